"""The knob registry and the config type.

A knob is one system setting the tuner may change. Each knob knows how to parse a value from a
search-space file, its baseline value (what a user runs without tuning), and when it does not apply
to the hardware at hand. Pure: nothing here imports torch or touches the machine. How a config is
applied (DataLoader, autocast, DDP) is in ``trial/apply.py``, shared by trials and training scripts;
``env_for`` below covers the knobs applied through the environment.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autotune.machine.hardware import Hardware

AMP_MODES = ("off", "fp16", "bf16")
# NCCL_ALGO and NCCL_PROTO values, each with the first NCCL release that knows it (release notes:
# Tree 2.4, LL128 2.5, CollNetDirect/CollNetChain 2.14, NVLS 2.17, NVLSTree 2.18, PAT 2.23).
NCCL_ALGOS = {"Tree": (2, 4), "Ring": (0, 0), "CollNetDirect": (2, 14), "CollNetChain": (2, 14),
              "NVLS": (2, 17), "NVLSTree": (2, 18), "PAT": (2, 23)}
NCCL_PROTOS = {"LL": (0, 0), "LL128": (2, 5), "Simple": (0, 0)}
# torch.compile modes; "off" runs the model eagerly. reduce-overhead uses CUDA graphs.
COMPILE_MODES = ("off", "default", "max-autotune-no-cudagraphs", "reduce-overhead")
# How the optimizer steps: "default" leaves it as the workload built it (torch then picks
# foreach on CUDA, the for-loop on CPU).
OPTIMIZER_IMPLS = ("default", "for-loop", "foreach", "fused")
# fp32 matmuls: "highest" (IEEE fp32) or "high" (TF32 on NVIDIA GPUs of compute capability 8.0+).
MATMUL_PRECISIONS = ("highest", "high")
# The attention implementation of a transformers model; "default" is the model's own choice.
ATTENTIONS = ("default", "eager", "sdpa", "flash_attention_2")
# The largest value each integer knob takes: far beyond any machine (a 2**62 micro-batch
# overflows the sample count; a billion threads aborts the process inside libgomp).
MAX_BATCH = 2**24
MAX_ACCUM = 2**16
MAX_BUCKET_MB = 2**16
MAX_WORKERS = 1024
MAX_PREFETCH = 1024
MAX_THREADS = 4096
MAX_WORLD = 2**17
# Knobs that change the model or its optimizer: searched only for a workload that declares them
# in its ``supports`` (a user's model may not take them; it then keeps its own behaviour).
DECLARED = ("optimizer_impl", "compile", "attention", "activation_checkpointing")


@dataclass(frozen=True)
class Config:
    """One point of the search space: a frozen, typed value with a stable dict form.

    The defaults are the baseline: what a PyTorch user runs without tuning (fp32, accumulation 1,
    no loader workers, DDP's default 25 MB buckets, NCCL left to decide). The micro-batch default is
    replaced by the workload's own default batch.
    """

    micro_batch_size: int = 8
    grad_accum_steps: int = 1
    amp: str = "off"
    ddp_bucket_cap_mb: int = 25
    ddp_gradient_as_bucket_view: bool = False
    ddp_static_graph: bool = False
    nccl_algo: str = "default"
    nccl_proto: str = "default"
    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int | None = None
    optimizer_impl: str = "default"
    compile: str = "off"
    matmul_precision: str = "highest"
    attention: str = "default"
    activation_checkpointing: bool = False
    cpu_threads: int = 0  # intra-op threads per rank; 0 leaves torch's own choice
    world_size: int = 1

    @property
    def samples_per_step(self) -> int:
        """Global samples per optimizer step: micro-batch x accumulation x ranks."""
        return self.micro_batch_size * self.grad_accum_steps * self.world_size

    @property
    def samples_per_rank_step(self) -> int:
        """Samples one rank processes per optimizer step."""
        return self.micro_batch_size * self.grad_accum_steps

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """The config in a few words: what differs between trials, not the fixed knobs."""
        parts = [f"batch {self.micro_batch_size}x{self.grad_accum_steps}",
                 "fp32" if self.amp == "off" else self.amp, f"workers {self.num_workers}"]
        if self.num_workers:
            parts.append(f"prefetch {self.prefetch_factor}")
        if self.pin_memory:
            parts.append("pinned")
        if self.cpu_threads:
            parts.append(f"threads {self.cpu_threads}")
        if self.optimizer_impl != "default":
            parts.append(f"optimizer {self.optimizer_impl}")
        if self.compile != "off":
            parts.append(f"compile {self.compile}")
        if self.matmul_precision != "highest":
            parts.append("tf32")
        if self.attention != "default":
            parts.append(f"attention {self.attention}")
        if self.activation_checkpointing:
            parts.append("checkpointing")
        if self.world_size > 1:
            parts.append(f"{self.world_size} ranks, bucket {self.ddp_bucket_cap_mb}MB")
            if self.ddp_gradient_as_bucket_view:
                parts.append("grad views")
            if self.ddp_static_graph:
                parts.append("static graph")
            if self.nccl_algo != "default" or self.nccl_proto != "default":
                parts.append(f"nccl {self.nccl_algo}/{self.nccl_proto}")
        return ", ".join(parts)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Config:
        """Build a config from its dict form; unknown keys are an error, missing ones default,
        and every value is checked against the knob registry (``parse_values``): a config
        read from a profile, a study or a trial's spec is data, and nothing outside the
        registry reaches torch or transformers. Raises ValueError naming every bad value."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; known: {sorted(names)}")
        values, problems = parse_values(data)
        if problems:
            raise ValueError("; ".join(problems))
        return cls(**values)


def _int_in(minimum: int, maximum: int) -> Callable[[Any], int]:
    """An integer knob's parser. The upper bound is far above any machine's need; it keeps a
    value from a hand-edited file (2**62 samples, a billion threads) from reaching torch, where
    it overflows a count or aborts the process inside OpenMP."""

    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"must be an integer from {minimum} to {maximum}, got {value!r}")
        if not minimum <= value <= maximum:
            raise ValueError(f"must be an integer from {minimum} to {maximum}, got {value}")
        return value

    return parse


def _parse_amp(value: Any) -> str:
    # YAML 1.1 reads a bare `off` as False; accept it rather than make users quote it.
    if value is False:
        return "off"
    if not isinstance(value, str) or value.lower() not in AMP_MODES:
        raise ValueError(f"must be one of {list(AMP_MODES)}, got {value!r}")
    return value.lower()


def _one_of(values: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if value is False and "off" in values:  # YAML 1.1 reads a bare `off` as False
            return "off"
        if not isinstance(value, str) or value not in values:
            raise ValueError(f"must be one of {list(values)}, got {value!r}")
        return value

    return parse


def _parse_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {value!r}")
    return value


def _nccl_values(table: dict[str, tuple[int, int]], variable: str) -> Callable[[Any], str]:
    """Parse 'default' or a comma-separated list of NCCL names, case-insensitively, into their
    canonical spelling (NCCL itself is case-insensitive; the profile should read the same)."""
    canonical = {name.lower(): name for name in table}

    def parse(value: Any) -> str:
        allowed = f"'default' or a comma-separated list of {list(table)}"
        if not isinstance(value, str):
            raise ValueError(f"{variable} must be {allowed}, got {value!r}")
        if value.strip().lower() == "default":
            return "default"
        parts = [p.strip() for p in value.split(",")]
        bad = [p for p in parts if p.lower() not in canonical]
        if bad:
            raise ValueError(f"{variable} must be {allowed}, got {value!r}")
        return ",".join(canonical[p.lower()] for p in parts)

    return parse


def _nccl_version_ok(table: dict[str, tuple[int, int]],
                     variable: str) -> Callable[[Any, Hardware, int], str | None]:
    """A value NCCL in use does not know would fail every trial: drop it, saying why."""

    def check(value: Any, hw: Hardware, world_size: int) -> str | None:
        if value == "default" or not hw.nccl_version:
            return None
        have = tuple(int(x) for x in hw.nccl_version.split(".")[:2] if x.isdigit())
        for name in value.split(","):
            need = table[name]
            if have < need:
                return (f"{variable}={name} needs NCCL >= {need[0]}.{need[1]}; this torch has "
                        f"NCCL {hw.nccl_version}")
        return None

    return check


# DistributedDataParallel's optional arguments, each with the first torch release that takes it.
DDP_ARGUMENTS = {"gradient_as_bucket_view": (1, 7), "static_graph": (1, 11)}


def torch_takes(argument: str, torch_version: str) -> bool:
    """Whether DDP in torch ``torch_version`` (``2.13.0+cpu``) takes ``argument``: read from
    the version, so narrowing a space never imports torch."""
    return _version(torch_version) >= DDP_ARGUMENTS[argument]


def _needs_ranks(hw: Hardware, world_size: int) -> str | None:
    if world_size <= 1:
        return "DDP is only used with more than one rank (world size 1)"
    return None


def _needs_nccl(hw: Hardware, world_size: int) -> str | None:
    if hw.device != "cuda":
        return "NCCL knobs need the nccl backend (no CUDA GPU here)"
    if world_size <= 1:
        return "NCCL knobs need more than one rank (world size 1)"
    return None


def _needs_ddp_argument(argument: str) -> Callable[[Hardware, int], str | None]:
    def check(hw: Hardware, world_size: int) -> str | None:
        if world_size <= 1:
            return "DDP is only used with more than one rank (world size 1)"
        if not torch_takes(argument, hw.torch_version):
            return f"this torch's DistributedDataParallel has no {argument} argument"
        return None

    return check


def _needs_gpu(hw: Hardware, world_size: int) -> str | None:
    if hw.device != "cuda":
        return "pin_memory only speeds up host-to-GPU copies (no CUDA GPU here)"
    return None


def _amp_value(value: Any, hw: Hardware, world_size: int) -> str | None:
    if value == "fp16" and not hw.supports_fp16:
        return "fp16 autocast is not a training precision on this device"
    if value == "bf16" and not hw.supports_bf16:
        if hw.device == "cuda":
            return "bf16 needs compute capability >= 8.0"
        return "this CPU has no native bf16 (avx512_bf16 or amx_bf16); it would be emulated"
    return None


def _workers_value(value: Any, hw: Hardware, world_size: int) -> str | None:
    if value * world_size > hw.cpu_cores:
        return f"{value} workers x {world_size} rank(s) exceed the {hw.cpu_cores} CPU cores"
    return None


def _compile_applies(hw: Hardware, world_size: int) -> str | None:
    if hw.device == "cpu" and not hw.cpp_compiler:
        return "torch.compile on a CPU needs a C++ compiler (none found: install g++)"
    return None


def _compile_value(value: Any, hw: Hardware, world_size: int) -> str | None:
    if value == "reduce-overhead" and hw.device != "cuda":
        return "reduce-overhead uses CUDA graphs (no CUDA GPU here)"
    return None


def _tf32_applies(hw: Hardware, world_size: int) -> str | None:
    if hw.device != "cuda":
        return "TF32 matmuls need an NVIDIA GPU (no CUDA GPU here)"
    if not all(g.compute_capability >= (8, 0) for g in hw.gpus):
        return "TF32 needs compute capability >= 8.0"
    return None


def _optimizer_value(value: Any, hw: Hardware, world_size: int) -> str | None:
    if value == {"cpu": "for-loop", "cuda": "foreach"}.get(hw.device):
        return f"what torch's default already does on this device ({hw.device})"
    if value == "fused" and hw.device == "cpu" and _version(hw.torch_version) < (2, 4):
        return f"a fused optimizer on the CPU needs torch >= 2.4 (this is {hw.torch_version})"
    return None


def _attention_value(value: Any, hw: Hardware, world_size: int) -> str | None:
    if value == "flash_attention_2" and (hw.device != "cuda" or not hw.flash_attn):
        return "flash_attention_2 needs a CUDA GPU and the flash-attn package"
    return None


def _threads_value(value: Any, hw: Hardware, world_size: int) -> str | None:
    # torch's default: one thread per core, but torchrun sets OMP_NUM_THREADS=1 for several
    # ranks per node.
    if value and value == (hw.cpu_cores if world_size == 1 else 1):
        return "torch's default here (0)"
    if value * world_size > hw.cpu_cores:
        return f"{value} threads x {world_size} rank(s) exceed the {hw.cpu_cores} CPU cores"
    return None


def _version(text: str) -> tuple[int, ...]:
    """``2.13.0+cpu`` -> ``(2, 13)``."""
    return tuple(int(p) for p in text.split("+")[0].split(".")[:2] if p.isdigit())


@dataclass(frozen=True)
class Knob:
    """One tunable setting: how to parse it, and when it (or one of its values) does not apply."""

    name: str
    help: str
    parse: Callable[[Any], Any]
    # Returns why the whole knob does not apply here, or None.
    applies: Callable[[Hardware, int], str | None] = lambda hw, world: None
    # Returns why one value cannot run here, or None.
    value_ok: Callable[[Any, Hardware, int], str | None] = lambda value, hw, world: None
    # A knob that only matters, or only works, for some values of another: (that knob, the
    # test its value must pass, this knob's value otherwise). Prefetch needs loader workers.
    when: tuple[str, Callable[[Any], bool], Any] | None = None

    def active(self, values: Mapping[str, Any]) -> bool:
        return self.when is None or self.when[1](values[self.when[0]])


KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob("micro_batch_size", "samples per forward/backward on each rank",
             _int_in(1, MAX_BATCH)),
        Knob("grad_accum_steps", "micro-batches per optimizer step", _int_in(1, MAX_ACCUM)),
        Knob("amp", "autocast precision: off (fp32), fp16 or bf16", _parse_amp,
             value_ok=_amp_value),
        Knob("ddp_bucket_cap_mb", "DDP gradient bucket size in MB", _int_in(1, MAX_BUCKET_MB),
             applies=_needs_ranks),
        Knob("ddp_gradient_as_bucket_view", "DDP gradients as views into the buckets "
             "(saves a copy and memory)", _parse_bool,
             applies=_needs_ddp_argument("gradient_as_bucket_view")),
        # static_graph with no_sync accumulation crashes in DDP's reducer, and once that is
        # patched stops all-reducing (pytorch PR 187732): only without accumulation.
        Knob("ddp_static_graph", "DDP static_graph: the same parameters get gradients every "
             "step (only without accumulation)", _parse_bool,
             applies=_needs_ddp_argument("static_graph"),
             when=("grad_accum_steps", lambda accum: accum == 1, False)),
        Knob("nccl_algo", "NCCL_ALGO for the ranks; default lets NCCL decide",
             _nccl_values(NCCL_ALGOS, "NCCL_ALGO"), applies=_needs_nccl,
             value_ok=_nccl_version_ok(NCCL_ALGOS, "NCCL_ALGO")),
        Knob("nccl_proto", "NCCL_PROTO for the ranks; default lets NCCL decide",
             _nccl_values(NCCL_PROTOS, "NCCL_PROTO"), applies=_needs_nccl,
             value_ok=_nccl_version_ok(NCCL_PROTOS, "NCCL_PROTO")),
        Knob("num_workers", "DataLoader worker processes per rank", _int_in(0, MAX_WORKERS),
             value_ok=_workers_value),
        Knob("pin_memory", "DataLoader pin_memory", _parse_bool, applies=_needs_gpu),
        Knob("prefetch_factor", "batches each loader worker prepares ahead",
             _int_in(1, MAX_PREFETCH),
             when=("num_workers", lambda workers: workers > 0, None)),
        Knob("optimizer_impl", "optimizer step: default (as built), for-loop, foreach or fused",
             _one_of(OPTIMIZER_IMPLS), value_ok=_optimizer_value),
        Knob("compile", "torch.compile mode for the model, or off", _one_of(COMPILE_MODES),
             applies=_compile_applies, value_ok=_compile_value),
        Knob("matmul_precision", "fp32 matmuls: highest (IEEE) or high (TF32)",
             _one_of(MATMUL_PRECISIONS), applies=_tf32_applies),
        Knob("attention", "the model's attention implementation (transformers models)",
             _one_of(ATTENTIONS), value_ok=_attention_value),
        Knob("activation_checkpointing", "recompute activations in backward: less memory, "
             "more compute", _parse_bool),
        Knob("cpu_threads", "intra-op CPU threads per rank (torch.set_num_threads); 0: torch's "
             "default", _int_in(0, MAX_THREADS), value_ok=_threads_value),
    )
}


def _parse_world(value: Any) -> int:
    return _int_in(1, MAX_WORLD)(value)


def parse_values(data: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``data``'s values parsed by the knob registry (canonical spelling: ``BF16`` -> ``bf16``),
    with one line per value the registry refuses (``attention must be one of [...], got
    'kernels-community/flash-attn'``). Keys that are no knob are passed through unchecked."""
    values, problems = dict(data), []
    for name, value in data.items():
        if name == "world_size":
            parse: Callable[[Any], Any] = _parse_world
        elif name in KNOBS:
            parse = KNOBS[name].parse
        else:
            continue
        if name == "prefetch_factor" and value is None:  # no loader workers: DataLoader's None
            continue
        try:
            values[name] = parse(value)
        except ValueError as exc:
            text = str(exc)  # "must be ..." or, for NCCL, "NCCL_ALGO must be ..."
            problems.append(f"{name} {text}" if text.startswith("must") else f"{name}: {text}")
    return values, problems


def oversubscribed(config: Config, cpu_cores: int) -> str | None:
    """Why a config that sets intra-op threads asks for more CPU cores than the machine has,
    counting its loader workers (each a process of its own) with the threads; None when it
    fits, or leaves the threads to torch."""
    if not config.cpu_threads:
        return None
    need = (config.cpu_threads + config.num_workers) * config.world_size
    if need <= cpu_cores:
        return None
    return (f"oversubscribed: {config.cpu_threads} thread(s) + {config.num_workers} loader "
            f"worker(s) per rank x {config.world_size} rank(s) need {need} cores; this "
            f"machine has {cpu_cores}")


# Every environment variable env_for can set: the only ones a profile's ``env`` may carry into
# a process (``Profile.apply_env``, ``autotune launch``, ``autotune profile env``). A profile is
# data; anything else in its env (LD_PRELOAD, PYTHONPATH, BASH_ENV, PATH...) could run code.
# Each with the knob whose value it carries (a profile's env value is checked as that knob's).
ENV_KNOBS = {"NCCL_ALGO": "nccl_algo", "NCCL_PROTO": "nccl_proto"}
TUNED_ENV = tuple(ENV_KNOBS)


def env_for(config: Config) -> dict[str, str]:
    """The environment variables a config sets in the trial (and later in training) processes.

    NCCL reads these when the process group starts, so they must be in place before that.
    """
    if config.world_size <= 1:
        return {}
    values = config.to_dict()
    return {name: values[knob] for name, knob in ENV_KNOBS.items()
            if values[knob] != "default"}


# Which ``Profile`` methods apply each knob in a training script: a script tuned as it runs
# (``autotune run -- CMD``) that calls none of a knob's methods cannot feel it, so the knob is
# not searched. The NCCL knobs are absent: the trial's launcher sets them in the environment.
APPLIED_BY: dict[str, tuple[str, ...]] = {
    "micro_batch_size": ("micro_batch_size", "dataloader_kwargs", "hf_training_args"),
    "grad_accum_steps": ("accumulation_steps", "hf_training_args", "lightning_trainer_kwargs"),
    "amp": ("autocast", "hf_training_args", "lightning_trainer_kwargs"),
    "ddp_bucket_cap_mb": ("ddp_kwargs", "hf_training_args", "lightning_trainer_kwargs"),
    "ddp_gradient_as_bucket_view": ("ddp_kwargs", "lightning_trainer_kwargs"),
    "ddp_static_graph": ("ddp_kwargs", "hf_training_args", "lightning_trainer_kwargs"),
    "num_workers": ("dataloader_kwargs", "hf_training_args"),
    "pin_memory": ("dataloader_kwargs", "hf_training_args"),
    "prefetch_factor": ("dataloader_kwargs", "hf_training_args"),
    "optimizer_impl": ("optimizer_kwargs", "apply_optimizer", "hf_training_args"),
    "compile": ("compile_model", "hf_training_args"),
    "matmul_precision": ("apply_torch_flags", "hf_training_args"),
    "attention": ("attn_implementation", "prepare_model"),
    "activation_checkpointing": ("prepare_model", "hf_training_args"),
    "cpu_threads": ("apply_torch_flags",),
}


_PROPERTIES = ("micro_batch_size", "accumulation_steps", "attn_implementation")


def unapplied(searched: list[str], accessed: set[str], script: str) -> dict[str, str]:
    """The searched knobs a script never applies (it called none of their ``APPLIED_BY``
    methods, read none of those properties), each with the reason printed and stored on the
    study."""
    found: dict[str, str] = {}
    for name in searched:
        methods = APPLIED_BY.get(name)
        if methods is None or accessed & set(methods):
            continue
        if not accessed:  # not one profile method: the script never loaded its profile
            found[name] = (f"{script} never loads a profile (autotune.load_profile()): {name} "
                           "is not searched")
            continue
        calls = " or ".join(m if m in _PROPERTIES else f"{m}()" for m in methods)
        found[name] = f"{script} never uses {calls}: {name} is not searched"
    return found
