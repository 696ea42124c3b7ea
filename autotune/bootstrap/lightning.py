"""Lightning's ``Trainer``, reached without an edit to the script: Lightning itself asks the
``callbacks_factory`` entry points (``site/autotune_bootstrap-0.dist-info``) for callbacks when
a Trainer is built, and gets one that reports the steps (unless the script added autotune's
own) and reads back what the Trainer runs with. Precision and accumulation come through the
``PL_TRAINER_*`` defaults the trial's environment holds; a value the script passes to
``Trainer(...)`` explicitly wins, and the read-back reports the knob as not applied, with that
reason. The knobs a Lightning script sets in its own code (its DataLoader, optimizer and
model) are reported as out of the bootstrap's reach: the script's profile methods reach them.

In a trial the user's outputs are left alone, as with Hugging Face's Trainer (``hook_trainer``):
the Trainer's root directory is the trial's folder, its loggers write nothing, no checkpoint
is saved, a resume asked in code starts from the beginning, and ``validate``/``test`` return
at once. Under ``autotune launch`` all of it stays as the script sets it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

from autotune import steps
from autotune.bootstrap import TRAINER_OUTPUT, TRIAL, hooks, memory, readback
from autotune.config.knobs import Config
from autotune.config.values import KnobValue
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
    if mode == TRIAL:
        hook_trainer(package)
    base = callback_class(package)

    class Bootstrap(base):  # type: ignore[misc, valid-type]
        """Reports the steps (when the script has no autotune callback of its own) and reads
        back what the Trainer runs with, once, as training starts."""

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            from autotune.trial.apply import set_torch_flags

            if config.cpu_threads or config.matmul_precision != "highest" \
                    or config.malloc_retain:
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
    if config.sharded:
        unreachable["sharding"] = (
            f"sharding={config.sharding}: autotune does not set Lightning's FSDP strategy yet; "
            "the Trainer's ranks run its own strategy")
    found = readback.compare(config, _seen(trainer), unreachable,
                             f"Lightning Trainer ({package.split('.')[0]} {version})")
    found.isolated = list(_isolated)
    if mode == TRIAL:
        steps.readback(dict(found.to_doc()))
    elif trainer.global_rank == 0:
        for why in found.fixed.values():
            print(f"autotune: not applied: {why}", file=sys.stderr)
    return found


def _seen(trainer: Any) -> dict[str, KnobValue]:
    from autotune.trial.apply import torch_flags_in_force

    seen: dict[str, KnobValue] = {"amp": readback.amp_of(str(trainer.precision)),
                                  "grad_accum_steps": int(trainer.accumulate_grad_batches)}
    flags = torch_flags_in_force()
    seen["cpu_threads"], seen["matmul_precision"] = flags["threads"], flags["matmul_precision"]
    seen["malloc_retain"] = flags["malloc_retain"]
    return seen


# -- in a trial, the user's outputs left alone ----------------------------------------------------

# What a trial skips of what a script does with its Trainer besides fitting: evaluating (the
# trial has measured by then). Each returns what Lightning returns with nothing to evaluate.
SKIPPED: dict[str, object] = {"validate": [], "test": []}
# What trials turned off in this process's Trainers (Trainer arguments' names), for the
# read-back.
_isolated: list[str] = []


def hook_trainer(package: str) -> None:
    """Patch ``package``'s ``Trainer`` (and so its subclasses), once, for a trial: ``fit`` and
    ``predict`` run with the user's outputs left alone (``isolate``), ``fit`` from the start
    (``_fresh``); ``validate`` and ``test`` return at once; ``save_checkpoint`` writes only
    into the trial's folder. Lightning asks the entry point for callbacks as it builds the
    first Trainer, which has written nothing yet: its loggers make their folders, and its
    checkpoint callbacks their files, only once it runs."""
    cls = importlib.import_module(package).Trainer
    if getattr(cls.fit, "_autotune", False):
        return
    signature = inspect.signature(cls.fit)

    def fit(trainer: Any, args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
        isolate(trainer, package)
        return _fresh(trainer, signature, args, kwargs)

    def predict(trainer: Any, args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
        isolate(trainer, package)
        return args, kwargs

    cls.fit, cls.predict = _in_trials(cls.fit, fit), _in_trials(cls.predict, predict)
    cls.save_checkpoint = _only_into_the_trial(cls.save_checkpoint)
    for name, result in SKIPPED.items():
        setattr(cls, name, hooks.skipped_in_trials(getattr(cls, name), result))


# A Trainer method's positional and keyword arguments, passed through unread but for the few
# ``_fresh`` looks at by name.
Args = tuple[object, ...]
Kwargs = dict[str, object]
Before = Callable[[Any, Args, Kwargs], tuple[Args, Kwargs]]


def _in_trials(method: Any, before: Before) -> Any:
    """``method`` with ``before`` run on its trainer and arguments first, in a trial."""
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if hooks.mode() == TRIAL:
            args, kwargs = before(self, args, kwargs)
        return method(self, *args, **kwargs)

    wrapper._autotune = True  # type: ignore[attr-defined]
    return wrapper


def _only_into_the_trial(save: Any) -> Any:
    """``Trainer.save_checkpoint`` that, in a trial, writes only into the trial's folder: what
    Lightning saves there itself (the batch-size and learning-rate finders' checkpoints, under
    the root directory) is saved and read back; a checkpoint the script saves where it keeps
    its own is not written."""
    @functools.wraps(save)
    def save_checkpoint(self: Any, filepath: Any, *args: Any, **kwargs: Any) -> Any:
        if hooks.mode() == TRIAL and not _inside(filepath, _trial_folder()):
            return None
        return save(self, filepath, *args, **kwargs)

    return save_checkpoint


def _trial_folder() -> str:
    return os.path.join(os.environ[steps.TRIAL_DIR_ENV], TRAINER_OUTPUT)


def _inside(path: Any, folder: str) -> bool:
    """Whether ``path`` (a local path; a URL is not) is in ``folder``."""
    where = os.path.abspath(os.fspath(path))
    return where == folder or where.startswith(folder.rstrip(os.sep) + os.sep)


def _record(name: str) -> None:
    if name not in _isolated:
        _isolated.append(name)


def isolate(trainer: Any, package: str) -> None:
    """Point ``trainer``'s outputs away from the user's folder: its root directory (where
    Lightning's default logger, checkpoints and finders write) is the trial's folder; its
    loggers, the script's own too, are replaced by one that writes nothing
    (``_quiet_logger``); its checkpoint callbacks are removed, Lightning's default one too (the
    Trainer ``enable_checkpointing=False`` builds). Each change is recorded for the read-back."""
    folder = _trial_folder()
    if getattr(trainer, "_default_root_dir", folder) != folder:
        trainer._default_root_dir = folder  # no setter: Lightning keeps it there since 1.0
        _record("default_root_dir")
    quiet = _quiet_logger(package)
    if any(not isinstance(x, quiet) for x in trainer.loggers):
        trainer.loggers = [quiet(folder)]
        _record("logger")
    checkpoints = {id(c) for c in trainer.checkpoint_callbacks}
    if checkpoints:
        trainer.callbacks = [c for c in trainer.callbacks if id(c) not in checkpoints]
        _record("checkpoint_callbacks")


def _fresh(trainer: Any, signature: inspect.Signature, args: Args,
           kwargs: Kwargs) -> tuple[Args, Kwargs]:
    """``fit``'s arguments without the checkpoint it would resume from (``ckpt_path``, or
    ``trainer.ckpt_path`` set before): a trial measures the config from the first step, not
    the rest of the user's run (and never reads the user's checkpoint). Said once on stderr
    and in the read-back."""
    bound = signature.bind_partial(trainer, *args, **kwargs)
    asked = bound.arguments.get("ckpt_path") or getattr(trainer, "ckpt_path", None)
    if not asked:
        return args, kwargs
    if "ckpt_path" in bound.arguments:
        bound.arguments["ckpt_path"] = None
    if getattr(trainer, "ckpt_path", None):
        trainer.ckpt_path = None
    _record("ckpt_path")
    hooks.note_fresh_start(f"fit(ckpt_path={asked!r})")
    return bound.args[1:], bound.kwargs


@functools.cache
def _quiet_logger(package: str) -> type:
    """A logger for a trial's Trainer: Lightning's ``DummyLogger`` (what it puts in place of
    the loggers under ``fast_dev_run``: a script's ``self.logger.experiment.add_image(...)``
    runs and writes nothing), whose folder (``trainer.log_dir``) is the trial's."""
    base = importlib.import_module(f"{package}.loggers.logger").DummyLogger

    class TrialLogger(base):  # type: ignore[misc, valid-type]
        def __init__(self, folder: str) -> None:
            super().__init__()
            self.folder = folder

        @property
        def save_dir(self) -> str:
            return self.folder

        @property
        def log_dir(self) -> str:
            return self.folder

    return TrialLogger
