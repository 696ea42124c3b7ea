"""Trials side by side in one driver: one thread per slot of a cluster engine's nodes, each
running the ordinary trial loop (ask, claim, measure, record) against the one study.

The loop already works for a fleet of workers sharing a study (the study lock, claims,
``--trials`` counting the trials running now), so the threads need nothing new from it: each
gets its own ``Measurer`` (its slot, its devices record), the reporter is called by one at a time,
and Ctrl-C in the main thread ends every slot's trial through an event their launchers watch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from autotune.trial.progress import ProgressEvent
from autotune.tuner.measurer import Measurer
from autotune.tuner.reporting import Reporter

JOIN_POLL_S = 0.5


class SerialReporter:
    """A reporter that slots call one at a time. Progress events are left out: the windows of
    trials running side by side would read as one trial's."""

    def __init__(self, inner: Reporter) -> None:
        self.inner, self._lock = inner, threading.Lock()

    def trial_event(self, event: ProgressEvent) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return attr(*args, **kwargs)

        return call


def run_slots(base: Measurer, slots: int, bind: Callable[[Measurer], None],
              loop: Callable[[], tuple[bool, str]]) -> tuple[bool, str]:
    """Run ``loop`` in ``slots`` threads, each after ``bind`` gave it a measurer of its own
    slot; returns (interrupted, why the slots stopped)."""
    interrupt = threading.Event()
    results: list[tuple[bool, str] | BaseException] = []

    def work(slot: int) -> None:
        bind(replace(base, slot=slot, held={}, interrupt=interrupt))
        try:
            results.append(loop())
        except BaseException as exc:  # noqa: BLE001 - raised again in the main thread
            results.append(exc)
            interrupt.set()  # one slot failing ends the run: the others stop their trials

    threads = [threading.Thread(target=work, args=(i,), daemon=True, name=f"slot-{i}")
               for i in range(slots)]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(JOIN_POLL_S)
    except KeyboardInterrupt:
        interrupt.set()
        for t in threads:
            t.join()
        return True, "interrupted"
    for r in results:
        if isinstance(r, BaseException):
            raise r
    done = [r for r in results if not isinstance(r, BaseException)]
    if any(interrupted for interrupted, _ in done):
        return True, "interrupted"
    return False, next((why for _, why in done if why), "")
