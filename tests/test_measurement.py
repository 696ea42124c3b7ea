from __future__ import annotations

from typing import Any

import pytest

from autotune.trial.measurement import (
    INTERRUPTED,
    MEMORY_LIMIT,
    TOO_SLOW,
    TRIAL_TIMEOUT,
    Measurement,
    RawResult,
    classify,
    is_oom,
)
from autotune.trial.merge import first_failure, merge_ranks
from autotune.trial.protocol import median_and_cv
from autotune.trial.result import RESULT_SCHEMA, check_result


def ok_doc(**extra: Any) -> dict[str, Any]:
    return {"schema": RESULT_SCHEMA, "status": "ok", "peak_memory_bytes": 1000,
            "windows": [{"samples": 100, "seconds": 1.0, "data_wait_s": 0.25},
                        {"samples": 100, "seconds": 0.5, "data_wait_s": 0.0},
                        {"samples": 100, "seconds": 0.8, "data_wait_s": 0.1}],
            "timings": {"measure_s": 2.3}, "flops_per_sample": 1e9, **extra}


def raw(**kw: Any) -> RawResult:
    base: dict[str, Any] = dict(returncode=0, timed_out=False, result=None, stderr_tail="",
                                wall_s=10.0, timeout_s=30.0)
    return RawResult(**{**base, **kw})


def test_median_and_cv() -> None:
    assert median_and_cv([2.0]) == (2.0, 0.0)
    med, cv = median_and_cv([1.0, 2.0, 3.0])
    assert med == 2.0 and cv == pytest.approx(0.5)


def test_ok_uses_the_median_window_and_splits_step_time() -> None:
    m = classify(raw(result=ok_doc(), tree_peak_bytes=5000))
    assert m.status == "ok" and m.reason is None
    assert m.samples_per_sec == pytest.approx(125.0)  # rates 100, 200, 125
    assert m.breakdown["data_wait"] == pytest.approx(0.35 / 2.3)
    assert m.peak_memory_bytes == 5000  # on CPU the process tree's peak counts
    assert m.tflops == pytest.approx(125.0 * 1e9 / 1e12)
    assert m.overhead_share() == pytest.approx(1 - 2.3 / 10.0)


def test_a_finished_trial_over_the_limit_is_an_oom_even_if_no_sample_caught_it() -> None:
    m = classify(raw(result=ok_doc(peak_memory_bytes=3 * 2**30), memory_limit_bytes=2**30))
    assert m.status == "oom" and m.ended_by == MEMORY_LIMIT and len(m.windows) == 3
    assert "peak memory 3.00 GiB passed the memory limit of 1.00 GiB" in (m.reason or "")
    assert classify(raw(result=ok_doc(), memory_limit_bytes=2**30)).ok


def test_cuda_peak_is_the_device_figure_not_host_rss() -> None:
    assert classify(raw(result=ok_doc(), tree_peak_bytes=5000), "cuda").peak_memory_bytes == 1000


@pytest.mark.parametrize(("kw", "status", "reason"), [
    (dict(interrupted=True, returncode=-9), "error", "interrupted by the user"),
    (dict(killed_for_memory=True, returncode=-9, tree_peak_bytes=3 * 2**30), "oom",
     "passed the memory limit at 3.00 GiB"),
    (dict(timed_out=True, returncode=-9), "timeout", "killed at the 30s trial timeout"),
    (dict(returncode=1, stderr_tail="Traceback...\ntorch.OutOfMemoryError: CUDA out of memory. "
          "Tried to allocate 2.00 GiB"), "oom", "CUDA out of memory"),
    (dict(returncode=1, stderr_tail="RuntimeError: [enforce fail at alloc_cpu.cpp:117] "
          "DefaultCPUAllocator: can't allocate memory"), "oom", "can't allocate memory"),
    (dict(returncode=-9), "oom", "OOM killer"),
    (dict(returncode=-11), "error", "SIGSEGV"),
    (dict(returncode=3, stderr_tail="boom\nValueError: bad thing\n"), "error",
     "exited with code 3 and no result: ValueError: bad thing"),
    (dict(result={"schema": "other"}), "error", "bad trial result"),
    (dict(result=ok_doc(windows=[])), "error", "at least one timed window"),
    (dict(result={"schema": RESULT_SCHEMA, "status": "oom", "reason": "OutOfMemoryError: x",
                  "peak_memory_bytes": 7}), "oom", "OutOfMemoryError: x"),
])
def test_outcomes(kw: dict[str, Any], status: str, reason: str) -> None:
    m = classify(raw(**kw))
    assert m.status == status
    assert reason in (m.reason or "")


@pytest.mark.parametrize(("kw", "ended_by", "is_result"), [
    (dict(interrupted=True, returncode=-9), INTERRUPTED, False),
    (dict(killed_for_memory=True, returncode=-9), MEMORY_LIMIT, True),
    (dict(timed_out=True, returncode=-9), TRIAL_TIMEOUT, True),
    (dict(result={"schema": RESULT_SCHEMA, "status": "timeout", "peak_memory_bytes": 1}),
     TOO_SLOW, True),
    (dict(result=ok_doc()), None, True),
])
def test_why_a_trial_ended_is_typed(kw: dict[str, Any], ended_by: str | None,
                                    is_result: bool) -> None:
    m = classify(raw(**kw))
    assert m.ended_by == ended_by and m.is_result is is_result


def test_oom_is_recognised_by_type_and_message() -> None:
    assert is_oom(MemoryError())
    assert is_oom(RuntimeError("DataLoader worker (pid 12) is killed by signal: Killed."))
    assert is_oom(RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory"))
    assert not is_oom(ValueError("shapes do not match"))


def test_timeout_keeps_partial_windows_as_a_rough_hint_only() -> None:
    m = classify(raw(timed_out=True, returncode=-9,
                     partial_windows=[{"samples": 10, "seconds": 2.0, "data_wait_s": 0.0}]))
    assert m.status == "timeout" and m.samples_per_sec is None
    assert m.rough_samples_per_sec == pytest.approx(5.0)
    assert "after 1 window(s) at 5.00 samples/s" in (m.reason or "")


def test_self_reported_too_slow_trial() -> None:
    doc = {"schema": RESULT_SCHEMA, "status": "timeout", "reason": "one optimizer step takes 90s",
           "first_step_samples_per_sec": 0.5, "peak_memory_bytes": 1}
    m = classify(raw(result=doc))
    assert m.status == "timeout" and m.rough_samples_per_sec == 0.5


def test_check_result_names_each_problem() -> None:
    problems = check_result({"schema": "x", "status": "maybe", "peak_memory_bytes": 1.5})
    assert len(problems) == 3
    assert check_result(ok_doc()) == []


def test_one_window_has_an_unknown_spread_not_zero() -> None:
    doc = ok_doc(windows=[{"samples": 100, "seconds": 2.0, "data_wait_s": 0.0}])
    m = classify(raw(result=doc))
    assert m.ok and m.samples_per_sec == 50.0 and m.spread_cv is None


def _rank_doc(rank: int, seconds: list[float], **extra: object) -> dict:
    return {"schema": RESULT_SCHEMA, "status": "ok", "rank": rank, "peak_memory_bytes": 100 + rank,
            "windows": [{"steps": 2, "samples": 16, "seconds": s, "data_wait_s": 0.01 * rank,
                         "comm_wait_s": 0.1} for s in seconds], **extra}


def test_merging_ranks_takes_the_slowest_rank_per_window_and_all_samples() -> None:
    merged = merge_ranks([_rank_doc(0, [1.0, 2.0, 1.0]), _rank_doc(1, [2.0, 1.0, 1.5])])
    assert [w["seconds"] for w in merged["windows"]] == [2.0, 2.0, 1.5]
    assert [w["slowest_rank"] for w in merged["windows"]] == [1, 0, 1]
    assert all(w["samples"] == 32 for w in merged["windows"])
    assert merged["samples_per_sec"] == 16.0  # median of 16, 16, 21.3
    assert merged["peak_memory_bytes"] == 101 and merged["world_size"] == 2
    assert [r["window_seconds"] for r in merged["ranks"]] == [[1.0, 2.0, 1.0], [2.0, 1.0, 1.5]]
    m = classify(RawResult(returncode=0, timed_out=False, result=merged, stderr_tail="",
                           wall_s=5.0))
    assert m.ok and len(m.ranks) == 2
    assert m.breakdown["comm_wait"] == pytest.approx(0.3 / 5.5)
    assert m.breakdown["compute"] == pytest.approx(1 - 0.3 / 5.5 - m.breakdown["data_wait"])


def test_ranks_out_of_step_are_an_error_not_a_number() -> None:
    merged = merge_ranks([_rank_doc(0, [1.0, 1.0]), _rank_doc(1, [1.0])])
    assert merged["status"] == "error" and "different window counts [1, 2]" in merged["reason"]


def test_the_first_rank_to_fail_is_the_cause() -> None:
    cause = {"rank": 1, "status": "oom", "reason": "CUDA out of memory", "failed_at": 10.0}
    echo = {"rank": 0, "status": "error", "reason": "Connection closed by peer", "failed_at": 10.4}
    doc = first_failure([echo, cause])
    assert doc is not None and doc["status"] == "oom"
    assert doc["reason"] == "rank 1: CUDA out of memory"
    assert first_failure([]) is None


def _classify_echo(summary: str, reason: str) -> Measurement:
    """rank 0's written report of a peer's failure, with torchrun's closing summary."""
    echo = {"schema": RESULT_SCHEMA, "status": "error", "rank": 0, "failed_at": 1.0,
            "reason": reason, "windows": [], "peak_memory_bytes": 0}
    return classify(RawResult(returncode=1, timed_out=False, result=echo, stderr_tail=summary,
                              wall_s=3.0))


def test_a_rank_killed_by_the_kernel_is_an_oom_named_by_torchrun() -> None:
    summary = ("autotune.trial.bench FAILED\nFailures:\n[1]:\n  rank      : 0 (local_rank: 0)\n"
               "  exitcode  : 1 (pid: 11)\nRoot Cause (first observed failure):\n[0]:\n"
               "  time      : 2026-11-29_20:04:49\n  rank      : 1 (local_rank: 1)\n"
               "  exitcode  : -9 (pid: 12)\n  error_file: <N/A>\n")
    closed = "rank 0: RuntimeError: Connection closed by peer"
    m = _classify_echo(summary, closed)
    assert m.status == "oom" and m.reason is not None and m.reason.startswith("rank 1 was killed")
    # The rank that reported is the root cause itself: its own report stands.
    m = _classify_echo(summary.replace("exitcode  : -9", "exitcode  : 1"), closed)
    assert m.status == "error" and "Connection closed" in (m.reason or "")


def test_a_signal_death_is_the_cause_even_when_torchrun_names_a_peer_first() -> None:
    # torchrun stamps failures by the second: the peer's "connection reset" can be named first.
    summary = ("autotune.trial.bench FAILED\n------\nFailures:\n[1]:\n"
               "  time      : 2026-11-29_20:04:49\n"
               "  rank      : 1 (local_rank: 1)\n  exitcode  : -11 (pid: 12)\n"
               "  traceback : Signal 11 (SIGSEGV) received by PID 12\n------\n"
               "Root Cause (first observed failure):\n[0]:\n  time      : 2026-11-29_20:04:49\n"
               "  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 11)\n")
    reset = "rank 0: RuntimeError: Connection reset by peer"
    m = _classify_echo(summary, reset)
    assert m.status == "error" and m.reason == "rank 1 died from SIGSEGV", m.reason
    # A rank that torchrun stopped with SIGTERM after the reporter failed is not a cause.
    m = _classify_echo(summary.replace("exitcode  : -11", "exitcode  : -15"), reset)
    assert m.status == "error" and "Connection reset" in (m.reason or ""), m.reason
