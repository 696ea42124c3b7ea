"""How a study spends its trials: memory model, staged start, pruning, early stop and the
confirmation. The real tuner runs in-process, every trial answered by a replay of the workload it
stands for (``autotune.testing.replay``), its study in a journal file: what is tested is what
the tuner decides, asks for and records, not a process or a storage."""

from __future__ import annotations

import re
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autotune.profile import load_profile
from autotune.testing.replay import Asked, ReplayMeasurer, Row
from autotune.tuner import snapshot
from autotune.tuner.confirmation import DECISIVE
from autotune.tuner.record import TrialRecord, read_trials
from tests.conftest import JOURNAL, load_study, replayed

MIB = 2**20
MEMHOG = "autotune.testing.workloads:memhog"
SLOW = "autotune.testing.workloads:slow"
TORCH_MIB = 350  # what a memhog trial holds besides its samples: torch itself


def load() -> optuna.Study:
    return load_study(JOURNAL)


def stored(r: TrialRecord) -> optuna.trial.FrozenTrial:
    """The trial behind a record, as Optuna holds it (its constraints, intermediate values)."""
    return load().trials[r.number]


def space(memdir: Path, text: str) -> str:
    (memdir / "space.yaml").write_text(text)
    return "space.yaml"


def memhog(mib_per_sample: int, limit: int) -> ReplayMeasurer:
    """memhog's trials: a peak of torch's own memory and ``mib_per_sample`` MiB per sample of
    the micro-batch, a rate growing with the batch; past ``limit`` the trial is ended out of
    memory, as the launcher ends it on a CPU."""
    def row(asked: Asked) -> Row:
        micro = asked.config.micro_batch_size
        return Row(500.0 * micro, (TORCH_MIB + mib_per_sample * micro) * MIB)

    return ReplayMeasurer(row, limit=limit)


def slow(step_s: float, exponent: float = 0.0) -> ReplayMeasurer:
    """The ``slow`` workload's trials: each micro-batch takes ``step_s x (batch / 4) **
    exponent`` seconds, exactly (no window noise)."""
    def row(asked: Asked) -> Row:
        c = asked.config
        step = c.grad_accum_steps * step_s * (c.micro_batch_size / 4) ** exponent
        return Row(c.samples_per_step / step)

    return ReplayMeasurer(row)


def memhog_study(memdir: Path, mib_per_sample: int, micros: str, trials: int, limit: float,
                 ) -> tuple[str, list[TrialRecord], list[TrialRecord]]:
    """A memhog study: its output, the trials that ran, and those the memory model ruled out."""
    _, out = replayed(memhog(mib_per_sample, int(limit * 2**30)), model=MEMHOG,
                      params={"mib_per_sample": mib_per_sample}, space=space(
                          memdir, f"knobs:\n  micro_batch_size: {{choices: [{micros}]}}\n"),
                      trials=trials, memory_limit=f"{limit}GiB", storage=JOURNAL)
    done = read_trials(load())
    ran = [t for t in done if t.ran]  # not ruled out, not a repeat reusing a twin's outcome
    return out, ran, [t for t in done if t.predicted]


def test_the_memory_model_rules_out_what_would_not_fit(memdir: Path) -> None:
    # 64 MiB per sample: the baseline (4) and the first doubling (8) fit 1.25 GiB; their line
    # puts 16 above it.
    out, ran, ruled_out = memhog_study(memdir, 64, "1, 2, 4, 8, 16, 32, 64", 6, 1.25)
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
    assert (first.forecast.peak_memory_bytes or 0) > 1.25 * 2**30 * 0.95
    assert "predicted to pass the memory limit" in out


def test_no_larger_micro_batch_after_an_oom(memdir: Path) -> None:
    # 128 MiB per sample: the baseline (4) fits 1 GiB, the doubling to 8 does not.
    _, ran, ceiling = memhog_study(memdir, 128, "1, 2, 4, 8, 16, 32", 5, 1.0)
    statuses = {t.params["micro_batch_size"]: t.status for t in ran}
    assert statuses[4] == "ok" and statuses[8] == "oom"
    assert not any(m > 8 for m in statuses)  # after the OOM at 8, nothing larger ran
    assert ceiling and all("8, which ran out of memory" in (t.reason or "") for t in ceiling)


def test_pruning_and_early_stop(memdir: Path) -> None:
    # Every micro-batch takes 50 ms: samples/sec grows with the batch. After the staged start
    # (4, then 16), batches 2 and 1 are clearly slower (pruned after two windows): two trials
    # with no win.
    measure = slow(0.05)
    summary, out = replayed(measure, model=SLOW, params={"step_s": 0.05}, space=space(
        memdir, "knobs:\n  micro_batch_size: {choices: [1, 2, 4, 16]}\n"), trials=10,
        patience=2, storage=JOURNAL)
    trials = read_trials(load())
    by_batch = {t.params["micro_batch_size"]: t for t in trials if t.reused_from is None}
    assert by_batch[16].stage
    for pruned in (by_batch[1], by_batch[2]):
        assert pruned.state == TrialState.PRUNED and pruned.status == "pruned"
        assert (pruned.reason or "").startswith("its first 2 windows reached at most")
        assert len(stored(pruned).intermediate_values) >= 2  # its windows, for the sampler
        # What the tuner asked for: stop it below the best so far.
        (asked,) = measure.of(pruned.config)
        assert asked.prune_below == pytest.approx(by_batch[16].samples_per_sec)
    assert measure.asked[0].prune_below is None  # the baseline is never pruned
    assert "no trial beat the best by more than the noise" in out
    assert summary.stop_reason.startswith("no trial beat the best by more than the noise")
    assert len(by_batch) == 4


CONFIRM = {"trial_s": 2.0, "confirm_top": 2, "confirm_rounds": 2, "storage": JOURNAL}


def test_confirmation_reruns_the_top_configs_interleaved(memdir: Path) -> None:
    # Both configs measured (the baseline among them), then two interleaved rounds of both. Each
    # micro-batch takes 20 ms x (batch / 4) ** 0.95: batch 8 leads the baseline's 4 by 3.5%
    # (2 ** 0.05), a lead that is not decisive (its own test below).
    def run() -> tuple[ReplayMeasurer, str]:
        measure = slow(0.02, 0.95)
        _, out = replayed(measure, model=SLOW, params={"step_s": 0.02, "exponent": 0.95},
                          space=space(memdir, "knobs:\n  micro_batch_size: {choices: [4, 8]}\n"),
                          trials=2, **CONFIRM)
        return measure, out

    measure, out = run()
    study = load()
    conf = snapshot.read(study).facts.confirmation
    assert conf is not None
    cands = conf.candidates
    assert len(cands) == 2 and sum(c.baseline for c in cands) == 1  # the baseline alongside
    assert conf.rounds == 2 and conf.stopped_early is None
    assert all(len(c.rates) == 2 for c in cands)
    assert conf.decision.margin * DECISIVE > max(c.median or 0 for c in cands) / \
        min(c.median or 1 for c in cands) - 1  # not decided in one round
    assert conf.measure["min_window_s"] == pytest.approx(0.2)  # twice the trials' windows
    rounds = measure.asked[2:]
    assert all(a.settings.min_window_s == pytest.approx(0.2) for a in rounds)
    # Interleaved: round 1 of every config before round 2 of any, each in its own folder.
    folder = Path("studies", study.study_name, "confirm")  # under the working folder
    assert [a.workdir.parent for a in rounds] == [folder] * 4
    assert [a.workdir.name.split("-")[0] for a in rounds] == ["1", "1", "2", "2"]
    assert [a.config for a in rounds[:2]] == [a.config for a in rounds[2:]]
    profile = load_profile(memdir / "studies" / study.study_name / "profile.yaml",
                           check_fingerprint=False)
    assert profile.confirmation is not None
    winner = next(c for c in cands if c.trial == conf.decision.winner_trial)
    base = next(c for c in cands if c.baseline)
    assert winner.median and base.median
    assert profile.samples_per_sec == pytest.approx(winner.median)
    assert profile.speedup == pytest.approx(winner.median / base.median, rel=1e-3)
    assert profile.result["trial_samples_per_sec"] > 0
    assert "measured side by side" in out and "interleaved rounds" in out
    # Resuming with nothing new to measure keeps the confirmation and measures nothing.
    again, out = run()
    assert again.asked == [] and "round 1/" not in out
    kept = snapshot.read(load()).facts.confirmation
    assert kept is not None and kept.raw["created"] == conf.raw["created"]


def test_a_decisive_lead_is_confirmed_in_one_round(memdir: Path) -> None:
    """Batch 16 gives 4x the samples/s of batch 4 (each step takes the same): the search's
    lead is many times the noise, so one interleaved round of the best and the baseline decides,
    and the third config, far behind, is not re-measured."""
    measure = slow(0.02)
    replayed(measure, model=SLOW, params={"step_s": 0.02}, space=space(
        memdir, "knobs:\n  micro_batch_size: {choices: [4, 8, 16]}\n"), trials=3,
        **{**CONFIRM, "confirm_top": 3, "confirm_rounds": 3})
    conf = snapshot.read(load()).facts.confirmation
    assert conf is not None
    assert conf.rounds == 1 and conf.planned_rounds >= 1
    assert (conf.stopped_early or "").startswith("one round: the winner leads the baseline by")
    assert sorted((c.config.micro_batch_size, c.baseline) for c in conf.candidates) == \
        [(4, True), (16, False)]
    assert conf.decision.winner_trial == next(c.trial for c in conf.candidates if not c.baseline)
    assert sorted(a.config.micro_batch_size for a in measure.asked[3:]) == [4, 16]
    profile = load_profile(memdir / "studies" / load().study_name / "profile.yaml",
                           check_fingerprint=False)
    assert profile.speedup is not None and profile.speedup > 2
