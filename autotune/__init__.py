"""autotune: find the fastest way to train a model on the hardware at hand, by measuring it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = ["__version__", "load_profile"]

if TYPE_CHECKING:
    from autotune.profile import Profile


def load_profile(path: str | Path) -> Profile:
    """Load and validate a profile file (see :func:`autotune.profile.load_profile`)."""
    from autotune.profile import load_profile as _load

    return _load(path)


def _data_dir(name: str) -> Path:
    """Where a shipped data folder (``search_spaces``, ``objectives``) is.

    Installed, they are the packages ``autotune.<name>``; run from a source checkout, they are the
    folders next to ``autotune/``.
    """
    from importlib import resources

    try:
        return Path(str(resources.files(f"autotune.{name}")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / name
