"""How trials are spent: the memory model, the staged start, the noise and early stop.

Pure functions over what the study has observed (``Observation``); ``runner.py`` runs the trials.

- **Memory model.** Peak memory is close to affine in the micro-batch size for fixed
  memory-relevant knobs (precision; DDP buckets; on CPU, where loader workers' memory counts, the
  loader knobs). Fitted per combination from the trials that ran; a config predicted above the
  limit minus the headroom is not run. After an OOM, no larger micro-batch with the same
  memory-relevant knobs is tried.
- **Staged start.** After the baseline (and, on a CPU, the baseline with glibc's freed memory
  retained, which the lines then carry unless it read slower), for each precision (the one with the
  most measured headroom first): the largest micro-batch that fits, by doubling from the
  baseline's, then bisection between the largest that fit and the smallest that did not (configs
  the memory model rules out count as not fitting, at no cost). A line stops doubling once two
  doublings did not beat its best before them by more than the noise, one lost more than twice the
  noise, its MFU is near its precision's measured peak, or the step-time model (fitted on three or
  more of its batches) says the next doubling cannot gain more than the noise even at its fast end;
  a precision whose measured peak is below what the best config already achieves is not searched.
- **Pruning.** A trial whose first windows are all clearly below the best is stopped
  (``tuner.pruning``).
- **Early stop.** When nothing beat the best by more than the noise for ``patience`` trials.
- **Winner.** Decided by the confirmation (``tuner.confirmation``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from autotune.config.knobs import Config
from autotune.config.space import Choices, NarrowedSpace
from autotune.trial.measurement import Status
from autotune.tuner.lines import NEAR_PEAK, below_the_best, line_done, no_gain

HEADROOM = 0.05  # an exported config peaks at least this share below the memory limit
NOISE_FLOOR = 0.02  # no measured difference below 2% is a win (see benchmarks/repeatability.py)
PATIENCE = 10

# Knobs that change peak memory besides the micro-batch. On CPU the trial's process tree is
# measured, so loader workers (separate processes) and their prefetched batches count too.
# Checkpointing trades memory for compute; compiling fuses kernels (fewer intermediates) and
# attention implementations differ in what they keep: each value has its own line.
_MEMORY_KNOBS = ("amp", "ddp_bucket_cap_mb", "ddp_gradient_as_bucket_view", "world_size",
                 "activation_checkpointing", "compile", "attention", "sharding",
                 "fsdp_reduce_dtype", "cpu_offload")
_HOST_MEMORY_KNOBS = ("num_workers", "prefetch_factor")


@dataclass(frozen=True)
class Observation:
    """What one trial of the study showed, as the search reads it."""

    config: Config
    status: Status
    samples_per_sec: float | None = None
    peak_memory_bytes: int = 0
    spread_cv: float | None = None
    predicted: bool = False  # skipped on the memory model's word: nothing ran
    number: int = -1
    mfu: float | None = None  # achieved FLOP/s over the measured peak of its precision
    peak_tflops: float | None = None  # the peak that MFU was taken against (per device)
    # What a rank held for the model after its first steps (``trial.shard.model_state``).
    model_state: Mapping[str, int] | None = None
    reread: bool = False  # a second reading of an unsteady trial, in its place (``rereads``)
    # Its windows' move from first to last, where they moved one way (last / first - 1); 0.0
    # where they went up and down; None with fewer than three windows.
    trend: float | None = None

    @property
    def achieved(self) -> float | None:
        """Achieved TFLOP/s per device (MFU x the peak it was taken against), when known."""
        return self.mfu * self.peak_tflops if self.mfu and self.peak_tflops else None

    @property
    def fits(self) -> bool:
        return self.status in (Status.OK, Status.PRUNED) and not self.predicted


def memory_key(config: Config, device: str) -> tuple[Any, ...]:
    names = _MEMORY_KNOBS + (_HOST_MEMORY_KNOBS if device == "cpu" else ())
    data = config.to_dict()
    return tuple(data[n] for n in names)


def _key_words(device: str) -> str:
    names = _MEMORY_KNOBS + (_HOST_MEMORY_KNOBS if device == "cpu" else ())
    return ", ".join(names)


@dataclass(frozen=True)
class Fit:
    intercept: float
    slope: float  # bytes per sample of micro-batch
    points: int

    def at(self, micro: int) -> float:
        return self.intercept + self.slope * micro


def fit_affine(points: Sequence[tuple[float, float]]) -> Fit | None:
    """Least squares peak = a + b * micro over (micro, peak) points; None with fewer than two
    distinct micro-batch sizes. The slope is never negative (more samples never need less)."""
    xs = [float(m) for m, _ in points]
    if len(set(xs)) < 2:
        return None
    ys = [float(p) for _, p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx)
    return Fit(my - slope * mx, slope, len(points))


class Strategies(Protocol):
    """The memory model of sharding (``tuner.sharding.ShardingModel``), as this one asks it."""

    def predict(self, config: Config) -> Any: ...
    def words(self, config: Config, peak: Any) -> str: ...
    def state(self, config: Config) -> float: ...


class MemoryModel:
    """Peak memory per memory-relevant knob combination, from the trials that ran; for a
    combination no two trials fitted yet, the memory model of sharding (``strategies``, with
    several ranks and a sized model) predicts it from the model's size."""

    def __init__(self, observations: Sequence[Observation], device: str, limit: int,
                 headroom: float = HEADROOM, strategies: Strategies | None = None) -> None:
        self.device, self.limit, self.headroom = device, limit, headroom
        self.strategies = strategies
        self._ok: dict[tuple[Any, ...], list[tuple[int, int]]] = {}
        self._oom: dict[tuple[Any, ...], int] = {}
        for o in observations:
            if o.predicted:
                continue
            key = memory_key(o.config, device)
            micro = o.config.micro_batch_size
            if o.status == Status.OOM:
                self._oom[key] = min(micro, self._oom.get(key, micro))
            elif o.status in (Status.OK, Status.PRUNED) and o.peak_memory_bytes > 0:
                self._ok.setdefault(key, []).append((micro, o.peak_memory_bytes))

    @property
    def budget(self) -> float:
        """Peak memory a config may reach: the limit less the headroom."""
        return self.limit * (1.0 - self.headroom)

    def fit(self, config: Config) -> Fit | None:
        return fit_affine(self._ok.get(memory_key(config, self.device), []))

    def predict(self, config: Config) -> float | None:
        fit = self.fit(config)
        return None if fit is None else fit.at(config.micro_batch_size)

    def verdict(self, config: Config) -> tuple[str, float | None] | None:
        """Why ``config`` should not run (reason, predicted peak), or None when it may."""
        key = memory_key(config, self.device)
        micro = config.micro_batch_size
        oom_at = self._oom.get(key)
        if oom_at is not None and micro >= oom_at:
            return (f"predicted-oom: micro-batch {micro} >= {oom_at}, which ran out of memory "
                    f"with the same {_key_words(self.device)}"), None
        fit = self.fit(config)
        if fit is None:
            return self.strategy_verdict(config)
        peak = fit.at(micro)
        if peak > self.budget:
            return (f"predicted-oom: peak {peak / 2**30:.2f} GiB at micro-batch {micro} (affine "
                    f"fit on {fit.points} trials with the same {_key_words(self.device)}) is above "
                    f"the limit less {100 * self.headroom:.0f}% headroom "
                    f"({self.budget / 2**30:.2f} GiB)"), peak
        return None


    def strategy_verdict(self, config: Config) -> tuple[str, float | None] | None:
        """The memory model of sharding's verdict alone (None: it fits, or no such model)."""
        if self.strategies is None or config.world_size < 2:
            return None
        peak = self.strategies.predict(config)
        if peak.counted <= self.budget:
            return None
        return (f"predicted-oom: {self.strategies.words(config, peak)} > the limit less "
                f"{100 * self.headroom:.0f}% headroom ({self.budget / 2**30:.2f} GiB; "
                f"{peak.basis})"), peak.counted


# -- staged start ---------------------------------------------------------------------------------


def micro_values(space: NarrowedSpace, baseline: Config) -> list[int]:
    domain = space.searched.get("micro_batch_size")
    if domain is None:
        return [baseline.micro_batch_size]
    if isinstance(domain, Choices):
        return sorted(int(v) for v in domain.values)
    return list(range(domain.low, domain.high + 1, domain.step))


def precisions(space: NarrowedSpace, baseline: Config,
               headroom: Mapping[str, float] | None = None) -> list[str]:
    """The precisions the space searches, the one with the most measured ``headroom`` first
    (its peak over what the baseline achieves: ``headroom_of``); without it, or on a tie,
    the baseline's first."""
    domain = space.searched.get("amp")
    others = [str(v) for v in domain.values] if isinstance(domain, Choices) else []
    order = [baseline.amp] + [p for p in others if p != baseline.amp]
    if not headroom:
        return order
    return sorted(order, key=lambda p: -headroom.get(p, 0.0))


def headroom_of(observations: Sequence[Observation], baseline: Config,
                peaks: Mapping[str, float]) -> dict[str, float]:
    """Per precision: its measured peak (``peaks``, TFLOP/s per device, the probe's) over the
    TFLOP/s the baseline achieved; empty until the baseline measured its MFU."""
    base = next((o for o in observations if o.config == baseline and o.status == Status.OK
                 and o.achieved), None)
    if base is None or base.achieved is None:
        return {}
    return {amp: peak / base.achieved for amp, peak in peaks.items() if peak}


def _beyond_reach(amp: str, observations: Sequence[Observation],
                  peaks: Mapping[str, float]) -> Observation | None:
    """A measured config of another precision that already achieves more FLOP/s than
    ``amp``'s line can reach (``NEAR_PEAK`` of its measured peak; a run had bf16 at 0.186
    TFLOP/s against fp32's peak of 0.1862, and spent four minutes on fp32 for nothing). (A
    config of the same precision above its own peak says the probe's peak is low.)"""
    peak = peaks.get(amp)
    if not peak:
        return None
    return next((o for o in observations if o.status == Status.OK and o.config.amp != amp
                 and o.achieved and o.achieved > NEAR_PEAK * peak), None)


def on_line(config: Config, line: Config) -> bool:
    """Whether ``config`` differs from ``line`` only in the micro-batch (and the accumulation
    that --global-batch derives from it)."""
    a, b = config.to_dict(), line.to_dict()
    for name in ("micro_batch_size", "grad_accum_steps"):
        a.pop(name), b.pop(name)
    return a == b


@dataclass(frozen=True)
class Proposal:
    config: Config
    stage: str  # what the proposal is for, shown to the user and kept on the trial
    reread_of: int | None = None  # the trial whose config it measures again (``rereads``)


def staged_next(space: NarrowedSpace, baseline: Config, observations: Sequence[Observation],
                model: MemoryModel, too_slow: Callable[[Config], bool] | None = None,
                peaks: Mapping[str, float] | None = None,
                fastest: Callable[[Config], float | None] | None = None) -> Proposal | None:
    """The next informed config, or None when the staged start is done.

    For each precision (the one with the most measured headroom first, with the probe's
    ``peaks``; else the baseline's): the micro-batch doubled until a config does not fit (OOM,
    predicted OOM, too slow to measure or ruled out by ``too_slow``: predicted too slow, or no
    room left in the run's time, or an error), two doublings did not beat the line's best by
    more than the noise, the line's MFU is near its peak, its largest batch was pruned
    (``lines.line_done``), or the next doubling cannot gain more than the noise even at the
    step-time model's ``fastest`` (``lines.no_gain``); then
    bisection between the largest that fit and the smallest that did not. The first line starts
    at the baseline's batch; later ones at the largest batch an earlier line fit, which saves
    the doublings up to it; a line whose fastest batch is its smallest then steps down until a
    smaller batch is slower. A precision whose line cannot reach what a measured config already
    achieves (``_beyond_reach``) is skipped: it cannot win. On a CPU the lines first get
    glibc's freed memory retained (``host_memory``).
    """
    values = micro_values(space, baseline)
    if len(values) < 2:
        return None
    start = _nearest(values, baseline.micro_batch_size)
    noise = noise_of(observations)
    peaks = peaks or {}
    host = host_memory(space, baseline, observations, noise, lambda c: bool(
        model.verdict(c) or (too_slow is not None and too_slow(c))))
    if isinstance(host, Proposal):
        return host
    for amp in precisions(space, baseline, headroom_of(observations, baseline, peaks)):
        line = space.variant(host, amp=amp)
        with_amp = f" with amp {amp}" if amp != "off" else ""
        if _beyond_reach(amp, observations, peaks) is not None:
            continue  # a config measured already achieves more than this precision's peak
        seen: dict[int, bool] = {}
        rates: dict[int, float] = {}
        mfus: dict[int, float] = {}
        pruned: set[int] = set()
        for o in observations:
            if on_line(o.config, line):
                micro = o.config.micro_batch_size
                seen[micro] = seen.get(micro, False) or o.fits
                if o.fits and o.status == Status.PRUNED:
                    pruned.add(micro)
                if o.fits and o.status == Status.OK and o.samples_per_sec:
                    rates[micro] = max(rates.get(micro, 0.0), o.samples_per_sec)
                    if o.mfu:
                        mfus[micro] = o.mfu
        while (nxt := _next_micro(values, seen, start)) is not None:
            if line_done(nxt, seen, rates, mfus, pruned, noise):
                break
            config = space.variant(line, micro_batch_size=nxt)
            if model.verdict(config) or (too_slow is not None and too_slow(config)):
                seen[nxt] = False  # ruled out by a model: no trial needed
                continue
            if no_gain(config, rates, fastest, noise):
                break
            return Proposal(config, f"staged: largest micro-batch that fits{with_amp}")
        below = below_the_best(values, rates, seen, noise)
        if below is not None:
            config = space.variant(line, micro_batch_size=below)
            if not model.verdict(config) and not (too_slow is not None and too_slow(config)):
                return Proposal(config, f"staged: the line's fastest is its smallest batch: "
                                        f"micro-batch {below}{with_amp}")
        start = max((m for m, fits in seen.items() if fits), default=start)
    return None


def host_memory(space: NarrowedSpace, baseline: Config, observations: Sequence[Observation],
                noise: float, ruled_out: Callable[[Config], bool]) -> Config | Proposal:
    """What the lines start from: the baseline, or the baseline with glibc's freed memory
    retained (``malloc_retain``) where the space searches it (a CPU): that first, one trial
    (unless ``ruled_out``), then the lines carry it unless it read slower than the baseline by
    more than ``noise``. Under glibc's default, one config read 3.33 to 5.49 samples/s in
    different processes (BERT on a 2-core Xeon VM: ~430,000 page faults per step, or none, by
    the process's allocation history); a line read 16x1 bf16 below 8x1 on such readings and
    never measured the winner's knobs at 16, 17% faster once retained. A tie goes to the knob:
    its readings are the steady ones."""
    domain = space.searched.get("malloc_retain")
    if baseline.malloc_retain or not isinstance(domain, Choices) or True not in domain.values:
        return baseline
    kept = space.variant(baseline, malloc_retain=True)
    ran = [o for o in observations if o.config == kept]
    if not ran:
        if ruled_out(kept):
            return baseline
        return Proposal(kept, "staged: glibc keeps freed host memory (malloc_retain true) "
                              "for steady readings on the lines")
    rate = max((o.samples_per_sec or 0.0 for o in ran if o.status == Status.OK), default=0.0)
    base = max((o.samples_per_sec or 0.0 for o in observations
                if o.config == baseline and o.status == Status.OK), default=0.0)
    return kept if rate and rate * (1.0 + noise) >= base else baseline


def _nearest(values: list[int], target: int) -> int:
    return min(values, key=lambda v: (abs(v - target), v))


def _next_micro(values: list[int], seen: dict[int, bool], start: int) -> int | None:
    if start not in seen:
        return start
    fit = [m for m, ok in seen.items() if ok]
    largest = max(fit, default=None)
    above = [m for m, ok in seen.items() if not ok and (largest is None or m > largest)]
    ceiling = min(above, default=None)
    if largest is None:  # nothing fits yet: halve below the smallest that did not
        between = [v for v in values if v < (ceiling or 0) and v not in seen]
    elif ceiling is None:  # no wall yet: double
        bigger = [v for v in values if v >= 2 * largest and v not in seen]
        if bigger:
            return bigger[0]
        between = [v for v in values if v > largest and v not in seen]
        return between[-1] if between else None
    else:  # bisect between the largest that fit and the smallest that did not
        between = [v for v in values if largest < v < ceiling and v not in seen]
    if not between:
        return None
    return between[len(between) // 2] if largest is not None else between[(len(between) - 1) // 2]


# -- noise, pruning, early stop -------------------------------------------------------------------


def noise_of(observations: Sequence[Observation]) -> float:
    """The relative difference a win must exceed: twice the typical in-trial spread, at least
    ``NOISE_FLOOR``."""
    cvs = [o.spread_cv for o in observations if o.status == Status.OK and o.spread_cv is not None]
    return max(NOISE_FLOOR, 2 * statistics.median(cvs)) if cvs else NOISE_FLOOR


def since_improvement(observations: Sequence[Observation], noise: float) -> int:
    """Measured trials since the last one that beat the best before it by more than ``noise``."""
    best, count = 0.0, 0
    for o in observations:
        if o.predicted:
            continue
        count += 1
        value = o.samples_per_sec if o.status == Status.OK else None
        if value is not None and value > best * (1.0 + noise):
            count = 0
        if value is not None:
            best = max(best, value)
    return count
