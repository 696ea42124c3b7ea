#!/usr/bin/env bash
# One GPU check, run on a lent GPU machine from the repository root (see the device notes in
# ../shared/GPU.md; its wheels installed and on PYTHONPATH first). Its default sections fit in
# one 10-minute command on one H200 (with a minute for the wheels) and run first what has never
# run on a GPU; the rest wait behind a switch. Every section has a hard time cap (`timeout`
# around each command, SIGTERM first, which `autotune run` takes as Ctrl-C: it stops, writes its
# profile and exits); the caps of the sections that will run are printed, summed, first.
#
#   section    switch (default)  cap (s)  what
#   preflight  always             40  an NVIDIA GPU, torch with CUDA, the wheels: else exit 2 at once
#   tests      GPU_TESTS=1       240  the gpu tests (the probe's with GPU_PROBE=1), NCCL facts, what
#                                     NCCL says to 2 ranks on 1 GPU (2026-12-04: 183 s, pytest 140)
#   gpt2       GPU_GPT2=1        280  GPT-2 small over the whole default space, no memory limit:
#                                     open-ended batches, then the diagnosis-led stages
#   roofline   GPU_ROOFLINE=0    345  BERT-base over the roofline knobs alone (micro-batch 128,
#                                     bf16): fused AdamW, torch.compile default and reduce-overhead,
#                                     TF32, sdpa/eager/flash attention, checkpointing; MFU and what
#                                     limits the winner
#   script     GPU_SCRIPT=0      175  a Hugging Face Trainer script tuned as it runs (`autotune run
#                                     -- python3 benchmarks/scripts/hf_bert.py`): the step protocol,
#                                     the callback's data wait, the script's own peak memory on CUDA
#   probe      GPU_PROBE=0       120  `autotune probe --refresh` on real NVML: links, copies, peaks
#   study      GPU_STUDY=0       330  a short BERT study, default space: AMP, a 24 GiB limit that
#                                     puts a wall in the space, the baseline, the confirmation
#   profile    GPU_PROFILE=0     240  the plain-PyTorch example trains with the study's profile (or
#                                     the roofline's) and `autotune profile check` re-measures it
#   sharded    GPU_SHARDED=0      90  FSDP2 as trials apply it (trial/shard.py) on ONE rank over NCCL:
#                                     GPT-2 small, full-shard and shard-grad-op, bf16 policy with the
#                                     reduce in bf16, CPU offload; losses against the unsharded model,
#                                     CUDA peak memory, the read-back. One GPU shows the path runs on
#                                     CUDA (policy, offload, read-back) and its peak; not what
#                                     sharding saves across ranks nor its communication (2+ GPUs)
#
# A section's cap is NAME_S (ROOFLINE_S=400 ...); its study's --timeout is the cap less 80 s
# (start-up, export, the stop). Default: 40 + 240 + 280 = 560 s.
# Outputs under $OUT (default gpu-out), few files (the device returns a limited number: pack
# $OUT into one archive where it returns fewer than ten): summary.txt (every short result, each
# section's time against its cap), probe.json (the probe the first study took), and per section
# NAME/run.log, NAME/trials.json, NAME-profile.yaml; gpu-tests.log, probe.txt.
set -uo pipefail
ROOT="$PWD"
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)" || exit 2
S="$OUT/summary.txt"
GRACE=15      # seconds between a section's SIGTERM and its SIGKILL
BUDGET=560    # what the default sections must fit in: one 10-minute command, less the wheels
# One probe for the whole check: the first study measures the machine, the others read it.
export AUTOTUNE_CACHE_DIR="$OUT/cache"

SECTIONS=(preflight tests gpt2 roofline script probe study profile sharded)
declare -A ON=([preflight]=1 [roofline]="${GPU_ROOFLINE:-0}" [script]="${GPU_SCRIPT:-0}"
               [tests]="${GPU_TESTS:-1}" [gpt2]="${GPU_GPT2:-1}" [probe]="${GPU_PROBE:-0}"
               [study]="${GPU_STUDY:-0}" [profile]="${GPU_PROFILE:-0}"
               [sharded]="${GPU_SHARDED:-0}")
declare -A CAP=([preflight]=40 [roofline]="${ROOFLINE_S:-345}" [script]="${SCRIPT_S:-175}"
                [tests]="${TESTS_S:-240}" [gpt2]="${GPT2_S:-280}" [probe]="${PROBE_S:-120}"
                [study]="${STUDY_S:-330}" [profile]="${PROFILE_S:-240}"
                [sharded]="${SHARDED_S:-90}")
declare -A SWITCH=([roofline]=GPU_ROOFLINE [script]=GPU_SCRIPT [tests]=GPU_TESTS
                   [gpt2]=GPU_GPT2 [probe]=GPU_PROBE [study]=GPU_STUDY [profile]=GPU_PROFILE
                   [sharded]=GPU_SHARDED)

say() { echo "$*" | tee -a "$S"; }
die() { say "gpu_check: $*"; exit 2; }

# capped SECONDS CMD...: CMD gets SIGTERM at SECONDS - GRACE (a quarter of a short cap) and
# SIGKILL at SECONDS.
capped() {
  local cap=$1 grace=$GRACE; shift
  [ "$grace" -le $((cap / 4)) ] || grace=$((cap / 4))
  timeout -k "$grace" "$((cap - grace))" "$@"
}

print_budget() {
  local name total=0 on="" off=""
  for name in "${SECTIONS[@]}"; do
    [[ "${CAP[$name]}" =~ ^[0-9]+$ ]] || die "${name^^}_S must be whole seconds, got ${CAP[$name]}"
    [ "$name" = preflight ] || [ "${CAP[$name]}" -ge 120 ] \
      || die "${name^^}_S must be at least 120 s, got ${CAP[$name]}"
    if [ "${ON[$name]}" = 1 ]; then
      total=$((total + CAP[$name])); on+=" $name ${CAP[$name]}s"
    else
      off+=" $name (${SWITCH[$name]}=1, ${CAP[$name]}s)"
    fi
  done
  say "gpu_check budget: ${total}s ($((total / 60))m$((total % 60))s; the default sections fit" \
    "in ${BUDGET}s), in this order:$on"
  [ -z "$off" ] || say "  off:$off"
  [ "$total" -le "$BUDGET" ] || say "  note: over the ${BUDGET}s the default sections fit in"
}

# -- sections --------------------------------------------------------------------------------

section_preflight() {
  command -v nvidia-smi > /dev/null || die "no nvidia-smi here: this check needs an NVIDIA GPU"
  local out rc
  out=$(capped 10 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
        2>&1); rc=$?
  [ "$rc" = 0 ] || die "nvidia-smi finds no usable GPU (rc=$rc): $(tail -1 <<< "$out")"
  say "$out"
  # Its own process: the tuner never initialises CUDA, this throwaway check may.
  out=$(capped 30 python3 - 2>&1 <<'PY'
import importlib.util
import torch
assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device"
missing = [m for m in ("optuna", "sqlalchemy", "plotly", "autotune")
           if importlib.util.find_spec(m) is None]
assert not missing, f"not importable: {missing}: install the wheels and set PYTHONPATH first"
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
PY
); rc=$?
  [ "$rc" = 0 ] || die "python3 is not ready for the check (rc=$rc): $(tail -1 <<< "$out")"
  say "$out"
}

# The roofline knobs alone, so the study's time goes to the knobs that have never run on a GPU.
# A space adds the baseline's value to each knob (fp32, micro-batch 8): the staged start has two
# configs to try, and the knobs left out stay at the baseline's (no loader workers: BERT stays
# input-bound, which has no remedy here, and the diagnosis goes on to its low MFU).
ROOFLINE_SPACE="$(mktemp --suffix .yaml)"
cat > "$ROOFLINE_SPACE" <<'YAML'
# scripts/gpu_check.sh: autotune run --model bert --space roofline.yaml
description: the roofline knobs of a GPU (optimizer, compile, TF32, attention, checkpointing)
knobs:
  micro_batch_size: {choices: [128]}
  amp: {choices: [bf16]}
  optimizer_impl: {choices: [default, fused]}
  compile: {choices: ["off", default, reduce-overhead]}
  matmul_precision: {choices: [highest, high]}
  attention: {choices: [default, sdpa, eager, flash_attention_2]}
  activation_checkpointing: {choices: [false, true]}
YAML

# Every trial's config, outcome and figures, for the note: one JSON row per trial.
DUMP="$(mktemp --suffix .py)"
cat > "$DUMP" <<'PY'
import json, sys, optuna
url = f"sqlite:///{sys.argv[1]}"
study = optuna.load_study(study_name=optuna.get_all_study_names(url)[0], storage=url)
rows = []
for t in study.trials:
    a, m = t.user_attrs, t.user_attrs.get("measurement") or {}
    c = a.get("config") or {}
    rows.append({"n": t.number, "state": t.state.name, "status": a.get("status"),
                 "stage": a.get("stage"), "reason": a.get("reason"), "config": c,
                 "samples_per_sec": m.get("samples_per_sec"), "peak": m.get("peak_memory_bytes"),
                 "predicted_peak": m.get("predicted_peak_memory_bytes"), "mfu": m.get("mfu"),
                 "breakdown": m.get("breakdown"), "wall_s": m.get("wall_s"),
                 "applied": m.get("applied"), "compile": m.get("compile")})
print(json.dumps({"trials": rows, "confirmation": study.user_attrs.get("confirmation")},
                 indent=1))
PY
trap 'rm -f "$ROOFLINE_SPACE" "$DUMP"' EXIT

# tune NAME CAP RUN-ARGS...: one study in $OUT/NAME, its run capped at CAP - 20 s and its
# --timeout at CAP - 80 s; then its trials (20 s). Keeps run.log, trials.json, the profile.
tune() {
  local name=$1 cap=$2; shift 2
  local dir="$OUT/$name"
  mkdir -p "$dir"
  (
    cd "$dir" || exit 1
    capped $((cap - 20)) python3 -m autotune run --timeout "$((cap - 80))s" --trial-seconds 10 \
      --storage "sqlite:///$dir/autotune.db" "$@" > run.log 2>&1
  )
  say "$name study rc=$?"
  capped 20 python3 "$DUMP" "$dir/autotune.db" > "$dir/trials.json" 2>&1
  grep -A12 "the search, led by\|what limits the winner\|^confirmation" "$dir/run.log" \
    | head -40 >> "$S"
  grep "^speedup\|^stopped" "$dir/run.log" >> "$S"
  local profiles=("$dir"/studies/*/profile.yaml)
  [ ! -f "${profiles[0]}" ] || cp "${profiles[0]}" "$OUT/$name-profile.yaml"
  rm -rf "$dir/studies" "$dir/autotune.db"*  # trial folders: too many files to bring back
}

section_roofline() {
  tune roofline "${CAP[roofline]}" --model bert --space "$ROOFLINE_SPACE" --confirm-top 0
}

section_script() {
  tune script "${CAP[script]}" --confirm-top 0 \
    -- python3 "$ROOT/benchmarks/scripts/hf_bert.py" --size base
  grep "^  #\|fixed:" "$OUT/script/run.log" | head -30 >> "$S"
}

section_tests() {
  local cap=${CAP[tests]} skip=()
  # The probe's own test re-measures the machine the roofline study probed: with the probe.
  [ "${ON[probe]}" = 1 ] || skip=(-k "not the_probe_measures")
  capped $((cap - 45)) python3 -m pytest -q -p no:cacheprovider --durations=0 \
    -m "gpu or multi_gpu" "${skip[@]}" > "$OUT/gpu-tests.log" 2>&1
  say "gpu tests rc=$?"
  tail -3 "$OUT/gpu-tests.log" >> "$S"
  # NCCL here: its version and what the default space keeps of the NCCL knobs for 2 ranks.
  capped 20 python3 - >> "$S" 2>&1 <<'PY'
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
  local two
  two=$(mktemp --suffix .py)
  cat > "$two" <<'PY'
import torch, torch.distributed as dist
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
t = torch.ones(4, device="cuda:0"); dist.all_reduce(t); print("rank", dist.get_rank(), t.tolist())
dist.destroy_process_group()
PY
  capped 25 torchrun --standalone --nproc-per-node 2 "$two" 2>&1 \
    | grep -m1 "Duplicate GPU\|rank 0" >> "$S"
  rm -f "$two"
}

section_gpt2() {
  tune gpt2 "${CAP[gpt2]}" --model gpt2 --confirm-top 0
}

section_probe() {
  capped "${CAP[probe]}" python3 -m autotune probe --refresh > "$OUT/probe.txt" 2>&1
  say "probe rc=$?"
}

section_study() {
  tune study "${CAP[study]}" --model bert --memory-limit 24GiB
}

section_profile() {
  local cap=${CAP[profile]} p="$OUT/study-profile.yaml"
  [ -f "$p" ] || p="$OUT/roofline-profile.yaml"
  [ -f "$p" ] || { say "profile: no profile to train with (run study or roofline)"; return; }
  say "example loop with $(basename "$p"):"
  capped 100 python3 "$ROOT/examples/train_plain.py" --profile "$p" --seconds 30 2>&1 \
    | tail -3 >> "$S"
  capped $((cap - 100)) python3 -m autotune profile check "$p" --rounds 2 >> "$S" 2>&1
  say "profile check rc=$?"
}

section_sharded() {
  local one
  one=$(mktemp --suffix .py)
  cat > "$one" <<'PY'
import dataclasses, json, torch, torch.distributed as dist
from autotune.config.knobs import Config
from autotune.trial.shard import blocks_of, shard, sharding_in_force
from autotune.workloads import resolve
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
device = torch.device("cuda", 0)
workload = resolve("gpt2", {"seq_len": 128})
def steps(model, amp):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(3):
        ids = torch.randint(0, 50000, (8, 128), generator=g).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True); out.append(loss.item())
    return out
for name, kw in (("unsharded", None), ("full-shard", {}), ("shard-grad-op", {}),
                 ("full-shard bf16 reduce bf16", {"amp": "bf16", "fsdp_reduce_dtype": "amp"}),
                 ("full-shard offload", {"cpu_offload": True})):
    torch.manual_seed(0); torch.cuda.reset_peak_memory_stats(device)
    model = workload.build_model().to(device)
    seen = {}
    if kw is not None:
        config = Config(sharding=name.split()[0], world_size=2, **kw)
        model = shard(model, config, device, blocks_of(model, workload))
        seen = sharding_in_force(model, config.sharding)
    losses = steps(model, bool(kw and kw.get("amp")))
    print(json.dumps({"config": name, "losses": [round(x, 5) for x in losses],
                      "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3),
                      "applied": seen}))
    del model; torch.cuda.empty_cache()
dist.destroy_process_group()
PY
  capped "${CAP[sharded]}" torchrun --standalone --nproc-per-node 1 "$one" \
    > "$OUT/sharded.log" 2>&1
  say "sharded rc=$?"
  grep '^{' "$OUT/sharded.log" >> "$S"
  rm -f "$one"
}

# -- the check -------------------------------------------------------------------------------

: > "$S"
print_budget
started=$SECONDS
for name in "${SECTIONS[@]}"; do
  [ "${ON[$name]}" = 1 ] || continue
  t0=$SECONDS
  echo "== $name (cap ${CAP[$name]}s)"
  "section_$name"
  say "== $name: $((SECONDS - t0))s of ${CAP[$name]}s"
done
mv "$OUT"/cache/probe-*.json "$OUT/probe.json" 2>/dev/null
rm -rf "$OUT/cache"
say "gpu_check: $((SECONDS - started))s in all"
echo "-- $S --"
cat "$S"
