"""autotune's bootstrap: on PYTHONPATH only in the processes of a trial of ``autotune run --
CMD`` and of ``autotune launch``. It hooks the training frameworks as the script imports them
(``autotune.bootstrap.hooks``), in a process that may train, and then runs the
``sitecustomize`` it shadows, if there is one. Standard library only until a hooked framework
is imported."""

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


def _install() -> None:
    if not os.environ.get("AUTOTUNE_BOOTSTRAP") or not _may_train():
        return
    try:
        from autotune.bootstrap import hooks
    except ImportError as exc:  # this python cannot import autotune: the script runs as is
        print(f"autotune: the bootstrap cannot import autotune ({exc}); the script runs "
              "without it", file=sys.stderr)
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
