"""autotune's bootstrap: on PYTHONPATH only in the processes of a trial of ``autotune run --
CMD`` and of ``autotune launch``. It hooks the training frameworks as the script imports them
(``autotune.bootstrap.hooks``), in a process that may train, and then runs the
``sitecustomize`` it shadows, if there is one. Standard library only until a hooked framework
is imported.

In a trial, each Python process it reaches says so first (``_mark``): a file named for its pid
in the trial's ``reached/`` folder, ``ok`` (hooked), ``worker`` (a process that never trains:
nothing hooked) or why it could not hook. A forked child (no interpreter start) is marked by
the fork itself. The tuner ends a trial in which a Python process runs without a mark
(``python -I``, a cleared environment, another Python): unhooked, it would train with the
user's outputs, checkpoints and trackers."""

import os
import sys


def _may_train() -> bool:
    """False for the processes a run starts that never train: multiprocessing's workers and
    its resource tracker (DataLoader workers under spawn or forkserver) and torch.compile's
    compile workers. Forked workers never run this file."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if "--multiprocessing-fork" in argv:
        return False
    if len(argv) > 2 and argv[1] == "-c" and "multiprocessing" in argv[2]:
        return False
    return not any("compile_worker" in a for a in argv)


# The folder of a trial's marks, in the trial's folder: ``autotune.trial.command.REACHED``
# (this file imports nothing of autotune's before it marks; tests/test_reach checks the two).
REACHED = "reached"


def _mark(status: str) -> None:
    """Say that the bootstrap reached this process of a trial: ``ok``, ``worker``, or why it
    could not hook it."""
    folder = os.environ.get("AUTOTUNE_TRIAL_DIR")
    if os.environ.get("AUTOTUNE_BOOTSTRAP") != "trial" or not folder:
        return
    path = os.path.join(folder, REACHED, str(os.getpid()))
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.write(status[:300])
        os.replace(path + ".tmp", path)  # whole: the tuner never reads half a mark
    except OSError:
        pass  # the trial's folder is gone: the tuner ends the trial on that


def _reached(status: str) -> None:
    """Mark this process, and every child it forks (loader workers, a compile worker's pool):
    a fork is no interpreter start, so this file does not run in it."""
    _mark(status)
    os.register_at_fork(after_in_child=lambda: _mark(status))


def _install() -> None:
    if not os.environ.get("AUTOTUNE_BOOTSTRAP"):
        return
    if not _may_train():
        _reached("worker")  # reached; it never trains, so nothing is hooked
        return
    # Marked before autotune's import (a tenth of a second, more from a cold disk): the tuner
    # gives an unmarked Python process only a moment. A failed import replaces the mark.
    _reached("ok")
    try:
        from autotune.bootstrap import hooks
    except ImportError as exc:  # this python cannot import autotune: the script runs as is
        print(f"autotune: the bootstrap cannot import autotune ({exc}); the script runs "
              "without it", file=sys.stderr)
        _mark(f"{sys.executable} cannot import autotune ({exc})")
        return
    hooks.install()


def _chain() -> None:
    """Import the next ``sitecustomize`` on sys.path (the one this file shadows)."""
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.pop("sitecustomize", None)
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        import sitecustomize  # noqa: F401  (the next one on the path)
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours
    finally:
        sys.path[:] = saved


try:
    _install()
finally:
    _chain()
