"""Hugging Face's ``Trainer``, reached without an edit to the script.

- ``TrainingArguments.__post_init__`` first takes the config (``integrations.hf.training_args``,
  for the fields the installed transformers has; ``config.frameworks`` names each one's knob),
  so it wins over command-line flags, a JSON file and arguments built in code alike, and the
  arguments' own validation then sees it. In a trial the user's outputs are left alone: the
  output directory is the trial's folder, nothing is saved, pushed, reported to a tracker,
  evaluated or resumed, and training runs until autotune has measured (``ISOLATION``;
  ``Trainer.train`` drops a resume asked in code).
- ``Trainer.__init__`` sets the model's attention implementation and the process's threads
  before the Trainer takes the model, then adds the step-reporting callback (unless the script
  added one) and one that reads back, at the start of training, what the Trainer runs with.
- ``Trainer.create_optimizer`` rebuilds the optimizer the Trainer made with the tuned step
  implementation (an optimizer the script passes in is its own: reported, not replaced).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from types import ModuleType
from typing import Any

from autotune import steps
from autotune.bootstrap import TRAINER_OUTPUT, TRIAL, hooks, memory, readback
from autotune.config.frameworks import HF_FIELD_KNOB, hf_unreached
from autotune.config.knobs import Config
from autotune.config.values import KnobValue
from autotune.integrations import config_and_device
from autotune.profile.load import read_quietly

# What a trial turns off in the Trainer's arguments, with the value it gets: nothing lands in
# the user's output directory, on a hub or in a tracker, nothing is evaluated or resumed, and
# training runs until autotune has measured. (``output_dir`` is the trial's folder.)
ISOLATION: dict[str, object] = {
    "save_strategy": "no", "eval_strategy": "no", "evaluation_strategy": "no",  # (4.40 and older)
    "do_eval": False, "eval_on_start": False,
    "load_best_model_at_end": False, "push_to_hub": False, "hub_token": None,
    "hub_model_id": None, "report_to": "none", "resume_from_checkpoint": None,
    "enable_jit_checkpoint": False, "auto_find_batch_size": False, "max_steps": 10**9,
}


@dataclasses.dataclass
class _State:
    """This process's candidate config and what was done with it."""

    mode: str
    config: Config
    device: str | None  # the one the config was measured on
    unreachable: dict[str, str] = dataclasses.field(default_factory=dict)
    script: dict[str, KnobValue] = dataclasses.field(default_factory=dict)
    isolated: list[str] = dataclasses.field(default_factory=list)
    reported: bool = False


@functools.cache
def _state() -> _State | None:
    mode, path = hooks.mode(), os.environ.get("AUTOTUNE_PROFILE")
    if mode is None or not path:
        return None
    return _State(mode, *config_and_device(read_quietly(path), None))


def on_training_args(module: ModuleType) -> None:
    """Patch ``TrainingArguments`` (and so its subclasses) to take the config first."""
    cls = module.TrainingArguments
    original = cls.__post_init__
    if getattr(original, "_autotune", False):
        return

    @functools.wraps(original)
    def __post_init__(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = _state()
        if state is not None:
            _configure(self, state)
        return original(self, *args, **kwargs)

    __post_init__._autotune = True  # type: ignore[attr-defined]
    cls.__post_init__ = __post_init__


def _configure(args: Any, state: _State) -> None:
    from autotune.integrations.hf import training_args

    fields = {f.name for f in dataclasses.fields(args)}
    wanted = training_args(state.config, state.device)
    # The optimizer's class stays the script's (``optim``): its step implementation is set
    # when the Trainer builds it (``create_optimizer``).
    wanted.pop("optim", None)
    if not state.script:
        state.script = _asked(args, fields)
    for name, value in wanted.items():
        if name in fields:
            setattr(args, name, value)
        elif (knob := HF_FIELD_KNOB.get(name)) is not None:
            state.unreachable[knob] = (f"{knob}: this transformers' TrainingArguments has no "
                                       f"{name} field")
    state.unreachable.update(hf_unreached(state.config, state.device))
    if state.mode == TRIAL:
        _isolate(args, fields, state)


def _isolate(args: Any, fields: set[str], state: _State) -> None:
    folder = os.path.join(os.environ[steps.TRIAL_DIR_ENV], TRAINER_OUTPUT)
    changes = {"output_dir": folder, **ISOLATION}
    for name, value in changes.items():
        if name in fields and getattr(args, name) != value:
            setattr(args, name, value)
            if name not in state.isolated:
                state.isolated.append(name)


def _asked(args: Any, fields: set[str]) -> dict[str, KnobValue]:
    """What the script asked for itself, in the config's terms, before the config is set."""
    def get(name: str) -> Any:
        return getattr(args, name) if name in fields else None

    compiled = "off" if not get("torch_compile") else str(get("torch_compile_mode") or "default")
    asked = {"micro_batch_size": get("per_device_train_batch_size"),
             "grad_accum_steps": get("gradient_accumulation_steps"),
             "amp": "bf16" if get("bf16") else "fp16" if get("fp16") else "off",
             "num_workers": get("dataloader_num_workers"), "compile": compiled}
    return {k: v for k, v in asked.items() if v is None or isinstance(v, int | str)}


def on_trainer(module: ModuleType) -> None:
    """Patch ``Trainer`` (and so its subclasses): the model's knobs before it is taken, the
    callbacks after, and the optimizer it builds; in a trial, ``train`` from the start and
    what follows training skipped (``SKIPPED``)."""
    cls = module.Trainer
    if getattr(cls.__init__, "_autotune", False):
        return
    init, create = cls.__init__, cls.create_optimizer

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        state = _state()
        if state is not None:
            _prepare_model(kwargs.get("model", args[0] if args else None), state)
        init(self, *args, **kwargs)
        if state is not None:
            _attach(self, state)

    @functools.wraps(create)
    def create_optimizer(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = _state()
        built_here = self.optimizer is None
        optimizer = create(self, *args, **kwargs)
        if state is None or state.config.optimizer_impl == "default":
            return optimizer
        if not built_here:
            state.unreachable["optimizer_impl"] = (
                "optimizer_impl: the script passes its own optimizer to Trainer(optimizers=...)")
            return optimizer
        from autotune.trial.apply import rebuild_optimizer

        try:
            self.optimizer = rebuild_optimizer(optimizer, state.config)
        except ValueError as exc:
            state.unreachable["optimizer_impl"] = str(exc)
        return self.optimizer

    __init__._autotune = True  # type: ignore[attr-defined]
    cls.__init__, cls.create_optimizer = __init__, create_optimizer
    cls.train = _fresh_in_trials(cls.train)
    for name, result in SKIPPED.items():
        setattr(cls, name, hooks.skipped_in_trials(getattr(cls, name), result))


def _fresh_in_trials(train: Any) -> Any:
    """``Trainer.train`` that trains from the start in a trial, where the script asks in
    code to resume (``train(resume_from_checkpoint=True)`` or a path): a trial would read the
    user's checkpoint and measure the tail of another run, or find none in its own output
    directory and fail. Said once on stderr and in the read-back; as written elsewhere."""
    @functools.wraps(train)
    def fresh(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = _state()
        asked = args[0] if args else kwargs.get("resume_from_checkpoint")
        if state is None or state.mode != TRIAL or asked is None or asked is False:
            return train(self, *args, **kwargs)
        if args:
            args = (None, *args[1:])
        else:
            kwargs["resume_from_checkpoint"] = None
        if "resume_from_checkpoint" not in state.isolated:
            state.isolated.append("resume_from_checkpoint")
        hooks.note_fresh_start(f"train(resume_from_checkpoint={asked!r})")
        return train(self, *args, **kwargs)

    return fresh


# What a script does with its Trainer after training that a trial skips (its windows are
# measured by then): saving the model and state, evaluating, pushing. Each returns what it
# would (``evaluate`` its metrics: none), so the script goes on to its end.
SKIPPED: dict[str, object] = {"save_model": None, "save_state": None, "evaluate": {},
                              "push_to_hub": None}


def _prepare_model(model: Any, state: _State) -> None:
    """The attention implementation (set on the model the Trainer receives, before its first
    step, by the same ``prepare_model`` trials and scripts use; checkpointing is the
    Trainer's own argument) and the process's intra-op threads."""
    from autotune.trial.apply import prepare_model, set_torch_flags

    config = state.config
    if config.cpu_threads or config.malloc_retain:
        set_torch_flags(config)
    if config.attention == "default":
        return
    try:
        prepare_model(model, dataclasses.replace(config, activation_checkpointing=False))
    except (ValueError, ImportError) as exc:
        state.unreachable["attention"] = f"attention={config.attention}: {exc}" \
            if not str(exc).startswith("attention") else str(exc)


def _keep_checkpointing_off(trainer: Any, state: _State) -> None:
    """Checkpointing on a model that has no way to take it (a plain ``torch.nn.Module``): the
    Trainer would call its ``gradient_checkpointing_enable`` as training starts, and end the
    script with an AttributeError. Left off instead, with the reason, as attention is."""
    from autotune.trial.apply import model_knobs_refused

    refused = model_knobs_refused(trainer.model, state.config).get("activation_checkpointing")
    if refused is None:
        return
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        if getattr(trainer.args, name, None):
            setattr(trainer.args, name, False)
    state.unreachable["activation_checkpointing"] = refused


def _attach(trainer: Any, state: _State) -> None:
    from transformers import TrainerCallback

    from autotune.integrations.hf import AutotuneCallback

    _keep_checkpointing_off(trainer, state)
    memory.cap_cuda_allocator(getattr(trainer.args, "device", None))
    callbacks = trainer.callback_handler.callbacks
    if state.mode == TRIAL and not any(isinstance(c, AutotuneCallback) for c in callbacks):
        trainer.add_callback(AutotuneCallback())

    class ReadBack(TrainerCallback):
        def on_train_begin(self, args: Any, st: Any, control: Any, **kwargs: Any) -> None:
            if not state.reported:
                state.reported = True
                report(trainer, state, kwargs.get("train_dataloader"), kwargs.get("optimizer"))

    trainer.add_callback(ReadBack())


def report(trainer: Any, state: _State, loader: Any, optimizer: Any) -> readback.Readback:
    """Read back what the Trainer runs with; in a trial, record it for the tuner, else say it
    on stderr."""
    import transformers

    seen = _seen(trainer, loader, optimizer)
    found = readback.compare(state.config, seen, state.unreachable,
                             f"Trainer (transformers {transformers.__version__})")
    found.script, found.isolated = dict(state.script), list(state.isolated)
    if state.mode == TRIAL:
        steps.readback(dict(found.to_doc()))
    elif trainer.args.process_index == 0:
        shown = ", ".join(f"{k}={readback.shown(found.seen[k])}" for k in found.applied
                          if k in found.seen)
        print(f"autotune: the Trainer runs the profile's {shown}", file=sys.stderr)
        for why in found.fixed.values():
            print(f"autotune: not applied: {why}", file=sys.stderr)
    return found


def _seen(trainer: Any, loader: Any, optimizer: Any) -> dict[str, KnobValue]:
    """The knobs' values in the objects the Trainer built."""
    from autotune.trial.apply import model_in_force, optimizer_in_force, torch_flags_in_force

    args = trainer.args
    seen: dict[str, KnobValue] = {}
    seen["grad_accum_steps"] = int(args.gradient_accumulation_steps)
    accelerator = getattr(trainer, "accelerator", None)
    seen["amp"] = readback.amp_of(getattr(accelerator, "mixed_precision", None))
    if loader is not None:
        batch = getattr(loader, "batch_size", None) or getattr(
            getattr(loader, "batch_sampler", None), "batch_size", None)
        if batch is not None:
            seen["micro_batch_size"] = int(batch)
        seen["num_workers"] = int(getattr(loader, "num_workers", 0))
        seen["prefetch_factor"] = getattr(loader, "prefetch_factor", None)
        seen["pin_memory"] = bool(getattr(loader, "pin_memory", False))
    if optimizer is not None:
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
        force = optimizer_in_force(inner)
        seen["optimizer_impl"] = readback.optimizer_impl(force["foreach"], force["fused"])
    model = trainer.model
    force_model = model_in_force(model)
    if force_model["attention"] is not None:
        seen["attention"] = force_model["attention"]
    seen["activation_checkpointing"] = force_model["activation_checkpointing"]
    wrapped = trainer.model_wrapped
    seen["compile"] = _compiled(wrapped, args)
    ddp = wrapped if hasattr(wrapped, "bucket_bytes_cap") else None
    if ddp is not None:
        seen["ddp_bucket_cap_mb"] = round(ddp.bucket_bytes_cap / 2**20)
        seen["ddp_static_graph"] = bool(getattr(ddp, "static_graph", False))
        seen["ddp_gradient_as_bucket_view"] = bool(getattr(ddp, "gradient_as_bucket_view",
                                                           False))
    seen.update(_sharding_seen(model, args))
    flags = torch_flags_in_force()
    seen["cpu_threads"] = flags["threads"]
    seen["matmul_precision"] = flags["matmul_precision"]
    seen["malloc_retain"] = flags["malloc_retain"]
    return seen


def _sharding_seen(model: Any, args: Any) -> dict[str, KnobValue]:
    """How the ranks hold the model, read back from it: FSDP2's units and policy, else
    replicated (DDP) with several ranks."""
    from torch.distributed.fsdp import FSDPModule

    from autotune.trial.shard import sharding_in_force

    if not isinstance(model, FSDPModule):
        return {"sharding": "replicated"} if int(args.world_size) > 1 else {}
    found = sharding_in_force(model, "?")
    seen: dict[str, KnobValue] = {
        "sharding": "full-shard" if found.get("reshard_after_forward") else "shard-grad-op",
        "cpu_offload": bool(found.get("offload"))}
    if found.get("param_dtype") is not None:
        seen["fsdp_reduce_dtype"] = "fp32" if found.get("reduce_dtype") == "float32" else "amp"
    return seen


def _compiled(wrapped: Any, args: Any) -> str:
    """The compile mode in effect: off unless the model the Trainer steps is compiled."""
    module = getattr(wrapped, "module", wrapped)  # DDP around the compiled model
    if not (hasattr(module, "_orig_mod") or hasattr(wrapped, "_orig_mod")):
        return "off"
    return str(getattr(args, "torch_compile_mode", None) or "default")
