"""FLOPs per sample for a trial's result: the study's figure when the tuner passes one, else
counted here once with PyTorch's FLOP counter (after the windows: it never touches the
measurement), else the workload's own estimate."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

from autotune.errors import one_line
from autotune.trial.bench.device import to_device
from autotune.trial.spec import COUNTED, TrialSpec


class FlopsInfo(TypedDict):
    """FLOPs per sample and where the figure came from, as the result carries them, and why
    counting failed when it was asked for and did."""

    flops_count_error: NotRequired[str]
    flops_per_sample: float | None
    flops_source: str | None


def flops_for(spec: TrialSpec, workload: Any, module: Any, dataset: Any, device: Any,
              amp_dtype: Any) -> FlopsInfo:
    """The study's figure, else one counted here (when asked), else the workload's own."""
    if spec.flops_per_sample:
        return {"flops_per_sample": spec.flops_per_sample, "flops_source": spec.flops_source}
    error = None
    # Counting runs a forward and autograd.grad outside the step: under FSDP that would gather
    # and reduce outside the step's order. The workload's own figure stands there.
    if spec.count_flops and not spec.config.sharded:
        try:
            return {"flops_per_sample": count_flops(workload, module, dataset, device, amp_dtype),
                    "flops_source": COUNTED}
        except Exception as exc:  # noqa: BLE001 - the measurement stands without it
            error = one_line(exc)
    fps = workload.flops_per_sample() if hasattr(workload, "flops_per_sample") else None
    out: FlopsInfo = {"flops_per_sample": float(fps) if fps else None,
                      "flops_source": "workload.flops_per_sample" if fps else None}
    return out if error is None else {"flops_count_error": error, **out}


def count_flops(workload: Any, module: Any, dataset: Any, device: Any, amp_dtype: Any = None,
                samples: int = 2) -> float:
    """Training FLOPs per sample, forward and backward (no optimizer), as PyTorch's FLOP
    counter sees them (matmuls, convolutions, attention), on a batch of ``samples``.

    The backward is ``autograd.grad`` over the parameters: it computes what ``backward()``
    does for the gradients without touching ``.grad`` or DDP's hooks, and, like training,
    nothing for inputs that need no gradient."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    loader = torch.utils.data.DataLoader(dataset, batch_size=samples,
                                         collate_fn=getattr(workload, "collate_fn", None))
    batch = to_device(next(iter(loader)), device, False)
    params = [p for p in module.parameters() if p.requires_grad]
    with FlopCounterMode(display=False) as counter:
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32,
                            enabled=amp_dtype is not None):
            loss = workload.loss(module, batch)
        torch.autograd.grad(loss, params, allow_unused=True)
    return float(counter.get_total_flops()) / samples
