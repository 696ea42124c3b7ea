"""What a script's step reports give its trial's result beyond the windows: where its time went,
each rank's summary, and whether the measured steps are the config's at all (their sample
counts). ``trial.driver`` assembles the document (``trial.result``) from these, the same one a
built-in workload's trial writes, so the record, pruning and the confirmation treat both alike.

The steps are 1-based; warm-up ended with step ``warm_end``; window k spans steps
``warm_end + k * per_window + 1`` to ``warm_end + (k + 1) * per_window``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from autotune.trial.protocol import WindowStats
from autotune.trial.reports import MIN_STEP_S, RankReports, trial_end
from autotune.trial.result import RankSummary, Timings, Window


def how_to_report(ranks: Sequence[RankReports], reached: int) -> str:
    """The one of the three ways to report steps that fits what a script that reported none
    did, and what the bootstrap saw (``reached``: the Python processes it hooked; only that: a
    Trainer in a process it did not reach is unseen)."""
    if any(r.readback is not None for r in ranks):
        return ("its Trainer was reached (autotune reports its steps itself) but ran no "
                "optimizer step: does training start, with data?")
    seen = (f"none began training in the {reached} Python process(es) autotune's bootstrap "
            "reached" if reached else "autotune's bootstrap reached no Python process of it")
    return ("a Hugging Face or Lightning Trainer is reported by autotune itself once its "
            f"Trainer trains ({seen}); a plain PyTorch loop calls autotune.step() once per "
            "optimizer step on every rank (and leaves when autotune.should_stop())")


def timings(ranks: Sequence[RankReports], started: float, warm_end: int,
            measured_end: int) -> Timings:
    """Start-up (to the end of step 1: the script's imports, build and first step), warm-up,
    and the windows (to the end of step ``measured_end``), as far as the steps reached."""
    out: Timings = {}
    if min(len(r.ends) for r in ranks) == 0:
        return out
    first = trial_end(ranks, 1)
    out["startup_s"] = max(0.0, first - started)
    if warm_end:
        out["warmup_s"] = trial_end(ranks, warm_end) - first
    if measured_end > warm_end:
        out["measure_s"] = trial_end(ranks, measured_end) - trial_end(ranks, warm_end)
    return out


def rank_summary(r: RankReports, warm_end: int, per_window: int, windows: int) -> RankSummary:
    """Rank ``r`` over the trial's windows: its own seconds per window, and its own rate (the
    median over its windows) when every window took time."""
    bounds = [(warm_end + k * per_window, warm_end + (k + 1) * per_window)
              for k in range(windows)]
    spans = [r.ends[b - 1] - r.ends[a - 1] for a, b in bounds]
    entry: RankSummary = {"rank": r.index, "status": "ok", "window_seconds": spans,
                          "peak_memory_bytes": r.peak, "steps": len(r.ends)}
    if spans and all(x > 0 for x in spans):
        own: list[Window] = [{"samples": sum(r.samples[a:b]), "seconds": x}
                             for (a, b), x in zip(bounds, spans, strict=True)]
        entry["samples_per_sec"] = WindowStats(own).median
    return entry


def too_short(name: str, a: int, b: int, seconds: float) -> str:
    """Why steps ``a + 1`` to ``b``, ``seconds`` long on the slowest rank, are not a
    measurement (end times that do not advance once gave a rate of 4e11 samples/s)."""
    steps = f"step {b}" if b == a + 1 else f"steps {a + 1} to {b}"
    return (f"{name}: {steps} took {seconds:.3g}s on the slowest rank "
            f"({seconds / (b - a) * 1e6:.3g} us per step), shorter than reporting a step "
            f"takes ({MIN_STEP_S * 1e6:g} us): these end times were not measured")


def overcounted(ranks: Sequence[RankReports], expected: int, name: str) -> str | None:
    """The first step that counts more samples than the config's ``expected`` per rank (its
    micro-batch x accumulation): no step can train more, so its count is not real. A smaller
    count is a partial batch (an epoch's last). None when every step fits or nothing is
    expected."""
    if not expected:
        return None
    for r in ranks:
        for k, n in enumerate(r.samples):
            if n > expected:
                return (f"{name}: step {k + 1} of rank {r.index} counts {n} samples, more than "
                        f"the config's {expected} per rank and step (micro-batch x "
                        "accumulation) can hold: autotune.step(samples) counts this rank's "
                        "samples of one optimizer step")
    return None


def overridden(ranks: Sequence[RankReports], expected: int, name: str, a: int,
               b: int) -> str | None:
    """Why the measured steps ``a + 1`` to ``b`` are not of the trial's config: their samples
    per step and rank (the median, as the script counted them) differ from the config's
    ``expected``. None when they agree, were not counted, or nothing is expected."""
    if not expected or b <= a or any(r.default_samples for r in ranks):
        return None
    got = statistics.median(n for r in ranks for n in r.samples[a:b])
    if got == expected:
        return None
    shown = f"{got:g}"
    readback = next((r.readback for r in ranks if r.readback is not None), None)
    if readback is not None and "micro_batch_size" in readback["fixed"]:
        return (f"{name} trained {shown} samples per optimizer step on each rank, but the "
                f"config asks {expected}, and autotune cannot set the batch of its "
                f"{readback['via']} ({readback['fixed']['micro_batch_size']}): pass --param "
                f"batch={shown} (its own batch) to tune the rest")
    return (f"{name} trained {shown} samples per optimizer step on each rank, but the config "
            f"asks {expected}: it does not train with the profile's batch (dataloader_kwargs(), "
            f"hf_training_args()), so this is not that config's speed; if {shown} is the "
            f"script's own fixed batch, pass --param batch={shown} (autotune.step(samples) "
            "counts this rank's samples only)")
