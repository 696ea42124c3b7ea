#!/usr/bin/env bash
# One GPU check, run on a lent GPU machine from the repository root (see the device notes in
# ../shared/GPU.md). Sections, each skippable so a short device lease goes where it is needed:
#   tests   (GPU_TESTS=0 skips)  the gpu tests, NCCL facts, and what NCCL says to 2 ranks on 1 GPU
#   probe                        `autotune probe` on real NVML: links, copies, peaks, flags
#   study                        a short real BERT study: AMP, a 24 GiB limit that puts a wall in
#                                the space, the baseline (and the confirmation, if it fits)
#   profile (GPU_PROFILE=0 skips) the plain-PyTorch example trains with the exported profile
#                                (reproduction ratio) and `autotune profile check` re-measures it
#   script (GPU_SCRIPT=0 skips)  a Hugging Face Trainer script tuned as it runs (`autotune run --
#                                python3 benchmarks/scripts/hf_bert.py`): the step protocol, the
#                                callback's data wait and the script's own peak memory on CUDA
#   roofline (GPU_ROOFLINE=0 skips) BERT-base and GPT-2 small with no memory limit: open-ended
#                                batches, the diagnosis-led stages (compile, fused AdamW, TF32,
#                                attention, checkpointing), MFU and what limits each winner
# Outputs under $OUT, few files (the device returns a limited number): summary.txt (every short
# result), gpu-tests.log, probe.txt, probe.json, run.log, trials.json, profile.yaml.
set -uo pipefail
ROOT="$PWD"
OUT="${OUT:-gpu-out}"
STUDY_TIMEOUT="${STUDY_TIMEOUT:-5m}"
mkdir -p "$OUT"
S="$OUT/summary.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$S" 2>&1

if [ "${GPU_TESTS:-1}" = 1 ]; then
  timeout 170 python3 -m pytest -q -m "gpu or multi_gpu" > "$OUT/gpu-tests.log" 2>&1
  echo "gpu tests rc=$?" >> "$S"
  # NCCL here: its version and what the default space keeps of the NCCL knobs for 2 ranks.
  python3 - >> "$S" 2>&1 <<'PY'
from autotune.machine.hardware import detect
from autotune.config.knobs import Config
from autotune.config.space import load_space, narrow
hw = detect()
print("nccl", hw.nccl_version, "gpus", len(hw.gpus))
space = narrow(load_space("default"), hw, 2, Config(world_size=2))
for name in ("nccl_algo", "nccl_proto"):
    print(name, space.searched.get(name), space.fixed.get(name), space.removed.get(name))
PY
  # The 2-rank nccl test needs two GPUs: this is what NCCL says to two ranks on one.
  two=$(mktemp --suffix .py)
  cat > "$two" <<'PY'
import torch, torch.distributed as dist
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
t = torch.ones(4, device="cuda:0"); dist.all_reduce(t); print("rank", dist.get_rank(), t.tolist())
dist.destroy_process_group()
PY
  timeout 60 torchrun --standalone --nproc-per-node 2 "$two" 2>&1 | grep -m1 "Duplicate GPU\|rank 0" >> "$S"
fi

# The probe on real NVML and GPUs (the tests only meet a fake NVML): kept whole, as JSON.
AUTOTUNE_CACHE_DIR="$OUT/cache" timeout 300 python3 -m autotune probe --refresh > "$OUT/probe.txt" 2>&1
echo "probe rc=$?" >> "$S"
mv "$OUT"/cache/probe-*.json "$OUT/probe.json" 2>/dev/null; rm -rf "$OUT/cache"

mkdir -p "$OUT/run" && cd "$OUT/run" || exit 1
timeout 420 python3 -m autotune run --model bert --timeout "$STUDY_TIMEOUT" --memory-limit 24GiB \
  --trial-seconds 15 --storage "sqlite:///$PWD/autotune.db" > run.log 2>&1
echo "study rc=$?" >> "$S"
# Every trial's config, outcome and peak memory, for the memory model and the note.
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
                 "breakdown": m.get("breakdown"), "reason": a.get("reason"),
                 "stage": a.get("stage"), "wall_s": m.get("wall_s"), "mfu": m.get("mfu"),
                 "applied": m.get("applied"), "compile": m.get("compile")})
print(json.dumps({"trials": rows, "confirmation": study.user_attrs.get("confirmation")}, indent=1))
EOF
rm -f autotune.db
PROFILE=$(ls studies/*/profile.yaml 2>/dev/null | head -1)
if [ -n "$PROFILE" ]; then
  cp "$PROFILE" ../profile.yaml
  rm -rf studies  # trial folders: too many files to bring back
  if [ "${GPU_PROFILE:-1}" = 1 ]; then
    echo "example loop with the profile:" >> "$S"
    timeout 120 python3 "$ROOT/examples/train_plain.py" --profile ../profile.yaml --seconds 30 \
      2>&1 | tail -3 >> "$S"
    timeout 200 python3 -m autotune profile check ../profile.yaml --rounds 2 >> "$S" 2>&1
    echo "profile check rc=$?" >> "$S"
  fi
fi
tail -25 run.log
cd "$ROOT" || exit 1

if [ "${GPU_SCRIPT:-1}" = 1 ]; then
  mkdir -p "$OUT/script" && cd "$OUT/script" || exit 1
  timeout 330 python3 -m autotune run --timeout "${SCRIPT_TIMEOUT:-4m}" --trial-seconds 10 \
    --storage "sqlite:///$PWD/autotune.db" -- python3 "$ROOT/benchmarks/scripts/hf_bert.py" \
    --size base > run.log 2>&1
  echo "hf script study rc=$?" >> "$ROOT/$S"
  grep "^  #\|fixed:\|stopped:\|speedup\|what limits" -A1 run.log | head -40 >> "$ROOT/$S"
  cp studies/*/profile.yaml ../script-profile.yaml 2>/dev/null
  rm -rf studies autotune.db
  cd "$ROOT" || exit 1
fi

if [ "${GPU_ROOFLINE:-1}" = 1 ]; then
  for model in bert gpt2; do
    mkdir -p "$OUT/$model" && cd "$OUT/$model" || exit 1
    timeout 330 python3 -m autotune run --model "$model" --timeout "${ROOFLINE_TIMEOUT:-4m}" \
      --trial-seconds 10 --storage "sqlite:///$PWD/autotune.db" > run.log 2>&1
    echo "$model roofline study rc=$?" >> "$ROOT/$S"
    # The stages as a story, the winner's MFU and what limits it (kept short for the summary).
    grep -A12 "the search, led by\|what limits the winner" run.log | head -30 >> "$ROOT/$S"
    python3 - > trials.json <<'PY'
import json, optuna
url = "sqlite:///autotune.db"
study = optuna.load_study(study_name=optuna.get_all_study_names(url)[0], storage=url)
print(json.dumps([{"n": t.number, "status": t.user_attrs.get("status"),
                   "config": t.user_attrs.get("config"), "stage": t.user_attrs.get("stage"),
                   "samples_per_sec": (t.user_attrs.get("measurement") or {}).get("samples_per_sec"),
                   "mfu": (t.user_attrs.get("measurement") or {}).get("mfu"),
                   "applied": (t.user_attrs.get("measurement") or {}).get("applied"),
                   "compile": (t.user_attrs.get("measurement") or {}).get("compile"),
                   "reason": t.user_attrs.get("reason")} for t in study.trials], indent=1))
PY
    rm -rf studies autotune.db
    cd "$ROOT" || exit 1
  done
fi
cat "$S"
