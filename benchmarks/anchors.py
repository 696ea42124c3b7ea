"""The real batch-size finders on the same workload, side by side with autotune's pick.

    pip install accelerate            # not a dependency of autotune
    python benchmarks/anchors.py --workload bert --profile studies/<study>/profile.yaml

Runs accelerate's ``find_executable_batch_size`` (the mechanism behind Hugging Face Trainer's
``auto_find_batch_size``: start at 128, halve on OOM) on the workload of a search-benchmark grid,
in this process, and takes the batch it returns. Then it measures that batch (fp32, no
accumulation, no loader workers: what the finder leaves as it was) and the profile's config in
fresh trial processes, interleaved (A B A B ...), and prints both medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from search_efficiency import GRIDS  # noqa: E402

from autotune.config.knobs import Config  # noqa: E402
from autotune.machine.hardware import detect  # noqa: E402
from autotune.profile import load_profile  # noqa: E402
from autotune.trial.launch import execute, plan  # noqa: E402
from autotune.trial.measurement import classify  # noqa: E402
from autotune.trial.spec import MeasureSettings, TrialSpec  # noqa: E402
from autotune.workloads import (
    WorkloadSpec,  # noqa: E402
    resolve,  # noqa: E402
)


def accelerate_pick(grid: dict[str, Any]) -> int:
    import torch
    from accelerate.utils import find_executable_batch_size

    workload = resolve(grid["spec"], grid["params"])

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size: int) -> int:
        model = workload.build_model()
        opt = workload.build_optimizer(model)
        loader = torch.utils.data.DataLoader(workload.build_dataset(), batch_size=batch_size)
        for step, batch in enumerate(loader):
            loss = workload.loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step == 1:
                break
        return batch_size

    return int(train())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(GRIDS), required=True)
    parser.add_argument("--profile", type=Path, required=True, help="autotune's profile")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    grid = GRIDS[args.workload]
    hw = detect()
    ours = load_profile(args.profile, check_fingerprint=False).config
    picked = accelerate_pick(grid)
    theirs = Config(micro_batch_size=picked)
    rates: dict[str, list[float]] = {"accelerate": [], "autotune": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, config in (("accelerate", theirs), ("autotune", ours)):
                p = plan(TrialSpec(WorkloadSpec(grid["spec"], grid["params"]), config,
                                   device=hw.device,
                                   measure=MeasureSettings.from_dict(grid["measure"])),
                         workdir=Path(tmp) / f"{r}-{name}", timeout_s=180)
                m = classify(execute(p), hw.device)
                if m.ok and m.samples_per_sec:
                    rates[name].append(m.samples_per_sec)
                print(f"round {r + 1} {name}: {m.status} {m.samples_per_sec or 0:.2f} samples/s",
                      file=sys.stderr, flush=True)
    med = {k: statistics.median(v) if v else None for k, v in rates.items()}
    report = {"workload": args.workload, "accelerate_batch": picked,
              "autotune_config": ours.to_dict(), "samples_per_sec": rates, "median": med,
              "ratio": (med["autotune"] / med["accelerate"]) if med["autotune"]
              and med["accelerate"] else None, "hardware": hw.describe()}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"accelerate find_executable_batch_size picked batch {picked}: "
              f"{med['accelerate'] or 0:.2f} samples/s; autotune's config: "
              f"{med['autotune'] or 0:.2f} samples/s; ratio {report['ratio'] or 0:.2f}x "
              f"(medians of {args.rounds} interleaved rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
