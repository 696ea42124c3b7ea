"""How a real study spends its trials: memory model, staged start, pruning, early stop and the
confirmation, with real trial processes and SQLite."""

from __future__ import annotations

import re
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autotune.profile import load_profile
from autotune.tuner import snapshot
from autotune.tuner.confirmation import DECISIVE
from autotune.tuner.record import TrialRecord, read_trials
from tests.conftest import FAST, autotune

DB = "sqlite:///study.db"
pytestmark = pytest.mark.slow  # whole studies: real trial processes, seconds each
MEMHOG = ("run", "--model", "autotune.testing.workloads:memhog")


def load() -> optuna.Study:
    return optuna.load_study(study_name=optuna.get_all_study_names(DB)[0], storage=DB)


def stored(r: TrialRecord) -> optuna.trial.FrozenTrial:
    """The trial behind a record, as Optuna holds it (its constraints, intermediate values)."""
    return load().trials[r.number]


def space(workdir: Path, text: str) -> str:
    (workdir / "space.yaml").write_text(text)
    return "space.yaml"


def memhog_study(workdir: Path, mib_per_sample: int, micros: str, trials: int, limit: str,
                 ) -> tuple[str, list[TrialRecord], list[TrialRecord]]:
    """A memhog study (peak ~ torch's own memory + mib_per_sample x micro-batch): its output,
    the trials that ran, and those the memory model ruled out."""
    result = autotune(*MEMHOG, "--param", f"mib_per_sample={mib_per_sample}", "--space", space(
        workdir, f"knobs:\n  micro_batch_size: {{choices: [{micros}]}}\n"), "--trials",
        str(trials), "--memory-limit", limit, "--storage", DB, *FAST,
        # memhog touches up to a GiB a step: beside other tests (make test runs two at a
        # time) its steps slow down, and FAST's 5 s left a baseline "too slow to measure" once.
        # A trial the stop rule ends early costs nothing more.
        "--trial-seconds", "15", cwd=workdir)
    assert result.returncode == 0, result.stderr
    done = read_trials(load())
    ran = [t for t in done if t.ran]  # not ruled out, not a repeat reusing a twin's outcome
    return result.stdout, ran, [t for t in done if t.predicted]


def test_the_memory_model_rules_out_what_would_not_fit(workdir: Path) -> None:
    # 64 MiB per sample: the baseline (4) and the first doubling (8) fit 1.25 GiB; their line
    # puts 16 above it.
    out, ran, ruled_out = memhog_study(workdir, 64, "1, 2, 4, 8, 16, 32, 64", 6, "1.25GiB")
    assert [t.params["micro_batch_size"] for t in ran[:2]] == [4, 8]
    assert (ran[1].stage or "").startswith("staged: largest micro-batch that fits")
    # Nothing ran into the wall (smaller batches may be pruned for being slow: memhog's rate
    # grows with the batch).
    seen = [(t.params["micro_batch_size"], t.status, t.peak_memory_bytes, t.stage, t.reason)
            for t in ran]
    assert {t.status for t in ran} <= {"ok", "pruned"}, seen
    assert max(t.params["micro_batch_size"] for t in ran) == 8, seen
    assert ruled_out and all(t.state == TrialState.PRUNED and stored(t).constraints["memory"] > 0
                             for t in ruled_out)
    first = ruled_out[0]
    assert re.match(r"predicted-oom: peak \d+\.\d+ GiB at micro-batch (16|32|64) \(affine fit on "
                    r"\d+ trials", first.reason or ""), first.reason
    assert (first.measurement.predicted_peak_memory_bytes or 0) > 1.25 * 2**30 * 0.95
    assert "predicted to pass the memory limit" in out


def test_no_larger_micro_batch_after_an_oom(workdir: Path) -> None:
    # 128 MiB per sample: the baseline (4) fits 1 GiB, the doubling to 8 does not.
    _, ran, ceiling = memhog_study(workdir, 128, "1, 2, 4, 8, 16, 32", 5, "1GiB")
    statuses = {t.params["micro_batch_size"]: t.status for t in ran}
    assert statuses[4] == "ok" and statuses[8] == "oom"
    assert not any(m > 8 for m in statuses)  # after the OOM at 8, nothing larger ran
    assert ceiling and all("8, which ran out of memory" in (t.reason or "") for t in ceiling)


def test_pruning_and_early_stop(workdir: Path) -> None:
    # Every micro-batch sleeps 50 ms: samples/sec grows with the batch. After the staged start
    # (4, then 16), batches 2 and 1 are clearly slower (pruned after two windows): two trials with
    # no win. (A tie as one of the two, e.g. 16 with a loader worker, could read 2% ahead on a
    # loaded machine and reset the count: seen once in CI.)
    result = autotune("run", "--model", "autotune.testing.workloads:slow", "--param",
                      "step_s=0.05", "--space", space(
                          workdir, "knobs:\n  micro_batch_size: {choices: [1, 2, 4, 16]}\n"),
                      "--trials", "10", "--patience", "2", "--storage", DB, *FAST, cwd=workdir)
    assert result.returncode == 0, result.stderr
    trials = read_trials(load())
    by_batch = {t.params["micro_batch_size"]: t for t in trials if t.reused_from is None}
    assert by_batch[16].stage
    for slow in (by_batch[1], by_batch[2]):
        assert slow.state == TrialState.PRUNED and slow.status == "pruned"
        assert (slow.reason or "").startswith("its first 2 windows reached at most")
        assert len(stored(slow).intermediate_values) >= 2  # its windows, for the sampler
    assert "no trial beat the best by more than the noise" in result.stdout
    assert len(by_batch) == 4


def test_confirmation_reruns_the_top_configs_interleaved(workdir: Path) -> None:
    # Both configs measured (the baseline among them), once or twice each: one round where the
    # winner's lead is decisive (its own test below), else two. Each micro-batch sleeps 20 ms x
    # (batch / 4) ** 0.8: batch 8 leads the baseline's 4 by 15% (2 ** 0.2), a lead no noise here
    # reverses and one that is decisive only where their margin is under 3%. (With the tiny
    # workload on the default space the second trial was bf16 at the baseline's batch, a tie: a
    # loaded run where the baseline read fastest left one candidate and no confirmation.)
    args = ("run", "--model", "autotune.testing.workloads:slow", "--param", "step_s=0.02",
            "--param", "exponent=0.8", "--space", space(
                workdir, "knobs:\n  micro_batch_size: {choices: [4, 8]}\n"),
            "--trials", "2", "--storage", DB, *FAST, "--trial-seconds", "2", "--confirm-top", "2",
            "--confirm-rounds", "2")
    result = autotune(*args, cwd=workdir)
    assert result.returncode == 0, result.stderr
    study = load()
    conf = snapshot.read(study).facts.confirmation
    assert conf is not None
    cands = conf.candidates
    rounds = conf.rounds
    assert len(cands) == 2 and sum(c.baseline for c in cands) == 1  # the baseline alongside
    assert all(len(c.rates) == rounds for c in cands)
    if rounds == 1:  # decided at once: the winner's lead was many times their margin
        assert (conf.stopped_early or "").startswith("one round: the winner leads the baseline")
        assert conf.decision.margin * DECISIVE < max(c.median or 0 for c in cands) / \
            min(c.median or 1 for c in cands) - 1
    else:
        assert rounds == 2
    assert conf.measure["min_window_s"] == pytest.approx(0.2)  # twice the trials' windows
    # Interleaved: round 1 of every config before round 2 of any.
    runs = sorted((workdir / "studies" / study.study_name / "confirm").iterdir(),
                  key=lambda p: p.stat().st_mtime)
    assert [p.name.split("-")[0] for p in runs] == \
        [str(r + 1) for r in range(rounds) for _ in cands]
    profile = load_profile(workdir / "studies" / study.study_name / "profile.yaml")
    assert profile.confirmation is not None
    winner = next(c for c in cands if c.trial == conf.decision.winner_trial)
    base = next(c for c in cands if c.baseline)
    assert winner.median and base.median
    assert profile.samples_per_sec == pytest.approx(winner.median)
    assert profile.speedup == pytest.approx(winner.median / base.median, rel=1e-3)
    assert profile.result["trial_samples_per_sec"] > 0
    assert "measured side by side" in result.stdout and "interleaved rounds" in result.stdout
    # Resuming with nothing new to measure keeps the confirmation and measures nothing.
    again = autotune(*args, cwd=workdir)
    assert again.returncode == 0 and "round 1/" not in again.stdout
    kept = snapshot.read(load()).facts.confirmation
    assert kept is not None and kept.raw["created"] == conf.raw["created"]


def test_a_decisive_lead_is_confirmed_in_one_round(workdir: Path) -> None:
    """Batch 16 gives 4x the samples/s of batch 4 (each step sleeps the same): the search's
    lead is many times the noise, so one interleaved round of the best and the baseline decides,
    and the third config, far behind, is not re-measured."""
    result = autotune("run", "--model", "autotune.testing.workloads:slow", "--param",
                      "step_s=0.02", "--space",
                      space(workdir, "knobs:\n  micro_batch_size: {choices: [4, 8, 16]}\n"),
                      "--trials", "3", "--storage", DB, *FAST, "--trial-seconds", "2",
                      "--confirm-top", "3", "--confirm-rounds", "3", cwd=workdir)
    assert result.returncode == 0, result.stderr
    conf = snapshot.read(load()).facts.confirmation
    assert conf is not None
    assert conf.rounds == 1 and conf.planned_rounds >= 1
    assert (conf.stopped_early or "").startswith("one round: the winner leads the baseline by")
    assert sorted((c.config.micro_batch_size, c.baseline) for c in conf.candidates) == \
        [(4, True), (16, False)]
    assert conf.decision.winner_trial == next(c.trial for c in conf.candidates if not c.baseline)
    profile = load_profile(workdir / "studies" / load().study_name / "profile.yaml")
    assert profile.speedup is not None and profile.speedup > 2
