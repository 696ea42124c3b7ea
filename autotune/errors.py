"""The few errors autotune raises on purpose.

Every message names the rule, the value and the fix, on one line, so the CLI can print it as is.
Usage errors (bad flags, bad files) exit with 2, runtime errors with 1.
"""

from __future__ import annotations

import errno


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``: how a caught exception is reported in one line."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:limit]}" if lines else type(exc).__name__


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# What the databases say when their disk is full: SQLite's SQLITE_FULL, PostgreSQL's 53100 (the
# server's own disk), and the OS's ENOSPC text when a driver passes it on as a string.
_FULL_TEXTS = ("database or disk is full", "No space left on device", "Disk quota exceeded")


def disk_full(exc: BaseException | None) -> str | None:
    """Why ``exc``, or anything that caused it, says a disk is full (the OS's words, with the
    file when it names one); None when nothing does. Storage layers wrap the driver's error in
    their own, so the whole chain is read."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _FULL:
            return f"{exc.strerror}: {exc.filename}" if exc.filename else str(exc.strerror)
        if getattr(exc, "pgcode", None) == "53100":
            return "the PostgreSQL server's disk is full"
        for text in _FULL_TEXTS:
            if text in str(exc):
                return text
        exc = exc.__cause__ or exc.__context__
    return None


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


class DiskFull(AutotuneError):
    """A disk filled up under the study's storage or its outputs; what is committed is kept."""


class ProfileError(UsageError):
    """A profile file that cannot be read, or is of an unknown schema; a profile misapplied."""
