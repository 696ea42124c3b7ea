"""Optuna storages: opening them, the study lock, heartbeats, and reading studies back.

This is the only module that touches Optuna's private APIs (the heartbeat thread, a trial's
storage id, the study's storage); ``pyproject.toml`` pins Optuna below its next major, where those
may move. Everything else reads and writes studies through Optuna's public API or through here.

The **study lock** serialises the few decisions that read the study and then write it: creating
the study and its attributes, queueing the baseline or a staged config, claiming a trial under
``--trials``, recovering a dead worker's trial. On PostgreSQL it is a session advisory lock (the
server drops it when a worker's connection dies); on SQLite and journal files a ``flock`` on a
file next to the storage's (the kernel drops it when the process dies). Other databases get no
lock: workers may then overshoot ``--trials``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import re
import stat
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.storages._heartbeat import BaseHeartbeat, get_heartbeat_thread
from optuna.trial import FrozenTrial, TrialState

if TYPE_CHECKING:
    import sqlalchemy

from autotune.errors import AutotuneError, StorageError, UsageError, one_line

JOURNAL = "journal:///"  # Optuna's journal file storage: for clusters that share only files
HEARTBEAT_S = 10
GRACE_S = 60  # a trial whose worker has not beaten for this long is dead
STORAGE_ATTEMPTS = 5
_ENGINES: dict[str, sqlalchemy.engine.Engine] = {}

optuna.logging.set_verbosity(optuna.logging.WARNING)


def redact(url: str) -> str:
    """A storage URL without its password (``user:password@`` or ``?password=``), for printing
    and for the profile."""
    url = re.sub(r"([?&]password=)[^&]*", r"\1***", url, flags=re.IGNORECASE)
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        return f"{scheme}://{creds.split(':')[0]}:***@{host}" if ":" in creds else url
    return url


def with_driver(url: str) -> str:
    """A PostgreSQL URL with the driver that is installed. SQLAlchemy 2.1 reads
    ``postgresql://`` as psycopg 3, while the ``postgres`` extra installs psycopg2; and
    ``postgres://`` (Heroku's and libpq's form) names no SQLAlchemy dialect at all. A URL that
    names its driver (``postgresql+psycopg2://``) is kept."""
    for plain in ("postgresql://", "postgres://"):
        if url.startswith(plain):
            driver = "postgresql+psycopg2://" if importlib.util.find_spec("psycopg") is None \
                and importlib.util.find_spec("psycopg2") is not None else "postgresql://"
            return driver + url[len(plain):]
    return url


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """An RDB storage with heartbeats, or a journal file (``journal:///path``, as sqlite URLs
    name files); bad URLs and unreachable servers become one-line errors."""
    for scheme in ("sqlite:///", JOURNAL):
        if url.startswith(scheme):
            path = url[len(scheme):]
            if path and path != ":memory:":
                with contextlib.suppress(OSError):
                    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if url.startswith(JOURNAL):
        from optuna.storages.journal import JournalFileBackend

        try:
            return optuna.storages.JournalStorage(JournalFileBackend(url[len(JOURNAL):]))
        except OSError as exc:
            raise StorageError(f"cannot open journal file {url[len(JOURNAL):]!r} "
                               f"({one_line(exc)}); pass a writable path: "
                               "journal:///path/to/journal.log") from None
    error: Exception | None = None
    for attempt in range(STORAGE_ATTEMPTS):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(
                    with_driver(url), heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                    heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=2))
        except Exception as exc:  # sqlalchemy's ArgumentError, OperationalError, ...
            error = exc
            # Workers started together all create Optuna's tables: the losers of that race see
            # "already exists", a duplicate key, or (SQLite) a locked database. Try again.
            racing = any(word in str(exc).lower() for word in
                         ("already exists", "duplicate", "locked", "unique constraint"))
            if not racing:
                break
            time.sleep(0.2 + 0.3 * attempt)
    assert error is not None
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    raise StorageError(f"cannot open storage {redact(url)!r} ({type(error).__name__}: "
                       f"{first[:200]}); use sqlite:///path/to.db or "
                       "postgresql://user@host:5432/db") from None


def open_existing(url: str) -> optuna.storages.BaseStorage:
    """Open a storage to read; a SQLite or journal file that is not there is an error, not a
    new file."""
    for scheme in ("sqlite:///", JOURNAL):
        path = url[len(scheme):]
        if url.startswith(scheme) and not Path(path).exists():
            raise UsageError(f"no study storage at {path}: run `autotune run` first, or pass "
                             "--storage URL")
    return open_storage(url)


def choose_study(url: str, name: str | None) -> tuple[optuna.Study, str]:
    """The study ``name``, else the only one, else the most recently started (the second
    value says which, and why). Never creates a storage that is not there."""
    storage = open_existing(url)
    summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
    names = [s.study_name for s in summaries]
    if name is not None:
        if name not in names:
            raise UsageError(f"no study {name!r} in {redact(url)}; it has: "
                             f"{', '.join(names) or 'none'}")
        chosen, why = name, ""
    elif not summaries:
        raise UsageError(f"no study in {redact(url)}: run `autotune run` first")
    else:
        latest = max(summaries, key=lambda s: s.datetime_start.timestamp()
                     if s.datetime_start else 0.0)
        chosen = latest.study_name
        why = "" if len(names) == 1 else (f" (the most recently started of {len(names)}; "
                                          "pass --study NAME for another)")
    return optuna.load_study(study_name=chosen, storage=storage), why


def all_studies(url: str) -> Iterator[tuple[optuna.Study, Any]]:
    """Every study in an existing storage, with Optuna's summary of it."""
    storage = open_existing(url)
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        yield optuna.load_study(study_name=summary.study_name, storage=storage), summary


# -- the study lock ------------------------------------------------------------------------------


def open_lock_file(path: Path) -> int:
    """A lock file's descriptor, never through a symlink and never another kind of file: in a
    shared directory (the system's temporary one, or next to a shared database) someone else
    may have put a link there to make autotune chmod or overwrite a file of theirs choosing.
    Only a file this call creates is made writable by everyone (other users' workers lock it
    too)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o666)
        return fd
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise UsageError(f"lock file {path} cannot be opened safely ({exc.strerror}; a symlink "
                         "is refused): remove it, or set AUTOTUNE_LOCK_DIR to a directory of "
                         "your own") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(f"lock file {path} is not a regular file: remove it, or set "
                         "AUTOTUNE_LOCK_DIR to a directory of your own")
    return fd


def _engine(url: str) -> sqlalchemy.engine.Engine:
    """One small connection pool per URL for the advisory lock, kept for the process."""
    import sqlalchemy

    if url not in _ENGINES:
        _ENGINES[url] = sqlalchemy.create_engine(with_driver(url), pool_size=1, max_overflow=1,
                                                 pool_pre_ping=True)
    return _ENGINES[url]


def _lock_key(study_name: str) -> int:
    """A signed 64-bit advisory-lock key for the study."""
    digest = hashlib.sha256(f"autotune:{study_name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


@contextlib.contextmanager
def study_lock(url: str, study_name: str) -> Iterator[None]:
    """Hold the study lock (see the module's docstring) for the duration of the block."""
    if url.startswith("postgresql"):
        from sqlalchemy import text

        key = _lock_key(study_name)
        with _engine(url).connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": key})
            conn.commit()
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                conn.commit()
    elif url.startswith(("sqlite:///", JOURNAL)) and url != "sqlite:///:memory:":
        path = Path(url.split(":///", 1)[1])
        key = _lock_key(study_name) & 0xFFFFFFFF
        fd = open_lock_file(path.with_name(f"{path.name}.{key:08x}.lock"))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
    else:
        yield


@contextlib.contextmanager
def locked(url: str, study_name: str) -> Iterator[None]:
    """The study lock, with a lock file that cannot be made turned into one line."""
    try:
        with study_lock(url, study_name):
            yield
    except AutotuneError:
        raise
    except OSError as exc:
        raise StorageError(f"cannot take the study lock next to {redact(url)} "
                           f"({one_line(exc)}); the directory must be writable") from None


# -- trials: heartbeats, dead workers, retries ---------------------------------------------------


def has_heartbeat(storage: optuna.storages.BaseStorage) -> bool:
    """Whether Optuna keeps the storage's heartbeats (an RDB does; a journal file does not, and
    autotune then marks ``alive_at`` on the trial itself)."""
    return isinstance(storage, BaseHeartbeat)


def frozen(study: optuna.Study, trial: optuna.Trial) -> FrozenTrial:
    """The trial as stored now."""
    return study._storage.get_trial(trial._trial_id)


def ask(study: optuna.Study) -> optuna.Trial:
    with warnings.catch_warnings():
        # Optuna warns that heartbeats are meant for optimize(); autotune runs the heartbeat
        # thread itself around the whole trial (``beating``).
        warnings.filterwarnings("ignore", message="Heartbeat of storage")
        return study.ask()


def retried_trial_number(storage: optuna.storages.BaseStorage, trial: optuna.Trial) -> int | None:
    """The number of the failed trial this one retries (Optuna's retry of a dead trial)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return RetryHeartbeatStaleTrialCallback.retried_trial_number(
            storage.get_trial(trial._trial_id))


@contextlib.contextmanager
def beating(study: optuna.Study, trial: optuna.Trial) -> Iterator[None]:
    """The trial's heartbeat while the block runs: Optuna's on a database; on a journal file,
    which has none, ``alive_at`` on the trial every HEARTBEAT_S seconds."""
    storage = study._storage
    with get_heartbeat_thread(trial._trial_id, storage):
        if has_heartbeat(storage):
            yield
            return
        stop = threading.Event()

        def beat() -> None:
            while True:
                with contextlib.suppress(Exception):  # the trial may have just finished
                    storage.set_trial_user_attr(trial._trial_id, "alive_at", time.time())
                if stop.wait(HEARTBEAT_S):
                    return

        thread = threading.Thread(target=beat, daemon=True, name="autotune-alive")
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


def fail_and_retry(study: optuna.Study, storage: optuna.storages.BaseStorage, trial: FrozenTrial,
                   reason: str) -> None:
    """Fail a running trial whose worker is gone and queue its retry. Another tuner may be
    recovering the same trial: whoever fails it first retries it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retry = RetryHeartbeatStaleTrialCallback(max_retry=2)
    # A finished trial's attributes are frozen: mark it first, then fail it, then retry.
    with contextlib.suppress(UpdateFinishedTrialError):
        storage.set_trial_user_attr(trial._trial_id, "interrupted", True)
        storage.set_trial_user_attr(trial._trial_id, "reason", reason)
        if storage.set_trial_state_values(trial._trial_id, TrialState.FAIL):
            retry(study, storage.get_trial(trial._trial_id))


def retry_running(study: optuna.Study, trial: optuna.Trial, reason: str) -> None:
    """Fail this worker's running trial, which did not measure its config for a reason outside
    it (a cluster engine lost one of its nodes), and queue it again (twice at most)."""
    fail_and_retry(study, study._storage, study._storage.get_trial(trial._trial_id), reason)


def fail_stale(study: optuna.Study) -> None:
    """Optuna's own recovery: trials on a database whose heartbeat stopped, failed and
    retried."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
