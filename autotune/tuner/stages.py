"""The search led by what limits the incumbent: after the staged start (micro-batch x precision),
the knobs that address the incumbent's diagnosis, one change at a time, before TPE takes over.

  input-bound          -> loader workers, prefetch, pinned memory, CPU threads
  low MFU / compute    -> retained host memory, fused optimizer, TF32, attention, torch.compile
  unexplained          -> both of the above, loader workers first (no data wait reported)
  memory-bound         -> activation checkpointing, then a larger micro-batch with it; with
                          several ranks, the next more sharded strategy, then a larger batch
  communication-bound  -> bucket size, gradient views, static graph, NCCL algorithm/protocol

The diagnosis is read again after every trial (a change that wins becomes the incumbent, and its
own diagnosis leads on), so the stages read as a story: "input-bound at 72% data wait ->
num_workers 2". Pure functions over what the study has measured; the runner queues the proposals.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from typing import Any

from autotune.config.knobs import Config
from autotune.config.space import Choices, NarrowedSpace
from autotune.trial.measurement import Status
from autotune.tuner.diagnosis import Finding
from autotune.tuner.interval import PROCESS_CV
from autotune.tuner.record import TrialRecord
from autotune.tuner.search import Observation, Proposal, micro_values, noise_of, on_line
from autotune.tuner.sharding import ORDER

# What addresses each kind of finding, in the order it is tried. Retained host memory first
# (CPU): one plain trial; glibc's default faulted ~430,000 pages in per BERT step on a Xeon VM
# (a third of it). Compile last: its trials spend 45-70 s compiling (2-core VMs); on a short
# budget its values took the time before eager attention ran (picks 8-14% behind).
REMEDIES: dict[str, tuple[str, ...]] = {
    "input-bound": ("num_workers", "prefetch_factor", "pin_memory", "cpu_threads"),
    "low-mfu": ("malloc_retain", "optimizer_impl", "matmul_precision", "attention", "compile"),
    "compute-bound": ("malloc_retain", "optimizer_impl", "matmul_precision", "attention",
                      "compile"),
    # A script that does not report its data wait: either may be the limit.
    "unexplained": ("num_workers", "malloc_retain", "optimizer_impl", "prefetch_factor",
                    "matmul_precision", "attention", "compile", "pin_memory", "cpu_threads"),
    "memory-bound": ("activation_checkpointing",),
    "communication-bound": ("ddp_bucket_cap_mb", "ddp_gradient_as_bucket_view",
                            "ddp_static_graph", "nccl_algo", "nccl_proto"),
}
# The values of a knob in the order worth trying (the most likely win first); values a space
# searches but this does not name come after, in the space's order.
PREFERRED: dict[str, tuple[Any, ...]] = {
    "optimizer_impl": ("fused", "foreach", "for-loop"),
    "compile": ("default", "max-autotune-no-cudagraphs", "reduce-overhead"),
    "attention": ("sdpa", "flash_attention_2", "eager"),
    "matmul_precision": ("high",),
    "pin_memory": (True,),
    "malloc_retain": (True,),
    "prefetch_factor": (4,),
    "activation_checkpointing": (True,),
    "ddp_gradient_as_bucket_view": (True,),
    "ddp_static_graph": (True,),
}


def headline(kind: str, evidence: Mapping[str, Any]) -> str:
    """The finding in a few words, with the number that made it."""
    def pct(key: str) -> str:
        value = evidence.get(key)
        return f"{100 * value:.0f}%" if isinstance(value, int | float) else "?"

    return {
        "input-bound": f"input-bound at {pct('data_wait_share')} data wait",
        "communication-bound": f"communication-bound at {pct('comm_wait_share')} all-reduce wait",
        "memory-bound": f"memory-bound at {pct('share')} of the limit",
        "low-mfu": f"low MFU at {pct('mfu')}",
        "compute-bound": f"compute-bound at MFU {pct('mfu')}" if evidence.get("mfu") is not None
        else "compute-bound (MFU not measured)",
        "unexplained": "data wait not measured",
    }.get(kind, kind)


# Knobs whose gain is largest at a small batch, tried at the smallest batch of the incumbent's
# line that measured as fast as it (``smallest_as_fast``): a run tried fused AdamW at 32x1 bf16
# (no gain) where at 8x1, within the noise of 32x1 on its line, it was 6% faster than the winner;
# a Xeon run tried eager attention at 64x1 (26% slower side by side; 7% faster at 16x1).
AT_SMALLEST = ("optimizer_impl", "attention")

# Knobs whose remedy is one direction only: turning checkpointing off does not address memory.
ONE_WAY = ("pin_memory", "activation_checkpointing", "ddp_gradient_as_bucket_view",
           "ddp_static_graph", "matmul_precision", "malloc_retain")


def _values(knob: str, domain: Choices, current: Any) -> list[Any]:
    first = [v for v in PREFERRED.get(knob, ()) if v in domain.values]
    rest = [] if knob in ONE_WAY else [v for v in domain.values if v not in first]
    if knob in ("num_workers", "cpu_threads", "ddp_bucket_cap_mb"):
        # Counts: more first from where the incumbent stands, then fewer.
        rest = sorted(v for v in rest if v > current) + sorted(
            (v for v in rest if v < current), reverse=True)
    return [v for v in first + rest if v != current]


def running_as(config: Config, applied: Mapping[str, Any]) -> dict[str, str]:
    """What a config's ``default`` knobs ran as, read back in its trial (``applied``): the
    attention implementation the model chose (BERT picks sdpa by itself, so a trial of
    ``attention sdpa`` would measure the same code again)."""
    found = {}
    if config.attention == "default" and isinstance(applied.get("attention"), str):
        found["attention"] = applied["attention"]
    return found


def smallest_as_fast(incumbent: Config, rate: float, observations: Sequence[Observation],
                     noise: float) -> Config:
    """The smallest micro-batch of ``incumbent``'s line (the same knobs but the batch) that
    measured within ``noise`` of its ``rate``; the incumbent itself when none is smaller."""
    close = [o.config for o in observations
             if o.status == Status.OK and o.samples_per_sec and on_line(o.config, incumbent)
             and o.samples_per_sec * (1.0 + noise) >= rate]
    return min(close + [incumbent], key=lambda c: c.micro_batch_size)


def diagnosis_next(space: NarrowedSpace, incumbent: Config,
                   findings: Iterable[Finding], tried: Set[Config],
                   ruled_out: Callable[[Config], bool],
                   same: Mapping[str, Any] | None = None,
                   smallest_at: Config | None = None) -> Proposal | None:
    """The next one-knob change of ``incumbent`` that addresses its findings (in the
    diagnosis's order) and has not been measured (``tried``: every config the study ran or
    queued) nor is ``ruled_out`` (predicted OOM or too slow) nor what the incumbent already
    runs as (``same``: ``running_as``). An ``AT_SMALLEST`` knob changes ``smallest_at``
    instead (``smallest_as_fast``); a knob already at its first ``PREFERRED`` value comes
    last. None when every remedy the space allows was tried: the stage is over."""
    same = same or {}
    def base_for(knob: str) -> Config:
        return smallest_at if knob in AT_SMALLEST and smallest_at is not None else incumbent

    for finding in findings:
        kind = finding.kind
        words = headline(kind, finding.evidence)
        # A knob at its likeliest value (fused AdamW that won) waits for the other knobs: a run
        # tried foreach after fused had won, and its search ended before eager attention ran.
        for knob in sorted(REMEDIES.get(kind, ()), key=lambda k: k in PREFERRED
                           and getattr(base_for(k), k) == PREFERRED[k][0]):
            domain = space.searched.get(knob)
            if not isinstance(domain, Choices):
                continue
            base = base_for(knob)
            at = f" at micro-batch {base.micro_batch_size}" if base != incumbent else ""
            for value in _values(knob, domain, getattr(base, knob)):
                config = space.variant(base, **{knob: value})
                if config == base or config in tried or ruled_out(config) \
                        or (knob in same and same[knob] == value):
                    continue
                return Proposal(config, f"diagnosis: {words} -> {knob} {_show(value)}{at}")
        if kind == "memory-bound":
            # Checkpointing costs compute at the same batch; what it buys is a larger batch.
            # Once the checkpointed variant ran (or is the incumbent), try the next batch with it.
            ckpt = incumbent if incumbent.activation_checkpointing else \
                space.variant(incumbent, activation_checkpointing=True)
            if ckpt.activation_checkpointing and (ckpt == incumbent or ckpt in tried):
                larger = _larger_micro(space, ckpt)
                if larger is not None and larger not in tried and not ruled_out(larger):
                    return Proposal(larger, f"diagnosis: {words} -> micro-batch "
                                            f"{larger.micro_batch_size} with checkpointing")
            sharded = _more_sharded(space, incumbent, tried, ruled_out, words)
            if sharded is not None:
                return sharded
    return None


# How far apart two single readings of one config in two fresh processes fall by chance: twice
# the noise of a difference of two readings at ``interval.PROCESS_CV`` each (11%). The in-trial
# spread (``noise_of``, 2-6% on the 2-core VMs) misses what moves between processes: a run read
# fused AdamW 7% behind foreach (one trial each), which a re-check read 14% ahead.
ONE_READING = 2 * math.sqrt(2) * PROCESS_CV


def after_start(space: NarrowedSpace, best: TrialRecord, observations: Sequence[Observation],
                findings: Iterable[Finding], tried: Set[Config],
                ruled_out: Callable[[Config], bool],
                last: Callable[[Config], bool]) -> Proposal | None:
    """The search after the staged start, for the incumbent ``best``: a change left behind on
    one noisy reading, tried on its line (``combination``), else the next change that
    addresses what limits it (``diagnosis_next``), else it at a neighbouring batch
    (``neighbours``; that one first where the search's time holds one more such trial but not
    two: ``last``), else its own changes that tied with it, combined with the left-behind ones
    (``combination`` with ties). "Within the noise" here is of one reading each
    (``ONE_READING``, or the trials' own noise where larger)."""
    noise = noise_of(observations)
    one = max(noise, ONE_READING)  # the search chose on one reading of each of two processes
    neighbour = neighbours(observations, best.config, one, space, tried, ruled_out)
    if neighbour is not None and last(neighbour.config):
        return neighbour
    return combination(observations, best.config, one, space, tried, ruled_out) or \
        diagnosis_next(space, best.config, findings, tried, ruled_out,
                       running_as(best.config, best.measurement.applied),
                       smallest_as_fast(best.config, best.samples_per_sec or 0.0,
                                        observations, noise)) \
        or neighbour or combination(observations, best.config, one, space, tried, ruled_out,
                                    ties=True)


# Whether a change that read within the noise of the one the search went on with is tried on
# the incumbent's line (``combination``); a benchmark turns it off to compare.
COMBINE = True
BATCH = ("micro_batch_size", "grad_accum_steps")  # the staged start's lines, not a remedy


def combination(observations: Sequence[Observation], incumbent: Config, noise: float,
                space: NarrowedSpace, tried: Set[Config], ruled_out: Callable[[Config], bool],
                ties: bool = False) -> Proposal | None:
    """Changes the search left behind on one noisy reading, tried on the incumbent's line.

    The incumbent descends from the baseline by one-knob changes, each of which beat its
    parent (its line of descent: ``_descent``). Where a step's parent had another child (a
    change of its own) that read within ``noise`` of the child the search went on with, the
    search chose between the two on one reading each: that change is tried on the incumbent,
    alone and together with each other such change of another knob. With ``ties`` (once the
    diagnosis has nothing left), so are the changes of the incumbent itself that read within
    ``noise`` of it without beating it. A run went on with foreach AdamW (2.79 samples/s)
    over fused (2.75), then found eager attention on the foreach line; fused with eager, 4-9%
    faster in every re-check, was never measured. The first such config not yet measured
    (single changes first, the closest siblings first); None when there is none."""
    if not COMBINE:
        return None
    oks = [o for o in observations if o.status == Status.OK and o.samples_per_sec
           and not o.predicted]
    left: list[tuple[str, Any, str]] = []  # (knob, value, what it read against)
    for parent, child in _descent(oks, incumbent):
        (went,) = differs(parent.config, child.config)
        siblings = [s for s in oks if s.number > parent.number and s.config != child.config
                    and len(differs(parent.config, s.config)) == 1
                    and _rate(s) * (1.0 + noise) >= _rate(child)]
        for s in sorted(siblings, key=_rate, reverse=True):
            (knob,) = differs(parent.config, s.config)
            if knob not in BATCH:
                left.append((knob, getattr(s.config, knob),
                             f"{_rate(s):,.3g} vs {_rate(child):,.3g} samples/s for {went} "
                             f"{_show(getattr(child.config, went))}"))
    if ties:
        left += _ties(oks, incumbent, noise)
    pairs = [(a, b) for i, a in enumerate(left) for b in left[i + 1:] if a[0] != b[0]]
    for changes in [[a] for a in left] + [[a, b] for a, b in pairs]:
        config = space.variant(incumbent, **{k: v for k, v, _ in changes})
        if config == incumbent or config in tried or ruled_out(config):
            continue
        what = " + ".join(f"{k} {_show(v)}" for k, v, _ in changes)
        why = "; ".join(r for _, _, r in changes)
        together = "together " if len(changes) > 1 else ""
        return Proposal(config, f"combination: {what}, read within the noise of what the "
                                f"search went on with ({why}), tried {together}on the "
                                "incumbent's line")
    return None


def _ties(oks: Sequence[Observation], incumbent: Config,
          noise: float) -> list[tuple[str, Any, str]]:
    """The incumbent's own one-knob changes (its children) that read within ``noise`` of it
    without beating it, the closest first."""
    node = next((o for o in oks if o.config == incumbent), None)
    if node is None:
        return []
    found = []
    for o in sorted(oks, key=_rate, reverse=True):
        if o.number > node.number and parent_of(o, oks) is node \
                and _rate(o) * (1.0 + noise) >= _rate(node):
            (knob,) = differs(node.config, o.config)
            if knob not in BATCH:
                found.append((knob, getattr(o.config, knob),
                              f"{_rate(o):,.3g} vs {_rate(node):,.3g} samples/s on the "
                              "incumbent's line"))
    return found


# Whether the incumbent is tried at the neighbouring micro-batch its line's start read within
# the noise (``neighbours``); a benchmark turns it off to compare.
NEIGHBOURS = True


def neighbours(observations: Sequence[Observation], incumbent: Config, noise: float,
               space: NarrowedSpace, tried: Set[Config],
               ruled_out: Callable[[Config], bool]) -> Proposal | None:
    """The incumbent at a neighbouring micro-batch its knobs never ran at, where the search
    read that batch within ``noise`` of the incumbent's batch.

    The staged start chose the batch of each line on one reading per batch; the diagnosis then
    changes other knobs at that batch only, and a change that saves a fixed time per step (a
    fused optimizer) or per sample (an attention kernel) moves the best batch. A run chose
    micro-batch 8 on a lead within the noise of 16, went on to fused AdamW with eager
    attention at 8, and never measured them at 16, which a re-check read 5% faster. The
    evidence for each neighbour is the pair of configs nearest the incumbent (fewest knobs
    apart; the newest on a tie) that ran at both batches; the neighbour that read closest to
    (or furthest past) its pair first; None when no neighbour is left to try."""
    if not NEIGHBOURS:
        return None
    oks = [o for o in observations if o.status == Status.OK and o.samples_per_sec
           and not o.predicted]
    values = micro_values(space, incumbent)
    at = incumbent.micro_batch_size
    if at not in values:
        return None
    i = values.index(at)
    found: list[tuple[float, Config, str]] = []
    for n in values[max(0, i - 1):i] + values[i + 1:i + 2]:
        config = space.variant(incumbent, micro_batch_size=n)
        if config == incumbent or config in tried or ruled_out(config):
            continue
        pairs = [(a, b) for a in oks if a.config.micro_batch_size == at for b in oks
                 if b.config.micro_batch_size == n and on_line(b.config, a.config)]
        if not pairs:
            continue
        a, b = min(pairs, key=lambda p: (len(differs(p[0].config, incumbent)),
                                         -max(p[0].number, p[1].number)))
        ratio = _rate(b) / _rate(a)
        if ratio * (1.0 + noise) >= 1.0:
            found.append((ratio, config, f"{_rate(b):,.3g} vs {_rate(a):,.3g} samples/s "
                                         f"in trials {b.number} and {a.number}"))
    if not found:
        return None
    ratio, config, why = max(found, key=lambda f: f[0])
    return Proposal(config, f"neighbour: micro-batch {config.micro_batch_size} read within the "
                            f"noise of {at} ({why}), tried with the incumbent's knobs")


def _descent(oks: Sequence[Observation], incumbent: Config) -> list[tuple[Observation,
                                                                          Observation]]:
    """The incumbent's line of descent, newest step first, as long as each child beat its
    parent: a trial's parent is the earliest trial one knob away from it (the config it was
    changed from; its siblings, one knob away from it too, came after that)."""
    node = next((o for o in oks if o.config == incumbent), None)
    steps: list[tuple[Observation, Observation]] = []
    while node is not None:
        parent = parent_of(node, oks)
        if parent is None or _rate(parent) >= _rate(node):
            break
        steps.append((parent, node))
        node = parent
    return steps


def parent_of(child: Observation, oks: Sequence[Observation]) -> Observation | None:
    """The trial ``child`` changed one knob of: the earliest earlier trial of ``oks`` one knob
    away from it (a sibling, one knob away from it too, came after its parent)."""
    parents = [p for p in oks if p.number < child.number
               and len(differs(p.config, child.config)) == 1]
    return min(parents, key=lambda p: p.number, default=None)


def differs(a: Config, b: Config) -> list[str]:
    """The knobs whose values differ between two configs."""
    x, y = a.to_dict(), b.to_dict()
    return [k for k in x if x[k] != y.get(k)]


def _rate(o: Observation) -> float:
    return o.samples_per_sec or 0.0


def _more_sharded(space: NarrowedSpace, incumbent: Config, tried: Set[Config],
                  ruled_out: Callable[[Config], bool], words: str) -> Proposal | None:
    """Memory binds the incumbent: the next more sharded strategy at its batch (sharding holds
    less per rank, at the cost of communication), and once that ran, the larger batch it may
    make room for. Only with several ranks and sharding searched."""
    domain = space.searched.get("sharding")
    if not isinstance(domain, Choices) or incumbent.world_size < 2:
        return None
    at = ORDER.index(incumbent.sharding) if incumbent.sharding in ORDER else len(ORDER)
    for strategy in (s for s in ORDER[at + 1:] if s in domain.values):
        config = space.variant(incumbent, sharding=strategy)
        if ruled_out(config):
            continue
        if config not in tried:
            return Proposal(config, f"diagnosis: {words} -> sharding {strategy}")
        larger = _larger_micro(space, config)
        if larger is not None and larger not in tried and not ruled_out(larger):
            return Proposal(larger, f"diagnosis: {words} -> micro-batch "
                                    f"{larger.micro_batch_size} with sharding {strategy}")
    return None


def _larger_micro(space: NarrowedSpace, incumbent: Config) -> Config | None:
    domain = space.searched.get("micro_batch_size")
    if not isinstance(domain, Choices):
        return None
    bigger = sorted(v for v in domain.values if v > incumbent.micro_batch_size)
    return space.variant(incumbent, micro_batch_size=bigger[0]) if bigger else None


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)

