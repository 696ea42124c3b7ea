"""The bootstrap that reaches a training script nobody edited.

In the processes of a trial of ``autotune run -- CMD`` (mode ``trial``) and of ``autotune launch
PROFILE -- CMD`` (mode ``launch``), and only there, ``site/`` goes first on ``PYTHONPATH``: its
``sitecustomize.py`` runs before the script, chains any ``sitecustomize`` it shadows, imports
nothing heavy, and hooks the frameworks as the script imports them (``hooks``):

- Hugging Face ``Trainer`` (``hf``): the config set on ``TrainingArguments`` before their own
  validation, the steps reported;
- Lightning (``lightning``): precision and accumulation through the ``PL_TRAINER_*`` defaults
  (``trainer_env``), the steps reported by a callback found through Lightning's own
  ``callbacks_factory`` entry points (``site/*.dist-info/entry_points.txt``).

For both, in a trial, the user's outputs are left alone: what the Trainer would write (its
output or root directory, loggers, checkpoints) goes to the trial's ``TRAINER_OUTPUT`` folder
or nowhere, and a resume the script asks for, in its arguments or in code, trains from the
start. Under ``launch`` all of it stays as the script sets it.

Either way what is in effect is read back once the Trainer is built (``readback``), and a knob
whose value did not take is reported with the reason. Outside those processes (no
``AUTOTUNE_BOOTSTRAP`` in the environment), in loader and compile workers, nothing is hooked.
This package's top level is standard library only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

MODE_ENV = "AUTOTUNE_BOOTSTRAP"
TRIAL, LAUNCH = "trial", "launch"
MODES = (TRIAL, LAUNCH)
SITE = Path(__file__).parent / "site"
# Where a trial's Trainer writes what it would have written to the user's output directory
# (inside the trial's folder); removed when the trial ends: a model per trial fills a disk.
TRAINER_OUTPUT = "trainer-output"


def environment(mode: str, env: Mapping[str, str]) -> dict[str, str]:
    """What a process of ``mode`` gets on top of ``env``: the bootstrap's folder first on its
    ``PYTHONPATH``, then the folder autotune is imported from here (the process imports the
    same autotune), then whatever ``env`` has there; and the mode."""
    from autotune.paths import import_root

    if mode not in MODES:
        raise ValueError(f"bootstrap mode must be one of {MODES}, got {mode!r}")
    ours = [str(SITE), str(import_root())]
    theirs = [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x and x not in ours]
    return {"PYTHONPATH": os.pathsep.join([*ours, *theirs]), MODE_ENV: mode}


def trainer_env(amp: str, accumulation: int) -> dict[str, str]:
    """Lightning's ``Trainer`` defaults from the environment (``PL_TRAINER_<ARG>``): a value the
    script passes to ``Trainer(...)`` wins, which the read-back then reports."""
    from autotune.config.frameworks import lightning_precision  # here: the top stays stdlib

    return {"PL_TRAINER_PRECISION": lightning_precision(amp),
            "PL_TRAINER_ACCUMULATE_GRAD_BATCHES": str(accumulation)}
