"""Whole studies with real trial processes and real SQLite storage (PostgreSQL: test_fleet), and
what the tuner decides about them (budgets, resuming), the tuner in-process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import optuna
import psutil
import pytest
from optuna.trial import TrialState

from autotune.config.knobs import Config
from autotune.config.space import load_space, narrow
from autotune.console import QuietReporter
from autotune.errors import UsageError
from autotune.machine.hardware import CPU_IDENTITY, Hardware
from autotune.profile import FingerprintWarning, load_profile
from autotune.testing.hardware import fake_cpu
from autotune.testing.replay import Asked, ReplayMeasurer, Row
from autotune.trial.spec import MeasureSettings
from autotune.tuner import snapshot
from autotune.tuner.identity import Identity, open_study
from autotune.tuner.record import TrialRecord, read_trials
from autotune.tuner.runner import Runner, RunOptions
from autotune.workloads import WorkloadSpec
from tests.conftest import FAST, JOURNAL, ROOT, autotune, load_study, poll, replayed

DB = "sqlite:///study.db"
# Whole studies with real trial processes (seconds each) are marked slow; the tests of what the
# tuner decides run it in-process, its trials replayed (``autotune.testing.replay``).
SLOW = pytest.mark.slow


def load(url: str, name: str | None = None) -> optuna.Study:
    names = optuna.get_all_study_names(url)
    return optuna.load_study(study_name=name or names[0], storage=url)


def stored(study: optuna.Study, r: TrialRecord) -> optuna.trial.FrozenTrial:
    """The trial behind a record, as Optuna holds it (its value, constraints, intermediate
    values)."""
    return study.trials[r.number]


@SLOW
def test_small_study_end_to_end(workdir: Path) -> None:
    result = autotune("run", "--model", "mlp", "--trials", "4", "--storage", DB, *FAST,
                      cwd=workdir)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "budget       4 measured trials in the study" in out and "(baseline)" in out
    assert "speedup over the baseline" in out
    study = load(DB)
    snap = snapshot.read(study)
    trials = snap.records
    assert len(snap.measured) == 4  # a repeated or ruled-out config does not count
    base = trials[0]
    assert base.is_baseline and base.status == "ok"
    # amp is searched only where the CPU has native bf16; the baseline runs fp32 either way.
    assert base.params["micro_batch_size"] == 32 and base.config.amp == "off"
    assert base.params["num_workers"] == 0 and stored(study, base).constraints["memory"] == \
        pytest.approx(base.peak_memory_bytes - snap.facts.memory_limit_bytes)
    # Each window's throughput (how many fit the 5 s budget depends on the machine's load).
    windows = base.measurement.windows
    assert len(stored(study, base).intermediate_values) == len(windows) >= 1
    profile = load_profile(workdir / "studies" / study.study_name / "profile.yaml")
    best = max((t for t in trials if t.status == "ok"), key=lambda t: stored(study, t).value)
    best_value, base_value = stored(study, best).value, stored(study, base).value
    assert best.samples_per_sec == best_value and base.samples_per_sec == base_value
    assert profile.samples_per_sec == pytest.approx(best_value, rel=1e-3)
    assert profile.speedup == pytest.approx(best_value / base_value, rel=1e-2)
    assert profile.baseline["samples_per_sec"] == pytest.approx(base_value, rel=1e-3)
    assert profile.provenance["trials"] == 4 and profile.provenance["study"] == study.study_name
    assert snap.facts.space["fixed"]["pin_memory"]["reason"]
    assert (workdir / "studies" / study.study_name / "trials" / "0000" / "result.json").exists()


def test_same_command_again_resumes_and_adds_no_trial(memdir: Path) -> None:
    """The real tuner in-process on real SQLite, its trials replayed: run twice, the second
    resumes with what the first measured and measures nothing."""
    def run() -> tuple[ReplayMeasurer, str]:
        measure = ReplayMeasurer(lambda asked: Row(1000.0 + asked.config.samples_per_step))
        _, out = replayed(measure, model="mlp", trials=2, storage=DB,
                          out_dir=Path("results"))
        return measure, out

    first, _ = run()
    assert load_profile(memdir / "results" / "profile.yaml",
                        check_fingerprint=False).provenance["trials"] == 2
    # Each trial's outputs go under --out (its process writes its logs there).
    assert [a.workdir for a in first.asked] == [Path("results", "trials", f"{n:04d}")
                                                for n in range(2)]
    assert not (memdir / "studies").exists()  # --out moved the outputs; the storage is explicit
    again, out = run()
    assert again.asked == [] and "resuming     2 trial(s) already measured" in out
    assert len(read_trials(load(DB))) == 2


@SLOW
def test_memory_limit_below_the_need_is_infeasible_and_the_study_goes_on(workdir: Path) -> None:
    # memhog holds 128 MiB per sample: the baseline's batch of 4 passes the 700 MiB limit and
    # runs first; batch 1 (~0.5 GiB with torch itself) fits and runs after it.
    (workdir / "space.yaml").write_text(
        "# autotune run --model autotune.testing.workloads:memhog --space space.yaml\n"
        "knobs:\n  micro_batch_size: {choices: [1]}\n")
    result = autotune("run", "--model", "autotune.testing.workloads:memhog", "--param",
                      "mib_per_sample=128", "--space", "space.yaml", "--trials", "2",
                      "--memory-limit", "700MiB", "--storage", DB, *FAST, cwd=workdir)
    assert result.returncode == 0, result.stderr
    study = load(DB)
    oom, fits = read_trials(study)
    assert oom.params["micro_batch_size"] == 4 and oom.is_baseline
    assert oom.status == "oom" and stored(study, oom).constraints["memory"] > 0
    assert oom.peak_memory_bytes > 700 * 2**20
    assert fits.params["micro_batch_size"] == 1  # the study went on after the OOM
    assert fits.status == "ok" and stored(study, fits).constraints["memory"] <= 0
    assert "passed the memory limit" in result.stdout
    assert "no speedup is claimed" in (workdir / "studies").joinpath(
        load(DB).study_name, "profile.yaml").read_text()


@SLOW
def test_a_real_allocation_failure_is_recorded_and_the_study_goes_on(workdir: Path) -> None:
    (workdir / "space.yaml").write_text("knobs:\n  micro_batch_size: {choices: [64]}\n")
    opts = RunOptions(model="autotune.testing.workloads:memhog",
                      params={"mib_per_sample": 256}, space="space.yaml", trials=2,
                      # 20 s: room for micro-batch 4 (1 GiB written in its first step) on a
                      # loaded CI machine; the windows end it in seconds otherwise.
                      storage=DB, measure=MeasureSettings(min_window_s=0.05, max_seconds=20),
                      address_space_bytes=8 * 2**30)  # batch 64 x 256 MiB cannot be mapped
    summary = Runner(opts, QuietReporter()).run()
    statuses = {t.config.micro_batch_size: (t.status, t.reason) for t in summary.trials}
    assert statuses[4][0] == "ok"
    assert statuses[64][0] == "oom" and "can't allocate memory" in statuses[64][1]
    assert summary.best is not None and summary.best.config.micro_batch_size == 4


@SLOW
@pytest.mark.serial  # a wall-time budget: other tests beside it would eat into it
def test_timeout_holds_including_the_running_trial(workdir: Path) -> None:
    start = time.monotonic()
    # Each step sleeps 3 s: warm-up and three windows need well over the 8 s budget.
    result = autotune("run", "--model", "autotune.testing.workloads:slow", "--timeout", "8s",
                      "--param", "step_s=3",
                      "--trial-seconds", "60", "--storage", DB, cwd=workdir)
    elapsed = time.monotonic() - start
    assert result.returncode == 1  # nothing could be measured in time: no profile
    assert "time budget of 8s spent" in result.stdout
    assert "no configuration has been measured successfully" in result.stdout
    assert elapsed < 8 + 10  # process start-up and the final export on top of the budget
    study = load(DB)
    assert read_trials(study) == []  # cut by the budget: not a result about the config
    cut = [t for t in study.trials if t.state == TrialState.FAIL]
    assert len(cut) == 1 and cut[0].user_attrs["reason"] == "stopped by the run's --timeout"
    waiting = [t for t in study.trials if t.state == TrialState.WAITING]
    assert waiting and waiting[0].system_attrs["fixed_params"] == cut[0].params  # run again next
    # Cut a second time, it is a real timeout: a config that never fits is not retried forever.
    again = autotune("run", "--model", "autotune.testing.workloads:slow", "--timeout", "8s",
                     "--param", "step_s=3", "--trial-seconds", "60", "--storage", DB, cwd=workdir)
    assert again.returncode == 1
    (timed_out,) = read_trials(load(DB))
    assert timed_out.state == TrialState.PRUNED and timed_out.status == "timeout"


def _slow_steps(step_s: float, exponent: float, startup_s: float = 1.5) -> ReplayMeasurer:
    """The ``slow`` workload's trials, replayed: each micro-batch takes ``step_s x (batch / 4)
    ** exponent`` seconds; a trial starts in ``startup_s``, warms up for three steps and
    measures three windows of at least a step."""
    def row(asked: Asked) -> Row:
        c, window = asked.config, asked.settings.min_window_s
        step = c.grad_accum_steps * step_s * (c.micro_batch_size / 4) ** exponent
        warmup, measure = 3 * step, 3 * max(step, window)
        return Row(c.samples_per_step / step, wall_s=startup_s + warmup + measure,
                   extra={"timings": {"warmup_s": warmup, "measure_s": measure}})

    return ReplayMeasurer(row)


def test_long_steps_get_their_budget_and_a_known_too_slow_config_never_starts(
        memdir: Path) -> None:
    # Steps take 0.25 s per 4 samples: 4 -> 0.25 s, 16 -> 1 s, 64 -> 4 s. Measuring 16 needs
    # more than the 2 s --trial-seconds: the step-time model, scaled from the baseline, gives
    # it that. 64 needs ~13 s of warm-up and two one-step windows even at the prediction's
    # lower end (4 s less 30%); a 12 s trial timeout (at most 80% of it to measure) cannot
    # hold it, and the fit on 4 and 16 says so before anything starts. (With 20 s, 64 fit
    # once warm-up's last step became the first window: the test's premise, not a bug.) The
    # real tuner runs in-process, its trials replayed: what is tested is what it decides.
    (memdir / "space.yaml").write_text("knobs:\n  micro_batch_size: {choices: [4, 16, 64]}\n")
    measure = _slow_steps(0.25, 1.0)
    _, out = replayed(measure, model="autotune.testing.workloads:slow",
                      params={"step_s": 0.25, "exponent": 1}, space="space.yaml", trials=3,
                      window_s=0.2, trial_s=2.0, trial_timeout_s=12.0, storage=JOURNAL)
    trials = read_trials(load_study(JOURNAL))
    by_micro = {t.params["micro_batch_size"]: t for t in trials if t.reused_from is None}
    base, sixteen = by_micro[4], by_micro[16]
    assert base.status == "ok" and base.budget == {}
    assert sixteen.status == "ok"
    assert sixteen.budget["max_seconds"] > 2.0
    # What its budget is for: three windows, never more; the trial was asked for exactly that.
    assert sixteen.budget["max_windows"] == 3
    (asked,) = measure.of(sixteen.config)
    assert asked.settings.max_windows == 3
    assert asked.settings.max_seconds == pytest.approx(sixteen.budget["max_seconds"])
    assert measure.of(base.config)[0].settings == MeasureSettings(min_window_s=0.2,
                                                                  max_seconds=2.0)
    forecast = sixteen.forecast.step
    assert forecast is not None
    assert forecast.fitted is False and forecast.step_s == pytest.approx(1.0, rel=0.3)
    slow = by_micro[64]
    assert slow.predicted and slow.predicted_kind == "too_slow"
    assert (slow.reason or "").startswith("predicted-too-slow: ~")
    assert slow.state == TrialState.PRUNED
    assert measure.of(slow.config) == []  # nothing ran
    assert "predicted too slow" in out
    assert "(predicted 1" in out  # predicted beside measured, per trial


def test_resuming_keeps_the_memory_limit(memdir: Path) -> None:
    """The resume guard, in-process (the study in a journal file, its trials replayed): the
    same flag resumes, another limit is refused in one line (a UsageError: exit 2)."""
    def run(limit: str) -> None:
        replayed(ReplayMeasurer(lambda asked: Row(1000.0)), model="mlp", trials=1,
                 memory_limit=limit, storage=JOURNAL)

    run("0.5")
    run("0.5")  # the same flag
    with pytest.raises(UsageError, match="was tuned with --memory-limit") as refused:
        run("2GiB")
    assert refused.value.exit_code == 2 and "\n" not in str(refused.value)


def _start(workdir: Path, *args: str) -> subprocess.Popen[str]:
    """The CLI in the background, with Ctrl-C's default: a test run started in the background
    of a shell without job control (`make test &` in a script) ignores SIGINT, and a child
    inherits that, so the Ctrl-C test would send a signal its tuner never sees."""
    return subprocess.Popen([sys.executable, "-m", "autotune", *args], cwd=workdir, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _measuring_after(n: int, tuner: subprocess.Popen[str]):
    """True once n trials are recorded and the tuner has a trial process measuring."""
    def check() -> bool:
        try:
            study = load(DB)
        except Exception:
            return False
        trials = study.get_trials(deepcopy=False)
        running = [t for t in trials if t.state == TrialState.RUNNING and "worker" in t.user_attrs]
        benches = []
        for child in psutil.Process(tuner.pid).children():
            try:
                if "autotune.trial.bench" in " ".join(child.cmdline()):
                    benches.append(child)
            except psutil.Error:  # a trial that just ended
                continue
        return len(read_trials(study)) >= n and bool(running) and bool(benches)

    return check


@SLOW
def test_killed_tuner_resumes_with_earlier_trials_intact(workdir: Path) -> None:
    # Killed measuring a trial after two were recorded; resumed, it ends at --trials 4 with the
    # earlier trials kept (a trial after the killed one keeps the wait for it from racing the
    # study's end).
    args = ("run", "--model", "mlp", "--trials", "4", "--storage", DB, *FAST)
    tuner = _start(workdir, *args)
    poll(_measuring_after(2, tuner))
    study = load(DB)
    before = {r.number: stored(study, r).value for r in read_trials(study)}
    trial_procs = psutil.Process(tuner.pid).children(recursive=True)
    assert trial_procs  # the kill lands while a trial process is measuring
    tuner.send_signal(signal.SIGKILL)
    tuner.communicate()
    _, alive = psutil.wait_procs(trial_procs, timeout=10)
    assert not alive  # the trial died with its tuner

    result = autotune(*args, cwd=workdir)
    assert result.returncode == 0, result.stderr
    study = load(DB)
    trials = read_trials(study)
    assert len(trials) == 4 and len(before) >= 2
    after = {r.number: stored(study, r).value for r in trials}
    assert all(after[n] == v for n, v in before.items())  # earlier trials intact
    killed = [t for t in study.trials if t.user_attrs.get("interrupted")]
    assert len(killed) == 1 and killed[0].state == TrialState.FAIL
    retried = [t for t in study.trials if t.system_attrs.get("failed_trial") == killed[0].number]
    assert retried and retried[0].params == killed[0].params
    assert not any(t.state == TrialState.RUNNING for t in study.trials)


@SLOW
def test_ctrl_c_ends_the_trial_and_keeps_the_study(workdir: Path) -> None:
    # --patience 0: no early stop, so the study is still running whenever Ctrl-C comes.
    args = ("run", "--model", "mlp", "--trials", "20", "--patience", "0", "--storage", DB,
            *FAST)
    tuner = _start(workdir, *args)
    poll(_measuring_after(2, tuner))
    tuner.send_signal(signal.SIGINT)
    out, err = tuner.communicate(timeout=60)
    assert tuner.returncode == 130, out[-3000:] + err
    assert "interrupted; study" in err and "run the same command to resume" in err
    study = load(DB)
    assert not any(t.state == TrialState.RUNNING for t in study.trials)
    assert len(read_trials(study)) >= 2
    assert (workdir / "studies" / study.study_name / "profile.yaml").exists()


ZEN4 = {"cpu_vendor": "AuthenticAMD", "cpu_family": 25, "cpu_model_number": 17,
        "cpu_stepping": 1, "cpu_flags": ("avx2", "avx512_bf16", "avx512f", "fma")}


def _identity(hw: Hardware) -> Identity:
    baseline = Config(micro_batch_size=32)
    return Identity("s", "mlp", WorkloadSpec("mlp", {}), narrow(load_space("default"), hw, 1,
                    baseline), hw, baseline, 1, None)


def _old_study(hw: Hardware, **stored: Any) -> optuna.storages.BaseStorage:
    """A study as an autotune from before the CPU identity fields left it."""
    storage = optuna.storages.InMemoryStorage()
    open_study(storage, "memory", _identity(hw), seed=0, limit=2**30, limit_spec=None)
    old = {k: v for k, v in hw.fingerprint().items() if k not in CPU_IDENTITY}
    optuna.load_study(study_name="s", storage=storage).set_user_attr(
        "fingerprint", {**old, **stored})
    return storage


def test_a_study_from_before_the_cpu_fields_resumes_with_one_warning() -> None:
    """Everything it recorded matches: it resumes, says in one line what could not be
    checked, and records this CPU, so a worker on another CPU is refused from then on."""
    zen4 = replace(fake_cpu(), **ZEN4)
    storage = _old_study(zen4)
    notes: list[str] = []
    study, _ = open_study(storage, "memory", _identity(zen4), seed=0, limit=2**30,
                          limit_spec=None, note=notes.append)
    (line,) = notes
    assert line.startswith(
        "study s was made by an earlier autotune whose fingerprint did not record the CPU's "
        "vendor, family, model, stepping, ISA flags, so autotune cannot tell whether this "
        "machine (CPU Fake CPU (family 25 model 17), 2 cores, bf16) is the CPU its 0 trial(s) "
        "ran on; everything else it recorded matches, so it resumes")
    assert line.endswith("pass another --study name to start a new study") and "\n" not in line
    assert study.user_attrs["fingerprint"] == zen4.fingerprint()
    assert study.user_attrs["cpu_identity_unverified"]["fields"] == list(CPU_IDENTITY)
    # Said once: the study now records its CPU.
    again: list[str] = []
    open_study(storage, "memory", _identity(zen4), seed=0, limit=2**30, limit_spec=None,
               note=again.append)
    assert again == []
    zen3 = replace(zen4, cpu_model_number=1, cpu_flags=("avx2", "fma"))
    with pytest.raises(UsageError, match=r"^study s was measured on other hardware \(cpu_flags: "
                                         r".*; cpu_model_number: 17 vs 1 here\)"):
        open_study(storage, "memory", _identity(zen3), seed=0, limit=2**30, limit_spec=None)
    # Without a note callback (a caller that has no reporter) the line is a warning.
    with pytest.warns(FingerprintWarning, match="made by an earlier autotune"):
        open_study(_old_study(zen4), "memory", _identity(zen4), seed=0, limit=2**30,
                   limit_spec=None)


def test_a_study_from_before_the_cpu_fields_that_differs_otherwise_is_refused() -> None:
    zen4 = replace(fake_cpu(), **ZEN4)
    with pytest.raises(UsageError) as refused:
        open_study(_old_study(zen4, cpu_cores=4), "memory", _identity(zen4), seed=0,
                   limit=2**30, limit_spec=None)
    assert str(refused.value) == (
        "study s was made by an earlier autotune whose fingerprint did not record the CPU's "
        "vendor, family, model, stepping, ISA flags, and what it did record differs here "
        "(cpu_cores: 4 vs 2 here); measurements are not comparable: pass another --study name "
        "to start a new study")


def test_a_study_over_another_space_is_refused_and_left_as_it_was() -> None:
    """The same machine, a space narrowed otherwise (amp fp32 only, as a CPU without native bf16
    narrows it): its trials would not fit this space's, so the resume is refused in one line
    naming the space it searched, and nothing is written to the study."""
    storage = optuna.storages.InMemoryStorage()
    ident = _identity(fake_cpu())
    fp32 = narrow(load_space("default"), fake_cpu(bf16=False), 1, ident.baseline)
    open_study(storage, "memory", replace(ident, space=fp32), seed=0, limit=2**30,
               limit_spec=None)
    before = optuna.load_study(study_name="s", storage=storage).user_attrs
    with pytest.raises(UsageError) as refused:
        open_study(storage, "memory", ident, seed=0, limit=2**30, limit_spec=None)
    line = str(refused.value)
    assert line.startswith("study s searched another space ({") and "\n" not in line
    assert "'amp'" not in line  # the space it searched: amp was fixed there, not searched
    assert line.endswith("its trials would not fit this one: pass another --study name")
    assert optuna.load_study(study_name="s", storage=storage).user_attrs == before
