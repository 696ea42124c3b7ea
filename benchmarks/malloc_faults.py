"""What glibc's default costs a CPU training step: page faults and samples/sec, with and without
``malloc_retain``, in a plain loop (no autotune trial around it).

    python benchmarks/malloc_faults.py --runs 3
    python benchmarks/malloc_faults.py --runs 2 --batch 8 --amp off

Each run is a fresh process that builds BERT-base (random init, seq_len 128), trains ``--steps``
steps of it with AdamW (the workload's own optimizer, as built) under bf16 autocast (or fp32),
and prints its samples/sec over the steps after the first two and its minor page faults per
step (``getrusage``). The modes alternate (default, retained, default, ...), so a machine that
drifts weighs on both. Retained is ``trial.apply.retain_freed_memory``, what the knob applies.
--json prints one JSON document instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LOOP = """
import json, resource, sys, time
import torch
from transformers import BertConfig, BertForMaskedLM
from autotune.trial.apply import retain_freed_memory
mode, batch, steps, amp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if mode == "retained":
    assert retain_freed_memory()
torch.manual_seed(0)
model = BertForMaskedLM(BertConfig(max_position_embeddings=512))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
ids = torch.randint(5, 30522, (batch, 128))
times, faults = [], []
for _ in range(steps):
    before, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp == "bf16"):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"samples_per_sec": batch * len(times[2:]) / sum(times[2:]),
                  "faults_per_step": sorted(faults[2:])[len(faults[2:]) // 2],
                  "step_s": times}))
"""


def run(mode: str, batch: int, steps: int, amp: str) -> dict:
    out = subprocess.run([sys.executable, "-c", LOOP, mode, str(batch), str(steps), amp],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="processes per mode")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--amp", choices=("bf16", "off"), default="bf16")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    found: dict[str, list[dict]] = {"default": [], "retained": []}
    for i in range(args.runs):
        for mode in found:
            found[mode].append(run(mode, args.batch, args.steps, args.amp))
            if not args.json:
                r = found[mode][-1]
                print(f"run {i + 1} {mode:8} {r['samples_per_sec']:.2f} samples/s, "
                      f"{r['faults_per_step']:,} minor faults per step", flush=True)
    doc = {mode: {"samples_per_sec": [r["samples_per_sec"] for r in rs],
                  "median": statistics.median(r["samples_per_sec"] for r in rs),
                  "faults_per_step": [r["faults_per_step"] for r in rs]}
           for mode, rs in found.items()}
    doc["ratio"] = doc["retained"]["median"] / doc["default"]["median"]
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"median: default {doc['default']['median']:.2f}, retained "
          f"{doc['retained']['median']:.2f} samples/s: {doc['ratio']:.2f}x "
          f"(BERT-base, micro-batch {args.batch}, {args.amp}, {args.runs} processes each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
