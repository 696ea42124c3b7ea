"""Where autotune's own files are: the data it ships (search spaces, built-in workloads) and the
folder a child process must find the package in."""

from __future__ import annotations

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
