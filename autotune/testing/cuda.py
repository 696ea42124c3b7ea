"""torch.cuda's device and memory calls, recorded instead of made: how the order a trial makes
them in is tested on a machine without a GPU (a CUDA context must exist before the allocator's
statistics can be read or reset)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

CALLS = ("set_device", "set_per_process_memory_fraction", "reset_peak_memory_stats")


@contextlib.contextmanager
def recorded_cuda(total_memory: int = 80 * 2**30) -> Iterator[list[tuple[Any, ...]]]:
    """While the block runs, ``torch.cuda.set_device``, ``set_per_process_memory_fraction`` and
    ``reset_peak_memory_stats`` append ``(name, *args)`` to the yielded list, and
    ``get_device_properties`` answers a device of ``total_memory`` bytes."""
    import torch

    calls: list[tuple[Any, ...]] = []
    saved = {name: getattr(torch.cuda, name) for name in (*CALLS, "get_device_properties")}

    def recorder(name: str) -> Any:
        return lambda *args: calls.append((name, *args))

    try:
        for name in CALLS:
            setattr(torch.cuda, name, recorder(name))
        torch.cuda.get_device_properties = lambda device: SimpleNamespace(
            total_memory=total_memory)
        yield calls
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
