"""Tuning the user's own script (``autotune run -- CMD``): the command, the step protocol's tuner
side, the outcomes a script can end in, and whole studies of real scripts in real processes."""

from __future__ import annotations

import json
import re
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import optuna
import pytest

from autotune.config.knobs import Config, unapplied
from autotune.errors import UsageError
from autotune.machine.hardware import detect
from autotune.profile import Profile, load_profile
from autotune.steps import STOP_FILE
from autotune.trial import launch
from autotune.trial.command import parse_command
from autotune.trial.driver import StepDriver
from autotune.trial.measurement import Measurement, classify
from autotune.trial.spec import MeasureSettings, TrialSpec
from autotune.workloads import WorkloadSpec
from tests.conftest import EXAMPLE_FRAMEWORKS, EXAMPLES, FAST, ROOT, autotune, needs_framework

LOOP = ROOT / "tests" / "data" / "scripts" / "loop.py"
# The environment's torchrun (its bin folder need not be on PATH).
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
# The no-progress limit is generous: on a loaded machine a script's imports alone take seconds.
QUICK = MeasureSettings(min_window_s=0.2, max_seconds=4.0, no_progress_s=30.0, stop_grace_s=4.0)


# -- the command ----------------------------------------------------------------------------------

def test_command_is_checked_and_identified(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('v1')\n")
    one = parse_command([sys.executable, str(script), "--lr", "1e-3"])
    assert (one.name, one.nproc, one.script) == ("train.py", 1, str(script))
    script.write_text("print('v2')\n")
    assert parse_command([sys.executable, str(script)]).script_sha256 != one.script_sha256
    two = parse_command([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", str(script)])
    assert (two.nproc, two.name) == (2, "train.py")
    with pytest.raises(UsageError, match="command 'trian' not found"):
        parse_command(["trian", "x.py"])
    with pytest.raises(UsageError, match="script 'missing.py' not found"):
        parse_command([sys.executable, "missing.py"])
    with pytest.raises(UsageError, match="--nnodes 2"):
        parse_command([TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", str(script)])
    with pytest.raises(UsageError, match="nproc-per-node 'gpu'"):
        parse_command([TORCHRUN, "--nproc-per-node", "gpu", str(script)])
    # Behind a wrapper, the .py file it names is the script; without one, what is not tracked
    # is said (a wrapper's file, or only the command line).
    for wrapped in (["env", "-u", "X", sys.executable, str(script)],
                    ["bash", "-c", f"cd /tmp && {sys.executable} {script} --lr 1"]):
        found = parse_command(wrapped)
        assert (found.name, found.script, found.untracked) == ("train.py", str(script), None)
    inline = parse_command(["bash", "-c", "echo trains"])
    assert inline.script is None and (inline.untracked or "").startswith(
        "bash -c runs code that names no .py file: no file identifies the study")


def test_a_script_s_trial_is_planned_as_data(tmp_path: Path) -> None:
    config = Config(micro_batch_size=16, grad_accum_steps=2)
    spec = TrialSpec(WorkloadSpec("command", {}), config, "cpu", QUICK)
    command = parse_command([sys.executable, str(LOOP), "--apply", "autocast"])
    p = launch.plan_command(spec, command, workdir=tmp_path / "t", timeout_s=30.0,
                            profile="schema: x\n")
    assert p.argv == command.argv and p.script == "loop.py"
    assert p.env["AUTOTUNE_PROFILE"] == str(tmp_path / "t" / "profile.yaml")
    assert p.env["AUTOTUNE_TRIAL_DIR"] == str(tmp_path / "t")
    assert p.env["AUTOTUNE_SAMPLES_PER_STEP"] == "32"  # this rank's micro-batch x accumulation
    assert not (tmp_path / "t").exists()  # planning wrote nothing; executing writes the profile


def test_knobs_a_script_never_applies_are_named_with_the_method() -> None:
    found = unapplied(["micro_batch_size", "amp", "num_workers", "nccl_algo", "cpu_threads"],
                      {"autocast"}, "train.py")
    assert set(found) == {"micro_batch_size", "num_workers", "cpu_threads"}
    assert "train.py never uses micro_batch_size or dataloader_kwargs()" in \
        found["micro_batch_size"]
    assert unapplied(["num_workers"], {"hf_training_args"}, "t.py") == {}


# -- the step protocol, from step files -----------------------------------------------------------

def _driver(tmp_path: Path, world: int = 1, settings: MeasureSettings = QUICK,
            expected: int = 0) -> StepDriver:
    # The step files these tests write are of a script that started two minutes ago.
    return StepDriver(tmp_path, world, settings, "train.py", str(tmp_path / "progress.jsonl"),
                      str(tmp_path / "result.json"), started=time.time() - 120,
                      expected_samples=expected)


def _steps(tmp_path: Path, rank: int, ends: list[float], samples: int = 8,
           wait: float | None = None) -> None:
    with open(tmp_path / f"steps.rank{rank}.jsonl", "a") as f:
        for i, t in enumerate(ends):
            line: dict[str, Any] = {"s": i + 1, "t": t, "n": samples}
            if wait is not None:
                line["d"] = wait
            f.write(json.dumps(line) + "\n")


def test_windows_count_every_rank_s_samples_at_the_slowest_rank_s_pace(tmp_path: Path) -> None:
    # Rank 0 takes 0.1 s a step, rank 1 0.125 s: rank 1 sets the pace, both ranks' samples count.
    now = time.time() - 10
    _steps(tmp_path, 0, [now + 0.1 * i for i in range(60)], wait=0.01)
    _steps(tmp_path, 1, [now + 0.125 * i for i in range(60)], wait=0.02)
    d = _driver(tmp_path, world=2)
    d.poll()
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "ok" and d.done
    assert result["warmup"]["ended_by"] == "stable"
    w = result["windows"][0]
    assert w["steps"] == 2 and w["samples"] == 2 * 2 * 8 and w["slowest_rank"] == 1
    assert w["seconds"] == pytest.approx(0.25) and w["data_wait_s"] == pytest.approx(0.04)
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    # Both ranks stop after the same step, ahead of what either has reached.
    assert json.loads((tmp_path / STOP_FILE).read_text())["at_step"] > 60
    m = classify(launch.RawResult(0, False, result, "", 10.0))
    assert m.ok and m.samples_per_sec == pytest.approx(32 / 0.25)
    assert m.breakdown["data_wait"] == pytest.approx(0.16)


def test_windows_follow_the_script_s_pace(tmp_path: Path) -> None:
    ends = [time.time() - 10]  # the step files of a script that started 10 s ago
    for i in range(40):  # warm-up takes three steps; then windows of two: 9 of 0.1 s steps
        ends.append(ends[-1] + (0.1 if i < 21 else 0.2))
    _steps(tmp_path, 0, ends)
    d = _driver(tmp_path, settings=MeasureSettings(min_window_s=0.19, max_windows=30,
                                                   max_seconds=100.0, target_cv=-1.0))
    d.poll()
    rates = [round(w["samples"] / w["seconds"]) for w in d.windows]
    assert d.warmup.ended_by == "stable" and d.per_window == 2
    assert rates == [80] * rates.count(80) + [40] * rates.count(40)  # 8 samples / 0.1 s, 0.2 s
    assert rates.count(40) >= 5 and not d.done  # data ran out before the budget


def test_a_script_that_reports_no_wait_has_an_unknown_one(tmp_path: Path) -> None:
    _steps(tmp_path, 0, [time.time() - 10 + 0.1 * i for i in range(40)])
    d = _driver(tmp_path)
    d.poll()
    m = classify(launch.RawResult(0, False, json.loads((tmp_path / "result.json").read_text()),
                                  "", 5.0))
    assert m.ok and "data_wait" not in m.breakdown


def test_steps_of_another_batch_than_the_config_are_not_its_measurement(tmp_path: Path) -> None:
    # The config asks 8 samples per step; the script trains 16 (it overrides the batch).
    _steps(tmp_path, 0, [time.time() - 10 + 0.1 * i for i in range(40)], samples=16)
    d = _driver(tmp_path)
    d.expected_samples = 8
    d.poll()
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["status"], d.give_up) == ("error", True)
    assert result["script"]["samples_mismatch"] is True
    assert result["reason"].startswith("train.py trained 16 samples per optimizer step on each "
                                       "rank, but the config asks 8")
    assert "pass --param batch=16" in result["reason"]
    assert not (tmp_path / STOP_FILE).exists()  # ended, not asked to stop
    # The same steps with the config's batch are its measurement.
    (tmp_path / "result.json").unlink()
    d = _driver(tmp_path)
    d.expected_samples = 16
    d.poll()
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "ok"


def test_a_slow_step_is_given_time_to_reach_the_stop(tmp_path: Path) -> None:
    # 2 s steps: the script cannot stop sooner than its current step ends, so the deadline
    # covers one more step at that pace (and half again) before the grace period.
    _steps(tmp_path, 0, [time.time() - 100 + 2.0 * i for i in range(40)])
    d = _driver(tmp_path, settings=replace(QUICK, max_seconds=60.0, min_window_s=1.0))
    d.poll()
    assert d.done and d.stop_at == 41
    assert d.stop_deadline_s == pytest.approx(1.5 * 2.0 + QUICK.stop_grace_s)
    # What the note says depends on where the steps are when the deadline passes.
    assert d._why_still_running().startswith("had not reached step 41, where it was asked")
    _steps_from(tmp_path, 41)
    d.poll()
    assert d._why_still_running() == "left its loop at step 41 but was still running 4s later"
    _steps_from(tmp_path, 42)
    d.poll()
    assert d._why_still_running().startswith("ran past step 41, where it was asked to stop")


@pytest.mark.parametrize("budget,outcome", [(40.0, None), (20.0, "timeout")])
def test_a_long_step_fits_the_budget_as_in_the_bench(tmp_path: Path, budget: float,
                                                     outcome: str | None) -> None:
    # 17 s steps, two seen so far. Warm-up needs one more, then a one-step window: 34 s more,
    # which fits twice a 40 s budget from step 1's end (as the bench judges a first step) but
    # not twice a 20 s one, which is known at once, not after the budget ran out.
    now = time.time()
    _steps(tmp_path, 0, [now - 17, now])
    d = _driver(tmp_path, settings=replace(QUICK, max_seconds=budget, min_window_s=1.0))
    d.poll()
    result = tmp_path / "result.json"
    if outcome is None:
        assert not d.done and not result.exists()
    else:
        doc = json.loads(result.read_text())
        assert (doc["status"], d.give_up) == ("timeout", True)
        assert doc["reason"].startswith("one optimizer step of train.py takes ~17.0s")


def _steps_from(tmp_path: Path, step: int) -> None:
    with open(tmp_path / "steps.rank0.jsonl", "a") as f:
        f.write(json.dumps({"s": step, "t": time.time(), "n": 8}) + "\n")


def test_a_script_that_ends_before_a_window_says_so(tmp_path: Path) -> None:
    _steps(tmp_path, 0, [time.time() - 1 + 0.1 * i for i in range(3)])
    d = _driver(tmp_path)
    d.at_exit(0)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "error"
    assert result["reason"].startswith("train.py finished after 3 step(s), before a window")


def test_a_rank_that_never_reports_is_named(tmp_path: Path) -> None:
    _steps(tmp_path, 0, [time.time()])
    d = _driver(tmp_path, world=2, settings=MeasureSettings(no_progress_s=0.0))
    d.poll()
    assert d.give_up
    reason = json.loads((tmp_path / "result.json").read_text())["reason"]
    assert reason.startswith("no progress from rank(s) 1 of train.py in 0 s: a Hugging Face "
                             "or Lightning Trainer is reported by autotune itself once its "
                             "Trainer trains (autotune's bootstrap reached no Python process "
                             "of it)")
    assert "a plain PyTorch loop calls autotune.step() once per optimizer step" in reason


# -- real scripts, one trial each -----------------------------------------------------------------

def _trial(tmp_path: Path, *args: str, config: Config | None = None,
           settings: MeasureSettings = QUICK, timeout: float = 60.0,
           sentinel: tuple[str, ...] = ()) -> Measurement:
    """One trial of loop.py in a real process, as the tuner runs it."""
    config = config or Config(micro_batch_size=16)
    hw = detect()
    command = parse_command([sys.executable, str(LOOP), *args])
    profile = Profile(workload={"name": "loop", "spec": "command", "params": {}}, config=config,
                      env={}, result={"samples_per_sec": 0.0}, baseline={}, speedup=None,
                      fingerprint=hw.fingerprint(), provenance={"candidate": True})
    folder = tmp_path / "trial"
    spec = TrialSpec(WorkloadSpec("command", {}), config, "cpu", settings, sentinel=sentinel)
    p = launch.plan_command(spec, command, workdir=folder, timeout_s=timeout,
                            profile=profile.to_yaml())
    return classify(launch.execute(p))


def test_a_script_is_measured_and_stops_when_asked(tmp_path: Path) -> None:
    m = _trial(tmp_path, "--apply", "dataloader,autocast")
    assert m.ok, m.reason
    assert m.reason is None  # it stopped by itself: no note
    assert {"dataloader_kwargs", "autocast"} <= set(m.script["accessed"])
    assert m.windows and all(w["samples"] == 16 * w["steps"] for w in m.windows)
    lines = (tmp_path / "trial" / "steps.rank0.jsonl").read_text().splitlines()
    steps = [json.loads(x)["s"] for x in lines if '"s"' in x]
    stop = json.loads((tmp_path / "trial" / STOP_FILE).read_text())["at_step"]
    # Alone, it leaves at its first look at the request (a rank with peers: at the step named).
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] >= stop


def test_a_script_s_trial_reads_the_sentinel_at_its_first_step(tmp_path: Path) -> None:
    m = _trial(tmp_path, sentinel=("fp32",))
    assert m.ok, m.reason
    assert {"matmul_fp32_gflops", "copy_gbs", "threads", "world_size", "seconds"} <= \
        set(m.sentinel), m.sentinel
    assert m.sentinel["world_size"] == 1
    lines = (tmp_path / "trial" / "steps.rank0.jsonl").read_text().splitlines()
    kinds = [next(iter(json.loads(x))) for x in lines if '"a"' not in x]  # not the accesses
    assert kinds[:3] == ["start", "sentinel", "s"]  # once, before step 1's end
    assert kinds.count("sentinel") == 1
    # Not asked (a study without one, or a CUDA trial): no reading, no line.
    assert _trial(tmp_path / "none").sentinel == {}


def test_a_script_s_sentinel_line_is_untrusted_data(tmp_path: Path) -> None:
    from autotune.trial.reports import RankReports

    path = tmp_path / "steps.rank0.jsonl"
    now = time.time()
    path.write_text("\n".join(json.dumps(d) for d in (
        {"start": now, "pid": 1, "rank": 0},
        {"sentinel": {"matmul_fp32_gflops": "9e99", "copy_gbs": -1, "threads": 2,
                      "__class__": 1, "seconds": float("inf")}},
        {"sentinel": {"matmul_fp32_gflops": 5.0}},  # a second one: the first counts
        {"s": 1, "t": now + 0.1, "n": 16})) + "\n")
    r = RankReports(path)
    r.read(now - 1)
    assert r.bad is None and len(r.ends) == 1
    assert r.sentinel == {"threads": 2.0}


def test_in_a_trial_the_profile_a_script_loads_by_path_is_the_candidate(tmp_path: Path) -> None:
    production = tmp_path / "production.yaml"
    Profile(workload={"name": "loop"}, config=Config(micro_batch_size=4), env={},
            result={"samples_per_sec": 1.0}, baseline={}, speedup=None,
            fingerprint=detect().fingerprint(), provenance={}).save(production)
    m = _trial(tmp_path, "--profile", str(production), config=Config(micro_batch_size=16))
    assert m.ok, m.reason
    assert all(w["samples"] == 16 * w["steps"] for w in m.windows)  # the candidate's batch
    assert "load_profile" in m.script["accessed"]
    assert f"autotune: load_profile({str(production)!r}) in a trial of `autotune run`: loading " \
        "the trial's candidate config instead" in m.stderr_tail


def test_a_script_that_ignores_the_stop_is_ended_and_still_measured(tmp_path: Path) -> None:
    m = _trial(tmp_path, "--behave", "ignore-stop")
    assert m.ok and m.samples_per_sec
    assert re.search(r"ran past step \d+, where it was asked to stop: it does not leave its "
                     r"loop when autotune.should_stop\(\) .*; ended by signal", m.reason or "")


def test_a_measured_script_still_stopping_at_the_trial_timeout_keeps_its_result(
        tmp_path: Path) -> None:
    # It saves a checkpoint for a minute after its loop; the trial timeout comes first.
    m = _trial(tmp_path, "--linger", "60",
               settings=replace(QUICK, max_seconds=2.0, stop_grace_s=60.0), timeout=20.0)
    assert m.ok and m.samples_per_sec, m.reason
    assert m.reason == "loop.py was still stopping at the 20s trial timeout; ended (its " \
        "windows were measured before)"


@pytest.mark.parametrize("behave,status,reason", [
    # What the bootstrap saw, not a claim: it once said "(none did)" of processes it never saw.
    ("silent", "error", "no progress from loop.py in 4 s: a Hugging Face or Lightning Trainer "
                        "is reported by autotune itself once its Trainer trains (none began "
                        "training in the 1 Python process(es) autotune's bootstrap reached)"),
    ("short", "error", "loop.py finished after 3 step(s), before a window could be measured; "
                       "give it more data or steps"),
    ("hang", "timeout", "step 4 of loop.py had not ended "),
])
def test_what_a_script_does_wrong_is_one_typed_outcome(tmp_path: Path, behave: str, status: str,
                                                       reason: str) -> None:
    start = time.monotonic()
    settings = replace(QUICK, no_progress_s=4.0) if behave == "silent" else QUICK
    m = _trial(tmp_path, "--behave", behave, settings=settings)
    assert (m.status, m.reason[:len(reason)] if m.reason else None) == (status, reason)
    assert time.monotonic() - start < 30  # ended by the protocol, not by the 60 s timeout


def test_a_crashing_script_is_an_error_with_its_last_line(tmp_path: Path) -> None:
    m = _trial(tmp_path, "--behave", "crash-on-bf16", config=Config(micro_batch_size=16,
                                                                    amp="bf16"))
    assert m.status == "error" and "this script cannot train in bf16" in (m.reason or "")


def test_two_ranks_under_torchrun_both_report_and_the_slowest_counts(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(LOOP), "--apply", "dataloader,ddp"]
    config = Config(micro_batch_size=16, world_size=2)
    hw = detect()
    profile = Profile(workload={"name": "loop"}, config=config, env={},
                      result={"samples_per_sec": 0.0}, baseline={}, speedup=None,
                      fingerprint=hw.fingerprint(), provenance={})
    folder = tmp_path / "t"
    spec = TrialSpec(WorkloadSpec("command", {}), config, "cpu",
                     # two ranks start slower, and torchrun's teardown (the process group,
                     # the agent) can take longer than QUICK's 4 s on a loaded 2-core machine:
                     # what is tested here is the ranks' windows, not the exit grace
                     replace(QUICK, no_progress_s=60.0, stop_grace_s=30.0))
    p = launch.plan_command(spec, parse_command(command), workdir=folder, timeout_s=90,
                            profile=profile.to_yaml())
    raw = launch.execute(p)
    m = classify(raw)
    assert m.ok, (m.reason, raw.stderr_tail[-2000:])
    assert m.reason is None  # both ranks left at the stop step by themselves
    assert [r["rank"] for r in m.ranks] == [0, 1]
    for i, w in enumerate(m.windows):
        assert w["samples"] == 2 * 16 * w["steps"]  # global samples
        spans = [r["window_seconds"][i] for r in m.ranks]
        assert w["seconds"] == pytest.approx(max(spans))  # the slowest rank's time
    stop = json.loads((folder / STOP_FILE).read_text())["at_step"]
    for rank in (0, 1):  # both left after the same step, the one they were told
        lines = (folder / f"steps.rank{rank}.jsonl").read_text().splitlines()
        assert [json.loads(x)["s"] for x in lines if '"s"' in x][-1] == stop


# -- whole studies through the CLI ----------------------------------------------------------------

def _study(folder: Path) -> optuna.Study:
    url = f"sqlite:///{folder}/studies/autotune.db"
    (name,) = optuna.get_all_study_names(url)
    return optuna.load_study(study_name=name, storage=url)


# amp is searched only where the CPU has native bf16 (else studies are fp32-only): the two tests
# that need a second precision to search run on such CPUs.
NEEDS_BF16 = pytest.mark.skipif(not detect().supports_bf16,
                                reason="amp is searched only on a CPU with native bf16")


@NEEDS_BF16
def test_a_script_that_applies_only_autocast_gets_only_precision_searched(
        tmp_path: Path) -> None:
    out = autotune("run", "--trials", "3", "--no-probe", *FAST, "--param", "batch=16", "--",
                   sys.executable, str(LOOP), "--apply", "autocast", cwd=tmp_path)
    assert out.returncode == 0, out.stderr + out.stdout
    study = _study(tmp_path)
    fixed = study.user_attrs["unapplied"]
    searched = set(study.user_attrs["space"]["searched"])
    assert "amp" in searched and "amp" not in fixed
    assert set(fixed) == searched - {"amp"}
    assert "loop.py never uses micro_batch_size or dataloader_kwargs()" in \
        fixed["micro_batch_size"]
    configs = [t.user_attrs["config"] for t in study.trials if "config" in t.user_attrs]
    baseline = configs[0]
    assert {c["amp"] for c in configs} == {"off", "bf16"}
    assert all({k: v for k, v in c.items() if k != "amp"} ==
               {k: v for k, v in baseline.items() if k != "amp"} for c in configs)
    assert "fixed: loop.py never uses" in out.stdout
    profile = load_profile(next((tmp_path / "studies").glob("*/profile.yaml")))
    assert profile.workload["params"]["command"][1:] == [str(LOOP), "--apply", "autocast"]
    assert any(n.startswith("not searched: loop.py never uses") for n in profile.notes)


@NEEDS_BF16
def test_a_study_goes_on_past_a_config_its_script_cannot_run(tmp_path: Path) -> None:
    out = autotune("run", "--trials", "3", "--no-probe", *FAST, "--param", "batch=16", "--",
                   sys.executable, str(LOOP), "--apply", "autocast", "--behave", "crash-on-bf16",
                   cwd=tmp_path)
    assert out.returncode == 0, out.stderr + out.stdout
    trials = [t for t in _study(tmp_path).trials if "config" in t.user_attrs]
    status = [(t.user_attrs["config"]["amp"], t.user_attrs.get("status")) for t in trials]
    assert status[:2] == [("off", "ok"), ("bf16", "error")]
    assert "this script cannot train in bf16" in trials[1].user_attrs["reason"]


def test_a_script_that_overrides_the_batch_stops_the_run_at_its_baseline(tmp_path: Path) -> None:
    # loop.py trains 16 per step without applying the profile's batch; the baseline asks 8.
    out = autotune("run", "--trials", "3", "--no-probe", *FAST, "--", sys.executable, str(LOOP),
                   "--apply", "autocast", cwd=tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    trials = [t for t in _study(tmp_path).trials if "config" in t.user_attrs]
    assert len(trials) == 1 and trials[0].user_attrs["status"] == "error"
    assert "loop.py trained 16 samples per optimizer step on each rank, but the config asks 8" \
        in trials[0].user_attrs["reason"]
    assert "pass --param batch=16" in out.stdout
    assert "the baseline trained another batch than its config" in out.stdout


def test_a_script_that_never_loads_a_profile_has_nothing_to_search(tmp_path: Path) -> None:
    out = autotune("run", "--trials", "4", "--no-probe", *FAST, "--param", "batch=16", "--",
                   sys.executable, str(LOOP), "--behave", "no-profile", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    study = _study(tmp_path)
    assert set(study.user_attrs["unapplied"]) == set(study.user_attrs["space"]["searched"])
    assert all("loop.py never loads a profile (autotune.load_profile())" in why
               for why in study.user_attrs["unapplied"].values())
    assert len([t for t in study.trials if "config" in t.user_attrs]) == 1  # the baseline
    assert "nothing to search: loop.py applies none of the searched knobs" in out.stdout


def test_bad_commands_are_one_line_and_lose_nothing(tmp_path: Path) -> None:
    out = autotune("run", "--trials", "1", "--", "no-such-program", "x.py", cwd=tmp_path)
    assert out.returncode == 2 or out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "autotune: error: command 'no-such-program' not found (not on PATH, not a file): check "
        "the command after --, e.g. autotune run -- python train.py"]
    out = autotune("run", "--nproc", "1", "--trials", "1", "--", sys.executable, "-m",
                   "torch.distributed.run", "--nproc-per-node", "2", str(LOOP), cwd=tmp_path)
    assert "--nproc 1 but the command starts 2 rank(s)" in out.stderr and out.returncode != 0
    assert not (tmp_path / "studies" / "autotune.db").exists()


def test_profile_check_reruns_the_command_only_when_allowed(tmp_path: Path) -> None:
    out = autotune("run", "--trials", "1", "--no-probe", *FAST, "--", sys.executable,
                   str(LOOP), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    # The same command resumes its study; another version of the script is another study.
    again = autotune("run", "--trials", "1", "--no-probe", *FAST, "--", sys.executable,
                     str(LOOP), cwd=tmp_path)
    assert again.returncode == 0 and "reached 1 trials" in again.stdout, again.stderr
    assert len(optuna.get_all_study_names(f"sqlite:///{tmp_path}/studies/autotune.db")) == 1
    path = next((tmp_path / "studies").glob("*/profile.yaml"))
    refused = autotune("profile", "check", str(path), "--rounds", "1", cwd=tmp_path)
    assert refused.returncode == 2 and "runs the command" in refused.stderr
    command = shlex.join(load_profile(path).workload["params"]["command"])
    ran = autotune("profile", "check", str(path), "--rounds", "1", "--threshold", "0.01",
                   "--allow-workload", command, cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "round 1/1:" in ran.stdout and "PASS" in ran.stdout


# -- the examples, tuned as they are --------------------------------------------------------------

# Per example: the arguments of a tuned run (the tuner stops it), and those of a short run with
# the profile afterwards.
TUNED = {
    "train_plain.py": (["--workload", "mlp"], ["--workload", "mlp", "--seconds", "0.3"]),
    "train_hf.py": (["--seq-len", "16"], ["--max-steps", "3", "--seq-len", "16"]),
    "train_lightning.py": ([], ["--max-steps", "3"]),
}


def _last_json(text: str) -> dict[str, Any]:
    return json.loads([ln for ln in text.splitlines() if ln.startswith("{")][-1])


@pytest.mark.slow
@pytest.mark.parametrize("example", list(TUNED))
def test_each_example_is_tuned_as_it_is_and_runs_its_profile(tmp_path: Path,
                                                            example: str) -> None:
    needs_framework(example)
    tuned, short = TUNED[example]
    script = str(EXAMPLES / example)
    out = autotune("run", "--trials", "2", "--no-probe", *FAST, "--", sys.executable, script,
                   *tuned, cwd=tmp_path, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    study = _study(tmp_path)
    ok = [t for t in study.trials if t.user_attrs.get("status") == "ok"]
    assert ok and all(t.user_attrs["measurement"]["windows"] for t in ok)
    accessed = set(ok[0].user_attrs["measurement"]["script"]["accessed"])
    assert accessed & {"dataloader_kwargs", "hf_training_args"}  # it applies the batch
    assert "micro_batch_size" not in study.user_attrs["unapplied"]
    if EXAMPLE_FRAMEWORKS[example]:
        # The bootstrap reached its Trainer too, and the steps of its own callback are not
        # counted twice: as many reported as the Trainer says it ran.
        m = ok[0].user_attrs["measurement"]
        assert m["script"]["readback"]["via"].split()[0] in ("Trainer", "Lightning")
        folder = next(tmp_path.glob(f"studies/*/trials/{ok[0].number:04d}"))
        trained = _last_json((folder / "stderr.log").read_text())
        reported = [ln for ln in (folder / "steps.rank0.jsonl").read_text().splitlines()
                    if ln.startswith('{"s":')]
        assert len(reported) == trained["steps"], trained
    path = next((tmp_path / "studies").glob("*/profile.yaml"))
    profile = load_profile(path)
    # Outside a trial, with the profile, each example runs as it does without autotune and
    # writes no steps, even with a trial's samples-per-step in its environment.
    ran = autotune("launch", str(path), "--", sys.executable, script, *short, cwd=tmp_path,
                   timeout=300, env={"AUTOTUNE_SAMPLES_PER_STEP": "8"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    printed = _last_json(ran.stdout)
    assert printed["steps"] == 3 or example == "train_plain.py" and printed["steps"] >= 3
    studies = tmp_path / "studies"  # the trials' own steps files are in there
    assert not [p for p in tmp_path.rglob("steps.*") if studies not in p.parents]
    if example == "train_hf.py":
        assert printed["args"]["per_device_train_batch_size"] == profile.micro_batch_size
    elif example == "train_lightning.py":
        assert printed["accumulate_grad_batches"] == profile.accumulation_steps
    else:
        assert printed["samples_per_sec"] > 0


@pytest.mark.slow
def test_a_script_that_starts_its_own_ranks_gets_them_from_nproc(tmp_path: Path) -> None:
    needs_framework("train_lightning.py")
    out = autotune("run", "--nproc", "2", "--trials", "1", "--no-probe", *FAST,
                   "--trial-timeout", "120s", "--", sys.executable,
                   str(EXAMPLES / "train_lightning.py"), cwd=tmp_path, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (trial,) = [t for t in _study(tmp_path).trials if "config" in t.user_attrs]
    m = trial.user_attrs["measurement"]
    assert trial.user_attrs["status"] == "ok", trial.user_attrs.get("reason")
    assert trial.user_attrs["config"]["world_size"] == 2
    assert [r["rank"] for r in m["ranks"]] == [0, 1]  # Lightning's second rank reported too


# (A shell's code naming the script is tracked as the script: test_command_is_checked_...)
@pytest.mark.parametrize("form", ["python", "wrapper"])
def test_an_edited_script_is_not_resumed_into_its_old_study(tmp_path: Path, form: str) -> None:
    script, wrapper = tmp_path / "train.py", tmp_path / "wrap.sh"
    script.write_text(LOOP.read_text())
    python = shlex.quote(sys.executable)
    wrapper.write_text(f"#!/bin/sh\nexec {python} train.py\n")
    wrapper.chmod(0o755)
    command = {"python": [sys.executable, str(script)], "wrapper": [str(wrapper)]}[form]
    args = ["run", "--study", "s", "--trials", "1", "--no-probe", *FAST, "--", *command]
    first = autotune(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    # A wrapper file is tracked, and the run says the script behind it is not.
    said = "wrap.sh is tracked (its sha256), not the Python script it runs: an edit to that " \
           "script neither starts a new study nor is refused by `autotune profile check`"
    assert (said in first.stdout) == (form == "wrapper"), first.stdout
    edited = wrapper if form == "wrapper" else script
    edited.write_text(edited.read_text() + "# tuned since\n")
    out = autotune(*args, cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"{edited.name} changed since study s measured it (sha256 " in out.stderr
    assert len(_study(tmp_path).trials) == 1  # nothing lost, nothing added


def test_a_baseline_that_fails_as_every_trial_would_stops_the_run(tmp_path: Path) -> None:
    script = tmp_path / "crash.py"
    script.write_text("import sys\nsys.exit('cannot open /data/shards: no such file')\n")
    out = autotune("run", "--trials", "4", "--no-probe", *FAST, "--", sys.executable,
                   str(script), cwd=tmp_path)
    assert out.returncode != 0
    assert "stopped: the baseline trial of crash.py failed (" in out.stdout, out.stdout[-2000:]
    assert "every trial runs the same script: make it train as it is on its own" in out.stdout
    assert len([t for t in _study(tmp_path).trials if "config" in t.user_attrs]) == 1
