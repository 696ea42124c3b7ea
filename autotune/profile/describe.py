"""A profile in words: its summary for ``autotune profile show``, and what differs between two
profiles or two fingerprints (``autotune profile diff``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from autotune.config.knobs import TUNED_ENV, Config

if TYPE_CHECKING:
    from autotune.profile.schema import Profile


def summary(p: Profile) -> str:
    """A few lines for a human: what was tuned, what it measured, against what, where."""
    from autotune.machine.hardware import describe_fingerprint

    c, fp = p.config, p.fingerprint
    params = p.workload.get("params") or {}
    lines = [f"workload   {p.workload.get('name')}" + (f" {params}" if params else ""),
             f"config     {c.describe()}",
             f"batch      {c.micro_batch_size} per micro-batch x {c.grad_accum_steps} "
             f"accumulation x {c.world_size} rank(s) = {c.samples_per_step} samples per "
             "optimizer step",
             *_measured(p)]
    lines += [f"limit      {d.get('text')}" for d in p.diagnosis]
    lines.append("env        " + (" ".join(f"{k}={v}" for k, v in p.env.items()
                                           if k in TUNED_ENV) or "(none)"))
    if p.foreign_env():
        lines.append("env        NOT APPLIED (autotune tunes only "
                     f"{', '.join(TUNED_ENV)}; apply_env and launch refuse this profile): "
                     + " ".join(repr(f"{k}={v}") for k, v in p.env.items()
                                if k not in TUNED_ENV))
    lines.append(f"tuned on   {describe_fingerprint(fp)}, torch {fp.get('torch_version')}, "
                 f"{p.provenance.get('created')}, study {p.provenance.get('study')}")
    lines += [f"note       {n}" for n in p.notes]
    lines += [f"REFUSED    here: {why}" for why in p.refused_here()]
    return "\n".join(lines)


def _measured(p: Profile) -> list[str]:
    """The summary's figures: samples/s and how, memory, the baseline, MFU."""
    from autotune.units import format_bytes

    r, base = p.result, p.baseline
    spread_cv = r.get("spread_cv")
    spread = f", spread {100 * spread_cv:.1f}%" if spread_cv is not None else ""
    how = (f"median of {p.confirmation['rounds']} interleaved rounds" if p.confirmation
           else "one search trial")
    lines = [f"measured   {p.samples_per_sec:,.2f} samples/s{spread} ({how})"]
    peak, limit = r.get("peak_memory_bytes"), r.get("memory_limit_bytes")
    if peak:
        lines.append(f"memory     peak {format_bytes(peak)}"
                     + (f" of a {format_bytes(limit)} limit" if limit else ""))
    base_rate, base_config = base.get("samples_per_sec"), base.get("config")
    if base_rate and base_config:
        speedup = f"; speedup {p.speedup:g}x{interval_words(p)}" if p.speedup else ""
        lines.append(f"baseline   {Config.from_dict(base_config).describe()}: "
                     f"{base_rate:,.2f} samples/s{speedup}")
    mfu = r.get("mfu")
    if mfu is not None:
        lines.append(f"MFU        {100 * mfu:.1f}%: {r.get('tflops'):g} TFLOP/s achieved, "
                     f"measured peak {r.get('peak_tflops'):g} TFLOP/s per device; "
                     f"{r.get('flops_per_sample'):.3g} FLOPs/sample ({r.get('flops_source')})")
    return lines


def interval_words(p: Profile) -> str:
    """' (2.02-2.57x, 90% interval)' where the profile states its speedup's interval."""
    iv = p.speedup_interval
    if not iv or not _number(iv.get("low")) or not _number(iv.get("high")):
        return ""
    level = iv.get("level")
    of = f", {100 * level:.0f}% interval" if level is not None and _number(level) else ""
    return f" ({iv['low']:.2f}-{iv['high']:.2f}x{of})"


def _number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def fingerprint_diff(a: Mapping[str, object], b: Mapping[str, object]) -> list[str]:
    """Human lines for each fingerprint field that differs (``field: A vs B here``)."""
    return [f"{k}: {a.get(k)!r} vs {b.get(k)!r} here" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


def profile_diff(a: Profile, b: Profile) -> list[str]:
    """What differs between two profiles: workload, config, env, results and fingerprint, one
    line each (``field: A -> B``); empty when they agree on all of these."""
    lines: list[str] = []

    def compare(prefix: str, x: Mapping[str, object], y: Mapping[str, object]) -> None:
        lines.extend(f"{prefix}{k}: {x.get(k)!r} -> {y.get(k)!r}" for k in sorted(set(x) | set(y))
                     if x.get(k) != y.get(k))

    compare("workload.", a.workload, b.workload)
    compare("config.", a.config.to_dict(), b.config.to_dict())
    compare("env.", a.env, b.env)
    for key in ("samples_per_sec", "spread_cv", "peak_memory_bytes", "memory_limit_bytes"):
        compare("result.", {key: a.result.get(key)}, {key: b.result.get(key)})
    compare("", {"speedup": a.speedup}, {"speedup": b.speedup})
    compare("", {"speedup_interval": a.speedup_interval}, {"speedup_interval": b.speedup_interval})
    compare("fingerprint.", a.fingerprint, b.fingerprint)
    return lines
