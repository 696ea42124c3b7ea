"""The end of a run: the top configs re-measured side by side with the baseline, the winner
decided by a margin larger than the measured noise, and the profile exported from that decision.

A search trial's figure comes from one process at one moment of a machine that drifts by 10-30%
within minutes; the confirmation runs the top configs and the baseline in interleaved rounds (A B
C A B C ...), with windows twice as long, so drift hits every config alike.

It is kept cheap enough to always run, and no more than the decision needs: a config joins the
best only when its search trial is within the margin of it (a runner-up further behind does not
win); where more of them are within it than --confirm-top takes, up to ``CONFIRM_SCREEN`` more
join the first round where the budget holds them, and the fastest of that round go on
(``screen``: a run's search read two compiled configs in a slow stretch and ranked them 4th and
5th, 9% behind the best; side by side they were 9% ahead of it); and where the best leads the
baseline by many times the noise (``DECISIVE``) and no runner-up joins, one interleaved round of
the two is enough; the time saved goes to the search. What it needs is reserved from --timeout
as the search goes (the search gets the rest), each round's measuring budget is sized to the
config's step time (warm-up and the minimum windows; the rounds give the spread), the plan
shrinks to fewer rounds and then to the best config and the baseline when the budget is short,
and rounds stop as soon as the decision is clear or the win is out of reach; where the planned
rounds left it undecided, another runs while the time left holds one at what a round measured. A
winner that does not beat the baseline by more than the measured noise is no win: the baseline's
settings are exported, with speedup 1.0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import optuna

from autotune.config.knobs import Config
from autotune.profile.documents import ConfirmationDoc
from autotune.trial.measurement import INTERRUPTED, TRIAL_TIMEOUT, Measurement
from autotune.trial.spec import MeasureSettings
from autotune.tuner import record, snapshot
from autotune.tuner.budget import confirm_settings, hard_timeout
from autotune.tuner.confirmation import (
    Candidate,
    confirmation_seconds,
    decide,
    decided_in_one_round,
    decisive,
    plan_confirmation,
    plan_seconds,
    screen,
    settled,
)
from autotune.tuner.drift import changes, reading_of, slowdowns, within_round
from autotune.tuner.options import CONFIRM_MAX_SHARE, CONFIRM_SCREEN, CONFIRM_SHARE
from autotune.tuner.search import noise_of
from autotune.tuner.snapshot import StudySnapshot
from autotune.units import format_duration

# (config, workdir, timeout, settings) -> the measurement of one fresh trial process
MeasureOne = Callable[[Config, Path, float, MeasureSettings], Measurement]


def round_settings(snap: StudySnapshot, c: Candidate,
                   settings: MeasureSettings) -> MeasureSettings:
    """How ``c`` is measured in each round: longer windows, a budget sized to its steps."""
    r = snap.trial(c.number)
    return confirm_settings(settings, r.step_s if r is not None else None)


def costs(snap: StudySnapshot, cands: list[Candidate],
          settings: MeasureSettings) -> dict[int, float]:
    """What one round of each candidate costs: its trial's start-up (wall time less warm-up
    and windows; half the wall time where the trial did not say) and its round's budget."""
    out = {}
    for c in cands:
        r = snap.trial(c.number)
        assert r is not None
        startup = r.startup_s
        if startup is None:
            startup = 0.5 * r.wall_s
        # A compiled config compiles again in each round's fresh process, from the study's
        # cache where its trial stored every graph there: the backend's work is skipped.
        compiling = r.recompile_s or 0.0
        out[c.number] = startup + compiling + round_settings(snap, c, settings).max_seconds
    return out


def candidates(snap: StudySnapshot, top: int, extra: int = 0) -> list[Candidate]:
    """The best config by its trial (distinct, ok, within the limit), the next of the ``top``
    (and ``extra`` more) whose trials are within the margin of it (twice the search's noise:
    a config further behind does not win a confirmation), and the baseline."""
    ranked = snap.ok_within_limit()[:top + extra]
    margin = 2 * noise_of(snap.observations)
    chosen = ranked[:1] + [r for r in ranked[1:] if (r.samples_per_sec or 0.0) * (1 + margin)
                           >= (ranked[0].samples_per_sec or 0.0)]
    base = snap.baseline
    if base is not None and base.number not in {r.number for r in chosen}:
        chosen.append(base)
    return [Candidate(r.number, r.config, is_baseline=r.is_baseline) for r in chosen]


def pair_rounds(snap: StudySnapshot) -> int:
    """The fewest rounds the best config and the baseline alone need: one where the best's
    search trial leads the baseline's by more than ``DECISIVE`` times the search's noise (the
    round must show it again: ``confirmation.decided_in_one_round``), else two."""
    if snap.best is None or snap.baseline is None:
        return 2
    best, base = snap.best.samples_per_sec or 0.0, snap.baseline.samples_per_sec or 0.0
    return 1 if base > 0 and decisive(best / base - 1.0, noise_of(snap.observations)) else 2


# The rounds the reserve keeps: two give a spread, and most confirmations settle there (a run
# that kept three had its rounds stop after two and left 3.4 minutes of its budget unused). A
# third round runs when the search left the time for it (``another_round``).
SPREAD_ROUNDS = 2

# Kept beyond the plan's cost: a trial the search's deadline cuts is stopped and recorded
# before the confirmation starts (a run that kept the exact cost of one round found a second
# less than that left, and could not confirm).
END_OF_SEARCH_S = 10.0


def reserve(snap: StudySnapshot, top: int, rounds: int, timeout_s: float | None,
            settings: MeasureSettings) -> float:
    """Seconds of the --timeout kept for the confirmation. Nothing before the first trial (the
    baseline runs whatever the budget: without it there is nothing to confirm against); then
    CONFIRM_SHARE of it; once two configs measured ok, what ``SPREAD_ROUNDS`` of the largest
    plan within that share need (its wider first round too, where more configs tie), or, where
    the plan is the best and the baseline with a decisive lead or had to drop candidates to fit,
    its fewest rounds (the search gets the rest); when even the smallest plan (the best and the
    baseline, twice, or once where decisive) needs more, that much up to CONFIRM_MAX_SHARE;
    nothing beyond it (the run then says it could not confirm)."""
    if top <= 0 or not timeout_s or not snap.measured:
        return 0.0
    share = CONFIRM_SHARE * timeout_s
    cands = candidates(snap, top, CONFIRM_SCREEN)
    if len(cands) < 2:
        return share
    cost = costs(snap, cands, settings)
    least = pair_rounds(snap)
    plan = plan_confirmation(cands, cost, rounds, share, least, keep=top)
    if not isinstance(plan, str):
        chosen, fit = plan
        few = least if len(chosen) <= 2 and (len(chosen) < len(cands) or least == 1) \
            else SPREAD_ROUNDS
        return min(share, plan_seconds(chosen, cost, min(fit, few), top) + END_OF_SEARCH_S)
    smallest = [cands[0]] + [c for c in cands[1:] if c.is_baseline][:1]
    need = confirmation_seconds(smallest, cost, least) + END_OF_SEARCH_S
    return need if need <= CONFIRM_MAX_SHARE * timeout_s else 0.0


def confirm(study: optuna.Study, measure: MeasureOne, settings: MeasureSettings, *, limit: int,
            top: int, rounds: int, headroom: float, trial_timeout_s: float,
            deadline: float | None, out_dir: Path,
            on_round: Callable[[int, int, Candidate, Measurement], None]) -> str | None:
    """Re-measure the top configs and the baseline interleaved and record the decision on the
    study (``confirmation``); returns why it did not, when it did not. ``settings`` are the
    search's: the rounds' windows are twice as long."""
    snap = snapshot.read(study, limit)
    if top <= 0 or snap.confirmation is not None:
        return None
    ranked = candidates(snap, top, CONFIRM_SCREEN)
    left = _left(deadline)
    plan = plan_confirmation(ranked, costs(snap, ranked, settings), rounds, left,
                             pair_rounds(snap), keep=top)
    if isinstance(plan, str):
        return plan
    cands, planned = plan
    left_out = _left_out(ranked, cands, planned, left)
    longer = settings.with_longer_windows()
    each = {c.number: round_settings(snap, c, settings) for c in cands}
    for c in cands:
        c.measure = each[c.number].to_dict()
    done, stopped, one, round_s, active = 0, None, None, 0.0, cands
    drift = Drift([x for r in snap.measured if (x := reading_of(r.measurement))])
    while True:
        started = time.monotonic()
        results = _round(done, max(planned, done + 1), active,
                         lambda c, w, t: measure(c.config, w, t, each[c.number]),
                         trial_timeout_s, deadline, out_dir, on_round, settings.max_compile_s)
        # A round counts only when every config ran in it: a round cut by the --timeout would
        # compare one config's fresh run with another's missing one.
        if results is None:
            break
        _record(done, results)
        done += 1
        elapsed, left = time.monotonic() - started, _left(deadline)
        if done == 1:
            active = first_screen(cands, top, drift.search, results, elapsed, left)
        round_s = next_round_s(results, active, elapsed)
        more = another_round(done, planned, rounds, round_s, left)
        one = decided_in_one_round(cands, limit, headroom) if done == 1 else None
        stopped = one or (settled(cands, limit, headroom) if more else None)
        if drift.add_round(cands, results, done, rounds, round_s, left):
            stopped = one = None  # a round on the machine as it is now: the decision sees it
            continue
        if stopped or not more:
            break
    if done < 2 and not one:
        left_s = 0.0 if deadline is None else max(0.0, deadline - time.monotonic())
        took = (f" (it took {format_duration(round_s)}, {format_duration(left_s)} were left)"
                if done else "")
        return (f"the --timeout ended the confirmation after {done} complete round(s){took}; "
                "two are needed for a spread")
    decision = decide(cands, limit, headroom)
    doc: ConfirmationDoc = {
        "measured_trials": len(snap.measured), "rounds": done, "planned_rounds": planned,
        "stopped_early": stopped, "machine_changed": drift.moved, "round_added": drift.added,
        "measure": {k: v for k, v in sorted(longer.to_dict().items())},
        "candidates": [c.to_dict() for c in cands], "decision": decision.to_dict(),
        "created": datetime.now(UTC).isoformat(timespec="seconds")}
    if left_out:
        doc["left_out"] = left_out
    record.write_confirmation(study, doc)
    return None


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def first_screen(cands: list[Candidate], top: int, search: list[dict[str, float]],
                 results: list[tuple[Candidate, Measurement]], elapsed: float,
                 left: float | None) -> list[Candidate]:
    """The configs that go on after round 1 (``confirmation.screen``): all of them where the
    sentinel saw the machine change within the round (``drift.within_round``) and the time
    ``left`` holds a round of all at what this one took (``elapsed``): its readings were not
    taken on one machine. A run screened out the config its search ranked second on one window
    read while the memory copy moved by 82% within the round; the re-check put it ahead."""
    moved = within_round(search, [reading_of(m) for _, m in results])
    if moved and (left is None or left >= next_round_s(results, cands, elapsed)):
        return cands
    return screen(cands, top)


def _left_out(ranked: list[Candidate], kept: list[Candidate], planned: int,
              left: float | None) -> str | None:
    """Which configs within the margin the time ``left`` held no round of (the plan keeps the
    best ranked), in a line; None when none was left out. A run's config ranked 5th by its
    search trial never ran in the confirmation, and nothing said why."""
    dropped = [f"#{c.number}" for c in ranked if c not in kept]
    if not dropped:
        return None
    return (f"not confirmed for the time left ({format_duration(left or 0.0)}): "
            f"{', '.join(dropped)}, within the margin of the best by their search trials but "
            f"ranked lowest; the plan held {len(kept)} configs (with the baseline) for {planned} "
            "round(s)")


@dataclass
class Drift:
    """What the sentinel saw of the machine under the rounds (``tuner.drift``): the search's
    readings, each round's runs, the rates that moved, and whether a round was added for it."""

    search: list[dict[str, float]]
    ran: list[list[Measurement]] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)
    added: bool = False

    def add_round(self, cands: list[Candidate], results: list[tuple[Candidate, Measurement]],
                  done: int, rounds: int, round_s: float, left: float | None) -> bool:
        """After round ``done``: what moved; whether one more round runs for it (once, where
        the time left holds one, even beyond ``rounds``)."""
        self.ran.append([m for _, m in results])
        self.moved = [c.line() for c in changes(self.search, sentinel_rounds(cands, done))] \
            + slowdowns(self.ran)
        if self.moved and not self.added and \
                another_round(done, done + 1, rounds + 1, round_s, left):
            self.added = True
            return True
        return False


def sentinel_rounds(cands: list[Candidate], done: int) -> list[list[dict[str, float]]]:
    """The sentinel's readings of each of ``done`` rounds, one per config that ran in it."""
    return [[c.sentinels[i] for c in cands if i < len(c.sentinels) and c.sentinels[i]]
            for i in range(done)]


def next_round_s(results: list[tuple[Candidate, Measurement]], active: list[Candidate],
                 elapsed: float) -> float:
    """What the next round of ``active`` takes, at what the last round's runs took: their wall
    times (2 s each for the process) or the round's elapsed time pro rata, the larger."""
    walls = {c.number: m.wall_s + 2.0 for c, m in results}
    going = sum(walls.get(c.number, 0.0) for c in active)
    return max(elapsed * going / max(sum(walls.values()), 1e-9), going)


def another_round(done: int, planned: int, rounds: int, round_s: float,
                  left: float | None) -> bool:
    """Whether another round runs after ``done`` that did not settle the decision: without a
    deadline, the plan's rounds; with one, up to ``rounds`` while the time left holds a round
    at what the last one took. The plan counted rounds from the search trials' costs before
    any round ran; a round's own cost is the better guide (a run planned one round from a
    lead the round did not show again, and left a second round's time unused)."""
    if done >= rounds:
        return False
    if left is None:
        return done < planned
    return left >= round_s


def _record(r: int, results: list[tuple[Candidate, Measurement]]) -> None:
    """Add one complete round's results to its candidates."""
    for c, m in results:
        c.sentinels.append(reading_of(m))
        if m.ok and m.samples_per_sec:
            c.rates.append(m.samples_per_sec)
            c.peaks.append(m.peak_memory_bytes)
            c.window_cvs.append(m.spread_cv or 0.0)
        else:
            c.failures.append(f"round {r + 1}: {m.status}: {m.reason}")


def _round(r: int, rounds: int, cands: list[Candidate],
           measure: Callable[[Candidate, Path, float], Measurement],
           trial_timeout_s: float, deadline: float | None, out_dir: Path,
           on_round: Callable[[int, int, Candidate, Measurement], None],
           max_compile_s: float = 0.0) -> list[tuple[Candidate, Measurement]] | None:
    """One round: every candidate once, in order; None when the run's budget cut it short. A
    compiled config gets its compile limit on top of the trial timeout, as in the search."""
    results = []
    for c in cands:
        hard = hard_timeout(c.config, trial_timeout_s, max_compile_s)
        timeout = hard
        if deadline is not None:
            timeout = min(timeout, deadline - time.monotonic())
        if timeout < 1.0:
            return None
        m = measure(c, out_dir / "confirm" / f"{r + 1}-{c.number:04d}", timeout)
        if m.ended_by == INTERRUPTED:
            raise KeyboardInterrupt
        if m.ended_by == TRIAL_TIMEOUT and timeout < hard:
            return None  # the run's budget ended it, not the config
        results.append((c, m))
        on_round(r, rounds, c, m)
    return results
