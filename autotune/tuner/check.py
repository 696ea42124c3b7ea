"""`autotune profile check`: measure a profile's config again on this machine and compare.

A regression check for training infrastructure: a new torch, driver, container or data pipeline
that makes the tuned config slower (or no longer fit) fails it. Each round is a fresh trial
process, measured as the profile's figure was (its ``result.measure`` settings), under the
profile's memory limit; the median of the rounds is compared with the recorded samples/sec.
"""

from __future__ import annotations

import shlex
import statistics
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from autotune.config.knobs import Config, env_for
from autotune.errors import UsageError
from autotune.machine.hardware import Hardware, detect
from autotune.profile import Profile
from autotune.trial import launch
from autotune.trial.command import Command, parse_command
from autotune.trial.measurement import INTERRUPTED, Measurement, classify
from autotune.trial.spec import MeasureSettings, TrialSpec
from autotune.tuner.interval import Interval, paired_speedup
from autotune.workloads import WorkloadSpec, builtin_workloads


def script_command(profile: Profile) -> list[str]:
    """The command of a profile tuned by ``autotune run -- CMD``."""
    command = (profile.workload.get("params") or {}).get("command")
    if not isinstance(command, list) or not command or \
            not all(isinstance(a, str) for a in command):
        raise UsageError("the profile's workload is a command but names none: re-export it "
                         "with `autotune run`")
    return command


@dataclass
class CheckResult:
    recorded: float  # the profile's samples/sec
    threshold: float
    rates: list[float] = field(default_factory=list)  # one per ok round
    failures: list[str] = field(default_factory=list)  # "round N: status: reason"
    peaks: list[int] = field(default_factory=list)
    # The claim checked: the baseline's reading in each round (None: it failed in that round),
    # and the winner's in each round, paired with them (None where it failed).
    baseline_rates: list[float | None] = field(default_factory=list)
    baseline_failures: list[str] = field(default_factory=list)
    paired_rates: list[float | None] = field(default_factory=list)

    @property
    def speedup(self) -> tuple[float, Interval | None] | None:
        """The winner's speedup over the baseline now, from the rounds both ran in: the ratio
        of their medians, with the interval of its per-round ratios (``tuner.interval``)."""
        found = paired_speedup(self.paired_rates, self.baseline_rates)
        return None if found is None else (found[0], found[2])

    @property
    def median(self) -> float | None:
        return statistics.median(self.rates) if self.rates else None

    @property
    def ratio(self) -> float | None:
        return None if self.median is None else self.median / self.recorded

    @property
    def passed(self) -> bool:
        """Every round ran and the median is at least ``threshold`` x the recorded figure."""
        return not self.failures and self.ratio is not None and self.ratio >= self.threshold


def check_target(profile: Profile, hw: Hardware) -> None:
    """Refuse a comparison that cannot mean anything: another device type, too few GPUs, a
    value this machine cannot apply as tuned."""
    for why in profile.refused_here():
        raise UsageError(f"the profile cannot run here: {why}")
    if profile.samples_per_sec <= 0:
        raise UsageError("the profile records no measured samples/sec (result.samples_per_sec "
                         "is 0: a trial's candidate, not an exported profile); check a profile "
                         "`autotune run` exported")
    tuned = profile.fingerprint.get("device")
    if tuned and tuned != hw.device:
        raise UsageError(f"the profile was tuned on {tuned} and this machine runs trials on "
                         f"{hw.device}: a check compares like with like; run it where such a "
                         "device is")
    if hw.device == "cuda" and profile.world_size > len(hw.gpus):
        raise UsageError(f"the profile runs {profile.world_size} ranks and this machine has "
                         f"{len(hw.gpus)} GPU(s); run the check on a machine like the one it "
                         "was tuned on")


def measure_settings(profile: Profile) -> MeasureSettings:
    """How the profile's figure was measured (``result.measure``), to measure it again alike."""
    try:
        return MeasureSettings.from_dict(profile.result.get("measure"))
    except (TypeError, ValueError) as exc:
        raise UsageError(f"the profile's result.measure is not this autotune's ({exc}); "
                         "re-export the profile with this version's `autotune run`") from None


def check_workload(profile: Profile, allow: str | None,
                   allow_edited: bool = False) -> WorkloadSpec:
    """The profile's workload, when checking may run it: a built-in, or the one workload (or
    the one script's command) the command line allows by name. A profile is data; the workload
    or command it names is code. A script edited since it was tuned is another workload: refused
    unless ``allow_edited``."""
    spec = str(profile.workload.get("spec") or profile.workload.get("name") or "")
    if spec == "command":
        command = shlex.join(str(a) for a in script_command(profile))
        if allow != command:
            raise UsageError(f"the profile runs the command {command!r}: checking runs it "
                             f"again; if you trust it, pass --allow-workload "
                             f"{shlex.quote(command)} (from the directory it was tuned in)")
        params = dict(profile.workload.get("params") or {})
        if not allow_edited:
            _refuse_edited(parse_command(script_command(profile)), params)
        return WorkloadSpec(spec, params)
    if spec in builtin_workloads() or (allow is not None and allow == spec):
        return WorkloadSpec(spec, dict(profile.workload.get("params") or {}))
    raise UsageError(f"the profile names workload {spec!r}, which is not built in: checking it "
                     f"imports and runs that code; if you trust it, pass --allow-workload "
                     f"{shlex.quote(spec)}")


def _refuse_edited(command: Command, params: dict[str, object]) -> None:
    """The script the command runs must be the one that was tuned: a check of an edited
    script would PASS or FAIL another program's speed."""
    then, now = params.get("script_sha256"), command.script_sha256
    if then == now:
        return
    if not then:
        raise UsageError(f"the profile records no hash of {command.name} (tuned before "
                         "autotune recorded one): whether it changed cannot be told; pass "
                         "--allow-edited to check it as it is now")
    raise UsageError(f"{command.name} changed since the profile was tuned (sha256 "
                     f"{str(then)[:12]} then, {str(now)[:12]} now): the check would measure "
                     "another script; restore it, re-tune it, or pass --allow-edited to check "
                     "it as it is now")


class UntrackedWarning(UserWarning):
    """The profile's command is identified by less than its script (``Command.untracked``)."""


def claimed_baseline(profile: Profile) -> Profile | None:
    """The profile with its baseline's config, where the profile claims a speedup over a
    baseline it names (another config than its own): what a check of the claim measures beside
    the winner. None where there is no claim to check."""
    config = profile.baseline.get("config")
    if not profile.speedup or profile.speedup == 1.0 or not isinstance(config, dict):
        return None
    base = Config.from_dict(config)
    return None if base == profile.config else replace(profile, config=base, env=env_for(base))


def baseline_settings(profile: Profile, settings: MeasureSettings) -> MeasureSettings:
    """How the confirmation measured the baseline (its budget sized to its own steps), else as
    the winner was."""
    cands = profile.confirmation.get("candidates") or [] if profile.confirmation else []
    found = next((c.get("measure") for c in cands if isinstance(c, dict) and c.get("baseline")),
                 None)
    try:
        return MeasureSettings.from_dict(found) if found else settings
    except (TypeError, ValueError):
        return settings


def check_profile(profile: Profile, *, rounds: int, threshold: float,
                  trial_timeout_s: float = 600.0,
                  on_round: Callable[[int, Measurement, bool], None] | None = None,
                  hw: Hardware | None = None, allow_workload: str | None = None,
                  allow_edited: bool = False, claim: bool = True) -> CheckResult:
    """Measure the profile's config ``rounds`` times, each in a fresh trial process; with
    ``claim`` and a claimed speedup, its baseline too, interleaved (the first of the pair
    alternates from round to round, so neither always runs on a machine the other warmed)."""
    workload = check_workload(profile, allow_workload, allow_edited)
    if rounds < 1:
        raise UsageError(f"--rounds must be >= 1, got {rounds}")
    if not 0 < threshold <= 10:
        raise UsageError(f"--threshold is a ratio to the recorded samples/sec (e.g. 0.9), got "
                         f"{threshold:g}")
    hw = hw or detect()
    check_target(profile, hw)
    result = CheckResult(recorded=profile.samples_per_sec, threshold=threshold)
    settings = measure_settings(profile)
    command = parse_command(script_command(profile)) if workload.spec == "command" else None
    if command is not None and command.untracked:
        warnings.warn(command.untracked, UntrackedWarning, stacklevel=2)
    base = claimed_baseline(profile) if claim else None
    base_settings = baseline_settings(profile, settings)

    def measure(p: Profile, workdir: Path) -> Measurement:
        spec = TrialSpec(workload, p.config, hw.device,
                         base_settings if p is base else settings,
                         memory_limit_bytes=profile.result.get("memory_limit_bytes"))
        if command is not None:  # the script, loading this profile, as it was tuned
            plan = launch.plan_command(spec, command, workdir=workdir,
                                       timeout_s=trial_timeout_s, profile=p.to_yaml())
        else:
            plan = launch.plan(spec, workdir=workdir, timeout_s=trial_timeout_s)
        m = classify(launch.execute(plan), hw.device)
        if m.ended_by == INTERRUPTED:
            raise KeyboardInterrupt
        return m

    with tempfile.TemporaryDirectory(prefix="autotune-check-") as tmp:
        for r in range(rounds):
            order = [(profile, False)] + ([] if base is None else [(base, True)])
            for p, is_base in (order if r % 2 == 0 else order[::-1]):
                m = measure(p, Path(tmp) / f"{r + 1}{'-baseline' if is_base else ''}")
                ok = m.ok and bool(m.samples_per_sec)
                if is_base:
                    result.baseline_rates.append(m.samples_per_sec if ok else None)
                    if not ok:
                        result.baseline_failures.append(f"round {r + 1}: {m.status}: {m.reason}")
                elif ok:
                    result.rates.append(m.samples_per_sec or 0.0)
                    result.paired_rates.append(m.samples_per_sec)
                    result.peaks.append(m.peak_memory_bytes)
                else:
                    result.paired_rates.append(None)
                    result.failures.append(f"round {r + 1}: {m.status}: {m.reason}")
                if on_round is not None:
                    on_round(r, m, is_base)
    return result


def claim_lines(profile: Profile, result: CheckResult) -> list[str]:
    """What the check says of the profile's claimed speedup: the speedup now, with its
    interval, against the claim and its interval, and whether it lies inside; nothing where
    the baseline did not run beside the winner."""
    if not result.baseline_rates:
        return []
    failed = [f"baseline {f}" for f in result.baseline_failures]
    now = result.speedup
    if now is None:
        return ["speedup now: not measured (no round ran both the winner and the baseline: "
                + "; ".join(failed + result.failures) + ")"]
    value, iv = now
    within = "" if iv is None else f" ({iv.low:.2f}-{iv.high:.2f}x)"
    claimed = float(profile.speedup or 0.0)
    doc = profile.speedup_interval
    low, high = (doc.get("low"), doc.get("high")) if doc else (None, None)
    has_interval = isinstance(low, int | float) and isinstance(high, int | float)
    theirs = f" ({low:.2f}-{high:.2f}x)" if has_interval else ""
    lines = [f"speedup now {value:.2f}x{within} against {claimed:.2f}x{theirs} claimed"
             f" ({len([r for r in result.baseline_rates if r])} round(s) side by side)"]
    if has_interval and low is not None and high is not None:
        if low <= value <= high:
            lines.append("  inside the claimed interval")
        else:
            side = "below" if value < low else "above"
            lines.append(f"  {side} the claimed interval: the machine or the software is not "
                         "as it was when the claim was measured (see the profile's notes: a "
                         "machine that changed during its confirmation is named there)")
    lines += [f"  {f}" for f in failed]
    return lines
