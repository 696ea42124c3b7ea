"""What torch.compile costs per trial on this machine, and what the study's shared cache saves.

    python benchmarks/compile_cache.py                       # BERT-base, micro-batch 8
    python benchmarks/compile_cache.py --model bert --param size=tiny --micro 16

Four real trial processes, in order, sharing one fresh Inductor cache as a study's trials do:
eager (the same config, not compiled: the payback reference), compiled with a cold cache,
compiled again (warm cache, same shapes), and compiled at twice the micro-batch (warm cache, new
shapes). Prints each trial's compiling step, its steady step and samples/sec, and when compiling
pays for itself. --json prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.config.knobs import Config  # noqa: E402
from autotune.machine.hardware import detect  # noqa: E402
from autotune.trial.launch import execute, plan  # noqa: E402
from autotune.trial.measurement import classify  # noqa: E402
from autotune.trial.spec import MeasureSettings, TrialSpec  # noqa: E402
from autotune.workloads import WorkloadSpec, parse_params  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert")
    parser.add_argument("--param", action="append", default=[])
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--mode", default="default")
    parser.add_argument("--trial-seconds", type=float, default=30.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    hw = detect()
    amp = "bf16" if hw.supports_bf16 else "off"
    workload = WorkloadSpec(args.model, parse_params(args.param))
    base = Config(micro_batch_size=args.micro, amp=amp)
    runs = [("eager", base),
            ("compiled, cold cache", Config(**{**base.to_dict(), "compile": args.mode})),
            ("compiled, warm cache", Config(**{**base.to_dict(), "compile": args.mode})),
            (f"compiled, warm cache, micro {2 * args.micro}",
             Config(**{**base.to_dict(), "compile": args.mode,
                       "micro_batch_size": 2 * args.micro}))]
    settings = MeasureSettings(max_seconds=args.trial_seconds, max_compile_s=900)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        env = {"TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "compile-cache")}
        for i, (name, config) in enumerate(runs):
            spec = TrialSpec(workload, config, hw.device, settings)
            raw = execute(plan(spec, workdir=Path(tmp) / str(i), extra_env=env,
                               timeout_s=settings.max_compile_s + 3 * args.trial_seconds + 120))
            m = classify(raw, hw.device)
            if not m.ok or not m.samples_per_sec:
                print(f"{name}: {m.status}: {m.reason}", file=sys.stderr)
                return 1
            step = config.samples_per_step / m.samples_per_sec
            rows.append({"trial": name, "config": config.describe(),
                         "compile_step_s": m.timings.get("compile_step_s"),
                         "compile_s": m.compile.get("seconds"), "step_s": round(step, 4),
                         "samples_per_sec": round(m.samples_per_sec, 3),
                         "wall_s": round(m.wall_s, 1)})
            if not args.json:
                r = rows[-1]
                print(f"{name:<34} compile step {_s(r['compile_step_s'])}, compiling "
                      f"{_s(r['compile_s'])}, steady step {step:.3f}s, "
                      f"{m.samples_per_sec:.3f} samples/s, trial wall {m.wall_s:.0f}s",
                      flush=True)
    eager, cold, warm = rows[0], rows[1], rows[2]
    saved = eager["step_s"] - cold["step_s"]
    doc = {"hardware": hw.describe(), "model": args.model, "params": workload.params,
           "mode": args.mode, "trials": rows,
           "speedup_compiled_vs_eager": round(eager["step_s"] / cold["step_s"], 4),
           "cache_saves_s": round(cold["compile_step_s"] - warm["compile_step_s"], 2),
           "payback_steps": math.ceil(cold["compile_s"] / saved) if saved > 0 else None}
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        pays = (f"pays for itself after {doc['payback_steps']} steps (cold cache)"
                if doc["payback_steps"] else "never pays: not faster than eager")
        print(f"compiled vs eager {doc['speedup_compiled_vs_eager']:.3f}x per step; the shared "
              f"cache saves {doc['cache_saves_s']:.1f}s on the second trial; {pays}")
    return 0


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


if __name__ == "__main__":
    sys.exit(main())
