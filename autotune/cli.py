"""The `autotune` command. Thin: each command parses, calls one function, prints.

A domain error becomes one line on stderr and exit code 2 (usage) or 1 (runtime); a traceback only
with --debug. `autotune run`'s flags are declared once, on the fields of ``RunOptions``, and
become its parameters here.
"""

from __future__ import annotations

import functools
import inspect
import os
import signal
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from autotune.errors import AutotuneError, UsageError, disk_full
from autotune.flags import BoundFlag
from autotune.tuner import options

if TYPE_CHECKING:
    from autotune.profile import Profile
    from autotune.tuner.reporting import RunSummary

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Find the fastest way to train a model on this machine, by measuring it.")

F = TypeVar("F", bound=Callable[..., Any])
Debug = Annotated[bool, typer.Option(help="Show tracebacks")]
DEFAULT_STORAGE = options.DEFAULT_STORAGE


def _fail(message: str, code: int) -> typer.Exit:
    typer.echo(f"autotune: error: {message}", err=True)
    return typer.Exit(code)


def guarded(func: F) -> F:
    """Turn AutotuneError into one line and an exit code; anything else too, unless --debug."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        debug = kwargs.get("debug") or os.environ.get("AUTOTUNE_DEBUG") == "1"
        try:
            return func(*args, **kwargs)
        except AutotuneError as exc:
            if debug:
                raise
            raise _fail(str(exc), exc.exit_code) from None
        except KeyboardInterrupt:
            raise _fail("interrupted", 130) from None
        except typer.Exit:
            raise  # a command's own exit code (e.g. a failed `profile check`)
        except Exception as exc:
            if debug:
                raise
            if (why := disk_full(exc)) is not None:
                raise _fail(f"disk full ({why}); free space and run the command again", 1) from None
            raise _fail(f"internal error: {type(exc).__name__}: {exc} "
                        "(rerun with --debug for the traceback)", 1) from None

    return wrapper  # type: ignore[return-value]


def parse_duration(text: str | None, flag: str) -> float | None:
    """``90``, ``90s``, ``10m``, ``1h30m`` -> seconds; None for None."""
    from autotune.units import parse_duration as parse

    if text is None:
        return None
    try:
        return parse(text, flag)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _sigterm_as_interrupt() -> None:
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def _parameter(flag: BoundFlag) -> inspect.Parameter:
    """The typer parameter of one of RunOptions' flags."""
    info = typer.Argument(help=flag.flag.help, show_default=False) if flag.flag.argument else \
        typer.Option(*flag.flag.names, help=flag.flag.help)
    return inspect.Parameter(flag.param, inspect.Parameter.KEYWORD_ONLY, default=flag.default,
                             annotation=Annotated[flag.takes, info])


def with_run_flags(func: Callable[..., None]) -> Callable[..., None]:
    """Give ``func`` RunOptions' flags as parameters in place of its ``**flags``, ahead of its
    own (typer reads a command's parameters from its signature)."""
    own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
           for p in inspect.signature(func, eval_str=True).parameters.values()
           if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params = [*map(_parameter, options.run_flags()), *own]
    func.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return func


@app.command(context_settings={"allow_interspersed_args": False})
@guarded
@with_run_flags
def run(
    json_: Annotated[bool, typer.Option(
        "--json", help="Print one JSON object per event on stdout, for scripts")] = False,
    debug: Debug = False,
    **flags: object,
) -> None:
    """Tune a workload, or your own training script (after --), on this machine and export
    the winner as a profile."""
    from autotune.console import ConsoleReporter, JsonReporter
    from autotune.machine.hardware import detect
    from autotune.report import write_dashboard
    from autotune.tuner.runner import run as run_study

    opts = options.from_flags(flags, detect())
    _sigterm_as_interrupt()
    summary = run_study(opts, JsonReporter() if json_ else ConsoleReporter(), write_dashboard)
    if summary.best is None:
        raise _nothing_measured(summary)


def _nothing_measured(summary: RunSummary) -> AutotuneError:
    counts = ", ".join(f"{n} {s}" for s, n in
                       sorted(Counter(t.status for t in summary.trials).items()))
    return AutotuneError(f"no configuration was measured successfully ({counts or 'no trials'})"
                         f"; read the trial logs under {summary.out_dir / 'trials'}, or give "
                         "more time (--timeout, --trial-seconds) or memory (--memory-limit)")


@app.command()
@guarded
def agent(
    storage: Annotated[str, typer.Option(
        help="The tuner's Optuna storage URL (PostgreSQL, reachable from every node)")],
    study: Annotated[str, typer.Option(help="The tuner's study name (--study)")],
    out: Annotated[Path, typer.Option(
        help="Directory for this node's trial logs")] = Path("studies/agent"),
    wait: Annotated[str, typer.Option(
        help="How long to wait for the tuner to create the study")] = "10m",
    allow_workload: Annotated[str | None, typer.Option(
        help="Also run this workload (its spec, as the tuner's --model names it); built-ins "
             "only otherwise")] = None,
    debug: Debug = False,
) -> None:
    """Run this machine's part of trials across machines: start with `autotune run --nnodes N
    --rdzv-endpoint HOST:PORT --storage URL --study NAME` on one machine, and this on each other
    one; it joins every trial until the tuner's run ends."""
    from autotune.tuner.agent import serve

    _sigterm_as_interrupt()
    serve(storage, study, out, lambda line: print(line, flush=True),
          wait_s=parse_duration(wait, "--wait") or 600.0, allow_workload=allow_workload)


@app.command("probe")
@guarded
def probe_command(
    json_: Annotated[bool, typer.Option(
        "--json", help="Print the whole probe as one JSON document (fields: docs/probe.md)")
    ] = False,
    refresh: Annotated[bool, typer.Option(
        help="Measure again instead of showing the cached probe (a cached probe older than 30 "
             "days, or $AUTOTUNE_PROBE_MAX_AGE_DAYS, is measured again anyway)")] = False,
    allreduce: Annotated[bool, typer.Option(
        help="Measure all-reduce bus bandwidth across the GPUs (several GPUs only)")] = True,
    debug: Debug = False,
) -> None:
    """Check this machine's data paths: GPUs, links and topology (NVML), measured copy and
    memory bandwidth, matmul/GEMM peaks and all-reduce, each against its theoretical peak."""
    import json

    from autotune.machine.hardware import detect
    from autotune.machine.probe import cache_path, cached, probe, render

    hw = detect()
    fresh = refresh or cached(hw) is None
    if fresh and not json_:
        typer.echo(f"probing {hw.describe()} (about 10 s on a CPU, a minute with GPUs)", err=True)
    doc = probe(hw, refresh=refresh, allreduce=allreduce,
                on_step=None if json_ else (lambda line: typer.echo(f"  {line}", err=True)))
    if json_:
        typer.echo(json.dumps(doc, indent=1))
        return
    for line in render(doc):
        typer.echo(line)
    when = "measured now" if fresh else \
        f"measurements cached from {doc.get('created')} (--refresh measures again)"
    where = "not cached (taken under load)" if doc.get("contended") else str(cache_path(hw))
    typer.echo(f"probe   {when}: {where}")


@app.command("list")
@guarded
def list_(debug: Debug = False) -> None:
    """Print the built-in workloads and search spaces."""
    import yaml

    from autotune.config.space import builtin_spaces
    from autotune.workloads import builtin_workloads, describe_builtin

    typer.echo("workloads (--model):")
    for name, path in builtin_workloads().items():
        typer.echo(f"  {name:<10} {describe_builtin(path).partition(': ')[2] or ''}")
    typer.echo("  or pkg.module:function, or path/to/file.py (docs/workloads.md: bring your own "
               "model)")
    typer.echo("search spaces (--space):")
    for name, path in builtin_spaces().items():
        data = yaml.safe_load(path.read_text()) or {}
        knobs = ", ".join((data.get("knobs") or {}).keys())
        typer.echo(f"  {name:<10} {data.get('description', '')}\n  {'':<10} knobs: {knobs}")


@app.command("dashboard")
@guarded
def dashboard(
    study: Annotated[str | None, typer.Option(
        help="Study name (default: the only one, or the most recently started)")] = None,
    storage: Annotated[str, typer.Option(help="Optuna storage URL")] = DEFAULT_STORAGE,
    out: Annotated[Path | None, typer.Option(
        help="Where to write it (default: studies/<study>/dashboard.html)")] = None,
    open_: Annotated[bool, typer.Option("--open", help="Open it in a browser")] = False,
    live: Annotated[bool, typer.Option(
        help="Serve optuna-dashboard on the storage (127.0.0.1) until Ctrl-C instead")] = False,
    port: Annotated[int, typer.Option(help="Port for --live (0: a free one)")] = 0,
    writable: Annotated[bool, typer.Option(
        help="Let --live edit and delete studies (read-only by default)")] = False,
    png: Annotated[bool, typer.Option(
        help="Also write each panel as a PNG (needs kaleido and a Chromium)")] = False,
    debug: Debug = False,
) -> None:
    """Write a study's dashboard: one self-contained HTML file that works offline."""
    from autotune.paths import control_characters, shown, study_folder
    from autotune.report import load_for_dashboard, serve_live, write_dashboard, write_pngs

    if study is not None and (why := control_characters("--study", study)):
        raise UsageError(why)
    if live:
        serve_live(storage, port, lambda url: typer.echo(
            f"live dashboard: {url} ({'writable' if writable else 'read-only'}; Ctrl-C stops "
            "it)"), writable=writable)
        typer.echo("live dashboard stopped")
        return
    chosen, why = load_for_dashboard(storage, study)
    path = write_dashboard(chosen, out or study_folder(Path("studies"), chosen.study_name)
                           / "dashboard.html")
    typer.echo(f"dashboard for study {shown(chosen.study_name)}{shown(why)}: {path}")
    if png:
        images = write_pngs(chosen, path.parent / "panels")
        typer.echo(f"{len(images)} PNG panels: {images[0].parent}")
    if open_:
        import webbrowser

        webbrowser.open(path.resolve().as_uri())


@app.command("studies")
@guarded
def studies(
    storage: Annotated[str, typer.Option(help="Optuna storage URL")] = DEFAULT_STORAGE,
    debug: Debug = False,
) -> None:
    """List the studies in a storage: measured trials, best samples/sec, speedup, last
    activity."""
    from autotune.paths import shown
    from autotune.tuner.results import list_studies

    rows = [{**r, "study": shown(r["study"])} for r in list_studies(storage)]
    if not rows:
        typer.echo("no studies yet: `autotune run` starts one")
        return
    width = max(len(r["study"]) for r in rows)
    typer.echo(f"{'study':<{width}}  trials  best samples/s  speedup  last activity")
    for r in sorted(rows, key=lambda r: str(r["last_activity"]), reverse=True):
        best = "-" if r["best_samples_per_sec"] is None else f"{r['best_samples_per_sec']:,.2f}"
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        when = r["last_activity"].strftime("%Y-%m-%d %H:%M") if r["last_activity"] else "-"
        typer.echo(f"{r['study']:<{width}}  {r['trials']:>6}  {best:>14}  {speedup:>7}  {when}")


# -- profiles ------------------------------------------------------------------------------------

profile_app = typer.Typer(no_args_is_help=True, help="Read, compare and re-check profiles.")
app.add_typer(profile_app, name="profile")
ProfileArg = Annotated[Path, typer.Argument(help="A profile.yaml written by `autotune run`")]


def _load(path: Path) -> Profile:
    """Load a profile; a fingerprint mismatch is one warning line on stderr, not a traceback."""
    import warnings

    from autotune.paths import shown
    from autotune.profile import load_profile

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile = load_profile(path)
    for w in caught:
        typer.echo(f"autotune: warning: {shown(w.message)}", err=True)
    return profile


@profile_app.command("show")
@guarded
def profile_show(path: ProfileArg, debug: Debug = False) -> None:
    """What a profile tuned, what it measured, and where."""
    from autotune.paths import shown

    profile = _load(path)
    # A profile is data from elsewhere: its names and notes are shown, never sent raw.
    lines = [f"profile    {path}", *profile.summary().splitlines()]
    typer.echo("\n".join(shown(line) for line in lines))


@profile_app.command("env")
@guarded
def profile_env(path: ProfileArg, debug: Debug = False) -> None:
    """Shell `export` lines: the profile's environment and AUTOTUNE_PROFILE (for
    `eval "$(autotune profile env P)"`)."""
    import shlex

    from autotune.profile import launch_env

    profile = _load(path)
    env = launch_env(profile, path, base={})
    for key, value in env.items():
        typer.echo(f"export {key}={shlex.quote(value)}")


@profile_app.command("diff")
@guarded
def profile_diff(a: ProfileArg, b: ProfileArg, debug: Debug = False) -> None:
    """What differs between two profiles: workload, config, env, results, fingerprint."""
    from autotune.paths import shown
    from autotune.profile import profile_diff as diff

    lines = [shown(line) for line in diff(_load(a), _load(b))]
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
    debug: Debug = False,
) -> None:
    """Measure the profile's config again on this machine; exit 1 if it is slower than
    --threshold x the recorded samples/sec, or no longer runs (a regression check for CI)."""
    from autotune.machine.hardware import detect
    from autotune.tuner.check import check_profile, check_target, check_workload, measure_settings
    from autotune.units import format_bytes

    profile = _load(path)
    check_workload(profile, allow_workload, allow_edited)  # before anything is printed or run
    hw = detect()
    check_target(profile, hw)
    budget = measure_settings(profile).max_seconds  # a bad result.measure: one line, exit 2
    typer.echo(f"checking {path}: {profile.config.describe()} on {hw.describe()}, {rounds} "
               f"round(s) of up to ~{budget:.0f}s of measuring each; recorded "
               f"{profile.samples_per_sec:,.2f} samples/s")

    def on_round(index: int, m: Any) -> None:
        what = (f"{m.samples_per_sec:,.2f} samples/s, peak {format_bytes(m.peak_memory_bytes)}"
                if m.ok else f"{m.status}: {m.reason}")
        typer.echo(f"  round {index + 1}/{rounds}: {what}")

    _sigterm_as_interrupt()
    result = check_profile(profile, rounds=rounds, threshold=threshold, hw=hw,
                           allow_workload=allow_workload, allow_edited=allow_edited,
                           trial_timeout_s=parse_duration(trial_timeout, "--trial-timeout")
                           or 600.0, on_round=on_round)
    recorded_peak = profile.result.get("peak_memory_bytes")
    if result.peaks and recorded_peak:
        typer.echo(f"peak memory {format_bytes(max(result.peaks))} (recorded "
                   f"{format_bytes(recorded_peak)})")
    if result.ratio is not None:
        typer.echo(f"median {result.median:,.2f} samples/s vs recorded "
                   f"{result.recorded:,.2f}: ratio {result.ratio:.3f} (threshold "
                   f"{threshold:g})")
    if not result.passed:
        why = "; ".join(result.failures) or f"ratio below {threshold:g}"
        typer.echo(f"FAIL: {why}", err=True)
        raise typer.Exit(1)
    typer.echo("PASS")


@app.command("launch", context_settings={"allow_interspersed_args": False})
@guarded
def launch_command(
    path: ProfileArg,
    command: Annotated[list[str], typer.Argument(
        help="The command to run, after --: e.g. torchrun --nproc-per-node 2 train.py")],
    debug: Debug = False,
) -> None:
    """Run a command with the profile's environment (NCCL_*) and AUTOTUNE_PROFILE set, so
    `autotune.load_profile()` in it finds the profile. The command replaces this process."""
    from autotune.profile import PROFILE_ENV, launch_env

    if command[:1] == ["--"]:  # click keeps the separator once options stop being parsed
        command = command[1:]
    if not command:
        raise UsageError("no command to launch: put it after --, e.g. autotune launch "
                         "profile.yaml -- python train.py")
    profile = _load(path)
    for why in profile.refused_here():  # the script would refuse it when applying it
        raise UsageError(f"the profile cannot run here: {why}")
    env = launch_env(profile, path)
    shown = " ".join(f"{k}={env[k]}" for k in (*profile.env, PROFILE_ENV))
    typer.echo(f"autotune: launching with {shown}", err=True)
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        raise UsageError(f"cannot run {command[0]!r}: {exc.strerror}; check the command after "
                         "--") from None


def main() -> None:
    """Console-script entry point. A usage error from the argument parser (an unknown flag, a
    value of the wrong type) is one line and exit 2, like every other error here, instead of
    the parser's boxed usage text."""
    try:
        code = app(prog_name="autotune", standalone_mode=False)
    except Exception as exc:  # typer's own copy of click raises its own exception classes
        if getattr(exc, "exit_code", None) == 2 and hasattr(exc, "format_message"):
            if not exc.format_message():  # no arguments: the help was printed, as asked
                sys.exit(2)
            ctx = getattr(exc, "ctx", None)
            where = ctx.command_path if ctx is not None else "autotune"
            print(f"autotune: error: {exc.format_message()}; `{where} --help` lists the "
                  "options", file=sys.stderr)
            sys.exit(2)
        if type(exc).__name__ == "Abort":  # Ctrl-C outside a command
            sys.exit(130)
        raise
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
