"""The search's decisions on crafted and measured observations (pure: no trial runs here)."""

from __future__ import annotations

from typing import Any

import pytest

from autotune.config.knobs import Config
from autotune.config.space import NarrowedSpace, narrow, parse_space
from autotune.testing.hardware import fake_gpus
from autotune.tuner.confirmation import (
    WITHIN_MARGIN,
    Candidate,
    confirmation_seconds,
    decide,
    decided_in_one_round,
    plan_confirmation,
    settled,
)
from autotune.tuner.pruning import prune_reason
from autotune.tuner.search import (
    MemoryModel,
    Observation,
    fit_affine,
    noise_of,
    since_improvement,
    staged_next,
)

GiB = 2**30


def gpu_space(micros: list[int], amps: tuple[str, ...] = ("off", "bf16")) -> NarrowedSpace:
    space = parse_space({"knobs": {"micro_batch_size": {"choices": micros},
                                   "amp": {"choices": list(amps)}}}, "t", "<test>")
    return narrow(space, fake_gpus(1, memory_gib=80), 1, Config(micro_batch_size=8), None)


def ok(micro: int, peak: float, amp: str = "off", rate: float = 100.0, **kw: Any) -> Observation:
    return Observation(Config(micro_batch_size=micro, amp=amp, **kw), "ok", rate, int(peak))


def oom(micro: int, amp: str = "off", **kw: Any) -> Observation:
    return Observation(Config(micro_batch_size=micro, amp=amp, **kw), "oom", None, 0)


# Measured on this project's 2-core CPU (benchmarks/data/grid_bert.json: BERT tiny, seq 128, fp32,
# no accumulation, no loader workers): peak PSS of the trial's process tree per micro-batch.
FP32 = [(4, 752410624), (8, 960970752), (16, 1376104448), (32, 2207219712), (64, 3857625088),
        (128, 7205138432)]


def test_affine_fit_recovers_the_measured_line() -> None:
    fit = fit_affine(FP32[:3])  # from the three smallest batches only
    assert fit is not None and fit.points == 3
    assert fit.slope == pytest.approx(52e6, rel=0.02)  # ~52 MB of activations per sample
    for micro, peak in FP32[3:]:  # extrapolated 2x to 8x beyond the points: within 3%
        assert fit.at(micro) == pytest.approx(peak, rel=0.03)
    assert fit_affine([(8, 10**9), (8, 11 * 10**8)]) is None  # one micro-batch size: no slope


def test_memory_model_predicts_and_skips_above_the_limit_less_headroom() -> None:
    limit = 4 * GiB
    model = MemoryModel([ok(m, p) for m, p in FP32[:3]], "cpu", limit)
    predicted = model.predict(Config(micro_batch_size=128))
    assert predicted is not None and predicted > model.budget  # ~7.0 GB > 3.8 GiB
    verdict = model.verdict(Config(micro_batch_size=128))
    assert verdict is not None and verdict[0].startswith("predicted-oom: peak")
    assert verdict[1] == pytest.approx(predicted)
    assert model.verdict(Config(micro_batch_size=64)) is None  # ~3.8 GB measured: it fits
    # Another precision has its own line: nothing is known about bf16 yet.
    assert model.verdict(Config(micro_batch_size=128, amp="bf16")) is None
    # Accumulation does not change the peak: the same line.
    assert model.verdict(Config(micro_batch_size=128, grad_accum_steps=2)) is not None
    # On CPU loader workers are processes of the measured tree: their own line.
    assert model.verdict(Config(micro_batch_size=128, num_workers=2, prefetch_factor=2)) is None
    # On a GPU they are not: one line for every loader setting.
    gpu = MemoryModel([ok(m, p) for m, p in FP32[:3]], "cuda", limit)
    assert gpu.verdict(Config(micro_batch_size=128, num_workers=2, prefetch_factor=2))


def test_after_an_oom_no_larger_micro_batch_with_the_same_memory_knobs() -> None:
    model = MemoryModel([ok(16, 5e9), oom(64)], "cuda", 80 * GiB)
    verdict = model.verdict(Config(micro_batch_size=128))
    assert verdict is not None and "64, which ran out of memory" in verdict[0]
    assert model.verdict(Config(micro_batch_size=64)) is not None
    assert model.verdict(Config(micro_batch_size=32)) is None
    assert model.verdict(Config(micro_batch_size=128, amp="bf16")) is None
    cpu = MemoryModel([oom(64, num_workers=0)], "cpu", 20 * GiB)
    assert cpu.verdict(Config(micro_batch_size=128, num_workers=0)) is not None
    assert cpu.verdict(Config(micro_batch_size=128, num_workers=2, prefetch_factor=2)) is None


def _stage_until_done(space: NarrowedSpace, fits: Any, limit: float = 80 * GiB,
                      ) -> list[tuple[int, str]]:
    """Drive the staged start with an oracle: (micro, amp) -> peak bytes or None for an OOM."""
    baseline = Config(micro_batch_size=8)
    # Rates grow with the batch: a flat rate would stop the doubling (two flat doublings).
    obs: list[Observation] = [ok(8, fits(8, "off"), rate=80.0)]
    ran = []
    while (p := staged_next(space, baseline, obs, MemoryModel(obs, "cuda", int(limit)))):
        c = p.config
        peak = fits(c.micro_batch_size, c.amp)
        obs.append(ok(c.micro_batch_size, peak, c.amp, rate=10.0 * c.micro_batch_size)
                   if peak is not None and peak <= limit
                   else oom(c.micro_batch_size, c.amp))
        ran.append((c.micro_batch_size, c.amp))
        assert len(ran) < 20
    return ran


def test_staged_start_doubles_then_bisects_per_precision() -> None:
    space = gpu_space([8, 16, 24, 32, 40, 48, 64, 96, 128])

    def fits(micro: int, amp: str) -> float | None:
        wall = 40 if amp == "off" else 96
        return 1e9 * micro / 128 if micro <= wall else None

    ran = _stage_until_done(space, fits)
    fp32 = [m for m, a in ran if a == "off"]
    bf16 = [m for m, a in ran if a == "bf16"]
    assert fp32[:2] == [16, 32] and 64 in fp32  # doubling from the baseline's 8 until OOM
    assert 40 in fp32 and 48 in fp32  # bisection found the wall between 40 and 48
    assert bf16[0] == 40 and 96 in bf16  # bf16 starts where fp32 hit its wall
    assert max(m for m in bf16 if m <= 96) == 96
    assert len(set(ran)) == len(ran)  # nothing measured twice


def test_staged_start_skips_what_the_memory_model_rules_out() -> None:
    space = gpu_space([8, 16, 32, 64, 128], amps=("off",))
    measured = dict(FP32)

    def fits(micro: int, amp: str) -> float:
        return measured[micro]

    ran = _stage_until_done(space, fits, 2.5 * GiB)
    # 8 (baseline) and 16 give the line; 32 fits (2.06 GiB); 64 (3.6 GiB) and 128 are ruled
    # out by the fit, so they never run.
    assert [m for m, _ in ran] == [16, 32]


def test_staged_start_halves_when_the_baseline_does_not_fit() -> None:
    space = gpu_space([1, 2, 4, 8, 16], amps=("off",))
    baseline = Config(micro_batch_size=8)
    obs = [oom(8)]
    proposal = staged_next(space, baseline, obs, MemoryModel(obs, "cuda", 80 * GiB))
    assert proposal is not None and proposal.config.micro_batch_size in (2, 4)


def test_noise_and_patience() -> None:
    obs = [ok(8, 1e9, rate=100.0), ok(16, 1e9, rate=101.0), ok(32, 1e9, rate=130.0),
           ok(64, 1e9, rate=131.0), oom(128)]
    assert noise_of(obs) == 0.02  # no spread recorded: the floor
    assert since_improvement(obs, 0.02) == 2  # 131 is within noise of 130; the OOM counts
    noisy = [Observation(o.config, o.status, o.samples_per_sec, 1, 0.05) for o in obs[:4]]
    assert noise_of(noisy) == pytest.approx(0.10)
    ruled_out = Observation(Config(micro_batch_size=256), "pruned", predicted=True)
    assert since_improvement([*obs, ruled_out], 0.02) == 2  # nothing ran: not a trial


def test_prune_only_when_every_early_window_is_clearly_below_the_best() -> None:
    assert prune_reason([50.0], 100.0) is None  # one window is not enough
    reason = prune_reason([50.0, 60.0], 100.0)
    assert reason is not None and reason.startswith("its first 2 windows")
    assert prune_reason([50.0, 80.0], 100.0) is None  # one window near the best
    # Judged on the first two windows only, however many arrived before the tuner looked.
    assert prune_reason([50.0, 60.0, 90.0], 100.0) is not None
    assert prune_reason([50.0, 60.0], None) is None  # no best yet
    # Where each window is one whole step (seconds), the first window decides when it is far
    # behind (below 0.6x), and only then.
    reason = prune_reason([55.0], 100.0, one_step_windows=True)
    assert reason is not None and reason.startswith("its first window (one whole step)")
    assert prune_reason([65.0], 100.0, one_step_windows=True) is None
    assert prune_reason([65.0, 70.0], 100.0, one_step_windows=True) is not None  # then two


def cand(number: int, rates: list[float], peak: float, **kw: Any) -> Candidate:
    return Candidate(number, Config(micro_batch_size=number), rates=rates,
                     peaks=[int(peak)] * len(rates), **kw)


def test_confirmation_picks_a_clear_winner_by_median() -> None:
    a = cand(1, [100.0, 101.0, 99.5], 30 * GiB)
    b = cand(2, [90.0, 91.0, 89.0], 10 * GiB)
    d = decide([b, a], 80 * GiB)
    assert d.winner is a and d.runner_up is b and d.decided_by == "median"
    assert d.margin == pytest.approx(0.02)  # spreads under 1%: the floor


def test_confirmation_within_noise_prefers_memory_headroom() -> None:
    # A leads by 1.5% on the median, but its own rounds spread by ~5%: a coin flip.
    a = cand(1, [101.5, 96.0, 106.0], 60 * GiB)
    b = cand(2, [100.0, 99.0, 101.0], 20 * GiB)
    d = decide([a, b], 80 * GiB)
    assert d.margin > 0.05 and d.decided_by == "headroom" and d.winner is b


def test_within_the_margin_peaks_alike_leave_the_higher_median() -> None:
    """A run's confirmation: 8x1 bf16 fused [4.69, 4.25] at 3.19 GiB, 8x1 bf16 [4.66, 4.10] at
    3.12 GiB of an 18.3 GiB limit. 70 MB is no headroom worth 2% of speed: the faster wins,
    said as within the margin, and one round of it never settles anything."""
    fused = cand(5, [4.69, 4.25], 3.19 * GiB)
    plain = cand(1, [4.66, 4.10], 3.12 * GiB)
    base = cand(0, [1.68, 1.64], 3.25 * GiB, is_baseline=True)
    d = decide([fused, plain, base], int(18.3 * GiB))
    assert d.winner is fused and d.runner_up is plain and d.decided_by == WITHIN_MARGIN
    assert settled([fused, plain, base], int(18.3 * GiB)) is None
    # Roomier by more than the headroom (5% of the limit), but both far from the wall: still
    # the higher median.
    roomy = cand(1, [4.66, 4.10], 2.0 * GiB)
    assert decide([fused, roomy, base], int(18.3 * GiB)).decided_by == WITHIN_MARGIN


def test_within_the_margin_headroom_decides_only_near_the_wall() -> None:
    """A Zen 4 run's confirmation: 16x1 [3.17, 3.18] at 4.30 GiB, 8x1 [3.15, 2.88] at 3.04 GiB
    of an 18.3 GiB limit, within the margin (8.9%). Roomier by 1.26 GiB (7% of the limit), but
    16x1 peaks at a quarter of it: the higher median wins. With 16x1 peaking past half the
    limit, the roomier 8x1 does."""
    limit = int(18.3 * GiB)
    wide, narrow = cand(10, [3.17, 3.18], 4.30 * GiB), cand(9, [3.15, 2.88], 3.04 * GiB)
    base = cand(0, [1.30, 1.08], 3.19 * GiB, is_baseline=True)
    d = decide([wide, narrow, base], limit)
    assert d.winner is wide and d.decided_by == WITHIN_MARGIN and d.margin > 0.05
    near = cand(10, [3.17, 3.18], 10.0 * GiB)
    d = decide([near, narrow, base], limit)
    assert d.winner is narrow and d.decided_by == "headroom"


def test_confirmation_excludes_configs_without_headroom_or_with_failures() -> None:
    near_wall = cand(1, [150.0, 151.0], 77 * GiB)  # within 5% of the 80 GiB limit
    failed = cand(2, [140.0], 10 * GiB, failures=["round 2: oom: CUDA out of memory"])
    fine = cand(3, [120.0, 121.0], 10 * GiB)
    d = decide([near_wall, failed, fine], 80 * GiB)
    assert d.winner is fine
    assert "within 5%" in d.excluded[1] and "oom" in d.excluded[2]
    assert decide([near_wall], 80 * GiB).winner is None


def test_confirmation_shrinks_to_the_time_left() -> None:
    top = [Candidate(n, Config(micro_batch_size=8 * n)) for n in (3, 5, 7)]
    base = Candidate(0, Config(), is_baseline=True)
    cands = [*top, base]
    # One run: 15 s (its start-up and its round's measuring budget) + 2 s for the process.
    walls = {0: 15.0, 3: 15.0, 5: 15.0, 7: 15.0}
    assert confirmation_seconds(cands, walls, 1) == pytest.approx(68.0)
    assert plan_confirmation(cands, walls, 3, None) == (cands, 3)  # no deadline: everything
    assert plan_confirmation(cands, walls, 3, 300.0) == (cands, 3)
    assert plan_confirmation(cands, walls, 3, 150.0) == (cands, 2)  # fewer rounds first
    plan = plan_confirmation(cands, walls, 3, 110.0)  # then fewer configs; the baseline stays
    assert not isinstance(plan, str) and plan[1] == 2
    assert [c.number for c in plan[0]] == [3, 5, 0]
    plan = plan_confirmation(cands, walls, 3, 70.0)  # the smallest: best and baseline, twice
    assert not isinstance(plan, str) and [c.number for c in plan[0]] == [3, 0] and plan[1] == 2
    why = plan_confirmation(cands, walls, 3, 60.0)
    assert isinstance(why, str) and why.startswith("two rounds of 2 configs need ~") and \
        "a longer --timeout" in why
    assert plan_confirmation([base], walls, 3, None) == "fewer than two configs measured ok"
    # Where the search's lead is decisive, the best and the baseline need one round only: the
    # runners-up go first, then one round of the two fits where two did not.
    plan = plan_confirmation(cands, walls, 3, 60.0, pair_rounds=1)
    assert not isinstance(plan, str) and [c.number for c in plan[0]] == [3, 0] and plan[1] == 1
    plan = plan_confirmation(cands, walls, 3, 110.0, pair_rounds=1)  # three configs need two
    assert not isinstance(plan, str) and [c.number for c in plan[0]] == [3, 5, 0] and plan[1] == 2
    why = plan_confirmation(cands, walls, 3, 30.0, pair_rounds=1)
    assert isinstance(why, str) and why.startswith("one round of 2 configs need ~34s")


def test_one_round_decides_only_a_lead_many_times_the_margin() -> None:
    base = Candidate(0, Config(), rates=[1.1], peaks=[GiB], window_cvs=[0.01], is_baseline=True)
    fast = Candidate(3, Config(amp="bf16"), rates=[2.4], peaks=[GiB], window_cvs=[0.02])
    why = decided_in_one_round([fast, base], 80 * GiB)
    assert why is not None and why.startswith("one round: the winner leads the baseline by 118%")
    # A 10% lead over a 2% margin is not decisive: a second round is needed.
    near = Candidate(4, Config(micro_batch_size=16), rates=[1.21], peaks=[GiB], window_cvs=[0.01])
    assert decided_in_one_round([near, base], 80 * GiB) is None
    # A runner-up beside the winner: one round cannot tell the two apart.
    assert decided_in_one_round([fast, near, base], 80 * GiB) is None
    # The baseline fastest: nothing to decide in one round.
    slow = Candidate(5, Config(micro_batch_size=4), rates=[0.2], peaks=[GiB], window_cvs=[0.01])
    assert decided_in_one_round([slow, base], 80 * GiB) is None


def test_pruning_reads_only_well_formed_window_events() -> None:
    """What pruning reads of a trial's progress file: a window's rate and whether it was one
    whole step. A script's trial folder is the script's to write: an event whose numbers are
    not finite numbers is not a window (it neither prunes the trial nor ends the run)."""
    from autotune.tuner.measurer import window_event

    one = {"event": "window", "samples_per_sec": 1.2, "samples": 8, "seconds": 6.6}
    assert window_event(one, 8, 1.0) == (1.2, True)
    assert window_event({**one, "samples": 24}, 8, 1.0) == (1.2, False)  # three steps
    assert window_event({**one, "seconds": 0.5}, 8, 1.0) == (1.2, False)  # below a window
    for bad in ("x", None, float("nan"), float("inf"), True, [1]):
        assert window_event({**one, "samples_per_sec": bad}, 8, 1.0) is None, bad
    assert window_event({**one, "samples": "x"}, 8, 1.0) == (1.2, True)  # unknown: not more
    assert window_event({"event": "warmup_step", "seconds": 6.6}, 8, 1.0) is None
