"""A machine that changes under a run is caught: the sentinel's readings compared between the
confirmation's rounds and against the search (tuner.drift), a round added, and the change in
the profile's notes and the claim's words. Readings are injected (a replayed measurer): no
timing is asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.config.knobs import Config
from autotune.testing.records import CraftedStudy
from autotune.testing.replay import Asked, ReplayMeasurer
from autotune.trial.measurement import Measurement, Status
from autotune.trial.sentinel import clean, precisions_of
from autotune.trial.spec import MeasureSettings
from autotune.tuner.confirm_rounds import confirm
from autotune.tuner.drift import FLOOR, changes, noise, reading_of, slowdowns, threshold
from autotune.tuner.export import build_profile
from autotune.tuner.snapshot import read
from autotune.workloads import WorkloadSpec

GIB = 2**30
BASE, WIN = Config(micro_batch_size=8), Config(micro_batch_size=16, amp="bf16")


def reading(fp32: float = 300.0, bf16: float = 1200.0, copy: float = 40.0,
            world: int = 1) -> dict[str, float]:
    return {"matmul_fp32_gflops": fp32, "matmul_bf16_gflops": bf16, "copy_gbs": copy,
            "seconds": 1.0, "threads": 2, "world_size": world}


SEARCH = [reading(300 * f, 1200 * f, 40 * f) for f in (0.99, 1.0, 1.01, 0.98, 1.02)]


def test_what_the_sentinel_reads_and_keeps_of_a_report() -> None:
    assert precisions_of(["off", "bf16"]) == ("fp32", "bf16")
    assert precisions_of(["bf16"]) == ("fp32", "bf16")  # the baseline's fp32 always
    assert precisions_of(["fp16", "off", "nonsense", 3]) == ("fp32", "fp16")
    # A trial's report is untrusted: only finite positive rates of known names stay.
    assert clean({"matmul_fp32_gflops": 1.5, "copy_gbs": float("nan"), "rm -rf": 1,
                  "threads": True, "seconds": -1}) == {"matmul_fp32_gflops": 1.5}
    assert clean(["not", "a", "mapping"]) == {}


def test_noise_is_the_robust_spread_and_sets_the_threshold() -> None:
    cvs = noise(SEARCH)
    assert set(cvs) == {"matmul_fp32_gflops", "matmul_bf16_gflops", "copy_gbs"}
    assert cvs["matmul_fp32_gflops"] == pytest.approx(1.4826 * 3.0 / 300.0)
    assert threshold(cvs["matmul_fp32_gflops"]) == FLOOR  # 3 x 1.41 x 1.5% = 6%: the floor
    assert threshold(0.03) == pytest.approx(3 * 2 ** 0.5 * 0.03)
    assert threshold(0.01) == FLOOR and threshold(None) == FLOOR  # never below the floor
    assert threshold(0.04) == pytest.approx(3 * 2 ** 0.5 * 0.04)
    # One odd reading does not widen it.
    assert noise([*SEARCH, reading(fp32=100.0)])["matmul_fp32_gflops"] < 0.03
    assert noise(SEARCH[:2]) == {}  # too few readings to say


def test_a_rate_that_moves_between_rounds_or_from_the_search_is_a_change() -> None:
    steady = [[reading(), reading(301)], [reading(299), reading(302)]]
    assert changes(SEARCH, steady) == []
    # fp32 30% slower in round 2, bf16 12.5%: both beyond the 10% floor, between rounds.
    slow = [[reading(), reading()], [reading(210, 1050), reading(210, 1050)]]
    found = {(c.metric, c.where) for c in changes(SEARCH, slow)}
    assert ("matmul_fp32_gflops", "between confirmation rounds 1 and 2") in found
    assert ("matmul_bf16_gflops", "between confirmation rounds 1 and 2") in found
    assert all(m != "copy_gbs" for m, _ in found)
    line = next(c for c in changes(SEARCH, slow) if c.metric == "matmul_fp32_gflops"
                and "rounds" in c.where).line()
    assert line == ("fp32 matmul 300.0 -> 210.0 GFLOP/s between confirmation rounds 1 and 2 "
                    "(-30%, beyond the 10% its noise allows)")
    # Within one round: the winner read on one machine, the baseline on another.
    within = changes(SEARCH, [[reading(300), reading(240)]])
    assert [(c.where, c.before, c.after) for c in within][0] == \
        ("within confirmation round 1", 300.0, 240.0)
    # A move counts as the line says it, from the earlier reading: a fall of 9.5% is within
    # the 10% (the faster reads 10.5% above the slower; a run said "-14%, beyond the 15%").
    assert changes(SEARCH, [[reading(300), reading(271.5)]]) == []
    assert changes(SEARCH, [[reading(271.5), reading(300)]]) != []
    assert changes(SEARCH, [[reading(300)], [reading(271.5)]]) == []
    # The line names the round's two readings furthest apart, in the order they were taken.
    (three,) = changes(SEARCH, [[reading(300), reading(330), reading(255)]])
    assert (three.before, three.after) == (330.0, 255.0)
    # The whole confirmation on a machine 20% slower than the search's.
    after = [[reading(240), reading(240)], [reading(241), reading(239)]]
    (moved,) = changes(SEARCH, after)
    assert moved.where == "from the search to the confirmation" and moved.after == 240.0
    # Readings of another rank count are not compared (ranks read at once, on shared cores).
    two_ranks = [[reading(150, world=2)], [reading(151, world=2)]]
    assert changes(SEARCH, two_ranks) == []


def _study() -> CraftedStudy:
    crafted = CraftedStudy(workload=WorkloadSpec("mlp", {}), limit=18 * GIB)
    for i, (config, rate) in enumerate([(BASE, 100.0), (WIN, 250.0), (BASE, 101.0),
                                        (WIN, 249.0), (WIN, 251.0)]):
        crafted.measured(config if i < 2 else Config(micro_batch_size=config.micro_batch_size
                                                     * 2 ** i, amp=config.amp),
                         Measurement(Status.OK, samples_per_sec=rate if i < 2 else rate * 0.5,
                                     spread_cv=0.01, peak_memory_bytes=GIB, wall_s=5.0,
                                     windows=[{"samples": 10, "seconds": 1.0}] * 3,
                                     sentinel=SEARCH[i]),
                         baseline=i == 0)
    return crafted


def _confirm(slow_from_call: int | None, tmp_path: Path) -> tuple[dict, list[Config]]:
    crafted = _study()

    def answer(asked: Asked) -> Measurement:
        calls = len(measure.configs) + 1  # this one included
        rate = 250.0 if asked.config == WIN else 100.0
        moved = slow_from_call is not None and calls >= slow_from_call
        return Measurement(Status.OK, samples_per_sec=rate, spread_cv=0.01,
                           peak_memory_bytes=GIB, wall_s=5.0,
                           sentinel=reading(210.0 if moved else 300.0))

    measure = ReplayMeasurer(answer)
    why = confirm(crafted.study, measure, MeasureSettings(), limit=18 * GIB, top=1, rounds=2,
                  headroom=0.05, trial_timeout_s=600.0, deadline=None, out_dir=tmp_path,
                  on_round=lambda *a: None)
    assert why is None
    return crafted.study.user_attrs["confirmation"], measure.configs


def test_a_steady_machine_adds_nothing(tmp_path: Path) -> None:
    conf, calls = _confirm(None, tmp_path)
    assert conf["machine_changed"] == [] and not conf["round_added"]
    assert conf["rounds"] == 1  # decisive (2.5x): one round, as before


def test_a_drift_between_rounds_is_flagged_adds_a_round_and_reaches_the_profile(
        tmp_path: Path) -> None:
    # The round's second run (the baseline) reads fp32 30% slower: the machine moved within
    # round 1, against the search's readings; the decisive round is not taken as final.
    conf, calls = _confirm(2, tmp_path)
    assert conf["round_added"] and conf["rounds"] == 2 and len(calls) == 4
    assert any(line.startswith("fp32 matmul") for line in conf["machine_changed"])
    snap = read(_study_with(conf, tmp_path))
    assert snap.speedup is not None and snap.speedup.machine_changed
    assert snap.speedup.words().endswith("; the machine changed during the confirmation)")
    profile = build_profile(snap, "sqlite://")
    assert profile is not None and profile.speedup_interval is not None
    assert profile.speedup_interval["machine_changed"] is True
    (note,) = [n for n in profile.notes if n.startswith("the machine changed")]
    assert "fp32 matmul" in note and "a re-check may differ" in note


def _study_with(conf: dict, tmp_path: Path):  # noqa: ANN202 - an Optuna study
    from autotune.tuner.record import write_confirmation

    crafted = _study()
    write_confirmation(crafted.study, conf)  # type: ignore[arg-type]
    return crafted.study


def test_on_cuda_the_sm_clock_is_read_and_a_slowdown_is_said() -> None:
    """A CUDA trial's NVML summary (the fake NVML's, in tests/test_monitor.py) joins the
    reading: its SM clock is a rate like the sentinel's, and a round in which a GPU slowed
    itself down is named with its temperature."""
    def gpu_run(clock: float, slow: list[str] | None = None) -> Measurement:
        return Measurement(Status.OK, samples_per_sec=1.0, gpu={
            "sm_clock_mhz_mean": clock, "temp_c_max": 88.0 if slow else 70.0,
            **({"slowdowns": slow} if slow else {})})

    assert reading_of(gpu_run(1980.0)) == {"sm_clock_mhz": 1980.0}
    search = [reading_of(gpu_run(c)) for c in (1980.0, 1975.0, 1985.0)]
    rounds = [[reading_of(gpu_run(1980.0))], [reading_of(gpu_run(1500.0))]]
    (moved,) = changes(search, rounds)  # one line per rate: its largest move
    assert moved.line().startswith("SM clock 1,980.0 -> 1,500.0 MHz between confirmation "
                                   "rounds 1 and 2 (-24%")
    lines = slowdowns([[gpu_run(1980.0)], [gpu_run(1500.0, ["hardware thermal slowdown"])]])
    assert lines == ["a GPU slowed itself down in confirmation round 2: hardware thermal "
                     "slowdown (up to 88 C)"]


def test_a_stored_reading_that_is_not_numbers_is_left_out() -> None:
    """A shared study's records are others' data: a reading holding anything but positive
    finite rates loses those entries, and the comparison goes on."""
    junk = Measurement(Status.OK, samples_per_sec=1.0,
                       sentinel={"matmul_fp32_gflops": "fast", "copy_gbs": -1.0,
                                 "matmul_bf16_gflops": 1200.0},  # type: ignore[dict-item]
                       gpu={"sm_clock_mhz_mean": float("nan")})
    assert reading_of(junk) == {"matmul_bf16_gflops": 1200.0}
    assert changes(SEARCH, [[reading_of(junk)], [reading()]]) == []
