"""A trial's record in the study, both ways: what is written on a trial as it goes and when it
ends (``write``: its marks, and a ``Record`` built from a Measurement or a Prediction), what is
read back (``read``: a ``TrialRecord``, parsed once) and what a study records of itself
(``facts``: ``StudyFacts``, read and written). With ``tuner/storage.py``, the only code that
reads or writes Optuna's user attributes: everything else reads typed records
(``tuner.snapshot`` gathers them per read of the study) and writes through these functions.
"""

from autotune.tuner.record.facts import (
    StudyFacts,
    read_facts,
    write_confirmation,
    write_diagnosis,
    write_flops,
    write_identity,
    write_memory_limit,
    write_model_size,
    write_probe,
    write_unapplied,
    write_unverified_cpu,
)
from autotune.tuner.record.read import (
    Pending,
    TrialRecord,
    Worker,
    baseline_pending,
    budget_cut_before,
    is_baseline,
    read_pending,
    read_trial,
    read_trials,
    reread_of,
    running_twins,
    was_interrupted,
    was_queued,
    worker_of,
)
from autotune.tuner.record.write import (
    DevicesHeld,
    Forecast,
    Outcome,
    Predicted,
    Prediction,
    Record,
    mark_claimed,
    mark_config,
    mark_forecast,
    mark_interrupted,
    mark_measuring,
    mark_reused,
    of_measurement,
    of_no_room,
    of_prediction,
    queue_baseline,
    queue_staged,
    tell,
)

__all__ = [
    "DevicesHeld", "Forecast", "Outcome", "Pending", "Predicted", "Prediction", "Record",
    "StudyFacts",
    "TrialRecord", "Worker", "baseline_pending", "budget_cut_before", "is_baseline",
    "mark_claimed", "mark_config", "mark_forecast", "mark_interrupted", "mark_measuring",
    "mark_reused", "of_measurement", "of_no_room", "of_prediction", "queue_baseline",
    "queue_staged", "read_facts", "read_pending", "read_trial", "read_trials", "reread_of",
    "running_twins", "tell", "was_interrupted", "was_queued", "worker_of", "write_confirmation",
    "write_diagnosis", "write_flops", "write_identity", "write_memory_limit", "write_model_size",
    "write_probe", "write_unapplied", "write_unverified_cpu",
]
