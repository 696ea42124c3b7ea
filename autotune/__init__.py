"""autotune: find the fastest way to train a model on the hardware at hand, by measuring it."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Profile", "__version__", "load_profile"]


# After __version__: the profile module is light (no torch, no Optuna at import),
# so training scripts get `autotune.load_profile` without a wrapper in the warning's stack.
from autotune.profile import Profile, load_profile  # noqa: E402
