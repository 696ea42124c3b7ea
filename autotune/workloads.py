"""Workloads: what is trained. A small protocol, the built-ins in ``objectives/``, and user modules.

A workload spec is one of
  * a built-in name: ``bert``, ``gpt2``, ``mlp`` (files in ``objectives/``),
  * ``package.module:function`` importable from the current directory or PYTHONPATH,
  * ``path/to/file.py`` (its ``build`` function) or ``path/to/file.py:function``.
The function takes the workload parameters as keyword arguments (``--param seq_len=256``) and must
return quickly: heavy work belongs in ``build_model`` and ``build_dataset``, which run only inside
the trial process.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from autotune.errors import WorkloadError, one_line
from autotune.paths import data_dir

if TYPE_CHECKING:
    import torch


@runtime_checkable
class Workload(Protocol):
    """What a trial trains. ``trial.bench`` owns the loop: autocast, scaling, accumulation,
    timing."""

    name: str
    default_micro_batch: int  # the batch a user would start from without tuning

    def build_model(self) -> torch.nn.Module:
        """A freshly initialised model on the CPU; the trial moves it to the device."""
        ...

    def build_dataset(self) -> torch.utils.data.Dataset[Any]:
        """A map-style dataset whose ``__getitem__`` does the per-sample CPU work of real input."""
        ...

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer: ...

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """Forward pass and loss for one micro-batch already on the model's device."""
        ...

    def flops_per_sample(self) -> float | None:
        """Training FLOPs (forward + backward) per sample, or None when unknown."""
        ...

    # Optional: the model knobs this workload takes (``autotune.config.knobs.DECLARED``):
    # "optimizer_impl" (build_optimizer returns a torch optimizer that takes foreach/fused),
    # "compile" (the model compiles with torch.compile), "attention" and
    # "activation_checkpointing" (a transformers model, or one with set_attn_implementation /
    # gradient_checkpointing_enable). A workload that declares nothing keeps its own
    # behaviour: those knobs stay at their baseline, with the reason printed.
    # supports: tuple[str, ...]


def declared_knobs(workload: Any) -> frozenset[str]:
    """The model knobs ``workload`` declares in ``supports``; a name autotune does not know is
    an error (a typo would otherwise silently search nothing)."""
    from autotune.config.knobs import DECLARED

    names = getattr(workload, "supports", ())
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise WorkloadError(f"workload {getattr(workload, 'name', '?')}: supports must be a "
                            f"tuple of knob names, got {names!r}")
    unknown = sorted(set(names) - set(DECLARED))
    if unknown:
        raise WorkloadError(f"workload {getattr(workload, 'name', '?')} declares unknown knobs "
                            f"{unknown} in supports; known: {list(DECLARED)}")
    return frozenset(names)


@dataclass(frozen=True)
class WorkloadSpec:
    """How to find a workload again in the trial process: the spec string and its params."""

    spec: str
    params: dict[str, Any]

    @property
    def name(self) -> str:
        if self.spec in builtin_workloads():
            return self.spec
        base = self.spec.split(":")[0]
        return Path(base).stem if base.endswith(".py") else base.rsplit(".", 1)[-1]


def builtin_workloads() -> dict[str, Path]:
    root = data_dir("objectives")
    return {p.stem: p for p in sorted(root.glob("*.py")) if not p.name.startswith("_")}


def describe_builtin(path: Path) -> str:
    """First line of an objective's docstring, read without importing it (keeps `list` fast)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def parse_params(items: list[str]) -> dict[str, Any]:
    """``["seq_len=256", "size=tiny"]`` -> ``{"seq_len": 256, "size": "tiny"}``."""
    params: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise WorkloadError(f"--param must look like name=value, got {item!r} "
                                "(e.g. --param seq_len=256)")
        if any(not c.isprintable() for c in raw):
            raise WorkloadError(f"--param {key.strip()} has a value with control characters "
                                f"({raw!r}): use printable characters only")
        params[key.strip()] = _scalar(raw.strip())
    return params


def _scalar(raw: str) -> Any:
    """int, float, bool or None when the text is one, else the text itself."""
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    return raw


def _load_file(path: Path, module_name: str) -> Any:
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise WorkloadError(f"cannot import workload file {path}; it must be a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise WorkloadError(f"workload file {path} fails to import: {one_line(exc)}; "
                            "fix the file (run `python` on it to see the traceback)") from None
    return module


def _builder(spec: str) -> Callable[..., Any]:
    builtins = builtin_workloads()
    if spec in builtins:
        module = _load_file(builtins[spec], f"autotune.objectives.{spec}")
        return module.build
    target, _, func = spec.partition(":")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise WorkloadError(f"workload file {target} does not exist; "
                                "pass an existing .py file, a module:function, or a built-in name")
        module = _load_file(path.resolve(), f"autotune_user_workload_{path.stem}")
    elif func:
        # As `python -m` does: modules next to where the user runs autotune are importable,
        # also under the console script (whose sys.path does not hold the current directory).
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise WorkloadError(f"cannot import workload module {target!r} ({exc}); "
                                "check PYTHONPATH or pass a .py file") from None
        except Exception as exc:
            raise WorkloadError(f"workload module {target!r} fails to import: "
                                f"{one_line(exc)}; fix the module") from None
    else:
        raise WorkloadError(f"unknown model {spec!r}; built-in workloads: "
                            f"{', '.join(builtins)}; or pass pkg.module:function or a .py file")
    func = func or "build"
    builder = getattr(module, func, None)
    if not callable(builder):
        raise WorkloadError(f"workload {spec!r} has no function {func!r}; "
                            f"define `def {func}(**params) -> Workload` in it")
    if not (inspect.isclass(builder) or inspect.isfunction(builder)) \
            or module.__name__.partition(".")[0] in sys.stdlib_module_names:
        # A spec names a workload builder, not any callable: `os:system` with a `command`
        # param would run it.
        raise WorkloadError(f"workload {spec!r} is not a workload builder (a Python function "
                            "or class in your module); pass pkg.module:function or a .py file")
    return builder


def resolve(spec: str, params: Mapping[str, Any] | None = None) -> Workload:
    """Build the workload object (cheap: no model yet). Checks params against the builder."""
    params = dict(params or {})
    builder = _builder(spec)
    signature = inspect.signature(builder)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    accepted = [n for n, p in signature.parameters.items()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [k for k in params if k not in accepted]
    if unknown and not takes_any:
        raise WorkloadError(f"workload {spec} has no parameter {', '.join(unknown)}; "
                            f"it takes: {', '.join(accepted) or 'none'}")
    try:
        workload = builder(**params)
    except (TypeError, ValueError) as exc:
        raise WorkloadError(f"workload {spec} rejected its params {params}: {exc}") from None
    except Exception as exc:
        raise WorkloadError(f"workload {spec}'s builder failed: {one_line(exc)}; "
                            "build() must only create the workload object") from None
    missing = [m for m in ("build_model", "build_dataset", "build_optimizer", "loss")
               if not callable(getattr(workload, m, None))]
    if missing or not isinstance(getattr(workload, "default_micro_batch", None), int):
        raise WorkloadError(f"workload {spec} returned {type(workload).__name__}, which lacks "
                            f"{', '.join(missing) or 'default_micro_batch'}; "
                            "see autotune.workloads.Workload")
    return workload


# A script's micro-batch before tuning, unless --param batch=N says otherwise: Hugging Face
# TrainingArguments' per_device_train_batch_size default.
SCRIPT_DEFAULT_BATCH = 8


@dataclass(frozen=True)
class ScriptWorkload:
    """A training script tuned as it runs (``autotune run -- CMD``): the script owns model, data
    and loop; autotune knows its name and the micro-batch its baseline starts from. Every model
    knob may apply: which ones do is learnt from the baseline trial (``steps.accessed``)."""

    name: str
    default_micro_batch: int = SCRIPT_DEFAULT_BATCH

    @property
    def supports(self) -> tuple[str, ...]:
        from autotune.config.knobs import DECLARED

        return DECLARED


def script_workload(name: str, params: Mapping[str, Any]) -> ScriptWorkload:
    """The script's workload; ``batch`` (its micro-batch without tuning) is its one param."""
    unknown = sorted(set(params) - {"batch"})
    if unknown:
        raise WorkloadError(f"a script takes --param batch=N only (the micro-batch it trains "
                            f"with before tuning), got {', '.join(unknown)}: the script's own "
                            "arguments go after --")
    batch = params.get("batch", SCRIPT_DEFAULT_BATCH)
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise WorkloadError(f"--param batch must be a positive integer, got {batch!r}")
    return ScriptWorkload(name, batch)
