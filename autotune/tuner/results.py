"""Reading a study's results: which trials count, the best and the baseline, and the profile
built from them. Pure functions over Optuna's frozen trials (and ``list_studies``, which
reads a storage through ``storage.py``); the running lives in runner.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.config.knobs import Config, env_for
from autotune.machine.probe import peak_for
from autotune.profile import Profile
from autotune.tuner.diagnosis import Finding, MemoryWall, config_key, diagnose, mfu
from autotune.tuner.search import NO_WIN, Observation


@dataclass(frozen=True)
class TrialView:
    """A finished trial as the reporters and the profile see it."""

    number: int
    config: Config
    status: str
    reason: str | None
    samples_per_sec: float | None
    spread_cv: float | None
    peak_memory_bytes: int
    breakdown: dict[str, float]
    is_baseline: bool
    wall_s: float
    overhead_share: float | None
    reused_from: int | None = None
    tflops: float | None = None
    predicted: bool = False  # ruled out by the memory or step-time model: nothing ran
    stage: str | None = None  # why the search proposed it, when it was not the sampler
    mfu: float | None = None  # achieved FLOP/s over the probe's measured peak
    gpu_util: float | None = None  # mean GPU utilisation over the timed windows (GPUs, NVML)
    # What the models predicted before it ran: {"step": StepPrediction.to_dict() or None,
    # "peak_memory_bytes": ... or None, "max_seconds": its measuring budget}; {} when none.
    forecast: dict[str, Any] = field(default_factory=dict)
    step_s: float | None = None  # measured seconds per optimizer step (samples/step / rate)
    predicted_kind: str | None = None  # "oom" or "too_slow" when ruled out without running
    compile_s: float | None = None  # a compiled trial's compiling, beyond a steady step


def view(t: FrozenTrial) -> TrialView:
    a = t.user_attrs
    m = a.get("measurement", {})
    return TrialView(
        number=t.number, config=Config.from_dict(a["config"]), status=a.get("status", "error"),
        reason=a.get("reason"), samples_per_sec=m.get("samples_per_sec"),
        spread_cv=m.get("spread_cv"), peak_memory_bytes=int(m.get("peak_memory_bytes", 0)),
        breakdown=m.get("breakdown") or {}, is_baseline=bool(a.get("baseline")),
        wall_s=float(m.get("wall_s", 0.0)), overhead_share=a.get("overhead_share"),
        reused_from=a.get("reused_from"), tflops=m.get("tflops"),
        predicted=bool(a.get("predicted")), stage=a.get("stage"), mfu=m.get("mfu"),
        gpu_util=(m.get("gpu") or {}).get("gpu_util_mean"), forecast=a.get("forecast") or (
            {"peak_memory_bytes": m.get("predicted_peak_memory_bytes")} if a.get("predicted")
            else {}),
        step_s=_step_s(m, a["config"]),
        predicted_kind=a.get("predicted_kind", "oom") if a.get("predicted") else None,
        compile_s=(m.get("compile") or {}).get("seconds"))


def _step_s(m: dict[str, Any], config: dict[str, Any]) -> float | None:
    """Seconds per optimizer step a trial measured (or, ruled out, was predicted to take)."""
    if m.get("predicted_step_s"):
        return float(m["predicted_step_s"])
    rate = m.get("samples_per_sec")
    return Config.from_dict(config).samples_per_step / rate if rate else None


def recorded(study: optuna.Study) -> list[FrozenTrial]:
    """Trials that ran to an outcome in this study (not waiting, running or interrupted)."""
    return [t for t in study.get_trials(deepcopy=False)
            if t.state.is_finished() and "status" in t.user_attrs
            and not t.user_attrs.get("interrupted")]


def measured(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    """Recorded trials that ran a process; repeats of a measured config reuse its outcome, and
    configs the memory model ruled out did not run."""
    return [t for t in trials if t.user_attrs.get("reused_from") is None
            and not t.user_attrs.get("predicted")]


def observations(trials: list[FrozenTrial]) -> list[Observation]:
    """What the search reads of the study: one observation per trial that ran or was ruled
    out (repeats of a config add nothing), in trial order."""
    out = []
    for t in trials:
        a = t.user_attrs
        if a.get("reused_from") is not None:
            continue
        m = a.get("measurement") or {}
        out.append(Observation(
            config=Config.from_dict(a["config"]), status=a.get("status", "error"),
            samples_per_sec=m.get("samples_per_sec"),
            peak_memory_bytes=int(m.get("peak_memory_bytes") or 0),
            spread_cv=m.get("spread_cv"), predicted=bool(a.get("predicted")), number=t.number))
    return out


def startup_of(t: FrozenTrial) -> float | None:
    """What a trial cost besides its warm-up and windows (process start, imports, build, FLOPs
    counting, exit): its wall time less its measuring time; None when it did not say."""
    m = t.user_attrs.get("measurement") or {}
    timings = m.get("timings") or {}
    if "measure_s" not in timings:
        return None
    # Compiling is not start-up: only compiled configs pay it (``compile_costs``).
    measuring = float(timings.get("warmup_s", 0.0)) + float(timings["measure_s"]) + float(
        timings.get("compile_step_s", 0.0))
    return max(float(m.get("wall_s") or 0.0) - measuring, 0.0)


def compile_costs(trials: list[FrozenTrial]) -> list[float]:
    """Seconds of each measured trial's compiling step (compiled configs only)."""
    found = ((t.user_attrs.get("measurement") or {}).get("timings", {}).get("compile_step_s")
             for t in measured(trials))
    return [float(s) for s in found if isinstance(s, int | float)]


def startup_costs(trials: list[FrozenTrial]) -> list[float]:
    """The start-up of each trial that ran to an ok result (``startup_of``)."""
    found = (startup_of(t) for t in measured(trials) if t.user_attrs.get("status") == "ok")
    return [s for s in found if s is not None]


def shortest_useful_trial(trials: list[FrozenTrial]) -> float:
    """Starting a trial with less time left than half the typical ok trial wastes the time."""
    walls = sorted(t.user_attrs["measurement"]["wall_s"] for t in trials
                   if t.user_attrs.get("status") == "ok"
                   and t.user_attrs.get("reused_from") is None)
    return max(5.0, 0.5 * walls[len(walls) // 2]) if walls else 5.0


def diagnose_trial(study: optuna.Study, trials: list[FrozenTrial], t: FrozenTrial,
                   limit: int) -> list[Finding]:
    """What limits trial ``t``'s config, from its stored measurement (with the MFU the tuner
    computed), the study's probe and what the study measured around it."""
    config = Config.from_dict(t.user_attrs["config"])
    return diagnose(t.user_attrs["measurement"], config,
                    device=study.user_attrs["fingerprint"].get("device", "cpu"), limit=limit,
                    probe=study.user_attrs.get("probe"),
                    larger_over_limit=larger_over_limit(trials, config, limit),
                    tried=tried(trials), unapplied=study.user_attrs.get("unapplied"))


def pick_best(trials: list[FrozenTrial], limit: int) -> FrozenTrial | None:
    """The fastest ok trial whose peak memory stayed within ``limit``."""
    ok = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("status") == "ok"
          and t.user_attrs["measurement"]["peak_memory_bytes"] <= limit]
    return max(ok, key=lambda t: t.user_attrs["measurement"]["samples_per_sec"], default=None)


def pick_baseline(trials: list[FrozenTrial]) -> FrozenTrial | None:
    base = [t for t in trials
            if t.user_attrs.get("baseline") and t.user_attrs.get("status") == "ok"]
    return base[-1] if base else None


def confirmed(study: optuna.Study, trials: list[FrozenTrial]) -> dict[str, Any] | None:
    """The study's confirmation, when it covers the trials recorded now (a resumed run that
    added trials must confirm again) and picked a winner."""
    conf = study.user_attrs.get("confirmation")
    if not conf or conf.get("measured_trials") != len(measured(trials)):
        return None
    return conf if conf.get("decision", {}).get("winner_trial") is not None else None


def confirmed_winner(study: optuna.Study, trials: list[FrozenTrial],
                     limit: int) -> FrozenTrial | None:
    """The confirmation's winner, else the fastest trial within the limit."""
    conf = confirmed(study, trials)
    if conf is not None:
        number = conf["decision"]["winner_trial"]
        for t in trials:
            if t.number == number:
                return t
    return pick_best(trials, limit)


def build_profile(study: optuna.Study, best: FrozenTrial, baseline: FrozenTrial | None,
                  trials: list[FrozenTrial], limit: int, storage: str,
                  global_batch: int | None = None,
                  confirmation: dict[str, Any] | None = None) -> Profile:
    """The profile of ``best``: its result (the confirmation's figures when it ran), the
    baseline it beat, the speedup, notes on how both were measured, MFU and the diagnosis."""
    m = best.user_attrs["measurement"]
    config = Config.from_dict(best.user_attrs["config"])
    result = _result_block(best, config, trials, limit)
    base_block, speedup, notes = _baseline_block(baseline, m, config, global_batch)
    if confirmation is not None:
        confirmed_speedup = _confirmed(result, base_block, best, confirmation, notes)
        speedup = confirmed_speedup or speedup
    else:
        notes.append("not confirmed by an interleaved re-measurement: the samples/sec are the "
                     "search trial's own")
        if speedup is not None and baseline is not None and (
                m.get("spread_cv") is None
                or baseline.user_attrs["measurement"].get("spread_cv") is None):
            notes.append(f"no speedup claimed: {speedup:.2f}x comes from a single timed window "
                         "(spread unknown)")
            speedup = None
    notes += [f"not searched: {why}" for why in
              (study.user_attrs.get("unapplied") or {}).values()]
    if global_batch is not None:
        notes.append(f"global batch kept at {global_batch} samples per optimizer step "
                     f"(--global-batch): {config.micro_batch_size} per micro-batch x "
                     f"{config.grad_accum_steps} accumulation step(s) x {config.world_size} "
                     "rank(s); the training semantics are unchanged")
    device = study.user_attrs["fingerprint"].get("device", "cpu")
    probe = study.user_attrs.get("probe")
    _efficiency(result, config, m, device, probe)
    if baseline is not None:
        _efficiency(base_block, Config.from_dict(baseline.user_attrs["config"]),
                    baseline.user_attrs["measurement"], device, probe)
    findings = diagnose({**m, "mfu": result.get("mfu"), "peak_tflops": result.get("peak_tflops")},
                        config, device=device, limit=limit, probe=probe,
                        larger_over_limit=larger_over_limit(trials, config, limit),
                        tried=tried(trials), unapplied=study.user_attrs.get("unapplied"))
    return Profile(
        workload=dict(study.user_attrs["workload"]),
        config=config, env=env_for(config), result=result, baseline=base_block, speedup=speedup,
        probe=probe, diagnosis=[f.to_dict() for f in findings],
        fingerprint=study.user_attrs["fingerprint"],
        provenance={"study": study.study_name, "storage": storage,
                    "trials": len(measured(trials)), "global_batch": global_batch,
                    "repeats_reused": len(trials) - len(measured(trials)),
                    "created": datetime.now(UTC).isoformat(timespec="seconds"),
                    "autotune_version": study.user_attrs["fingerprint"].get("autotune_version")},
        notes=notes, confirmation=confirmation)


def _result_block(best: FrozenTrial, config: Config, trials: list[FrozenTrial],
                  limit: int) -> dict[str, Any]:
    """The winner's search-trial figures, and how they were measured (so `autotune profile
    check` measures them again the same way)."""
    m = best.user_attrs["measurement"]
    result = {
        "samples_per_sec": round(m["samples_per_sec"], 4), "spread_cv": _round(m["spread_cv"]),
        "windows": len(m["windows"]), "step_time_s": m.get("step_time_s"),
        "peak_memory_bytes": m["peak_memory_bytes"], "memory_limit_bytes": limit,
        "breakdown": {k: round(v, 4) for k, v in (m.get("breakdown") or {}).items()},
        "tflops": round(m["tflops"], 4) if m.get("tflops") else None,
        "trial": best.user_attrs.get("reused_from", best.number),
        "samples_per_optimizer_step": config.samples_per_step,
    }
    source = next((t for t in trials if t.number == result["trial"]), best)
    measure = dict(source.user_attrs.get("measure_settings") or {})
    # A measuring budget its steps needed ("remeasured": studies of autotune 0.x before the
    # step-time model, which measured a too-slow config again with a longer budget).
    if source.user_attrs.get("budget"):
        measure.update(source.user_attrs["budget"])
    elif source.user_attrs.get("remeasured"):
        measure["max_seconds"] = source.user_attrs["remeasured"]["max_seconds"]
    result["measure"] = measure
    if m.get("ranks"):
        result["ranks"] = [{k: r.get(k) for k in ("rank", "samples_per_sec", "peak_memory_bytes")}
                           for r in m["ranks"]]
    if m.get("applied"):
        result["applied"] = m["applied"]
    payback = compile_payback(trials, best)
    if payback is not None:
        result["compile"] = payback
    return result


def compile_payback(trials: list[FrozenTrial], t: FrozenTrial) -> dict[str, Any] | None:
    """For a compiled trial: what compiling cost, and after how many optimizer steps it pays
    for itself against the same config run eagerly, when the study measured that one (None
    for a trial that did not compile)."""
    m = t.user_attrs.get("measurement") or {}
    compiled = m.get("compile") or {}
    if not compiled or not m.get("samples_per_sec"):
        return None
    config = Config.from_dict(t.user_attrs["config"])
    # The longest compile of this config in the study: a later trial of it may have found
    # its graphs in the shared cache.
    same = [(e.user_attrs.get("measurement") or {}).get("compile") or {} for e in
            measured(trials) if e.user_attrs.get("config") == t.user_attrs["config"]]
    compiled = max([compiled, *same], key=lambda c: float(c.get("seconds") or 0.0))
    eager_key = config_key(replace(config, compile="off"))
    eager = next((e for e in measured(trials) if e.user_attrs.get("status") == "ok"
                  and config_key(Config.from_dict(e.user_attrs["config"])) == eager_key), None)
    out: dict[str, Any] = {"mode": compiled.get("mode"),
                           "seconds": round(float(compiled.get("seconds", 0.0)), 2)}
    if eager is not None:
        step_on = config.samples_per_step / float(m["samples_per_sec"])
        step_off = config.samples_per_step / float(eager.user_attrs["measurement"]
                                                   ["samples_per_sec"])
        saved = step_off - step_on
        out.update(against_trial=eager.number, step_s=round(step_on, 4),
                   eager_step_s=round(step_off, 4),
                   payback_steps=math.ceil(round(out["seconds"] / saved, 6))
                   if saved > 0 else None)
    return out


def payback_words(payback: dict[str, Any]) -> str:
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


def _baseline_block(baseline: FrozenTrial | None, m: dict[str, Any], config: Config,
                    global_batch: int | None) -> tuple[dict[str, Any], float | None, list[str]]:
    """The baseline's figures, the trials' own speedup, and the notes they call for."""
    if baseline is None:
        return ({"config": None, "samples_per_sec": None}, None,
                ["the baseline has not been measured yet: no speedup is claimed"])
    bm = baseline.user_attrs["measurement"]
    base_config = Config.from_dict(baseline.user_attrs["config"])
    block = {"config": base_config.to_dict(), "samples_per_sec": round(bm["samples_per_sec"], 4),
             "spread_cv": _round(bm["spread_cv"]), "peak_memory_bytes": bm["peak_memory_bytes"],
             "trial": baseline.number}
    notes = []
    if global_batch is None and config.samples_per_step != base_config.samples_per_step:
        notes.append(f"effective batch changed from {base_config.samples_per_step} to "
                     f"{config.samples_per_step} samples per optimizer step; scale the "
                     "learning rate and schedule accordingly")
    return block, round(m["samples_per_sec"] / bm["samples_per_sec"], 3), notes


def _confirmed(result: dict[str, Any], base_block: dict[str, Any], best: FrozenTrial,
               confirmation: dict[str, Any], notes: list[str]) -> float | None:
    """Put the confirmation's figures in the result and baseline blocks; returns the side-by-
    side speedup when the baseline ran in it."""
    by_trial = {c["trial"]: c for c in confirmation["candidates"]}
    win = by_trial.get(best.number)
    base = next((c for c in confirmation["candidates"] if c["baseline"]), None)
    speedup = None
    if win is not None and win["median"]:
        result["trial_samples_per_sec"] = result["samples_per_sec"]
        result["samples_per_sec"] = win["median"]
        result["measure"] = dict(win.get("measure") or confirmation["measure"])
        result["spread_cv"] = win["spread_cv"]
        result["peak_memory_bytes"] = max(result["peak_memory_bytes"], win["peak_memory_bytes"])
        if base is not None and base["median"]:
            base_block["samples_per_sec"] = base["median"]
            base_block["spread_cv"] = base["spread_cv"]
            speedup = round(win["median"] / base["median"], 3)
            notes.append(f"speedup measured side by side: {confirmation['rounds']} "
                         "interleaved rounds of the top configs and the baseline")
    d = confirmation["decision"]
    if d["decided_by"] == NO_WIN:
        runner = by_trial.get(d.get("runner_up_trial"))
        lead = (f" (the best, trial {runner['trial']}, measured {runner['median']:.4g} against "
                f"{base['median']:.4g} samples/s)" if runner and base and runner["median"]
                and base["median"] else "")
        notes.append(f"no config beat the baseline by more than the measured noise (margin "
                     f"{100 * d['margin']:.1f}%){lead}: the baseline's settings are kept")
        return 1.0
    notes.append(f"winner decided by {d['decided_by']} (margin {100 * d['margin']:.1f}%, "
                 "twice the pooled spread of the top two)")
    return speedup


def _efficiency(block: dict[str, Any], config: Config, m: dict[str, Any], device: str,
                probe: dict[str, Any] | None) -> None:
    """FLOPs per sample, achieved TFLOP/s and MFU of a profile's result or baseline block, at
    its (possibly confirmed) samples/s."""
    fps, rate = m.get("flops_per_sample"), block.get("samples_per_sec")
    peak = peak_for(probe, config.amp, device)
    share = mfu(rate, fps, peak, config.world_size, device)
    block.update(flops_per_sample=fps, flops_source=m.get("flops_source"),
                 tflops=round(rate * fps / 1e12, 4) if rate and fps else None,
                 mfu=None if share is None else round(share, 4), peak_tflops=peak)


def tried(trials: list[FrozenTrial]) -> dict[str, dict[str, Any]]:
    """What the study measured, by config (``diagnosis.config_key``): the trial, its outcome
    and samples/sec; ruled-out configs did not run and are not here."""
    out: dict[str, dict[str, Any]] = {}
    for t in measured(trials):
        a = t.user_attrs
        rate = (a.get("measurement") or {}).get("samples_per_sec") if a.get("status") == "ok" \
            else None
        out.setdefault(config_key(Config.from_dict(a["config"])), {
            "trial": t.number, "status": a.get("status"), "samples_per_sec": rate})
    return out


def larger_over_limit(trials: list[FrozenTrial], config: Config,
                      limit: int) -> MemoryWall | None:
    """The smallest micro-batch above ``config``'s, in the same precision and ranks, that ran
    out of memory or passed the limit (measured), or that the memory model ruled out
    (predicted): the memory wall the config stands at. None when there is none, or when a
    micro-batch between the two ran within the limit: then throughput had already stopped
    growing with the batch before the wall (the config beat that larger batch), and memory is
    not what limits it. A config too slow to measure is no evidence about memory."""
    over, fits = [], []
    for t in trials:
        a = t.user_attrs
        c = Config.from_dict(a["config"])
        if c.amp != config.amp or c.world_size != config.world_size \
                or c.micro_batch_size <= config.micro_batch_size:
            continue
        m = a.get("measurement") or {}
        predicted = bool(a.get("predicted"))
        if predicted and a.get("predicted_kind", "oom") == "oom":
            over.append((c.micro_batch_size, False, a.get("reused_from", t.number)))
        elif not predicted and (a.get("status") == "oom"
                                or int(m.get("peak_memory_bytes") or 0) > limit):
            over.append((c.micro_batch_size, True, a.get("reused_from", t.number)))
        elif a.get("status") == "ok":
            fits.append(c.micro_batch_size)
    if not over:
        return None
    # The smallest wall; at one micro-batch a measured one is the stronger evidence.
    micro, measured_, number = min(over, key=lambda o: (o[0], not o[1]))
    if any(m < micro for m in fits):
        return None
    return MemoryWall(number, micro, measured_)


def _rate(t: FrozenTrial) -> float:
    return float(t.user_attrs["measurement"]["samples_per_sec"])


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def list_studies(storage_url: str) -> list[dict[str, Any]]:
    """One row per study of an existing storage: measured trials, best samples/sec, speedup
    (the trials' own figures, or the confirmation's winner), last activity."""
    from autotune.tuner.storage import all_studies

    rows = []
    for study, summary in all_studies(storage_url):
        trials = recorded(study)
        limit = int(study.user_attrs.get("memory_limit_bytes") or 0)
        best, base = confirmed_winner(study, trials, limit), pick_baseline(trials)
        times = [t.datetime_complete or t.datetime_start for t in study.trials]
        stamps = [t for t in times if t is not None]
        rows.append({
            "study": summary.study_name, "trials": len(measured(trials)),
            "best_samples_per_sec": _rate(best) if best else None,
            "speedup": _rate(best) / _rate(base) if best and base else None,
            "last_activity": max(stamps) if stamps else summary.datetime_start})
    return rows
