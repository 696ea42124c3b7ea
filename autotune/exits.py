"""How an `autotune` command ends when something is wrong: one line on stderr and an exit code.

A domain error (``AutotuneError``) exits with its code: 2 for usage, 1 at runtime; anything else
is an internal error in one line, unless --debug (or ``AUTOTUNE_DEBUG=1``) asks for the
traceback. The argument parser's own errors read the same way.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

from autotune.errors import AutotuneError, UsageError, disk_full

F = TypeVar("F", bound=Callable[..., Any])
# Every command takes it; ``guarded`` reads it.
Debug = Annotated[bool, typer.Option(help="Show tracebacks")]


def fail(message: str, code: int) -> typer.Exit:
    """Print ``message`` as autotune's one error line; the exit to raise with ``code``."""
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
            raise fail(str(exc), exc.exit_code) from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None
        except typer.Exit:
            raise  # a command's own exit code (e.g. a failed `profile check`)
        except Exception as exc:
            if debug:
                raise
            if (why := disk_full(exc)) is not None:
                raise fail(f"disk full ({why}); free space and run the command again", 1) from None
            raise fail(f"internal error: {type(exc).__name__}: {exc} "
                       "(rerun with --debug for the traceback)", 1) from None

    return wrapper  # type: ignore[return-value]


def parser_exit_code(exc: Exception) -> int | None:
    """The exit code for an error of the argument parser (an unknown flag, a value of the wrong
    type), printed as one line like every other error here instead of the parser's boxed usage
    text; None for an exception that is not the parser's."""
    # typer's own copy of click raises its own exception classes: recognised by what they have.
    if getattr(exc, "exit_code", None) == 2 and hasattr(exc, "format_message"):
        if not exc.format_message():  # no arguments: the help was printed, as asked
            return 2
        ctx = getattr(exc, "ctx", None)
        where = ctx.command_path if ctx is not None else "autotune"
        print(f"autotune: error: {exc.format_message()}; `{where} --help` lists the options",
              file=sys.stderr)
        return 2
    if type(exc).__name__ == "Abort":  # Ctrl-C outside a command
        return 130
    return None


def parse_duration(text: str | None, flag: str) -> float | None:
    """``90``, ``90s``, ``10m``, ``1h30m`` -> seconds; None for None; a UsageError otherwise."""
    from autotune.units import parse_duration as parse

    if text is None:
        return None
    try:
        return parse(text, flag)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def sigterm_as_interrupt() -> None:
    """Let SIGTERM end a command as Ctrl-C does: the same clean-up, exit code 130."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
