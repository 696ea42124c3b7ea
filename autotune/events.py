"""What `autotune run --json` tells a script: one JSON object per line for each event of the
run (the terminal's view is ``console.py``)."""

from __future__ import annotations

import time
from typing import Any

from autotune.config.knobs import Config
from autotune.trial.measurement import Measurement
from autotune.trial.progress import ProgressEvent
from autotune.tuner.confirmation import Candidate
from autotune.tuner.record import TrialRecord
from autotune.tuner.reporting import RunSummary, StartInfo


class JsonReporter:
    """`autotune run --json`: one JSON object per line on stdout for each event, for scripts.

    Every line has ``event``: started, trial_started, trial_progress (built, warmup_step, window),
    trial_finished, confirm_round, finished. Errors still go to stderr as one line."""

    def __init__(self, stream: Any = None) -> None:
        import sys

        self.stream = stream or sys.stdout
        self.trial: int | None = None  # the running trial, for its progress events

    def _emit(self, event: str, **fields: Any) -> None:
        import json

        self.stream.write(json.dumps({"event": event, "t": time.time(), **fields},
                                     default=str) + "\n")
        self.stream.flush()

    def started(self, info: StartInfo) -> None:
        space = info.space
        self._emit("started", study=info.study_name, storage=info.storage,
                   hardware=info.hardware.describe(), device=info.hardware.device,
                   memory_limit_bytes=info.memory_limit_bytes, budget=info.budget,
                   out_dir=info.out_dir, done_before=info.done_before, trials=info.trials,
                   timeout_s=info.timeout_s, world_size=space.world_size,
                   searched={k: d.describe() for k, d in space.searched.items()},
                   fixed={k: {"value": v, "reason": why} for k, (v, why) in space.fixed.items()})

    def trial_started(self, number: int, index: int, total: int | None, config: Config,
                      is_baseline: bool, timeout_s: float) -> None:
        self.trial = number
        self._emit("trial_started", trial=number, index=index, total=total,
                   config=config.to_dict(), baseline=is_baseline, timeout_s=timeout_s)

    def trial_event(self, event: ProgressEvent) -> None:
        fields = {k: v for k, v in event.items() if k not in ("event", "t")}
        self._emit("trial_progress", trial=self.trial, kind=event.get("event"), **fields)

    def trial_finished(self, view: TrialRecord, best: TrialRecord | None) -> None:
        self._emit("trial_finished", **_view_fields(view),
                   best_trial=best.number if best else None)

    def confirming(self, round_index: int, rounds: int, candidate: Candidate,
                   measurement: Measurement) -> None:
        self._emit("confirm_round", round=round_index + 1, rounds=rounds,
                   trial=candidate.number, baseline=candidate.is_baseline,
                   status=measurement.status, samples_per_sec=measurement.samples_per_sec,
                   peak_memory_bytes=measurement.peak_memory_bytes)

    def note(self, line: str) -> None:
        self._emit("note", text=line)

    def finished(self, summary: RunSummary) -> None:
        self._emit("finished", study=summary.study_name, storage=summary.storage,
                   stop_reason=summary.stop_reason, interrupted=summary.interrupted,
                   wall_s=summary.wall_s, profile=summary.profile_path,
                   dashboard=summary.dashboard or None,
                   best=_view_fields(summary.best) if summary.best else None,
                   baseline=_view_fields(summary.baseline) if summary.baseline else None,
                   speedup=summary.speedup.value if summary.speedup else None,
                   speedup_kind=summary.speedup.kind if summary.speedup else None,
                   confirmed=summary.confirmation is not None,
                   not_confirmed_because=summary.confirm_skipped,
                   diagnosis=[f.to_dict() for f in summary.diagnosis])


def _view_fields(view: TrialRecord) -> dict[str, Any]:
    return {"trial": view.number, "config": view.config.to_dict(), "status": view.status,
            "reason": view.reason, "samples_per_sec": view.samples_per_sec,
            "spread_cv": view.spread_cv, "peak_memory_bytes": view.peak_memory_bytes,
            "breakdown": view.breakdown, "baseline": view.is_baseline,
            "reused_from": view.reused_from, "predicted": view.predicted, "stage": view.stage,
            "mfu": view.mfu, "tflops": view.tflops, "step_s": view.step_s,
            "forecast": view.forecast.to_dict(), "predicted_kind": view.predicted_kind}
