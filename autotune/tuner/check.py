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
from dataclasses import dataclass, field
from pathlib import Path

from autotune.errors import UsageError
from autotune.machine.hardware import Hardware, detect
from autotune.profile import Profile
from autotune.trial import launch
from autotune.trial.command import Command, parse_command
from autotune.trial.measurement import INTERRUPTED, Measurement, classify
from autotune.trial.spec import MeasureSettings, TrialSpec
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


def check_profile(profile: Profile, *, rounds: int, threshold: float,
                  trial_timeout_s: float = 600.0,
                  on_round: Callable[[int, Measurement], None] | None = None,
                  hw: Hardware | None = None, allow_workload: str | None = None,
                  allow_edited: bool = False) -> CheckResult:
    """Measure the profile's config ``rounds`` times, each in a fresh trial process."""
    workload = check_workload(profile, allow_workload, allow_edited)
    if rounds < 1:
        raise UsageError(f"--rounds must be >= 1, got {rounds}")
    if not 0 < threshold <= 10:
        raise UsageError(f"--threshold is a ratio to the recorded samples/sec (e.g. 0.9), got "
                         f"{threshold:g}")
    hw = hw or detect()
    check_target(profile, hw)
    result = CheckResult(recorded=profile.samples_per_sec, threshold=threshold)
    spec = TrialSpec(
        workload, profile.config, hw.device, measure_settings(profile),
        memory_limit_bytes=profile.result.get("memory_limit_bytes"))
    command = parse_command(script_command(profile)) if workload.spec == "command" else None
    if command is not None and command.untracked:
        warnings.warn(command.untracked, UntrackedWarning, stacklevel=2)
    with tempfile.TemporaryDirectory(prefix="autotune-check-") as tmp:
        for r in range(rounds):
            workdir = Path(tmp) / str(r + 1)
            if command is not None:  # the script, loading this profile, as it was tuned
                p = launch.plan_command(spec, command, workdir=workdir,
                                        timeout_s=trial_timeout_s, profile=profile.to_yaml())
            else:
                p = launch.plan(spec, workdir=workdir, timeout_s=trial_timeout_s)
            m = classify(launch.execute(p), hw.device)
            if m.ended_by == INTERRUPTED:
                raise KeyboardInterrupt
            if m.ok and m.samples_per_sec:
                result.rates.append(m.samples_per_sec)
                result.peaks.append(m.peak_memory_bytes)
            else:
                result.failures.append(f"round {r + 1}: {m.status}: {m.reason}")
            if on_round is not None:
                on_round(r, m)
    return result
