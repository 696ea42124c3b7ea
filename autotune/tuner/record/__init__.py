"""A trial's record in the study, both ways: what is written on a trial when it ends
(``write``: a ``Record`` built from a Measurement), what is read back (``read``: a
``TrialRecord``, parsed once) and what a study records of itself (``study``: ``StudyFacts``).
With ``tuner/storage.py``, the only code that reads Optuna's ``user_attrs``: everything else
reads typed records (``tuner.snapshot`` gathers them per read of the study).
"""

from autotune.tuner.record.facts import (
    StudyFacts,
    read_facts,
)
from autotune.tuner.record.read import (
    Forecast,
    Pending,
    StepForecast,
    TrialRecord,
    Worker,
    baseline_pending,
    budget_cut_before,
    is_baseline,
    read_pending,
    read_trial,
    read_trials,
    running_twins,
    was_interrupted,
    worker_of,
)
from autotune.tuner.record.write import (
    NOT_RUN,
    OVERSUBSCRIBED,
    PREDICTED_OOM,
    TOO_SLOW,
    Record,
    of_measurement,
    of_no_room,
    of_prediction,
    of_rule,
    of_slow_prediction,
    tell,
)

__all__ = [
    "NOT_RUN", "OVERSUBSCRIBED", "PREDICTED_OOM", "TOO_SLOW", "Forecast",
    "Pending", "Record", "StepForecast", "StudyFacts", "TrialRecord", "Worker",
    "baseline_pending", "budget_cut_before", "is_baseline",
    "of_measurement", "of_no_room", "of_prediction", "of_rule", "of_slow_prediction", "tell",
    "read_facts", "read_pending", "read_trial", "read_trials", "running_twins",
    "was_interrupted", "worker_of",
]
