"""The few errors autotune raises on purpose.

Every message names the rule, the value and the fix, on one line, so the CLI can print it as is.
Usage errors (bad flags, bad files) exit with 2, runtime errors with 1.
"""

from __future__ import annotations


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``: how a caught exception is reported in one line."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:limit]}" if lines else type(exc).__name__


class AutotuneError(Exception):
    """A failure the user can act on; the CLI prints it as one line and exits with ``exit_code``."""

    exit_code = 1


class UsageError(AutotuneError):
    """Bad input from the user: a flag, a file, a name. Exit code 2."""

    exit_code = 2


class SpaceError(UsageError):
    """A search-space file that breaks a rule; carries every problem found, not only the first."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        joined = "; ".join(problems)
        super().__init__(f"invalid search space {source}: {joined}")


class WorkloadError(UsageError):
    """An unknown or broken workload specification."""


class StorageError(AutotuneError):
    """The Optuna storage cannot be opened or written."""

    exit_code = 2


class ProfileError(UsageError):
    """A profile file that cannot be read, or is of an unknown schema; a profile misapplied."""
