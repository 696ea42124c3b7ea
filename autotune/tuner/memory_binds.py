"""What a run does when the model does not fit replicated on each rank: it sizes the model once
(``trial.sizing``) for the memory model of sharding (``tuner.sharding``), and when the baseline runs
out of memory, or is predicted to, queues the baseline again under the next, more sharded,
strategy. The memory model rules out each strategy that cannot fit either (the trial is recorded
with its prediction, not run), so the run's lines say why each strategy ran or not."""

from __future__ import annotations

import time
from collections.abc import Callable

import optuna

from autotune.config.knobs import Config
from autotune.config.space import Choices, NarrowedSpace
from autotune.trial.measurement import Status
from autotune.trial.sizing import size_model
from autotune.tuner import record
from autotune.tuner.search import Strategies, micro_values
from autotune.tuner.sharding import next_strategy
from autotune.tuner.snapshot import StudySnapshot
from autotune.units import format_bytes
from autotune.workloads import WorkloadSpec

# What a run of a script fixes: autotune does not shard a script's model in its trials yet.
SCRIPT_FIXED = dict.fromkeys(("sharding", "fsdp_reduce_dtype", "cpu_offload"),
                             "a script's model is not sharded by autotune yet")


def size_once(study: optuna.Study, space: NarrowedSpace, workload: WorkloadSpec,
              note: Callable[[str], None]) -> None:
    """With sharding searched: the model's size, once per study (a failure is said, and
    leaves sharding to the OOMs trials measure)."""
    if "sharding" not in space.searched or record.read_facts(study).model_size is not None:
        return
    start = time.monotonic()
    try:
        size = size_model(workload.name, dict(workload.params))
    except ValueError as exc:
        note(f"the memory model of sharding has no model size: {exc}")
        return
    record.write_model_size(study, size)
    note(f"model: {size['params'] / 1e6:.1f}M parameters, {format_bytes(size['param_bytes'])} "
         f"({size['units']} FSDP units, the largest {format_bytes(size['largest_unit_bytes'])}),"
         f" {size['optimizer']}; sized in {time.monotonic() - start:.0f}s")


def baseline_now(snap: StudySnapshot, baseline: Config) -> Config:
    """The baseline in force: the user's, or the next strategy's once the user's did not fit
    (``next_baseline``)."""
    queued = [r for r in snap.records if r.is_baseline]
    return queued[-1].config if queued else baseline


def _smaller_micro(space: NarrowedSpace, config: Config) -> int | None:
    """The largest micro-batch below ``config``'s that the space runs (an enqueued value must
    be one of its own; with --global-batch, those divide it)."""
    below = [v for v in micro_values(space, config) if v < config.micro_batch_size]
    return max(below) if below else None


def next_baseline(study: optuna.Study, space: NarrowedSpace, snap: StudySnapshot,
                  note: Callable[[str], None], model: Strategies | None = None) -> bool:
    """When every baseline trial so far ran out of memory (or was predicted to) and the space
    searches sharding: queue the baseline under the next strategy (the least sharded that
    holds less than those tried, by the memory model of sharding: a rank's state), or, once
    no strategy fits its micro-batch, the most sharded one at the next smaller batch (what a
    user does next). Returns whether one was queued."""
    domain = space.searched.get("sharding")
    if not isinstance(domain, Choices) or snap.baseline is not None:
        return False
    ran = [r for r in snap.records if r.is_baseline]
    if not ran or not all(r.status == Status.OOM or r.predicted_kind == record.Predicted.OOM
                          for r in ran):
        return False  # not run yet, or failed for another reason than memory
    last = ran[-1]
    micro = last.config.micro_batch_size
    nxt = next_strategy([r.config.sharding for r in ran if r.config.micro_batch_size == micro],
                        domain.values, None if model is None else lambda strategy: model.state(
                            space.variant(last.config, sharding=strategy)))
    if nxt is not None:
        config, then = space.variant(last.config, sharding=nxt), f"sharding {nxt}"
    else:  # no strategy fits this batch: the most sharded one at the next smaller batch
        smaller = _smaller_micro(space, last.config)
        if smaller is None:
            note(f"memory binds: the baseline fits no strategy at micro-batch {micro}, and the "
                 "space has no smaller micro-batch (add smaller sizes to micro_batch_size)")
            return False
        config = space.variant(last.config, micro_batch_size=smaller)
        then = f"micro-batch {smaller} ({last.config.sharding})"
    why = "predicted" if last.predicted else "measured"
    note(f"memory binds: the baseline does not fit {last.config.sharding} at micro-batch "
         f"{last.config.micro_batch_size} ({why}: {last.reason or 'out of memory'}); the "
         f"baseline again with {then}")
    record.queue_baseline(study, space.params_for(config))
    return True
