"""Crafted studies, written through the tuner's own record path: a real Optuna study (in memory,
or in any storage URL a run takes) made as a run makes it (``identity.open_study``), and trials
asked from it, each marked with its config as a run marks it and ended with its ``Record``
(``record.of_measurement``, ``of_prediction``, ``of_no_room``) by ``record.tell``. Snapshot,
search, budget and confirmation tests start from a known study without running anything:

    crafted = CraftedStudy()
    base = crafted.measured(Config(micro_batch_size=8), ok(8.0, wall_s=40.0), baseline=True)
    best = crafted.measured(Config(micro_batch_size=16), ok(12.0))
    snap = crafted.snapshot()  # what the tuner reads of the study
"""

from __future__ import annotations

from typing import Any, cast

import optuna

from autotune.config.knobs import Config
from autotune.config.space import NarrowedSpace, load_space, narrow
from autotune.machine.hardware import Hardware
from autotune.testing.hardware import fake_cpu
from autotune.trial.measurement import Measurement, Status
from autotune.trial.result import Window
from autotune.tuner import claims, record, snapshot, storage
from autotune.tuner.identity import Identity, open_study
from autotune.tuner.snapshot import StudySnapshot
from autotune.workloads import WorkloadSpec

GiB = 2**30


class CraftedStudy:
    """A study as ``autotune run`` makes it (its fingerprint, workload, space, baseline and
    memory limit recorded), on ``hw`` (a fake 2-core CPU by default), searching ``space`` (a
    space's name or a narrowed space); trials are added one at a time, numbered in order."""

    def __init__(self, hw: Hardware | None = None, *, space: str | NarrowedSpace = "default",
                 baseline: Config | None = None, workload: WorkloadSpec | None = None,
                 limit: int = 18 * GiB, url: str | None = None, name: str = "crafted",
                 seed: int = 0) -> None:
        self.hw = hw or fake_cpu()
        workload = workload or WorkloadSpec("mlp", {})
        self.baseline = baseline or Config()
        self.space = space if isinstance(space, NarrowedSpace) else narrow(
            load_space(space), self.hw, 1, self.baseline)
        self.url = url or "memory"
        self.storage = optuna.storages.InMemoryStorage() if url is None \
            else storage.open_storage(url)
        ident = Identity(name, workload.spec, workload, self.space, self.hw, self.baseline, 1,
                         None)
        self.study, self.limit = open_study(self.storage, self.url, ident, seed=seed,
                                            limit=limit, limit_spec=None)

    def ask(self, config: Config, *, baseline: bool = False) -> optuna.Trial:
        """A trial asked for ``config`` as a run asks for one, its config marked as a run marks
        it; the baseline's queued through the run's own queue first. Nothing is suggested: a
        crafted config need not be one the space's sampler could propose, so the trial holds
        no Optuna params (nothing the tuner reads of a finished trial needs them)."""
        if baseline:
            claims.enqueue_baseline(self.study, self.space.params_for(config))
        trial = storage.ask(self.study)  # as a run asks (no heartbeat warning)
        record.mark_config(trial, config)
        return trial

    def measured(self, config: Config, m: Measurement, *, baseline: bool = False) -> int:
        """A trial that ran and measured ``m``; returns its number."""
        trial = self.ask(config, baseline=baseline)
        record.tell(self.study, trial, record.of_measurement(
            m, self.limit, number=trial.number, baseline=baseline))
        return trial.number

    def predicted(self, config: Config, prediction: record.Prediction) -> int:
        """A config ruled out without running (the memory or step-time model, or a rule)."""
        trial = self.ask(config)
        record.tell(self.study, trial, record.of_prediction(prediction, self.limit))
        return trial.number

    def not_run(self, config: Config, reason: str) -> int:
        """A config not started for want of time left in the run's --timeout."""
        trial = self.ask(config)
        record.tell(self.study, trial, record.of_no_room(reason, self.limit))
        return trial.number

    def snapshot(self, limit: int | None = None) -> StudySnapshot:
        """The study as the tuner reads it, against ``limit`` (default: the study's)."""
        return snapshot.read(self.study, limit or self.limit)


def ok(rate: float, *, wall_s: float = 30.0, peak: int = GiB, spread_cv: float | None = 0.01,
       windows: int = 3, **fields: Any) -> Measurement:
    """A measurement that ended ok at ``rate`` samples/s: ``windows`` one-second windows at the
    rate, and a trial of ``wall_s`` (its timings say half of it was warm-up and windows)."""
    fields.setdefault("timings", {"warmup_s": 0.2 * wall_s, "measure_s": 0.3 * wall_s})
    window = cast(Window, {"samples": rate, "seconds": 1.0})
    return Measurement(Status.OK, None, samples_per_sec=rate, spread_cv=spread_cv,
                       windows=[window] * windows, peak_memory_bytes=peak, wall_s=wall_s,
                       **fields)
