"""The memory limit inside a script's trial on a GPU: the caching allocator itself refuses to
pass it, as in the built-in loop, so an over-limit config fails as a real OOM instead of
running on memory the user does not have."""

from __future__ import annotations

import os
import sys
from typing import Any

LIMIT_ENV = "AUTOTUNE_MEMORY_LIMIT_BYTES"


def cap_cuda_allocator(device: Any) -> float | None:
    """Cap this process's allocator on ``device`` (a CUDA device the framework chose) at the
    trial's limit; the fraction set, or None where there is no limit, no CUDA or no device."""
    torch = sys.modules.get("torch")
    raw = os.environ.get(LIMIT_ENV, "")
    if torch is None or not raw.isdigit() or int(raw) <= 0 or device is None:
        return None
    if getattr(device, "type", None) != "cuda" or not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, int(raw) / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction
