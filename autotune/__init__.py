"""autotune: find the fastest way to train a model on the hardware at hand, by measuring it."""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"

__all__ = ["Profile", "__version__", "load_profile"]


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


# After __version__ and _data_dir: the profile module is light (no torch, no Optuna at import),
# so training scripts get `autotune.load_profile` without a wrapper in the warning's stack.
from autotune.profile import Profile, load_profile  # noqa: E402
