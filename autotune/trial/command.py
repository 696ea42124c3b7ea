"""Trials of the user's own training script (``autotune run -- CMD``): the command as a study
knows it, checked once, and what its trial's environment adds.

The script runs unchanged, with ``AUTOTUNE_PROFILE`` naming the candidate config as a profile
and ``AUTOTUNE_TRIAL_DIR`` the trial's folder, where each of its processes appends a line per
optimizer step (``autotune.steps``); ``trial.driver`` measures the trial from those lines.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import UsageError
from autotune.steps import SAMPLES_ENV, STOP_FILE, TRIAL_DIR_ENV

# Launchers whose ranks are the script's processes: torchrun, or python -m torch.distributed.run.
_TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")


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
    launcher = base == "torchrun"
    if base.startswith("python") and rest[:1] == ["-m"] and rest[1:2] and \
            rest[1] in _TORCHRUN_MODULES:
        launcher, rest = True, rest[2:]
    nproc = _torchrun_nproc(rest) if launcher else 1
    script = next((a for a in (rest if launcher or base.startswith("python") else [program])
                   if a.endswith(".py") and Path(a).is_file()), None)
    if script is None and base.startswith("python") and rest and rest[0].endswith(".py"):
        raise UsageError(f"script {rest[0]!r} not found: check the path after python")
    digest = hashlib.sha256(Path(script).read_bytes()).hexdigest() if script else None
    return Command(argv, os.path.basename(script) if script else base, script, digest, nproc,
                   launcher)


def _torchrun_nproc(args: list[str]) -> int:
    """Ranks a torchrun command starts on this node; refuses what a trial cannot be."""
    values: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            break  # the script and its own arguments
        key, eq, value = arg[2:].partition("=")
        key = key.replace("_", "-")
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("--") and \
                key not in ("standalone", "no-python", "run-path"):
            value, i = args[i + 1], i + 1
        values[key] = value
        i += 1
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
    """Remove an earlier run's step files and stop request (a retried trial's folder)."""
    for path in (*folder.glob("steps.rank*.jsonl"), folder / STOP_FILE):
        path.unlink(missing_ok=True)
