"""Lightning's ``Trainer``, reached without an edit to the script: Lightning itself asks the
``callbacks_factory`` entry points (``site/autotune_bootstrap-0.dist-info``) for callbacks when
a Trainer is built, and gets one that reports the steps (unless the script added autotune's
own) and reads back what the Trainer runs with. Precision and accumulation come through the
``PL_TRAINER_*`` defaults the trial's environment holds; a value the script passes to
``Trainer(...)`` explicitly wins, and the read-back reports the knob as not applied, with that
reason. The knobs a Lightning script sets in its own code (its DataLoader, optimizer and
model) are reported as out of the bootstrap's reach: the script's profile methods reach them.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

from autotune import steps
from autotune.bootstrap import TRIAL, hooks, memory, readback
from autotune.config.knobs import Config
from autotune.profile.load import read_quietly

# What only the script's own code sets in a Lightning run, with the profile method that does.
OWN_CODE = {
    "micro_batch_size": "its DataLoader's batch (profile.dataloader_kwargs())",
    "num_workers": "its DataLoader's workers (profile.dataloader_kwargs())",
    "pin_memory": "its DataLoader's pinning (profile.dataloader_kwargs())",
    "prefetch_factor": "its DataLoader's prefetching (profile.dataloader_kwargs())",
    "optimizer_impl": "its optimizer (profile.optimizer_kwargs() in configure_optimizers)",
    "compile": "its model's compiling (profile.compile_model())",
    "attention": "its model's attention (profile.prepare_model())",
    "activation_checkpointing": "its model's checkpointing (profile.prepare_model())",
    "ddp_bucket_cap_mb": "its DDP strategy (profile.lightning_trainer_kwargs())",
    "ddp_static_graph": "its DDP strategy (profile.lightning_trainer_kwargs())",
    "ddp_gradient_as_bucket_view": "its DDP strategy (profile.lightning_trainer_kwargs())",
}


@functools.cache
def _config() -> tuple[str, Config] | None:
    mode, path = hooks.mode(), os.environ.get("AUTOTUNE_PROFILE")
    if mode is None or not path:
        return None
    return mode, read_quietly(path).config


def callbacks() -> list[Any]:
    """Lightning's ``lightning.pytorch.callbacks_factory`` entry point."""
    return _callbacks("lightning.pytorch")


def callbacks_pl() -> list[Any]:
    """The older ``pytorch_lightning.callbacks_factory`` entry point."""
    return _callbacks("pytorch_lightning")


def _callbacks(package: str) -> list[Any]:
    found = _config()
    if found is None:
        return []
    from autotune.integrations.lightning import Reporting, callback_class

    mode, config = found
    base = callback_class(package)

    class Bootstrap(base):  # type: ignore[misc, valid-type]
        """Reports the steps (when the script has no autotune callback of its own) and reads
        back what the Trainer runs with, once, as training starts."""

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            from autotune.trial.apply import set_torch_flags

            if config.cpu_threads or config.matmul_precision != "highest":
                set_torch_flags(config)
            memory.cap_cuda_allocator(getattr(trainer.strategy, "root_device", None))

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            super().on_train_start(trainer, pl_module)
            own = [c for c in trainer.callbacks if isinstance(c, Reporting) and c is not self]
            if mode != TRIAL or own:
                self.active = False  # the script's own callback reports the steps
            report(trainer, config, mode, package)

    return [Bootstrap()]


def report(trainer: Any, config: Config, mode: str, package: str) -> readback.Readback:
    """Read back what the Trainer runs with; in a trial, record it for the tuner, else say it
    on stderr."""
    version = getattr(sys.modules.get(package.split(".")[0]), "__version__", "?")
    unreachable = {k: f"{k}: a Lightning script sets {v}" for k, v in OWN_CODE.items()}
    found = readback.compare(config, _seen(trainer), unreachable,
                             f"Lightning Trainer ({package.split('.')[0]} {version})")
    if mode == TRIAL:
        steps.readback(found.to_doc())
    elif trainer.global_rank == 0:
        for why in found.fixed.values():
            print(f"autotune: not applied: {why}", file=sys.stderr)
    return found


def _seen(trainer: Any) -> dict[str, Any]:
    from autotune.trial.apply import torch_flags_in_force

    seen: dict[str, Any] = {"amp": readback.amp_of(str(trainer.precision)),
                            "grad_accum_steps": int(trainer.accumulate_grad_batches)}
    flags = torch_flags_in_force()
    seen["cpu_threads"], seen["matmul_precision"] = flags["threads"], flags["matmul_precision"]
    return seen
