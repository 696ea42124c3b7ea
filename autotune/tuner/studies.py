"""The studies of a storage, as `autotune studies` lists them: one row per study, read through
a ``StudySnapshot``."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from autotune.tuner import snapshot
from autotune.tuner.snapshot import Speedup


@dataclass(frozen=True)
class StudyRow:
    """One study of a storage, as `autotune studies` lists it."""

    study: str
    trials: int
    best_samples_per_sec: float | None
    speedup: Speedup | None
    last_activity: datetime | None


def list_studies(storage_url: str) -> list[StudyRow]:
    """One row per study of an existing storage: measured trials, the winner's samples/sec,
    its speedup and which kind it is (confirmed side by side, or the search windows'), last
    activity."""
    from autotune.tuner.storage import all_studies

    rows = []
    for study, summary in all_studies(storage_url):
        snap = snapshot.read(study)
        times = [t.datetime_complete or t.datetime_start for t in study.trials]
        stamps = [t for t in times if t is not None]
        best = snap.winner
        rows.append(StudyRow(summary.study_name, len(snap.measured),
                             best.samples_per_sec if best else None, snap.speedup,
                             max(stamps) if stamps else summary.datetime_start))
    return rows
