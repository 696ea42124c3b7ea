"""The trial process tree's memory watcher: what it reads, and when."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

import autotune.trial.memory as memory_mod
from autotune.trial.memory import TreeMemory


def test_tree_memory_reads_pss_only_at_new_highs_and_over_the_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """PSS walks the trial's page tables under its memory-map lock (it slowed BERT by ~11% read
    at 5 Hz): read at a new RSS high, over the limit, or every PSS_EVERY_S; RSS otherwise."""
    reads: list[str] = []
    real = memory_mod._memory

    def counted(proc: psutil.Process, kind: str) -> int:
        reads.append(kind)
        return real(proc, kind)

    monkeypatch.setattr(memory_mod, "_memory", counted)
    code = ("import sys; a = b'x' * (64 << 20); print('held', flush=True); sys.stdin.readline(); "
            "b = b'y' * (128 << 20); print('grown', flush=True); sys.stdin.readline()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "held"
        memory = TreeMemory(proc.pid)
        for _ in range(5):
            assert memory.sample() is False
        assert reads.count("pss") == 1 and reads.count("rss") == 5  # one PSS read: the first
        assert memory.peak > 64 << 20
        first = memory.peak
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "grown"
        memory.sample()
        assert reads.count("pss") == 2 and memory.peak > first + (100 << 20)  # a new high
        # Over the limit: PSS decides, at every sample.
        capped = TreeMemory(proc.pid, limit=100 << 20)
        assert capped.sample() and capped.sample() and reads.count("pss") == 4
        assert not TreeMemory(proc.pid, limit=1 << 40).sample()
    finally:
        proc.kill()
        proc.wait()
