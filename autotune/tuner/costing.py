"""What a profile means for the user's run: the time to train N samples (or tokens) at its
confirmed rate, with the interval a re-check of that rate finds (``tuner.interval``), and what
it costs at a price per hour; profiles of several machines or studies side by side. Pure: a
profile in, figures and lines out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autotune.errors import UsageError
from autotune.machine.fingerprint import describe_fingerprint, fingerprint_id
from autotune.profile import Profile
from autotune.tuner.interval import Interval, rate_interval
from autotune.units import format_span


@dataclass(frozen=True)
class Rate:
    """A profile's samples/s and where a re-check of it lands; ``rounds``: the confirmation
    rounds it rests on (0: one search trial)."""

    value: float
    interval: Interval | None
    rounds: int

    def words(self, per_sample: float = 1.0, unit: str = "samples") -> str:
        """'6.22 samples/s (5.46-7.09, 90% interval), median of 2 confirmation round(s)'; in
        tokens/s with ``per_sample`` tokens per sample."""
        within = "" if self.interval is None else \
            f" ({_figure(per_sample * self.interval.low)}-" \
            f"{_figure(per_sample * self.interval.high)}, " \
            f"{100 * self.interval.level:.0f}% interval)"
        how = f"median of {self.rounds} confirmation round(s)" if self.rounds \
            else "one search trial, not confirmed"
        return f"{_figure(per_sample * self.value)} {unit}/s{within}, {how}"


def rate_of(profile: Profile) -> Rate:
    """The profile's rate: the confirmation's median of the winner's rounds with their
    interval, or the search trial's figure with the interval of one reading."""
    value = profile.samples_per_sec
    mine = _winner_rounds(profile)
    if mine is not None:
        rates = [float(r) for r in mine.get("samples_per_sec") or [] if _positive(r)]
        cvs = [float(c) for c in mine.get("window_cvs") or [] if _number(c)]
        if rates:
            return Rate(value, rate_interval(value, rates, cvs), len(rates))
    cv = profile.result.get("spread_cv")
    cvs = [float(cv)] if cv is not None and _number(cv) else []
    return Rate(value, rate_interval(value, [value], cvs), 0)


def _winner_rounds(profile: Profile) -> Mapping[str, Any] | None:
    conf = profile.confirmation
    cands: list[Any] = list(conf.get("candidates") or []) if conf else []
    mine = profile.config.to_dict()
    return next((c for c in cands
                 if isinstance(c, Mapping) and c.get("config") == mine), None)


@dataclass(frozen=True)
class TrainingTime:
    """Seconds to train ``amount`` samples or tokens at ``rate``, with the interval's ends,
    and the cost at ``price_per_hour`` where given."""

    amount: float
    unit: str  # "samples" or "tokens"
    rate: Rate
    per_sample: float  # units per sample: 1, or the profile's tokens per sample
    seconds: float
    fastest_s: float | None
    slowest_s: float | None
    price_per_hour: float | None = None

    def cost(self, seconds: float) -> float | None:
        return None if self.price_per_hour is None else seconds / 3600 * self.price_per_hour

    def lines(self, ranks: int) -> list[str]:
        span = "" if self.fastest_s is None or self.slowest_s is None else \
            f" ({format_span(self.fastest_s)}-{format_span(self.slowest_s)})"
        out = [f"to train   {self.amount:,.0f} {self.unit} at "
               f"{self.rate.words(self.per_sample, self.unit)}: "
               f"{format_span(self.seconds)}{span} with {ranks} rank(s)"]
        cost = self.cost(self.seconds)
        if cost is not None and self.price_per_hour is not None:
            low, high = self.cost(self.fastest_s or self.seconds), \
                self.cost(self.slowest_s or self.seconds)
            range_ = "" if low is None or high is None or self.fastest_s is None else \
                f" ({_money(low)}-{_money(high)})"
            out.append(f"costs      {_money(cost)}{range_} at {_money(self.price_per_hour)} "
                       "per hour (the price's currency)")
        return out


def training_time(profile: Profile, *, samples: float | None = None,
                  tokens: float | None = None,
                  price_per_hour: float | None = None) -> TrainingTime:
    """The time (and cost) to train ``samples`` or ``tokens`` at the profile's rate."""
    if (samples is None) == (tokens is None):
        raise UsageError("give one of --train-samples N or --train-tokens N")
    amount = samples if samples is not None else tokens
    assert amount is not None
    if not math.isfinite(amount) or amount <= 0:
        raise UsageError(f"the amount to train must be a positive number, got {amount:g}")
    if price_per_hour is not None and (not math.isfinite(price_per_hour) or price_per_hour < 0):
        raise UsageError(f"--price-per-hour must be a number >= 0, got {price_per_hour:g}")
    rate = rate_of(profile)
    if rate.value <= 0:
        raise UsageError("the profile records no measured samples/sec: there is no rate to "
                         "train at; export it with `autotune run`")
    per_sample = 1.0
    unit = "samples"
    if tokens is not None:
        per = profile.result.get("tokens_per_sample")
        if not isinstance(per, int) or per <= 0:
            raise UsageError("the profile records no tokens per sample (its workload has no "
                             "token ids, or it was exported before autotune recorded them): "
                             "pass --train-samples N instead")
        per_sample, unit = float(per), "tokens"
    seconds = amount / (rate.value * per_sample)
    iv = rate.interval
    return TrainingTime(amount, unit, rate, per_sample, seconds,
                        None if iv is None else amount / (iv.high * per_sample),
                        None if iv is None else amount / (iv.low * per_sample),
                        price_per_hour)


# -- several profiles, side by side ----------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One profile in a comparison."""

    name: str
    machine: str
    fingerprint: str  # a short id of its fingerprint (``fingerprint_id``)
    label: str  # "A", "B", ...: one per fingerprint, in order of appearance
    ranks: int
    rate: Rate
    mfu: float | None
    headroom: float | None  # share of the memory limit left free at the peak
    speedup: float | None
    time: TrainingTime | None

    def to_doc(self) -> dict[str, Any]:
        iv = self.rate.interval
        doc: dict[str, Any] = {
            "profile": self.name, "machine": self.machine, "fingerprint": self.fingerprint,
            "fingerprint_label": self.label, "ranks": self.ranks,
            "samples_per_sec": self.rate.value, "rounds": self.rate.rounds,
            "interval": None if iv is None else [round(iv.low, 4), round(iv.high, 4)],
            "mfu": self.mfu, "memory_headroom": self.headroom, "speedup": self.speedup}
        if self.time is not None:
            t = self.time
            doc.update(train={"amount": t.amount, "unit": t.unit, "seconds": round(t.seconds, 1),
                              "fastest_s": t.fastest_s and round(t.fastest_s, 1),
                              "slowest_s": t.slowest_s and round(t.slowest_s, 1),
                              "cost": t.cost(t.seconds), "price_per_hour": t.price_per_hour})
        return doc


def compare(named: Sequence[tuple[str, Profile]], *, samples: float | None = None,
            tokens: float | None = None,
            prices: Sequence[float] = ()) -> list[Row]:
    """The profiles as rows: each labelled by its fingerprint (profiles of one fingerprint
    share a label); with an amount to train, its time, and with ``prices`` (one for all, or
    one per profile) its cost."""
    if prices and len(prices) not in (1, len(named)):
        raise UsageError(f"give one --price-per-hour for all profiles or one per profile "
                         f"({len(named)}), got {len(prices)}")
    labels: dict[str, str] = {}
    rows = []
    for i, (name, p) in enumerate(named):
        fid = fingerprint_id(p.fingerprint)
        label = labels.setdefault(fid, chr(ord("A") + len(labels)) if len(labels) < 26
                                  else fid)
        price = prices[0] if len(prices) == 1 else prices[i] if prices else None
        time = training_time(p, samples=samples, tokens=tokens, price_per_hour=price) \
            if samples is not None or tokens is not None else None
        peak, limit = p.result.get("peak_memory_bytes"), p.result.get("memory_limit_bytes")
        headroom = 1.0 - peak / limit if _positive(peak) and _positive(limit) and peak \
            and limit else None
        mfu = p.result.get("mfu")
        rows.append(Row(name, describe_fingerprint(p.fingerprint), fid, label, p.world_size,
                        rate_of(p), float(mfu) if mfu is not None and _number(mfu) else None,
                        headroom,
                        p.speedup, time))
    return rows


def table(rows: Sequence[Row]) -> list[str]:
    """The comparison as terminal lines, and a line per fingerprint: profiles measured on
    different machines (or software) are labelled, never mixed silently."""
    head = ["", "profile", "ranks", "samples/s (90% interval)", "MFU", "headroom"]
    timed = any(r.time is not None for r in rows)
    costed = any(r.time is not None and r.time.price_per_hour is not None for r in rows)
    if timed:
        head.append("to train")
    if costed:
        head.append("cost")
    body = []
    for r in rows:
        iv = r.rate.interval
        cells = [r.label, r.name, str(r.ranks),
                 _figure(r.rate.value) + ("" if iv is None else
                                          f" ({_figure(iv.low)}-{_figure(iv.high)})")
                 + ("" if r.rate.rounds else " search only"),
                 "-" if r.mfu is None else f"{100 * r.mfu:.1f}%",
                 "-" if r.headroom is None else f"{100 * r.headroom:.0f}%"]
        if timed:
            cells.append("-" if r.time is None else format_span(r.time.seconds))
        if costed:
            cost = r.time.cost(r.time.seconds) if r.time is not None else None
            cells.append("-" if cost is None else _money(cost))
        body.append(cells)
    widths = [max(len(c[i]) for c in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
             for cells in [head, *body]]
    seen: dict[str, Row] = {}
    for r in rows:
        seen.setdefault(r.label, r)
    lines.append("")
    for label, r in seen.items():
        lines.append(f"{label}: {r.machine} (fingerprint {r.fingerprint})")
    if len(seen) > 1:
        lines.append(f"{len(seen)} fingerprints: the figures come from different machines or "
                     "software (`autotune profile diff` names the fields); each is that "
                     "machine's own")
    return lines


def _figure(x: float) -> str:
    """A rate to three or four significant digits, without an exponent: 2.64, 18.4, 9,000."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _money(x: float) -> str:
    return f"{x:,.2f}" if x < 100 else f"{x:,.0f}"


def _number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _positive(x: object) -> bool:
    return _number(x) and float(x) > 0  # type: ignore[arg-type]
