"""Several ranks, one outcome: the result a trial of several ranks reports (the slowest rank's
pace counts), and which rank's failure caused the others' (on whichever node it happened: a
cluster engine's trial relays every node's rank reports to the tuner)."""

from __future__ import annotations

from autotune.trial.protocol import WindowStats
from autotune.trial.result import RankSummary, TrialResultDoc


def merge_ranks(docs: list[TrialResultDoc]) -> TrialResultDoc:
    """One trial result from every rank's report (in rank order), by the slowest-rank rule.

    Window i of the trial took as long as the slowest rank's window i (the ranks run in lockstep,
    so the job goes at the pace of its slowest rank) and processed all ranks' samples; its data
    and communication waits are the slowest rank's. Ranks agree on every stop decision, so they
    report the same number of windows. Peak memory is the largest rank's (a per-rank limit).
    The per-rank reports are kept, shortened, under ``ranks``.
    """
    first = docs[0]
    merged = first.copy()
    # What one rank said of itself only.
    merged.pop("rank", None)
    merged.pop("comm", None)
    merged.pop("failed_at", None)
    merged["world_size"] = len(docs)
    merged["peak_memory_bytes"] = max(int(d.get("peak_memory_bytes") or 0) for d in docs)
    merged["ranks"] = [_summary(d) for d in docs]
    counts = {len(d.get("windows") or []) for d in docs}
    if first.get("status") != "ok" or len(counts) != 1:
        if len(counts) != 1:
            merged["status"] = "error"
            merged["reason"] = (f"ranks reported different window counts {sorted(counts)}; "
                                "the trial's ranks fell out of step")
        return merged
    windows = []
    for i in range(counts.pop()):
        slowest = max(range(len(docs)), key=lambda r: docs[r]["windows"][i]["seconds"])
        w = docs[slowest]["windows"][i].copy()
        w["samples"] = sum(d["windows"][i]["samples"] for d in docs)
        w["slowest_rank"] = docs[slowest].get("rank", slowest)
        windows.append(w)
    stats = WindowStats(windows)
    merged["windows"] = windows
    merged["samples_per_sec"] = stats.median
    merged["spread_cv"] = stats.spread
    merged["step_time_s"] = stats.step_time_s
    return merged


def _summary(d: TrialResultDoc) -> RankSummary:
    """One rank's report, shortened for the merged result."""
    ws = d.get("windows") or []
    entry: RankSummary = {"rank": d.get("rank"), "status": d.get("status"),
                          "peak_memory_bytes": d.get("peak_memory_bytes"),
                          "window_seconds": [w["seconds"] for w in ws]}
    if ws:
        stats = WindowStats(ws)
        entry["samples_per_sec"] = stats.median
        entry["breakdown"] = stats.breakdown
    if "comm" in d:
        entry["comm"] = d["comm"]
    return entry


def first_failure(docs: list[TrialResultDoc]) -> TrialResultDoc | None:
    """The report of the rank that failed first: its failure is the cause; the other ranks'
    errors (a peer closing the connection) are consequences."""
    failed = [d for d in docs if isinstance(d, dict) and "failed_at" in d]
    if not failed:
        return None
    doc = min(failed, key=lambda d: d["failed_at"]).copy()
    doc["reason"] = f"rank {doc.get('rank')}: {doc.get('reason')}"
    return doc
