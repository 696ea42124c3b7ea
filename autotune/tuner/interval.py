"""The interval a re-check of a speedup will find, from the rounds that measured it.

A confirmation runs the winner and the baseline in 1-5 interleaved rounds; each round gives one
paired ratio (the winner's reading over the baseline's, minutes apart at most). Too few for a
bootstrap, and one or two rounds alone say nothing of their own spread, so the method is a
Student-t prediction interval on the log of the per-round ratios whose variance is pooled with
a prior: ``PRIOR_ROUNDS`` pseudo-rounds at the noise of one round's ratio between fresh
processes (the readings' window spread, at least ``PROCESS_CV`` per reading: on the 2-core VMs
one config moves 2-14% between processes a minute apart, docs/benchmarks.md). Two rounds that
disagree widen it; one round is wide by construction. The interval is for a re-check of as
many interleaved rounds on the machine as it was (``level`` of them land inside): a machine
that changed is the sentinel's to say (``tuner.drift``), not this interval's. Pure.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from autotune.profile.documents import IntervalDoc

LEVEL = 0.90
PROCESS_CV = 0.04  # one reading's noise between fresh processes, at least
PRIOR_ROUNDS = 2  # how many rounds the prior counts as
METHOD = (f"Student-t prediction interval of the per-round log ratios, their variance pooled "
          f"with {PRIOR_ROUNDS} rounds at {100 * PROCESS_CV:.0f}% per reading (or the rounds' "
          "window spread, if larger); for a re-check of as many interleaved rounds")

# The t distribution's 0.95 quantile (a two-sided 90% interval) by degrees of freedom.
_T95 = ((1, 6.314), (2, 2.920), (3, 2.353), (4, 2.132), (5, 2.015), (6, 1.943), (7, 1.895),
        (8, 1.860), (9, 1.833), (10, 1.812), (12, 1.782), (15, 1.753), (20, 1.725),
        (30, 1.697), (60, 1.671))


def t95(df: float) -> float:
    """The t distribution's 0.95 quantile at ``df`` degrees of freedom (interpolated in
    1/df between the table's rows; the normal's 1.645 beyond it)."""
    if df <= 1:
        return _T95[0][1]
    for (d0, t0), (d1, t1) in zip(_T95, _T95[1:], strict=False):
        if df <= d1:
            w = (1 / d0 - 1 / df) / (1 / d0 - 1 / d1)
            return t0 + w * (t1 - t0)
    last_d, last_t = _T95[-1]
    return 1.645 + (last_t - 1.645) * last_d / df


@dataclass(frozen=True)
class Interval:
    """A speedup's interval: where ``level`` of re-checks of as many rounds land."""

    low: float
    high: float
    rounds: int
    level: float = LEVEL

    @property
    def wide(self) -> bool:
        """Wider than a quarter either way of its middle: a claim to read as a range."""
        return self.high / self.low > 1.25 ** 2

    def words(self) -> str:
        """'2.02-2.57x, 90% interval' (', a wide one' where ``wide``): for a line that already
        names the speedup."""
        wide = ", a wide one" if self.wide else ""
        return f"{self.low:.2f}-{self.high:.2f}x, {100 * self.level:.0f}% interval{wide}"

    def to_doc(self, machine_changed: bool = False) -> IntervalDoc:
        return {"low": round(self.low, 3), "high": round(self.high, 3), "level": self.level,
                "rounds": self.rounds, "method": METHOD, "machine_changed": machine_changed}


def ratio_interval(center: float, ratios: Sequence[float],
                   reading_cvs: Sequence[float] = ()) -> Interval | None:
    """The interval of ``center`` (the claimed ratio) from its ``ratios``, one per round, and
    the readings' in-process spread (``reading_cvs``: the window CVs of the two configs' runs).
    None without a positive center or any positive round."""
    return _interval(center, ratios, reading_cvs, readings_per_round=2)


def rate_interval(center: float, rates: Sequence[float],
                  reading_cvs: Sequence[float] = ()) -> Interval | None:
    """The same for one config's rate (samples/s) from its rounds' readings: where a re-check
    of as many rounds of it lands on the machine as it was."""
    return _interval(center, rates, reading_cvs, readings_per_round=1)


def _interval(center: float, values: Sequence[float], reading_cvs: Sequence[float],
              readings_per_round: int) -> Interval | None:
    logs = [math.log(r) for r in values if r > 0 and math.isfinite(r)]
    if center <= 0 or not logs:
        return None
    n = len(logs)
    per_reading = max([PROCESS_CV, *(c for c in reading_cvs if math.isfinite(c))])
    prior = readings_per_round * per_reading ** 2  # a ratio's round holds two readings
    between = sum((x - statistics.fmean(logs)) ** 2 for x in logs)
    df = n - 1 + PRIOR_ROUNDS
    s = math.sqrt((between + PRIOR_ROUNDS * prior) / df)
    half = t95(df) * s * math.sqrt(2 / n)  # the claim's mean and a re-check's, n rounds each
    return Interval(center * math.exp(-half), center * math.exp(half), n)


def paired_speedup(win: Sequence[float | None], base: Sequence[float | None],
                   reading_cvs: Sequence[float] = ()
                   ) -> tuple[float, tuple[float, ...], Interval | None] | None:
    """A speedup from readings paired by round (``win[i]`` and ``base[i]`` ran in round i;
    None or 0 where a run failed): the ratio of the two medians over the rounds both ran in,
    each such round's ratio, and their interval. The one rule for the confirmation's claim and
    for ``profile check``'s speedup now. None where no round holds both."""
    pairs = [(w, b) for w, b in zip(win, base, strict=False)
             if w and b and w > 0 and b > 0 and math.isfinite(w) and math.isfinite(b)]
    if not pairs:
        return None
    value = statistics.median(w for w, _ in pairs) / statistics.median(b for _, b in pairs)
    ratios = tuple(w / b for w, b in pairs)
    return value, ratios, ratio_interval(value, ratios, reading_cvs)


def contains(interval: Interval, value: float) -> bool:
    return interval.low <= value <= interval.high
