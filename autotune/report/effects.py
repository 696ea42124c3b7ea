"""What each knob did, as measured: every trial that changed one knob of an earlier one, read
against it. The staged search walks such one-knob changes (micro-batch, then precision, then
the diagnosis's remedies), so most of a study's trials answer "what did this knob do here"
directly; a statistical importance over them (PED-ANOVA) assumes a broad sample and misreads
the walk (a default run ranked loader workers first and precision last, while precision made
the run's gain: fp32 1.32 -> bf16 2.35 samples/s at the same batch).

Each knob's effect is its largest measured one: the child's rate over its parent's, the margin
their spreads allow (``tuner.confirmation.margin_of``, the confirmation's rule), and whether both
configs ran side by side in at least two rounds of the confirmation (then the ratio is of their
medians over the rounds both ran in; a config screened out after one round read once there, no
better than its search trial). The effects beyond the noise come first, the largest first. A
change to what the parent already ran as (``tuner.stages.running_as``) is no effect: skipped.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autotune.tuner.confirmation import Confirmation, margin_of
from autotune.tuner.record import TrialRecord
from autotune.tuner.stages import differs, parent_of, running_as


@dataclass(frozen=True)
class Effect:
    """One knob changed between two measured trials, and what it did."""

    knob: str
    before: Any
    after: Any
    parent: int  # trial numbers
    child: int
    ratio: float  # the child's rate over its parent's
    margin: float  # the lead the two trials' spreads allow
    confirmed: bool  # the ratio is of their confirmation medians (side by side)

    @property
    def beyond_noise(self) -> bool:
        return abs(self.ratio - 1.0) > self.margin

    def words(self) -> str:
        how = "side by side in the confirmation" if self.confirmed else "search trials"
        noise = "beyond the noise" if self.beyond_noise else "within the noise"
        return (f"{self.knob} {_show(self.knob, self.before)} -> "
                f"{_show(self.knob, self.after)} (trial "
                f"{self.parent} -> {self.child}): {self.ratio:.2f}x, {noise} (margin "
                f"{100 * self.margin:.1f}%; {how})")


def measured_effects(records: Sequence[TrialRecord],
                     confirmation: Confirmation | None = None) -> list[Effect]:
    """Each knob's largest measured effect, the largest first."""
    ran = [r for r in records if r.ran and r.ok and r.samples_per_sec and r.reused_from is None]
    obs = [r.observation() for r in ran]
    by_number = {r.number: r for r in ran}
    best: dict[str, Effect] = {}
    for o in obs:
        parent = parent_of(o, obs)
        if parent is None:
            continue
        (knob,) = differs(parent.config, o.config)
        child_r, parent_r = by_number[o.number], by_number[parent.number]
        if _runs_as(knob, parent_r) == _runs_as(knob, child_r):
            continue  # the same code twice: its ratio is the noise, not the knob's effect
        effect = _effect(knob, parent_r, child_r, confirmation)
        held = best.get(knob)
        if held is None or abs(math.log(effect.ratio)) > abs(math.log(held.ratio)):
            best[knob] = effect
    # Beyond the noise first: an effect its margin cannot tell from nothing never heads.
    return sorted(best.values(), key=lambda e: (not e.beyond_noise, -abs(math.log(e.ratio))))


def _effect(knob: str, parent: TrialRecord, child: TrialRecord,
            confirmation: Confirmation | None) -> Effect:
    rates = (parent.samples_per_sec or 0.0, child.samples_per_sec or 0.0)
    cvs = (parent.spread_cv or 0.0, child.spread_cv or 0.0)
    confirmed = False
    if confirmation is not None:
        a, b = confirmation.of(parent.number), confirmation.of(child.number)
        # The rounds both ran in (a config screened out after round 1 ran in that one only);
        # one round is one reading of each, no better than the search's: two at least.
        both = min(len(a.rates), len(b.rates)) if a is not None and b is not None else 0
        if a is not None and b is not None and both >= 2:
            paired = (statistics.median(a.rates[:both]), statistics.median(b.rates[:both]))
            if all(r > 0 and math.isfinite(r) for r in paired):  # a stored document: checked
                rates, cvs, confirmed = paired, (a.spread_cv, b.spread_cv), True
    return Effect(knob, getattr(parent.config, knob), getattr(child.config, knob),
                  parent.number, child.number, rates[1] / rates[0], margin_of(*cvs), confirmed)


def _runs_as(knob: str, record: TrialRecord) -> Any:
    """What the knob ran as in the trial: a ``default`` read back as what the model chose (BERT
    picks sdpa attention by itself; a run's panel read "attention default -> sdpa: 0.90x,
    beyond the noise", one reading each of the same code)."""
    found = running_as(record.config, record.measurement.applied)
    return found.get(knob, getattr(record.config, knob))


def sampled(records: Sequence[TrialRecord]) -> list[TrialRecord]:
    """The trials the sampler chose (not the baseline, the staged start, the diagnosis or a
    combination): the broad sample a statistical importance assumes."""
    return [r for r in records if not r.is_baseline and not r.stage]


def _show(knob: str, value: Any) -> str:
    if knob == "amp" and value == "off":
        return "fp32"
    return str(value).lower() if isinstance(value, bool) else str(value)
