"""What `autotune run` shows in a terminal: the start-up facts, progress, one line per trial, and
the closing table. Outside a terminal the same facts come as plain lines (no bar, no colour)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from autotune.config.knobs import Config
from autotune.events import JsonReporter
from autotune.trial.measurement import Measurement, Status
from autotune.trial.progress import ProgressEvent
from autotune.tuner.confirmation import NO_WIN, Candidate
from autotune.tuner.record import TrialRecord
from autotune.tuner.reporting import QuietReporter, RunSummary, StartInfo, story
from autotune.tuner.snapshot import CONFIRMED
from autotune.units import format_bytes

__all__ = ["ConsoleReporter", "JsonReporter", "QuietReporter"]


def _rate(value: float | None, cv: float | None = None) -> str:
    if value is None:
        return "-"
    return f"{value:,.2f} samples/s" + (f" ±{cv * 100:.1f}%" if cv is not None else "")


def _minutes(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s"


class ConsoleReporter:
    """Rich progress in a terminal, plain lines elsewhere. Every text is printed as written, never
    read as rich markup: trial errors quote paths in brackets (gloo's ``[/.../pair.cc:537]``)."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(highlight=False, markup=False)
        if not self.console.is_terminal:
            # Logs and CI: one line per fact, never wrapped at 80 columns.
            self.console.soft_wrap = True
            self.console.width = max(self.console.width, 140)
        self.live = self.console.is_terminal
        self.progress: Progress | None = None
        self.task: TaskID | None = None
        self.total: int | None = None
        self.start = self._trial_start = time.monotonic()
        self.timeout_s: float | None = None
        self.best: TrialRecord | None = None
        self.current = ""
        self.trials_target: int | None = None
        self.done = 0
        self.durations: list[float] = []
        self._confirm_started = False

    # -- Reporter protocol ----------------------------------------------------------------------

    def started(self, info: StartInfo) -> None:
        p = self._plain
        self.start = time.monotonic()
        self.timeout_s, self.trials_target = info.timeout_s, info.trials
        self.done = info.done_before
        p(f"autotune: study {info.study_name} in {info.storage}")
        p(f"  hardware     {info.hardware.describe()}")
        for note in info.hardware.notes:
            p(f"  note         {note}")
        ranks = info.space.world_size
        if ranks > 1:
            backend = "nccl" if info.hardware.device == "cuda" else "gloo"
            p(f"  ranks        {ranks} per trial (torchrun, {backend})")
        if info.space.global_batch is not None:
            p(f"  global batch {info.space.global_batch} samples per optimizer step, kept "
              "fixed (--global-batch)")
        scope = "per rank" if info.hardware.device == "cuda" or ranks == 1 else \
            f"for the {ranks} ranks together (they share the RAM)"
        p(f"  memory limit {format_bytes(info.memory_limit_bytes)} {scope}")
        p(f"  budget       {info.budget}")
        p(f"  outputs      {info.out_dir}")
        p(f"  search space {info.space.name} ({info.space.source}):")
        for line in info.space.describe():
            p("  " + line)
        if info.done_before:
            p(f"  resuming     {info.done_before} trial(s) already measured")
        if self.live:
            self.progress = Progress(TextColumn("{task.description}", markup=False), BarColumn(),
                                     TextColumn("{task.completed}/{task.total} trials"),
                                     TimeElapsedColumn(),
                                     TextColumn("{task.fields[status]}", markup=False),
                                     console=self.console, transient=True)
            self.progress.start()
            self.task = self.progress.add_task("tuning", total=None, status="",
                                               completed=info.done_before)

    def trial_started(self, number: int, index: int, total: int | None, config: Config,
                      is_baseline: bool, timeout_s: float) -> None:
        label = " (baseline)" if is_baseline else ""
        count = f"{index}/{total}" if total else str(index)
        self.current = f"trial {count}{label}: {config.describe()}"
        self._trial_start = time.monotonic()
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, description=self.current, total=total,
                                 status=f"{self._best_text()} | {self._eta_text()}")
        else:
            self._plain(f"{self.current} ... ({self._eta_text()})")

    def trial_event(self, event: ProgressEvent) -> None:
        if self.progress is None or self.task is None:
            return
        kind = event.get("event")
        if kind == "built":
            status = f"built in {event['build_s']:.1f}s, warming up"
        elif kind == "warmup_step":
            status = f"warm-up step {event['seconds']:.2f}s"
        elif kind == "window":
            status = f"window {event['index'] + 1}: {event['samples_per_sec']:,.2f} samples/s"
        else:
            return
        self.progress.update(self.task,
                             status=f"{status} | {self._best_text()} | {self._eta_text()}")

    def trial_finished(self, view: TrialRecord, best: TrialRecord | None) -> None:
        self.best = best
        ran = view.reused_from is None and not view.predicted
        if ran:
            self.done += 1
            self.durations.append(time.monotonic() - self._trial_start)
        tag = ""
        if view.is_baseline:
            tag = " baseline"
        elif view.stage:
            tag = f" ({view.stage})"
        if best is not None and best.number == view.number:
            tag += " new best"
        if view.status == Status.OK:
            what = (f"{_rate(view.samples_per_sec, view.spread_cv)}, "
                    f"{_step_text(view)}peak {format_bytes(view.peak_memory_bytes)}"
                    f"{_predicted_peak(view)}"
                    + (f", MFU {100 * view.mfu:.0f}%" if view.mfu is not None else "")
                    + (f", compiling {view.compile_s:.1f}s (not timed)"
                       if view.compile_s is not None else ""))
            if view.reused_from is not None:
                what += f" (same config as trial #{view.reused_from}: not re-run)"
        elif view.predicted:
            what = f"not run, {view.reason}"
        else:
            what = f"{view.status}: {view.reason}"
            step = view.forecast.step
            if step:
                what += f" (predicted step {step.step_s:.3g}s)"
        line = f"  #{view.number:<3} {view.config.describe():<44} {what}{tag}"
        if self.progress is not None and self.task is not None and ran:
            self.progress.advance(self.task)
        self._print(line)

    def confirming(self, round_index: int, rounds: int, candidate: Candidate,
                   measurement: Measurement) -> None:
        if not self._confirm_started:
            self._confirm_started = True
            self._print("confirming the top configs and the baseline: interleaved rounds, "
                        "windows twice as long")
        tag = " (baseline)" if candidate.is_baseline else ""
        what = _rate(measurement.samples_per_sec, measurement.spread_cv) if measurement.ok \
            else f"{measurement.status}: {measurement.reason}"
        self._print(f"  round {round_index + 1}/{rounds} #{candidate.number:<3} "
                    f"{candidate.config.describe():<44} {what}{tag}")

    def note(self, line: str) -> None:
        self._print(f"  {line}")

    def _print(self, line: str) -> None:
        """A line above the progress bar when there is one."""
        if self.progress is not None:
            self.progress.console.print(line, markup=False, highlight=False)
        else:
            self._plain(line)

    def _plain(self, *objects: Any) -> None:
        self.console.print(*objects, markup=False, highlight=False)

    def finished(self, summary: RunSummary) -> None:
        if self.progress is not None:
            self.progress.stop()
        p = self._plain
        p(_stopped_line(summary))
        if summary.best is None:
            p("no configuration has been measured successfully yet; no profile written")
            if summary.dashboard:  # empty: the caller gave no dashboard writer
                p(f"dashboard: {summary.dashboard}")
            return
        p(_result_table(summary))
        led = _story(summary)
        if led:
            p("the search, led by the diagnosis (search trials' own figures vs the baseline):")
            for line in led:
                p(f"  {line}")
        if summary.diagnosis:
            p("what limits the winner:")
            for finding in summary.diagnosis:
                p(f"  {finding.text}")
        for line in _confirmation_lines(summary):
            p(line)
        if summary.speedup is not None:
            sp = summary.speedup
            within = f"{sp.interval.words()}; " if sp.interval is not None else ""
            how = f" ({within}measured side by side{sp.per_round()})" \
                if sp.kind == CONFIRMED else " (the search trials' own figures, not confirmed)"
            p(f"speedup over the baseline: {sp.value:.2f}x{how}")
            if sp.interval is not None and sp.interval.wide:
                p(f"  a wide interval: its {sp.interval.rounds} round(s) leave the speedup "
                  "uncertain; a re-check (`autotune profile check`) or a longer --timeout "
                  "narrows it")
        elif summary.baseline is not None and summary.best.number != summary.baseline.number:
            p("speedup over the baseline: not claimed (a single timed window; see the profile's "
              "notes)")
        if summary.baseline is not None:
            before = summary.baseline.config.samples_per_step
            after = summary.best.config.samples_per_step
            if before != after:
                p(f"effective batch: {before} -> {after} samples per optimizer step (micro x "
                  "accumulation x ranks); scale the learning rate and schedule to match, or pass "
                  "--global-batch to keep it")
            else:
                p(f"effective batch: unchanged at {after} samples per optimizer step")
        p(f"profile: {summary.profile_path}")
        if summary.dashboard:
            p(f"dashboard: {summary.dashboard}")

    def _eta_text(self) -> str:
        """Elapsed, and the time left: the time budget, or the mean trial time x trials left."""
        elapsed = time.monotonic() - self.start
        left: list[float] = []
        if self.timeout_s is not None:
            left.append(max(0.0, self.timeout_s - elapsed))
        if self.trials_target is not None and self.durations:
            mean = sum(self.durations) / len(self.durations)
            left.append(mean * max(0, self.trials_target - self.done))
        text = f"elapsed {_minutes(elapsed)}"
        return text + (f", ETA ~{_minutes(min(left))}" if left else "")

    def _best_text(self) -> str:
        if self.best is None:
            return "best: -"
        return f"best {_rate(self.best.samples_per_sec)} (#{self.best.number})"


def _step_text(view: TrialRecord) -> str:
    """The measured step time, with what the step-time model predicted before the trial."""
    if view.step_s is None:
        return ""
    predicted = view.forecast.step
    if not predicted:
        return f"step {view.step_s:.3g}s, "
    return (f"step {view.step_s:.3g}s (predicted {predicted.step_s:.3g}s "
            f"+-{100 * predicted.error:.0f}%), ")


def _predicted_peak(view: TrialRecord) -> str:
    peak = view.forecast.peak_memory_bytes
    return f" (predicted {format_bytes(peak)})" if peak else ""


def _stopped_line(summary: RunSummary) -> str:
    """Why the run stopped, what the study holds, how long this run took."""
    ran = [t for t in summary.trials if t.reused_from is None]
    ruled_out = [t for t in ran if t.predicted]
    ran = [t for t in ran if not t.predicted]
    counts = Counter(t.status for t in ran)
    repeats = len(summary.trials) - len(ran) - len(ruled_out)
    outcomes = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    return (f"\nstopped: {summary.stop_reason}; {len(ran)} measured trial(s) in the study"
            + (f" ({outcomes})" if outcomes else "")
            + (f", {len(ruled_out)} ruled out without running ({_ruled_out_words(ruled_out)})"
               if ruled_out else "")
            + (f" and {repeats} repeated config(s) not re-run" if repeats else "")
            + f"; this run took {summary.wall_s / 60:.1f} min")


def _ruled_out_words(views: list[TrialRecord]) -> str:
    kinds = Counter(v.predicted_kind for v in views)
    words = {"oom": "predicted to pass the memory limit", "too_slow": "predicted too slow",
             "oversubscribed": "more threads and loader workers than cores"}
    return ", ".join(f"{n} {words.get(k or 'oom', k)}" for k, n in sorted(
        kinds.items(), key=lambda kv: str(kv[0])))


def _result_table(summary: RunSummary) -> Table:
    """Baseline and best side by side: rate, spread, memory, where the step time goes, MFU."""
    assert summary.best is not None
    table = Table(show_header=True, header_style="bold")
    multi = summary.best.config.world_size > 1
    cols = ["", "config", "samples/s", "spread", "peak memory", "data wait"]
    cols += ["comm wait"] if multi else []
    for col in (*cols, "compute", "MFU"):
        table.add_column(col)
    for name, view in (("baseline", summary.baseline), ("best", summary.best)):
        if view is None:
            table.add_row(name, "not measured", *["-"] * (len(cols) - 1))
            continue
        b = view.breakdown
        shares = ["data_wait", "comm_wait", "compute"] if multi else ["data_wait", "compute"]
        table.add_row(name, Text(view.config.describe()), f"{view.samples_per_sec:,.2f}",
                      "1 window" if view.spread_cv is None else f"{view.spread_cv * 100:.1f}%",
                      format_bytes(view.peak_memory_bytes),
                      *(f"{b[k] * 100:.0f}%" if k in b else "unknown" for k in shares),
                      "-" if view.mfu is None else f"{100 * view.mfu:.1f}%")
    return table


def _confirmation_lines(summary: RunSummary) -> list[str]:
    """The confirmation's decision and each candidate's rounds, or why there was none."""
    conf = summary.confirmation
    if conf is None:
        return [f"not confirmed: {summary.confirm_skipped}"] if summary.confirm_skipped else []
    d = conf.decision
    rounds = f"{conf.rounds} interleaved rounds"
    if conf.stopped_early:
        rounds += f" of {conf.planned_rounds} planned (stopped: {conf.stopped_early})"
    if d.decided_by == NO_WIN:
        lines = [f"confirmation: {rounds}; no config beat the baseline by more than the "
                 f"measured noise (margin {100 * d.margin:.1f}%): the profile keeps the "
                 "baseline's settings"]
    else:
        lines = [f"confirmation: {rounds}, windows twice as long; winner #{d.winner_trial} "
                 f"by {d.decided_by} (margin {100 * d.margin:.1f}%: twice the pooled "
                 "spread of the top two)"]
    for c in conf.candidates:
        rates = ", ".join(f"{r:,.2f}" for r in c.rates) or "-"
        note = " baseline" if c.baseline else ""
        if str(c.trial) in d.excluded:
            note += f" (cannot win: {d.excluded[str(c.trial)]})"
        lines.append(f"  #{c.trial:<3} median {c.median or 0:,.2f} samples/s from "
                     f"[{rates}], spread {100 * c.spread_cv:.1f}%, peak "
                     f"{format_bytes(c.peak_memory_bytes)}{note}")
    if conf.left_out:
        lines.append(f"  {conf.left_out}")
    if conf.machine_changed:
        added = " (a round was added)" if conf.raw.get("round_added") else ""
        lines.append(f"  the machine changed during the confirmation{added}, as the sentinel "
                     "read it before each trial:")
        lines += [f"    {line}" for line in conf.machine_changed]
    return lines


def _story(summary: RunSummary) -> list[str]:
    """Each diagnosis-led trial: what limited the incumbent, the change, and its speedup."""
    return story(summary.trials, summary.baseline.samples_per_sec if summary.baseline else None)
