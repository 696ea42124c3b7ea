"""Several ranks, one outcome: the result a trial of several ranks reports (the slowest rank's
pace counts), and which rank's failure caused the others' (on this node, or, for a trial across
machines, on another one)."""

from __future__ import annotations

from typing import Any, TypedDict

from autotune.trial.measurement import RawResult, classify
from autotune.trial.protocol import WindowStats
from autotune.trial.result import RankSummary, TrialResultDoc


class Death(TypedDict):
    """A rank that died without a report, as classified on its node."""

    status: str
    reason: str | None


class NodeFailure(TypedDict, total=False):
    """What an agent publishes of its node's failed part of a trial: its first failed rank's
    report, or the death of a rank that wrote none."""

    doc: TrialResultDoc
    death: Death


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


def node_failure(raw: RawResult, device: str = "cpu") -> NodeFailure | None:
    """What ``autotune agent`` publishes of its node's part of a trial across machines when it
    failed: the report of its first failed rank (``doc``), or, for a rank that died without
    writing one (a signal, the memory limit), the classified death (``death``). None when the
    part ran through or was ended from outside (the tuner, a timeout, Ctrl-C)."""
    if raw.stopped or raw.interrupted or raw.timed_out:
        return None
    if isinstance(raw.result, dict) and "failed_at" in raw.result:
        return {"doc": raw.result}
    if raw.returncode in (0, None) and not raw.killed_for_memory:
        return None
    m = classify(raw, device)
    return {"death": {"status": m.status, "reason": m.reason}} if m.status != "ok" else None


def node_cause(local: TrialResultDoc | None,
               reports: list[dict[str, Any]]) -> TrialResultDoc | None:
    """The report that names the cause of a failed trial across machines, from this node's
    (``local``: its first failed rank's report) and the other nodes' agents' ``node_failure``
    reports (with their ``host``). A rank that died on another node without a report outranks
    every written one, as on one machine; else the earliest failure, wherever it happened: the
    other ranks' errors (a peer closing the connection) are its consequences."""
    for r in reports:
        death = r.get("death")
        if death and local is not None:
            return {**local, "status": death["status"],
                    "reason": f"{death['reason']} (on {r.get('host')})"}
    docs: list[TrialResultDoc] = [
        {**r["doc"], "reason": f"{r['doc'].get('reason')} (on {r.get('host')})"}
        for r in reports if isinstance(r.get("doc"), dict) and "failed_at" in r["doc"]]
    if local is not None and "failed_at" in local:
        docs.append(local)
    return min(docs, key=lambda d: float(d["failed_at"])) if docs else local
