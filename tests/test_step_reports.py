"""What a script's trial reports is untrusted input: a malformed, non-finite, out-of-order,
impossible or missing report ends that trial with a typed outcome naming the step, and the
study goes on. Each case runs a real script (tests/data/scripts/hostile.py) in a real trial."""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optuna
import pytest
import yaml

from autotune import steps
from autotune.config.knobs import Config
from autotune.machine.hardware import detect
from autotune.profile import Profile
from autotune.trial import launch
from autotune.trial.command import parse_command
from autotune.trial.measurement import Measurement, classify
from autotune.trial.output import CappedLog
from autotune.trial.reports import check_step
from autotune.trial.spec import MeasureSettings, TrialSpec
from autotune.workloads import WorkloadSpec
from tests.conftest import FAST, ROOT, autotune

HOSTILE = ROOT / "tests" / "data" / "scripts" / "hostile.py"
QUICK = MeasureSettings(min_window_s=0.2, max_seconds=4.0, no_progress_s=30.0, stop_grace_s=4.0)
CONFIG = Config(micro_batch_size=16)


def _trial(tmp_path: Path, behave: str, workdir: Path | None = None) -> Measurement:
    """One trial of hostile.py in a real process, as the tuner runs it."""
    command = parse_command([sys.executable, str(HOSTILE), "--behave", behave])
    profile = Profile(workload={"name": "hostile", "spec": "command", "params": {}},
                      config=CONFIG, env={}, result={"samples_per_sec": 0.0}, baseline={},
                      speedup=None, fingerprint=detect().fingerprint(), provenance={})
    spec = TrialSpec(WorkloadSpec("command", {}), CONFIG, "cpu", QUICK)
    p = launch.plan_command(spec, command, workdir=workdir or tmp_path / "trial", timeout_s=60.0,
                            profile=profile.to_yaml())
    return classify(launch.execute(p))


# -- a report the tuner cannot trust ends the trial, naming the step ---------------------------

@pytest.mark.parametrize(("behave", "status", "reason"), [
    # The script deletes its own trial folder: the tuner once died writing the result there.
    ("rmdir-self", "error", "the trial's folder"),
    # A NaN end time: the tuner once died in math.ceil(NaN).
    ("nan-time", "error", "hostile.py: step 5 of rank 0 has end time nan, not a finite number"),
    ("not-json", "error", "hostile.py: rank 0 wrote a line that is not JSON"),
    # 10**9 samples on every tenth step once won at 4.7e9 samples/s.
    ("spike", "error", "hostile.py: step 10 of rank 0 counts 1000000000 samples, more than the "
                       "config's 16"),
    # The count check was skipped when the first step used the default count.
    ("default-then-big", "error", "hostile.py: step 2 of rank 0 counts 1000000000 samples"),
    # End times that do not advance were clamped to 1e-9 s (4e11 samples/s, exported).
    ("frozen-time", "error", "hostile.py: step "),
    # 200,000 nested brackets ended the tuner (RecursionError: "internal error", exit 1).
    # (Read while it is written, it may be a line without an end yet: either ends the trial.)
    ("deep-array", "error", "hostile.py: rank 0 wrote "),
    ("deep-object", "error", "hostile.py: rank 0 wrote a line that is nested more than 32 "
                             "levels deep"),
    # A read-back whose tables are lists ended the tuner (AttributeError).
    ("list-readback", "error", "hostile.py: rank 0 reported what its Trainer runs with, but "
                               "fixed is not a table of names"),
    # An unfinished line was kept and re-joined on every look: 300 MB grew the tuner to 640 MB.
    ("no-line-end", "error", "hostile.py: rank 0 wrote more than 64 KiB without a line end"),
    # A nested python reporting as rank 0 too read as "reported step 1 where step 6 was due".
    ("nested", "error", "hostile.py: two processes (pids "),
])
def test_a_report_that_cannot_be_trusted_ends_its_trial(tmp_path: Path, behave: str,
                                                        status: str, reason: str) -> None:
    m = _trial(tmp_path, behave)
    # Ended by the protocol, naming the step: not the 60 s trial timeout's "timeout".
    assert (m.status, (m.reason or "")[:len(reason)]) == (status, reason), m.reason
    assert m.samples_per_sec is None
    if behave == "frozen-time":
        assert "shorter than reporting a step takes" in (m.reason or "")
    if behave == "deep-array":
        assert "a line that is longer than 65536 bytes" in (m.reason or "") or \
            "more than 64 KiB without a line end" in (m.reason or ""), m.reason


def test_a_step_line_is_checked_field_by_field() -> None:
    ok = {"s": 3, "t": 100.5, "n": 8, "d": 0.01, "m": 10}
    args: dict[str, Any] = dict(rank=0, step=3, last_end=100.0, since=90.0, now=101.0)
    assert check_step(ok, **args) is None
    for bad, words in (({"s": 4}, "reported step 4 where step 3 was due"),
                       ({"s": True}, "reported step True"),
                       ({"t": math.inf}, "end time inf"),
                       ({"t": "100"}, "end time '100'"),
                       ({"t": 99.0}, "before step 2 did"),
                       ({"t": 80.0}, "before the trial started"),
                       ({"t": 200.0}, "in the future"),
                       ({"n": -1}, "counts -1 samples"),
                       ({"n": 8.5}, "counts 8.5 samples"),
                       ({"d": math.nan}, "waited nan s"),
                       ({"d": -1}, "waited -1 s"),
                       ({"m": "x"}, "peak memory 'x'")):
        assert words in (check_step({**ok, **bad}, **args) or ""), bad


# -- a study goes on past them -------------------------------------------------------------------

def _study(tmp_path: Path) -> optuna.Study:
    name = optuna.get_all_study_names(f"sqlite:///{tmp_path}/studies/autotune.db")[0]
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path}/studies/autotune.db")


# (A trial that removes its folder: test_untrusted. 200,000 nested brackets once ended the run.)
@pytest.mark.parametrize("behave", ["deep-array", "frozen-time"])
def test_the_study_goes_on_and_exports_only_what_was_measured(tmp_path: Path,
                                                              behave: str) -> None:
    # The baseline (micro-batch 8) behaves; every other config's trial misbehaves.
    out = autotune("run", "--trials", "3", "--no-probe", *FAST, "--", sys.executable,
                   str(HOSTILE), "--behave", behave, "--only-batch", "8", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "internal error" not in out.stderr
    trials = [t for t in _study(tmp_path).trials if "config" in t.user_attrs]
    statuses = [t.user_attrs["status"] for t in trials]
    assert statuses[0] == "ok" and "error" in statuses[1:], statuses
    profile = yaml.safe_load(next(tmp_path.glob("studies/*/profile.yaml")).read_text())
    assert profile["config"]["micro_batch_size"] == 8  # the only config that measured
    best = profile["result"]["samples_per_sec"]
    assert 0 < best < 16 * 1000  # a 10 ms step of 8 samples: never a clamp's 1e11


def test_progress_events_are_read_only_as_a_trial_writes_them(tmp_path: Path) -> None:
    from autotune.trial.progress import Tail, read_events
    from tests.data.scripts.hostile import PROGRESS

    path = tmp_path / "progress.jsonl"
    ours = {"event": "window", "t": 1.0, "index": 0, "samples": 8, "seconds": 0.5,
            "samples_per_sec": 16.0, "data_wait_s": 0.0}
    path.write_text("".join(json.dumps(e) + "\n" for e in [*PROGRESS, ours]) + "{\"event\"")
    # Only autotune's own events, with only their own keys: the window with "trial" and
    # "kind" is kept without them; the rest, and the unfinished last line, are not events.
    stripped = {k: v for k, v in PROGRESS[2].items() if k not in ("trial", "kind")}
    assert read_events(str(path)) == [stripped, ours]
    seen: list[dict[str, Any]] = []
    Tail(str(path)).forward(seen.append)
    assert seen == [stripped, ours]


def test_a_run_with_json_events_outlives_what_a_script_writes_into_its_progress_file(
        tmp_path: Path) -> None:
    out = autotune("run", "--trials", "1", "--no-probe", "--json", *FAST, "--", sys.executable,
                   str(HOSTILE), "--behave", "junk-progress", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    events = [json.loads(line) for line in out.stdout.splitlines()]  # "trial" twice once
    assert events[-1]["event"] == "finished"


# -- paths and environment -------------------------------------------------------------------------

@pytest.mark.parametrize("behave", ["chdir-before", "chdir-after"])
def test_a_script_that_changes_directory_still_loads_its_profile_and_stops(
        tmp_path: Path, behave: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    m = _trial(tmp_path, behave, workdir=Path("studies") / "s" / "trials" / "0001")
    assert m.ok, m.reason
    assert m.reason is None  # stopped when asked, not ended by signal after the grace


def test_a_script_trial_s_paths_are_absolute(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    spec = TrialSpec(WorkloadSpec("command", {}), CONFIG, "cpu", QUICK)
    p = launch.plan_command(spec, parse_command([sys.executable, str(HOSTILE)]),
                            workdir=Path("studies/s/trials/0001"), timeout_s=9.0, profile="")
    for name in ("AUTOTUNE_TRIAL_DIR", "AUTOTUNE_PROFILE"):
        assert os.path.isabs(p.env[name]) and p.env[name].startswith(str(tmp_path))


@pytest.mark.parametrize(("behave", "words"), [
    ("nan-wait", "autotune.step(data_s=nan): data_s must be a finite number of seconds >= 0"),
    ("bad-rank", "RANK='abc' in the environment is not a whole number"),
    ("bad-samples-env", "AUTOTUNE_SAMPLES_PER_STEP='abc' in the environment is not a whole "
                        "number"),
])
def test_what_step_cannot_report_is_refused_at_once_in_one_line(tmp_path: Path, behave: str,
                                                                words: str) -> None:
    m = _trial(tmp_path, behave)
    assert m.status == "error" and words in (m.reason or ""), m.reason
    # The tuner saw no "hang": the script said what was wrong and ended.
    assert "had not ended" not in (m.reason or "")


def test_step_checks_its_arguments_in_a_trial_only(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steps, "_state", False)
    steps.step(data_s=math.nan)  # outside a trial: nothing is read, nothing refused
    monkeypatch.setattr(steps, "_state", None)
    monkeypatch.setenv("AUTOTUNE_TRIAL_DIR", str(tmp_path))
    monkeypatch.setenv("AUTOTUNE_SAMPLES_PER_STEP", "8")
    monkeypatch.setenv("AUTOTUNE_TUNER_PID", "0")
    for bad in ({"samples": -1}, {"samples": 2.5}, {"samples": True}, {"data_s": math.inf},
                {"data_s": "x"}, {"loss": "x"}):
        with pytest.raises(steps.StepError, match=r"^autotune\.step\("):
            steps.step(**bad)
    steps.step(8, 0.01, loss=0.5)
    lines = (tmp_path / "steps.rank0.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["s"] == 1  # refused calls are not steps


# -- a diverging script is diverged, not ok ----------------------------------------------------

def test_a_script_whose_loss_goes_nan_is_diverged(tmp_path: Path) -> None:
    m = _trial(tmp_path, "nan-loss")
    assert m.status == "diverged", m.reason
    assert "NaN or infinite at step 5 of rank 0" in (m.reason or "")


def _in_trial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steps, "_state", None)
    monkeypatch.setenv("AUTOTUNE_TRIAL_DIR", str(tmp_path))
    monkeypatch.setenv("AUTOTUNE_SAMPLES_PER_STEP", "8")
    monkeypatch.setenv("AUTOTUNE_TUNER_PID", "0")


def _nan_lines(tmp_path: Path) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in (tmp_path / "steps.rank0.jsonl").read_text().splitlines()]
    return [e for e in lines if e.get("nan") is not None]


def test_the_hf_callback_reports_a_nan_it_logs(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    from autotune.integrations.hf import AutotuneCallback

    _in_trial(tmp_path, monkeypatch)
    cb = AutotuneCallback()
    cb.on_train_begin(SimpleNamespace(per_device_train_batch_size=8), None, None)
    cb.on_log(None, None, None, logs={"loss": 2.5, "grad_norm": 1.0})
    assert not (tmp_path / "steps.rank0.jsonl").exists() or not _nan_lines(tmp_path)
    cb.on_log(None, None, None, logs={"loss": 2.5, "grad_norm": math.nan})
    assert _nan_lines(tmp_path)


def test_the_lightning_callback_reports_a_nan_loss(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("lightning")
    from autotune.integrations.lightning import AutotuneCallback

    _in_trial(tmp_path, monkeypatch)
    cb, trainer = AutotuneCallback(), SimpleNamespace(global_step=0, should_stop=False)
    cb.on_train_start(trainer, None)
    batch = torch.zeros(8, 2)
    for step, loss in enumerate((1.0, math.nan, 1.0), start=1):
        cb.on_train_batch_start(trainer, None, batch, step)
        trainer.global_step = step
        cb.on_train_batch_end(trainer, None, {"loss": torch.tensor(loss)}, batch, step)
    # Read one step late (it costs the loop no wait): step 2's NaN is on step 3's line.
    lines = [json.loads(x) for x in (tmp_path / "steps.rank0.jsonl").read_text().splitlines()]
    flagged = [e["s"] for e in lines if "s" in e and e.get("nan") == 1]
    assert flagged == [3]


# -- output --------------------------------------------------------------------------------------

def test_a_trial_that_prints_50_mb_keeps_its_head_and_tail(tmp_path: Path) -> None:
    m = _trial(tmp_path, "loud")
    assert m.ok, m.reason
    log = tmp_path / "trial" / "stderr.log"
    assert log.stat().st_size < 1.1 * 2**20
    text = log.read_text()
    assert "bytes of the trial's output cut here; 52428800 in all" in text
    assert text.startswith("x" * 1023)


def test_the_capped_log_keeps_everything_when_it_is_small(tmp_path: Path) -> None:
    log = CappedLog(tmp_path / "out.log", head=10, tail=10)
    os.write(log.fd, b"0123456789abcdefghij")  # head 10 + tail 10: nothing cut
    log.started()
    assert log.close() == b"abcdefghij"
    assert (tmp_path / "out.log").read_bytes() == b"0123456789abcdefghij"
    log = CappedLog(tmp_path / "cut.log", head=4, tail=4)
    os.write(log.fd, b"0123456789abcdefghij")
    log.started()
    assert log.close() == b"ghij"
    text = (tmp_path / "cut.log").read_text()
    assert text.startswith("0123\n[autotune: 12 bytes") and text.endswith("]\nghij")


# -- names ---------------------------------------------------------------------------------------

def test_a_name_with_control_characters_is_refused_and_never_printed_raw(tmp_path: Path) -> None:
    name = "x\x1b[31m\x07"
    out = autotune("run", "--model", "mlp", "--study", name, "--out", "d", cwd=tmp_path)
    assert out.returncode == 2 and "\x1b" not in out.stdout + out.stderr
    assert "control characters" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    # A study stored by someone else under such a name is listed with escapes.
    storage = f"sqlite:///{tmp_path}/shared.db"
    optuna.create_study(study_name=name, storage=storage)
    out = autotune("studies", "--storage", storage, cwd=tmp_path)
    assert out.returncode == 0 and "\x1b" not in out.stdout and "x\\x1b[31m\\x07" in out.stdout


# -- the script's identity ---------------------------------------------------------------------

def test_a_module_s_file_is_hashed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text("print('v1')\n")
    monkeypatch.chdir(tmp_path)
    one = parse_command([sys.executable, "-m", "pkg.train", "--lr", "1"])
    assert (one.name, one.script) == ("pkg.train", str(tmp_path / "pkg" / "train.py"))
    torchrun = parse_command([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                              "2", "-m", "pkg.train"])
    assert (torchrun.nproc, torchrun.script_sha256) == (2, one.script_sha256)
    (tmp_path / "pkg" / "train.py").write_text("print('v2')\n")
    assert parse_command([sys.executable, "-m", "pkg.train"]).script_sha256 != \
        one.script_sha256


def test_profile_check_refuses_a_script_edited_since_it_was_tuned(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(HOSTILE.read_text())
    command = [sys.executable, str(script)]
    tuned = parse_command(command)
    profile = Profile(
        workload={"name": "train.py", "spec": "command", "params": tuned.to_params(16)},
        config=CONFIG, env={}, baseline={}, speedup=None, fingerprint=detect().fingerprint(),
        result={"samples_per_sec": 1000.0, "measure": replace(QUICK, max_seconds=2.0).to_dict()},
        provenance={})
    path = profile.save(tmp_path / "profile.yaml")
    script.write_text(HOSTILE.read_text() + "\n# edited\n")
    allow = shlex.join(command)
    out = autotune("profile", "check", str(path), "--rounds", "1", "--allow-workload", allow,
                   cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "train.py changed since the profile was tuned (sha256" in out.stderr
    assert "round 1" not in out.stdout and not (tmp_path / "trial").exists()
    out = autotune("profile", "check", str(path), "--rounds", "1", "--allow-workload", allow,
                   "--allow-edited", cwd=tmp_path)
    assert "changed since" not in out.stderr and "round 1/1" in out.stdout, out.stderr
