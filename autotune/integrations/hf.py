"""Hugging Face's ``Trainer`` and a profile: the ``TrainingArguments`` a profile sets
(``training_args``, which ``Profile.hf_training_args`` returns), and a callback that makes the
script tunable by ``autotune run -- CMD``: it reports each optimizer step and stops training when
the tuner has measured enough.

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
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback, TrainingArguments

from autotune import steps

if TYPE_CHECKING:
    from autotune.profile import Profile


def training_args(profile: Profile) -> dict[str, Any]:
    """Keyword arguments for ``transformers.TrainingArguments``: per-device batch,
    accumulation, precision, the DataLoader's workers/pinning/prefetch, ``use_cpu`` for a
    profile tuned on a CPU and, with ranks, the DDP bucket size and static graph; compiling,
    TF32 and activation checkpointing as the trials ran them; ``optim`` only where AdamW needs
    another name than TrainingArguments' default to step as the profile's ``optimizer_impl``
    (``optim_name``). (TrainingArguments has no gradient-view option.) Keys vary with the
    transformers version: a dict, not a fixed type."""
    c = profile.config
    kwargs: dict[str, Any] = {
        "per_device_train_batch_size": c.micro_batch_size,
        "gradient_accumulation_steps": c.grad_accum_steps,
        "bf16": c.amp == "bf16", "fp16": c.amp == "fp16",
        "dataloader_num_workers": c.num_workers,
        # TrainingArguments pins by default; the profile says whether pinning paid.
        "dataloader_pin_memory": c.pin_memory,
    }
    if c.num_workers > 0:
        kwargs["dataloader_prefetch_factor"] = c.prefetch_factor or 2
        kwargs["dataloader_persistent_workers"] = True
    if profile.fingerprint.get("device") == "cpu":
        kwargs["use_cpu"] = True  # what was measured; also how HF allows bf16 on a CPU
    if c.world_size > 1:
        kwargs["ddp_bucket_cap_mb"] = c.ddp_bucket_cap_mb
        if c.ddp_static_graph:
            kwargs["ddp_static_graph"] = True
    if c.compile != "off":
        kwargs["torch_compile"] = True
        if c.compile != "default":
            kwargs["torch_compile_mode"] = c.compile
    if c.matmul_precision == "high":
        kwargs["tf32"] = True
    # No optim where TrainingArguments' default already steps as tuned, or where the profile
    # kept the optimizer's own implementation: the Trainer's own default (adamw_torch_fused
    # with torch 2.8 or newer) and a script's own optim= stand.
    optim = optim_name(profile)
    if optim is not None and optim != field_defaults().get("optim"):
        kwargs["optim"] = optim
    if c.activation_checkpointing:
        name = _checkpointing_name()
        kwargs[name] = True
        kwargs[f"{name}_kwargs"] = {"use_reentrant": False}
    return kwargs


def optim_name(profile: Profile) -> str | None:
    """The TrainingArguments ``optim`` that steps AdamW as the profile's ``optimizer_impl``;
    None where the profile keeps the optimizer's own implementation, or where no name reaches
    it on the profile's device. (torch's AdamW given neither ``foreach`` nor ``fused``, which
    ``adamw_torch`` builds, steps foreach on a GPU and the for-loop on a CPU.)"""
    impl = profile.config.optimizer_impl
    if impl == "fused":
        return "adamw_torch_fused"
    torch_picks = "for-loop" if profile.fingerprint.get("device") == "cpu" else "foreach"
    return "adamw_torch" if impl == torch_picks else None


@functools.cache
def field_defaults() -> dict[str, Any]:
    """The installed TrainingArguments' own default of each field that has one (``optim``'s
    depends on the torch version)."""
    return {f.name: f.default for f in dataclasses.fields(TrainingArguments)
            if f.default is not dataclasses.MISSING}


def _checkpointing_name() -> str:
    """TrainingArguments' name for activation checkpointing: transformers 5.x renamed
    ``gradient_checkpointing`` to ``activation_checkpointing``."""
    params = inspect.signature(TrainingArguments.__init__).parameters
    return "activation_checkpointing" if "activation_checkpointing" in params \
        else "gradient_checkpointing"


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
