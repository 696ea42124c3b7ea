"""The confirmation's decision, and the document it leaves on the study.

The top configs and the baseline are measured again in interleaved rounds (``tuner.confirm_rounds``
runs them). A ``Candidate`` collects one config's rounds; ``decide`` picks the winner by median
with a margin from the measured spread (by memory headroom within the margin), and a winner that
does not lead the baseline by more than the noise is no win (``NO_WIN``). ``Confirmation`` is
what is stored on the study and in the profile: typed here, a plain dict only at the storage.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from autotune.config.knobs import Config
from autotune.profile.documents import CandidateDoc, ConfirmationDoc, DecisionDoc, MeasureValue
from autotune.trial.sentinel import clean
from autotune.tuner.search import HEADROOM, NOISE_FLOOR
from autotune.units import format_duration


@dataclass
class Candidate:
    """One config under confirmation: its samples/sec in each interleaved round."""

    number: int  # the trial it came from
    config: Config
    rates: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    window_cvs: list[float] = field(default_factory=list)
    is_baseline: bool = False
    failures: list[str] = field(default_factory=list)
    measure: dict[str, MeasureValue] = field(default_factory=dict)  # how its rounds measured
    screened_out: str | None = None  # why it ran in the first round only (``screen``)
    sentinels: list[dict[str, float]] = field(default_factory=list)  # each round's reading

    @property
    def median(self) -> float | None:
        return statistics.median(self.rates) if self.rates else None

    @property
    def peak(self) -> int:
        return max(self.peaks, default=0)

    @property
    def spread(self) -> float:
        """Relative spread of this config's rounds (CV); the in-trial CV with one round."""
        if len(self.rates) >= 2 and statistics.fmean(self.rates) > 0:
            return statistics.stdev(self.rates) / statistics.fmean(self.rates)
        return statistics.fmean(self.window_cvs) if self.window_cvs else 0.0

    def to_dict(self) -> CandidateDoc:
        doc: CandidateDoc = {
            "trial": self.number, "config": self.config.to_dict(),
            "samples_per_sec": [round(r, 4) for r in self.rates],
            "median": None if self.median is None else round(self.median, 4),
            "spread_cv": round(self.spread, 4), "peak_memory_bytes": self.peak,
            "window_cvs": [round(c, 4) for c in self.window_cvs],
            "sentinel": [{k: round(v, 3) for k, v in s.items()} for s in self.sentinels],
            "baseline": self.is_baseline, "failures": self.failures, "measure": self.measure}
        if self.screened_out:
            doc["screened_out"] = self.screened_out
        return doc


def confirmation_seconds(cands: Sequence[Candidate], costs: dict[int, float],
                         rounds: int) -> float:
    """What ``rounds`` rounds of ``cands`` take, from what one run of each costs (its start-up
    and its round's measuring budget, ``confirm_rounds.costs``), with 2 s each for the process."""
    return rounds * sum(costs.get(c.number, 0.0) + 2.0 for c in cands)


def kept(cands: Sequence[Candidate], keep: int | None) -> list[Candidate]:
    """The candidates that go on past the first round when ``keep`` of the configs do (the
    baseline always): by their order here, until the first round has ranked them."""
    if keep is None:
        return list(cands)
    going = {c.number for c in [o for o in cands if not o.is_baseline][:keep]}
    return [c for c in cands if c.is_baseline or c.number in going]


def plan_seconds(cands: Sequence[Candidate], costs: dict[int, float], rounds: int,
                 keep: int | None = None) -> float:
    """What ``rounds`` rounds take when only ``keep`` of the configs go on past the first."""
    if rounds <= 0:
        return 0.0
    return (confirmation_seconds(cands, costs, 1)
            + confirmation_seconds(kept(cands, keep), costs, rounds - 1))


def rounds_that_fit(cands: Sequence[Candidate], costs: dict[int, float], rounds: int,
                    left: float, keep: int | None = None) -> int:
    """How many of ``rounds`` fit ``left`` seconds: the first with every candidate, the rest
    with those ``kept`` past it."""
    first = confirmation_seconds(cands, costs, 1)
    rest = confirmation_seconds(kept(cands, keep), costs, 1)
    if left < first:
        return 0
    return min(rounds, 1 + int((left - first) // max(rest, 1e-9)))


def plan_confirmation(cands: Sequence[Candidate], costs: dict[int, float], rounds: int,
                      left: float | None, pair_rounds: int = 2, keep: int | None = None
                      ) -> tuple[list[Candidate], int] | str:
    """The candidates (best first) and rounds that fit ``left`` seconds, or why none fits:
    fewer rounds first, then fewer configs (the baseline stays); never fewer than two rounds
    (a spread), or ``pair_rounds`` once only the best config and the baseline are left (one
    where the search's lead is decisive: ``confirm_rounds.pair_rounds``). With ``keep``, only that
    many configs go on past the first round (``screen``). Without a deadline, all of them."""
    cands = list(cands)
    if len(cands) < 2:
        return "fewer than two configs measured ok"
    if left is None:
        return cands, rounds
    while True:
        least = max(1, min(pair_rounds if len(cands) <= 2 else 2, rounds))
        fit = rounds_that_fit(cands, costs, rounds, left, keep)
        if fit >= least:
            return cands, fit
        if sum(not c.is_baseline for c in cands) <= 1 or len(cands) <= 2:
            need = confirmation_seconds(cands, costs, least)
            words = "one round" if least == 1 else "two rounds"
            return (f"{words} of {len(cands)} configs need ~{format_duration(need)} and "
                    f"{format_duration(max(0.0, left))} are left; a longer --timeout leaves room "
                    "for it")
        cands.remove(next(c for c in reversed(cands) if not c.is_baseline))


# One interleaved round decides when the winner leads the baseline by more than this many times
# their margin (and no other config is within the margin of it): a lead of 2x over a noise of a
# few percent is not made doubtful by a second round, and a round of BERT on a 2-core CPU costs
# minutes the search can use.
DECISIVE = 5.0


def decisive(lead: float, margin: float) -> bool:
    """Whether a relative ``lead`` is more than ``DECISIVE`` times ``margin``."""
    return lead > DECISIVE * margin


def screen(candidates: Sequence[Candidate], keep: int) -> list[Candidate]:
    """After the first round: the ``keep`` configs it measured fastest go on with the baseline;
    the others (``screened_out``, with their reading) cannot win. The search ranked them from
    trials minutes apart, in a machine that drifts; the round measured them side by side."""
    ran = sorted((c for c in candidates if not c.is_baseline and c.rates and not c.failures),
                 key=lambda c: -c.rates[0])
    if len(ran) <= keep:
        return [c for c in candidates if not c.screened_out]
    slowest = ran[keep - 1].rates[0]
    for c in ran[keep:]:
        c.screened_out = (f"screened out after round 1: {c.rates[0]:,.2f} samples/s, behind "
                          f"the {keep} fastest of it (down to {slowest:,.2f})")
    return [c for c in candidates if not c.screened_out]


def decided_in_one_round(candidates: Sequence[Candidate], limit: int,
                         headroom: float = HEADROOM) -> str | None:
    """Why one round of these candidates settles the decision, or None: the winner, the only
    config besides the baseline, leads it by more than ``DECISIVE`` times their margin."""
    candidates = [c for c in candidates if not c.screened_out]
    if len(candidates) != 2 or any(len(c.rates) != 1 for c in candidates):
        return None
    d = decide(candidates, limit, headroom)
    base = next((c for c in candidates if c.is_baseline), None)
    win = d.winner
    if d.decided_by != "median" or win is None or base is None or win is base:
        return None
    lead = (win.median or 0.0) / (base.median or 1e-12) - 1.0
    margin = margin_between(win, base)
    if not decisive(lead, margin):
        return None
    return (f"one round: the winner leads the baseline by {100 * lead:.0f}%, more than "
            f"{DECISIVE:g}x their margin ({100 * margin:.1f}%)")


@dataclass(frozen=True)
class Decision:
    winner: Candidate | None
    runner_up: Candidate | None
    margin: float
    decided_by: str  # "median", "headroom" or why there is no winner
    excluded: dict[int, str]  # trial -> why it cannot win

    def to_dict(self) -> DecisionDoc:
        return {"winner_trial": self.winner.number if self.winner else None,
                "runner_up_trial": self.runner_up.number if self.runner_up else None,
                "margin": round(self.margin, 4), "decided_by": self.decided_by,
                "excluded": {str(k): v for k, v in self.excluded.items()}}


NO_WIN = "no win beyond noise"
# Within the margin, with peaks that differ by less than the headroom: the faster median, said
# as such (a run picked a config for 70 MB less peak of an 18 GiB limit over a 2% faster one).
WITHIN_MARGIN = "the higher median within the margin"


def margin_between(a: Candidate, b: Candidate) -> float:
    """The lead ``a`` needs over ``b`` to count (``margin_of`` their spreads)."""
    return margin_of(a.spread, b.spread)


def margin_of(spread_a: float, spread_b: float) -> float:
    """The lead one config needs over another to count, from their spreads (CVs): twice their
    pooled spread, at least ``NOISE_FLOOR``."""
    return max(NOISE_FLOOR, 2 * math.sqrt((spread_a ** 2 + spread_b ** 2) / 2))


def decide(candidates: Sequence[Candidate], limit: int, headroom: float = HEADROOM) -> Decision:
    """The winner of a confirmation.

    Eligible: every round ran to a result and the peak stayed below the limit less the headroom.
    The highest median wins when it leads the runner-up by more than the margin, twice the pooled
    spread of the two (at least ``NOISE_FLOOR``); within the margin the one with more memory
    headroom wins (a tie in speed is not a reason to run closer to the wall), where its peak is
    lower by more than the headroom (``headroom`` of the limit) and the other's above
    ``NEAR_WALL`` of it; else the higher median (``WITHIN_MARGIN``). A winner that does not
    lead the baseline by more than their margin is no win: the baseline is kept (``NO_WIN``).
    """
    decision = _rank(candidates, limit, headroom)
    base = next((c for c in candidates if c.is_baseline and c.number not in decision.excluded),
                None)
    win = decision.winner
    if win is None or base is None or win is base:
        return decision
    margin = margin_between(win, base)
    if (win.median or 0.0) / (base.median or 1e-12) - 1.0 > margin:
        return decision
    return Decision(base, win, margin, NO_WIN, decision.excluded)


def settled(candidates: Sequence[Candidate], limit: int, headroom: float = HEADROOM) -> str | None:
    """Why more rounds would not change the decision, or None: the winner leads the runner-up
    and the baseline by more than their margins, or even the winner's best round against the
    baseline's worst does not clear the margin (the win is not reachable). Needs two rounds."""
    candidates = [c for c in candidates if not c.screened_out]
    if any(len(c.rates) < 2 for c in candidates if not c.failures):
        return None
    d = decide(candidates, limit, headroom)
    base = next((c for c in candidates if c.is_baseline and c.rates), None)
    if d.winner is None:
        return None
    if d.decided_by == "median" and _clear(d, base):
        return f"the winner leads by more than the margin ({100 * d.margin:.1f}%)"
    if d.decided_by == NO_WIN and base is not None and d.runner_up is not None:
        best_case = max(d.runner_up.rates) / min(base.rates) - 1.0
        if best_case <= d.margin:
            return (f"even its best round leads the baseline's worst by {100 * best_case:.1f}%, "
                    f"within the margin ({100 * d.margin:.1f}%)")
    return None


def _clear(d: Decision, base: Candidate | None) -> bool:
    """The winner leads the runner-up (and the baseline) beyond their margins."""
    win = d.winner
    if win is None:
        return False
    others = [c for c in (d.runner_up, base) if c is not None and c is not win]
    return all((win.median or 0.0) / (o.median or 1e-12) - 1.0 > margin_between(win, o)
               for o in others)


# Headroom decides a tie only where the other peaks above this share of the limit: far from it
# a tie is a coin flip (Zen 4 re-checks of 8x1 taken over 16x1: 16x1 5.3%, 0.4%, -4.1% ahead).
NEAR_WALL = 0.5


def _rank(candidates: Sequence[Candidate], limit: int, headroom: float) -> Decision:
    """The fastest eligible candidate beyond the margin over the runner-up, else the roomier of
    the two by more than the headroom where the other nears the wall, else the faster."""
    budget = limit * (1.0 - headroom)
    excluded: dict[int, str] = {}
    eligible = []
    for c in candidates:
        if c.screened_out:
            excluded[c.number] = c.screened_out
        elif c.failures or not c.rates:
            excluded[c.number] = "; ".join(c.failures) or "not measured"
        elif c.peak > budget:
            excluded[c.number] = (f"peak {c.peak / 2**30:.2f} GiB is within {100 * headroom:.0f}% "
                                  f"of the {limit / 2**30:.2f} GiB limit")
        else:
            eligible.append(c)
    if not eligible:
        return Decision(None, None, NOISE_FLOOR, "no config kept its memory headroom", excluded)
    ranked = sorted(eligible, key=lambda c: -(c.median or 0.0))
    if len(ranked) == 1:
        return Decision(ranked[0], None, NOISE_FLOOR, "median", excluded)
    first, second = ranked[0], ranked[1]
    margin = margin_between(first, second)
    lead = (first.median or 0.0) / (second.median or 1e-12) - 1.0
    if lead > margin:
        return Decision(first, second, margin, "median", excluded)
    roomier = min((first, second), key=lambda c: (c.peak, -(c.median or 0.0)))
    other = second if roomier is first else first
    if other.peak - roomier.peak <= headroom * limit or other.peak <= NEAR_WALL * limit:
        return Decision(first, second, margin, WITHIN_MARGIN, excluded)
    return Decision(roomier, other, margin, "headroom", excluded)


# -- the stored document ---------------------------------------------------------------------


@dataclass(frozen=True)
class Confirmed:
    """One candidate's rounds as stored: what a reader of the study needs of it."""

    trial: int
    config: Config
    rates: tuple[float, ...]
    median: float | None
    spread_cv: float
    peak_memory_bytes: int
    baseline: bool
    failures: tuple[str, ...] = ()
    measure: Mapping[str, Any] = field(default_factory=dict)
    window_cvs: tuple[float, ...] = ()  # each round's in-process spread (older studies: none)
    sentinels: tuple[Mapping[str, float], ...] = ()  # each round's reading (``trial.sentinel``)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Confirmed:
        return cls(trial=int(d["trial"]), config=Config.from_dict(d["config"]),
                   rates=tuple(float(r) for r in d.get("samples_per_sec") or ()),
                   median=d.get("median"), spread_cv=float(d.get("spread_cv") or 0.0),
                   peak_memory_bytes=int(d.get("peak_memory_bytes") or 0),
                   baseline=bool(d.get("baseline")), failures=tuple(d.get("failures") or ()),
                   measure=dict(d.get("measure") or {}),
                   window_cvs=tuple(float(c) for c in d.get("window_cvs") or ()),
                   sentinels=tuple(clean(s) for s in d.get("sentinel") or ()))


@dataclass(frozen=True)
class StoredDecision:
    """The decision as stored (trial numbers, not candidates)."""

    winner_trial: int | None
    runner_up_trial: int | None
    margin: float
    decided_by: str
    excluded: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StoredDecision:
        return cls(d.get("winner_trial"), d.get("runner_up_trial"), float(d.get("margin") or 0.0),
                   str(d.get("decided_by") or ""), dict(d.get("excluded") or {}))


@dataclass(frozen=True)
class Confirmation:
    """The confirmation a study holds: its rounds, candidates and decision. Its stored form
    (``to_dict``) is the study's ``confirmation`` attribute and the profile's block."""

    measured_trials: int
    rounds: int
    candidates: tuple[Confirmed, ...]
    decision: StoredDecision
    measure: Mapping[str, Any]
    raw: Mapping[str, Any]  # the stored form, kept whole (later versions may add keys)
    planned_rounds: int = 0
    stopped_early: str | None = None  # why rounds stopped before the plan's end
    # The sentinel's rates that moved under it (``tuner.drift``), a line each: its speedup
    # ran on a machine that changed.
    machine_changed: tuple[str, ...] = ()
    left_out: str | None = None  # tied configs the time left held no round of, and why

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Confirmation:
        return cls(measured_trials=int(d.get("measured_trials") or 0),
                   rounds=int(d.get("rounds") or 0),
                   planned_rounds=int(d.get("planned_rounds") or d.get("rounds") or 0),
                   stopped_early=d.get("stopped_early"),
                   machine_changed=tuple(str(x) for x in d.get("machine_changed") or ()
                                         if isinstance(x, str)),
                   left_out=d["left_out"][:400] if isinstance(d.get("left_out"), str) else None,
                   candidates=tuple(Confirmed.from_dict(c) for c in d.get("candidates") or ()),
                   decision=StoredDecision.from_dict(d.get("decision") or {}),
                   measure=dict(d.get("measure") or {}), raw=dict(d))

    def to_doc(self) -> ConfirmationDoc:
        """As the study and the profile hold it: the stored form, whole."""
        return cast(ConfirmationDoc, dict(self.raw))

    def of(self, trial: int) -> Confirmed | None:
        return next((c for c in self.candidates if c.trial == trial), None)

    @property
    def baseline(self) -> Confirmed | None:
        return next((c for c in self.candidates if c.baseline), None)

    @property
    def no_win(self) -> bool:
        return self.decision.decided_by == NO_WIN

    @property
    def side_by_side(self) -> bool:
        """Whether the baseline ran in it to a result: its speedup is a side-by-side ratio."""
        base = self.baseline
        return base is not None and bool(base.median)
