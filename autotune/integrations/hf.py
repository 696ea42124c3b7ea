"""Hugging Face's ``Trainer`` and a profile: the ``TrainingArguments`` a config sets
(``training_args``, which ``Profile.hf_training_args`` returns for the profile's), and a callback
that makes the script tunable by ``autotune run -- CMD``: it reports each optimizer step and
stops training when the tuner has measured enough.

    from autotune.integrations.hf import AutotuneCallback

    args = TrainingArguments(output_dir="out", **profile.hf_training_args())
    trainer = Trainer(model=model, args=args, train_dataset=dataset,
                      callbacks=[AutotuneCallback()])

Outside a trial the callback does nothing: the script stays the production script.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import time
from typing import Any

from transformers import TrainerCallback, TrainingArguments

from autotune import steps
from autotune.config.frameworks import HF_FIELDS, hf_optim
from autotune.config.knobs import Config
from autotune.integrations import ProfileLike, config_and_device


def training_args(config: Config | ProfileLike, device: str | None = None) -> dict[str, Any]:
    """Keyword arguments for ``transformers.TrainingArguments`` for ``config`` measured on
    ``device`` (a ``Profile`` in place of both reads its own): per-device batch, accumulation,
    precision, the DataLoader's workers/pinning/prefetch, ``use_cpu`` for a config measured on
    a CPU and, with ranks, the DDP bucket size and static graph; compiling, TF32 and activation
    checkpointing as the trials ran them; ``optim`` only where AdamW needs another name than
    TrainingArguments' default to step as ``optimizer_impl`` (``optim_name``).
    (TrainingArguments has no gradient-view option.) The fields are ``config.frameworks``'
    table's; their names and TrainingArguments' defaults are the installed transformers': a
    dict of its keyword arguments (``Any``: each field has its own type), not a fixed type."""
    config, device = config_and_device(config, device)
    fields = _init_fields()
    # No optim where TrainingArguments' default already steps as tuned, or where the config
    # keeps the optimizer's own implementation: the Trainer's own default (adamw_torch_fused
    # with torch 2.8 or newer) and a script's own optim= stand.
    default_optim = field_defaults().get("optim")
    values = ((f, f.value(config, device)) for f in HF_FIELDS)
    # A field transformers 5 renamed (gradient_checkpointing: activation_checkpointing) goes
    # by the name the installed TrainingArguments takes.
    return {f.name if f.older is None or f.name in fields else f.older: value
            for f, value in values
            if value is not None and not (f.name == "optim" and value == default_optim)}


def optim_name(config: Config | ProfileLike, device: str | None = None) -> str | None:
    """The TrainingArguments ``optim`` that steps AdamW as ``config.optimizer_impl`` on
    ``device`` (a ``Profile`` in place of both reads its own); None where the config keeps the
    optimizer's own implementation, or where no name reaches it there
    (``config.frameworks.hf_optim``)."""
    return hf_optim(*config_and_device(config, device))


@functools.cache
def field_defaults() -> dict[str, object]:
    """The installed TrainingArguments' own default of each field that has one (``optim``'s
    depends on the torch version)."""
    return {f.name: f.default for f in dataclasses.fields(TrainingArguments)
            if f.default is not dataclasses.MISSING}


@functools.cache
def _init_fields() -> frozenset[str]:
    """The keyword arguments the installed ``TrainingArguments`` takes."""
    return frozenset(inspect.signature(TrainingArguments.__init__).parameters)


class AutotuneCallback(TrainerCallback):
    """Reports every optimizer step (``autotune.step``) with this rank's samples and the time it
    waited for its batches, and sets ``should_training_stop`` once ``autotune.should_stop()``."""

    def __init__(self) -> None:
        self.active = False
        self.micro_batch = 0
        self.substeps = 0  # micro-batches of the current step before its last one
        self.begun: float | None = None  # perf_counter at this step's on_step_begin
        self.ready: float | None = None  # when the previous step's own work ended

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.active = steps.in_trial()
        self.micro_batch = args.per_device_train_batch_size
        self.substeps, self.begun, self.ready = 0, None, None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.active:
            # The Trainer fetches all of a step's micro-batches before this hook: the time since
            # the previous step ended is the wait for data.
            self.begun = time.perf_counter()

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.active:
            self.substeps += 1

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.active:
            return
        # Counted, not args.gradient_accumulation_steps: an epoch's last step may have fewer.
        samples = self.micro_batch * (self.substeps + 1)
        data_s = None
        if self.begun is not None and self.ready is not None and self.begun >= self.ready:
            data_s = self.begun - self.ready
        steps.step(samples, data_s)
        if steps.should_stop():
            control.should_training_stop = True
        self.substeps, self.begun = 0, None
        self.ready = time.perf_counter()

    def _after_own_work(self) -> None:
        # Logging (which waits for the device to read the loss), evaluation and checkpoints run
        # between on_step_end and the next fetch: not time spent waiting for data.
        if self.active and self.ready is not None:
            self.ready = time.perf_counter()

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
               **kwargs: Any) -> None:
        # The Trainer logs the loss and the gradient norm every logging_steps; a NaN or
        # infinite one ends the trial as diverged (its default logging_nan_inf_filter hides a
        # NaN loss, not the gradient norm).
        if self.active and isinstance(logs, dict) and not all(
                math.isfinite(v) for k, v in logs.items()
                if k in ("loss", "grad_norm") and isinstance(v, int | float)):
            steps.diverged()
        self._after_own_work()

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._after_own_work()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._after_own_work()
