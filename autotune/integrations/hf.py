"""A Hugging Face ``Trainer`` callback that makes a training script tunable by ``autotune run
-- CMD``: it reports each optimizer step and stops training when the tuner has measured enough.

    from autotune.integrations.hf import AutotuneCallback

    trainer = Trainer(model=model, args=training_args, train_dataset=dataset,
                      callbacks=[AutotuneCallback()])

Outside a trial it does nothing: the script stays the production script.
"""

from __future__ import annotations

import math
import time
from typing import Any

from transformers import TrainerCallback

from autotune import steps


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
