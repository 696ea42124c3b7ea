"""The trial process tree's memory watcher: what it reads, and when."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

import autotune.trial.memory as memory_mod
from autotune.trial.memory import TreeMemory

HOLD = ("import sys; a = b'x' * (64 << 20); print('held', flush=True); sys.stdin.readline(); "
        "b = b'y' * (128 << 20); print('grown', flush=True); sys.stdin.readline()")
# The same with a forked child (a loader worker) that shares the parent's pages until the end.
WITH_WORKER = ("import os, sys, time; a = b'x' * (64 << 20)\n"
               "if os.fork() == 0:\n    time.sleep(60); os._exit(0)\n" + HOLD.split("; ", 2)[2])


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    reads: list[str] = []
    real = memory_mod._memory

    def counted(proc: psutil.Process, kind: str) -> int:
        reads.append(kind)
        return real(proc, kind)

    monkeypatch.setattr(memory_mod, "_memory", counted)
    return reads


def _grow(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None and proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "grown"


def test_tree_memory_reads_pss_only_at_new_highs_and_over_the_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """PSS walks the trial's page tables under its memory-map lock (it slowed BERT by ~11% read
    at 5 Hz): with loader workers, read at a new RSS high, over the limit, or every
    PSS_EVERY_S; RSS otherwise."""
    reads = _counted(monkeypatch)
    proc = subprocess.Popen([sys.executable, "-c", WITH_WORKER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "held"
        memory = TreeMemory(proc.pid)
        for _ in range(5):
            assert memory.sample() is False
        assert len(memory._procs) == 2  # the parent and its worker
        assert reads.count("pss") == 2 and reads.count("rss") == 10  # PSS once: the first
        assert memory.peak > 64 << 20
        assert memory.peak < 2 * (64 << 20)  # the worker's shared pages are not counted twice
        first = memory.peak
        _grow(proc)
        memory.sample()
        assert reads.count("pss") == 4 and memory.peak > first + (100 << 20)  # a new high
        # Over the limit: PSS decides, at every sample.
        capped = TreeMemory(proc.pid, limit=100 << 20)
        assert capped.sample() and capped.sample() and reads.count("pss") == 8
        assert not TreeMemory(proc.pid, limit=1 << 40).sample()
    finally:
        for child in psutil.Process(proc.pid).children():
            child.kill()
        proc.kill()
        proc.wait()


def test_a_single_process_is_measured_by_its_rss_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """No worker shares its pages: RSS is the figure, and PSS, which stalls the trial's page
    faults while the kernel walks its page tables, is never read."""
    reads = _counted(monkeypatch)
    proc = subprocess.Popen([sys.executable, "-c", HOLD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "held"
        memory = TreeMemory(proc.pid)
        for _ in range(3):
            assert memory.sample() is False
        assert memory.peak > 64 << 20
        first = memory.peak
        _grow(proc)
        memory.sample()
        assert memory.peak > first + (100 << 20)
        assert TreeMemory(proc.pid, limit=100 << 20).sample()  # over the limit, by RSS
        assert reads and set(reads) == {"rss"}
    finally:
        proc.kill()
        proc.wait()
