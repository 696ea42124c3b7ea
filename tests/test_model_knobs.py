"""The model and process knobs (compile, optimizer implementation, matmul precision, attention,
activation checkpointing, CPU threads, retained host memory): narrowed with reasons, applied in
real trial processes, and what took effect read back from torch, the model and the
optimizer."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from autotune.config.knobs import DECLARED, Config
from autotune.config.space import load_space, narrow
from autotune.errors import ProfileError, WorkloadError
from autotune.testing.hardware import fake_cpu, fake_gpus
from autotune.trial.launch import execute, plan
from autotune.trial.measurement import COMPILE_LIMIT, classify
from autotune.trial.spec import MeasureSettings, TrialSpec
from autotune.tuner.record import StudyFacts, TrialRecord, read_trial
from autotune.tuner.snapshot import StudySnapshot
from autotune.workloads import WorkloadSpec, declared_knobs, resolve
from tests.conftest import autotune
from tests.test_profile import make

QUICK = MeasureSettings(min_window_s=0.1, max_seconds=4, target_cv=0.5, min_windows=2)


def _trial(tmp_path: Path, spec: str, params: dict, config: Config,
           measure: MeasureSettings = QUICK, env: dict[str, str] | None = None,
           events: list | None = None):  # noqa: ANN202
    p = plan(TrialSpec(WorkloadSpec(spec, params), config, device="cpu", measure=measure),
             workdir=tmp_path / "t", timeout_s=240, extra_env=env)
    raw = execute(p, on_event=events.append if events is not None else None)
    return raw, classify(raw)


def test_model_knobs_are_searched_only_where_they_apply_and_are_declared() -> None:
    space = load_space("default")
    everything = narrow(space, fake_cpu(), 1, Config(), supports=DECLARED, workload="workload x")
    for knob in ("optimizer_impl", "compile", "attention", "activation_checkpointing",
                 "cpu_threads"):
        assert knob in everything.searched, knob
    assert everything.fixed["matmul_precision"] == (
        "highest", "TF32 matmuls need an NVIDIA GPU (no CUDA GPU here)")
    dropped = dict(everything.removed["compile"])
    assert dropped["reduce-overhead"] == "reduce-overhead uses CUDA graphs (no CUDA GPU here)"
    assert "for-loop" in dict(everything.removed["optimizer_impl"])  # the CPU's default
    assert 2 in dict(everything.removed["cpu_threads"])  # torch's default on 2 cores
    undeclared = narrow(space, fake_cpu(), 1, Config(), workload="workload x")
    for knob in DECLARED:
        value, why = undeclared.fixed[knob]
        assert value == getattr(Config(), knob)
        assert why.startswith("workload x does not declare it"), why
    no_compiler = narrow(space, fake_cpu(cpp_compiler=None), 1, Config(), supports=DECLARED)
    assert "needs a C++ compiler" in no_compiler.fixed["compile"][1]
    gpu = narrow(space, fake_gpus(1), 1, Config(), supports=DECLARED)
    assert gpu.searched["matmul_precision"].values == ("highest", "high")  # type: ignore[union-attr]
    assert "reduce-overhead" in gpu.searched["compile"].values  # type: ignore[union-attr]


def test_a_workloads_supports_is_checked() -> None:
    assert declared_knobs(resolve("bert", {})) == frozenset(DECLARED)
    assert declared_knobs(resolve("mlp", {})) == {"optimizer_impl", "compile"}

    class Typo:
        name = "typo"
        supports = ("compiel",)

    with pytest.raises(WorkloadError, match="unknown knobs"):
        declared_knobs(Typo())


def test_what_a_trial_applied_is_read_back_from_the_trial_process(tmp_path: Path) -> None:
    config = Config(micro_batch_size=4, optimizer_impl="fused", attention="eager",
                    activation_checkpointing=True, cpu_threads=1, malloc_retain=True)
    raw, m = _trial(tmp_path, "bert", {"size": "tiny", "seq_len": 16}, config)
    assert m.ok, raw.stderr_tail[-2000:]
    assert m.applied["threads"] == 1
    assert m.applied["malloc_retain"] is sys.platform.startswith("linux")
    assert m.applied["attention"] == "eager"
    assert m.applied["activation_checkpointing"] is True
    assert m.applied["optimizer"] == {"class": "AdamW", "foreach": False, "fused": True}
    assert m.applied["compiled"] == "off" and m.applied["matmul_precision"] == "highest"
    base_raw, base = _trial(tmp_path / "base", "bert", {"size": "tiny", "seq_len": 16},
                            Config(micro_batch_size=4))
    assert base.ok, base_raw.stderr_tail[-2000:]
    # The baseline leaves the model and the optimizer as the workload built them.
    assert base.applied["optimizer"] == {"class": "AdamW", "foreach": None, "fused": None}
    assert base.applied["activation_checkpointing"] is False
    assert base.applied["malloc_retain"] is False
    assert base.applied["attention"] != "eager"


@pytest.mark.slow  # two ranks under torchrun, compiling
def test_a_compiled_trial_with_ranks_and_accumulation_compiles_apart_and_fills_the_cache(
        tmp_path: Path) -> None:
    """torch.compile around DDP skipped a torch.nn model's forward and ran it eagerly; the
    trial compiles the module and wraps it, says how many graphs compiled (read from Dynamo,
    not from the wrapper's type), and times the compiling step apart from warm-up and every
    window. One trial of two ranks with accumulation checks all of it (compiling is the
    slowest thing the suite does on a CPU)."""
    cache, events = tmp_path / "cache", []
    raw, m = _trial(tmp_path, "autotune.testing.workloads:tiny", {},
                    Config(micro_batch_size=4, grad_accum_steps=2, compile="default",
                           world_size=2),
                    env={"TORCHINDUCTOR_CACHE_DIR": str(cache)}, events=events)
    assert m.ok, raw.stderr_tail[-3000:]
    assert m.applied["compiled"] == "default" and m.applied["compiled_graphs"] >= 1
    assert m.compile["mode"] == "default"
    assert m.compile["first_step_s"] == m.timings["compile_step_s"] > 0
    assert m.compile["steady_step_s"] == m.warmup["step_times_s"][-1]
    # The compile step comes before warm-up and every window: none of them carries it.
    kinds = [e["event"] for e in events]
    assert "compiled" in kinds and kinds.index("compiled") < kinds.index("warmup_step")
    assert any(cache.iterdir())  # the study's shared cache
    # Every graph went into the cache: a fresh process of the config (a confirmation round)
    # skips the backend's seconds, part of the compiling step.
    assert m.compile["cached"] is True
    assert 0 < m.compile["backend_s"] <= m.timings["compile_step_s"]


@pytest.mark.parametrize("suppress", ["0", "1"])
def test_a_compile_past_its_limit_is_a_typed_timeout(tmp_path: Path, suppress: str) -> None:
    """Also when the user's environment tells Dynamo to swallow errors (it then falls back to
    eager and would have measured that under the compiled label)."""
    measure = MeasureSettings(min_window_s=0.1, max_seconds=4, max_compile_s=0.05)
    raw, m = _trial(tmp_path, "autotune.testing.workloads:tiny", {},
                    Config(micro_batch_size=4, compile="max-autotune-no-cudagraphs"), measure,
                    env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "empty-cache"),
                         "TORCHDYNAMO_SUPPRESS_ERRORS": suppress})
    assert m.status == "timeout" and m.ended_by == COMPILE_LIMIT, (m.reason, raw.stderr_tail)
    assert "compile limit" in (m.reason or "")


def test_the_optimizer_is_rebuilt_with_the_same_groups_and_hyperparameters() -> None:
    import torch

    from autotune.trial.apply import optimizer_in_force, rebuild_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    built = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 0.1},
                               {"params": model[1].parameters()}], lr=0.01, weight_decay=0.3)
    fused = rebuild_optimizer(built, Config(optimizer_impl="fused"))
    assert [g["lr"] for g in fused.param_groups] == [0.1, 0.01]
    assert all(g["weight_decay"] == 0.3 for g in fused.param_groups)
    assert optimizer_in_force(fused) == {"class": "AdamW", "foreach": False, "fused": True}
    assert rebuild_optimizer(built, Config()) is built

    class Plain(torch.optim.Optimizer):
        def __init__(self, params, lr: float = 0.1) -> None:  # noqa: ANN001
            super().__init__(params, {"lr": lr})

    with pytest.raises(ValueError, match="takes no fused argument"):
        rebuild_optimizer(Plain(model.parameters()), Config(optimizer_impl="fused"))


def _snapshot(*records: TrialRecord) -> StudySnapshot:
    return StudySnapshot(StudyFacts("study"), records, limit=2**40)


def test_compile_pays_for_itself_after_the_steps_its_saving_buys_back() -> None:
    import optuna

    from autotune.tuner.export import compile_payback, payback_words

    def trial(number: int, config: Config, rate: float,
              compiled: dict | None = None) -> TrialRecord:
        t = optuna.trial.create_trial(value=rate, user_attrs={
            "config": config.to_dict(), "status": "ok",
            "measurement": {"samples_per_sec": rate, "compile": compiled or {}}})
        t.number = number
        record = read_trial(t)
        assert record is not None
        return record

    on = Config(micro_batch_size=8, compile="default")
    eager = trial(1, Config(micro_batch_size=8), 8.0)  # 1.0 s per step
    fast = trial(2, on, 10.0, {"mode": "default", "seconds": 40.0})  # 0.8 s per step
    payback = compile_payback(_snapshot(eager, fast), fast)
    assert payback is not None and payback["payback_steps"] == 200  # 40 s / 0.2 s per step
    assert payback_words(payback) == \
        "compile default: 40.0s with the study's cache, pays for itself after 200 steps " \
        "(against trial 1)"
    slow = trial(3, on, 7.0, {"mode": "default", "seconds": 40.0})
    never = compile_payback(_snapshot(eager, slow), slow)
    assert never is not None and never["payback_steps"] is None
    assert compile_payback(_snapshot(eager), eager) is None
    alone = compile_payback(_snapshot(fast), fast)
    assert alone is not None and "no eager run" in payback_words(alone)
    assert fast.compile_s == 40.0 and eager.compile_s is None  # the trial line


def test_threads_are_counted_with_loader_workers_against_the_cores() -> None:
    import optuna

    from autotune.config.knobs import oversubscribed
    from autotune.tuner.record import Predicted, Prediction, of_prediction

    assert oversubscribed(Config(cpu_threads=1, num_workers=1), 2) is None
    assert oversubscribed(Config(num_workers=2), 2) is None  # threads left to torch
    why = oversubscribed(Config(cpu_threads=1, num_workers=2), 2)
    assert why == ("oversubscribed: 1 thread(s) + 2 loader worker(s) per rank x 1 rank(s) need "
                   "3 cores; this machine has 2")
    assert oversubscribed(Config(cpu_threads=4, world_size=2), 16) is None
    assert oversubscribed(Config(cpu_threads=4, num_workers=5, world_size=2), 16) is not None
    rec = of_prediction(Prediction(Predicted.OVERSUBSCRIBED, why), 2**30)
    t = optuna.trial.create_trial(state=rec.state, user_attrs={
        **rec.attrs, "config": Config(cpu_threads=1, num_workers=2).to_dict()})
    v = read_trial(t)
    assert v is not None and v.predicted and v.predicted_kind == "oversubscribed"
    assert v.reason == why


# A plain PyTorch script applying a profile: a torch.nn.Module has neither
# set_attn_implementation nor gradient_checkpointing_enable.
PLAIN_SCRIPT = """
import json, torch, autotune
model = autotune.load_profile().prepare_model(torch.nn.Linear(4, 1))
model(torch.randn(2, 4)).sum().backward()
print(json.dumps({"model": type(model).__name__, "trained": model.weight.grad is not None}))
"""


def test_launch_leaves_off_the_model_knobs_a_plain_module_cannot_take(tmp_path: Path) -> None:
    """Attention and checkpointing alike: one "not applied" line each (as a Trainer's model
    gets), and the script trains on."""
    profile = replace(make(), config=Config(attention="sdpa", activation_checkpointing=True))
    path = profile.save(tmp_path / "profile.yaml")
    script = tmp_path / "train.py"
    script.write_text(PLAIN_SCRIPT)
    out = autotune("launch", str(path), "--", sys.executable, str(script), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == {"model": "Linear", "trained": True}
    said = [line for line in out.stderr.splitlines() if line.startswith("autotune: not applied")]
    assert said == [
        "autotune: not applied: attention=sdpa needs a transformers model "
        "(set_attn_implementation); Linear has none",
        "autotune: not applied: activation_checkpointing=true needs a transformers model "
        "(gradient_checkpointing_enable); Linear has none"], out.stderr


def test_a_trial_never_measures_a_model_knob_its_model_cannot_take(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The built-in loop (``apply.prepare_model``) and a script's trial refuse it: the trial
    ends with the reason instead of measuring a config it did not run."""
    import torch

    from autotune import steps
    from autotune.trial.apply import prepare_model

    config = Config(activation_checkpointing=True)
    with pytest.raises(ValueError, match="activation_checkpointing"):
        prepare_model(torch.nn.Linear(4, 1), config)
    monkeypatch.setattr(steps, "in_trial", lambda: True)
    with pytest.raises(ProfileError, match="activation_checkpointing"):
        replace(make(), config=config).prepare_model(torch.nn.Linear(4, 1))


HEAP = """
import ctypes, json, sys, torch
from autotune.trial.apply import retain_freed_memory, torch_flags_in_force
FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS.split()]
mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Info
if sys.argv[1] == "retain":
    assert retain_freed_memory() and torch_flags_in_force()["malloc_retain"]
else:
    assert not torch_flags_in_force()["malloc_retain"]
before = mallinfo2()
t = torch.empty(40 * 2**20, dtype=torch.uint8)  # an activation-sized tensor
t.fill_(1)
held = mallinfo2()
del t
freed = mallinfo2()
print(json.dumps({"own_mmap": held.hblkhd - before.hblkhd,
                  "mapped_after_free": freed.hblkhd - before.hblkhd,
                  "heap_kept": freed.arena >= held.arena, "heap_free": freed.fordblks}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_retained_host_memory_keeps_a_freed_tensor_in_the_heap_for_the_next_step() -> None:
    """What the knob changes in glibc, read from glibc (``mallinfo2``), not from timings or
    page-fault counts (a VM's memory reclaim can take retained pages back now and then)."""
    import subprocess

    seen = {}
    for mode in ("default", "retain"):
        done = subprocess.run([sys.executable, "-c", HEAP, mode], capture_output=True,
                              text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        seen[mode] = json.loads(done.stdout.split("\n")[-2])
    size = 40 * 2**20
    # By default a tensor above 32 MiB gets its own mmap, unmapped when freed: the next step
    # faults its pages in afresh. Retained, it comes from the heap, which keeps it once freed.
    assert seen["default"]["own_mmap"] >= size > seen["default"]["mapped_after_free"], seen
    assert seen["retain"]["own_mmap"] < size, seen
    assert seen["retain"]["heap_kept"] and seen["retain"]["heap_free"] >= size, seen
