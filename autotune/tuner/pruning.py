"""When a running trial is stopped early: its first windows clearly below the best trial's.

The tuner reads a trial's windows as they come (``tuner.measure``) and asks ``prune_reason``;
a trial stopped here is recorded as pruned, not as a measurement of its config.
"""

from __future__ import annotations

from collections.abc import Sequence

PRUNE_AFTER_WINDOWS = 2
# A trial is pruned when each of its first windows is below this share of the best. Measured on
# the search benchmark's grids (benchmarks/data): a config's final median was at most 1.05x the
# better of its first two windows on BERT, 1.21x on the noisy mlp, so a trial pruned at 0.75x
# would have finished at most at 0.91x the best.
PRUNE_BELOW = 0.75
# Where a window is one whole step (seconds each), a trial is pruned after its first window
# when that window is below this share of the best: on the BERT grid a config's final median
# was at most 1.20x its first window, so a trial pruned here would have finished at most at
# 0.72x the best.
PRUNE_BELOW_FIRST = 0.6


def prune_reason(window_rates: Sequence[float], best: float | None,
                 after: int = PRUNE_AFTER_WINDOWS, below: float = PRUNE_BELOW,
                 one_step_windows: bool = False) -> str | None:
    """Why a running trial should stop now, or None: its first ``after`` windows are all below
    ``below`` x the best trial's samples/sec; where each window is one whole step
    (``one_step_windows``), already its first window below ``PRUNE_BELOW_FIRST`` x the best."""
    if best is None or best <= 0 or not window_rates:
        return None
    if one_step_windows and window_rates[0] < PRUNE_BELOW_FIRST * best:
        return (f"its first window (one whole step) reached {window_rates[0]:.4g} samples/s, "
                f"below {PRUNE_BELOW_FIRST:.2f} x the best trial's {best:.4g}")
    if len(window_rates) < after:
        return None
    top = max(window_rates[:after])
    if top >= below * best:
        return None
    return (f"its first {after} windows reached at most {top:.4g} samples/s, below "
            f"{below:.2f} x the best trial's {best:.4g}")
