"""Where autotune's own files are: the data it ships (search spaces, built-in workloads) and the
folder a child process must find the package in."""

from __future__ import annotations

import re
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """Where a shipped data folder (``search_spaces``, ``objectives``) is.

    Installed, they are the packages ``autotune.<name>``; run from a source checkout, they are the
    folders next to ``autotune/``.
    """
    from importlib import resources

    try:
        return Path(str(resources.files(f"autotune.{name}")))
    except ModuleNotFoundError:
        return _PACKAGE.parent / name


def import_root() -> Path:
    """The folder that holds the ``autotune`` package: put on a child process's PYTHONPATH, it
    imports autotune from wherever this process did (a source checkout or an installed one)."""
    return _PACKAGE.parent


_STUDY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def study_folder(studies_dir: Path, name: str) -> Path:
    """``studies_dir / name``, for a study name that stays a folder name there. A name from the
    command line, or one stored in a shared database, with ``/``, ``..`` or an absolute path
    would put outputs anywhere: refused in one line (the error is a UsageError)."""
    from autotune.errors import UsageError

    if not _STUDY_NAME.fullmatch(name) or len(name) > 200:
        raise UsageError(f"study name {name!r} cannot name a folder under {studies_dir}: use "
                         "letters, digits, '.', '_' and '-' (up to 200, not starting with '.'), "
                         "or pass --out DIR")
    return studies_dir / name


def control_characters(flag: str, value: str) -> str | None:
    """Why ``value`` (given as ``flag``) cannot be a name autotune prints and stores, or None:
    a control character (an escape sequence, a bell, a newline) would rewrite the terminal of
    everyone who lists the study."""
    bad = sorted({c for c in value if not c.isprintable()})
    if not bad:
        return None
    return (f"{flag} {value!r} holds control characters ({', '.join(map(repr, bad))}): use "
            "printable characters only")


def shown(text: object) -> str:
    """``text`` for a terminal: control characters (from a study stored by someone else)
    written as escapes, never sent raw."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
