"""A losing reading measured again before it counts, where its own windows say it was taken on
a moving machine.

The diagnosis tries one change of the incumbent and judges it by one reading against its
parent's: a change that read behind by more than the noise of one reading each is left behind
for good (neither the combination nor the ties retry it). A reading taken while the machine
slowed down or sped up can show it in its windows: a Xeon run read eager attention on its best
line at 5.33 samples/s (windows 5.09, 5.33, 6.08: +19% from first to last) against 7.08
without it, and its re-check read that config 15% ahead of the pick; two other runs read it at
7.16 and 7.55 and picked it. Such a trial, whose windows moved one way by more than twice the
search's noise, is measured once more, and the second reading stands in its place
(``StudySnapshot.observations``): it is taken independently of what chose it, so it does not
flatter the config the way the better of two readings would. A slow stretch its windows do not
show (a Zen 4 run read every trial of several minutes ~7% low, windows steady) is not caught.

Pure functions over what the study has measured; the runner queues the proposal."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from autotune.config.knobs import Config
from autotune.trial.measurement import Status
from autotune.tuner.search import Observation, Proposal, noise_of
from autotune.tuner.stages import BATCH, ONE_READING, differs, parent_of

# How far (in the search's noise) a trial's windows must move one way for its reading to be
# taken as one of a moving machine.
TREND = 2.0
# Whether an unsteady losing reading is measured again; a benchmark turns it off to compare.
REREAD = True
# A re-read costs a trial (40-60 s of a 6-minute search on the 2-core VMs): a study spends at
# most this many, the newest unsteady loser first.
MOST = 2


def unsteady_loser(observations: Sequence[Observation], best: float,
                   ruled_out: Callable[[Config], bool]) -> Proposal | None:
    """The newest trial that changed one knob (not the batch: a batch that read behind ends
    its line, and the neighbour rule tries the batches beside the best) of its parent, read
    behind it by more than the noise of one reading each (``stages.ONE_READING``), whose
    windows moved one way by more than ``TREND`` times the search's noise (``noise_of`` of the
    other trials), where the parent read within that one-reading noise of the ``best`` rate (so
    the change could still matter), and that was not measured again already: its config, to
    measure again. None when there is none, or the study spent its ``MOST`` re-reads."""
    oks = [o for o in observations if o.status == Status.OK and o.samples_per_sec
           and not o.predicted]
    if not REREAD or sum(o.reread for o in observations) >= MOST:
        return None
    for o in sorted(oks, key=lambda o: -o.number):
        parent = parent_of(o, oks)
        noise = noise_of([x for x in observations if x is not o])
        if parent is None or o.reread or o.trend is None or abs(o.trend) <= TREND * noise:
            continue
        (knob,) = differs(parent.config, o.config)
        one = max(noise, ONE_READING)
        mine, theirs = o.samples_per_sec or 0.0, parent.samples_per_sec or 0.0
        if knob in BATCH or mine * (1.0 + one) >= theirs or theirs * (1.0 + one) < best \
                or ruled_out(o.config):
            continue
        value = getattr(o.config, knob)
        shown = str(value).lower() if isinstance(value, bool) else str(value)
        return Proposal(o.config, f"re-read: trial {o.number} ({knob} {shown}) read "
                                  f"{mine:,.3g} against {theirs:,.3g} samples/s, its windows "
                                  f"moving {100 * o.trend:+.0f}% from first to last (the "
                                  f"search's noise {100 * noise:.0f}%): measured again before "
                                  "it counts",
                        reread_of=o.number)
    return None
