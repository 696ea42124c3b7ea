"""Measurements replayed instead of trial processes: the real tuner, in-process, answered from a
table of per-config outcomes, a function of what it asked, or a measured grid
(``benchmarks/data/grid_*.json``).

    measure = ReplayMeasurer(lambda asked: Row(100.0 * asked.config.micro_batch_size))
    Runner(opts, reporter, measure=measure).run()
    assert [a.config.micro_batch_size for a in measure.asked] == [...]

Everything but the trial process is real: the search, the verdicts, the budget, the records, the
confirmation, the export. The measurer keeps what it was asked (config, trial folder, timeout,
settings, the pruning bound) and what it answered, so a test asserts on what the tuner asked for
and not on a process. Nothing is started and nothing is written in the trial folders.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from autotune.config.knobs import Config
from autotune.trial.measurement import PRUNED, Measurement, Status, median_and_cv
from autotune.trial.protocol import WindowStats
from autotune.trial.result import Window
from autotune.trial.spec import MeasureSettings
from autotune.tuner.pruning import prune_reason

GiB = 2**30


@dataclass(frozen=True)
class Row:
    """What one config measures as, replayed: its rate (samples/s) and peak memory, or a status
    other than ok (oom, timeout, diverged, error) with its reason. ``window_cv`` is each
    window's relative noise (drawn from the measurer's seeded generator; 0: every window reads
    the rate exactly); ``extra`` holds any other ``Measurement`` field the test needs (a
    breakdown, timings, what was applied, an MFU)."""

    samples_per_sec: float | None = None
    peak_memory_bytes: int = GiB
    status: str = "ok"
    reason: str | None = None
    window_cv: float = 0.0
    windows: int = 3
    wall_s: float = 1.0
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status == "ok" and not self.samples_per_sec:
            raise ValueError("an ok row needs its samples_per_sec")

    def measure(self, rng: random.Random, prune_below: float | None = None, *,
                limit: int | None = None, run_sigma: float = 0.0) -> Measurement:
        """One trial of this row: each window's rate is the row's, times this run's luck
        (``run_sigma``, log-normal) and the window's noise; stopped after the first windows
        when ``tuner.pruning`` says they are clearly below ``prune_below``, as a running trial
        is. A peak above ``limit`` ends it out of memory, as the launcher ends it."""
        peak = self.peak_memory_bytes
        if self.status != "ok":
            return Measurement(Status(self.status), self.reason, peak_memory_bytes=peak,
                               wall_s=self.wall_s, **self.extra)
        if limit is not None and peak > limit:
            return Measurement(Status.OOM, f"peak {peak / GiB:.2f} GiB above the replay limit",
                               peak_memory_bytes=peak, wall_s=self.wall_s)
        assert self.samples_per_sec is not None
        run = math.exp(rng.gauss(0.0, run_sigma))  # this process's luck
        rates = [self.samples_per_sec * run * (1.0 + rng.gauss(0.0, self.window_cv))
                 for _ in range(self.windows)]
        # One second each: the rate is the window's samples.
        windows = [cast(Window, {"samples": x, "seconds": 1.0}) for x in rates]
        for n in range(1, len(rates) + 1):
            why = prune_reason(rates[:n], prune_below)
            if why:
                return Measurement(Status.PRUNED, why, windows=windows[:n],
                                   peak_memory_bytes=peak,
                                   rough_samples_per_sec=statistics.median(rates[:n]),
                                   ended_by=PRUNED, wall_s=self.wall_s * n / len(rates))
        med, spread = median_and_cv(rates)
        return Measurement(Status.OK, None, samples_per_sec=med, spread_cv=spread,
                           windows=windows, peak_memory_bytes=peak, wall_s=self.wall_s,
                           **self.extra)


@dataclass(frozen=True)
class Asked:
    """One call of the measurer: what the tuner asked for, and (in ``ReplayMeasurer.asked``)
    what it was answered. ``nth`` counts the earlier asks of the same config (a confirmation
    round re-measures a config: 1 for its first round after the search trial)."""

    config: Config
    workdir: Path
    timeout: float
    settings: MeasureSettings
    prune_below: float | None
    nth: int = 0
    measurement: Measurement | None = None

    @property
    def answer(self) -> Measurement:
        assert self.measurement is not None, "not answered yet"
        return self.measurement


Answer = Row | Measurement
Answers = Mapping[Any, Answer] | Callable[[Asked], Answer]


class ReplayMeasurer:
    """A ``MeasureTrial`` (``Runner(..., measure=)``) that answers from ``answers``: a mapping
    from the config (or from ``key(config)``) to its Row or Measurement, or a function of the
    ``Asked``. A Row is measured with the measurer's seeded generator, pruning and ``limit``;
    a Measurement is answered as it is. Every call is kept in ``asked``."""

    def __init__(self, answers: Answers, *, seed: int = 0, limit: int | None = None,
                 run_sigma: float = 0.0, key: Callable[[Config], Hashable] | None = None,
                 ) -> None:
        self.answers, self.key = answers, key
        self.rng = random.Random(seed)
        self.limit, self.run_sigma = limit, run_sigma
        self.asked: list[Asked] = []

    def __call__(self, config: Config, workdir: Path, timeout: float,
                 settings: MeasureSettings, prune_below: float | None = None,
                 on_event: Callable[[Any], None] | None = None) -> Measurement:
        asked = Asked(config, workdir, timeout, settings, prune_below,
                      nth=sum(1 for a in self.asked if a.config == config))
        answer = self._answer(asked)
        m = answer if isinstance(answer, Measurement) else answer.measure(
            self.rng, prune_below, limit=self.limit, run_sigma=self.run_sigma)
        self.asked.append(replace(asked, measurement=m))
        if on_event is not None:
            for i, (w, rate) in enumerate(zip(m.windows, WindowStats(m.windows).rates,
                                              strict=True)):
                on_event({"event": "window", "t": time.time(), "index": i,
                          "samples": w["samples"], "seconds": w["seconds"],
                          "samples_per_sec": rate})
        return m

    def _answer(self, asked: Asked) -> Answer:
        if callable(self.answers):
            return self.answers(asked)
        found = self.key(asked.config) if self.key is not None else asked.config
        if found not in self.answers:
            raise KeyError(f"the replay has no answer for {found!r} ({asked.config})")
        return self.answers[found]

    @property
    def configs(self) -> list[Config]:
        """The configs asked for, in order (confirmation rounds included)."""
        return [a.config for a in self.asked]

    def of(self, config: Config) -> list[Asked]:
        """Every ask of ``config``, in order."""
        return [a for a in self.asked if a.config == config]


class Grid:
    """A measured grid (``benchmarks/data/grid_*.json``: every config of a reduced space run as
    a real trial, and a sample run again in fresh processes) as an oracle: each row's true
    rate, and noisy trials drawn from its measured spread and the between-run noise. Rows are
    found by the knobs in ``key`` (default: the grid's own)."""

    def __init__(self, doc: Mapping[str, Any], limit: int,
                 key: Sequence[str] | None = None) -> None:
        self.doc, self.limit = doc, limit
        self.key_names = tuple(key or doc["knobs"])
        self.rows = {self.key(r["config"]): r for r in doc["rows"]}
        # Between-run noise: pairs of fresh-process measurements of one config.
        logs = [math.log(a["samples_per_sec"] / r["samples_per_sec"])
                for a in doc["repeats"] if a.get("samples_per_sec")
                for r in [self.rows[self.key(a["config"])]] if r.get("samples_per_sec")]
        self.run_sigma = math.sqrt(statistics.fmean(x * x for x in logs) / 2) if logs else 0.02

    def key(self, config: Mapping[str, Any] | Config) -> tuple[Any, ...]:
        data = config.to_dict() if isinstance(config, Config) else config
        return tuple(data[k] for k in self.key_names)

    def true(self, key: tuple[Any, ...]) -> float:
        """The config's measured samples/s; 0 when it failed or does not fit the limit."""
        r = self.rows[key]
        if r["status"] != "ok" or r["peak_memory_bytes"] > self.limit:
            return 0.0
        return float(r["samples_per_sec"])

    @property
    def optimum(self) -> float:
        return max(self.true(k) for k in self.rows)

    def row(self, key: tuple[Any, ...]) -> Row:
        r = self.rows[key]
        return Row(r["samples_per_sec"], int(r["peak_memory_bytes"]), r["status"], r["reason"],
                   window_cv=r["spread_cv"] or 0.0,
                   windows=max(3, len(r.get("window_rates") or ())), wall_s=r["wall_s"])

    def evaluate(self, key: tuple[Any, ...], rng: random.Random,
                 prune_below: float | None = None) -> Measurement:
        """One noisy trial of the row at ``key``."""
        return self.row(key).measure(rng, prune_below, limit=self.limit,
                                     run_sigma=self.run_sigma)

    def measurer(self, seed: int) -> ReplayMeasurer:
        """The tuner's measurer, answering each config from its row, seeded."""
        return ReplayMeasurer(lambda asked: self.row(self.key(asked.config)), seed=seed,
                              limit=self.limit, run_sigma=self.run_sigma)
