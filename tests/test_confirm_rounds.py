"""How many interleaved rounds the confirmation runs, on crafted studies and crafted rounds:
the plan's count comes from the search trials' costs before any round ran; once a round has
run, what it took decides whether another fits the time left."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from autotune.config.knobs import Config
from autotune.console import _confirmation_lines
from autotune.profile.load import load_profile
from autotune.testing.replay import Asked, ReplayMeasurer
from autotune.trial.measurement import Measurement, Status
from autotune.tuner.confirm_rounds import (
    another_round,
    candidates,
    confirm,
    costs,
    first_screen,
)
from autotune.tuner.confirmation import Confirmation, confirmation_seconds, screen
from autotune.tuner.export import write_profile as export
from autotune.tuner.reporting import RunSummary
from autotune.tuner.snapshot import read
from tests.test_budget import GIB, SETTINGS, _ok_trial, _study


def test_another_round_runs_while_the_time_left_holds_one_at_its_measured_cost() -> None:
    assert another_round(1, 1, 3, 100.0, 101.0)  # beyond the plan: the time left holds one
    assert not another_round(1, 2, 3, 100.0, 99.0)  # within the plan, but it would be cut
    assert not another_round(3, 3, 3, 10.0, 1000.0)  # --confirm-rounds is the most
    assert another_round(1, 2, 3, 100.0, None) and not another_round(2, 2, 3, 100.0, None)


def _rounds(rates: dict[int, list[float]], wall_s: float,
            copy_gbs: Callable[[int], float] | None = None) -> ReplayMeasurer:
    """A measurer that answers each config's next rate of ``rates`` (by micro-batch), each run
    reporting ``wall_s`` of wall time (and with ``copy_gbs``, the sentinel's memory copy its
    nth call reads)."""
    def answer(asked: Asked) -> Measurement:
        sentinel = None if copy_gbs is None else {
            "copy_gbs": copy_gbs(len(measure.configs) + 1), "seconds": 1.0, "threads": 2}
        return Measurement(Status.OK, samples_per_sec=rates[asked.config.micro_batch_size][
            asked.nth], spread_cv=0.02, peak_memory_bytes=GIB, wall_s=wall_s, sentinel=sentinel)

    measure = ReplayMeasurer(answer)
    return measure


def _calls(measure: ReplayMeasurer) -> list[int]:
    return [c.micro_batch_size for c in measure.configs]


def _confirm(rates: dict[int, list[float]], wall_s: float, tmp_path: Path,
             left: float | None) -> tuple[str | None, Any, list[int]]:
    # The search's figures: the best leads the baseline by 2.4x (decisive), so one round of the
    # two is planned where the time left holds one by the trials' costs.
    study = _study([_ok_trial(0, 8, 0.5, 60.0, baseline=True), _ok_trial(1, 32, 1.2, 90.0)],
                   None)
    measure = _rounds(rates, wall_s)
    deadline = None if left is None else time.monotonic() + left
    why = confirm(study, measure, SETTINGS, limit=18 * GIB, top=3, rounds=3, headroom=0.1,
                  trial_timeout_s=600.0, deadline=deadline, out_dir=tmp_path,
                  on_round=lambda *a: None)
    return why, study.user_attrs.get("confirmation"), _calls(measure)


def _one_round_s() -> float:
    study = _study([_ok_trial(0, 8, 0.5, 60.0, baseline=True), _ok_trial(1, 32, 1.2, 90.0)],
                   None)
    snap = read(study, 18 * GIB)
    cands = candidates(snap, 3)
    return confirmation_seconds(cands, costs(snap, cands, SETTINGS), 1)


def test_a_round_that_does_not_show_the_lead_again_is_followed_by_one_that_fits(
        tmp_path: Path) -> None:
    # Time for 1.5 rounds by the trials' costs: one round planned. It shows a 16% lead, not
    # decisive; the round took 24 s, far less than the plan's estimate, so a second one runs
    # and decides (a run left a second round's time unused here and did not confirm).
    est = _one_round_s()
    assert est > 2 * 24.0
    why, conf, calls = _confirm({32: [0.58, 0.59, 0.6], 8: [0.5, 0.5, 0.5]}, 10.0, tmp_path,
                                1.5 * est)
    assert why is None and conf is not None
    assert conf["planned_rounds"] == 1 and conf["rounds"] == 2 and calls == [32, 8, 32, 8]
    assert conf["decision"]["winner_trial"] == 1
    # A third would fit; the second settled it.
    assert conf["stopped_early"].startswith("the winner leads by more than the margin")


def test_no_round_is_started_that_the_time_left_cannot_hold(tmp_path: Path) -> None:
    # The same, but a round took more than the time left after it: no second one is started, and
    # the run says what a round took and what was left.
    est = _one_round_s()
    why, conf, calls = _confirm({32: [0.58, 0.59], 8: [0.5, 0.5]}, 0.6 * est, tmp_path,
                                1.2 * est)
    assert conf is None and calls == [32, 8]
    assert why is not None and "after 1 complete round(s) (it took" in why


def test_a_decisive_round_ends_the_confirmation_whatever_the_time_left(tmp_path: Path) -> None:
    why, conf, calls = _confirm({32: [1.2], 8: [0.5]}, 10.0, tmp_path, 10 * _one_round_s())
    assert why is None and conf["rounds"] == 1 and calls == [32, 8]
    assert conf["stopped_early"].startswith("one round")


def _tie(tmp_path: Path, rates: dict[int, list[float]], left: float | None,
         copy_gbs: Callable[[int], float] | None = None
         ) -> tuple[str | None, Any, list[int], Any]:
    # Five configs within the margin of the best by their search trials (the noise floor: 4%),
    # --confirm-top 3: the best three by the search, two more for the first round only.
    study = study_of_tie()
    measure = _rounds(rates, 10.0, copy_gbs)
    deadline = None if left is None else time.monotonic() + left
    why = confirm(study, measure, SETTINGS, limit=18 * GIB, top=3, rounds=2, headroom=0.1,
                  trial_timeout_s=600.0, deadline=deadline, out_dir=tmp_path,
                  on_round=lambda *a: None)
    return why, study.user_attrs.get("confirmation"), _calls(measure), study


def _round_s(micros: list[int]) -> float:
    study = _study([_ok_trial(0, 8, 0.5, 60.0, baseline=True)]
                   + [_ok_trial(i + 1, m, 1.2, 60.0) for i, m in enumerate(micros)], None)
    snap = read(study, 18 * GIB)
    cands = candidates(snap, len(micros))
    return confirmation_seconds(cands, costs(snap, cands, SETTINGS), 1)


def test_the_first_round_screens_a_tie_wider_than_the_top(tmp_path: Path) -> None:
    # Side by side, the config the search ranked 4th is the fastest: it goes on with the two
    # next fastest of the round; the two slowest of it ran once and cannot win.
    rates = {16: [1.0, 1.0], 32: [1.05, 1.05], 64: [1.02], 128: [1.3, 1.31], 4: [1.1, 1.1],
             8: [0.5, 0.5]}
    why, conf, calls, study = _tie(tmp_path, rates, None)
    assert why is None and conf is not None
    assert calls == [16, 32, 64, 128, 4, 8] + [32, 128, 4, 8]
    assert conf["rounds"] == 2 and conf["decision"]["winner_trial"] == 4
    out = {c["trial"]: c for c in conf["candidates"]}
    assert [t for t, c in out.items() if "screened_out" in c] == [1, 3]
    assert out[1]["screened_out"].startswith("screened out after round 1: 1.00 samples/s")
    assert set(conf["decision"]["excluded"]) == {"1", "3"}
    # The profile holds the screen as the study does, and loads with it.
    export(study, read(study, 18 * GIB), "sqlite://", None, tmp_path / "p.yaml")
    loaded = load_profile(tmp_path / "p.yaml", check_fingerprint=False)
    assert loaded.config.micro_batch_size == 128 and loaded.confirmation is not None
    assert loaded.confirmation["candidates"][0]["screened_out"].startswith("screened out")


def test_a_first_round_the_machine_changed_within_screens_nothing(tmp_path: Path) -> None:
    # The tie above, but the sentinel's memory copy reads 40 GB/s for the round's first three
    # runs and 20 for the next three: the round's readings were not taken on one machine, so
    # every config goes on (a round is added for the change too, and the rounds stop at two).
    rates = {16: [1.0, 1.0], 32: [1.05, 1.05], 64: [1.02, 0.9], 128: [1.3, 1.31],
             4: [1.1, 1.1], 8: [0.5, 0.5]}
    why, conf, calls, _ = _tie(tmp_path, rates, None, lambda n: 20.0 if 3 < n <= 6 else 40.0)
    assert why is None and calls == [16, 32, 64, 128, 4, 8] * 2
    assert not any("screened_out" in c for c in conf["candidates"])
    assert conf["round_added"] and conf["machine_changed"][0].startswith("memory copy 40.0 -> ")
    assert conf["decision"]["winner_trial"] == 4
    # Where the time left does not hold a round of all of them, the screen stands.
    cands = candidates(read(study_of_tie(), 18 * GIB), 3, 2)
    results = [(c, Measurement(Status.OK, samples_per_sec=r, wall_s=10.0, sentinel={
        "copy_gbs": g, "seconds": 1.0, "threads": 2})) for c, r, g in zip(
        cands, [1.0, 1.05, 1.02, 1.3, 1.1, 0.5], [40.0] * 3 + [20.0] * 3, strict=True)]
    for c, m in results:
        c.rates.append(m.samples_per_sec or 0.0)
    assert first_screen(cands, 3, [], results, 60.0, None) == cands
    assert first_screen(cands, 3, [], results, 60.0, 71.0) == screen(cands, 3) != cands
    steady = [(c, replace(m, sentinel={"copy_gbs": 40.0, "seconds": 1.0, "threads": 2}))
              for c, m in results]
    assert first_screen(cands, 3, [], steady, 60.0, None) == screen(cands, 3)
    # A round steady within itself but apart from the search's readings compares its configs
    # on one machine: the screen stands.
    search = [{"copy_gbs": 20.0, "seconds": 1.0, "threads": 2}] * 3
    assert first_screen(cands, 3, search, steady, 60.0, None) == screen(cands, 3)


def study_of_tie() -> Any:
    return _study([_ok_trial(0, 8, 0.5, 60.0, baseline=True), _ok_trial(1, 16, 1.20, 60.0),
                   _ok_trial(2, 32, 1.19, 60.0), _ok_trial(3, 64, 1.18, 60.0),
                   _ok_trial(4, 128, 1.17, 60.0), _ok_trial(5, 4, 1.16, 60.0)], None)


def test_a_screen_the_time_left_cannot_hold_is_left_out(tmp_path: Path) -> None:
    # The time left holds two rounds of the top three and the baseline, not the wider first
    # round: the two beyond the top are left out first.
    left = 2.1 * _round_s([16, 32, 64])
    assert left < _round_s([16, 32, 64, 128, 4]) + _round_s([16, 32, 64])
    rates = {16: [1.2, 1.2], 32: [1.0, 1.0], 64: [1.0, 1.0], 8: [0.5, 0.5]}
    why, conf, calls, _ = _tie(tmp_path, rates, left)
    assert why is None and calls == [16, 32, 64, 8] * 2
    assert not any("screened_out" in c for c in conf["candidates"])
    # The run says which it left out and why (a run's 5th-ranked config never ran, unsaid).
    said = conf["left_out"]
    assert said.startswith("not confirmed for the time left (") and "): #4, #5, within the " \
        "margin of the best by their search trials but ranked lowest; the plan held 4 configs " \
        "(with the baseline) for 2 round(s)" in said
    parsed = Confirmation.from_dict(conf)
    assert parsed.left_out == said
    summary = cast(RunSummary, SimpleNamespace(confirmation=parsed, confirm_skipped=None))
    assert f"  {said}" in _confirmation_lines(summary)
    # From a shared study, only a string, cut to a line's length, reaches the console.
    assert Confirmation.from_dict({**conf, "left_out": ["#1"]}).left_out is None
    assert len(Confirmation.from_dict({**conf, "left_out": "x" * 10_000}).left_out or "") == 400
    # Nothing left out: nothing said.
    _, roomy, _, _ = _tie(tmp_path / "roomy", rates | {128: [1.0], 4: [1.0]}, None)
    assert "left_out" not in roomy and Confirmation.from_dict(roomy).left_out is None


def test_the_rounds_that_fit_count_the_wider_first_round_once() -> None:
    from autotune.tuner.confirmation import Candidate, rounds_that_fit

    cands = [Candidate(i, Config(micro_batch_size=2 ** i)) for i in range(5)]
    cands.append(Candidate(9, Config(), is_baseline=True))
    cost = {c.number: 8.0 for c in cands}  # 10 s each with the process
    assert rounds_that_fit(cands, cost, 3, 59.0, keep=3) == 0
    assert rounds_that_fit(cands, cost, 3, 100.0, keep=3) == 2  # 60 + 40
    assert rounds_that_fit(cands, cost, 3, 140.0, keep=3) == 3
    assert rounds_that_fit(cands, cost, 3, 140.0) == 2  # without a screen: 60 a round


def test_the_next_round_is_costed_by_the_configs_that_go_on() -> None:
    from autotune.tuner.confirm_rounds import next_round_s
    from autotune.tuner.confirmation import Candidate

    a, b, c = (Candidate(i, Config(micro_batch_size=2 ** i)) for i in range(3))
    results = [(x, Measurement(status="ok", samples_per_sec=1.0, wall_s=18.0))
               for x in (a, b, c)]
    assert next_round_s(results, [a, b, c], 50.0) == 60.0  # the runs' walls: 3 x 20 s
    assert next_round_s(results, [a, c], 90.0) == 60.0  # the elapsed 90 s, pro rata


def test_the_reserve_keeps_the_wider_first_round_where_more_configs_tie() -> None:
    from autotune.tuner.confirm_rounds import END_OF_SEARCH_S, reserve
    from tests.test_budget import _snap

    base = _ok_trial(0, 8, 0.5, 60.0, baseline=True)
    top = [_ok_trial(1, 16, 1.20, 60.0), _ok_trial(2, 32, 1.19, 60.0),
           _ok_trial(3, 64, 1.18, 60.0)]
    three = reserve(_snap([base, *top]), 3, 3, 7200.0, SETTINGS)
    assert three == pytest.approx(2 * _round_s([16, 32, 64]) + END_OF_SEARCH_S, rel=0.02)
    # Two more within the margin: the first round holds them too, the second does not.
    tie = [base, *top, _ok_trial(4, 128, 1.17, 60.0), _ok_trial(5, 4, 1.16, 60.0)]
    wide = reserve(_snap(tie), 3, 3, 7200.0, SETTINGS)
    assert wide == pytest.approx(_round_s([16, 32, 64, 128, 4]) + _round_s([16, 32, 64])
                                 + END_OF_SEARCH_S, rel=0.02)
    # One further behind than the margin is no tie: it adds nothing.
    behind = [base, *top, _ok_trial(4, 128, 1.0, 60.0)]
    assert reserve(_snap(behind), 3, 3, 7200.0, SETTINGS) == pytest.approx(three)
