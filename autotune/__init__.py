"""autotune: find the fastest way to train a model on the hardware at hand, by measuring it."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Profile", "__version__", "in_trial", "load_profile", "should_stop", "step"]


# After __version__: the profile module is light (no torch, no Optuna at import),
# so training scripts get `autotune.load_profile` without a wrapper in the warning's stack.
from autotune.profile import Profile, load_profile  # noqa: E402

# A script tuned by `autotune run -- CMD` reports its steps; outside a trial these do nothing.
from autotune.steps import in_trial, should_stop, step  # noqa: E402
