"""The profile a study exports, and the diagnosis it carries: built from a ``StudySnapshot``
(pure), and written in one place (``write_profile``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import optuna

from autotune.config.knobs import Config, env_for
from autotune.machine.probe import peak_for
from autotune.profile import Profile
from autotune.profile.documents import (
    BaselineDoc,
    CompileDoc,
    EfficiencyDoc,
    RankDoc,
    ResultDoc,
)
from autotune.trial.measurement import Measurement
from autotune.tuner import record
from autotune.tuner.diagnosis import Finding, diagnose, mfu
from autotune.tuner.record import TrialRecord
from autotune.tuner.sharding import ShardingModel, with_strategies
from autotune.tuner.snapshot import StudySnapshot


def diagnose_record(snap: StudySnapshot, r: TrialRecord,
                    measurement: Measurement | None = None) -> list[Finding]:
    """What limits trial ``r``'s config, from its measurement (with the MFU the tuner
    computed; ``measurement``: the same with the profile's figures), the study's probe and
    what the study measured around it."""
    found = diagnose(measurement or r.measurement, r.config, device=snap.facts.device,
                     limit=snap.limit,
                     probe=snap.facts.probe or None,
                     larger_over_limit=snap.larger_over_limit(r.config), tried=snap.tried(),
                     unapplied=snap.facts.unapplied)
    size = snap.facts.model_size
    if size is None or r.config.world_size < 2:
        return found
    # With several ranks and a sized model: what each sharding strategy would hold.
    model = ShardingModel(size, snap.observations, snap.facts.device, r.config.world_size)
    return [Finding(f.kind, *with_strategies(f.kind, f.text, f.evidence, r.config, model,
                                             snap.observations)) for f in found]


@dataclass(frozen=True)
class Efficiency:
    """FLOPs per sample, achieved TFLOP/s and MFU at a (possibly confirmed) samples/s."""

    flops_per_sample: float | None
    flops_source: str | None
    tflops: float | None
    mfu: float | None
    peak_tflops: float | None

    def block(self) -> EfficiencyDoc:
        return {"flops_per_sample": self.flops_per_sample, "flops_source": self.flops_source,
                "tflops": self.tflops, "mfu": self.mfu, "peak_tflops": self.peak_tflops}


def efficiency(snap: StudySnapshot, r: TrialRecord, rate: float | None) -> Efficiency:
    """``r``'s efficiency at ``rate`` samples/s: its own, or the confirmation's. The one MFU
    the profile, the diagnosis and the dashboard show."""
    fps = r.measurement.flops_per_sample
    peak = peak_for(snap.facts.probe or None, r.config.amp, snap.facts.device)
    share = mfu(rate, fps, peak, r.config.world_size, snap.facts.device)
    return Efficiency(fps, r.measurement.flops_source,
                      round(rate * fps / 1e12, 4) if rate and fps else None,
                      None if share is None else round(share, 4), peak)


def rate_of(snap: StudySnapshot, r: TrialRecord) -> float | None:
    """``r``'s samples/s as the profile states it: the confirmation's median when ``r`` ran
    in it, else its search trial's."""
    conf = snap.confirmation
    mine = conf.of(r.number) if conf is not None else None
    return mine.median if mine is not None and mine.median else r.samples_per_sec


def build_profile(snap: StudySnapshot, storage: str,
                  global_batch: int | None = None) -> Profile | None:
    """The profile of the study's winner: its result (the confirmation's figures when it
    covers the study), the baseline it beat, the speedup (which kind), notes on how both were
    measured, MFU and the diagnosis; None when nothing has been measured ok yet."""
    best, baseline, conf = snap.winner, snap.baseline, snap.confirmation
    if best is None:
        return None
    config = best.config
    result = _result_block(snap, best)
    base_block, notes = _baseline_block(baseline, config, global_batch)
    speedup = snap.speedup
    if conf is not None:
        _confirmed(snap, result, base_block, best, notes)
    else:
        notes.append("not confirmed by an interleaved re-measurement: the samples/sec are the "
                     "search trial's own")
        if speedup is None and baseline is not None:
            ratio = (best.samples_per_sec or 0.0) / (baseline.samples_per_sec or 1e-12)
            notes.append(f"no speedup claimed: {ratio:.2f}x comes from a single timed window "
                         "(spread unknown)")
    notes += [f"not searched: {why}" for why in (snap.facts.unapplied or {}).values()]
    if global_batch is not None:
        notes.append(f"global batch kept at {global_batch} samples per optimizer step "
                     f"(--global-batch): {config.micro_batch_size} per micro-batch x "
                     f"{config.grad_accum_steps} accumulation step(s) x {config.world_size} "
                     "rank(s); the training semantics are unchanged")
    eff = efficiency(snap, best, result["samples_per_sec"])
    result.update(eff.block())
    if baseline is not None:
        base_block.update(efficiency(snap, baseline, base_block.get("samples_per_sec")).block())
    findings = diagnose_record(snap, best, replace(best.measurement, mfu=eff.mfu,
                                                   peak_tflops=eff.peak_tflops))
    fingerprint = dict(snap.facts.fingerprint)
    return Profile(
        workload=dict(snap.facts.workload), config=config, env=env_for(config), result=result,
        baseline=base_block, speedup=None if speedup is None else speedup.value,
        speedup_interval=speedup.interval.to_doc(bool(speedup.machine_changed))
        if speedup is not None and speedup.interval is not None else None,
        probe=snap.facts.probe, diagnosis=[f.to_doc() for f in findings],
        fingerprint=fingerprint,
        provenance={"study": snap.name, "storage": storage, "trials": len(snap.measured),
                    "global_batch": global_batch,
                    "repeats_reused": len(snap.records) - len(snap.measured),
                    "created": datetime.now(UTC).isoformat(timespec="seconds"),
                    "autotune_version": fingerprint.get("autotune_version")},
        notes=notes, confirmation=conf.to_doc() if conf is not None else None)


def _result_block(snap: StudySnapshot, best: TrialRecord) -> ResultDoc:
    """The winner's search-trial figures, and how they were measured (so `autotune profile
    check` measures them again the same way)."""
    m, config = best.measurement, best.config
    result: ResultDoc = {
        "samples_per_sec": round(m.samples_per_sec or 0.0, 4), "spread_cv": _round(m.spread_cv),
        "windows": len(m.windows), "step_time_s": m.step_time_s,
        "peak_memory_bytes": m.peak_memory_bytes, "memory_limit_bytes": snap.limit,
        "breakdown": {k: round(v, 4) for k, v in (m.breakdown or {}).items()},
        "tflops": round(m.tflops, 4) if m.tflops else None,
        "trial": best.source, "samples_per_optimizer_step": config.samples_per_step,
    }
    source = snap.trial(best.source) or best
    # How it was measured: the search's settings, with any longer budget its steps needed.
    result["measure"] = {**source.measure_settings, **source.budget}
    if m.ranks:
        result["ranks"] = [RankDoc(rank=int(r.get("rank") or 0),
                                   samples_per_sec=r.get("samples_per_sec"),
                                   peak_memory_bytes=r.get("peak_memory_bytes"))
                           for r in m.ranks]
    if m.applied:
        result["applied"] = dict(m.applied)
    if m.tokens_per_sample:
        result["tokens_per_sample"] = m.tokens_per_sample
    payback = compile_payback(snap, best)
    if payback is not None:
        result["compile"] = payback
    return result


def compile_payback(snap: StudySnapshot, r: TrialRecord) -> CompileDoc | None:
    """For a compiled trial: what compiling cost, and after how many optimizer steps it pays
    for itself against the same config run eagerly, when the study measured that one (None
    for a trial that did not compile)."""
    compiled = r.measurement.compile or {}
    if not compiled or not r.samples_per_sec:
        return None
    # The longest compile of this config in the study: a later trial of it may have found
    # its graphs in the shared cache.
    same = [e.measurement.compile or {} for e in snap.measured if e.config == r.config]
    compiled = max([compiled, *same], key=lambda c: float(c.get("seconds") or 0.0))
    eager_config = replace(r.config, compile="off")
    eager = next((e for e in snap.measured if e.ok and e.config == eager_config), None)
    out: CompileDoc = {"mode": compiled.get("mode"),
                       "seconds": round(float(compiled.get("seconds", 0.0)), 2)}
    if eager is not None and eager.step_s is not None and r.step_s is not None:
        saved = eager.step_s - r.step_s
        out["against_trial"] = eager.number
        out["step_s"] = round(r.step_s, 4)
        out["eager_step_s"] = round(eager.step_s, 4)
        out["payback_steps"] = math.ceil(round(out["seconds"] / saved, 6)) if saved > 0 else None
    return out


def payback_words(payback: CompileDoc) -> str:
    """``compile default: 38.5s, pays for itself after 120 steps (against trial 4)``. The
    seconds are what the trial paid with the study's cache, which may already have held some
    of the graphs: a first compile elsewhere can take longer."""
    head = f"compile {payback.get('mode')}: {payback.get('seconds')}s with the study's cache"
    if "against_trial" not in payback:
        return head + " (no eager run of the same config to compare)"
    steps = payback.get("payback_steps")
    if steps is None:
        return head + f", never pays: no faster than eager (trial {payback['against_trial']})"
    return head + f", pays for itself after {steps} steps (against trial " \
        f"{payback['against_trial']})"


def _baseline_block(baseline: TrialRecord | None, config: Config,
                    global_batch: int | None) -> tuple[BaselineDoc, list[str]]:
    """The baseline's figures, and the notes they call for."""
    if baseline is None:
        return ({"config": None, "samples_per_sec": None},
                ["the baseline has not been measured yet: no speedup is claimed"])
    base_config = baseline.config
    block: BaselineDoc = {"config": base_config.to_dict(),
             "samples_per_sec": round(baseline.samples_per_sec or 0.0, 4),
             "spread_cv": _round(baseline.spread_cv),
             "peak_memory_bytes": baseline.peak_memory_bytes, "trial": baseline.number}
    notes = []
    if global_batch is None and config.samples_per_step != base_config.samples_per_step:
        notes.append(f"effective batch changed from {base_config.samples_per_step} to "
                     f"{config.samples_per_step} samples per optimizer step; scale the "
                     "learning rate and schedule accordingly")
    return block, notes


def _confirmed(snap: StudySnapshot, result: ResultDoc, base_block: BaselineDoc,
               best: TrialRecord, notes: list[str]) -> None:
    """Put the confirmation's figures in the result and baseline blocks, with its notes."""
    conf = snap.confirmation
    assert conf is not None
    win, base = conf.of(best.number), conf.baseline
    if win is not None and win.median:
        result["trial_samples_per_sec"] = result["samples_per_sec"]
        result["samples_per_sec"] = win.median
        result["measure"] = dict(win.measure or conf.measure)
        result["spread_cv"] = win.spread_cv
        result["peak_memory_bytes"] = max(result["peak_memory_bytes"], win.peak_memory_bytes)
        if base is not None and base.median:
            base_block["samples_per_sec"] = base.median
            base_block["spread_cv"] = base.spread_cv
            notes.append(f"speedup measured side by side: {conf.rounds} interleaved rounds of "
                         "the top configs and the baseline")
    if conf.machine_changed:
        notes.append("the machine changed during the confirmation (the sentinel read before "
                     "each trial): " + "; ".join(conf.machine_changed) + ": the speedup's "
                     "rounds ran on a changed machine, and a re-check may differ from it by "
                     "more than its interval")
    d = conf.decision
    if conf.no_win:
        runner = conf.of(d.runner_up_trial) if d.runner_up_trial is not None else None
        lead = (f" (the best, trial {runner.trial}, measured {runner.median:.4g} against "
                f"{base.median:.4g} samples/s)" if runner and base and runner.median
                and base.median else "")
        notes.append(f"no config beat the baseline by more than the measured noise (margin "
                     f"{100 * d.margin:.1f}%){lead}: the baseline's settings are kept")
        return
    notes.append(f"winner decided by {d.decided_by} (margin {100 * d.margin:.1f}%, "
                 "twice the pooled spread of the top two)")


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def write_profile(study: optuna.Study, snap: StudySnapshot, storage: str,
                  global_batch: int | None, path: Path) -> Profile | None:
    """Write the profile of the confirmed winner, else of the best trial, of the study as
    ``snap`` read it, to ``path``; None when nothing has been measured successfully yet."""
    profile = build_profile(snap, storage, global_batch)
    if profile is None:
        return None
    profile.save(path)
    if list(snap.facts.diagnosis) != profile.diagnosis:
        record.write_diagnosis(study, profile.diagnosis)
    return profile
