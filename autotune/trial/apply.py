"""How a config is applied: the DataLoader arguments, the autocast dtype, loss scaling and DDP's
arguments. Trials (``trial.bench``) and training scripts (``Profile``) both build from these, so
what was measured is what trains. torch is imported inside the functions that need it only.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any, NotRequired, TypedDict

from autotune.config.knobs import KNOBS, Config

# How an optimizer steps: its class, and its groups' foreach/fused flags (None: torch decides
# at the first step). The functional form: "class" is a keyword.
OptimizerInForce = TypedDict("OptimizerInForce", {"class": str, "foreach": bool | None,
                                                  "fused": bool | None})


class ModelInForce(TypedDict):
    """The attention implementation (None: not a transformers model) and the activation
    checkpointing a model runs with."""

    attention: str | None
    activation_checkpointing: bool


class LoaderKwargs(TypedDict):
    """The DataLoader's keyword arguments a config sets (``loader_kwargs``)."""

    batch_size: int
    num_workers: int
    pin_memory: bool
    prefetch_factor: NotRequired[int]  # with workers only: DataLoader refuses it without
    persistent_workers: NotRequired[bool]


class TorchFlags(TypedDict):
    """The process-wide settings in force: intra-op threads, the fp32 matmul precision in the
    config's terms (``highest`` or ``high``), and whether glibc retains freed host memory."""

    threads: int
    matmul_precision: str
    malloc_retain: bool


class OptimizerKwargs(TypedDict, total=False):
    """A torch optimizer's implementation flags (``{}``: the optimizer's own default)."""

    foreach: bool
    fused: bool


def loader_kwargs(config: Config, device_type: str) -> LoaderKwargs:
    """The DataLoader arguments a config sets; the caller adds dataset, sampler and collate_fn.

    pin_memory only where batches go to a GPU; prefetch and persistent workers only with workers
    (DataLoader refuses prefetch_factor without them). Trials and training both build from this.
    """
    kwargs: LoaderKwargs = {"batch_size": config.micro_batch_size,
                            "num_workers": config.num_workers,
                            "pin_memory": config.pin_memory and device_type == "cuda"}
    if config.num_workers > 0:
        kwargs["prefetch_factor"] = config.prefetch_factor or 2
        kwargs["persistent_workers"] = True
    return kwargs


def autocast_dtype(config: Config) -> Any:
    """The torch dtype autocast runs in, or None for fp32 (autocast off)."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.amp)


def uses_grad_scaler(config: Config, device_type: str) -> bool:
    """Loss scaling only for fp16 on CUDA: bf16 has fp32's range and needs none."""
    return config.amp == "fp16" and device_type == "cuda"


def ddp_kwargs(config: Config) -> dict[str, Any]:
    """Keyword arguments for DistributedDataParallel: only those the installed torch takes, and
    only values that differ from DDP's own defaults (so an older torch runs the baseline)."""
    wanted: dict[str, Any] = {"bucket_cap_mb": config.ddp_bucket_cap_mb}
    if config.ddp_gradient_as_bucket_view:
        wanted["gradient_as_bucket_view"] = True
    if config.ddp_static_graph:
        wanted["static_graph"] = True
    return {k: v for k, v in wanted.items() if ddp_accepts(k)}


def ddp_accepts(name: str) -> bool:
    """Whether the installed torch's DistributedDataParallel takes this keyword argument."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    return name in inspect.signature(DistributedDataParallel.__init__).parameters


# -- the model, its optimizer and process-wide torch flags ----------------------------------------


def set_torch_flags(config: Config) -> TorchFlags:
    """Process-wide settings: intra-op threads (when the config sets them), the precision of
    fp32 matmuls and glibc's retention of freed memory. Call once, before building the model.
    Returns what is in force afterwards."""
    import torch

    if config.cpu_threads:
        torch.set_num_threads(config.cpu_threads)
    if config.malloc_retain:
        retain_freed_memory()
    tf32 = config.matmul_precision == "high"
    matmul = getattr(getattr(torch.backends, "cuda", None), "matmul", None)
    if matmul is not None and hasattr(matmul, "fp32_precision"):
        # torch 2.9+: the per-backend setting; allow_tf32 and set_float32_matmul_precision are
        # deprecated there.
        matmul.fp32_precision = "tf32" if tf32 else "ieee"
    else:
        torch.set_float32_matmul_precision(config.matmul_precision)
    return torch_flags_in_force()


def torch_flags_in_force() -> TorchFlags:
    """The threads and fp32 matmul precision this process runs with now."""
    import torch

    matmul = getattr(getattr(torch.backends, "cuda", None), "matmul", None)
    precision = getattr(matmul, "fp32_precision", None) if matmul is not None else None
    return {"threads": torch.get_num_threads(),
            "matmul_precision": "high" if precision == "tf32" or (
                precision is None and torch.get_float32_matmul_precision() != "highest")
            else "highest",
            "malloc_retain": _retaining}


# glibc's mallopt parameters (malloc.h): M_TRIM_THRESHOLD, M_MMAP_THRESHOLD; INT_MAX for both.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _INT_MAX = -1, -3, 2**31 - 1
_retaining = False  # whether this process called mallopt for it (glibc has no getter)


def retain_freed_memory() -> bool:
    """Keep freed host memory in the process: glibc stops returning the top of its heap to the
    OS (trimming) and stops giving each large allocation its own mmap, both of which it does
    by default and which make every training step fault its activations' pages in afresh
    (BERT-base at micro-batch 16 on a 2-core VM: ~430,000 minor faults per step, a quarter to a
    third of the step: ``benchmarks/malloc_faults.py``). Memory freed stays in the process's
    resident set for the next step to reuse: its peak is unchanged, what it returns to the OS
    between steps is not. glibc only (Linux); elsewhere nothing changes. Returns whether it is
    in force."""
    global _retaining
    if _retaining or not sys.platform.startswith("linux"):
        return _retaining
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    trim = mallopt(_M_TRIM_THRESHOLD, _INT_MAX)
    # glibc before 2.26 refuses a threshold above 32 MiB (its largest dynamic one).
    mmap = mallopt(_M_MMAP_THRESHOLD, _INT_MAX) or mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)
    _retaining = bool(trim and mmap)
    return _retaining


def attention_refused(attention: str, model: Any = None) -> str | None:
    """Why ``attention`` must not be handed to transformers here, or None. Only the registry's
    names are ever passed (never a Hub id or a path: transformers 5 downloads and runs a Hub
    kernel for those), and a registry name that transformers would quietly replace by a Hub
    kernel is refused on this machine: ``flash_attention_2`` without the flash-attn package
    (with the ``kernels`` package installed, transformers loads a kernel from the Hub instead),
    or for a model whose own list of flash implementations does not hold it (transformers
    switches to the first of that list, which may be a Hub kernel)."""
    try:  # the registry's rule, here too: a Profile built in code skips loading's check
        KNOBS["attention"].parse(attention)
    except ValueError as exc:
        return f"attention {exc}"
    if not attention.startswith("flash_attention"):
        return None
    if importlib.util.find_spec("flash_attn") is None:
        return (f"attention={attention} needs the flash-attn package, which is not installed "
                "here: transformers would load a flash-attention kernel from the Hub in its "
                "place; install flash-attn, or use attention: sdpa")
    compatible = getattr(model, "_compatible_flash_implementations", None)
    if compatible and attention not in compatible:
        return (f"attention={attention}: {type(model).__name__} lists {list(compatible)} as its "
                "flash implementations, and transformers would switch to the first (which may "
                "be a Hub kernel); use attention: sdpa")
    return None


def model_knobs_refused(model: Any, config: Config) -> dict[str, str]:
    """The model knobs ``config`` sets that ``model`` has no way to take, each with why:
    attention without ``set_attn_implementation``, checkpointing without
    ``activation_checkpointing_enable`` / ``gradient_checkpointing_enable`` (a plain
    ``torch.nn.Module``). Empty when the model can take them all."""
    name = type(model).__name__
    refused: dict[str, str] = {}
    if config.attention != "default" and getattr(model, "set_attn_implementation", None) is None:
        refused["attention"] = (f"attention={config.attention} needs a transformers model "
                                f"(set_attn_implementation); {name} has none")
    if config.activation_checkpointing and _checkpointing_enable(model) is None:
        refused["activation_checkpointing"] = (
            "activation_checkpointing=true needs a transformers model "
            f"(gradient_checkpointing_enable); {name} has none")
    return refused


def _checkpointing_enable(model: Any) -> tuple[str, Any] | None:
    """The model's method that turns checkpointing on, with its keyword's prefix:
    transformers 5.x renamed gradient_checkpointing_* to activation_checkpointing_*."""
    for prefix in ("activation", "gradient"):
        enable = getattr(model, f"{prefix}_checkpointing_enable", None)
        if enable is not None:
            return prefix, enable
    return None


def prepare_model(model: Any, config: Config) -> Any:
    """The attention implementation and activation checkpointing a config sets, applied to a
    transformers model (or one with the same two methods); the model itself is returned.
    A knob the model cannot take is a ValueError (``model_knobs_refused``): a trial must not
    measure a config it did not run. Compile comes after (``compile_model``), before any DDP
    wrapping."""
    refused = model_knobs_refused(model, config)
    if refused:
        raise ValueError(next(iter(refused.values())))
    if config.attention != "default":
        unsafe = attention_refused(config.attention, model)
        if unsafe:
            raise ValueError(unsafe)
        model.set_attn_implementation(config.attention)
    found = _checkpointing_enable(model) if config.activation_checkpointing else None
    if found is not None:
        # Non-reentrant: what torch recommends, and it needs no input that requires grad.
        prefix, enable = found
        enable(**{f"{prefix}_checkpointing_kwargs": {"use_reentrant": False}})
    return model


def compile_model(model: Any, config: Config) -> Any:
    """``torch.compile(model, mode=...)`` for a config that compiles, else the model as is.
    With DDP, compile the module and wrap the result: Dynamo skips a DDP-wrapped forward that
    lives in ``torch.nn``."""
    if config.compile == "off":
        return model
    import torch

    return torch.compile(model, mode=None if config.compile == "default" else config.compile)


def optimizer_kwargs(config: Config) -> OptimizerKwargs:
    """Keyword arguments a torch optimizer takes for the config's implementation: ``{}`` for
    the default, ``foreach`` or ``fused`` otherwise."""
    impls: dict[str, OptimizerKwargs] = {
        "default": {}, "for-loop": {"foreach": False, "fused": False},
        "foreach": {"foreach": True, "fused": False}, "fused": {"foreach": False, "fused": True}}
    return impls[config.optimizer_impl]


def rebuild_optimizer(optimizer: Any, config: Config) -> Any:
    """The same optimizer (class, parameter groups, hyperparameters) with the config's
    implementation; before its first step. A class whose constructor takes no ``foreach`` /
    ``fused`` is refused with the reason."""
    import inspect

    wanted = optimizer_kwargs(config)
    if not wanted:
        return optimizer
    if optimizer.state:
        raise ValueError(f"optimizer_impl={config.optimizer_impl}: the optimizer has stepped "
                         "already (its state would be lost); rebuild it before the first step")
    cls = type(optimizer)
    takes = inspect.signature(cls.__init__).parameters
    missing = [k for k, v in wanted.items() if v and k not in takes]
    if missing:
        raise ValueError(f"optimizer_impl={config.optimizer_impl}: {cls.__name__} takes no "
                         f"{missing[0]} argument")
    kwargs = {k: v for k, v in wanted.items() if k in takes}
    defaults = {k: v for k, v in optimizer.defaults.items() if k in takes}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": g["params"], **kwargs}
              for g in optimizer.param_groups]
    return cls(groups, **{**defaults, **kwargs})


def optimizer_in_force(optimizer: Any) -> OptimizerInForce:
    """How the optimizer will step: its class and the foreach/fused flags of its groups (None:
    torch decides at the first step; on CUDA it picks foreach, on the CPU the for-loop)."""
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    return {"class": type(optimizer).__name__, "foreach": group.get("foreach"),
            "fused": group.get("fused")}


def model_in_force(model: Any) -> ModelInForce:
    """The attention implementation and checkpointing the model runs with."""
    cfg = getattr(model, "config", None)
    # The older name only where the newer is missing: transformers 5 warns on reading it.
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    return {"attention": getattr(cfg, "_attn_implementation", None),
            "activation_checkpointing": bool(checkpointing)}
