"""The `autotune` command. Thin: each command parses, calls one function, prints.

A domain error becomes one line on stderr and exit code 2 (usage) or 1 (runtime); a traceback only
with --debug (``exits``). `autotune run`'s flags are declared once, on the fields of
``RunOptions``, and become its parameters here; `autotune profile` is ``profile_commands``.
"""

from __future__ import annotations

import inspect
import os
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from autotune import bootstrap
from autotune.errors import AutotuneError, UsageError
from autotune.exits import Debug, guarded, parse_duration, parser_exit_code, sigterm_as_interrupt
from autotune.flags import BoundFlag
from autotune.profile_commands import ProfileArg, compare_profiles, profile_app, read_profile
from autotune.tuner import options

if TYPE_CHECKING:
    from autotune.tuner.reporting import RunSummary

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Find the fastest way to train a model on this machine, by measuring it.")
app.add_typer(profile_app, name="profile")
app.command("compare")(compare_profiles)
__all__ = ["app", "main", "parse_duration"]


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
    sigterm_as_interrupt()
    summary = run_study(opts, JsonReporter() if json_ else ConsoleReporter(), write_dashboard)
    if summary.best is None:
        raise _nothing_measured(summary)


def _nothing_measured(summary: RunSummary) -> AutotuneError:
    counts = ", ".join(f"{n} {s}" for s, n in
                       sorted(Counter(t.status for t in summary.trials).items()))
    return AutotuneError(f"no configuration was measured successfully ({counts or 'no trials'})"
                         f"; read the trial logs under {summary.out_dir / 'trials'}, or give "
                         "more time (--timeout, --trial-seconds) or memory (--memory-limit)")


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
    storage: Annotated[str, typer.Option(help="Optuna storage URL")] = options.DEFAULT_STORAGE,
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
    storage: Annotated[str, typer.Option(help="Optuna storage URL")] = options.DEFAULT_STORAGE,
    debug: Debug = False,
) -> None:
    """List the studies in a storage: measured trials, the winner's samples/sec, its speedup
    (confirmed side by side, or the search windows' own), last activity."""
    from autotune.paths import shown
    from autotune.tuner.snapshot import CONFIRMED
    from autotune.tuner.studies import list_studies

    rows = sorted(list_studies(storage), key=lambda r: str(r.last_activity), reverse=True)
    if not rows:
        typer.echo("no studies yet: `autotune run` starts one")
        return
    names = [shown(r.study) for r in rows]
    width = max(len(n) for n in names)
    typer.echo(f"{'study':<{width}}  trials  best samples/s  {'speedup':<46}  last activity")
    for name, r in zip(names, rows, strict=True):
        best = "-" if r.best_samples_per_sec is None else f"{r.best_samples_per_sec:,.2f}"
        speedup = "-" if r.speedup is None else f"{r.speedup.value:.2f}x " + (
            "search only" if r.speedup.kind != CONFIRMED else "confirmed" if
            r.speedup.interval is None else
            f"({r.speedup.interval.low:.2f}-{r.speedup.interval.high:.2f}) confirmed"
            + (", machine changed" if r.speedup.machine_changed else ""))
        when = r.last_activity.strftime("%Y-%m-%d %H:%M") if r.last_activity else "-"
        typer.echo(f"{name:<{width}}  {r.trials:>6}  {best:>14}  {speedup:<46}  {when}")


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
    profile = read_profile(path)
    for why in profile.refused_here():  # the script would refuse it when applying it
        raise UsageError(f"the profile cannot run here: {why}")
    env = launch_env(profile, path)
    shown = " ".join(f"{k}={env[k]}" for k in (*profile.env, PROFILE_ENV))
    # A Hugging Face or Lightning Trainer gets the profile from autotune's bootstrap, with
    # no edit to the script (``autotune.bootstrap``); a plain loop loads it itself.
    env.update(bootstrap.environment(bootstrap.LAUNCH, env))
    env.update(bootstrap.trainer_env(profile.config.amp, profile.config.grad_accum_steps))
    from autotune.trial.command import SKIPPED_BY, shown_flag

    flag = found[1] if (found := shown_flag(command)) is not None else None
    # A script that loads the profile itself still gets it under these flags; a Trainer not.
    reached = "a Hugging Face or Lightning Trainer in it gets the profile's config" \
        if flag is None else (f"warning: {flag} ({SKIPPED_BY[flag]}) keeps autotune's "
                              "bootstrap out: a Hugging Face or Lightning Trainer in it does "
                              f"not get the profile's config; run it without {flag} for that")
    typer.echo(f"autotune: launching with {shown}; {reached}", err=True)
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        raise UsageError(f"cannot run {command[0]!r}: {exc.strerror}; check the command after "
                         "--") from None


def _warning_line(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  line: str | None = None) -> str:
    """autotune's own warnings as one line a user reads (not a source location); others as
    Python shows them."""
    if category.__module__.startswith("autotune."):
        return f"autotune: warning: {message}\n"
    return _python_warning_line(message, category, filename, lineno, line)


_python_warning_line = warnings.formatwarning


def main() -> None:
    """Console-script entry point. A usage error from the argument parser (an unknown flag, a
    value of the wrong type) is one line and exit 2, like every other error here."""
    warnings.formatwarning = _warning_line
    try:
        code = app(prog_name="autotune", standalone_mode=False)
    except Exception as exc:
        if (exit_code := parser_exit_code(exc)) is None:
            raise
        sys.exit(exit_code)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
