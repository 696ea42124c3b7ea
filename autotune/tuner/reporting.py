"""What a run tells whoever shows it (``console.ConsoleReporter``, ``JsonReporter``): its start,
each trial, the confirmation's rounds, notes, and the summary at the end."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from autotune.config.knobs import Config
from autotune.config.space import NarrowedSpace
from autotune.errors import AutotuneError
from autotune.machine.hardware import Hardware
from autotune.trial.measurement import Measurement, Status
from autotune.trial.progress import ProgressEvent
from autotune.tuner.confirmation import Candidate, Confirmation
from autotune.tuner.diagnosis import Finding
from autotune.tuner.record import TrialRecord
from autotune.tuner.snapshot import Speedup


@dataclass
class StartInfo:
    study_name: str
    storage: str
    hardware: Hardware
    space: NarrowedSpace
    memory_limit_bytes: int
    budget: str
    done_before: int
    out_dir: Path
    trials: int | None = None  # the study's target, for the ETA
    timeout_s: float | None = None


@dataclass
class RunSummary:
    study_name: str
    storage: str
    out_dir: Path
    profile_path: Path | None
    best: TrialRecord | None  # the winner: the confirmation's, else the fastest trial
    baseline: TrialRecord | None
    trials: list[TrialRecord]
    wall_s: float
    interrupted: bool = False
    stop_reason: str = ""
    confirmation: Confirmation | None = None  # when it covers the study's trials
    # The profile's speedup and its kind: side by side when confirmed (1.0 when no config beat
    # the baseline beyond the noise), the search trials' own ratio when unconfirmed; None when
    # one of those trials had a single window (or nothing is exported).
    speedup: Speedup | None = None
    confirm_skipped: str | None = None  # why this run did not confirm, when it did not
    dashboard: str = ""  # its path, or why it was not written; "" without a dashboard writer
    diagnosis: list[Finding] = field(default_factory=list)  # what limits the winner
    mfu: float | None = None  # the winner's, at the profile's (confirmed) samples/s


class Reporter(Protocol):
    def started(self, info: StartInfo) -> None: ...
    def trial_started(self, number: int, index: int, total: int | None, config: Config,
                      is_baseline: bool, timeout_s: float) -> None: ...
    def trial_event(self, event: ProgressEvent) -> None: ...
    def trial_finished(self, view: TrialRecord, best: TrialRecord | None) -> None: ...
    def confirming(self, round_index: int, rounds: int, candidate: Candidate,
                   measurement: Measurement) -> None: ...
    def note(self, line: str) -> None: ...
    def finished(self, summary: RunSummary) -> None: ...


class Interrupted(AutotuneError):
    """Ctrl-C: the running trial was ended and recorded; the study is intact and resumable."""

    exit_code = 130


class QuietReporter:
    """Reports nothing: for running studies from code (benchmarks, tests)."""

    def started(self, info: StartInfo) -> None: ...
    def trial_started(self, *args: Any) -> None: ...
    def trial_event(self, event: ProgressEvent) -> None: ...
    def trial_finished(self, view: TrialRecord, best: TrialRecord | None) -> None: ...
    def confirming(self, *args: Any) -> None: ...
    def note(self, line: str) -> None: ...
    def finished(self, summary: RunSummary) -> None: ...


def story(trials: Sequence[TrialRecord], baseline_rate: float | None) -> list[str]:
    """Lines for the console and the dashboard: each diagnosis-led trial's stage and the speedup
    its search trial measured over the baseline's."""
    out = []
    for t in trials:
        stage = t.stage or ""
        if not stage.startswith(("diagnosis: ", "combination: ", "neighbour: ", "re-read: ")):
            continue
        told = stage.removeprefix("diagnosis: ")
        rate = t.samples_per_sec
        if t.status == Status.OK and rate and baseline_rate:
            out.append(f"{told}: {rate / baseline_rate:.2f}x")
        else:
            out.append(f"{told}: no result")
    return out
