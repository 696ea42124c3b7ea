"""How many interleaved rounds the confirmation runs, on crafted studies and crafted rounds:
the plan's count comes from the search trials' costs before any round ran; once a round has
run, what it took decides whether another fits the time left."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from autotune.config.knobs import Config
from autotune.trial.measurement import Measurement
from autotune.trial.spec import MeasureSettings
from autotune.tuner.confirm import another_round, candidates, confirm, costs
from autotune.tuner.confirmation import confirmation_seconds
from autotune.tuner.snapshot import read
from tests.test_budget import GIB, SETTINGS, _ok_trial, _study


def test_another_round_runs_while_the_time_left_holds_one_at_its_measured_cost() -> None:
    assert another_round(1, 1, 3, 100.0, 101.0)  # beyond the plan: the time left holds one
    assert not another_round(1, 2, 3, 100.0, 99.0)  # within the plan, but it would be cut
    assert not another_round(3, 3, 3, 10.0, 1000.0)  # --confirm-rounds is the most
    assert another_round(1, 2, 3, 100.0, None) and not another_round(2, 2, 3, 100.0, None)


def _rounds(rates: dict[int, list[float]], wall_s: float) -> Any:
    """A measure function that returns the next of each config's ``rates`` (by micro-batch),
    each run reporting ``wall_s`` of wall time."""
    seen: dict[int, int] = {}
    calls: list[int] = []

    def measure(config: Config, workdir: Path, timeout: float,
                settings: MeasureSettings) -> Measurement:
        micro = config.micro_batch_size
        i = seen.get(micro, 0)
        seen[micro] = i + 1
        calls.append(micro)
        return Measurement(status="ok", samples_per_sec=rates[micro][i], spread_cv=0.02,
                           peak_memory_bytes=GIB, wall_s=wall_s)

    measure.calls = calls  # type: ignore[attr-defined]
    return measure


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
    return why, study.user_attrs.get("confirmation"), measure.calls


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
