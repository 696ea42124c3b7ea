"""The end of a run: the top configs re-measured side by side with the baseline, the winner
decided by a margin larger than the measured noise, and the profile exported from that decision.

A search trial's figure comes from one process at one moment of a machine that drifts by 10-30%
within minutes; the confirmation runs the top configs and the baseline in interleaved rounds (A B
C A B C ...), with windows twice as long, so drift hits every config alike.

It is kept cheap enough to always run: its share of --timeout is reserved from the start (the
search gets the rest), each round's measuring budget is sized to the config's step time (warm-up
and the minimum windows; the rounds give the spread), the plan shrinks to fewer rounds and then
to the best config and the baseline when the budget is short, and rounds stop as soon as the
decision is clear or the win is out of reach. A winner that does not beat the baseline by more
than the measured noise is no win: the baseline's settings are exported, with speedup 1.0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from autotune.config.knobs import Config
from autotune.profile import Profile
from autotune.trial.measurement import INTERRUPTED, TRIAL_TIMEOUT, Measurement
from autotune.trial.spec import MeasureSettings
from autotune.tuner.budget import confirm_settings, hard_timeout
from autotune.tuner.options import CONFIRM_MAX_SHARE, CONFIRM_SHARE
from autotune.tuner.results import (
    build_profile,
    confirmed,
    confirmed_winner,
    measured,
    pick_baseline,
    recorded,
    startup_of,
)
from autotune.tuner.search import (
    Candidate,
    confirmation_seconds,
    decide,
    plan_confirmation,
    settled,
)

# (config, workdir, timeout, settings) -> the measurement of one fresh trial process
MeasureOne = Callable[[Config, Path, float, MeasureSettings], Measurement]


def round_settings(trials: list[FrozenTrial], c: Candidate,
                   settings: MeasureSettings) -> MeasureSettings:
    """How ``c`` is measured in each round: longer windows, a budget sized to its steps."""
    t = next(t for t in trials if t.number == c.number)
    rate = t.user_attrs["measurement"].get("samples_per_sec")
    return confirm_settings(settings, c.config.samples_per_step / rate if rate else None)


def costs(trials: list[FrozenTrial], cands: list[Candidate],
          settings: MeasureSettings) -> dict[int, float]:
    """What one round of each candidate costs: its trial's start-up (wall time less warm-up
    and windows; half the wall time where the trial did not say) and its round's budget."""
    out = {}
    for c in cands:
        t = next(t for t in trials if t.number == c.number)
        startup = startup_of(t)
        if startup is None:
            startup = 0.5 * float(t.user_attrs["measurement"].get("wall_s") or 0.0)
        # A compiled config compiles again in each round's fresh process (from the study's
        # cache, usually quicker): its trial's compiling step is the estimate.
        compiling = float((t.user_attrs["measurement"].get("timings") or {})
                          .get("compile_step_s", 0.0))
        out[c.number] = startup + compiling + round_settings(trials, c, settings).max_seconds
    return out


def candidates(trials: list[FrozenTrial], limit: int, top: int) -> list[Candidate]:
    """The ``top`` configs by their trial (distinct, ok, within the limit) and the baseline."""
    ok = [t for t in measured(trials) if t.user_attrs.get("status") == "ok"
          and t.user_attrs["measurement"]["peak_memory_bytes"] <= limit]
    ok.sort(key=lambda t: -t.user_attrs["measurement"]["samples_per_sec"])
    chosen = ok[:top]
    base = pick_baseline(trials)
    if base is not None and base.number not in {t.number for t in chosen}:
        chosen.append(base)
    return [Candidate(t.number, Config.from_dict(t.user_attrs["config"]),
                      is_baseline=bool(t.user_attrs.get("baseline"))) for t in chosen]


def reserve(trials: list[FrozenTrial], limit: int, top: int, rounds: int,
            timeout_s: float | None, settings: MeasureSettings) -> float:
    """Seconds of the --timeout kept for the confirmation. Nothing before the first trial (the
    baseline runs whatever the budget: without it there is nothing to confirm against); then
    CONFIRM_SHARE of it; once two configs measured ok, what the largest plan within that share
    needs, or, when even the smallest plan (the best and the baseline, twice) needs more, that
    much up to CONFIRM_MAX_SHARE; nothing beyond it (the run then says it could not confirm)."""
    if top <= 0 or not timeout_s or not measured(trials):
        return 0.0
    share = CONFIRM_SHARE * timeout_s
    cands = candidates(trials, limit, top)
    if len(cands) < 2:
        return share
    cost = costs(trials, cands, settings)
    plan = plan_confirmation(cands, cost, rounds, share)
    if not isinstance(plan, str):
        return min(share, confirmation_seconds(plan[0], cost, plan[1]))
    smallest = [cands[0]] + [c for c in cands[1:] if c.is_baseline][:1]
    need = confirmation_seconds(smallest, cost, 2)
    return need if need <= CONFIRM_MAX_SHARE * timeout_s else 0.0


def confirm(study: optuna.Study, measure: MeasureOne, settings: MeasureSettings, *, limit: int,
            top: int, rounds: int, headroom: float, trial_timeout_s: float,
            deadline: float | None, out_dir: Path,
            on_round: Callable[[int, int, Candidate, Measurement], None]) -> str | None:
    """Re-measure the top configs and the baseline interleaved and record the decision on the
    study (``confirmation``); returns why it did not, when it did not. ``settings`` are the
    search's: the rounds' windows are twice as long."""
    trials = recorded(study)
    if top <= 0 or confirmed(study, trials) is not None:
        return None
    cands = candidates(trials, limit, top)
    plan = plan_confirmation(cands, costs(trials, cands, settings), rounds,
                             None if deadline is None else deadline - time.monotonic())
    if isinstance(plan, str):
        return plan
    cands, planned = plan
    longer = settings.with_longer_windows()
    each = {c.number: round_settings(trials, c, settings) for c in cands}
    for c in cands:
        c.measure = each[c.number].to_dict()
    done, stopped = 0, None
    for r in range(planned):
        results = _round(r, planned, cands,
                         lambda c, w, t: measure(c.config, w, t, each[c.number]),
                         trial_timeout_s, deadline, out_dir, on_round, settings.max_compile_s)
        # A round counts only when every config ran in it: a round cut by the --timeout would
        # compare one config's fresh run with another's missing one.
        if results is None:
            break
        for c, m in results:
            if m.ok and m.samples_per_sec:
                c.rates.append(m.samples_per_sec)
                c.peaks.append(m.peak_memory_bytes)
                c.window_cvs.append(m.spread_cv or 0.0)
            else:
                c.failures.append(f"round {r + 1}: {m.status}: {m.reason}")
        done += 1
        stopped = settled(cands, limit, headroom) if done < planned else None
        if stopped:
            break
    if done < 2:
        return (f"the --timeout ended the confirmation after {done} complete round(s); two are "
                "needed for a spread")
    decision = decide(cands, limit, headroom)
    study.set_user_attr("confirmation", {
        "measured_trials": len(measured(trials)), "rounds": done, "planned_rounds": planned,
        "stopped_early": stopped,
        "measure": {k: v for k, v in sorted(longer.to_dict().items())},
        "candidates": [c.to_dict() for c in cands], "decision": decision.to_dict(),
        "created": datetime.now(UTC).isoformat(timespec="seconds")})
    return None


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


def export(study: optuna.Study, limit: int, storage: str, global_batch: int | None,
           path: Path) -> Profile | None:
    """Write the profile of the confirmed winner, else of the best trial, to ``path``; None
    when nothing has been measured successfully yet."""
    trials = recorded(study)
    best = confirmed_winner(study, trials, limit)
    if best is None:
        return None
    profile = build_profile(study, best, pick_baseline(trials), trials, limit, storage,
                            global_batch, confirmed(study, trials))
    profile.save(path)
    if study.user_attrs.get("diagnosis") != profile.diagnosis:
        study.set_user_attr("diagnosis", profile.diagnosis)  # for the dashboard
    return profile


def speedup_side_by_side(profile: Profile | None, conf: dict[str, Any] | None) -> float | None:
    """The profile's speedup when it is the confirmation's side-by-side ratio (the baseline ran
    in it), else None."""
    side_by_side = conf is not None and any(c["baseline"] and c["median"]
                                            for c in conf["candidates"])
    return profile.speedup if profile and side_by_side else None
