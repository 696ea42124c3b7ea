"""`autotune profile`: read, compare and re-check profiles.

Each command loads the profile (a fingerprint mismatch is one warning line, not a traceback),
calls one function, and prints. A profile is data from elsewhere: its names and notes are shown
escaped, never sent raw to the terminal.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from autotune.errors import UsageError
from autotune.exits import Debug, guarded, parse_duration, sigterm_as_interrupt

if TYPE_CHECKING:
    from autotune.profile import Profile
    from autotune.trial.measurement import Measurement
    from autotune.tuner.check import CheckResult

profile_app = typer.Typer(no_args_is_help=True, help="Read, compare and re-check profiles.")
ProfileArg = Annotated[Path, typer.Argument(help="A profile.yaml written by `autotune run`")]


def read_profile(path: Path, check_fingerprint: bool = True) -> Profile:
    """Load a profile; a fingerprint mismatch is one warning line on stderr, not a traceback."""
    import warnings

    from autotune.paths import shown
    from autotune.profile import load_profile

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile = load_profile(path, check_fingerprint=check_fingerprint)
    for w in caught:
        typer.echo(f"autotune: warning: {shown(w.message)}", err=True)
    return profile


TrainSamples = Annotated[float | None, typer.Option(
    "--train-samples", help="Print the time to train this many samples at the profile's rate")]
TrainTokens = Annotated[float | None, typer.Option(
    "--train-tokens", help="The same in tokens (token workloads: the profile records tokens "
    "per sample)")]


@profile_app.command("show")
@guarded
def profile_show(path: ProfileArg, debug: Debug = False, hf_args: Annotated[bool, typer.Option(
        "--hf-args", help="Print the profile as Hugging Face TrainingArguments command-line "
        "flags, to paste after a Trainer script's own")] = False,
        train_samples: TrainSamples = None, train_tokens: TrainTokens = None,
        price_per_hour: Annotated[float | None, typer.Option(
            "--price-per-hour", help="With --train-samples/--train-tokens: the cost too, at "
            "this price per hour of the machine (any currency)")] = None) -> None:
    """What a profile tuned, what it measured, and where; with --train-samples N (or
    --train-tokens N), the time to train N at its rate and its interval, and with
    --price-per-hour X what that costs."""
    from autotune.machine.fingerprint import describe_fingerprint
    from autotune.paths import shown
    from autotune.tuner.costing import training_time

    profile = read_profile(path)
    if hf_args:
        typer.echo(hf_flags(profile))
        return
    time = None
    if train_samples is not None or train_tokens is not None:
        time = training_time(profile, samples=train_samples, tokens=train_tokens,
                             price_per_hour=price_per_hour)
    elif price_per_hour is not None:
        raise UsageError("--price-per-hour prices a run: give --train-samples N or "
                         "--train-tokens N with it")
    lines = [f"profile    {path}", *profile.summary().splitlines()]
    if time is not None:
        lines += time.lines(profile.world_size)
        lines.append(f"           on the machine it was measured on: "
                     f"{describe_fingerprint(profile.fingerprint)}")
    typer.echo("\n".join(shown(line) for line in lines))


@guarded
def compare_profiles(
    paths: Annotated[list[Path], typer.Argument(help="Profiles to lay side by side",
                                                exists=True, dir_okay=False)],
    train_samples: TrainSamples = None, train_tokens: TrainTokens = None,
    price_per_hour: Annotated[list[float] | None, typer.Option(
        "--price-per-hour", help="The cost too: one price for all, or one per profile in "
        "order (each machine's own)")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON document")] = False,
    debug: Debug = False,
) -> None:
    """Profiles from several machines or studies side by side: samples/s with its interval,
    MFU, memory headroom, and the time and cost to train; each labelled by its fingerprint."""
    import json

    from autotune.paths import shown
    from autotune.tuner.costing import compare, table

    if price_per_hour and train_samples is None and train_tokens is None:
        raise UsageError("--price-per-hour prices a run: give --train-samples N or "
                         "--train-tokens N with it")
    rows = compare([(shown(str(p)), read_profile(p, check_fingerprint=False)) for p in paths],
                   samples=train_samples, tokens=train_tokens, prices=price_per_hour or ())
    if json_out:
        typer.echo(json.dumps({"profiles": [r.to_doc() for r in rows]}, indent=2))
        return
    typer.echo("\n".join(table(rows)))


def hf_flags(profile: Profile) -> str:
    """The profile's TrainingArguments as command-line flags (for HfArgumentParser), quoted
    for a shell, to paste after a script's own: only the fields autotune tunes, each also at
    TrainingArguments' default (pasted after ``--bf16``, ``--bf16 False`` is what fp32 was
    measured as). Never ``--optim``: it would replace the script's optimizer class; the
    optimizer implementation and the other knobs no flag reaches are named on comment lines.
    `autotune launch` applies all of them without flags."""
    import json
    import shlex

    from autotune.integrations.hf import training_args

    flags = []
    for name, value in training_args(profile).items():
        if name == "optim":
            continue
        text = json.dumps(value) if isinstance(value, dict) else str(value)
        if name == "fsdp":  # the command line takes a strategy's name, not True
            text = profile.config.sharding.replace("-", "_")
        flags.append(f"--{name} {shlex.quote(text)}")
    lines = [" ".join(flags)]
    optimizer = _optimizer_note(profile)
    if optimizer:
        lines.append(optimizer)
    if profile.config.attention != "default":
        lines.append(f"# attention={profile.config.attention}: pass attn_implementation= where "
                     "the script builds its model; `autotune launch` sets it on the Trainer's")
    if profile.config.cpu_threads:
        lines.append(f"# cpu_threads={profile.config.cpu_threads}: OMP_NUM_THREADS="
                     f"{profile.config.cpu_threads} in the environment, or `autotune launch`")
    if profile.config.malloc_retain:
        lines.append("# malloc_retain=true: profile.apply_torch_flags() before the script builds "
                     "its model, or `autotune launch`")
    return "\n".join(lines)


def _optimizer_note(profile: Profile) -> str | None:
    """The comment line on the profile's optimizer implementation (None: it keeps the
    optimizer's own). A flag for it would be ``--optim``, which also sets the class."""
    from autotune.integrations.hf import field_defaults, optim_name

    impl = profile.config.optimizer_impl
    if impl == "default":
        return None
    if impl != "fused":
        return f"# optimizer_impl={impl}: no TrainingArguments flag sets it; `autotune launch` does"
    if optim_name(profile) == field_defaults().get("optim"):
        return ("# optimizer_impl=fused: TrainingArguments' default optim, adamw_torch_fused, "
                "is it; for your own --optim, `autotune launch` sets fused= where that "
                "optimizer takes it")
    return ("# optimizer_impl=fused: add --optim adamw_torch_fused if the script steps AdamW "
            "(not printed: it would replace your own --optim); `autotune launch` sets fused= "
            "on any optimizer that takes it")


@profile_app.command("env")
@guarded
def profile_env(path: ProfileArg, debug: Debug = False) -> None:
    """Shell `export` lines: the profile's environment and AUTOTUNE_PROFILE (for
    `eval "$(autotune profile env P)"`)."""
    import shlex

    from autotune.profile import launch_env

    for key, value in launch_env(read_profile(path), path, base={}).items():
        typer.echo(f"export {key}={shlex.quote(value)}")


@profile_app.command("diff")
@guarded
def profile_diff(a: ProfileArg, b: ProfileArg, debug: Debug = False) -> None:
    """What differs between two profiles: workload, config, env, results, fingerprint."""
    from autotune.paths import shown
    from autotune.profile import profile_diff as diff

    lines = [shown(line) for line in diff(read_profile(a), read_profile(b))]
    typer.echo("\n".join(lines) if lines else
               "no differences in workload, config, env, results or fingerprint")


@profile_app.command("check")
@guarded
def profile_check(
    path: ProfileArg,
    rounds: Annotated[int, typer.Option(help="Fresh trial processes; their median counts")] = 3,
    threshold: Annotated[float, typer.Option(
        help="Fail below this ratio of the recorded samples/sec")] = 0.9,
    trial_timeout: Annotated[str, typer.Option(
        help="Hard limit per round (process start to exit)")] = "600s",
    allow_workload: Annotated[str | None, typer.Option(
        help="Run the profile's workload although it is not built in (its spec, exactly as "
             "the profile names it): checking imports and runs that code")] = None,
    allow_edited: Annotated[bool, typer.Option(
        help="Check a profile's script although it changed since it was tuned (its sha256 "
             "differs): the result then measures the script as it is now")] = False,
    claim: Annotated[bool, typer.Option(
        help="Measure the profile's baseline too, interleaved with the winner, and check the "
             "claimed speedup (where the profile claims one)")] = True,
    debug: Debug = False,
) -> None:
    """Measure the profile's config again on this machine; exit 1 if it is slower than
    --threshold x the recorded samples/sec, or no longer runs (a regression check for CI).
    Where the profile claims a speedup, its baseline runs beside it and the speedup now is
    compared with the claim (said, not part of the exit code)."""
    from autotune.machine.hardware import detect
    from autotune.tuner.check import (
        baseline_settings,
        check_profile,
        check_target,
        check_workload,
        claimed_baseline,
        measure_settings,
    )

    profile = read_profile(path)
    check_workload(profile, allow_workload, allow_edited)  # before anything is printed or run
    hw = detect()
    check_target(profile, hw)
    settings = measure_settings(profile)  # a bad result.measure: one line, exit 2
    base = claimed_baseline(profile) if claim else None
    budget = settings.max_seconds + (0.0 if base is None else
                                     baseline_settings(profile, settings).max_seconds)
    pair = "" if base is None else ", each beside its baseline (the claimed speedup)"
    typer.echo(f"checking {path}: {profile.config.describe()} on {hw.describe()}, {rounds} "
               f"round(s) of up to ~{budget:.0f}s of measuring each{pair}; recorded "
               f"{profile.samples_per_sec:,.2f} samples/s")
    sigterm_as_interrupt()
    result = check_profile(profile, rounds=rounds, threshold=threshold, hw=hw,
                           allow_workload=allow_workload, allow_edited=allow_edited,
                           trial_timeout_s=parse_duration(trial_timeout, "--trial-timeout")
                           or 600.0, claim=claim,
                           on_round=lambda i, m, b: _show_round(i, rounds, m, b))
    _show_verdict(profile, result, threshold)


def _show_round(index: int, rounds: int, m: Measurement, baseline: bool = False) -> None:
    from autotune.units import format_bytes

    what = (f"{m.samples_per_sec:,.2f} samples/s, peak {format_bytes(m.peak_memory_bytes)}"
            if m.ok else f"{m.status}: {m.reason}")
    typer.echo(f"  round {index + 1}/{rounds}{' baseline' if baseline else ''}: {what}")


def _show_verdict(profile: Profile, result: CheckResult, threshold: float) -> None:
    """The check's peak memory, ratio and PASS; FAIL and exit 1 when it did not pass."""
    from autotune.tuner.check import claim_lines
    from autotune.units import format_bytes

    recorded_peak = profile.result.get("peak_memory_bytes")
    if result.peaks and recorded_peak:
        typer.echo(f"peak memory {format_bytes(max(result.peaks))} (recorded "
                   f"{format_bytes(recorded_peak)})")
    if result.ratio is not None:
        typer.echo(f"median {result.median:,.2f} samples/s vs recorded "
                   f"{result.recorded:,.2f}: ratio {result.ratio:.3f} (threshold "
                   f"{threshold:g})")
    for line in claim_lines(profile, result):
        typer.echo(line)
    if not result.passed:
        why = "; ".join(result.failures) or f"ratio below {threshold:g}"
        typer.echo(f"FAIL: {why}", err=True)
        raise typer.Exit(1)
    typer.echo("PASS")
