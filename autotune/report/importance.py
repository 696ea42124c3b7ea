"""Which searched knobs mattered for samples/sec: PED-ANOVA (no scikit-learn) over the measured
trials, ranked only where ranking can say something.

PED-ANOVA compares where each knob's values fall among the fastest trials with where they fall
among all of them. Two things make that comparison empty, and the panel then says so in words
instead of drawing bars: a knob that never changed (its estimators still differ a little, by
their prior alone, which once drew bars for knobs no trial ever moved), and too few trials for
a "fastest" set that is both more than one trial and a small part of the study.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autotune.tuner.record import TrialRecord

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

# The fastest set must hold at least two trials (one trial is a point, not a distribution) and
# be at most a quarter of the trials ranked (more and it is half the study, not its top): 2 /
# (1/4) = 8 trials with a measured rate. Below, the panel says how many more it needs.
TOP_TRIALS = 2
MIN_TRIALS = 8
# PED-ANOVA's own default: the fastest tenth. With 8 to 19 trials that is a single trial, so the
# quantile grows to hold TOP_TRIALS (1.5 / n: its ceiling is 2 whatever the rounding).
TARGET_QUANTILE = 0.1


@dataclass(frozen=True)
class Importance:
    """What the importance panel draws: knobs ranked (most important first, shares summing to
    1), the searched knobs that never changed among the ranked trials, and why nothing is
    ranked when nothing is."""

    ranked: tuple[tuple[str, float], ...]
    unvaried: tuple[str, ...]
    trials: int  # measured trials with a rate, the ones ranked over
    why_empty: str | None = None


def rank(records: Sequence[TrialRecord], frozen: Sequence[FrozenTrial],
         walked: int | None = None) -> Importance:
    """The importance of each searched knob that varied among the trials that measured a rate
    (ok, ran a process of their own), once there are ``MIN_TRIALS`` of them. ``frozen`` are the
    study's trials as Optuna holds them: their search distributions are what PED-ANOVA needs.
    ``walked``: the study's measured trials, where ``records`` are only its sampled ones (the
    rest walked one-knob changes, which such a statistic misreads: ``report.effects``)."""
    ran = [r for r in records if r.ran and r.ok and r.samples_per_sec]
    numbers = {r.number for r in ran}
    trials = [t for t in frozen if t.number in numbers and t.value is not None
              and math.isfinite(t.value)]
    varied, unvaried = _split_by_variation(ran, trials)
    n = len(trials)
    if n < MIN_TRIALS and walked is not None:
        return Importance((), unvaried, n, f"not ranked: {n} of the {walked} measured trials "
                          f"were sampled broadly (by the sampler); a statistical importance "
                          f"needs {MIN_TRIALS} such: the others walked one-knob changes, whose "
                          "effects the panel before this one shows as measured")
    if n < MIN_TRIALS:
        return Importance((), unvaried, n, f"not ranked yet: {n} measured trial(s) with a "
                          f"rate; ranking needs {MIN_TRIALS}, so that the fastest {TOP_TRIALS} "
                          "are at most a quarter of them")
    if not varied:
        return Importance((), unvaried, n, f"nothing to rank: no searched knob changed among "
                          f"the {n} measured trials")
    try:
        raw = _ped_anova(trials, varied)
    except Exception as exc:  # noqa: BLE001 - one panel short is no reason to lose the rest
        return Importance((), unvaried, n, str(exc).splitlines()[0] if str(exc)
                          else type(exc).__name__)
    total = sum(raw.values())
    if total <= 0:
        return Importance((), unvaried, n, "nothing to rank: the fastest trials' knob values "
                          "are spread like all the trials'")
    ranked = sorted(((k, v / total) for k, v in raw.items()), key=lambda kv: -kv[1])
    return Importance(tuple(ranked), unvaried, n)


def _split_by_variation(ran: Sequence[TrialRecord], trials: Sequence[FrozenTrial],
                        ) -> tuple[list[str], tuple[str, ...]]:
    """Searched knobs with at least two values among ``ran``, and those with one. A value is
    what ran (the config), so a suggestion a rule overrode does not count as a change."""
    configs = {r.number: r.config for r in ran}
    names = sorted({k for t in trials for k in t.distributions})
    varied: list[str] = []
    unvaried: list[str] = []
    for name in names:
        values = {getattr(configs[t.number], name, t.params.get(name)) for t in trials
                  if name in t.params}
        (varied if len(values) >= 2 else unvaried).append(name)
    return varied, tuple(unvaried)


def _ped_anova(trials: Sequence[FrozenTrial], params: list[str]) -> dict[str, float]:
    """PED-ANOVA's raw (unnormalised) importances of ``params`` over ``trials`` only: an
    in-memory study holds them, so repeats, ruled-out configs and failures stay out."""
    import optuna

    study = optuna.create_study(direction="maximize")
    study.add_trials(trials)
    quantile = max(TARGET_QUANTILE, (TOP_TRIALS - 0.5) / len(trials))
    evaluator = optuna.importance.PedAnovaImportanceEvaluator(target_quantile=quantile)
    with warnings.catch_warnings():
        # Regimes of a conditional knob with one trial: PED-ANOVA skips them and says so.
        warnings.simplefilter("ignore")
        return optuna.importance.get_param_importances(study, evaluator=evaluator,
                                                       params=params, normalize=False)
