"""What the user sees in their own logs: the Trainer's ``train_samples_per_second`` of an
unchanged Hugging Face script, run as the user runs it and under ``autotune launch PROFILE --``
(the profile applied by the bootstrap, no edit), in interleaved rounds; beside the speedup the
profile claims.

    python benchmarks/trainer_logs.py PROFILE --rounds 3 [--max-steps 8] [--size base]

PROFILE is a study's profile.yaml of ``benchmarks/scripts/hf_bert_unchanged.py`` (e.g. the
script study of ``benchmarks/script_vs_builtin.py --timeout default``). Each round runs the
script plainly, then launched with the profile, one after the other, each for --max-steps
optimizer steps. Prints each run's figure, the median of each side, their ratio, and the
profile's claimed speedup. The Trainer's figure spans its whole train() call (its first,
slower steps included), as the user reads it; the profile's is steady-state windows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "scripts" / "hf_bert_unchanged.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def run(launched: Path | None, size: str, steps: int, out: Path) -> float:
    """One run of the script; the Trainer's train_samples_per_second."""
    command = [sys.executable, str(SCRIPT), "--size", size, "--output_dir", str(out),
               "--max_steps", str(steps), "--save_strategy", "no", "--report_to", "none",
               "--dataloader_drop_last", "true", "--learning_rate", "1e-4"]
    if launched is not None:
        command = [sys.executable, "-m", "autotune", "launch", str(launched), "--", *command]
    done = subprocess.run(command, capture_output=True, text=True, env=ENV, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"run failed ({done.returncode}): {done.stderr[-2000:]}")
    return float(json.loads(lines[-1])["metrics"]["train_samples_per_second"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--size", default="base", choices=("base", "tiny"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from autotune.profile import load_profile

    profile = load_profile(args.profile, check_fingerprint=False)
    plain, tuned = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            plain.append(run(None, args.size, args.max_steps, Path(tmp) / f"plain-{r}"))
            tuned.append(run(args.profile, args.size, args.max_steps, Path(tmp) / f"tuned-{r}"))
            print(f"round {r + 1}: as the user runs it {plain[-1]:.3f} samples/s, with "
                  f"`autotune launch` {tuned[-1]:.3f} samples/s", flush=True)
    a, b = statistics.median(plain), statistics.median(tuned)
    print(f"\nthe Trainer's own train_samples_per_second, median of {args.rounds}: "
          f"{a:.3f} -> {b:.3f} ({b / a:.2f}x)")
    print(f"the profile's config: {profile.config.describe()}; its claimed speedup: "
          f"{profile.speedup}x over {profile.baseline.get('config', {}).get('micro_batch_size')}"
          "-sample micro-batches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
