"""Whose trial is whose: claiming an asked trial, recovering a dead worker's, queueing the
baseline once, and finding a config's twin (measured already, or being measured by another
worker), whose outcome is reused instead of measured again. Called under the study lock where a
decision reads the study and then writes it."""

from __future__ import annotations

import time
from collections.abc import Mapping

import optuna
from optuna.trial import TrialState

from autotune.config.knobs import Config
from autotune.machine.hardware import hostname, process_alive, process_identity
from autotune.trial.spec import MeasureSettings
from autotune.tuner import record
from autotune.tuner.record import TrialRecord
from autotune.tuner.snapshot import StudySnapshot
from autotune.tuner.storage import (
    GRACE_S,
    fail_and_retry,
    fail_stale,
    has_heartbeat,
    retried_trial_number,
)


def claim(study: optuna.Study, storage: optuna.storages.BaseStorage,
          trial: optuna.Trial) -> optuna.Trial:
    """Mark a trial just asked as this worker's, under the study lock with the ask: a retried
    trial arrives with its dead worker's attributes (owner, last heartbeat mark), and another
    worker recovering dead workers' trials must not take it for that worker's."""
    # A retry carries the dead trial's last (stale) mark: beat now, not in a moment.
    record.mark_claimed(
        trial, process_identity(), alive_at=None if has_heartbeat(storage) else time.time(),
        retry_of=retried_trial_number(storage, trial) if record.was_interrupted(trial)
        else None)
    return trial


def recover_dead(study: optuna.Study, storage: optuna.storages.BaseStorage) -> None:
    """Fail and retry RUNNING trials whose tuner is gone: on this host by its pid, on others
    by the heartbeat (Optuna's on a database, autotune's ``alive_at`` on a journal file)."""
    host = hostname()
    own_heartbeat = not has_heartbeat(storage)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = record.worker_of(t)
        owner = worker.owner
        if owner.get("host") == host:
            if process_alive(owner):
                continue
        elif not own_heartbeat or not owner:
            continue
        else:
            start = t.datetime_start.timestamp() if t.datetime_start else time.time()
            if time.time() - (worker.alive_at or start) < GRACE_S:
                continue
        fail_and_retry(study, storage, t, "its tuner process died")
    fail_stale(study)  # other hosts: by heartbeat


def enqueue_baseline(study: optuna.Study, params: Mapping[str, object]) -> None:
    """Queue the baseline once: a baseline that ran (even to an OOM) is not run again."""
    if not record.baseline_pending(study):
        record.queue_baseline(study, params)


def measured_twin(snap: StudySnapshot, config: Config,
                  settings: MeasureSettings) -> TrialRecord | None:
    """An earlier trial of exactly this config, measured with the same settings: its outcome
    (ok, oom, timeout or error) is reused, not re-run. TPE ignores failed trials and may
    propose them again."""
    return next((r for r in snap.current if r.reused_from is None and r.config == config
                 and MeasureSettings.same(r.measure_settings, settings)), None)


def running_twins(study: optuna.Study, number: int, config: Config,
                  settings: MeasureSettings) -> list[int]:
    """Other trials measuring exactly ``config`` now (on other workers of a fleet)."""
    return record.running_twins(study, number, config, settings)
