"""A measuring tool that never finishes, for the launcher's tests: ``python -m
autotune.testing.tool hang OUT`` sleeps (in every rank, under torchrun) and writes nothing."""

from __future__ import annotations

import sys
import time

if __name__ == "__main__":
    if sys.argv[1:2] == ["hang"]:
        while True:
            time.sleep(1)
