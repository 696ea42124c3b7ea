"""The `autotune` command. Thin: each command parses, calls one function, prints.

A domain error becomes one line on stderr and exit code 2 (usage) or 1 (runtime); a traceback only
with --debug.
"""

from __future__ import annotations

import functools
import os
import re
import signal
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from autotune.errors import AutotuneError, UsageError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Find the fastest way to train a model on this machine, by measuring it.")

F = TypeVar("F", bound=Callable[..., Any])


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
        except Exception as exc:
            if debug:
                raise
            raise _fail(f"internal error: {type(exc).__name__}: {exc} "
                        "(rerun with --debug for the traceback)", 1) from None

    return wrapper  # type: ignore[return-value]


_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?$")


def parse_duration(text: str | None, flag: str) -> float | None:
    """``90``, ``90s``, ``10m``, ``1h30m`` -> seconds."""
    if text is None:
        return None
    match = _DURATION.match(text.strip().lower())
    if not text.strip() or match is None or not any(match.groups()):
        raise UsageError(f"{flag} must be a duration like 90s, 10m or 1h30m, got {text!r}")
    h, m, s = (float(g) if g else 0.0 for g in match.groups())
    seconds = h * 3600 + m * 60 + s
    if seconds <= 0:
        raise UsageError(f"{flag} must be positive, got {text!r}")
    return seconds


def _sigterm_as_interrupt() -> None:
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


@app.command()
@guarded
def run(
    model: Annotated[str, typer.Option(
        "--model", "-m",
        help="Built-in workload (see `autotune list`), pkg.module:function, or path/to/file.py")
    ] = "bert",
    param: Annotated[list[str] | None, typer.Option(
        "--param", "-p", help="Workload parameter name=value, repeatable (--param seq_len=256)")
    ] = None,
    space: Annotated[str, typer.Option(
        help="Search space: built-in name or YAML file")] = "default",
    storage: Annotated[str | None, typer.Option(
        help="Optuna storage URL (default: sqlite:///studies/autotune.db)")] = None,
    study: Annotated[str | None, typer.Option(
        help="Study name (default: workload-space-<hash of params, space, hardware>)")] = None,
    trials: Annotated[int | None, typer.Option(
        help="Measured trials the study should have (repeats of a measured config do not "
             "count); rerunning the command resumes towards it")] = None,
    timeout: Annotated[str | None, typer.Option(
        help="Wall-time budget of this run, e.g. 10m (default: 12m when --trials is not given)")
    ] = None,
    nproc: Annotated[int | None, typer.Option(
        help="Ranks per trial, started through torchrun (nccl on GPUs, gloo on CPU) (default: "
             "one per visible GPU, 1 on CPU)")] = None,
    global_batch: Annotated[int | None, typer.Option(
        help="Keep micro-batch x accumulation x ranks at this many samples per optimizer step "
             "(accumulation is derived), so tuning never changes the training semantics")
    ] = None,
    memory_limit: Annotated[str | None, typer.Option(
        help="Memory limit: a size (20GiB) or a fraction (0.8); per rank on GPUs, for all ranks "
             "together on CPU, where they share the RAM (default: 90% of GPU memory, 80% of "
             "available RAM on CPU)")] = None,
    out: Annotated[Path | None, typer.Option(
        help="Directory for the profile and trial logs (default: studies/<study>)")] = None,
    seed: Annotated[int, typer.Option(help="Sampler seed")] = 0,
    trial_timeout: Annotated[str, typer.Option(
        help="Hard limit per trial (process start to exit)")] = "180s",
    trial_seconds: Annotated[float, typer.Option(
        help="Measuring budget per trial, warm-up included")] = 60.0,
    window_seconds: Annotated[float, typer.Option(
        help="Minimum length of one timed window")] = 1.0,
    patience: Annotated[int, typer.Option(
        help="Stop when this many trials in a row beat the best by no more than the noise "
             "(0: never stop early)")] = 10,
    confirm_top: Annotated[int, typer.Option(
        help="Configs re-measured at the end, interleaved with the baseline, to pick the "
             "winner (0: no confirmation)")] = 3,
    confirm_rounds: Annotated[int, typer.Option(
        help="Interleaved rounds of that re-measurement")] = 3,
    prune: Annotated[bool, typer.Option(
        help="Stop trials whose first windows are clearly below the best")] = True,
    debug: Annotated[bool, typer.Option(help="Show tracebacks")] = False,
) -> None:
    """Tune a workload on this machine and export the winner as a profile."""
    from autotune.console import ConsoleReporter
    from autotune.study import RunOptions
    from autotune.study import run as run_study
    from autotune.workloads import parse_params

    if trial_seconds <= 0 or window_seconds <= 0:
        raise UsageError(f"--trial-seconds and --window-seconds must be positive, got "
                         f"{trial_seconds:g} and {window_seconds:g}")
    if patience < 0 or confirm_top < 0 or confirm_rounds < 2:
        raise UsageError(f"--patience and --confirm-top must be >= 0 and --confirm-rounds >= 2 "
                         f"(a spread needs two rounds), got {patience}, {confirm_top} and "
                         f"{confirm_rounds}")
    hard = parse_duration(trial_timeout, "--trial-timeout") or 180.0
    if trial_seconds > hard * 2 / 3:
        # Start-up, model build and the slow first step need room under the hard limit.
        raise UsageError(f"--trial-seconds ({trial_seconds:g}s) must be at most 2/3 of "
                         f"--trial-timeout ({hard:g}s); raise --trial-timeout to at least "
                         f"{trial_seconds * 1.5:g}s")
    opts = RunOptions(
        model=model, params=parse_params(param or []), space=space, storage=storage,
        study_name=study, trials=trials, timeout_s=parse_duration(timeout, "--timeout"),
        memory_limit=memory_limit, out_dir=out, seed=seed,
        trial_timeout_s=hard, nproc=nproc, global_batch=global_batch,
        measure={"max_seconds": trial_seconds, "min_window_s": window_seconds},
        patience=patience or None, confirm_top=confirm_top, confirm_rounds=confirm_rounds,
        prune=prune)
    _sigterm_as_interrupt()
    summary = run_study(opts, ConsoleReporter())
    if summary.best is None:
        counts = ", ".join(f"{n} {s}" for s, n in
                           sorted(Counter(t.status for t in summary.trials).items()))
        raise AutotuneError(f"no configuration was measured successfully ({counts or 'no trials'})"
                            f"; read the trial logs under {summary.out_dir / 'trials'}, or give "
                            "more time (--timeout, --trial-seconds) or memory (--memory-limit)")


@app.command("list")
@guarded
def list_(debug: Annotated[bool, typer.Option(help="Show tracebacks")] = False) -> None:
    """Print the built-in workloads and search spaces."""
    import yaml

    from autotune.space import builtin_spaces
    from autotune.workloads import builtin_workloads, describe_builtin

    typer.echo("workloads (--model):")
    for name, path in builtin_workloads().items():
        typer.echo(f"  {name:<10} {describe_builtin(path).partition(': ')[2] or ''}")
    typer.echo("  or pkg.module:function, or path/to/file.py (see README: bring your own model)")
    typer.echo("search spaces (--space):")
    for name, path in builtin_spaces().items():
        data = yaml.safe_load(path.read_text()) or {}
        knobs = ", ".join((data.get("knobs") or {}).keys())
        typer.echo(f"  {name:<10} {data.get('description', '')}\n  {'':<10} knobs: {knobs}")


def main() -> None:
    """Console-script entry point."""
    app(prog_name="autotune")


if __name__ == "__main__":
    main()
