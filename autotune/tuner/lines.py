"""When a batch line of the staged start stops doubling, and where it steps down instead.

A line is one precision (and the baseline's other knobs) over the micro-batch; ``rates`` are its
measured samples/sec by micro-batch, ``noise`` the relative difference a win must exceed
(``search.noise_of``). Pure functions; ``search.staged_next`` walks the lines with them.
"""

from __future__ import annotations

from collections.abc import Callable

from autotune.config.knobs import Config

# A line whose MFU reached this share of its precision's measured peak is not doubled again:
# a larger batch has no compute left to gain.
NEAR_PEAK = 0.9


def line_done(nxt: int, seen: dict[int, bool], rates: dict[int, float],
              mfus: dict[int, float], pruned: set[int], noise: float) -> bool:
    """Whether a line stops before ``nxt``: two doublings did not beat its best before them by
    more than the noise, one lost more than twice the noise, its fastest batch's MFU is near
    its peak, or its largest batch that ran was pruned (clearly behind the best; a run doubled
    fp32 past a pruned 32x1, two minutes for nothing)."""
    top = max((m for m, fits in seen.items() if fits), default=None)
    if top is not None and nxt > top and top in pruned:
        return True
    return bool(rates) and nxt > max(rates) and (
        _gains_flat(rates, noise) or _lost(rates, noise)
        or mfus.get(max(rates), 0.0) >= NEAR_PEAK)


def no_gain(config: Config, rates: dict[int, float],
            fastest: Callable[[Config], float | None] | None, noise: float) -> bool:
    """Whether a batch beyond the line's measured ones cannot beat the line's best by more than
    the noise even at ``fastest`` (the samples/sec at the fast end of the step-time model's
    prediction; None where that model has no measured error). A run doubled bf16 32x1 (2.46
    samples/s, noise 6.7%, predicted 64x1 at 2.60 at most) and measured 64x1 at 2.29: 97 s
    for nothing."""
    if fastest is None or not rates or config.micro_batch_size <= max(rates):
        return False
    best = fastest(config)
    return best is not None and best < max(rates.values()) * (1.0 + noise)


def _lost(rates: dict[int, float], noise: float) -> bool:
    """Whether the line's last doubling lost more than twice the noise: not flat, slower (a
    run doubled bf16 past a 16x1 at 0.53x of its 8x1, and spent two minutes on 32x1)."""
    sizes = sorted(rates)
    if len(sizes) < 2:
        return False
    b, c = sizes[-2:]
    return c == 2 * b and rates[c] < rates[b] * (1 - 2 * noise)


def below_the_best(values: list[int], rates: dict[int, float], seen: dict[int, bool],
                   noise: float) -> int | None:
    """A line that started above its rate peak (a later precision starts at the batch the
    previous line fit) and was fastest at its smallest batch, by more than the noise: the next
    smaller batch, once per step down, until one is not faster."""
    if len(rates) < 2:
        return None
    sizes = sorted(rates)
    best = max(rates, key=lambda m: rates[m])
    if best != sizes[0] or rates[best] <= rates[sizes[1]] * (1 + noise):
        return None
    smaller = [v for v in values if v < best and v not in seen]
    return smaller[-1] if smaller else None


def _gains_flat(rates: dict[int, float], noise: float) -> bool:
    """Whether the last two doublings of the micro-batch each failed to beat the line's best
    before them by more than the noise (the micro-batch is no longer what limits the rate:
    the open-ended space stops growing here). The best before, not the batch before: a run
    read bf16 8x1 2.54, 16x1 2.12, 32x1 2.32 samples/s (32x1 gained on 16x1, not on 8x1) and
    spent two minutes on 64x1. Two, not one: a search trial's figure drifts by more than its
    windows' noise from one process to the next, and on the slow replay of the BERT grid
    (benchmarks/slow_replay.py, 10 seeds) stopping at the first flat doubling left a 14%
    regret at 8 minutes where two found the optimum (0%). Where the MFU says no compute is
    left, one doubling is the last (``NEAR_PEAK``)."""
    sizes = sorted(rates)
    if len(sizes) < 3:
        return False
    a, b, c = sizes[-3:]

    def flat(m: int) -> bool:
        return rates[m] < max(r for k, r in rates.items() if k < m) * (1 + noise)

    return b == 2 * a and c == 2 * b and flat(b) and flat(c)
