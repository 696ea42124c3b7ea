"""Does a trial measure what the user's own loop gets? A trial and a plain loop, interleaved.

    python benchmarks/observer.py --rounds 3             # bert, 8x1, fp32 and bf16, 10 s windows
    python benchmarks/observer.py --model bert --micro 8 --amp bf16 --rounds 3 --json

Each round runs, for each precision, every kind twice in a mirrored order (``plain trial trial
plain``, then ``trial plain plain trial`` the next round), so that a drift over the round weighs
on every kind alike; a kind's rate in a round is the mean of its two runs:
  trial   the tuner's own path: ``trial.launch.execute`` of a planned trial, followed as a run
          follows it (progress tailed, the process tree's memory sampled, pruning asked, at the
          interval a run uses for these windows); its samples/s (median of its windows), with
          windows of ``--window-seconds`` (10 s: several steps each, so that a round's figure is
          not one step's luck) within ``--trial-seconds``;
  bare    the same trial process with no one watching (``python -m autotune.trial.bench``, the
          tuner waiting on it): what the in-trial loop costs, apart from the observer;
  plain   a plain PyTorch loop of the same workload and config (``--plain``, below): the model,
          optimizer and data of the workload, autocast when the config asks for it, one
          optimizer step per iteration; warm-up steps as the trial's, then as many windows as the
          last trial timed, of as many steps as its windows held, their median.
Printed per round and precision: each kind's rate; at the end, per precision, the median over
rounds of the trial/plain (and bare/plain) ratio with a 90% bootstrap interval over the rounds,
and the noise: the median gap between the two runs of one kind in a round, what one process reads
against the next with nothing changed. A ratio resolves a 3% difference only where its interval
is narrower than that. Timing ratios live here, not in the test suite: a shared machine drifts
20-30% within minutes, which is why the kinds run back to back in every round.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autotune.config.knobs import Config  # noqa: E402
from autotune.trial.launch import execute, plan, poll_interval  # noqa: E402
from autotune.trial.measurement import classify  # noqa: E402
from autotune.trial.protocol import WindowStats  # noqa: E402
from autotune.trial.spec import MeasureSettings, TrialSpec  # noqa: E402
from autotune.workloads import WorkloadSpec  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def trial(spec: TrialSpec, folder: Path) -> tuple[float, int, int]:
    """The tuner's path: samples/s, windows and steps per window."""
    events: list[dict] = []
    m = classify(execute(plan(spec, workdir=folder, timeout_s=600), on_event=events.append,
                         should_stop=lambda: None,
                         poll_s=poll_interval(spec.measure.min_window_s)), "cpu")
    if not m.ok or not m.samples_per_sec:
        raise SystemExit(f"trial: {m.status}: {m.reason}")
    return m.samples_per_sec, len(m.windows), int(m.windows[-1].get("steps") or 1)


def bare(spec: TrialSpec, folder: Path) -> tuple[float, int, int]:
    """The trial process alone, no one watching it."""
    folder.mkdir(parents=True)
    (folder / "spec.json").write_text(json.dumps(spec.to_json()))
    subprocess.run([sys.executable, "-m", "autotune.trial.bench", str(folder / "spec.json"),
                    str(folder / "result.json")], env=ENV, check=True, timeout=600,
                   stdout=subprocess.DEVNULL)
    doc = json.loads((folder / "result.json").read_text())
    if doc["status"] != "ok":
        raise SystemExit(f"bare: {doc['status']}: {doc['reason']}")
    stats = WindowStats(doc["windows"])
    return stats.median, len(doc["windows"]), int(doc["windows"][-1].get("steps") or 1)


def plain(model: str, config: Config, warmup: int, windows: int, steps: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--plain", model, json.dumps(config.to_dict()),
                          str(warmup), str(windows), str(steps)], env=ENV, check=True,
                         timeout=900, capture_output=True, text=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["median"])


def plain_loop(model: str, config_json: str, warmup: int, windows: int, per_window: int) -> None:
    """The user's loop: nothing but the workload, the config's batch size and precision."""
    import torch

    from autotune.workloads import resolve

    config = Config.from_dict(json.loads(config_json))
    torch.manual_seed(0)
    workload = resolve(model, {})
    net = workload.build_model()
    net.train()
    optimizer = workload.build_optimizer(net)
    loader = torch.utils.data.DataLoader(
        workload.build_dataset(), batch_size=config.micro_batch_size, shuffle=True,
        drop_last=True, collate_fn=getattr(workload, "collate_fn", None))
    dtype = torch.bfloat16 if config.amp == "bf16" else None

    def batches():
        while True:
            yield from loader

    stream = batches()

    def step() -> None:
        for _ in range(config.grad_accum_steps):
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = workload.loss(net, next(stream)) / config.grad_accum_steps
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    rates = []
    for _ in range(windows):
        t = time.perf_counter()
        for _ in range(per_window):
            step()
        rates.append(per_window * config.samples_per_step / (time.perf_counter() - t))
    print(json.dumps({"median": statistics.median(rates), "rates": rates}))


def interval(values: list[float], draws: int = 2000) -> tuple[float, float, float]:
    """The median of ``values`` and a 90% bootstrap interval for it (seeded: reruns agree)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                     for _ in range(draws))
    return (statistics.median(values), medians[int(0.05 * draws)], medians[int(0.95 * draws) - 1])


def summarize(rows: list[dict], kinds: list[str]) -> dict:
    """Per precision: each kind's ratio to the plain loop over rounds, and the same-kind noise."""
    ratios = {f"{kind}/plain": interval([x[kind] / x["plain"] for x in rows])
              for kind in kinds if kind != "plain" and "plain" in kinds}
    gaps = [abs(a / b - 1) for x in rows for a, b in [x["runs"][k] for k in kinds]]
    return {"rounds": len(rows), "ratios": ratios, "noise": statistics.median(gaps)}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--plain":
        plain_loop(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]),
                   int(sys.argv[6]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert")
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--window-seconds", type=float, default=10.0)
    parser.add_argument("--trial-seconds", type=float, default=100.0)
    parser.add_argument("--amp", nargs="+", default=["off", "bf16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kinds", nargs="+", default=["trial", "bare", "plain"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    settings = MeasureSettings(min_window_s=args.window_seconds, max_seconds=args.trial_seconds)
    rows: list[dict] = []
    shape = {amp: [3, 1] for amp in args.amp}  # windows and steps per window, per precision
    with tempfile.TemporaryDirectory(prefix="autotune-observer-") as tmp:
        for r in range(args.rounds):
            for amp in args.amp:
                config = Config(micro_batch_size=args.micro, amp=amp)
                spec = TrialSpec(WorkloadSpec(args.model, {}), config, "cpu", settings)
                row: dict = {"round": r + 1, "amp": amp}
                # Mirrored within the round (A B B A), and the mirror turned every other round, so
                # that neither a drift across the round nor going first favours one kind.
                kinds = args.kinds if r % 2 == 0 else args.kinds[::-1]
                runs: dict[str, list[float]] = {k: [] for k in args.kinds}
                for i, kind in enumerate(kinds + kinds[::-1]):
                    folder = Path(tmp) / f"{r}-{amp}-{kind}-{i}"
                    if kind == "trial":
                        rate, *shape[amp] = trial(spec, folder)
                    elif kind == "bare":
                        rate, *shape[amp] = bare(spec, folder)
                    else:  # as many windows of as many steps as the last trial timed
                        rate = plain(args.model, config, settings.warmup_min_steps + 1,
                                     *shape[amp])
                    runs[kind].append(rate)
                row.update({k: statistics.fmean(v) for k, v in runs.items()}, runs=runs)
                rows.append(row)
                if not args.json:
                    print(f"round {r + 1} amp {amp:<5} " + "  ".join(
                        f"{k} {row[k]:.3f} ({' '.join(f'{x:.3f}' for x in runs[k])})"
                        for k in args.kinds) + " samples/s", flush=True)
    summary = {amp: summarize([x for x in rows if x["amp"] == amp], args.kinds)
               for amp in args.amp}
    if args.json:
        print(json.dumps({"model": args.model, "micro": args.micro, "rounds": rows,
                          "summary": summary}, indent=1))
    else:
        for amp, found in summary.items():
            for name, (median, low, high) in found["ratios"].items():
                print(f"{amp} {name}: median {median:.3f} over {found['rounds']} rounds, "
                      f"90% interval {low:.3f}-{high:.3f}")
            print(f"{amp} noise: one run of a kind against its twin in the round, median gap "
                  f"{found['noise']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
