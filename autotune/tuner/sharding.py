"""The memory model of sharding: each strategy's peak per rank before it runs, from measurements.

A rank's peak is what it holds for the model (parameters, gradients, optimizer state, and what a
strategy gathers or copies), plus its process (imports, buffers) and activations per sample:

  replicated     P + G + O, plus DDP's gradient buckets (G, unless gradients are bucket views)
                 and autocast's low-precision copy of the weights (P/2 under amp)
  shard-grad-op  (P + G + O) / S, plus every unit's parameters gathered from forward to backward
                 (P, halved under amp: FSDP gathers in the amp dtype), plus one unit's gradients
  full-shard     (P + G + O) / S, plus two units gathered (the one running and the one
  hybrid-shard   prefetched) and one unit's gradients; S is the ranks of a node for hybrid
  (sharded, CPU) plus P, measured rather than explained: without it full-shard read 13% under
                 its prediction (benchmarks/sharding_memory.py). Not the whole model built before
                 sharding: built on the meta device, a rank's peak after 3 steps is the same
                 (2.76 against 2.70 GiB, 103M parameters); its resident memory grows step by step
                 (gloo's collective buffers, or freed memory the allocator keeps).

P and G are the parameters' bytes (``trial.sizing`` counts them before any trial), O the
optimizer's state: from its class (AdamW: 2 x P) until a trial measures it after a step
(``trial.shard.model_state``), then measured. The rest, process plus activations, is fitted on
the trials that ran (any strategy: it does not depend on the strategy) as ``a + b x micro-batch``
per the knobs that change activations; before any trial, the sizing process's own memory with no
activations: a lower bound, said so. On CPU the limit holds for a node's ranks together (they
share its RAM), so the prediction is their sum there. Pure: the runner reads the study and passes
what it found.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from autotune.config.knobs import Config
from autotune.trial.measurement import Status
from autotune.tuner.search import Observation, fit_affine

# The order strategies are tried in: the least sharded first (sharding costs communication).
ORDER = ("replicated", "shard-grad-op", "full-shard", "hybrid-shard")
# Knobs that change activations per sample (the strategy does not).
_ACTIVATION_KNOBS = ("amp", "activation_checkpointing", "compile", "attention", "num_workers",
                     "prefetch_factor")


@dataclass(frozen=True)
class StrategyPeak:
    """A config's predicted peak: per rank, as the limit counts it (all ranks on CPU), and
    what it rests on."""

    per_rank: float
    counted: float  # what the limit is compared with
    state: float  # the model's part per rank
    basis: str
    lower_bound: bool  # no trial measured activations yet


def _key(config: Config) -> tuple[Any, ...]:
    data = config.to_dict()
    return tuple(data[n] for n in _ACTIVATION_KNOBS)


class ShardingModel:
    """Peak memory per sharding strategy, from the model's size and the trials that ran."""

    def __init__(self, size: Mapping[str, Any], observations: Sequence[Observation],
                 device: str, per_node: int) -> None:
        self.size, self.device, self.per_node = size, device, per_node
        self.param_bytes = float(size["param_bytes"])
        self.optimizer_bytes = self.param_bytes * int(size["states_per_param"])
        self.optimizer_basis = (f"{size['optimizer']}'s state assumed at "
                                f"{size['states_per_param']} x the parameters")
        measured = next((o for o in reversed(observations) if o.model_state), None)
        if measured is not None and measured.model_state is not None:
            group = self.shard_group(measured.config)
            self.optimizer_bytes = float(measured.model_state["optimizer_bytes"]) * group
            self.optimizer_basis = (f"{size['optimizer']}'s state measured in trial "
                                    f"{measured.number}")
        self._points: dict[tuple[Any, ...], list[tuple[int, float]]] = {}
        for o in observations:
            if o.predicted or o.status not in (Status.OK, Status.PRUNED) \
                    or o.peak_memory_bytes <= 0 or o.config.world_size < 2:
                continue
            rest = self.rank_peak(o.config, o.peak_memory_bytes) - self.state(o.config)
            self._points.setdefault(_key(o.config), []).append(
                (o.config.micro_batch_size, rest))

    def shard_group(self, config: Config) -> int:
        """The ranks one copy of the model is sharded over (1: replicated)."""
        if not config.sharded:
            return 1
        return self.per_node if config.sharding == "hybrid-shard" else config.world_size

    def _on_a_node(self, config: Config) -> int:
        """The ranks a CPU limit counts together: those of one node (they share its RAM)."""
        return min(config.world_size, self.per_node)

    def rank_peak(self, config: Config, peak: float) -> float:
        """One rank's share of a measured peak (on CPU the trial's tree holds a node's
        ranks)."""
        return peak / self._on_a_node(config) if self.device == "cpu" else peak

    def state(self, config: Config) -> float:
        """The model's bytes per rank under ``config``'s strategy (see the module's table)."""
        p, o = self.param_bytes, self.optimizer_bytes
        gathered = 0.5 if config.amp != "off" else 1.0
        unit = float(self.size["largest_unit_bytes"])
        if not config.sharded:
            buckets = 0.0 if config.ddp_gradient_as_bucket_view or config.world_size < 2 else p
            return p + p + o + buckets + (p / 2 if config.amp != "off" else 0.0)
        # Measured on CPU, not explained (see the module's table): one more P per rank.
        built = p if self.device == "cpu" else 0.0
        sharded = built + (p + p + o) / self.shard_group(config)
        if config.cpu_offload:
            sharded = 0.0  # held in host memory (CUDA only)
        if config.sharding == "shard-grad-op":
            return sharded + gathered * p + unit
        return sharded + gathered * 2 * unit + unit

    def predict(self, config: Config) -> StrategyPeak:
        """``config``'s peak by its strategy's state and the fitted rest."""
        state = self.state(config)
        points = self._points.get(_key(config), [])
        fit = fit_affine(points)
        if fit is not None:
            rest = fit.at(config.micro_batch_size)
            basis, lower = f"activations fitted on {len(points)} trials", False
        elif points:
            micro, rest = max(points)
            lower = config.micro_batch_size > micro
            basis = f"activations measured at micro-batch {micro}" + (
                " (a larger batch needs more)" if lower else "")
        else:
            rest = float(self.size["base_bytes"])
            basis, lower = "no activations measured yet: a lower bound", True
        rest = max(rest, 0.0)
        per_rank = state + rest
        counted = per_rank * self._on_a_node(config) if self.device == "cpu" else per_rank
        return StrategyPeak(per_rank, counted, state,
                            f"model state {state / 2**30:.2f} GiB per rank "
                            f"({self.optimizer_basis}), {basis}", lower)

    def words(self, config: Config, peak: StrategyPeak) -> str:
        """``replicated: predicted 9.80 GiB for the 2 ranks together``."""
        ranks = self._on_a_node(config)
        node = "" if ranks == config.world_size else " of a node"
        scope = f"for the {ranks} ranks{node} together" if self.device == "cpu" \
            and ranks > 1 else "per rank"
        at_least = "at least " if peak.lower_bound else ""
        return (f"{config.sharding}: predicted {at_least}{peak.counted / 2**30:.2f} GiB {scope} "
                f"at micro-batch {config.micro_batch_size}")


def next_strategy(tried: Sequence[str], searched: Sequence[Any],
                  holds: Callable[[str], float] | None = None) -> str | None:
    """The least sharded strategy the space searches that holds less than every one
    ``tried``: by the memory model's ``holds`` (a rank's state under a strategy) where there is
    one (hybrid-shard, sharded within a node only, holds more than full-shard across all),
    else in ``ORDER``."""
    left = [s for s in ORDER if s in searched and s not in tried]
    if holds is None:
        last = max((ORDER.index(t) for t in tried if t in ORDER), default=-1)
        return next((s for s in left if ORDER.index(s) > last), None)
    floor = min((holds(t) for t in tried), default=float("inf"))
    below = [s for s in left if holds(s) < floor]
    return max(below, key=holds) if below else None


def with_strategies(kind: str, text: str, evidence: dict[str, object], config: Config,
                    model: ShardingModel, observations: Sequence[Observation]
                    ) -> tuple[str, dict[str, object]]:
    """A memory-bound finding's text and evidence with what sharding would hold: each
    strategy's predicted peak at the config's batch, and its measured peak where a trial of
    the same config under it ran (the finding cites both, never a prediction as measured)."""
    if kind != "memory-bound" or config.world_size < 2:
        return text, evidence
    found: dict[str, object] = {}
    words = []
    for strategy in ORDER[:3]:
        other = replace(config, sharding=strategy)
        peak = model.predict(other)
        ran = max((o.peak_memory_bytes for o in observations if o.config == other
                   and not o.predicted and o.peak_memory_bytes), default=None)
        found[strategy] = {"predicted_bytes": int(peak.counted), "lower_bound": peak.lower_bound,
                           "measured_bytes": ran}
        shown = f"measured {ran / 2**30:.2f}" if ran else \
            f"predicted {'>= ' if peak.lower_bound else ''}{peak.counted / 2**30:.2f}"
        words.append(f"{strategy} {shown} GiB")
    return (f"{text}; sharding at this batch: {', '.join(words)}",
            {**evidence, "strategies": found})
