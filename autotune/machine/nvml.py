"""NVML: how autotune reads NVIDIA GPUs without creating a CUDA context.

``binding()`` is ``pynvml`` (from nvidia-ml-py). Tests answer from a made-up machine instead by
handing a fake to ``use()`` (``autotune.testing.nvml.FakeNVML``; ``python -m autotune.testing``
does it for a CLI run): this room never imports the fake itself.
"""

from __future__ import annotations

import os
from typing import Any

_injected: Any = None


def use(binding: Any) -> None:
    """Answer every NVML query of this process from ``binding`` (a fake NVML, in tests);
    ``None`` goes back to ``pynvml``."""
    global _injected
    _injected = binding


def binding() -> Any:
    """The NVML binding in use. Raises ImportError when nvidia-ml-py is missing."""
    if _injected is not None:
        return _injected
    import pynvml

    return pynvml


def text(value: Any) -> str:
    """NVML returns bytes from older bindings and str from newer ones."""
    return value.decode() if isinstance(value, bytes) else str(value)


def call(func: Any, *args: Any) -> Any:
    """One NVML query, or None where this GPU or driver does not support it."""
    try:
        return func(*args)
    except Exception:  # NVMLError_NotSupported, NoPermission, FunctionNotFound, ...
        return None


def nvlink_links(nv: Any, handle: Any) -> int | None:
    """Active NVLink links of one GPU; None where NVML has no NVLink (PCIe-only parts)."""
    active, supported = 0, False
    for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
        state = call(nv.nvmlDeviceGetNvLinkState, handle, link)
        if state is None:
            continue
        supported = True
        active += int(state == 1)
    return active if supported else None


def visible_indices(count: int) -> list[int]:
    """NVML indices of the GPUs CUDA_VISIBLE_DEVICES leaves visible (all when unset)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    picked = []
    for part in visible.split(","):
        part = part.strip()
        if not part.isdigit():  # UUIDs, MIG names, "-1": take none rather than guess
            return [] if part in ("", "-1") else list(range(count))
        if int(part) < count:
            picked.append(int(part))
    return picked
