"""A workload's model, sized before any trial runs it: what the memory model of sharding needs to
predict whether each strategy fits (``tuner.sharding``).

A short process of its own (``python -m autotune.trial.sizing``) builds the model on torch's
meta device (no memory, no initialisation), counts its parameters and their bytes, the largest
FSDP unit (a block, or the root's own parameters), and reads its own resident memory after the
imports: what a rank holds before its model. The optimizer's state is taken from the optimizer's
class (AdamW keeps two tensors per parameter) until a trial measures it after a step; the figure
says which. Its output crosses a process boundary: only whole non-negative numbers and a class
name are read back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from typing import Any, TypedDict

from autotune.errors import one_line

# Optimizer state tensors per parameter, by class (those torch ships; amsgrad adds one).
STATES_PER_PARAM = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adagrad": 1,
                    "Adadelta": 2, "RMSprop": 1, "SGD": 1, "Rprop": 2, "ASGD": 3}
ASSUMED_STATES = 2  # an optimizer of another class: assumed Adam-like until a trial measures it
MAX_LINE = 4096
_NUMBERS = ("params", "param_bytes", "largest_unit_bytes", "units", "states_per_param",
            "base_bytes")


class ModelSize(TypedDict):
    """The model's size before training, as the study stores it."""

    params: int
    param_bytes: int  # the whole model's parameters
    largest_unit_bytes: int  # the largest FSDP unit's parameters (a block, or the root's own)
    units: int  # blocks + the root
    optimizer: str  # the optimizer's class name
    states_per_param: int  # optimizer state tensors per parameter (by class, see ``assumed``)
    assumed: bool  # the optimizer's state is from its class, not from a trial's step
    base_bytes: int  # a process's resident memory after its imports, before the model


def size_model(spec: str, params: dict[str, Any], timeout_s: float = 120.0) -> ModelSize:
    """Size the workload ``spec`` in a process of its own; ValueError saying why it failed."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "autotune.trial.sizing", json.dumps(
                {"spec": spec, "params": params})],
            capture_output=True, text=True, timeout=timeout_s,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        raise ValueError(f"sizing the model took more than {timeout_s:.0f}s") from None
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        raise ValueError(f"sizing the model failed: {tail[0][:300]}")
    return parse(done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "")


def parse(text: str) -> ModelSize:
    """The sizing process's line (a few hundred bytes; a longer one is no result), checked."""
    try:
        doc = json.loads(text) if len(text) <= MAX_LINE else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise ValueError(f"sizing the model printed no result: {text[:200]!r}")
    return check(doc)


def check(doc: Mapping[str, Any]) -> ModelSize:
    """A model size as the process printed it or a study stored it: whole non-negative
    numbers and a short class name, else ValueError."""
    bad = [k for k in _NUMBERS if isinstance(doc.get(k), bool)
           or not isinstance(doc.get(k), int) or doc[k] < 0]
    name = doc.get("optimizer")
    if bad or not isinstance(name, str) or len(name) > 100 \
            or not isinstance(doc.get("assumed"), bool):
        raise ValueError(f"sizing the model printed a malformed result ({bad or 'optimizer'})")
    return ModelSize(params=doc["params"], param_bytes=doc["param_bytes"],
                     largest_unit_bytes=doc["largest_unit_bytes"], units=doc["units"],
                     optimizer=name, states_per_param=doc["states_per_param"],
                     assumed=doc["assumed"], base_bytes=doc["base_bytes"])


def _size(spec: str, params: dict[str, Any]) -> ModelSize:
    import psutil
    import torch

    from autotune.trial.shard import blocks_of
    from autotune.workloads import resolve

    workload = resolve(spec, params)
    import transformers  # noqa: F401 - a trial imports it too: part of what a rank holds

    base = int(psutil.Process().memory_info().rss)
    with torch.device("meta"):
        model = workload.build_model()
    total = sum(int(p.numel()) * p.element_size() for p in model.parameters())
    blocks = blocks_of(model, workload)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    units = [sum(int(p.numel()) * p.element_size() for p in b.parameters()) for b in blocks]
    units.append(sum(int(p.numel()) * p.element_size() for p in model.parameters()
                     if id(p) not in in_blocks))
    optimizer = workload.build_optimizer(model)
    name = type(optimizer).__name__
    states = STATES_PER_PARAM.get(name)
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if states is not None and group.get("amsgrad"):
        states += 1
    if name == "SGD" and not group.get("momentum"):
        states = 0
    return ModelSize(params=sum(int(p.numel()) for p in model.parameters()), param_bytes=total,
                     largest_unit_bytes=max(units), units=len(units), optimizer=name,
                     states_per_param=ASSUMED_STATES if states is None else states,
                     assumed=True, base_bytes=base)


def main(argv: list[str]) -> int:
    try:
        doc = json.loads(argv[0])
        print(json.dumps(_size(doc["spec"], dict(doc.get("params") or {}))))
    except Exception as exc:  # noqa: BLE001 - said in one line to the tuner
        print(one_line(exc), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
