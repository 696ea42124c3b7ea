"""What the trial's own step costs over a plain one: both in one process, interleaved.

    python benchmarks/trial_step.py --amp bf16 --blocks 8 --steps 4
    python benchmarks/trial_step.py --model bert --micro 8 --amp off bf16 --json

``benchmarks/observer.py`` compares a trial with a plain loop in separate processes, where one
config's readings move 5-30% from one fresh process to the next on a shared VM: a per-step cost
of a few percent hides in that. Here one process builds the trial's ``Trainer``
(``trial.bench.build``: the config applied, its seeded DataLoader, the GradScaler, the
per-micro-step finiteness check) and times, in turn, blocks of ``--steps`` steps of

  trial    ``Trainer.step``, as the trial's windows run it;
  plain    the user's loop on the same model, optimizer and batches: autocast when the config
           asks for it, backward, ``optimizer.step()``, ``zero_grad``; nothing else;
  checked  the plain step plus the trial's NaN/inf check of the loss (kept on the device);
  scaled   the plain step through the trial's GradScaler (disabled but called, as in a trial
           that does not use fp16 on CUDA).

All share the model, its weights and the allocator's state, so what differs is only what each
step does. Every other round of blocks runs in reverse order. Printed per precision: each
block's samples/s and, for each kind, the median over rounds of its ratio to the plain block of
the same round, with their range. A ratio below 1 is what that step costs that the user's does
not; the range says what this machine lets a few rounds resolve.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.config.knobs import Config  # noqa: E402
from autotune.trial.spec import TrialSpec  # noqa: E402
from autotune.workloads import WorkloadSpec  # noqa: E402


def measure(model: str, config: Config, blocks: int, steps: int, warmup: int) -> dict:
    import torch

    from autotune.trial.bench.build import build
    from autotune.trial.bench.device import Memory, to_device
    from autotune.trial.bench.ranks import Ranks

    device = torch.device("cpu")
    spec = TrialSpec(WorkloadSpec(model, {}), config, "cpu")
    result: dict = {}
    trainer = build(spec, device, Ranks(), result, Memory(device))  # type: ignore[arg-type]
    accum, dtype = config.grad_accum_steps, trainer.amp_dtype

    bad: list = []

    def plain_step(check: bool = False, scaled: bool = False) -> None:
        for _ in range(accum):
            batch = to_device(next(trainer.batches), device, False)
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = trainer.workload.loss(trainer.model, batch) / accum
            if check:
                found = (~torch.isfinite(loss.detach())).sum()
                bad[:] = [found + bad[0] if bad else found]
            (trainer.scaler.scale(loss) if scaled else loss).backward()
        if scaled:
            trainer.scaler.step(trainer.optimizer)
            trainer.scaler.update()
        else:
            trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)

    kinds = {"trial": trainer.step, "plain": plain_step,
             "checked": lambda: plain_step(check=True),
             "scaled": lambda: plain_step(scaled=True)}
    for _ in range(warmup):
        for run in kinds.values():
            run()
    names = list(kinds)
    rates: dict[str, list[float]] = {k: [] for k in names}
    for b in range(blocks):
        for kind in (names if b % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            for _ in range(steps):
                kinds[kind]()
            rates[kind].append(steps * config.samples_per_step / (time.perf_counter() - t))
    ratios = {k: [a / b for a, b in zip(rates[k], rates["plain"], strict=True)]
              for k in names if k != "plain"}
    return {"amp": config.amp, "rates": rates,
            "ratio_median": {k: statistics.median(v) for k, v in ratios.items()},
            "ratio_range": {k: [min(v), max(v)] for k, v in ratios.items()},
            "nonfinite": trainer.nonfinite_steps()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert")
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--amp", nargs="+", default=["off", "bf16"])
    parser.add_argument("--blocks", type=int, default=8, help="rounds of blocks per precision")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per block")
    parser.add_argument("--warmup", type=int, default=2, help="steps of each kind first")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = []
    for amp in args.amp:
        row = measure(args.model, Config(micro_batch_size=args.micro, amp=amp), args.blocks,
                      args.steps, args.warmup)
        out.append(row)
        if not args.json:
            for kind, values in row["rates"].items():
                print(f"amp {amp:<5} {kind:<8}" + " ".join(f"{r:.3f}" for r in values)
                      + " samples/s", flush=True)
            for kind, median in row["ratio_median"].items():
                low, high = row["ratio_range"][kind]
                print(f"amp {amp:<5} {kind}/plain median {median:.3f} (rounds {low:.3f}-"
                      f"{high:.3f})", flush=True)
    if args.json:
        print(json.dumps({"model": args.model, "micro": args.micro, "blocks": args.blocks,
                          "steps": args.steps, "results": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
