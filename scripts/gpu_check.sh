#!/usr/bin/env bash
# One GPU check, run on a lent GPU machine from the repository root (see the device notes in
# ../shared/GPU.md): the gpu tests, then a short real BERT study with AMP, a memory limit low enough
# to put a wall inside the space (the memory model and the staged start meet it), the baseline and
# the confirmation. Everything it produces goes under $OUT.
set -uo pipefail
OUT="${OUT:-gpu-out}"
STUDY_TIMEOUT="${STUDY_TIMEOUT:-5m}"
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
timeout 170 python3 -m pytest -q -m "gpu or multi_gpu" > "$OUT/gpu-tests.log" 2>&1
echo "gpu tests rc=$?" | tee -a "$OUT/summary.txt"
mkdir -p "$OUT/run" && cd "$OUT/run" || exit 1
timeout 420 python3 -m autotune run --model bert --timeout "$STUDY_TIMEOUT" --memory-limit 24GiB \
  --trial-seconds 15 --storage "sqlite:///$PWD/autotune.db" > run.log 2>&1
echo "study rc=$?" | tee -a ../summary.txt
# Every trial's config, outcome and peak memory, for the memory model's unit test and the note.
python3 - > trials.json <<'EOF'
import json, optuna
url = "sqlite:///autotune.db"
study = optuna.load_study(study_name=optuna.get_all_study_names(url)[0], storage=url)
rows = []
for t in study.trials:
    a, m = t.user_attrs, t.user_attrs.get("measurement") or {}
    c = a.get("config") or {}
    rows.append({"n": t.number, "state": t.state.name, "status": a.get("status"),
                 "micro": c.get("micro_batch_size"), "accum": c.get("grad_accum_steps"),
                 "amp": c.get("amp"), "workers": c.get("num_workers"),
                 "samples_per_sec": m.get("samples_per_sec"), "peak": m.get("peak_memory_bytes"),
                 "predicted_peak": m.get("predicted_peak_memory_bytes"),
                 "reason": a.get("reason"), "stage": a.get("stage"), "wall_s": m.get("wall_s")})
print(json.dumps({"trials": rows, "confirmation": study.user_attrs.get("confirmation")}, indent=1))
EOF
tail -40 run.log
