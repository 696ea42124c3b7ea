"""One read of a study: its finished trials as typed records, what it records of itself, and
what follows from them (the trials that ran, the best and the baseline, the confirmation that
covers them, the winner, the speedup and which kind it is). Built once per loop iteration of a
run, and once per drawing of the dashboard or listing of studies; every reader takes it, in
the spirit of Optuna's per-ask cache of frozen trials. Pure but for ``read``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import optuna

from autotune.config.knobs import Config
from autotune.trial.measurement import Status
from autotune.tuner import record
from autotune.tuner.confirmation import Confirmation
from autotune.tuner.diagnosis import MemoryWall, Tried, TriedConfig
from autotune.tuner.interval import Interval, paired_speedup
from autotune.tuner.record import Pending, Predicted, StudyFacts, TrialRecord
from autotune.tuner.search import Observation

# Which kind a speedup is (Speedup.kind).
CONFIRMED = "confirmed side by side"
SEARCH = "search windows, not confirmed"


@dataclass(frozen=True)
class Speedup:
    """The winner's speedup over the baseline, and what it rests on: the confirmation's
    interleaved rounds (CONFIRMED) or the two search trials' own windows (SEARCH). ``rounds``:
    a confirmed win's ratio in each round (the winner's reading over the baseline's in the
    same round), so a reader sees how far one round's ratio is from another's."""

    value: float
    kind: str
    rounds: tuple[float, ...] = ()
    interval: Interval | None = None  # confirmed: where a re-check lands (``tuner.interval``)
    # The sentinel's rates that moved under the confirmation (``tuner.drift``), a line each.
    machine_changed: tuple[str, ...] = ()

    def per_round(self) -> str:
        """'; per round 2.67x, 2.37x' (a range past four rounds) where there are two or more
        rounds, else ''."""
        if len(self.rounds) < 2:
            return ""
        if len(self.rounds) > 4:
            return f"; per round {min(self.rounds):.2f}-{max(self.rounds):.2f}x"
        return "; per round " + ", ".join(f"{r:.2f}x" for r in self.rounds)

    def words(self) -> str:
        """'2.28x (2.02-2.57x, 90% interval; confirmed side by side; per round 2.35x,
        2.22x)'."""
        within = f"{self.interval.words()}; " if self.interval is not None else ""
        changed = "; the machine changed during the confirmation" \
            if self.machine_changed else ""
        return f"{self.value:.2f}x ({within}{self.kind}{self.per_round()}{changed})"


@dataclass(frozen=True)
class StudySnapshot:
    """A study as read once: records of its finished trials, its own facts, its pending
    trials, and the memory limit its trials are judged against."""

    facts: StudyFacts
    records: tuple[TrialRecord, ...]
    limit: int
    pending: Pending = field(default_factory=Pending)

    @property
    def name(self) -> str:
        return self.facts.name

    def trial(self, number: int) -> TrialRecord | None:
        return next((r for r in self.records if r.number == number), None)

    @cached_property
    def measured(self) -> tuple[TrialRecord, ...]:
        """Records that ran a process: repeats of a measured config reuse its outcome, and
        configs a model or a rule ruled out did not run."""
        return tuple(r for r in self.records if r.ran)

    @cached_property
    def rereads(self) -> dict[int, TrialRecord]:
        """Trials measured again by an ok re-read (``tuner.rereads``), with the re-read that
        stands in their place: a later trial of the same config (a shared study's marks are
        others' data: a mark that names anything else replaces nothing)."""
        earlier = {r.number: r.config for r in self.records}
        return {r.reread_of: r for r in self.records
                if r.reread_of is not None and r.ran and r.ok and r.reread_of < r.number
                and earlier.get(r.reread_of) == r.config}

    @cached_property
    def current(self) -> tuple[TrialRecord, ...]:
        """The records less the readings a re-read replaced: what picks and effects read."""
        return tuple(r for r in self.records if r.number not in self.rereads)

    @cached_property
    def observations(self) -> list[Observation]:
        """What the search reads: one observation per trial that ran or was ruled out
        (repeats of a config add nothing), in trial order; a re-read's in the place (and under
        the number) of the reading it replaced, so the search's tree of changes stands."""
        again = {r.number for r in self.rereads.values()}
        out = []
        for r in self.records:
            if r.reused_from is not None or r.number in again:
                continue
            second = self.rereads.get(r.number)
            out.append(r.observation() if second is None else
                       replace(second.observation(), number=r.number, reread=True))
        return out

    @cached_property
    def best(self) -> TrialRecord | None:
        """The fastest ok trial whose peak memory stayed within the limit."""
        return best_of(self.current, self.limit)

    @cached_property
    def baseline(self) -> TrialRecord | None:
        """The baseline's latest ok trial."""
        base = [r for r in self.records if r.is_baseline and r.ok]
        return base[-1] if base else None

    @cached_property
    def confirmation(self) -> Confirmation | None:
        """The study's confirmation, when it covers the trials recorded now (a resumed run
        that added trials must confirm again) and picked a winner."""
        conf = self.facts.confirmation
        if conf is None or conf.measured_trials != len(self.measured) \
                or conf.decision.winner_trial is None:
            return None
        return conf

    @cached_property
    def winner(self) -> TrialRecord | None:
        """The confirmation's winner, else the fastest trial within the limit."""
        conf = self.confirmation
        found = self.trial(conf.decision.winner_trial) if conf and \
            conf.decision.winner_trial is not None else None
        return found or self.best

    @cached_property
    def speedup(self) -> Speedup | None:
        """The winner's speedup: the confirmation's side-by-side ratio (1.0 when no config
        beat the baseline beyond the noise, or the baseline won it for its headroom), else the
        search trials' own figures (only when both had a measured spread); None when there is
        nothing to claim."""
        conf, win, base = self.confirmation, self.winner, self.baseline
        if conf is not None:
            if conf.no_win or (win is not None and win.is_baseline):
                return Speedup(1.0, CONFIRMED)  # not the baseline's rounds over themselves
            mine, theirs = conf.of(win.number) if win else None, conf.baseline
            # Every round runs the baseline and every config still in it: the i-th readings
            # of both share a round, where their counts agree (a stored confirmation is others'
            # data in a shared study: it may hold anything).
            paired = paired_speedup(mine.rates, theirs.rates, (*mine.window_cvs,
                                                               *theirs.window_cvs)) \
                if mine and theirs and len(mine.rates) == len(theirs.rates) else None
            if paired is not None:
                value, rounds, interval = paired
                return Speedup(round(value, 3), CONFIRMED, tuple(round(r, 3) for r in rounds),
                               interval, conf.machine_changed)
            if mine and theirs and mine.median and theirs.median:
                return Speedup(round(mine.median / theirs.median, 3), CONFIRMED,
                               machine_changed=conf.machine_changed)
        if win is None or base is None or not win.samples_per_sec or not base.samples_per_sec \
                or win.spread_cv is None or base.spread_cv is None:
            return None
        return Speedup(round(win.samples_per_sec / base.samples_per_sec, 3), SEARCH)

    # -- what the budget and the search read ---------------------------------------------

    def startup_costs(self) -> list[float]:
        """The start-up of each trial that ran to an ok result (``TrialRecord.startup_s``)."""
        found = (r.startup_s for r in self.measured if r.ok)
        return [s for s in found if s is not None]

    def compile_costs(self) -> list[float]:
        """Seconds of each measured trial's compiling step (compiled configs only)."""
        found = (r.compile_step_s for r in self.measured)
        return [s for s in found if s is not None]

    def shortest_useful_trial(self) -> float:
        """Starting a trial with less time left than half the typical ok trial wastes it."""
        walls = sorted(r.wall_s for r in self.measured if r.ok)
        return max(5.0, 0.5 * walls[len(walls) // 2]) if walls else 5.0

    def tried(self) -> Tried:
        """What the study measured, by config: the trial, its outcome and samples/sec;
        ruled-out configs did not run and are not here."""
        out: dict[Config, TriedConfig] = {}
        for r in (r for r in self.current if r.ran):
            out.setdefault(r.config, TriedConfig(r.number, r.status,
                                                 r.samples_per_sec if r.ok else None))
        return out

    def larger_over_limit(self, config: Config) -> MemoryWall | None:
        """The memory wall ``config`` stands at (``larger_over_limit``)."""
        return larger_over_limit(self.records, config, self.limit)

    def ok_within_limit(self) -> list[TrialRecord]:
        """Distinct configs that ran ok within the limit, fastest first."""
        ok = [r for r in self.current if r.ran and r.ok and r.peak_memory_bytes <= self.limit]
        return sorted(ok, key=lambda r: -(r.samples_per_sec or 0.0))


def best_of(records: Sequence[TrialRecord], limit: int) -> TrialRecord | None:
    """The fastest ok trial whose peak memory stayed within ``limit``."""
    return max((r for r in records if r.fits(limit)),
               key=lambda r: r.samples_per_sec or 0.0, default=None)


def larger_over_limit(records: Sequence[TrialRecord], config: Config,
                      limit: int) -> MemoryWall | None:
    """The smallest micro-batch above ``config``'s, in the same precision and ranks, that ran
    out of memory or passed the limit (measured), or that the memory model ruled out
    (predicted): the memory wall the config stands at. None when there is none, or when a
    micro-batch between the two ran within the limit: then throughput had already stopped
    growing with the batch before the wall (the config beat that larger batch), and memory is
    not what limits it. A config too slow to measure is no evidence about memory."""
    over, fits = [], []
    for r in records:
        c = r.config
        if c.amp != config.amp or c.world_size != config.world_size \
                or c.micro_batch_size <= config.micro_batch_size:
            continue
        if r.predicted_kind == Predicted.OOM:
            over.append((c.micro_batch_size, False, r.source))
        elif not r.predicted and (r.status == Status.OOM or r.peak_memory_bytes > limit):
            over.append((c.micro_batch_size, True, r.source))
        elif r.ok:
            fits.append(c.micro_batch_size)
    if not over:
        return None
    # The smallest wall; at one micro-batch a measured one is the stronger evidence.
    micro, measured_, number = min(over, key=lambda o: (o[0], not o[1]))
    if any(m < micro for m in fits):
        return None
    return MemoryWall(number, micro, measured_)


def read(study: optuna.Study, limit: int | None = None) -> StudySnapshot:
    """Read the study once. ``limit``: the memory limit trials are judged against (a run's
    own); by default the study's."""
    facts = record.read_facts(study)
    if limit is None:
        limit = int(facts.memory_limit_bytes or 0)
    return StudySnapshot(facts, tuple(record.read_trials(study)), limit,
                         record.read_pending(study))
