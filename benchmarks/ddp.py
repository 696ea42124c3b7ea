"""Multi-rank trials side by side: what no_sync accumulation gains, and how bucket sizes compare.

    python benchmarks/ddp.py --model bert --nproc 2 --amp bf16 --micro-batch 4 --accum 4

Two experiments, each run as real N-rank trials (torchrun; gloo on CPU, nccl on GPUs), with the
configs interleaved round by round (A B A B ...) so slow drift of the machine hits both alike:

  no_sync   the same global batch (micro x accum x ranks), once all-reducing gradients only on
            the last micro-step (no_sync on the others, as autotune's trials do) and once on
            every micro-step (what a DDP loop without no_sync does);
  buckets   accumulation 1 (every step all-reduces), one trial per --buckets size;
  hook      (--hook-rounds) accumulation 1, with and without the communication hook that times
            the all-reduce: what measuring the communication costs the measured config.

Prints each trial, then per config the median samples/sec and the exposed all-reduce share of the
step, and the ratios. --json prints one JSON document instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.config.knobs import Config  # noqa: E402
from autotune.machine.hardware import detect  # noqa: E402
from autotune.trial.launch import execute, plan  # noqa: E402
from autotune.trial.measurement import classify  # noqa: E402
from autotune.trial.spec import MeasureSettings, TrialSpec  # noqa: E402
from autotune.workloads import (
    WorkloadSpec,  # noqa: E402
    parse_params,  # noqa: E402
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert")
    parser.add_argument("--param", action="append", default=[])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--amp", default="bf16")
    parser.add_argument("--buckets", default="10,25,50,100,200",
                        help="bucket sizes in MB for the bucket sweep; empty to skip it")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the no_sync pair")
    parser.add_argument("--bucket-rounds", type=int, default=1)
    parser.add_argument("--hook-rounds", type=int, default=0)
    parser.add_argument("--trial-seconds", type=float, default=60.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    hw = detect()
    params = parse_params(args.param)
    base = Config(micro_batch_size=args.micro_batch, grad_accum_steps=args.accum, amp=args.amp,
                  world_size=args.nproc)
    report: dict[str, Any] = {"model": args.model, "params": params,
                              "hardware": hw.describe(), "nproc": args.nproc}

    def trial(tmp: Path, name: str, config: Config, **measure: Any) -> dict[str, Any]:
        p = plan(TrialSpec(WorkloadSpec(args.model, params), config, device=hw.device,
                           measure=MeasureSettings.from_dict(
                               {"max_seconds": args.trial_seconds, **measure})),
                 workdir=tmp / name, timeout_s=max(300, 4 * args.trial_seconds))
        m = classify(execute(p), hw.device)
        row = {"name": name, "status": m.status, "reason": m.reason,
               "samples_per_sec": m.samples_per_sec, "spread_cv": m.spread_cv,
               "comm_wait": m.breakdown.get("comm_wait"), "windows": len(m.windows),
               "buckets_per_sync": (m.ranks[0].get("comm") or {}).get("buckets_per_sync")
               if m.ranks else None, "wall_s": round(m.wall_s, 1)}
        if not args.json:
            comm = row["comm_wait"]
            wait = f"{100 * comm:.0f}% of the step" if comm is not None else "not timed"
            print(f"  {name:<22} {m.status} {m.samples_per_sec or 0:.3f} samples/s, all-reduce "
                  f"wait {wait}, "
                  f"{row['windows']} windows, {m.wall_s:.0f}s" + (f" ({m.reason})"
                                                                   if m.reason else ""),
                  flush=True)
        return row

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        if args.accum > 1 and args.rounds > 0:
            if not args.json:
                print(f"no_sync: global batch {base.samples_per_step} = {args.micro_batch} x "
                      f"{args.accum} x {args.nproc} ranks, {args.amp}", flush=True)
            rows: dict[str, list[dict[str, Any]]] = {"no_sync": [], "sync_each_micro": []}
            for r in range(args.rounds):
                rows["no_sync"].append(trial(tmp, f"no_sync-{r}", base))
                rows["sync_each_micro"].append(
                    trial(tmp, f"sync_each_micro-{r}", base, sync_each_micro=True))
            summary = {k: _median(v) for k, v in rows.items()}
            gain = _ratio(summary["no_sync"], summary["sync_each_micro"])
            report["no_sync"] = {"config": base.to_dict(), "trials": rows, "median": summary,
                                 "gain": gain}
            if not args.json:
                print(f"  median: no_sync {summary['no_sync']['samples_per_sec']}, every "
                      f"micro-step {summary['sync_each_micro']['samples_per_sec']}: "
                      f"no_sync is {gain}x", flush=True)
        sizes = [int(b) for b in args.buckets.split(",") if b.strip()]
        if sizes:
            one = replace(base, grad_accum_steps=1)
            if not args.json:
                print(f"buckets: {args.micro_batch} x 1 x {args.nproc} ranks, {args.amp}",
                      flush=True)
            by_size: dict[int, list[dict[str, Any]]] = {b: [] for b in sizes}
            for r in range(args.bucket_rounds):
                for b in sizes:
                    by_size[b].append(trial(tmp, f"bucket{b}MB-{r}",
                                            replace(one, ddp_bucket_cap_mb=b)))
            medians = {b: _median(v) for b, v in by_size.items()}
            ref = medians.get(25) or medians[sizes[0]]
            report["buckets"] = {"config": one.to_dict(), "trials": by_size, "median": medians,
                                 "ratio_to_25MB": {b: _ratio(m, ref) for b, m in medians.items()}}
            if not args.json:
                for b, m in medians.items():
                    print(f"  {b:>4} MB: {m['samples_per_sec']} samples/s, all-reduce wait "
                          f"{m['comm_wait']}, {_ratio(m, ref)}x the 25 MB default", flush=True)
        if args.hook_rounds > 0:
            one = replace(base, grad_accum_steps=1)
            if not args.json:
                print(f"hook: {args.micro_batch} x 1 x {args.nproc} ranks, {args.amp}", flush=True)
            hook_rows: dict[str, list[dict[str, Any]]] = {"hook": [], "no_hook": []}
            for r in range(args.hook_rounds):
                hook_rows["hook"].append(trial(tmp, f"hook-{r}", one))
                hook_rows["no_hook"].append(trial(tmp, f"no_hook-{r}", one, time_comm=False))
            hook_medians = {k: _median(v) for k, v in hook_rows.items()}
            cost = _ratio(hook_medians["hook"], hook_medians["no_hook"])
            report["hook"] = {"config": one.to_dict(), "trials": hook_rows,
                              "median": hook_medians, "ratio_hook_to_no_hook": cost}
            if not args.json:
                print(f"  median: with the hook {hook_medians['hook']['samples_per_sec']}, "
                      f"without {hook_medians['no_hook']['samples_per_sec']}: {cost}x", flush=True)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return {"samples_per_sec": None, "comm_wait": None, "runs": 0}
    return {"samples_per_sec": round(statistics.median(r["samples_per_sec"] for r in ok), 4),
            "comm_wait": round(statistics.median(r["comm_wait"] or 0.0 for r in ok), 4),
            "runs": len(ok)}


def _ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    if not a["samples_per_sec"] or not b["samples_per_sec"]:
        return None
    return round(a["samples_per_sec"] / b["samples_per_sec"], 3)


if __name__ == "__main__":
    raise SystemExit(main())
