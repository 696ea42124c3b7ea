"""Lightning's ``Trainer`` and a profile: the ``Trainer`` arguments a config sets
(``trainer_kwargs``, which ``Profile.lightning_trainer_kwargs`` returns for the profile's), and
a callback that makes the script tunable by ``autotune run -- CMD``: it reports each optimizer
step and stops ``fit`` when the tuner has measured enough.

    from autotune.integrations.lightning import AutotuneCallback

    trainer = pl.Trainer(..., callbacks=[AutotuneCallback()],
                         **profile.lightning_trainer_kwargs())

Outside a trial the callback does nothing: the script stays the production script. Works with
``lightning.pytorch`` and with the older ``pytorch_lightning``.
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypedDict

from autotune import steps
from autotune.config.frameworks import LightningPrecision, lightning_precision
from autotune.config.knobs import Config
from autotune.integrations import ProfileLike, config_and_device
from autotune.trial.apply import ddp_kwargs


def package() -> str:
    """The Lightning package a script's Trainer comes from: a Trainer accepts only its own
    package's callbacks and strategies. The older ``pytorch_lightning`` when the script
    imported it alone; else the current ``lightning.pytorch`` (when installed)."""
    if "pytorch_lightning" in sys.modules and "lightning.pytorch" not in sys.modules:
        return "pytorch_lightning"
    try:
        importlib.import_module("lightning.pytorch")
    except ImportError:
        return "pytorch_lightning"
    return "lightning.pytorch"


if TYPE_CHECKING or package() == "lightning.pytorch":
    from lightning.pytorch import Callback
else:
    from pytorch_lightning import Callback


class TrainerKwargs(TypedDict, total=False):
    """What ``trainer_kwargs`` sets; ``strategy`` and ``devices`` only with several ranks."""

    precision: LightningPrecision
    accumulate_grad_batches: int
    strategy: Any  # a DDPStrategy of the script's Lightning package (``package``)
    devices: int


def trainer_kwargs(config: Config | ProfileLike) -> TrainerKwargs:
    """Keyword arguments for a Lightning ``Trainer`` for ``config`` (a ``Profile`` in its place
    reads its own): ``precision``, ``accumulate_grad_batches`` and, with ranks, ``devices`` and
    a ``DDPStrategy`` carrying the DDP arguments (``trial.apply.ddp_kwargs``, as
    ``Profile.ddp_kwargs``). The model knobs are not the Trainer's: see
    ``Profile.lightning_trainer_kwargs``."""
    c, _ = config_and_device(config, None)
    kwargs: TrainerKwargs = {"precision": lightning_precision(c.amp),
                             "accumulate_grad_batches": c.grad_accum_steps}
    if c.world_size > 1:
        if package() == "lightning.pytorch":
            from lightning.pytorch.strategies import DDPStrategy
        else:
            from pytorch_lightning.strategies import DDPStrategy
        kwargs["strategy"] = DDPStrategy(**ddp_kwargs(c))
        kwargs["devices"] = c.world_size
    return kwargs


def batch_size(batch: Any) -> int | None:
    """Samples in a batch: the leading dimension of its first tensor (a dict's first tensor
    value, a list's or tuple's first tensor element, looked for depth first); None when it
    holds no tensor with a dimension."""
    shape = getattr(batch, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else None
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, list | tuple):
        for item in batch:
            found = batch_size(item)
            if found is not None:
                return found
    return None


class Reporting:
    """Reports every optimizer step (``autotune.step``) with this rank's samples (summed over
    the step's micro-batches) and the time it waited for them, and sets ``trainer.should_stop``
    once ``autotune.should_stop()``: ``AutotuneCallback``'s hooks, for the ``Callback`` class of
    either Lightning package (``callback_class``)."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.global_step = 0
        self.samples: int | None = 0  # None: a micro-batch of this step had no countable size
        self.data_s: float | None = 0.0  # None: a micro-batch's wait is unknown (the first)
        self.ready: float | None = None  # perf_counter when the previous micro-batch ended
        # The loss of the last micro-batch of the previous optimizer step: read one step late,
        # when the device has long computed it, so checking it costs the loop no wait.
        self.loss: Any = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.active = steps.in_trial()
        self.global_step = trainer.global_step
        self.samples, self.data_s, self.ready, self.loss = 0, 0.0, None, None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        if not self.active:
            return
        # Lightning fetched this batch (and moved it to the device) since the previous one ended.
        if self.ready is None or self.data_s is None:
            self.data_s = None
        else:
            self.data_s += time.perf_counter() - self.ready
        n = batch_size(batch)
        self.samples = None if n is None or self.samples is None else self.samples + n

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self.active:
            return
        # Fires per micro-batch; the optimizer stepped when the global step moved.
        if trainer.global_step != self.global_step:
            self.global_step = trainer.global_step
            steps.step(self.samples, self.data_s, loss=self.loss)
            loss: Any = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            self.loss = loss.detach() if hasattr(loss, "numel") and loss.numel() == 1 else None
            if steps.should_stop():
                trainer.should_stop = True
            self.samples, self.data_s = 0, 0.0
        self.ready = time.perf_counter()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        # Validation inside fit runs between two training batches: not a wait for data.
        if self.active and self.ready is not None:
            self.ready = time.perf_counter()


class AutotuneCallback(Reporting, Callback):
    """Reports every optimizer step (``autotune.step``) with this rank's samples (summed over
    the step's micro-batches) and the time it waited for them, and sets ``trainer.should_stop``
    once ``autotune.should_stop()``."""


_CLASSES: dict[str, type] = {}


def callback_class(lightning: str) -> type:
    """``AutotuneCallback`` for the Trainer of ``lightning`` (``lightning.pytorch`` or
    ``pytorch_lightning``): a Trainer takes only its own package's callbacks."""
    base = importlib.import_module(lightning).Callback
    if issubclass(AutotuneCallback, base):
        return AutotuneCallback
    if lightning not in _CLASSES:
        _CLASSES[lightning] = type("AutotuneCallback", (Reporting, base),
                                   {"__doc__": AutotuneCallback.__doc__})
    return _CLASSES[lightning]
