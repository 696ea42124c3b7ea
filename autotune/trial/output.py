"""A trial's output (stdout and stderr together), kept within a size: the head and the tail.

A trial that prints in a loop (a progress bar per step, a warning per batch) would otherwise keep
megabytes to gigabytes per trial under ``studies/``. The trial writes into a pipe; a thread of
the tuner keeps the first ``head`` bytes in the trial's ``stderr.log`` as they come, the last
``tail`` bytes in memory, and at the end writes a line saying how much was cut between them,
then the tail. Everything the tuner reads back (the stderr tail a failed trial is explained by)
comes from memory, so a trial that deletes its own folder loses the tuner nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

LOG_HEAD_BYTES = 512 * 1024
LOG_TAIL_BYTES = 512 * 1024


class CappedLog:
    """The write end (``fd``) goes to the trial process as its stdout and stderr; ``close``
    ends the copying and returns the last ``tail`` bytes of everything the trial wrote."""

    def __init__(self, path: str | Path, head: int = LOG_HEAD_BYTES,
                 tail: int = LOG_TAIL_BYTES) -> None:
        self.head, self.tail = head, tail
        self.file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._read, self.fd = os.pipe()
        self.kept = 0  # bytes in the file's head
        self.seen = 0  # bytes the trial wrote
        self.last = bytearray()  # the last `tail` bytes seen
        self._thread = threading.Thread(target=self._pump, daemon=True, name="trial-output")
        self._thread.start()

    def started(self) -> None:
        """The trial holds the write end now: close ours, so its exit ends the copying."""
        os.close(self.fd)

    def _pump(self) -> None:
        while True:
            try:
                chunk = os.read(self._read, 1 << 16)
            except OSError:
                break
            if not chunk:
                break
            self.seen += len(chunk)
            if self.kept < self.head:
                part = chunk[:self.head - self.kept]
                with contextlib.suppress(OSError, ValueError):
                    self.file.write(part)
                    self.file.flush()
                self.kept += len(part)
            self.last += chunk
            if len(self.last) > 2 * self.tail:  # trim now and then, not on every chunk
                del self.last[:-self.tail]

    def close(self, wait_s: float = 5.0) -> bytes:
        """Stop copying (a process that outlived the trial and still holds the pipe is not
        waited for past ``wait_s``), write the cut and the tail, return the tail."""
        self._thread.join(wait_s)
        if not self._thread.is_alive():
            # Closed only once nobody reads it: a number closed under a blocked reader could be
            # reused by the next open, and the reader would drain someone else's file.
            os.close(self._read)
        tail = bytes(self.last[-self.tail:])
        after_head = self.seen - self.kept
        with contextlib.suppress(OSError, ValueError):
            if after_head > len(tail):
                cut = after_head - len(tail)
                self.file.write(f"\n[autotune: {cut} bytes of the trial's output cut here; "
                                f"{self.seen} in all: the first {self.kept} and the last "
                                f"{len(tail)} are kept]\n".encode())
            self.file.write(tail[-after_head:] if after_head else b"")
        with contextlib.suppress(OSError):
            self.file.close()
        return tail
