#!/usr/bin/env bash
# One GPU check, run on a lent GPU machine from the repository root (see the device notes in
# ../shared/GPU.md): the gpu tests, then a short real BERT study with AMP, the memory limit and the
# baseline. Everything it produces goes under $OUT.
set -uo pipefail
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -m pytest -q -m "gpu or multi_gpu" > "$OUT/gpu-tests.log" 2>&1
echo "gpu tests rc=$?" | tee -a "$OUT/summary.txt"
mkdir -p "$OUT/run" && cd "$OUT/run" || exit 1
timeout 420 python3 -m autotune run --model bert --trials 8 --trial-seconds 20 \
  --storage "sqlite:///$PWD/autotune.db" > run.log 2>&1
echo "study rc=$?" | tee -a ../summary.txt
tail -20 run.log
