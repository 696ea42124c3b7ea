"""Several ranks, one outcome: the result a trial of several ranks reports (the slowest rank's
pace counts), and which rank's failure caused the others' (on this node, or, for a trial across
machines, on another one)."""

from __future__ import annotations

from typing import Any

from autotune.trial.measurement import RawResult, breakdown, classify, median_and_cv, window_stats


def merge_ranks(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One trial result from every rank's report (in rank order), by the slowest-rank rule.

    Window i of the trial took as long as the slowest rank's window i (the ranks run in lockstep,
    so the job goes at the pace of its slowest rank) and processed all ranks' samples; its data
    and communication waits are the slowest rank's. Ranks agree on every stop decision, so they
    report the same number of windows. Peak memory is the largest rank's (a per-rank limit).
    The per-rank reports are kept, shortened, under ``ranks``.
    """
    first = dict(docs[0])
    merged = {k: v for k, v in first.items() if k not in ("rank", "comm", "failed_at")}
    merged["world_size"] = len(docs)
    merged["peak_memory_bytes"] = max(int(d.get("peak_memory_bytes") or 0) for d in docs)
    per_rank = []
    for d in docs:
        ws = d.get("windows") or []
        entry: dict[str, Any] = {"rank": d.get("rank"), "status": d.get("status"),
                                 "peak_memory_bytes": d.get("peak_memory_bytes"),
                                 "window_seconds": [w["seconds"] for w in ws]}
        if ws:
            entry["samples_per_sec"] = median_and_cv([w["samples"] / w["seconds"]
                                                      for w in ws])[0]
            entry["breakdown"] = breakdown(ws)
        if "comm" in d:
            entry["comm"] = d["comm"]
        per_rank.append(entry)
    merged["ranks"] = per_rank
    counts = {len(d.get("windows") or []) for d in docs}
    if first.get("status") != "ok" or len(counts) != 1:
        if len(counts) != 1:
            merged.update(status="error", reason=f"ranks reported different window counts "
                          f"{sorted(counts)}; the trial's ranks fell out of step")
        return merged
    windows = []
    for i in range(counts.pop()):
        slowest = max(range(len(docs)), key=lambda r: docs[r]["windows"][i]["seconds"])
        w = dict(docs[slowest]["windows"][i])
        w["samples"] = sum(d["windows"][i]["samples"] for d in docs)
        w["slowest_rank"] = docs[slowest].get("rank", slowest)
        windows.append(w)
    med, cv, _ = window_stats(windows)
    merged.update(windows=windows, samples_per_sec=med, spread_cv=cv,
                  step_time_s=sum(w["seconds"] for w in windows) / sum(w["steps"]
                                                                       for w in windows))
    return merged


def first_failure(docs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The report of the rank that failed first: its failure is the cause; the other ranks'
    errors (a peer closing the connection) are consequences."""
    failed = [d for d in docs if isinstance(d, dict) and "failed_at" in d]
    if not failed:
        return None
    doc = dict(min(failed, key=lambda d: d["failed_at"]))
    doc["reason"] = f"rank {doc.get('rank')}: {doc.get('reason')}"
    return doc


def node_failure(raw: RawResult, device: str = "cpu") -> dict[str, Any] | None:
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


def node_cause(local: dict[str, Any] | None,
               reports: list[dict[str, Any]]) -> dict[str, Any] | None:
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
    docs = [{**r["doc"], "reason": f"{r['doc'].get('reason')} (on {r.get('host')})"}
            for r in reports if isinstance(r.get("doc"), dict) and "failed_at" in r["doc"]]
    if local is not None and "failed_at" in local:
        docs.append(local)
    return min(docs, key=lambda d: float(d["failed_at"])) if docs else local
