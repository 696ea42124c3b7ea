"""The tuner's side of the step protocol of a script's trial (``autotune.steps``):
``StepDriver`` reads the step files while the trial runs and measures from them what
``trial.bench`` measures in a built-in workload's trial: warm-up until two steps in a row agree,
then windows of whole steps lasting ``min_window_s`` each, until ``min_windows`` agree within
``target_cv`` or the budget is spent. Step k of the trial ends when the slowest rank ends it; a
window's samples are all ranks' together. It writes the same progress events and the same
result document, so pruning, the budget, the record and the confirmation treat a script's trial
like any other. Then it writes ``stop.json``, naming a step every rank stops after (a rank that
left alone would hang its peers' next collective), and ends the script after a grace period if
it does not stop by itself.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.steps import STOP_FILE, steps_file
from autotune.trial.measurement import RESULT_SCHEMA, median_and_cv
from autotune.trial.reports import MIN_STEP_S, RankReports
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
    warm: list[float] = field(default_factory=list)
    warm_ended_by: str | None = None
    warm_end: int = 0  # the step warm-up ended with
    per_window: int = 0
    windows: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False  # a result is written
    stop_at: int = 0  # the step every rank was asked to stop after
    stop_deadline: float | None = None  # time.monotonic() by which the script should have ended
    stop_deadline_s: float = 0.0  # how long after the request that is
    term_sent: float | None = None
    ignored_stop: bool = False
    give_up: bool = False  # the trial is over without a stop request (no progress, too slow)
    # The result document, as decided here: what the tuner reads (the copy in the trial's
    # folder is for the record; the script could write that file too).
    result: dict[str, Any] | None = None

    timeout_s: float = float("inf")  # the trial's hard limit
    # Samples one step of one rank should train on, as the config sets them (micro-batch x
    # accumulation); 0: not checked.
    expected_samples: int = 0

    def __post_init__(self) -> None:
        self.ranks = [RankReports(Path(steps_file(str(self.folder), r)), r)
                      for r in range(self.world)]

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
        if self.done:
            return
        if self._untrusted():
            return
        steps = min(len(r.ends) for r in self.ranks)
        if steps == 0:
            if running:
                self._check_progress()
            return
        if self.warm_ended_by is None:
            self._warm_up(steps)
        if self.warm_ended_by is not None and not self.done:
            self._measure(steps)
        if not self.done and running:
            self._check_too_slow()

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
        if self.done or returncode != 0:
            return  # a crash: its exit code and stderr say what happened (classify)
        if self.windows:
            self._finish("ok", None)
            return
        steps = min(len(r.ends) for r in self.ranks)
        if max(len(r.ends) for r in self.ranks) == 0:
            self._finish("error", f"{self.name} exited without reporting a step: call "
                         "autotune.step() once per optimizer step, or add autotune's callback")
            return
        self._finish("error", f"{self.name} finished after {steps} step(s), before a window "
                     "could be measured; give it more data or steps (autotune stops it once it "
                     "has measured enough)")

    # -- the protocol ---------------------------------------------------------------------------

    def _ends(self, step: int) -> float:
        """When the slowest rank ended ``step`` (1-based)."""
        return max(r.ends[step - 1] for r in self.ranks)

    def _duration(self, a: int, b: int) -> tuple[float, int]:
        """Seconds from the end of step ``a`` to the end of step ``b`` on the slowest rank,
        and that rank."""
        spans = [r.ends[b - 1] - r.ends[a - 1] for r in self.ranks]
        slowest = max(range(len(spans)), key=spans.__getitem__)
        return spans[slowest], slowest

    def _warm_up(self, steps: int) -> None:
        """Step 1 carries the script's start-up; warm-up times steps 2, 3, ... until two in a
        row agree (as ``trial.bench.loop.warm_up``)."""
        s = self.settings
        while self.warm_ended_by is None and len(self.warm) + 2 <= steps:
            step = len(self.warm) + 2
            seconds, _ = self._duration(step - 1, step)
            if seconds < MIN_STEP_S:
                self._finish("error", self._too_short(step - 1, step, seconds), give_up=True)
                return
            self.warm.append(seconds)
            self._emit("warmup_step", seconds=seconds)
            elapsed = self._ends(step) - self._ends(1)
            if len(self.warm) >= s.warmup_min_steps:
                a, b = self.warm[-2], self.warm[-1]
                if abs(a - b) / max(a, b, 1e-12) <= s.warmup_tolerance:
                    self.warm_ended_by = "stable"
                elif elapsed > 0.4 * s.max_seconds:
                    self.warm_ended_by = "time"
                elif len(self.warm) >= s.warmup_max_steps:
                    self.warm_ended_by = "max_steps"
            if self.warm_ended_by is not None:
                self.warm_end = step
                self.per_window = max(1, math.ceil(s.min_window_s / max(self.warm[-1], 1e-6)))

    def _measure(self, steps: int) -> None:
        s = self.settings
        while not self.done:
            a = self.warm_end + len(self.windows) * self.per_window
            b = a + self.per_window
            if b > steps:
                return
            seconds, slowest = self._duration(a, b)
            if seconds < MIN_STEP_S * self.per_window:
                self._finish("error", self._too_short(a, b, seconds), give_up=True)
                return
            rank = self.ranks[slowest]
            samples = sum(sum(r.samples[a:b]) for r in self.ranks)
            window: dict[str, Any] = {"steps": self.per_window, "seconds": seconds,
                                      "samples": samples, "slowest_rank": slowest}
            waits = rank.waits[a:b]
            if all(w is not None for w in waits):
                window["data_wait_s"] = sum(w for w in waits if w is not None)
            self.windows.append(window)
            rates = [w["samples"] / w["seconds"] for w in self.windows]
            self._emit("window", index=len(self.windows) - 1, samples=samples, seconds=seconds,
                       samples_per_sec=rates[-1],
                       **({"data_wait_s": window["data_wait_s"]}
                          if "data_wait_s" in window else {}))
            elapsed = self._ends(b) - self._ends(1)
            if (len(rates) >= s.min_windows and median_and_cv(rates)[1] <= s.target_cv) or \
                    len(rates) >= s.max_windows or elapsed + seconds > s.max_seconds:
                self._finish("ok", None)

    def _too_short(self, a: int, b: int, seconds: float) -> str:
        """Why steps ``a + 1`` to ``b``, ``seconds`` long on the slowest rank, are not a
        measurement (end times that do not advance once gave a rate of 4e11 samples/s)."""
        steps = f"step {b}" if b == a + 1 else f"steps {a + 1} to {b}"
        return (f"{self.name}: {steps} took {seconds:.3g}s on the slowest rank "
                f"({seconds / (b - a) * 1e6:.3g} us per step), shorter than reporting a step "
                f"takes ({MIN_STEP_S * 1e6:g} us): these end times were not measured")

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
                     "call autotune.step() once per optimizer step on every rank, or add "
                     "autotune's callback", give_up=True)

    def _check_too_slow(self) -> None:
        """Warm-up and one window cannot fit the measuring budget, as the bench's TooSlow
        judges it: within twice the budget of the first step (whose start a script does not
        report: the budget counts from its end, and the first window needs one step more than
        the bench's, since step 1 is not warm-up here). Predicted from the steps so far as
        soon as they show it, and on the wall clock, so a step that never ends counts too."""
        s = self.settings
        first = self._ends(1)
        now = time.time()
        if self.windows:
            if now - first > 2 * s.max_seconds:  # the budget is spent; keep what was measured
                self._finish("ok", None)
            return
        end_by = first + 2.0 * s.max_seconds
        steps = min(len(r.ends) for r in self.ranks)
        last = self._ends(steps)
        if self.warm:
            step = self.warm[-1]
            # Steps until the first window ends: the rest of warm-up, then the window.
            if self.warm_ended_by is None:
                need = max(s.warmup_min_steps - len(self.warm), 0) + max(
                    1, math.ceil(s.min_window_s / max(step, 1e-6)))
            else:
                need = self.warm_end + self.per_window - steps
            if last + need * step > end_by:
                self._finish("timeout", f"one optimizer step of {self.name} takes "
                             f"~{step:.1f}s; warm-up and a window do not fit the "
                             f"{s.max_seconds:.0f}s measuring budget", give_up=True)
                return
        if now > end_by:
            before = f" (steps took ~{self.warm[-1]:.3g}s before)" if self.warm else ""
            self._finish("timeout", f"step {steps + 1} of {self.name} had not ended "
                         f"{now - last:.0f}s after step {steps}{before}; warm-up and a window "
                         f"do not fit the {s.max_seconds:.0f}s measuring budget", give_up=True)

    # -- the result -----------------------------------------------------------------------------

    def _overcounted(self) -> str | None:
        """The first step that counts more samples than the config's batch per rank (its
        micro-batch x accumulation): no step can train more, so its count is not real. A
        smaller count is a partial batch (an epoch's last). None when every step fits."""
        if not self.expected_samples:
            return None
        for r in self.ranks:
            for k, n in enumerate(r.samples):
                if n > self.expected_samples:
                    return (f"{self.name}: step {k + 1} of rank {r.index} counts {n} samples, "
                            f"more than the config's {self.expected_samples} per rank and step "
                            "(micro-batch x accumulation) can hold: autotune.step(samples) "
                            "counts this rank's samples of one optimizer step")
        return None

    def _overridden(self) -> str | None:
        """Why the measured steps are not of the trial's config: their samples per step and
        rank (the median over the windows, as the script counted them) differ from the
        config's micro-batch x accumulation. None when they agree or were not counted."""
        if not self.expected_samples or not self.windows or \
                any(r.default_samples for r in self.ranks):
            return None
        a, b = self.warm_end, self.warm_end + len(self.windows) * self.per_window
        got = statistics.median(n for r in self.ranks for n in r.samples[a:b])
        if got == self.expected_samples:
            return None
        shown = f"{got:g}"
        return (f"{self.name} trained {shown} samples per optimizer step on each rank, but the "
                f"config asks {self.expected_samples}: it does not train with the profile's "
                "batch (dataloader_kwargs(), hf_training_args()), so this is not that config's "
                f"speed; if {shown} is the script's own fixed batch, pass --param batch={shown} "
                "(autotune.step(samples) counts this rank's samples only)")

    def _finish(self, status: str, reason: str | None, give_up: bool = False) -> None:
        # A script that trains another batch throughout (its own fixed one) is told how to
        # tune it; a count no batch of the config holds, here and there, is a bad report.
        overridden = self._overridden() if status == "ok" else None
        overcounted = self._overcounted() if status == "ok" and overridden is None else None
        if overridden is not None or overcounted is not None:
            status, reason, give_up = "error", overridden or overcounted, True
        steps = [len(r.ends) for r in self.ranks]
        doc: dict[str, Any] = {
            "schema": RESULT_SCHEMA, "status": status, "reason": reason,
            "windows": self.windows, "device": self.device, "world_size": self.world,
            "peak_memory_bytes": max(r.peak for r in self.ranks),
            "memory_source": "reported by the script (CUDA allocator)"
            if any(r.peak for r in self.ranks) else "process tree",
            "timings": self._timings(), "script": {
                "name": self.name, "steps": steps,
                "accessed": sorted({a for r in self.ranks for a in r.accessed}),
                "default_samples": any(r.default_samples for r in self.ranks),
                "samples_mismatch": overridden is not None}}
        if self.warm:
            doc["warmup"] = {"steps": len(self.warm), "ended_by": self.warm_ended_by,
                             "step_times_s": self.warm,
                             "seconds": doc["timings"].get("warmup_s", 0.0)}
        if self.windows:
            doc["steps_per_window"] = self.per_window
            doc["step_time_s"] = sum(w["seconds"] for w in self.windows) / sum(
                w["steps"] for w in self.windows)
        if self.world > 1:
            doc["ranks"] = [self._rank_summary(i) for i in range(self.world)]
        if status == "timeout" and self.warm and self.warm[-1] >= MIN_STEP_S:
            per_step = sum(r.samples[-1] for r in self.ranks if r.samples)
            doc["first_step_samples_per_sec"] = per_step / self.warm[-1]
        self.result = doc
        _write_json(self.result_path, doc)
        self.done, self.give_up = True, give_up
        if status == "ok":
            self._request_stop(max(steps))

    def _timings(self) -> dict[str, float]:
        timings: dict[str, float] = {}
        if not any(r.ends for r in self.ranks) or min(len(r.ends) for r in self.ranks) == 0:
            return timings
        first = self._ends(1)
        timings["startup_s"] = max(0.0, first - self.started)
        if self.warm_end:
            timings["warmup_s"] = self._ends(self.warm_end) - first
        if self.windows:
            last = self.warm_end + len(self.windows) * self.per_window
            timings["measure_s"] = self._ends(last) - self._ends(self.warm_end)
        return timings

    def _rank_summary(self, i: int) -> dict[str, Any]:
        r, a = self.ranks[i], self.warm_end
        spans = [r.ends[a + (k + 1) * self.per_window - 1] - r.ends[a + k * self.per_window - 1]
                 for k in range(len(self.windows))]
        entry: dict[str, Any] = {"rank": i, "status": "ok", "window_seconds": spans,
                                 "peak_memory_bytes": r.peak, "steps": len(r.ends)}
        if spans and all(x > 0 for x in spans):
            rates = [sum(r.samples[a + k * self.per_window:a + (k + 1) * self.per_window]) / x
                     for k, x in enumerate(spans)]
            entry["samples_per_sec"] = median_and_cv(rates)[0]
        return entry

    def _request_stop(self, seen: int) -> None:
        """Every rank stops after the same step, far enough ahead that none has passed it
        when it reads the request (ranks look every 50 ms; this side polls every 100 ms). The
        script has until those steps ran (at the slowest pace measured, with half again on
        top) and ``stop_grace_s`` more to end by itself: a 30 s step is not a script that
        ignores the request."""
        paces = [w["seconds"] / w["steps"] for w in self.windows] or self.warm[-1:] or [1.0]
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
        with contextlib.suppress(OSError), open(self.progress_path, "a") as f:
            f.write(json.dumps({"event": event, "t": time.time(), **data}) + "\n")


def _write_json(path: str, doc: dict[str, Any]) -> None:
    """Write atomically (nobody reads half a document); the copy on disk is for the record,
    the driver's own is what counts, so a folder the script removed loses nothing."""
    tmp = Path(path + ".tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(doc))
        tmp.replace(path)
