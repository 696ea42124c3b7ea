"""Profiles: the exported winner, in schema ``autotune.profile/v1`` (see DESIGN.md), and how a
training script applies one.

Loading never executes code (``yaml.safe_load``), rejects other schema versions with a message
naming both versions, and warns when the fingerprint differs from the machine it is loaded on.
This module is imported by training scripts: it needs torch only inside the methods that make
torch objects, and never Optuna.
"""

from __future__ import annotations

import functools
import math
import os
import re
import warnings
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from autotune import steps
from autotune.config.knobs import ENV_KNOBS, KNOBS, TUNED_ENV, Config, parse_values
from autotune.errors import ProfileError
from autotune.trial.apply import (
    attention_refused,
    autocast_dtype,
    compile_model,
    ddp_kwargs,
    loader_kwargs,
    optimizer_kwargs,
    prepare_model,
    rebuild_optimizer,
    set_torch_flags,
    uses_grad_scaler,
)

if TYPE_CHECKING:
    import torch

    from autotune.integrations.lightning import TrainerKwargs

# v2 added the model and process knobs (compile, optimizer_impl, matmul_precision, attention,
# activation_checkpointing, cpu_threads); a v1 profile loads with their baseline values.
SCHEMA_VERSION = 2
READS = (1, 2)
SCHEMA = f"autotune.profile/v{SCHEMA_VERSION}"
_SCHEMA_RE = re.compile(r"autotune\.profile/v(\d+)")
_MAPPINGS = ("workload", "config", "env", "result", "baseline", "fingerprint", "provenance")
_REQUIRED = ("schema", *_MAPPINGS, "speedup")
# Environment variables a training process gets from `autotune launch`: the profile's path.
PROFILE_ENV = "AUTOTUNE_PROFILE"


def _tracked(method: Callable[..., Any]) -> Any:
    """Record the first call of a ``Profile`` method in a trial of ``autotune run -- CMD``
    (``steps.accessed``): the tuner searches only the knobs the script applies. Costs a
    global lookup outside a trial."""
    name = method.__name__

    @functools.wraps(method)
    def tracked(self: Profile, *args: Any, **kwargs: Any) -> Any:
        steps.accessed(name)
        return method(self, *args, **kwargs)

    return tracked


class FingerprintWarning(UserWarning):
    """The profile was tuned on different hardware or software than this machine."""


@dataclass(frozen=True)
class Profile:
    """A tuned configuration and what it measured; its methods apply it in a training script.

    Everything a trial set is here: the DataLoader (``dataloader_kwargs``), precision
    (``autocast``, ``grad_scaler``), accumulation, DDP (``ddp_kwargs``) and the environment the
    ranks started with (``env``, ``apply_env``).
    """

    workload: dict[str, Any]
    config: Config
    env: dict[str, str]
    result: dict[str, Any]
    baseline: dict[str, Any]
    speedup: float | None
    fingerprint: dict[str, Any]
    provenance: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    schema: str = SCHEMA
    # The interleaved re-measurement that chose the winner (absent when there was none).
    confirmation: dict[str, Any] | None = None
    # The machine's probe in a few numbers (peaks, links, flags), and what limits this config.
    probe: dict[str, Any] | None = None
    diagnosis: list[dict[str, Any]] = field(default_factory=list)

    # -- what was tuned -------------------------------------------------------------------------

    @property
    @_tracked
    def micro_batch_size(self) -> int:
        """Samples per forward/backward on each rank: the DataLoader's batch_size."""
        return self.config.micro_batch_size

    @property
    @_tracked
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (gradients synchronised on the last one only)."""
        return self.config.grad_accum_steps

    @property
    def world_size(self) -> int:
        """Ranks the profile was measured with."""
        return self.config.world_size

    @property
    def samples_per_step(self) -> int:
        """Global samples per optimizer step: micro-batch x accumulation x ranks."""
        return self.config.samples_per_step

    @property
    def samples_per_sec(self) -> float:
        """The measured throughput: the confirmation's median when there was one."""
        return float(self.result["samples_per_sec"])

    # -- applying it ----------------------------------------------------------------------------

    @_tracked
    def dataloader_kwargs(self, device: str | torch.device | None = None) -> dict[str, Any]:
        """``batch_size``, ``num_workers``, ``pin_memory`` and, with workers, ``prefetch_factor``
        and ``persistent_workers``, as the trials ran them. Add your dataset, sampler and
        collate_fn. ``pin_memory`` is on only when batches go to a GPU (``device``, default:
        CUDA if available)."""
        return loader_kwargs(self.config, _device_type(device))

    @_tracked
    def ddp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``DistributedDataParallel``: the bucket size and, where this
        torch's DDP takes them, gradient views and static graph."""
        return ddp_kwargs(self.config)

    @_tracked
    def autocast(self, device: str | torch.device | None = None) -> Any:
        """A context manager for the forward pass and loss: ``torch.autocast`` in the profile's
        precision, or a no-op for fp32."""
        import torch

        dtype = autocast_dtype(self.config)
        return torch.autocast(_device_type(device), dtype=dtype or torch.float32,
                              enabled=dtype is not None)

    @_tracked
    def grad_scaler(self, device: str | torch.device | None = None) -> torch.amp.GradScaler:
        """A ``torch.amp.GradScaler``, enabled only for fp16 on CUDA (bf16 and fp32 need no
        loss scaling; a disabled scaler passes ``scale``, ``step`` and ``update`` through)."""
        import torch

        kind = _device_type(device)
        return torch.amp.GradScaler(kind, enabled=uses_grad_scaler(self.config, kind))

    @_tracked
    def apply_env(self, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
        """Set the profile's environment (``NCCL_ALGO``, ``NCCL_PROTO``) in this process.

        NCCL reads these when the process group starts, so this refuses once one is running:
        call it before ``init_process_group``, or start the script with ``autotune launch``.
        A different value already set is replaced, with a warning naming both.
        """
        import torch.distributed as dist

        self.check_env()
        if dist.is_available() and dist.is_initialized():
            raise ProfileError("apply_env() called after the process group started: NCCL reads "
                               "its environment at init; call it before init_process_group, or "
                               "start the script with `autotune launch PROFILE -- CMD`")
        environ = os.environ if environ is None else environ
        for key, value in self.env.items():
            old = environ.get(key)
            if old is not None and old != value:
                warnings.warn(f"{key}={old} in the environment replaced by the profile's "
                              f"{key}={value}", stacklevel=2)
            environ[key] = value
        return dict(self.env)

    def refused_here(self) -> list[str]:
        """Why values of this profile cannot be applied on this machine (each refused when it
        would be applied; ``profile check`` refuses to start): a flash attention that
        transformers would replace by a kernel from the Hub."""
        if self.config.attention == "default":
            return []
        refused = attention_refused(self.config.attention)
        return [refused] if refused else []

    def foreign_env(self) -> list[str]:
        """Names in the profile's ``env`` that autotune does not tune (``TUNED_ENV``)."""
        return [k for k in self.env if k not in TUNED_ENV]

    def check_env(self) -> None:
        """Refuse a profile whose env holds anything autotune does not tune: a profile is data,
        and LD_PRELOAD, PYTHONPATH, BASH_ENV or PATH set from one would run foreign code."""
        foreign = self.foreign_env()
        if foreign:
            names = ", ".join(repr(k) for k in foreign)
            raise ProfileError(f"the profile's env sets {names}: autotune applies only the "
                               f"variables it tunes ({', '.join(TUNED_ENV)}); remove the others "
                               "from the profile's env")

    @_tracked
    def apply_torch_flags(self) -> dict[str, Any]:
        """Set the process-wide torch settings the profile tuned: intra-op threads (when it
        set them) and the fp32 matmul precision (TF32 or not). Call once at start, before
        building the model. Returns what is in force afterwards."""
        return set_torch_flags(self.config)

    @property
    @_tracked
    def attn_implementation(self) -> str | None:
        """The attention implementation for transformers' ``from_pretrained`` /
        ``from_config`` (``attn_implementation=``); None: the model's own default."""
        if self.config.attention == "default":
            return None
        refused = attention_refused(self.config.attention)
        if refused:
            raise ProfileError(refused)
        return self.config.attention

    @_tracked
    def optimizer_kwargs(self) -> dict[str, Any]:
        """``foreach`` / ``fused`` for your torch optimizer's constructor, as the trials ran it
        (``{}``: the optimizer's own default). ``AdamW(params, lr=..., **p.optimizer_kwargs())``."""
        return optimizer_kwargs(self.config)

    @_tracked
    def apply_optimizer(self, optimizer: Any) -> Any:
        """``optimizer`` rebuilt (same class, groups and hyperparameters) with the tuned
        implementation, before its first step: for a script whose optimizer is built elsewhere
        (the workload's ``build_optimizer``); the same object when the profile keeps the default.
        Build any LR scheduler after this call: one built before drives the old optimizer."""
        return rebuild_optimizer(optimizer, self.config)

    @_tracked
    def prepare_model(self, model: Any, compile: bool = True) -> Any:
        """The model as the trials ran it: its attention implementation and activation
        checkpointing (transformers models), then ``torch.compile`` in the tuned mode. With
        DDP, wrap what this returns, as the trials do (compiling around DDP can leave a
        ``torch.nn`` model uncompiled). Returns the model to train."""
        try:
            model = prepare_model(model, self.config)
        except ValueError as exc:
            raise ProfileError(str(exc)) from None
        return self.compile_model(model) if compile else model

    @_tracked
    def compile_model(self, model: Any) -> Any:
        """``torch.compile(model, mode=...)`` when the profile compiles, else ``model``."""
        return compile_model(model, self.config)

    # -- integrations ---------------------------------------------------------------------------

    @_tracked
    def hf_training_args(self) -> dict[str, Any]:
        """Keyword arguments for ``transformers.TrainingArguments``: per-device batch,
        accumulation, precision, the DataLoader's workers/pinning/prefetch, ``use_cpu`` for a
        profile tuned on a CPU and, with ranks, the DDP bucket size and static graph; compiling,
        TF32, the AdamW implementation and activation checkpointing as the trials ran them
        (``autotune.integrations.hf.training_args``)."""
        from autotune.integrations.hf import training_args

        return training_args(self)

    @_tracked
    def lightning_trainer_kwargs(self) -> TrainerKwargs:
        """Keyword arguments for a Lightning ``Trainer``
        (``autotune.integrations.lightning.trainer_kwargs``): ``precision``,
        ``accumulate_grad_batches`` and, with ranks, ``devices`` and a ``DDPStrategy`` carrying
        the DDP arguments. Build the DataLoader with ``dataloader_kwargs()``.

        Lightning's Trainer takes none of the model knobs: call ``apply_torch_flags()`` at
        start, ``prepare_model(self.model)`` in your LightningModule's ``configure_model``, and
        pass ``optimizer_kwargs()`` to the optimizer ``configure_optimizers`` builds."""
        try:
            from autotune.integrations.lightning import trainer_kwargs
        except ImportError:
            raise ProfileError("lightning_trainer_kwargs() needs Lightning: pip install "
                               "lightning") from None
        return trainer_kwargs(self)

    # -- reading it -----------------------------------------------------------------------------

    def summary(self) -> str:
        """A few lines for a human: what was tuned, what it measured, against what, where."""
        from autotune.machine.hardware import describe_fingerprint
        from autotune.units import format_bytes

        c, r, fp = self.config, self.result, self.fingerprint
        params = self.workload.get("params") or {}
        where = describe_fingerprint(fp)
        lines = [f"workload   {self.workload.get('name')}"
                 + (f" {params}" if params else ""),
                 f"config     {c.describe()}",
                 f"batch      {c.micro_batch_size} per micro-batch x {c.grad_accum_steps} "
                 f"accumulation x {c.world_size} rank(s) = {c.samples_per_step} samples per "
                 "optimizer step"]
        spread = f", spread {100 * r['spread_cv']:.1f}%" if r.get("spread_cv") is not None else ""
        how = (f"median of {self.confirmation['rounds']} interleaved rounds" if self.confirmation
               else "one search trial")
        lines.append(f"measured   {self.samples_per_sec:,.2f} samples/s{spread} ({how})")
        if r.get("peak_memory_bytes"):
            limit = r.get("memory_limit_bytes")
            lines.append(f"memory     peak {format_bytes(r['peak_memory_bytes'])}"
                         + (f" of a {format_bytes(limit)} limit" if limit else ""))
        if self.baseline.get("samples_per_sec") and self.baseline.get("config"):
            base = Config.from_dict(self.baseline["config"])
            speedup = f"; speedup {self.speedup:g}x" if self.speedup else ""
            lines.append(f"baseline   {base.describe()}: {self.baseline['samples_per_sec']:,.2f} "
                         f"samples/s{speedup}")
        if r.get("mfu") is not None:
            lines.append(f"MFU        {100 * r['mfu']:.1f}%: {r['tflops']:g} TFLOP/s achieved, "
                         f"measured peak {r['peak_tflops']:g} TFLOP/s per device; "
                         f"{r['flops_per_sample']:.3g} FLOPs/sample ({r.get('flops_source')})")
        lines += [f"limit      {d.get('text')}" for d in self.diagnosis]
        lines.append("env        " + (" ".join(f"{k}={v}" for k, v in self.env.items()
                                               if k in TUNED_ENV) or "(none)"))
        if self.foreign_env():
            lines.append("env        NOT APPLIED (autotune tunes only "
                         f"{', '.join(TUNED_ENV)}; apply_env and launch refuse this profile): "
                         + " ".join(repr(f"{k}={v}") for k, v in self.env.items()
                                    if k not in TUNED_ENV))
        lines.append(f"tuned on   {where}, torch {fp.get('torch_version')}, "
                     f"{self.provenance.get('created')}, study {self.provenance.get('study')}")
        lines += [f"note       {n}" for n in self.notes]
        lines += [f"REFUSED    here: {why}" for why in self.refused_here()]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "workload": self.workload,
            "config": self.config.to_dict(),
            "env": dict(self.env),
            "result": self.result,
            "baseline": self.baseline,
            "speedup": self.speedup,
            "fingerprint": self.fingerprint,
            "provenance": self.provenance,
            "notes": list(self.notes),
            **({"diagnosis": list(self.diagnosis)} if self.diagnosis else {}),
            **({"probe": self.probe} if self.probe else {}),
            **({"confirmation": self.confirmation} if self.confirmation else {}),
        }

    def to_yaml(self) -> str:
        """The profile as the file ``save`` writes."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None,
                              width=100)

    def save(self, path: str | Path) -> Path:
        """Write atomically: a crash mid-write never leaves a half profile behind."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self.to_yaml())
        os.replace(tmp, path)
        return path


def _device_type(device: str | torch.device | None) -> str:
    if device is None:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device if isinstance(device, str) else device.type


def _check_schema(schema: Any, source: str) -> None:
    """Accept this version only; name both versions, and which side must change."""
    if schema == SCHEMA:
        return
    found = _SCHEMA_RE.fullmatch(schema) if isinstance(schema, str) else None
    if found is None:
        raise ProfileError(f"{source} has schema {schema!r}, which is not an autotune profile "
                           f"schema; this autotune reads {SCHEMA!r}")
    if int(found.group(1)) in READS:
        return
    if int(found.group(1)) > SCHEMA_VERSION:
        raise ProfileError(f"{source} has schema {schema!r}, newer than this autotune reads "
                           f"({SCHEMA!r}): upgrade autotune to load it")
    raise ProfileError(f"{source} has schema {schema!r}, older than this autotune reads "
                       f"({SCHEMA!r}): re-export it with `autotune run` on its study")


def from_dict(data: Any, source: str = "<profile>") -> Profile:
    """Validate a profile's dict form; every problem is named in one error."""
    if not isinstance(data, dict):
        raise ProfileError(f"{source} is not a profile: expected a mapping, got "
                           f"{type(data).__name__}; the file is damaged or not a profile")
    _check_schema(data.get("schema"), source)
    problems = [f"lacks {k}" for k in _REQUIRED if k not in data]
    problems += [f"{k} is not a mapping" for k in _MAPPINGS
                 if k in data and not isinstance(data[k], dict)
                 and not (k == "env" and data[k] is None)]
    config: Config | None = None
    values: list[str] = []  # what the knob registry refuses
    if isinstance(data.get("config"), dict):
        config, values = _config(data["config"], "config")
    if isinstance(data.get("baseline"), dict) and data["baseline"].get("config") is not None:
        values += _config(data["baseline"]["config"], "baseline.config")[1]
    if isinstance(data.get("result"), dict) and \
            not _positive(data["result"].get("samples_per_sec"), zero=True):
        # 0: a trial's candidate, written before anything was measured
        problems.append("has no result.samples_per_sec (a finite number >= 0)")
    env = data.get("env") or {}
    if isinstance(env, dict) and not all(isinstance(k, str) and isinstance(v, str)
                                         for k, v in env.items()):
        problems.append("has an env whose names and values are not all strings")
    elif isinstance(env, dict):
        problems += _env_problems(env)
    speedup = data.get("speedup")
    if speedup is not None and not _positive(speedup):
        problems.append(f"has a speedup that is not a positive number ({speedup!r})")
    for name, kind in (("confirmation", dict), ("notes", list), ("diagnosis", list),
                       ("probe", dict)):
        if data.get(name) is not None and not isinstance(data[name], kind):
            problems.append(f"has a {name} that is not a {'mapping' if kind is dict else 'list'}")
    if values:
        # Edited, not damaged: say which values, what they may be, and where that is written.
        raise ProfileError(f"{source}: {'; '.join(values + problems)}; a profile holds only "
                           "the values autotune's knob registry lists (docs/profiles.md): "
                           "correct it, or re-export the profile with `autotune run`")
    if problems or config is None:
        raise ProfileError(f"{source} {'; '.join(problems)}: the file is damaged or truncated; "
                           "re-export it with `autotune run` on its study")
    return Profile(workload=data["workload"], config=config, env=dict(env),
                   result=data["result"], baseline=data["baseline"], speedup=speedup,
                   fingerprint=data["fingerprint"], provenance=data["provenance"],
                   notes=list(data.get("notes") or []),
                   confirmation=data.get("confirmation") or None,
                   probe=data.get("probe") if isinstance(data.get("probe"), dict) else None,
                   diagnosis=[d for d in data.get("diagnosis") or [] if isinstance(d, dict)])


def _config(data: Any, key: str) -> tuple[Config | None, list[str]]:
    """A profile's config, every value checked against the knob registry, and a line for each
    value it refuses (naming the key, the value and the allowed values). A profile is data that
    may have been edited or downloaded, and what it holds goes into training: a Hub id as the
    attention implementation would download code."""
    if not isinstance(data, dict):
        return None, [f"{key} is not a mapping"]
    unknown = sorted(set(data) - set(Config.__dataclass_fields__))
    values, problems = parse_values(data)
    lines = [f"{key}.{p}" for p in problems]
    if unknown:
        lines.insert(0, f"{key} has keys no knob has ({', '.join(map(repr, unknown))})")
    return (None if lines else Config(**values)), lines


def _env_problems(env: dict[str, str]) -> list[str]:
    """The tuned variables' values, checked as their knobs check them (names autotune does not
    tune are refused where the env is applied, and shown by ``profile show``)."""
    problems = []
    for name, knob in ENV_KNOBS.items():
        if name in env:
            try:
                KNOBS[knob].parse(env[name])
            except ValueError as exc:
                problems.append(f"has env.{exc}")
    return problems


def _positive(value: Any, zero: bool = False) -> bool:
    """A finite number above zero, or zero too (YAML's .nan and .inf are floats as well)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and \
        math.isfinite(value) and (value > 0 or (zero and value == 0))


# A profile autotune writes is a few KB and a few hundred values; these bounds refuse a file
# that is not one before anything prints or walks it (a 637-byte YAML of nested aliases expands
# to 100+ MB).
MAX_PROFILE_BYTES = 4 * 2**20
MAX_PROFILE_NODES = 200_000


def _expanded_size(data: Any, cap: int) -> int:
    """Values in ``data`` counted as printing would visit them (an alias's target as often as
    it is referenced), stopping just past ``cap``."""
    count, stack = 0, [data]
    while stack and count <= cap:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


def load_profile(path: str | Path | None = None, check_fingerprint: bool = True) -> Profile:
    """Load a profile safely. Warns (FingerprintWarning) when tuned on other hardware.

    Without ``path``, loads the one ``autotune launch`` named in ``AUTOTUNE_PROFILE``. In a
    trial of ``autotune run -- CMD`` it always loads the trial's candidate config (also named
    in ``AUTOTUNE_PROFILE``), whatever ``path`` the script passes: a script that loads its
    production profile by path is tuned without that path changing, and says so once on stderr.
    """
    path = _trial_candidate(path)
    if path is None:
        path = os.environ.get(PROFILE_ENV)
        if not path:
            raise ProfileError(f"no profile path given and {PROFILE_ENV} is not set: pass the "
                               "path, or start the script with `autotune launch PROFILE -- CMD`")
    path = Path(path)
    try:
        if path.stat().st_size > MAX_PROFILE_BYTES:
            raise ProfileError(f"profile {path} is {path.stat().st_size} bytes, more than a "
                               f"profile's {MAX_PROFILE_BYTES}: it is not a profile")
        text = path.read_text()
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ProfileError(f"profile {path} is not text: the file is damaged or not a "
                           "profile") from None
    try:
        data = yaml.safe_load(text)  # safe_load refuses !!python/object and friends
    except yaml.YAMLError as exc:
        what = str(exc).splitlines()[0]
        if "python/" in str(exc):
            raise ProfileError(f"profile {path} holds a Python object tag ({what}); profiles "
                               "are plain data and such tags are never loaded") from None
        raise ProfileError(f"profile {path} is not valid YAML ({what}); the file is damaged: "
                           "re-export it") from None
    if _expanded_size(data, MAX_PROFILE_NODES) > MAX_PROFILE_NODES:
        raise ProfileError(f"profile {path} expands to more than {MAX_PROFILE_NODES} values "
                           "(YAML aliases repeating aliases): it is not a profile autotune wrote")
    profile = from_dict(data, str(path))
    if check_fingerprint:
        from autotune.machine.hardware import compare_fingerprints, detect

        match = compare_fingerprints(profile.fingerprint, detect().fingerprint())
        if match.differs:
            warnings.warn(f"profile {path} was tuned on a different machine or software: "
                          f"{'; '.join(match.differs)}", FingerprintWarning, stacklevel=2)
        elif match.unverified:
            warnings.warn(f"profile {path} was made by an earlier autotune whose fingerprint "
                          f"did not record the CPU's {match.unverified_words()}: whether it "
                          "was tuned on this CPU cannot be told", FingerprintWarning,
                          stacklevel=2)
    return profile


def _trial_candidate(path: str | Path | None) -> str | Path | None:
    """``path``, or in a trial the candidate profile the tuner wrote for it (and the load is
    recorded: a script that never loads a profile applies no knob)."""
    candidate = os.environ.get(PROFILE_ENV)
    if not steps.in_trial() or not candidate:
        return path
    steps.accessed("load_profile")
    if path is not None and os.path.abspath(path) != os.path.abspath(candidate):
        steps.note_once(f"autotune: load_profile({str(path)!r}) in a trial of `autotune run`: "
                        "loading the trial's candidate config instead")
    return candidate


def fingerprint_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Human lines for each fingerprint field that differs (``field: A vs B here``)."""
    return [f"{k}: {a.get(k)!r} vs {b.get(k)!r} here" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


def profile_diff(a: Profile, b: Profile) -> list[str]:
    """What differs between two profiles: workload, config, env, results and fingerprint, one
    line each (``field: A -> B``); empty when they agree on all of these."""
    lines: list[str] = []

    def compare(prefix: str, x: dict[str, Any], y: dict[str, Any]) -> None:
        lines.extend(f"{prefix}{k}: {x.get(k)!r} -> {y.get(k)!r}" for k in sorted(set(x) | set(y))
                     if x.get(k) != y.get(k))

    compare("workload.", a.workload, b.workload)
    compare("config.", a.config.to_dict(), b.config.to_dict())
    compare("env.", a.env, b.env)
    for key in ("samples_per_sec", "spread_cv", "peak_memory_bytes", "memory_limit_bytes"):
        compare("result.", {key: a.result.get(key)}, {key: b.result.get(key)})
    compare("", {"speedup": a.speedup}, {"speedup": b.speedup})
    compare("fingerprint.", a.fingerprint, b.fingerprint)
    return lines


def launch_env(profile: Profile, path: str | Path,
               base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment `autotune launch` runs a command in: ``base`` (default: this one), the
    profile's variables and ``AUTOTUNE_PROFILE`` (its absolute path) for ``load_profile``.
    Refuses a profile whose env holds a variable autotune does not tune."""
    profile.check_env()
    env = dict(os.environ if base is None else base)
    env.update(profile.env)
    env[PROFILE_ENV] = str(Path(path).resolve())
    return env

