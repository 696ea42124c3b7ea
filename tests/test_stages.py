"""The search led by what limits the incumbent (pure: crafted findings, no trial runs here), and
the open-ended micro-batch of the default space."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from optuna.trial import TrialState

from autotune.config.knobs import DECLARED, Config
from autotune.config.space import load_space, narrow, parse_space
from autotune.testing.hardware import fake_cpu, fake_gpus
from autotune.trial.measurement import Measurement, Status
from autotune.tuner.budget import StepTimeModel
from autotune.tuner.diagnosis import Finding
from autotune.tuner.record import TrialRecord, read_trial
from autotune.tuner.reporting import story
from autotune.tuner.search import MemoryModel, Observation, staged_next
from autotune.tuner.stages import (
    ONE_READING,
    REMEDIES,
    after_start,
    combination,
    diagnosis_next,
    neighbours,
    running_as,
    smallest_as_fast,
)

GPU_SPACE = narrow(load_space("default"), fake_gpus(2), 2, Config(world_size=2),
                   supports=DECLARED)


def finding(kind: str, **evidence: Any) -> Finding:
    return Finding(kind, kind, evidence)


def never(config: Config) -> bool:
    return False


def test_each_kind_of_limit_is_addressed_by_its_own_knobs_first() -> None:
    base = GPU_SPACE.variant(Config(world_size=2), micro_batch_size=32, amp="bf16")
    first = {kind: diagnosis_next(GPU_SPACE, base, [finding(kind, **ev)], set(), never)
             for kind, ev in (("input-bound", {"data_wait_share": 0.72}),
                              ("low-mfu", {"mfu": 0.07}),
                              ("memory-bound", {"share": 0.93}),
                              ("communication-bound", {"comm_wait_share": 0.3}))}
    assert first["input-bound"].stage == \
        "diagnosis: input-bound at 72% data wait -> num_workers 1"  # type: ignore[union-attr]
    assert first["low-mfu"].stage == \
        "diagnosis: low MFU at 7% -> optimizer_impl fused"  # type: ignore[union-attr]
    assert first["memory-bound"].config.activation_checkpointing  # type: ignore[union-attr]
    assert first["communication-bound"].stage.endswith(  # type: ignore[union-attr]
        "-> ddp_bucket_cap_mb 50")
    for proposal in first.values():  # one knob changed, the rest is the incumbent
        assert proposal is not None
        changed = {k for k, v in proposal.config.to_dict().items() if base.to_dict()[k] != v}
        assert len(changed - {"prefetch_factor"}) == 1, changed  # prefetch comes with workers


def test_an_unexplained_config_tries_loader_and_compute_knobs_in_turn() -> None:
    # A script that reports no data wait: not diagnosed, so both kinds of remedy are tested.
    base = GPU_SPACE.variant(Config(), micro_batch_size=32, amp="bf16")
    tried: set[Config] = set()
    knobs: list[str] = []
    while (proposal := diagnosis_next(GPU_SPACE, base, [finding("unexplained")], tried,
                                      never)) is not None:
        assert proposal.stage.startswith("diagnosis: data wait not measured -> ")
        knob = proposal.stage.split("-> ")[1].split()[0]
        knobs += [knob] if knob not in knobs else []
        tried.add(proposal.config)
    assert knobs[:2] == ["num_workers", "optimizer_impl"]  # loader first, then compute
    assert {"compile", "pin_memory"} <= set(knobs) <= set(REMEDIES["unexplained"])
    # Without an MFU figure a compute-bound headline says so, not "MFU ?".
    proposal = diagnosis_next(GPU_SPACE, base, [finding("compute-bound", mfu=None)], set(), never)
    assert proposal is not None and \
        proposal.stage.startswith("diagnosis: compute-bound (MFU not measured) -> ")


def test_a_stage_walks_its_remedies_and_ends_when_all_were_tried() -> None:
    base = GPU_SPACE.variant(Config(world_size=2), micro_batch_size=32, amp="bf16")
    low = [finding("low-mfu", mfu=0.07)]
    tried: set[Config] = set()
    stages = []
    while (p := diagnosis_next(GPU_SPACE, base, low, tried, never)) is not None:
        tried.add(p.config)
        stages.append(p.stage.split("-> ")[1])
    assert stages[:3] == ["optimizer_impl fused", "optimizer_impl for-loop",
                          "matmul_precision high"]
    assert "attention sdpa" in stages and "compile default" in stages
    # The changes that cost no compiling come first.
    kinds = [x.split()[0] for x in stages]
    assert max(i for i, k in enumerate(kinds) if k == "attention") < kinds.index("compile")
    assert len(stages) == len(set(stages))


def test_a_knob_already_at_its_likeliest_value_waits_for_the_other_knobs() -> None:
    """A Zen 4 run: fused AdamW won at 8x1 and the diagnosis tried foreach next; the search
    ended before eager attention ran. With the incumbent on fused, attention goes first, and
    the optimizer's other values come once the other knobs were tried."""
    fused = CPU_BF16.variant(Config(), micro_batch_size=8, amp="bf16", optimizer_impl="fused",
                             malloc_retain=True)
    low = [finding("low-mfu", mfu=0.2)]
    tried: set[Config] = set()
    stages = []
    while (p := diagnosis_next(CPU_BF16, fused, low, tried, never,
                               {"attention": "sdpa"})) is not None:
        tried.add(p.config)
        stages.append(p.stage.split("-> ")[1])
    assert stages[0] == "attention eager", stages
    assert stages.index("optimizer_impl foreach") > stages.index("attention eager")
    # An incumbent on the default optimizer tries its values first, as before.
    plain = CPU_BF16.variant(fused, optimizer_impl="default")
    first = diagnosis_next(CPU_BF16, plain, low, set(), never, {"attention": "sdpa"})
    assert first is not None and first.stage.endswith("-> optimizer_impl fused")


def test_a_change_to_what_the_incumbent_already_runs_as_is_not_proposed() -> None:
    """BERT's ``attention: default`` runs sdpa (read back in its trial): a trial of ``attention
    sdpa`` would measure the same code again, so the stage goes on to eager."""
    base = GPU_SPACE.variant(Config(world_size=2), micro_batch_size=32, amp="bf16")
    same = running_as(base, {"attention": "sdpa", "threads": 2})
    assert same == {"attention": "sdpa"}
    low = [finding("low-mfu", mfu=0.07)]
    tried: set[Config] = set()
    stages = []
    while (p := diagnosis_next(GPU_SPACE, base, low, tried, never, same)) is not None:
        tried.add(p.config)
        stages.append(p.stage.split("-> ")[1])
    assert "attention sdpa" not in stages and "attention eager" in stages
    # Set explicitly, or not read back (not a transformers model): nothing is assumed.
    assert running_as(GPU_SPACE.variant(base, attention="eager"), {"attention": "sdpa"}) == {}
    assert running_as(base, {"attention": None}) == {}


def test_ruled_out_changes_are_skipped_and_checkpointing_leads_to_a_larger_batch() -> None:
    base = GPU_SPACE.variant(Config(world_size=2), micro_batch_size=32, amp="bf16",
                             activation_checkpointing=True)
    mem = [finding("memory-bound", share=0.95)]
    p = diagnosis_next(GPU_SPACE, base, mem, set(), never)
    assert p is not None and p.config.micro_batch_size == 64
    assert p.config.activation_checkpointing
    # No larger batch fits with checkpointing: with two ranks, memory binds -> sharding.
    sharded = diagnosis_next(GPU_SPACE, base, mem, set(), lambda c: c.micro_batch_size > 32)
    assert sharded is not None and sharded.config.sharding == "shard-grad-op"
    assert sharded.stage.endswith("-> sharding shard-grad-op")
    assert sharded.config.micro_batch_size == 32 and sharded.config.activation_checkpointing
    assert diagnosis_next(GPU_SPACE, base, mem, set(), lambda c: c.micro_batch_size > 32
                          or c.sharding != "replicated") is None
    # From an incumbent without it: checkpointing first, then (once that ran, whatever it
    # measured at the same batch) the larger batch it is for.
    plain = GPU_SPACE.variant(Config(world_size=2), micro_batch_size=32, amp="bf16")
    first = diagnosis_next(GPU_SPACE, plain, mem, set(), never)
    assert first is not None and first.config.activation_checkpointing
    assert first.config.micro_batch_size == 32
    then = diagnosis_next(GPU_SPACE, plain, mem, {first.config}, never)
    assert then is not None and then.config.micro_batch_size == 64
    assert then.config.activation_checkpointing
    assert then.stage.endswith("-> micro-batch 64 with checkpointing")


def test_memory_binds_with_ranks_and_sharding_makes_room_for_a_larger_batch() -> None:
    """With checkpointing out of the space: the next more sharded strategy at the same batch,
    then the larger batch with it; the sharding after it where that batch cannot fit."""
    space = GPU_SPACE.fix({"activation_checkpointing": "test"}, Config(world_size=2))
    base = space.variant(Config(world_size=2), micro_batch_size=32, amp="bf16")
    mem = [finding("memory-bound", share=0.97)]
    first = diagnosis_next(space, base, mem, set(), never)
    assert first is not None and (first.config.sharding, first.config.micro_batch_size) == (
        "shard-grad-op", 32)
    then = diagnosis_next(space, base, mem, {first.config}, never)
    assert then is not None and (then.config.sharding, then.config.micro_batch_size) == (
        "shard-grad-op", 64)
    assert then.stage.endswith("-> micro-batch 64 with sharding shard-grad-op")
    full = diagnosis_next(space, base, mem, {first.config}, lambda c: c.micro_batch_size > 32)
    assert full is not None and full.config.sharding == "full-shard"
    one = narrow(load_space("default"), fake_gpus(1), 1, Config())
    assert diagnosis_next(one, one.variant(Config(), micro_batch_size=32), mem, set(),
                          lambda c: c.activation_checkpointing) is None  # one rank: no sharding


def test_the_optimizer_and_attention_are_tried_at_the_smallest_batch_as_fast_as_the_best(
) -> None:
    # The bf16 line of a default run: 8x1 2.41, 16x1 2.50, 32x1 2.56 samples/s, noise 9%; a
    # fused optimizer saves a fixed time per step, which weighs most at 8x1.
    cpu = narrow(load_space("default"), fake_cpu(2), 1, Config(), supports=DECLARED)
    line = cpu.variant(Config(), amp="bf16")
    rates = {8: 2.41, 16: 2.50, 32: 2.56}
    obs = [Observation(cpu.variant(line, micro_batch_size=m), "ok", r, 2**30, spread_cv=0.045)
           for m, r in rates.items()]
    obs.append(Observation(Config(micro_batch_size=8), "ok", 1.45, 2**30))  # fp32: another line
    incumbent = obs[2].config
    at = smallest_as_fast(incumbent, 2.56, obs, noise=0.09)
    assert at == obs[0].config
    low = [finding("compute-bound", mfu=0.53)]
    # On a CPU, retained host memory first, on the incumbent itself.
    p = diagnosis_next(cpu, incumbent, low, set(), never, smallest_at=at)
    assert p is not None and p.config == cpu.variant(incumbent, malloc_retain=True)
    retained = {p.config}
    p = diagnosis_next(cpu, incumbent, low, retained, never, smallest_at=at)
    assert p is not None and p.config == cpu.variant(at, optimizer_impl="fused")
    assert p.stage == "diagnosis: compute-bound at MFU 53% -> optimizer_impl fused at micro-batch 8"
    # With the optimizer's values tried, the attention comes next, at 8x1 too (eager
    # attention's cost grows faster than the batch); compiling, last, changes the incumbent.
    tried = retained | {cpu.variant(at, optimizer_impl=v) for v in ("fused", "foreach")}
    p = diagnosis_next(cpu, incumbent, low, tried, never, smallest_at=at)
    assert p is not None and p.config == cpu.variant(at, attention="sdpa")
    assert p.stage.endswith("-> attention sdpa at micro-batch 8")
    tried |= {cpu.variant(at, attention=v) for v in ("sdpa", "eager")}
    p = diagnosis_next(cpu, incumbent, low, tried, never, smallest_at=at)
    assert p is not None and p.config == cpu.variant(incumbent, compile="default")
    # Where the smaller batches read slower by more than the noise, the incumbent is the place.
    assert smallest_as_fast(incumbent, 2.56, obs, noise=0.02) == incumbent
    assert smallest_as_fast(incumbent, 2.56, obs, noise=0.03) == obs[1].config


def test_the_story_reads_each_diagnosis_stage_with_its_speedup() -> None:
    from optuna.trial import TrialState

    def trial(stage: str | None, status: str, samples_per_sec: float | None) -> TrialRecord:
        return TrialRecord(number=0, state=TrialState.COMPLETE, config=Config(), status=status,
                           reason=None, stage=stage,
                           measurement=Measurement(status, samples_per_sec=samples_per_sec))

    trials = [trial(None, "ok", 10.0),
              trial("staged: largest micro-batch that fits", "ok", 20.0),
              trial("diagnosis: input-bound at 72% data wait -> num_workers 8", "ok", 31.0),
              trial("diagnosis: low MFU at 9% -> compile default", "timeout", None),
              trial("neighbour: micro-batch 16 read within the noise of 8 (...)", "ok", 33.0)]
    assert story(trials, 10.0) == ["input-bound at 72% data wait -> num_workers 8: 3.10x",
                                   "low MFU at 9% -> compile default: no result",
                                   "neighbour: micro-batch 16 read within the noise of 8 (...): "
                                   "3.30x"]


def test_the_default_space_does_not_cap_the_micro_batch() -> None:
    space = narrow(load_space("default"), fake_gpus(1, memory_gib=141), 1, Config())
    assert max(space.searched["micro_batch_size"].values) >= 65536  # type: ignore[union-attr]


def _line_space(amps: tuple[str, ...] = ("off",)) -> Any:
    knobs: dict[str, Any] = {"micro_batch_size": {"choices": [4, 8, 16, 32, 64, 128, 256, 512]}}
    if len(amps) > 1:
        knobs["amp"] = {"choices": list(amps)}
    return narrow(parse_space({"knobs": knobs}, "t", "<test>"), fake_cpu(bf16=True), 1,
                  Config(micro_batch_size=8))


def test_doubling_stops_when_two_doublings_gain_less_than_the_noise_or_mfu_is_near_peak(
        ) -> None:
    """... or when one lost clearly."""
    space = _line_space()
    model = MemoryModel([], "cpu", 100 * 2**30)

    def run(rates: dict[int, float], mfu: float | None = None) -> int | None:
        obs = [Observation(Config(micro_batch_size=m), "ok", r, 2**30, spread_cv=0.01, mfu=mfu,
                           peak_tflops=1.0 if mfu else None)
               for m, r in rates.items()]
        p = staged_next(space, Config(micro_batch_size=8), obs, model)
        return None if p is None else p.config.micro_batch_size

    assert run({8: 100.0, 16: 180.0, 32: 300.0}) == 64  # still gaining: double again
    assert run({8: 100.0, 16: 101.0, 32: 100.5}) is None  # two flat doublings: stop
    # One flat doubling is not enough: a search trial drifts by more than its windows' noise.
    assert run({8: 100.0, 16: 180.0, 32: 181.0}) == 64
    # Flat against the line's best before it, not the batch before: 32 gained on 16, not on 8;
    # no 64, the line steps down from its fastest, 8.
    assert run({8: 2.54, 16: 2.12, 32: 2.32}) == 4
    # Gaining, but the MFU is near the precision's measured peak: no compute left to gain.
    assert run({8: 100.0, 16: 180.0}, mfu=0.95) is None
    assert run({8: 100.0, 16: 180.0}, mfu=0.5) == 32
    # The line's fastest is its smallest batch, by more than the noise, two doublings on: step
    # down once.
    assert run({8: 100.0, 16: 90.0, 32: 85.0}) == 4
    # A doubling that lost more than twice the noise is the line's last (a run doubled bf16
    # past a 16x1 at 0.53x of its 8x1): the line steps down instead. A loss within it doubles on.
    assert run({8: 100.0, 16: 53.0}) == 4
    assert run({8: 100.0, 16: 97.0}) == 32


def test_doubling_stops_where_the_step_time_model_says_it_cannot_gain_more_than_the_noise(
        ) -> None:
    """A run's bf16 line: 8x1 3.71 s a step, 16x1 6.87 s, 32x1 13.0 s (in-trial spreads 6.9%,
    4.1%, 1.2%: noise 8.2%). The fit over the three predicts 64x1 at ~25.4 s, 2.5-2.6
    samples/s at its fast end, within the noise of 32x1's 2.46: the line is not doubled again
    (the run spent 97 s measuring 64x1 at 2.29). Where the fit still predicts a gain, or rests
    on two batches only (its error assumed), the line doubles on."""
    space = _line_space()
    model = MemoryModel([], "cpu", 100 * 2**30)
    base = Config(micro_batch_size=8)

    def run(steps: dict[int, float], cvs: tuple[float, ...] = (0.069, 0.041, 0.012)
            ) -> int | None:
        obs = [Observation(Config(micro_batch_size=m), "ok", m / s, 2**30, spread_cv=cv)
               for (m, s), cv in zip(steps.items(), cvs, strict=False)]
        p = staged_next(space, base, obs, model, fastest=StepTimeModel(obs).fastest)
        return None if p is None else p.config.micro_batch_size

    ran = {8: 3.71, 16: 6.87, 32: 13.0}
    assert run(ran) is None
    obs = [Observation(Config(micro_batch_size=m), "ok", m / s, 2**30, spread_cv=0.01)
           for m, s in ran.items()]
    p = staged_next(space, base, obs, model)  # without the model: one flat doubling, go on
    assert p is not None and p.config.micro_batch_size == 64
    assert run({8: 4.0, 16: 5.0, 32: 7.0}) == 64  # a large intercept: doubling still pays
    assert run({8: 3.71, 16: 6.87}) == 32  # two batches: the error is not measured yet


def test_the_precision_with_the_most_measured_headroom_goes_first() -> None:
    """The baseline (fp32) reaches 56% of the measured fp32 peak; bf16's measured peak is ~4x
    fp32's: the bf16 line starts right after the baseline, at the baseline's batch."""
    space = _line_space(("off", "bf16"))
    base = Config(micro_batch_size=8)
    model = MemoryModel([], "cpu", 100 * 2**30)
    peaks = {"off": 0.17, "bf16": 0.66}
    obs = [Observation(base, "ok", 1.11, 2**30, spread_cv=0.01, mfu=0.56, peak_tflops=0.17)]
    p = staged_next(space, base, obs, model, peaks=peaks)
    assert p is not None and p.config.amp == "bf16" and p.config.micro_batch_size == 8
    assert "amp bf16" in p.stage
    # Without the probe's peaks the baseline's precision comes first, as before.
    p = staged_next(space, base, obs, model)
    assert p is not None and p.config.amp == "off" and p.config.micro_batch_size == 16
    # bf16 slower than fp32 at its peak (emulated, as on a CPU without native bf16): fp32 first.
    low = [Observation(base, "ok", 1.11, 2**30, spread_cv=0.01, mfu=0.1, peak_tflops=0.17)]
    p = staged_next(space, base, low, model, peaks={"off": 0.17, "bf16": 0.09})
    assert p is not None and p.config.amp == "off"


def test_a_precision_whose_peak_a_measured_config_already_passes_is_not_searched() -> None:
    """bf16 at batch 8, 16 and 32 achieved 0.2 TFLOP/s, above fp32's measured peak of 0.17: no
    fp32 batch can beat it, so the fp32 line is not doubled; the staged start is over."""
    space = _line_space(("off", "bf16"))
    base = Config(micro_batch_size=8)
    model = MemoryModel([], "cpu", 100 * 2**30)
    peaks = {"off": 0.17, "bf16": 0.66}
    obs = [Observation(base, "ok", 1.11, 2**30, spread_cv=0.01, mfu=0.56, peak_tflops=0.17)]
    for micro, rate in ((8, 2.4), (16, 2.41), (32, 2.4)):
        obs.append(Observation(Config(micro_batch_size=micro, amp="bf16"), "ok", rate, 2**30,
                               spread_cv=0.01, mfu=0.3, peak_tflops=0.66))
    assert staged_next(space, base, obs, model, peaks=peaks) is None
    # Nor where bf16 achieves 0.16, below fp32's peak but above the 90% of it a line reaches.
    near = obs[:1] + [Observation(o.config, "ok", o.samples_per_sec, 2**30, spread_cv=0.01,
                                  mfu=0.16 / 0.66, peak_tflops=0.66) for o in obs[1:]]
    assert staged_next(space, base, near, model, peaks=peaks) is None
    # Well below fp32's peak, the fp32 line is searched after bf16's.
    slow = obs[:1] + [Observation(o.config, "ok", 1.2, 2**30, spread_cv=0.01, mfu=0.2,
                                  peak_tflops=0.66) for o in obs[1:]]
    p = staged_next(space, base, slow, model, peaks=peaks)
    assert p is not None and p.config.amp == "off"


def test_a_line_whose_largest_batch_was_pruned_is_not_doubled_again() -> None:
    """bf16 ran 8, 16, 32 (fastest at 16); fp32's line starts at 32, where its first window
    was below 0.6x the best: pruned. Doubling past it (64x1 fp32, two minutes a trial on a
    2-core CPU) is not proposed; without the pruning, the line doubles on."""
    space = _line_space(("off", "bf16"))
    base = Config(micro_batch_size=8)
    model = MemoryModel([], "cpu", 100 * 2**30)
    obs = [Observation(base, "ok", 1.32, 2**30, spread_cv=0.08)]
    for micro, rate in ((8, 2.13), (16, 2.15), (32, 1.90)):
        obs.append(Observation(Config(micro_batch_size=micro, amp="bf16"), "ok", rate, 2**30,
                               spread_cv=0.05))
    cut = Observation(Config(micro_batch_size=32), "pruned", None, 2**30)
    p = staged_next(space, base, [*obs, cut], model)
    assert p is None, p  # the staged start is over: bf16 flat twice, fp32 pruned at 32
    ran = Observation(Config(micro_batch_size=32), "ok", 1.217, 2**30, spread_cv=0.05)
    p = staged_next(space, base, [*obs, ran], model)
    assert p is not None and (p.config.amp, p.config.micro_batch_size) == ("off", 64)


def test_a_study_follows_the_incumbents_diagnosis_and_records_why(memdir: Path) -> None:
    """A study of an input-bound workload (the real tuner, in-process, its trials replayed):
    with nothing to stage in micro-batch or precision, the diagnosis proposes loader workers,
    and each trial keeps why."""
    from autotune.testing.replay import Asked, ReplayMeasurer, Row
    from tests.conftest import JOURNAL, load_study, replayed

    def slowdata(asked: Asked) -> Row:
        # Without loader workers the step waits for data 72% of its time; with them it hardly
        # does, and is faster.
        waits = asked.config.num_workers == 0
        return Row(100.0 if waits else 300.0,
                   extra={"breakdown": {"data_wait": 0.72 if waits else 0.05,
                                        "compute": 0.28 if waits else 0.95}})

    (memdir / "space.yaml").write_text(
        "knobs:\n  num_workers: {choices: [0, 1, 2]}\n  prefetch_factor: {choices: [2, 4]}\n")
    measure = ReplayMeasurer(slowdata)
    _, out = replayed(measure, model="autotune.testing.workloads:slowdata", space="space.yaml",
                      trials=2, study_name="led", patience=None, storage=JOURNAL)
    second = read_trial(load_study(JOURNAL, "led").trials[1])
    assert second is not None and second.stage is not None
    assert second.stage.startswith("diagnosis: input-bound at "), second
    assert second.stage.endswith("data wait -> num_workers 1")
    assert second.config.num_workers == 1
    assert [a.config.num_workers for a in measure.asked] == [0, 1]
    assert "input-bound at" in out and "-> num_workers 1" in out


def test_a_line_fastest_at_its_smallest_batch_steps_down() -> None:
    """bf16 starts where fp32 stopped (32); on a CPU its rate can peak below that."""
    space = narrow(parse_space({"knobs": {"micro_batch_size": {"choices": [8, 16, 32, 64, 128]},
                                          "amp": {"choices": ["off", "bf16"]}}}, "t", "<test>"),
                   fake_cpu(), 1, Config(micro_batch_size=8))
    model = MemoryModel([], "cpu", 100 * 2**30)

    def obs(rates: dict[tuple[int, str], float | None]) -> list[Observation]:
        return [Observation(Config(micro_batch_size=m, amp=a), "ok" if r else "oom", r,
                            2**30, spread_cv=0.01) for (m, a), r in rates.items()]

    fp32 = {(8, "off"): 10.0, (16, "off"): 10.1, (32, "off"): 10.0}
    # bf16 32 then 64 (slower); 128 OOM: the line's fastest is its smallest batch -> 16.
    p = staged_next(space, Config(micro_batch_size=8),
                    obs({**fp32, (32, "bf16"): 24.0, (64, "bf16"): 20.0, (128, "bf16"): None}),
                    model)
    assert p is not None and p.config.micro_batch_size == 16 and p.config.amp == "bf16"
    assert p.stage == "staged: the line's fastest is its smallest batch: micro-batch 16 with " \
        "amp bf16"
    # 16 was faster still -> 8; once a smaller one is slower, the line is done.
    p = staged_next(space, Config(micro_batch_size=8),
                    obs({**fp32, (32, "bf16"): 24.0, (64, "bf16"): 20.0, (128, "bf16"): None,
                         (16, "bf16"): 26.0}), model)
    assert p is not None and p.config.micro_batch_size == 8
    assert staged_next(space, Config(micro_batch_size=8),
                       obs({**fp32, (32, "bf16"): 24.0, (64, "bf16"): 20.0,
                            (128, "bf16"): None, (16, "bf16"): 22.0}), model) is None
    # Fastest at the bottom only within the noise (a flat line): no step down.
    assert staged_next(space, Config(micro_batch_size=8),
                       obs({**fp32, (32, "bf16"): 24.0, (64, "bf16"): 23.9,
                            (128, "bf16"): None}), model) is None


def test_the_search_reads_each_trials_mfu_and_the_peak_it_was_taken_against() -> None:
    import optuna

    m = Measurement("ok", None, samples_per_sec=1.11, spread_cv=0.01, mfu=0.56,
                    peak_tflops=0.17)
    trial = optuna.trial.create_trial(state=optuna.trial.TrialState.COMPLETE, value=1.11,
                                      user_attrs={"config": Config().to_dict(), "status": "ok",
                                                  "measurement": m.to_dict()})
    record = read_trial(trial)
    assert record is not None
    o = record.observation()
    assert (o.mfu, o.peak_tflops) == (0.56, 0.17)
    assert o.achieved == pytest.approx(0.56 * 0.17)


CPU_BF16 = narrow(load_space("default"), fake_cpu(2, bf16=True), 1, Config(), supports=DECLARED)


def _ok(number: int, config: Config, rate: float) -> Observation:
    return Observation(config, Status.OK, rate, spread_cv=0.01, number=number)


def test_a_change_left_behind_on_one_noisy_reading_is_tried_on_the_incumbents_line() -> None:
    """The run of the issue: foreach (2.79) edged fused (2.75) on one reading each, eager
    attention then won on the foreach line; fused with eager is tried on it."""
    p = CPU_BF16.variant(Config(), micro_batch_size=8, amp="bf16")
    fused = CPU_BF16.variant(p, optimizer_impl="fused")
    foreach = CPU_BF16.variant(p, optimizer_impl="foreach")
    eager = CPU_BF16.variant(foreach, attention="eager")
    seen = [_ok(0, Config(), 1.30), _ok(1, CPU_BF16.variant(p, amp="off"), 1.32),
            _ok(2, p, 2.35), _ok(3, fused, 2.75), _ok(4, foreach, 2.79), _ok(5, eager, 2.85)]
    tried = {o.config for o in seen}
    proposal = combination(seen, eager, 0.04, CPU_BF16, tried, never)
    assert proposal is not None
    assert proposal.config == CPU_BF16.variant(eager, optimizer_impl="fused")
    assert proposal.stage == ("combination: optimizer_impl fused, read within the noise of what "
                              "the search went on with (2.75 vs 2.79 samples/s for "
                              "optimizer_impl foreach), tried on the incumbent's line")
    # Measured: nothing more to combine.
    done = [*seen, _ok(6, proposal.config, 2.95)]
    assert combination(done, proposal.config, 0.04, CPU_BF16, tried | {proposal.config},
                       never) is None
    # A sibling well behind the one the search went on with (beyond the noise) is not tried;
    # nor one a model rules out.
    far = [*seen[:3], _ok(3, fused, 2.40), *seen[4:]]
    assert combination(far, eager, 0.04, CPU_BF16, tried, never) is None
    assert combination(seen, eager, 0.04, CPU_BF16, tried, lambda c: True) is None


def test_changes_left_behind_at_two_steps_are_tried_together() -> None:
    """A replayed run (benchmarks/pick_noise.py, seed 5): fused edged foreach, then foreach with
    sdpa edged fused with sdpa, then eager on the foreach line read within the noise of sdpa.
    Each left-behind change alone was measured; fused with eager was not: it is tried."""
    p = CPU_BF16.variant(Config(), micro_batch_size=8, amp="bf16")
    fused, foreach = (CPU_BF16.variant(p, optimizer_impl=v) for v in ("fused", "foreach"))
    seen = [_ok(4, p, 2.436), _ok(5, fused, 2.729), _ok(6, foreach, 2.694),
            _ok(9, CPU_BF16.variant(fused, attention="sdpa"), 2.789),
            _ok(10, CPU_BF16.variant(foreach, attention="sdpa"), 2.815),
            _ok(14, CPU_BF16.variant(foreach, attention="eager"), 2.784)]
    incumbent = seen[4].config
    proposal = combination(seen, incumbent, 0.05, CPU_BF16, {o.config for o in seen}, never)
    assert proposal is not None
    assert proposal.config == CPU_BF16.variant(fused, attention="eager")
    assert proposal.stage.startswith("combination: attention eager + optimizer_impl fused, ")
    assert proposal.stage.endswith("tried together on the incumbent's line")


def _run2() -> tuple[list[Observation], Config]:
    """Run 2 of the claims (docs/benchmarks.md): the bf16 line read 8x1 within the noise of
    16x1, the diagnosis went on at 8x1 to fused AdamW, then eager attention."""
    p = CPU_BF16.variant(Config(), micro_batch_size=8, amp="bf16")
    fused = CPU_BF16.variant(p, optimizer_impl="fused")
    eager = CPU_BF16.variant(fused, attention="eager")
    line = [CPU_BF16.variant(p, micro_batch_size=m) for m in (16, 32)]
    seen = [_ok(0, Config(), 2.10), _ok(1, p, 4.10), _ok(2, line[0], 4.02), _ok(3, line[1], 3.60),
            _ok(4, fused, 4.60), _ok(5, eager, 4.85)]
    return seen, eager


def test_the_incumbent_is_tried_at_the_neighbouring_batch_its_line_read_within_the_noise() -> None:
    seen, eager = _run2()
    tried = {o.config for o in seen}
    proposal = neighbours(seen, eager, 0.05, CPU_BF16, tried, never)
    assert proposal is not None
    assert proposal.config == CPU_BF16.variant(eager, micro_batch_size=16)
    assert proposal.stage == ("neighbour: micro-batch 16 read within the noise of 8 (4.02 vs "
                              "4.1 samples/s in trials 2 and 1), tried with the incumbent's "
                              "knobs")
    # 4x1 never ran on any line: no evidence, not tried; measured at 16: nothing left.
    assert neighbours([*seen, _ok(6, proposal.config, 4.7)], eager, 0.05, CPU_BF16,
                      tried | {proposal.config}, never) is None
    # A neighbour read beyond the noise behind, or one a model rules out, is not tried.
    assert neighbours(seen, eager, 0.01, CPU_BF16, tried, never) is None
    assert neighbours(seen, eager, 0.05, CPU_BF16, tried, lambda c: True) is None


def test_the_nearest_pair_that_ran_at_both_batches_is_the_evidence() -> None:
    """The staged line read 16 within the noise of 8, but fused AdamW read at both batches
    says 16 is 10% behind with the knobs nearer the incumbent's: not tried."""
    seen, eager = _run2()
    fused16 = CPU_BF16.variant(seen[4].config, micro_batch_size=16)
    seen = [*seen, _ok(6, fused16, 4.14)]
    assert neighbours(seen, eager, 0.05, CPU_BF16, {o.config for o in seen}, never) is None


def _best(config: Config, rate: float) -> TrialRecord:
    return TrialRecord(5, TrialState.COMPLETE, config, Status.OK, None,
                       Measurement(Status.OK, samples_per_sec=rate))


def test_the_neighbouring_batch_comes_after_the_diagnosis_unless_time_holds_one_trial() -> None:
    seen, eager = _run2()
    tried = {o.config for o in seen}
    found = [finding("compute-bound", mfu=0.5)]

    def ask(last: bool) -> str:
        p = after_start(CPU_BF16, _best(eager, 4.85), seen, found, tried, never,
                        lambda c: last)
        assert p is not None
        return p.stage

    assert ask(last=False).startswith("diagnosis: compute-bound at MFU 50% -> ")
    assert ask(last=True).startswith("neighbour: micro-batch 16 ")
    # Every remedy measured: the neighbour comes next without the time rule.
    remedies = set()
    for knob in REMEDIES["compute-bound"]:
        domain = CPU_BF16.searched.get(knob)
        for value in getattr(domain, "values", ()):
            remedies.add(CPU_BF16.variant(eager, **{knob: value}))
            remedies.add(CPU_BF16.variant(seen[1].config, **{knob: value}))
    p = after_start(CPU_BF16, _best(eager, 4.85), seen, found, tried | remedies, never,
                    lambda c: False)
    assert p is not None and p.stage.startswith("neighbour: micro-batch 16 ")


def test_changes_that_tied_with_the_incumbent_are_combined_once_the_diagnosis_is_done() -> None:
    """Run 2 of the claims (docs/benchmarks.md): fused read 7% behind foreach on one trial each
    (within the noise of one reading), the search went on with foreach, and eager attention
    on the foreach line tied with it (2.71 vs 2.72); fused with eager, 14% ahead of the pick
    in both rounds of its re-check, is tried once the diagnosis has nothing left."""
    p = CPU_BF16.variant(Config(), micro_batch_size=8, amp="bf16")
    fused, foreach = (CPU_BF16.variant(p, optimizer_impl=v) for v in ("fused", "foreach"))
    seen = [_ok(0, Config(), 1.50), _ok(1, p, 2.63),
            _ok(2, CPU_BF16.variant(p, micro_batch_size=16), 2.02), _ok(4, fused, 2.53),
            _ok(5, foreach, 2.72), _ok(6, CPU_BF16.variant(foreach, compile="default"), 2.55),
            _ok(8, CPU_BF16.variant(foreach, attention="eager"), 2.71)]
    tried = {o.config for o in seen}
    assert combination(seen, foreach, ONE_READING, CPU_BF16, tried, never) is None
    proposal = combination(seen, foreach, ONE_READING, CPU_BF16, tried, never, ties=True)
    assert proposal is not None
    assert proposal.config == CPU_BF16.variant(fused, attention="eager")
    assert proposal.stage == (
        "combination: optimizer_impl fused + attention eager, read within the noise of what "
        "the search went on with (2.53 vs 2.72 samples/s for optimizer_impl foreach; 2.71 vs "
        "2.72 samples/s on the incumbent's line), tried together on the incumbent's line")
    # Within the trials' own noise alone (2%), fused was behind: nothing is left behind, and
    # eager's tie alone was measured.
    assert combination(seen, foreach, 0.02, CPU_BF16, tried, never, ties=True) is None
    # Before the diagnosis is done, its next remedy comes first; then the tie's combination.
    best = _best(foreach, 2.72)
    found = [finding("compute-bound", mfu=0.5)]
    first = after_start(CPU_BF16, best, seen, found, tried, never, lambda c: False)
    assert first is not None and first.stage.startswith("diagnosis: ")
    remedies = {CPU_BF16.variant(foreach, **{k: v}) for k in REMEDIES["compute-bound"]
                for v in getattr(CPU_BF16.searched.get(k), "values", ())}
    then = after_start(CPU_BF16, best, seen, found, tried | remedies, never, lambda c: False)
    assert then is not None and then.config == proposal.config


def test_on_a_cpu_low_mfu_tries_retained_host_memory_first_and_a_gpu_never_searches_it() -> None:
    cpu = narrow(load_space("default"), fake_cpu(), 1, Config(), supports=DECLARED)
    assert cpu.searched["malloc_retain"].values == (False, True)  # type: ignore[union-attr]
    base = cpu.variant(Config(), micro_batch_size=16, amp="bf16")
    low = [finding("low-mfu", mfu=0.14)]
    first = diagnosis_next(cpu, base, low, set(), never)
    assert first is not None and first.stage == "diagnosis: low MFU at 14% -> malloc_retain true"
    assert first.config == cpu.variant(base, malloc_retain=True)
    # One way only: once tried, the diagnosis goes on to the optimizer.
    second = diagnosis_next(cpu, base, low, {first.config}, never)
    assert second is not None and "optimizer_impl" in second.stage
    assert "malloc_retain" in GPU_SPACE.fixed
    assert "GPU" in GPU_SPACE.fixed["malloc_retain"][1]


def test_on_a_cpu_the_lines_carry_retained_host_memory_unless_it_read_slower() -> None:
    """The staged start measures the baseline with glibc's freed memory retained first; the
    batch lines then run with it (a tie goes to it), or without it where it read slower by
    more than the noise; a GPU's lines never ask."""
    cpu = narrow(load_space("default"), fake_cpu(bf16=True), 1, Config(), supports=DECLARED)
    base = Config()
    kept = cpu.variant(base, malloc_retain=True)
    model = MemoryModel([], "cpu", 100 * 2**30)

    def obs(config: Config, rate: float, number: int) -> Observation:
        return Observation(config, Status.OK, rate, 2**30, spread_cv=0.02, number=number)

    first = staged_next(cpu, base, [obs(base, 4.0, 0)], model)
    assert first is not None and first.config == kept
    assert first.stage.startswith("staged: glibc keeps freed host memory (malloc_retain true)")
    # Not when its trial cannot run (no time left for it): the lines start from the baseline.
    plain = staged_next(cpu, base, [obs(base, 4.0, 0)], model, too_slow=lambda c: c == kept)
    assert plain is not None and not plain.config.malloc_retain
    # Faster, or within the noise (4%): the first line doubles with it.
    for rate in (6.0, 3.9):
        p = staged_next(cpu, base, [obs(base, 4.0, 0), obs(kept, rate, 1)], model)
        assert p is not None and p.config == cpu.variant(kept, micro_batch_size=
                                                         2 * base.micro_batch_size)
    # Slower by more than the noise, or it failed: the lines go on without it.
    for seen in (obs(kept, 3.0, 1), Observation(kept, Status.ERROR, number=1)):
        p = staged_next(cpu, base, [obs(base, 4.0, 0), seen], model)
        assert p is not None and p.config == cpu.variant(base, micro_batch_size=
                                                         2 * base.micro_batch_size)
    gpu = GPU_SPACE.variant(Config(world_size=2))
    p = staged_next(GPU_SPACE, gpu, [obs(gpu, 4.0, 0)], MemoryModel([], "cuda", 80 * 2**30))
    assert p is not None and p.config.micro_batch_size == 2 * gpu.micro_batch_size
