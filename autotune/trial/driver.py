"""The tuner's side of the step protocol of a script's trial (``autotune.steps``):
``StepDriver`` reads the step files while the trial runs and measures from them what
``trial.bench`` measures in a built-in workload's trial, by the same rules (``trial.protocol``):
warm-up until two steps in a row agree, then windows of whole steps lasting ``min_window_s``
each, until ``min_windows`` agree within ``target_cv`` or the budget is spent. Step k of the
trial ends when the slowest rank ends it; a window's samples are all ranks' together. It writes
the same progress events and the same result document, so pruning, the budget, the record and
the confirmation treat a script's trial like any other. Then it writes ``stop.json``, naming a
step every rank stops after (a rank that left alone would hang its peers' next collective), and
ends the script after a grace period if it does not stop by itself.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.steps import STOP_FILE, steps_file
from autotune.trial import progress
from autotune.trial.measurement import TRIAL_TIMEOUT
from autotune.trial.protocol import Answer, Measuring, Stop, WarmUp, WindowStats, stop_reason
from autotune.trial.reach import Reach
from autotune.trial.reports import MIN_STEP_S, RankReports, slowest_span, trial_end
from autotune.trial.result import RESULT_SCHEMA, TrialResultDoc, Window
from autotune.trial.script_result import (
    how_to_report,
    overcounted,
    overridden,
    rank_summary,
    timings,
    too_short,
)
from autotune.trial.spec import MeasureSettings

TERM_GRACE_S = 5.0  # after SIGTERM, before SIGKILL


@dataclass
class StepDriver:
    """Measures a script's trial from its step files; see the module's docstring."""

    folder: Path
    world: int
    settings: MeasureSettings
    name: str
    progress_path: str
    result_path: str
    device: str = "cpu"
    started: float = field(default_factory=time.time)
    ranks: list[RankReports] = field(default_factory=list)
    warm_end: int = 0  # the step warm-up ended with (the one before, where it is a window)
    done: bool = False  # a result is written
    stop_at: int = 0  # the step every rank was asked to stop after
    stop_deadline: float | None = None  # time.monotonic() by which the script should have ended
    stop_deadline_s: float = 0.0  # how long after the request that is
    term_sent: float | None = None
    ignored_stop: bool = False
    give_up: bool = False  # the trial is over without a stop request (no progress, too slow)
    # The result document, as decided here: what the tuner reads (the copy in the trial's
    # folder is for the record; the script could write that file too).
    result: TrialResultDoc | None = None

    timeout_s: float = float("inf")  # the trial's hard limit
    # Samples one step of one rank should train on, as the config sets them (micro-batch x
    # accumulation); 0: not checked.
    expected_samples: int = 0

    def __post_init__(self) -> None:
        self.ranks = [RankReports(Path(steps_file(str(self.folder), r)), r)
                      for r in range(self.world)]
        self.reach = Reach(self.folder)
        # The protocol, fed with each step as it ended on the slowest rank, on the wall clock
        # of the step reports; the trial's hard end is its timeout from its start.
        self.measuring = Measuring(self.settings, self.started + self.timeout_s)

    @property
    def warmup(self) -> WarmUp:
        return self.measuring.warm

    @property
    def windows(self) -> list[Window]:
        return self.measuring.windows

    @property
    def per_window(self) -> int:
        return self.measuring.per_window

    def look(self, processes: Mapping[int, float]) -> None:
        """Check the trial's processes (pid -> start time) against the bootstrap's marks: a
        Python process it did not reach ends the trial as an error (``trial.reach``), also
        when windows were measured: the config was not applied there, so they need not be
        its speed."""
        if self.give_up or (self.done and self.result is not None
                            and self.result.get("status") != "ok"):
            return
        why = self.reach.check(processes, reporters=[pid for r in self.ranks for pid in r.pids])
        if why is not None:
            self._finish("error", f"{self.name}: {why}", give_up=True)

    @property
    def no_progress_s(self) -> float:
        """How long the script may run before every rank reported a step: ``no_progress_s``,
        or less under a short trial timeout (which would otherwise say less)."""
        return min(self.settings.no_progress_s, 0.75 * self.timeout_s)

    # -- following the trial ------------------------------------------------------------------

    def poll(self, running: bool = True) -> None:
        """Read what the ranks reported and take every decision it allows (those on the wall
        clock only while the script runs)."""
        # A clock read a little before the start counts: the tuner's and the script's clocks are
        # the same machine's, read a few microseconds apart.
        since = self.started - 1.0
        for rank in self.ranks:
            rank.read(since)
        if self.done or self._untrusted():
            return
        steps = min(len(r.ends) for r in self.ranks)
        if steps == 0:
            if running:
                self._check_progress()
            return
        # A script that exited reported all it ran: no stop spares a wait for more steps (too
        # slow, too late, stuck); its steps are measured as they are.
        self.measuring.more_to_come = running
        self._follow(steps)
        if not self.done and running:
            now = time.time()
            self._decide(self.measuring.waited(self._ends(steps), now), steps, now)

    def _untrusted(self) -> bool:
        """End the trial on a report that cannot be trusted, or on a loss that was not finite,
        naming the step; True when it did."""
        bad = next((r.bad for r in self.ranks if r.bad), None)
        if bad is not None:
            self._finish("error", f"{self.name}: {bad}", give_up=True)
            return True
        diverged = next((r.diverged for r in self.ranks if r.diverged), None)
        if diverged is not None:
            self._finish("diverged", f"the loss of {self.name} was NaN or infinite at "
                         f"{diverged}: this config does not train (with fp16, an overflow)",
                         give_up=True)
            return True
        if not self.folder.is_dir():
            self._finish("error", f"the trial's folder {self.folder} was removed while "
                         f"{self.name} ran: its steps cannot be read", give_up=True)
            return True
        return False

    def action(self, pid: int) -> bool:
        """Whether the trial should be ended now: given up on, or the script is still running
        past its stop deadline (sent SIGTERM first; SIGKILL after ``TERM_GRACE_S``)."""
        if self.give_up:
            return True
        if self.stop_deadline is None:
            return False
        now = time.monotonic()
        if self.term_sent is None and now > self.stop_deadline:
            self.ignored_stop = True
            self.term_sent = now
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
            self._note(f"{self.name} {self._why_still_running()}; ended by signal (its windows "
                       "were measured before)")
        return self.term_sent is not None and now - self.term_sent > TERM_GRACE_S

    @property
    def stopping(self) -> bool:
        """Measured (an ok result is written) and asked to stop."""
        return self.stop_deadline is not None

    def note_timeout(self, timeout_s: float) -> None:
        """The trial timeout ended a script that was stopping after its windows."""
        if not self.ignored_stop:
            self._note(f"{self.name} was still stopping at the {timeout_s:.0f}s trial timeout; "
                       "ended (its windows were measured before)")

    def _why_still_running(self) -> str:
        """What the ranks' steps say about a script that did not end by its stop deadline."""
        at, grace = self.stop_at, self.settings.stop_grace_s
        reached = [len(r.ends) for r in self.ranks]
        if max(reached) > at:  # steps past the one it was asked to stop after
            return (f"ran past step {at}, where it was asked to stop: it does not leave its loop "
                    "when autotune.should_stop() (or autotune's callback) says so")
        if min(reached) >= at:
            return f"left its loop at step {at} but was still running {grace:g}s later"
        return (f"had not reached step {at}, where it was asked to stop, by "
                f"{self.stop_deadline_s:.0f}s after the request")

    def at_exit(self, returncode: int | None) -> None:
        """The script ended by itself: a result from what it reported, if none was written."""
        self.poll(running=False)
        self.look({})  # its processes are gone; those that reported steps are known
        if self.done or returncode != 0:
            return  # a crash: its exit code and stderr say what happened (classify)
        if self.windows:
            self._finish("ok", None)
            return
        steps = min(len(r.ends) for r in self.ranks)
        if max(len(r.ends) for r in self.ranks) == 0:
            self._finish("error", f"{self.name} exited without reporting a step: "
                         f"{how_to_report(self.ranks, self.reach.reached)}")
            return
        self._finish("error", f"{self.name} finished after {steps} step(s), before a window "
                     "could be measured; give it more data or steps (autotune stops it once it "
                     "has measured enough)")

    # -- the protocol ---------------------------------------------------------------------------

    def _ends(self, step: int) -> float:
        """When the slowest rank ended ``step`` (1-based)."""
        return trial_end(self.ranks, step)

    def _follow(self, steps: int) -> None:
        """Feed the protocol the steps reported since the last look, as the slowest rank ended
        them: warm-up's one by one, then each window whose steps all ended, until it stops.
        Step 1 carries the script's start-up, and its start is not reported: warm-up times
        steps 2, 3, ..., and starts (the measuring budget counts from there) when step 1 ends."""
        m = self.measuring
        if not m.warm.step_times:
            m.start(self._ends(1))
        while not self.done:
            warming, n = m.warm.ended_by is None, len(m.warm.step_times)
            edges = (n, n + 1) if warming else m.next_window()  # counted from step 1's end
            a, b = edges[0] + 1, edges[1] + 1
            if b > steps:
                return
            seconds, slowest = slowest_span(self.ranks, a, b)
            if seconds < MIN_STEP_S * (b - a):
                self._finish("error", too_short(self.name, a, b, seconds), give_up=True)
                return
            if warming:
                answer = m.warmup_step(seconds, self._ends(b))
                self._emit("warmup_step", seconds=seconds)
                if m.warm.ended_by is not None:
                    self.warm_end = m.next_window()[0] + 1
            else:
                answer = self._window(a, b, seconds, slowest)
            self._decide(answer, b)

    def _window(self, a: int, b: int, seconds: float, slowest: int) -> Answer:
        """Steps ``a + 1`` to ``b``, ``seconds`` long on rank ``slowest``, as a window: all
        ranks' samples, and the slowest rank's data waits where it reported every one."""
        samples = sum(sum(r.samples[a:b]) for r in self.ranks)
        waits = self.ranks[slowest].waits[a:b]
        wait = {"data_wait_s": sum(w for w in waits if w is not None)} \
            if all(w is not None for w in waits) else {}
        answer = self.measuring.window(seconds, samples, self._ends(b), slowest_rank=slowest,
                                       **wait)
        self._emit("window", index=len(self.windows) - 1, samples=samples, seconds=seconds,
                   samples_per_sec=answer.rate, **wait)
        return answer

    def _decide(self, answer: Answer, steps: int, now: float = 0.0) -> None:
        """End the trial where the protocol stopped after step ``steps`` (at ``now``): with
        windows, they are the result; without, the config is too slow to measure."""
        if not answer.stop:
            return
        if self.windows:
            self._finish("ok", None)
        elif answer.why is Stop.STUCK:
            # The bench's trial timeout would end such a step, but here it is seen.
            before = f" (steps took ~{answer.seconds:.3g}s before)" \
                if self.warmup.step_times else ""
            self._finish("timeout", f"step {steps + 1} of {self.name} had not ended "
                         f"{now - self._ends(steps):.0f}s after step {steps}{before}; warm-up "
                         f"and a window do not fit the {self.settings.max_seconds:.0f}s "
                         "measuring budget", give_up=True)
        else:
            late = answer.why is Stop.TOO_LATE
            self._finish("timeout", stop_reason(answer, self.settings, f" of {self.name}",
                                                f" ({self.timeout_s:.0f}s)"),
                         give_up=True, ended_by=TRIAL_TIMEOUT if late else None)

    def _check_progress(self) -> None:
        """No step from some rank by ``no_progress_s`` after the start: the script does not
        report (or reports on some ranks only)."""
        waited = time.time() - self.started
        if waited <= self.no_progress_s:
            return
        silent = [i for i, r in enumerate(self.ranks) if not r.ends]
        who = self.name if len(silent) == self.world else \
            f"rank(s) {', '.join(map(str, silent))} of {self.name}"
        self._finish("error", f"no progress from {who} in {self.no_progress_s:.0f} s: "
                     f"{how_to_report(self.ranks, self.reach.reached)}", give_up=True)

    # -- the result -----------------------------------------------------------------------------

    @property
    def _measured_end(self) -> int:
        """The step the last window ended with (``warm_end`` before any window)."""
        return self.warm_end + len(self.windows) * self.per_window

    def _finish(self, status: str, reason: str | None, give_up: bool = False,
                ended_by: str | None = None) -> None:
        # A script that trains another batch throughout (its own fixed one) is told how to
        # tune it; a count no batch of the config holds, here and there, is a bad report.
        mismatch = overridden(self.ranks, self.expected_samples, self.name, self.warm_end,
                              self._measured_end) if status == "ok" else None
        bad = overcounted(self.ranks, self.expected_samples, self.name) \
            if status == "ok" and mismatch is None else None
        if mismatch is not None or bad is not None:
            status, reason, give_up = "error", mismatch or bad, True
        doc = self._document(status, reason, samples_mismatch=mismatch is not None)
        if ended_by is not None:
            doc["ended_by"] = ended_by
        self.result = doc
        _write_json(self.result_path, doc)
        self.done, self.give_up = True, give_up
        if status == "ok":
            self._request_stop(max(len(r.ends) for r in self.ranks))

    def _document(self, status: str, reason: str | None, samples_mismatch: bool) -> TrialResultDoc:
        """The result document, as a built-in workload's trial writes it."""
        warm, ranks = self.warmup, self.ranks
        doc: TrialResultDoc = {
            "schema": RESULT_SCHEMA, "status": status, "reason": reason,
            "windows": self.windows, "device": self.device, "world_size": self.world,
            "peak_memory_bytes": max(r.peak for r in ranks),
            "memory_source": "reported by the script (CUDA allocator)"
            if any(r.peak for r in ranks) else "process tree",
            "timings": timings(ranks, self.started, self.warm_end, self._measured_end),
            "script": {"name": self.name, "steps": [len(r.ends) for r in ranks],
                       "accessed": sorted({a for r in ranks for a in r.accessed}),
                       "default_samples": any(r.default_samples for r in ranks),
                       "samples_mismatch": samples_mismatch}}
        readback = next((r.readback for r in ranks if r.readback is not None), None)
        if readback is not None:
            doc["script"]["readback"] = readback
        if ranks[0].sentinel:
            doc["sentinel"] = ranks[0].sentinel
        if warm.step_times:
            doc["warmup"] = warm.record(doc["timings"].get("warmup_s", 0.0))
        if self.windows:
            doc["steps_per_window"] = self.per_window
            doc["step_time_s"] = WindowStats(self.windows).step_time_s
        if self.world > 1:
            doc["ranks"] = [rank_summary(r, self.warm_end, self.per_window, len(self.windows))
                            for r in ranks]
        if status == "timeout" and warm.step_times and warm.step_times[-1] >= MIN_STEP_S:
            per_step = sum(r.samples[-1] for r in ranks if r.samples)
            doc["first_step_samples_per_sec"] = per_step / warm.step_times[-1]
        return doc

    def _request_stop(self, seen: int) -> None:
        """Every rank stops after the same step, far enough ahead that none has passed it
        when it reads the request (ranks look every 50 ms; this side polls every 100 ms). The
        script has until those steps ran (at the slowest pace measured, with half again on
        top) and ``stop_grace_s`` more to end by itself: a 30 s step is not a script that
        ignores the request."""
        paces = [w["seconds"] / w["steps"] for w in self.windows] or \
            self.warmup.step_times[-1:] or [1.0]
        step_s = max(max(paces), 1e-4)
        ahead = 1 if self.world == 1 else math.ceil(1.0 / step_s) + 2
        self.stop_at = seen + ahead
        _write_json(str(self.folder / STOP_FILE), {"at_step": self.stop_at})
        self.stop_deadline_s = 1.5 * ahead * step_s + self.settings.stop_grace_s
        self.stop_deadline = time.monotonic() + self.stop_deadline_s

    def _note(self, text: str) -> None:
        """Add a note to the result (an ok result keeps it as its reason)."""
        if self.result is not None:
            self.result["note"] = text
            _write_json(self.result_path, self.result)

    def _emit(self, event: str, **data: Any) -> None:
        # The script may have removed its folder: the trial ends on that (``_untrusted``),
        # never the tuner.
        progress.append(self.progress_path, event, **data)


def _write_json(path: str, doc: Mapping[str, object]) -> None:
    """Write atomically (nobody reads half a document); the copy on disk is for the record,
    the driver's own is what counts, so a folder the script removed loses nothing."""
    tmp = Path(path + ".tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(doc))
        tmp.replace(path)
