"""Reading a study's results: which trials count, the best and the baseline, and the profile
built from them. Pure functions over Optuna's frozen trials; the running lives in study.py."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.knobs import Config, env_for
from autotune.profile import Profile


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


def view(t: FrozenTrial) -> TrialView:
    a = t.user_attrs
    m = a.get("measurement", {})
    return TrialView(
        number=t.number, config=Config.from_dict(a["config"]), status=a.get("status", "error"),
        reason=a.get("reason"), samples_per_sec=m.get("samples_per_sec"),
        spread_cv=m.get("spread_cv"), peak_memory_bytes=int(m.get("peak_memory_bytes", 0)),
        breakdown=m.get("breakdown") or {}, is_baseline=bool(a.get("baseline")),
        wall_s=float(m.get("wall_s", 0.0)), overhead_share=a.get("overhead_share"),
        reused_from=a.get("reused_from"), tflops=m.get("tflops"))


def recorded(study: optuna.Study) -> list[FrozenTrial]:
    """Trials that ran to an outcome in this study (not waiting, running or interrupted)."""
    return [t for t in study.get_trials(deepcopy=False)
            if t.state.is_finished() and "status" in t.user_attrs
            and not t.user_attrs.get("interrupted")]


def measured(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    """Recorded trials that ran a process; repeats of a measured config reuse its outcome."""
    return [t for t in trials if t.user_attrs.get("reused_from") is None]


def pick_best(trials: list[FrozenTrial], limit: int) -> FrozenTrial | None:
    """The fastest ok trial whose peak memory stayed within ``limit``."""
    ok = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("status") == "ok"
          and t.user_attrs["measurement"]["peak_memory_bytes"] <= limit]
    return max(ok, key=lambda t: t.user_attrs["measurement"]["samples_per_sec"], default=None)


def pick_baseline(trials: list[FrozenTrial]) -> FrozenTrial | None:
    base = [t for t in trials
            if t.user_attrs.get("baseline") and t.user_attrs.get("status") == "ok"]
    return base[-1] if base else None


def build_profile(study: optuna.Study, best: FrozenTrial, baseline: FrozenTrial | None,
                  trials: list[FrozenTrial], limit: int, storage: str,
                  global_batch: int | None = None) -> Profile:
    m = best.user_attrs["measurement"]
    config = Config.from_dict(best.user_attrs["config"])
    result = {
        "samples_per_sec": round(m["samples_per_sec"], 4), "spread_cv": _round(m["spread_cv"]),
        "windows": len(m["windows"]), "step_time_s": m.get("step_time_s"),
        "peak_memory_bytes": m["peak_memory_bytes"], "memory_limit_bytes": limit,
        "breakdown": {k: round(v, 4) for k, v in (m.get("breakdown") or {}).items()},
        "tflops": round(m["tflops"], 4) if m.get("tflops") else None,
        "trial": best.user_attrs.get("reused_from", best.number),
        "samples_per_optimizer_step": config.samples_per_step,
    }
    if m.get("ranks"):
        result["ranks"] = [{k: r.get(k) for k in ("rank", "samples_per_sec", "peak_memory_bytes")}
                           for r in m["ranks"]]
    base_block: dict[str, Any] = {"config": None, "samples_per_sec": None}
    speedup = None
    notes = []
    if baseline is not None:
        bm = baseline.user_attrs["measurement"]
        base_config = Config.from_dict(baseline.user_attrs["config"])
        base_block = {"config": base_config.to_dict(),
                      "samples_per_sec": round(bm["samples_per_sec"], 4),
                      "spread_cv": _round(bm["spread_cv"]),
                      "peak_memory_bytes": bm["peak_memory_bytes"], "trial": baseline.number}
        speedup = round(m["samples_per_sec"] / bm["samples_per_sec"], 3)
        if global_batch is None and config.samples_per_step != base_config.samples_per_step:
            notes.append(f"effective batch changed from {base_config.samples_per_step} to "
                         f"{config.samples_per_step} samples per optimizer step; scale the "
                         "learning rate and schedule accordingly")
    else:
        notes.append("the baseline has not been measured yet: no speedup is claimed")
    if global_batch is not None:
        notes.append(f"global batch kept at {global_batch} samples per optimizer step "
                     f"(--global-batch): {config.micro_batch_size} per micro-batch x "
                     f"{config.grad_accum_steps} accumulation step(s) x {config.world_size} "
                     "rank(s); the training semantics are unchanged")
    return Profile(
        workload=dict(study.user_attrs["workload"]),
        config=config, env=env_for(config), result=result, baseline=base_block, speedup=speedup,
        fingerprint=study.user_attrs["fingerprint"],
        provenance={"study": study.study_name, "storage": storage,
                    "trials": len(measured(trials)), "global_batch": global_batch,
                    "repeats_reused": len(trials) - len(measured(trials)),
                    "created": datetime.now(UTC).isoformat(timespec="seconds"),
                    "autotune_version": study.user_attrs["fingerprint"].get("autotune_version")},
        notes=notes)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
