"""The memory model of sharding against measured peaks: each strategy predicted before it runs.

    python benchmarks/sharding_memory.py --model gpt2 --param size=100M --param seq_len=32 \
        --nproc 2 --micro 2 8

Sizes the model (``trial.sizing``), then runs one real N-rank trial (torchrun, gloo on CPU) per
strategy x micro-batch x precision, with no memory limit, and records each trial's measured peak
(on CPU the process tree of all ranks, as the limit counts it). Each strategy is then predicted
the way a run predicts one it has not run: from the model's size and the trials of the *other*
strategies only (``tuner.sharding.ShardingModel``), and the prediction is printed beside the
measured peak with the relative error. The issue's bar is 15% for every strategy that ran.
--json prints one JSON document instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.config.knobs import Config  # noqa: E402
from autotune.machine.hardware import detect  # noqa: E402
from autotune.trial.launch import execute, plan  # noqa: E402
from autotune.trial.measurement import classify  # noqa: E402
from autotune.trial.sizing import size_model  # noqa: E402
from autotune.trial.spec import MeasureSettings, TrialSpec  # noqa: E402
from autotune.tuner.search import Observation  # noqa: E402
from autotune.tuner.sharding import ShardingModel  # noqa: E402
from autotune.workloads import WorkloadSpec, parse_params  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--param", action="append", default=[])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--micro", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--amp", nargs="+", default=["off"])
    ap.add_argument("--strategies", nargs="+",
                    default=["replicated", "shard-grad-op", "full-shard"])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    params = parse_params(args.param)
    hw = detect()
    size = size_model(args.model, params)
    observations: list[Observation] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, (strategy, amp, micro) in enumerate(
                (s, a, m) for s in args.strategies for a in args.amp for m in args.micro):
            config = Config(micro_batch_size=micro, amp=amp, sharding=strategy,
                            world_size=args.nproc)
            spec = TrialSpec(WorkloadSpec(args.model, params), config, device=hw.device,
                             measure=MeasureSettings(max_seconds=args.seconds,
                                                     min_window_s=1.0))
            m = classify(execute(plan(spec, workdir=Path(tmp) / str(n), timeout_s=600)))
            observations.append(Observation(
                config, m.status, m.samples_per_sec, m.peak_memory_bytes, m.spread_cv,
                number=n, model_state=dict(m.applied.get("model_state") or {}) or None))
            if not args.json:
                rate = f", {m.samples_per_sec:.2f} samples/s" if m.samples_per_sec else ""
                print(f"trial {n}: {config.describe()}: {m.status.value}, peak "
                      f"{m.peak_memory_bytes / 2**30:.2f} GiB{rate}", flush=True)
    rows: list[dict[str, Any]] = []
    for o in observations:
        others = [x for x in observations if x.config.sharding != o.config.sharding]
        model = ShardingModel(size, others, hw.device, args.nproc)
        peak = model.predict(o.config)
        rows.append({"config": o.config.describe(), "status": o.status.value,
                     "measured_gib": o.peak_memory_bytes / 2**30,
                     "predicted_gib": peak.counted / 2**30,
                     "error": peak.counted / o.peak_memory_bytes - 1.0
                     if o.peak_memory_bytes else None, "basis": peak.basis})
    if args.json:
        print(json.dumps({"size": size, "rows": rows}, indent=2))
        return 0
    print(f"\nmodel: {size['params'] / 1e6:.1f}M parameters; {hw.describe()}")
    print(f"{'config':<58} {'measured':>9} {'predicted':>9} {'error':>7}")
    for r in rows:
        err = f"{100 * r['error']:+.0f}%" if r["error"] is not None else "-"
        print(f"{r['config']:<58} {r['measured_gib']:>8.2f}G {r['predicted_gib']:>8.2f}G "
              f"{err:>7}")
    worst = max((abs(r["error"]) for r in rows if r["error"] is not None), default=0.0)
    print(f"largest error: {100 * worst:.0f}% (each strategy predicted from the others' trials)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
