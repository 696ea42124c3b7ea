"""The memory watcher of a trial's process tree: how the memory limit is enforced on CPU, where
the trial's loader workers are processes of their own and the kernel does not stop at a limit."""

from __future__ import annotations

import contextlib
import math
import time

import psutil

from autotune.trial.processes import descendants


class TreeMemory:
    """The peak memory of a trial's process tree while it runs, and the memory limit's check.

    The figure of a tree of several processes is PSS, which splits the pages forked loader
    workers share with their parent, so they are not counted once per worker. PSS is costly to
    read: the kernel walks every page table of the process under its memory-map lock (~45 ms
    for a 4 GB BERT trial here), and read at 5 Hz it slowed a BERT trial by ~11% on a 2-core
    CPU (interleaved runs; RSS at 5 Hz: ~2%). So each sample reads RSS, a counter, and PSS only
    when the tree's RSS passes its last high by RSS_STEP, passes the limit, or PSS_EVERY_S has
    gone by: RSS >= PSS, so PSS cannot reach a figure RSS has not. A tree of one process shares
    its pages with no worker: its RSS is its figure, and PSS is never read.
    The tree's processes are found by walking it (``processes.descendants``) every
    TREE_EVERY_S.
    """

    RSS_STEP = 1.02
    PSS_EVERY_S = 5.0
    TREE_EVERY_S = 1.0

    def __init__(self, pid: int, limit: int | None = None) -> None:
        self.pid, self.limit = pid, limit
        self.peak = 0
        self._rss_high = 0  # the tree's RSS at the last PSS read
        self._pss_at = self._tree_at = -math.inf
        self._procs: list[psutil.Process] = []

    def sample(self) -> bool:
        """Sample the tree once; returns whether it is over the limit."""
        now = time.monotonic()
        if now - self._tree_at >= self.TREE_EVERY_S:
            self._procs, self._tree_at = _tree(self.pid), now
        procs = self._procs
        rss = sum(_memory(proc, "rss") for proc in procs)
        over = self.limit is not None and rss > self.limit
        if len(procs) <= 1:
            self.peak = max(self.peak, rss)
            return over
        if rss <= self._rss_high * self.RSS_STEP and not over \
                and now - self._pss_at < self.PSS_EVERY_S:
            return False
        pss = sum(_memory(proc, "pss") for proc in procs)
        self.peak = max(self.peak, pss)
        self._rss_high, self._pss_at = max(self._rss_high, rss), now
        return self.limit is not None and pss > self.limit


def _tree(pid: int) -> list[psutil.Process]:
    out = []
    for each in [pid, *descendants(pid)]:
        with contextlib.suppress(psutil.Error):
            out.append(psutil.Process(each))
    return out


def _memory(proc: psutil.Process, kind: str) -> int:
    try:
        if kind == "rss":
            return int(proc.memory_info().rss)
        info = proc.memory_full_info()
        return int(getattr(info, "pss", 0) or info.rss)
    except psutil.Error:
        return 0
