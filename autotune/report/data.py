"""What the dashboard draws, read from the study in one place: ``gather`` takes the study's
snapshot (``tuner.snapshot``) and the figures the exported profile states (``tuner.export``)
and returns one typed ``DashboardData``. Everything that draws takes that value; nothing else
in the report reads the study.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autotune.machine.hardware import describe_fingerprint
from autotune.report.effects import Effect, measured_effects, sampled
from autotune.report.importance import Importance, rank
from autotune.tuner import snapshot
from autotune.tuner.confirmation import Confirmation
from autotune.tuner.costing import training_time
from autotune.tuner.export import (
    Efficiency,
    build_profile,
    compile_payback,
    efficiency,
    payback_words,
    rate_of,
)
from autotune.tuner.record import TrialRecord
from autotune.tuner.snapshot import Speedup, StudySnapshot

if TYPE_CHECKING:
    import optuna


@dataclass(frozen=True)
class Rate:
    """A config's samples/s as the profile states it: the confirmation's median when it ran
    there (``confirmed``), else its search trial's own."""

    trial: int
    config: str  # described
    samples_per_sec: float
    confirmed: bool
    search_samples_per_sec: float | None  # its search trial's own figure

    def words(self) -> str:
        own = self.search_samples_per_sec
        where = (f"confirmed median; its search trial #{self.trial} measured {own:,.2f}"
                 if self.confirmed and own else f"search trial #{self.trial}")
        return f"{self.config}: {self.samples_per_sec:,.2f} samples/s ({where})"


@dataclass(frozen=True)
class Headline:
    """The winner as the exported profile states it: its rate and the baseline's, the speedup
    and what it rests on, its MFU at the profile's rate, what compiling cost."""

    best: Rate
    baseline: Rate | None
    speedup: Speedup | None
    no_win: bool  # confirmed: no config beat the baseline beyond the noise
    efficiency: Efficiency
    compile: str | None  # what compiling cost and when it pays, in words
    # The time to train a reference amount at the profile's rate (``tuner.costing``).
    training: tuple[str, ...] = ()


@dataclass(frozen=True)
class Probe:
    """The machine's probe as the header shows it: measured peaks by dtype, and its flags."""

    peaks: tuple[tuple[str, float], ...]
    flags: tuple[str, ...]


@dataclass(frozen=True)
class DashboardData:
    """Everything the dashboard draws, read once from the study."""

    name: str
    hardware: str
    limit: int  # bytes; 0: none
    records: tuple[TrialRecord, ...]
    headline: Headline | None  # None until a trial measured ok
    search_baseline_rate: float | None  # the baseline trial's own figure, for the search story
    confirmation: Confirmation | None
    probe: Probe | None
    limits_the_winner: tuple[str, ...]  # the exported profile's diagnosis
    importance: Importance  # over the sampled trials only (``effects.sampled``)
    effects: tuple[Effect, ...] = ()  # each knob's largest measured one-knob effect


def gather(study: optuna.Study) -> DashboardData:
    """Read ``study`` once for the dashboard: the one place the report reads a study."""
    snap = snapshot.read(study)
    facts = snap.facts
    base = snap.baseline
    return DashboardData(
        name=snap.name, hardware=_hardware(facts.fingerprint), limit=snap.limit,
        records=snap.records, headline=_headline(snap), confirmation=snap.confirmation,
        search_baseline_rate=base.samples_per_sec if base is not None else None,
        probe=_probe(facts.probe),
        # Written by the export from the profile it saved (the same MFU as the headline's).
        limits_the_winner=tuple(str(f.get("text")) for f in facts.diagnosis),
        importance=rank(sampled(snap.records), study.get_trials(deepcopy=False),
                        walked=len(snap.measured)),
        effects=tuple(measured_effects(snap.current, snap.confirmation)))


def _headline(snap: StudySnapshot) -> Headline | None:
    """The profile's figures, from the functions the profile is built with (``build_profile``):
    the confirmation's medians where it ran, the speedup of ``StudySnapshot.speedup``, the MFU
    of ``efficiency`` at the profile's rate."""
    best, base = snap.winner, snap.baseline
    if best is None:
        return None
    best_rate = _rate(snap, best)
    conf = snap.confirmation
    payback = compile_payback(snap, best)
    return Headline(
        best=best_rate, baseline=_rate(snap, base) if base is not None else None,
        speedup=snap.speedup, no_win=conf is not None and conf.no_win,
        efficiency=efficiency(snap, best, best_rate.samples_per_sec),
        compile=payback_words(payback) if payback is not None else None,
        training=_training(snap))


# What the header's time to train is for: a million samples, or a billion tokens where the
# workload has tokens.
REFERENCE_SAMPLES = 1e6
REFERENCE_TOKENS = 1e9


def _training(snap: StudySnapshot) -> tuple[str, ...]:
    """The time to train the reference amounts at the exported profile's rate, its interval
    and the ranks (``autotune profile show --train-samples``' lines, without the cost)."""
    profile = build_profile(snap, "")
    if profile is None or profile.samples_per_sec <= 0:
        return ()
    lines = [training_time(profile, samples=REFERENCE_SAMPLES).lines(profile.world_size)[0]]
    if profile.result.get("tokens_per_sample"):
        lines.append(training_time(profile, tokens=REFERENCE_TOKENS)
                     .lines(profile.world_size)[0])
    return tuple(line.removeprefix("to train").strip() for line in lines)


def _rate(snap: StudySnapshot, r: TrialRecord) -> Rate:
    conf = snap.confirmation
    mine = conf.of(r.number) if conf is not None else None
    return Rate(r.number, r.config.describe(), rate_of(snap, r) or 0.0,
                mine is not None and bool(mine.median), r.samples_per_sec)


def _hardware(fingerprint: Mapping[str, Any]) -> str:
    fp = dict(fingerprint)
    return f"{describe_fingerprint(fp)}, torch {fp.get('torch_version')}"


def _probe(probe: Mapping[str, Any] | None) -> Probe | None:
    if not probe:
        return None
    peaks = tuple((str(k), float(v)) for k, v in (probe.get("peak_tflops") or {}).items()
                  if v is not None)
    return Probe(peaks, tuple(str(f) for f in probe.get("flags") or ()))
