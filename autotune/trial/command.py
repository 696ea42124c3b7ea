"""Trials of the user's own training script (``autotune run -- CMD``): the command as a study
knows it, checked once, and what its trial's environment adds.

The script runs as typed, with ``AUTOTUNE_PROFILE`` naming the candidate config as a profile
and ``AUTOTUNE_TRIAL_DIR`` the trial's folder, where each of its processes appends a line per
optimizer step (``autotune.steps``); ``trial.driver`` measures the trial from those lines.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import UsageError
from autotune.steps import SAMPLES_ENV, STOP_FILE, TRIAL_DIR_ENV

# Launchers whose ranks are the script's processes: torchrun, or python -m torch.distributed.run.
_TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")
# The bootstrap's folder of marks in a trial's (``trial.reach``, ``site/sitecustomize.py``).
REACHED = "reached"
# Python's options that keep autotune's bootstrap (a sitecustomize on PYTHONPATH) out.
SKIPPED_BY = {"-I": "isolated mode ignores PYTHONPATH and sitecustomize",
              "-E": "it ignores PYTHONPATH", "-S": "it imports no site, so no sitecustomize"}


@dataclass(frozen=True)
class Command:
    """The user's command as a study knows it: the argv, the script it runs (when one is a
    file), the script's hash, and the ranks its launcher starts."""

    argv: tuple[str, ...]
    name: str  # what messages call it: the script's file name, else the program's
    script: str | None = None
    script_sha256: str | None = None
    nproc: int = 1
    # Whether the command is torchrun (its --nproc-per-node sets the ranks). Otherwise a
    # script that starts its ranks itself (Lightning, mp.spawn) takes them from --nproc,
    # through the profile (``lightning_trainer_kwargs``'s devices).
    launcher: bool = False
    # What identifies the study less than the script would (a wrapper's file, or none), said
    # when the run starts; None when the script itself is tracked.
    untracked: str | None = None

    def to_params(self, batch: int) -> dict[str, Any]:
        """The study's workload params: what makes two commands' trials comparable."""
        return {"command": list(self.argv), "script": self.script,
                "script_sha256": self.script_sha256, "batch": batch}


def parse_command(argv: list[str] | tuple[str, ...]) -> Command:
    """The command, checked: its program exists, its torchrun options (ranks on one node) are
    ones autotune can run. One-line errors name the rule, the value and the fix."""
    argv = tuple(argv)
    if not argv:
        raise UsageError("no command after --: e.g. autotune run -- python train.py")
    program = argv[0]
    if shutil.which(program) is None and not (os.sep in program and Path(program).is_file()):
        raise UsageError(f"command {program!r} not found (not on PATH, not a file): check the "
                         "command after --, e.g. autotune run -- python train.py")
    base = os.path.basename(program)
    rest = list(argv[1:])
    if (shown := shown_flag(argv)) is not None:
        python, flag = shown
        raise UsageError(f"{python} {flag}: {SKIPPED_BY[flag]}, so autotune's bootstrap never "
                         "runs in the trial (it could not keep a Trainer off your outputs, "
                         f"checkpoints and trackers); run it without {flag}")
    launcher = base == "torchrun"
    if base.startswith("python") and rest[:1] == ["-m"] and rest[1:2] and \
            rest[1] in _TORCHRUN_MODULES:
        launcher, rest = True, rest[2:]
    nproc = 1
    if launcher:
        options, at = _torchrun_options(rest)
        nproc = _torchrun_nproc(options)
        if "module" in options:  # torchrun --module pkg.train
            rest = ["-m", *rest[at:]]
    module = _module(rest) if launcher or base.startswith("python") else None
    untracked: str | None = None
    if module is not None:  # python -m pkg.train: the file it runs is the script
        script = module_file(module)
        if script is None:
            raise UsageError(f"module {module!r} not found (from {os.getcwd()} and the Python "
                             "path): check the name after -m")
    elif launcher or base.startswith("python"):
        script = next((a for a in rest if a.endswith(".py") and Path(a).is_file()), None)
        if script is None and base.startswith("python") and rest and rest[0].endswith(".py"):
            raise UsageError(f"script {rest[0]!r} not found: check the path after python")
    else:
        script, untracked = _behind(program, base, rest)
    name = module if module is not None else os.path.basename(script) if script else base
    digest = hashlib.sha256(Path(script).read_bytes()).hexdigest() if script else None
    return Command(argv, name, script, digest, nproc, launcher, untracked)


_SHELLS = ("sh", "bash", "dash", "zsh", "ksh")
# A Python interpreter's file name (python, python3.11, pypy3), not a word that starts so.
INTERPRETER = re.compile(r"(python|pypy)[0-9.]*[a-z]?")


def _behind(program: str, base: str, rest: list[str]) -> tuple[str | None, str | None]:
    """The file that identifies a command whose program is not Python (a shell, ``env``,
    ``accelerate launch``, a wrapper script), and a line saying what is not tracked then: the
    ``.py`` file it names (in a shell's ``-c`` code too), else the wrapper file itself."""
    def python_file(args: list[str]) -> str | None:
        return next((a for a in args if a.endswith(".py") and Path(a).is_file()), None)

    if program.endswith(".py") and Path(program).is_file():
        return program, None
    code = shell_code([program, *rest])
    if code is not None:
        try:
            words = shlex.split(code)
        except ValueError:
            words = []
        if (script := python_file(words)) is not None:
            return script, None
        return None, (f"{base} -c runs code that names no .py file: no file identifies the "
                      "study, only the command line; an edit to what it runs neither starts a "
                      "new study nor is refused by `autotune profile check`")
    if (script := python_file(rest)) is not None:
        return script, None
    wrapper = next((a for a in rest if not a.startswith("-") and Path(a).is_file()), None) \
        if base in _SHELLS else program if os.sep in program else None
    if wrapper is None:
        return None, (f"{base} names no script file: no file identifies the study, only the "
                      "command line; an edit to what it runs neither starts a new study nor "
                      "is refused by `autotune profile check`")
    return wrapper, (f"{os.path.basename(wrapper)} is tracked (its sha256), not the Python "
                     "script it runs: an edit to that script neither starts a new study nor "
                     "is refused by `autotune profile check`")


def shell_code(argv: list[str] | tuple[str, ...]) -> str | None:
    """The code of a shell's ``-c`` (``bash -c CODE``, ``bash -lc CODE``, ``sh -ec CODE``);
    None when the command is no shell running code."""
    if os.path.basename(argv[0]) not in _SHELLS:
        return None
    for i, arg in enumerate(argv[1:], start=1):
        if not arg.startswith("-") or arg == "-":
            return None  # a script file: the shell runs that
        if not arg.startswith("--") and "c" in arg[1:]:
            return argv[i + 1] if i + 1 < len(argv) else None
    return None


def shown_flag(argv: list[str] | tuple[str, ...]) -> tuple[str, str] | None:
    """The first Python of the command (the program, the one a wrapper such as ``env`` runs,
    or the first in a shell's ``-c`` code) with an option that keeps the bootstrap out: (its
    name, the option), or None. Later words are its script's arguments, not a Python's."""
    words = list(argv)
    if (code := shell_code(argv)) is not None:
        with contextlib.suppress(ValueError):
            words = shlex.split(code)
    for i, word in enumerate(words):
        if INTERPRETER.fullmatch(os.path.basename(word)):
            flag = skipping_flag(words[i + 1:])
            return (os.path.basename(word), flag) if flag is not None else None
    return None


def skipping_flag(args: list[str] | tuple[str, ...]) -> str | None:
    """The option of a Python command line (the arguments after the interpreter) that keeps
    the bootstrap out: ``-I`` (isolated), ``-E`` (ignores PYTHONPATH) or ``-S`` (no
    ``site``, so no ``sitecustomize``); None when it has none before its script."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--check-hash-based-pycs":
            i += 2
            continue
        if not arg.startswith("-") or arg == "-" or arg.startswith("--"):
            return None  # the script, stdin, or a long option that takes no value
        for j, letter in enumerate(arg[1:]):
            if letter in "IES":
                return f"-{letter}"
            if letter in "cm":
                return None  # -c CODE, -m MODULE: the options end
            if letter in "WX":
                i += j == len(arg) - 2  # -W VALUE (its value is the next argument)
                break
        i += 1
    return None


def _module(args: list[str]) -> str | None:
    """The module of ``-m MODULE`` (python's, or torchrun's ``-m`` before its script) where
    the arguments run one; None otherwise."""
    for i, arg in enumerate(args):
        if arg == "-m" and i + 1 < len(args):
            return args[i + 1]
        if arg == "-c" or not arg.startswith("-"):
            return None  # python -c CODE, or the script and its own arguments
    return None


def module_file(module: str) -> str | None:
    """The file ``python -m MODULE`` runs from this directory (a package's ``__main__.py``),
    found without importing anything: importing a package runs its code."""
    from importlib.machinery import PathFinder

    paths = [os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep), *sys.path]
    spec = None
    parts = module.split(".")
    for i in range(len(parts)):
        spec = PathFinder.find_spec(".".join(parts[:i + 1]), [p for p in paths if p])
        if spec is None:
            return None
        paths = list(spec.submodule_search_locations or [])
    if spec is None:
        return None
    if spec.submodule_search_locations:  # a package: -m runs its __main__
        main = PathFinder.find_spec(f"{module}.__main__", list(spec.submodule_search_locations))
        return main.origin if main is not None and main.has_location else None
    return spec.origin if spec.has_location else None


def _torchrun_options(args: list[str]) -> tuple[dict[str, str], int]:
    """torchrun's own options (``--key value`` or ``--key=value``; ``-m`` is ``--module``)
    and where its script's part of the command starts."""
    values: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-m":
            arg = "--module"
        if not arg.startswith("--"):
            break  # the script and its own arguments
        key, eq, value = arg[2:].partition("=")
        key = key.replace("_", "-")
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("-") and \
                key not in ("standalone", "no-python", "run-path", "module"):
            value, i = args[i + 1], i + 1
        values[key] = value
        i += 1
    return values, i


def _torchrun_nproc(values: dict[str, str]) -> int:
    """Ranks a torchrun command starts on this node; refuses what a trial cannot be."""
    nnodes = values.get("nnodes", "1")
    if nnodes not in ("1", "1:1"):
        raise UsageError(f"torchrun --nnodes {nnodes}: a script's trials run on this machine "
                         "only; tune with --nnodes 1 (one node's ranks)")
    raw = values.get("nproc-per-node", "1")
    if not raw.isdigit() or int(raw) < 1:
        raise UsageError(f"torchrun --nproc-per-node {raw!r}: autotune needs the rank count "
                         "as a number to compare trials; pass e.g. --nproc-per-node 2")
    return int(raw)


def command_env(folder: Path, profile_path: Path, samples_per_rank_step: int) -> dict[str, str]:
    """What a script's trial gets on top of the usual trial environment."""
    return {"AUTOTUNE_PROFILE": str(profile_path), TRIAL_DIR_ENV: str(folder),
            SAMPLES_ENV: str(samples_per_rank_step)}


def clear(folder: Path) -> None:
    """Remove an earlier run's step files, stop request and the bootstrap's marks (a retried
    trial's folder)."""
    for path in (*folder.glob("steps.rank*.jsonl"), folder / STOP_FILE):
        path.unlink(missing_ok=True)
    shutil.rmtree(folder / REACHED, ignore_errors=True)
