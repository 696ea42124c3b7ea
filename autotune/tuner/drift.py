"""Whether the machine changed under a run: the sentinel's readings (``trial.sentinel``, taken
in every trial process before its warm-up) compared between the confirmation's rounds, and
between the search and the confirmation. Pure.

A rate counts as changed when it moved by more than ``K`` times the noise of a difference of
two readings (sqrt(2) times one reading's), and never by less than ``FLOOR``: one reading's
noise is the readings' robust spread over the search's trials (the scaled median absolute
deviation: a few odd readings do not widen it); ``FLOOR`` alone where fewer than
``MIN_READINGS`` were taken. On the 2-core VMs one reading's noise is 1-6.5%
(``benchmarks/sentinel.py``): two readings differ by 5-10% by chance often enough (a default run
flagged a bf16 matmul 10% apart within one round at a 5% floor, its search's readings having
spread by under 1.5%), so the floor is 10%; a busy neighbour process moved the fp32 matmul by
-57%, and the run that motivated this read fp32 30% slower in its confirmation than half an
hour later. Readings compare only with readings of as many ranks (ranks read at once, on
shared cores).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autotune.trial.measurement import Measurement
from autotune.trial.sentinel import SM_CLOCK, clean, describe, rates, unit

FLOOR = 0.10
K = 3.0
MIN_READINGS = 3

Reading = Mapping[str, float]


@dataclass(frozen=True)
class Change:
    """One rate that moved: its median before and after, where, and its noise."""

    metric: str
    before: float
    after: float
    where: str  # "between confirmation rounds 1 and 2", "from the search to the confirmation"
    limit: float  # the move its noise allows (``threshold``)

    @property
    def moved(self) -> float:
        return self.after / self.before - 1.0

    def line(self) -> str:
        return (f"{describe(self.metric)} {self.before:,.1f} -> {self.after:,.1f} "
                f"{unit(self.metric)} {self.where} ({100 * self.moved:+.0f}%, beyond the "
                f"{100 * self.limit:.0f}% its noise allows)")


def reading_of(m: Measurement) -> dict[str, float]:
    """What a trial read of the machine: the sentinel's rates, and on CUDA the mean SM clock
    of its timed windows (NVML's, ``machine.monitor``)."""
    out = clean(m.sentinel)  # a shared study's record is others' data: numbers only
    clock = (m.gpu or {}).get(f"{SM_CLOCK}_mean")
    if isinstance(clock, int | float) and not isinstance(clock, bool) and math.isfinite(clock) \
            and clock > 0:
        out[SM_CLOCK] = float(clock)
    return out


def slowdowns(rounds: Sequence[Sequence[Measurement]]) -> list[str]:
    """The rounds in which a GPU slowed itself down (NVML's clock event reasons: heat, a power
    brake, a hardware slowdown), a line each with the hottest reading."""
    lines = []
    for i, rnd in enumerate(rounds):
        names = sorted({n for m in rnd for n in (m.gpu or {}).get("slowdowns") or ()
                        if isinstance(n, str)})
        if names:
            hottest = max(((m.gpu or {}).get("temp_c_max") or 0.0 for m in rnd), default=0.0)
            temp = f" (up to {hottest:.0f} C)" if hottest else ""
            lines.append(f"a GPU slowed itself down in confirmation round {i + 1}: "
                         f"{', '.join(names)}{temp}")
    return lines


def noise(readings: Sequence[Reading]) -> dict[str, float]:
    """Each rate's relative noise over ``readings``: 1.4826 x the median absolute deviation
    over the median; rates read fewer than ``MIN_READINGS`` times are left out."""
    out = {}
    for name in sorted({k for r in readings for k in rates(r)}):
        values = [r[name] for r in readings if name in r]
        if len(values) < MIN_READINGS:
            continue
        mid = statistics.median(values)
        mad = statistics.median(abs(v - mid) for v in values)
        out[name] = 1.4826 * mad / mid
    return out


def threshold(noise_cv: float | None) -> float:
    """How far a rate must move to count as changed: ``K`` times the noise of a difference of
    two readings, at least ``FLOOR``."""
    return max(FLOOR, K * math.sqrt(2) * (noise_cv if noise_cv is not None else 0.0))


def alike(readings: Sequence[Reading], like: Reading) -> list[Reading]:
    """The readings taken as ``like`` was: by as many ranks at once (an unlabelled one counts
    as one) on as many threads (a script may set its own before its first step)."""
    return [r for r in readings if r.get("world_size", 1.0) == like.get("world_size", 1.0)
            and r.get("threads") == like.get("threads")]


def changes(search: Sequence[Reading], rounds: Sequence[Sequence[Reading]],
            against_search: bool = True) -> list[Change]:
    """The rates that moved within or between the confirmation's ``rounds`` (each round's
    readings: one per config it ran, in order) or, ``against_search``, from the ``search``
    trials' readings to the confirmation's: each rate's largest move, where one passed its
    threshold (set by the noise of the search's readings)."""
    taken = [r for rnd in rounds for r in rnd if rates(r)]
    if not taken:
        return []
    search = alike(search, taken[0])
    cvs = noise(search)
    found: list[Change] = []
    for name in sorted({k for r in taken for k in rates(r)}):
        limit = threshold(cvs.get(name))
        per_round = [[r[name] for r in alike(rnd, taken[0]) if name in r] for rnd in rounds]
        moves = _within(name, per_round, limit) + _between(name, per_round, limit)
        before = [r[name] for r in search if name in r]
        after = [v for values in per_round for v in values]
        if against_search and before and after:
            b, a = statistics.median(before), statistics.median(after)
            if abs(a / b - 1.0) > limit:
                moves.append(Change(name, b, a, "from the search to the confirmation", limit))
        if moves:  # the largest move of each rate: one line per rate
            found.append(max(moves, key=lambda c: abs(math.log(c.after / c.before))))
    return found


def within_round(search: Sequence[Reading], readings: Sequence[Reading]) -> list[Change]:
    """The rates that moved within one confirmation round (``readings``: one per config it
    ran, in order), against their noise over the ``search``'s readings."""
    return changes(search, [readings], against_search=False)


def _within(name: str, per_round: list[list[float]], limit: float) -> list[Change]:
    """Within a round, its configs (one after another) read the machine differently: the
    round's ratio compares a config on one machine with one on another."""
    found = []
    for i, values in enumerate(per_round):
        if len(values) < 2:
            continue
        lo, hi = values.index(min(values)), values.index(max(values))
        first, last = sorted((lo, hi))
        change = Change(name, values[first], values[last], f"within confirmation round {i + 1}",
                        limit)
        if abs(change.moved) > limit:  # as the line says it: a fall of 14% is not beyond 15%
            found.append(change)
    return found


def _between(name: str, per_round: list[list[float]], limit: float) -> list[Change]:
    """The slowest and the fastest round by their medians, where they differ by more than
    ``limit``: the earlier of the two first."""
    medians = [(i, statistics.median(v)) for i, v in enumerate(per_round) if v]
    if len(medians) < 2:
        return []
    slow, fast = min(medians, key=lambda m: m[1]), max(medians, key=lambda m: m[1])
    early, late = sorted((slow, fast))
    change = Change(name, early[1], late[1],
                    f"between confirmation rounds {early[0] + 1} and {late[0] + 1}", limit)
    return [change] if abs(change.moved) > limit else []
