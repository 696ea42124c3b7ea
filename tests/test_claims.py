"""What a user is told of a claim: a check's speedup now against the claimed one and its
interval (tuner.check), from crafted readings. Pure: no process runs here (the check itself
runs in tests/test_examples.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autotune.config.knobs import Config
from autotune.errors import UsageError
from autotune.profile import Profile
from autotune.tuner.check import CheckResult, claim_lines, claimed_baseline
from autotune.tuner.costing import compare, table, training_time
from autotune.tuner.interval import rate_interval

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


# -- what the profile means for the user's run ------------------------------------------------


def confirmed_profile(rates: list[float], fingerprint: dict | None = None,
                      tokens: int | None = None) -> Profile:
    """A profile whose winner's confirmation rounds read ``rates`` (median = its rate)."""
    import statistics

    p = profile()
    result = dict(p.result, samples_per_sec=statistics.median(rates), peak_memory_bytes=6 * 2**30,
                  memory_limit_bytes=8 * 2**30, mfu=0.25)
    if tokens:
        result["tokens_per_sample"] = tokens
    conf = {"rounds": len(rates), "candidates": [
        {"trial": 3, "config": WIN.to_dict(), "samples_per_sec": rates,
         "window_cvs": [0.01] * len(rates)},
        {"trial": 0, "config": BASE.to_dict(), "samples_per_sec": [100.0] * len(rates),
         "baseline": True}]}
    return replace(p, result=result, confirmation=conf,  # type: ignore[arg-type]
                   fingerprint=fingerprint or {"device": "cpu", "cpu_model": "X", "cpu_cores": 2})


def test_the_time_and_cost_to_train_at_the_confirmed_rate_with_its_interval() -> None:
    p = confirmed_profile([190.0, 200.0, 210.0])
    t = training_time(p, samples=3_600_000, price_per_hour=3.0)
    assert t.seconds == 3_600_000 / 200.0 and t.rate.rounds == 3
    iv = rate_interval(200.0, [190.0, 200.0, 210.0], [0.01] * 3)
    assert iv is not None and t.fastest_s == 3_600_000 / iv.high
    assert t.slowest_s == 3_600_000 / iv.low
    assert t.cost(t.seconds) == 5.0 * 3.0  # 5 hours at 3.0
    lines = t.lines(ranks=1)
    assert lines[0] == ("to train   3,600,000 samples at 200 samples/s (185-216, 90% "
                        "interval), median of 3 confirmation round(s): 5.0 h (4.6 h-5.4 h) "
                        "with 1 rank(s)")
    assert lines[1].startswith("costs      15.00 (") and lines[1].endswith(
        "at 3.00 per hour (the price's currency)")
    # Tokens: the profile's tokens per sample; none recorded is one clear error.
    tok = training_time(confirmed_profile([200.0], tokens=128), tokens=128 * 2_000)
    assert tok.seconds == 10.0 and tok.unit == "tokens"
    assert tok.lines(1)[0].startswith("to train   256,000 tokens at 25,600 tokens/s (")
    with pytest.raises(UsageError, match="records no tokens per sample"):
        training_time(p, tokens=1e9)
    with pytest.raises(UsageError, match="one of --train-samples N or --train-tokens N"):
        training_time(p, samples=1.0, tokens=1.0)
    with pytest.raises(UsageError, match="must be a positive number"):
        training_time(p, samples=-5)


def test_an_unconfirmed_profile_says_its_rate_rests_on_one_trial() -> None:
    t = training_time(profile(), samples=1000)
    assert t.rate.rounds == 0 and "one search trial, not confirmed" in t.lines(1)[0]
    assert t.fastest_s is not None and t.fastest_s < t.seconds < (t.slowest_s or 0)


def test_compare_labels_profiles_by_fingerprint_and_never_mixes_them() -> None:
    here = {"device": "cpu", "cpu_model": "AMD EPYC", "cpu_cores": 2}
    other = {**here, "cpu_model": "Intel Xeon"}
    a, b, c = (confirmed_profile([200.0, 210.0], here), confirmed_profile([150.0], other),
               confirmed_profile([205.0], here))
    rows = compare([("a.yaml", a), ("b.yaml", b), ("c.yaml", c)], samples=1e6,
                   prices=[2.0, 1.0, 2.0])
    assert [r.label for r in rows] == ["A", "B", "A"]
    assert rows[0].headroom == 0.25 and rows[0].mfu == 0.25
    assert rows[1].time is not None and rows[1].time.cost(rows[1].time.seconds) == \
        pytest.approx(1e6 / 150.0 / 3600 * 1.0)
    lines = table(rows)
    assert lines[0].split() == ["profile", "ranks", "samples/s", "(90%", "interval)", "MFU",
                                "headroom", "to", "train", "cost"]
    assert lines[1].startswith("A  a.yaml") and lines[2].startswith("B  b.yaml")
    assert "A: CPU AMD EPYC, 2 cores (fingerprint " in lines[-3]
    assert lines[-1].startswith("2 fingerprints: the figures come from different machines")
    same = table(compare([("a.yaml", a), ("c.yaml", c)]))
    assert not any("fingerprints:" in line for line in same)
    doc = rows[1].to_doc()
    assert doc["fingerprint_label"] == "B" and doc["train"]["unit"] == "samples"
    with pytest.raises(UsageError, match="one --price-per-hour for all profiles or one per"):
        compare([("a.yaml", a), ("b.yaml", b), ("c.yaml", c)], samples=1.0, prices=[1.0, 2.0])
