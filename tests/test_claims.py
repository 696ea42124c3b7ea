"""What a user is told of a claim: a check's speedup now against the claimed one and its
interval (tuner.check), from crafted readings. Pure: no process runs here (the check itself
runs in tests/test_examples.py)."""

from __future__ import annotations

from dataclasses import replace

from autotune.config.knobs import Config
from autotune.profile import Profile
from autotune.tuner.check import CheckResult, claim_lines, claimed_baseline

BASE = Config(micro_batch_size=8)
WIN = Config(micro_batch_size=16, amp="bf16")


def profile(speedup: float | None = 2.0, interval: tuple[float, float] | None = (1.8, 2.2),
            baseline: Config = BASE) -> Profile:
    return Profile(
        workload={"name": "mlp", "spec": "mlp", "params": {}}, config=WIN, env={},
        result={"samples_per_sec": 200.0, "spread_cv": 0.01},
        baseline={"config": baseline.to_dict(), "samples_per_sec": 100.0}, speedup=speedup,
        fingerprint={"device": "cpu"}, provenance={"study": "s"},
        speedup_interval=None if interval is None else
        {"low": interval[0], "high": interval[1], "level": 0.9, "rounds": 2})


def checked(wins: list[float | None], bases: list[float | None]) -> CheckResult:
    r = CheckResult(recorded=200.0, threshold=0.9, paired_rates=list(wins),
                    baseline_rates=list(bases))
    r.rates = [w for w in wins if w]
    r.baseline_failures = [f"round {i + 1}: oom: out of memory"
                           for i, b in enumerate(bases) if b is None]
    return r


def test_only_a_claim_over_another_config_is_checked() -> None:
    base = claimed_baseline(profile())
    assert base is not None and base.config == BASE and base.env == {}
    assert claimed_baseline(profile(speedup=None)) is None  # nothing claimed
    assert claimed_baseline(profile(speedup=1.0)) is None  # no win: the baseline kept
    assert claimed_baseline(profile(baseline=WIN)) is None  # the baseline is the winner


def test_the_speedup_now_pairs_rounds_and_says_where_it_lies() -> None:
    r = checked([190.0, 210.0, 205.0], [100.0, 95.0, None])
    now = r.speedup
    assert now is not None
    value, iv = now
    assert value == 200.0 / 97.5  # the rounds both ran in: medians 200 and 97.5
    assert iv is not None and iv.rounds == 2 and iv.low < value < iv.high
    lines = claim_lines(profile(), r)
    assert lines[0].startswith("speedup now 2.05x (") and \
        "against 2.00x (1.80-2.20x) claimed (2 round(s) side by side)" in lines[0]
    assert lines[1] == "  inside the claimed interval"
    assert lines[2] == "  baseline round 3: oom: out of memory"


def test_a_speedup_outside_the_claim_says_so_and_which_side() -> None:
    low = claim_lines(profile(), checked([150.0, 152.0], [100.0, 101.0]))
    assert low[1].startswith("  below the claimed interval: the machine or the software")
    high = claim_lines(profile(interval=(1.2, 1.4)), checked([150.0, 152.0], [100.0, 101.0]))
    assert high[1].startswith("  above the claimed interval")
    # A profile from before intervals: the figures, no verdict on an interval it lacks.
    old = claim_lines(profile(interval=None), checked([150.0], [100.0]))
    assert old == ["speedup now 1.50x (1.19-1.89x) against 2.00x claimed (1 round(s) side by "
                   "side)"]


def test_no_claim_line_without_the_baseline_and_a_plain_one_when_no_round_paired() -> None:
    assert claim_lines(profile(), CheckResult(recorded=200.0, threshold=0.9)) == []
    none = checked([None], [100.0])
    none.failures = ["round 1: error: boom"]
    assert claim_lines(profile(), none) == [
        "speedup now: not measured (no round ran both the winner and the baseline: round 1: "
        "error: boom)"]
    assert replace(profile(), speedup=None).speedup is None
