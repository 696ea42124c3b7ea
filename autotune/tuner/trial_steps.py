"""One trial of a run, step by step: the verdict on the proposed config (``tuner.verdict``),
then either the record of why nothing ran, a twin's outcome reused, or the trial's process
measured; the record written once, the profile exported and the trial reported once. The
``Runner`` (runner.py) holds the state these steps use and the loop around them.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import optuna
from optuna.trial import TrialState

from autotune.config.knobs import Config, oversubscribed, unapplied
from autotune.config.space import NarrowedSpace
from autotune.machine.hardware import Hardware
from autotune.profile import Profile
from autotune.trial.command import Command
from autotune.trial.measurement import (
    BUDGET,
    INTERRUPTED,
    NODE_LOST,
    TRIAL_TIMEOUT,
    Measurement,
    Status,
)
from autotune.trial.result import ReadbackDoc
from autotune.trial.spec import MeasureSettings
from autotune.tuner import budget, claims, record, snapshot, storage, verdict
from autotune.tuner.export import write_profile
from autotune.tuner.measurer import Measurer, MeasureTrial
from autotune.tuner.options import RunOptions
from autotune.tuner.reporting import Reporter
from autotune.tuner.search import MemoryModel
from autotune.tuner.sharding import ShardingModel
from autotune.tuner.snapshot import StudySnapshot

# A script's trial runs two steps outside its measuring budget: the first (its start is not
# reported) and the one it stops after (trial.driver).
SCRIPT_UNMEASURED_STEPS = 2
RUNNING_TWIN_POLL_S = 1.0


@dataclass
class TrialSteps:
    """The steps of one trial, with what they need passed in: the run's options, the machine,
    the study and its storage, the space and the baseline, the user's script (if any), where
    trials write, who is told, this thread's measurer (``measurer_now``: slots of an executor
    measure side by side, each with its own) and what measures a config (``measure``: a trial
    process through the measurer, unless a test or the search benchmark injects a replay).

    What the steps learn is theirs, and the Runner's loop reads it: the space with the knobs a
    script never applies fixed, and why no later trial can run (``no_room``, ``halted``)."""

    opts: RunOptions
    hw: Hardware
    study: optuna.Study
    storage: optuna.storages.BaseStorage
    storage_url: str
    limit: int
    space: NarrowedSpace
    baseline: Config
    command: Command | None
    out_dir: Path
    reporter: Reporter
    measurer_now: Callable[[], Measurer]
    measure: MeasureTrial | None = None
    no_room: str | None = None  # the next config does not fit what is left of --timeout
    halted: str | None = None  # why no later trial can measure anything (a script's)
    trainer_said: bool = False  # the note on the bootstrap's reach into a Trainer, once
    # The strategy sampled configs keep (the runner's: the baseline's, replicated until memory
    # binds): sharding is chosen by the memory model, never sampled.
    sharding_now: str = "replicated"

    @property
    def measurer(self) -> Measurer:
        return self.measurer_now()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The study lock: one worker at a time reads-then-writes the study."""
        with storage.locked(self.storage_url, self.study.study_name):
            yield

    def recover_dead_trials(self) -> None:
        claims.recover_dead(self.study, self.storage)

    def read(self) -> StudySnapshot:
        """The study as stored now, its trials judged against this run's memory limit."""
        return snapshot.read(self.study, self.limit)

    def run_trial(self, trial: optuna.Trial, remaining: float | None) -> bool:
        """Measure (or reuse, or rule out), record and export an asked trial. Returns whether
        nothing ran (a twin's measurement reused, or ruled out without running)."""
        told = False
        self.measurer.held = {}
        try:
            is_baseline = record.is_baseline(trial)
            config = self._space_for(trial).suggest(trial, self.baseline)
            record.mark_config(trial, config)
            v, snap = self._verdict(trial.number, config, is_baseline, remaining,
                                    fresh=is_baseline or record.reread_of(trial) is not None)
            if v.record is not None:  # nothing runs
                self._write(trial, v.record)
                told = True
                if v.kind == verdict.Kind.NO_ROOM:
                    self.no_room = f"not run: no room left: {v.plan.no_room}" if v.plan \
                        else v.kind
                if v.reported:
                    self._report(trial)
                return True
            if v.twin is not None:  # reported once, when recorded: nothing runs
                m = replace(v.twin.measurement, stderr_tail="")
                record.mark_reused(trial, v.twin.number)
            else:
                assert v.plan is not None
                self._forecast(trial, config, v.plan, snap)
                m = self._measure_trial(trial, config, is_baseline, len(snap.measured) + 1,
                                        remaining, v.plan.settings, snap)
            if m.ended_by == NODE_LOST:  # the engine's fault, not the config's: run again
                storage.retry_running(self.study, trial, m.reason or NODE_LOST)
                told = True
                self.reporter.note(f"trial {trial.number}: {m.reason}; queued again")
                return False
            self._write(trial, record.of_measurement(
                m, self.limit, number=trial.number, baseline=is_baseline,
                devices=self.measurer.held))
            told = True
            self._learn_applied(m, is_baseline)
            if m.ended_by == INTERRUPTED:
                raise KeyboardInterrupt
            if m.is_result:
                self._report(trial)
            else:
                self.export(self.read())
            return v.twin is not None
        finally:
            if not told:
                with contextlib.suppress(Exception):
                    record.mark_interrupted(trial)
                    self.study.tell(trial, state=TrialState.FAIL)

    def _space_for(self, trial: optuna.Trial) -> NarrowedSpace:
        """The space a trial's config comes from: a queued one's (baseline, staged, diagnosis)
        as it was queued; a sampled one's with the sharding of the baseline now in force."""
        if record.was_queued(trial) or "sharding" not in self.space.searched:
            return self.space
        return self.space.fix({"sharding": "chosen by the memory model, not sampled"},
                              replace(self.baseline, sharding=self.sharding_now))

    def _verdict(self, number: int, config: Config, is_baseline: bool,
                 remaining: float | None,
                 fresh: bool = False) -> tuple[verdict.Verdict, StudySnapshot]:
        """What happens to ``config`` (``tuner.verdict``), from the study as it stands; while
        another worker measures exactly this config, wait for it: its result is then reused,
        so a fleet never measures one config twice at the same time. A ``fresh`` trial (the
        baseline, a re-read) is measured whatever its twins."""
        told = False
        while True:
            snap = self.read()
            running = () if fresh else tuple(
                claims.running_twins(self.study, number, config, self.opts.measure))
            twin = None if fresh or running else \
                claims.measured_twin(snap, config, self.opts.measure)
            model = self.memory_model(snap)
            v = verdict.decide(verdict.Facts(
                config, number, is_baseline, self.limit, twin=twin, running_twins=running,
                rule=oversubscribed(config, self.hw.cpu_cores), memory=model.verdict(config),
                strategy_out=is_baseline and "sharding" in self.space.searched
                and model.fit(config) is None and model.strategy_verdict(config) is not None,
                plan=None if twin else self.trial_budget(config, remaining, snap)))
            if v.kind != verdict.Kind.TWIN_RUNNING:
                return v, snap
            if not told:
                # Its worker may be dead: found like any other dead worker's trial.
                with self.locked():
                    self.recover_dead_trials()
                self.reporter.note(f"trial {number}: another worker is measuring this config "
                                   f"(trial {running[0]}); waiting to reuse its result")
                told = True
            time.sleep(RUNNING_TWIN_POLL_S)

    def _report(self, trial: optuna.Trial) -> None:
        """Export the profile as the study stands now, and show the trial beside the best."""
        snap = self.read()
        self.export(snap)
        done = snap.trial(trial.number)
        if done is not None:
            self.reporter.trial_finished(done, snap.best)

    def _learn_applied(self, m: Measurement, is_baseline: bool) -> None:
        """After a script's first measured trial: fix the knobs it never applies (it called
        none of their Profile methods, and its Trainer, read back by the bootstrap, does not
        run them), say why, and keep that on the study. A baseline that failed as every trial
        would, or trained another batch than its config's, halts the run."""
        if self.command is None:
            return
        read_back = m.script.get("readback")
        if read_back is not None:
            self._say_trainer(read_back, is_baseline)
        if is_baseline and (why := _shared_failure(m, self.command.name)):
            self.halted = why
        known = record.read_facts(self.study).unapplied
        if known is not None and (later := self._not_in_effect(m)):
            # Found after the baseline (a value the Trainer refuses): fixed from now on.
            record.write_unapplied(self.study, {**known, **later})
            self.space = self.space.fix(later, self.baseline)
            for why in later.values():
                self.reporter.note(f"fixed: {why}")
        if not m.ok or known is not None:
            return
        accessed = set(m.script.get("accessed") or ())
        reasons = unapplied(list(self.space.searched), accessed, self.command.name,
                            dict(read_back) if read_back is not None else None)
        record.write_unapplied(self.study, reasons)
        self.space = self.space.fix(reasons, self.baseline)
        if reasons and not accessed and read_back is None:  # one line: no profile loaded
            self.reporter.note(f"fixed: {self.command.name} never loads a profile "
                               f"(autotune.load_profile()): {', '.join(reasons)} are not searched")
        for why in reasons.values() if accessed or read_back is not None else ():
            self.reporter.note(f"fixed: {why}")
        if m.script.get("default_samples") and "micro_batch_size" in reasons:
            self.reporter.note(
                f"{self.command.name} reports steps without a sample count and never reads the "
                f"batch size from the profile: samples/s counts {self.baseline.micro_batch_size}"
                " per rank and step; pass --param batch=N (its batch) or autotune.step(samples)")

    def _say_trainer(self, read_back: ReadbackDoc, is_baseline: bool) -> None:
        """Once per run: that the bootstrap reached the script's Trainer and what a trial
        turns off in it; at the baseline, the batch the script asks for itself when the
        baseline measures another."""
        if not self.trainer_said:
            self.trainer_said = True
            off = ", ".join(read_back["isolated"])
            # Lightning's validation inside fit() runs as the script sets it (its callbacks
            # may watch a validation metric); the Hugging Face Trainer's evaluation is off.
            turned_off = "no checkpoints or logs" if read_back["via"].startswith("Lightning") \
                else "no checkpoints; nothing pushed, tracked or evaluated"
            kept = (f"; in trials its outputs go to the trial's folder, with {off} overridden "
                    f"({turned_off})") if off else ""
            self.reporter.note(f"{self.command.name if self.command else 'the script'}: "
                               f"autotune sets each trial's config on its {read_back['via']}"
                               f"{kept}")
        if not is_baseline:
            return
        base = self.baseline.to_dict()
        differs = {k: v for k, v in read_back["script"].items()
                   if k in ("micro_batch_size", "grad_accum_steps", "amp") and v is not None
                   and v != base.get(k)}
        if differs:
            asked = ", ".join(f"{k} {v}" for k, v in differs.items())
            measured = ", ".join(f"{k} {base.get(k)}" for k in differs)
            batch = differs.get("micro_batch_size")
            self.reporter.note(
                f"the script asks for {asked} itself; the baseline measures {measured} (the "
                "framework's defaults): the speedup is over those" + (
                    f"; pass --param batch={batch} to measure it against your batch"
                    if batch is not None else ""))

    def trial_budget(self, config: Config, remaining: float | None,
                      snap: StudySnapshot) -> budget.TrialBudget:
        """The measuring budget ``config``'s predicted steps need, or why it does not run
        (``remaining``: seconds left for the search; None: judge the config alone)."""
        if remaining is not None and config.compile != "off":
            # Compiling comes before the measuring, outside the trial timeout (its own limit).
            remaining -= budget.compile_seconds(snap.compile_costs(),
                                                self.opts.measure.max_compile_s)
        return budget.plan_trial(
            config, budget.StepTimeModel(snap.observations), self.opts.measure,
            trial_timeout_s=self.opts.trial_timeout_s,
            startup_s=budget.startup_seconds(snap.startup_costs(), self.opts.trial_timeout_s),
            left_s=remaining, unmeasured_steps=SCRIPT_UNMEASURED_STEPS if self.command else 0)

    def _forecast(self, trial: optuna.Trial, config: Config, plan: budget.TrialBudget,
                  snap: StudySnapshot) -> None:
        """What the models predicted before the trial ran, kept beside what it measured."""
        peak = self.memory_model(snap).predict(config)
        record.mark_forecast(trial, record.Forecast(
            plan.prediction, None if peak is None else int(peak), plan.settings.max_seconds))

    def _measure_trial(self, trial: optuna.Trial, config: Config, is_baseline: bool, index: int,
                       remaining: float | None, settings: MeasureSettings,
                       snap: StudySnapshot) -> Measurement:
        """Run the trial's process with ``settings`` (the search's, or a longer measuring
        budget its steps need); a trial the run's --timeout cut short is no result."""
        hard = budget.hard_timeout(config, self.opts.trial_timeout_s,
                                   self.opts.measure.max_compile_s)
        cut = remaining is not None and remaining < hard
        timeout = max(1.0, min(hard, remaining or math.inf))
        self.reporter.trial_started(trial.number, index, self.opts.trials, config, is_baseline,
                                    timeout)
        # The search's settings identify how it was measured (twins match on them); a longer
        # budget is kept beside them.
        record.mark_measuring(trial, self.opts.measure, settings)
        best = snap.best if self.opts.prune and not is_baseline else None
        m = self.measure_config(config, self._workdir(trial), timeout, settings,
                                best.samples_per_sec if best else None)
        if cut and m.ended_by == TRIAL_TIMEOUT and not record.budget_cut_before(trial):
            # The run's budget ended this trial, not the config's speed: not a result, measured
            # again once by the next run (twice cut: it is a real timeout).
            m = replace(m, status=Status.ERROR, reason="stopped by the run's --timeout",
                        ended_by=BUDGET)
        if not is_baseline and m.is_result and (off := self._not_in_effect(m)):
            m = replace(m, status=Status.ERROR,
                        reason=f"not this config's speed: {'; '.join(off.values())}")
        return m

    def _not_in_effect(self, m: Measurement) -> dict[str, str]:
        """The searched knobs a script's Trainer, read back, did not run as the config asked
        (by the rule of ``unapplied``: the script does not apply them itself either), each
        with why: that trial did not measure its config."""
        read_back = m.script.get("readback")
        if read_back is None or self.command is None:
            return {}
        reasons = unapplied(list(self.space.searched), set(m.script.get("accessed") or ()),
                            self.command.name, dict(read_back))
        return {k: why for k, why in reasons.items() if k in read_back["fixed"]}

    def measure_config(self, config: Config, workdir: Path, timeout: float,
                       settings: MeasureSettings, prune_below: float | None = None,
                       report: bool = True) -> Measurement:
        """One trial process for ``config``, or what the run was given to measure with."""
        measure = self.measure or self.measurer.run
        return measure(config, workdir, timeout, settings, prune_below,
                       self.reporter.trial_event if report else None)

    def _workdir(self, trial: optuna.Trial) -> Path:
        return self.out_dir / "trials" / f"{trial.number:04d}"

    def _write(self, trial: optuna.Trial, rec: record.Record) -> None:
        record.tell(self.study, trial, rec)

    def memory_model(self, snap: StudySnapshot) -> MemoryModel:
        size = snap.facts.model_size
        strategies = None if size is None or self.opts.world < 2 else ShardingModel(
            size, snap.observations, self.hw.device, self.opts.nproc or 1)
        return MemoryModel(snap.observations, self.hw.device, self.limit, self.opts.headroom,
                           strategies)

    def export(self, snap: StudySnapshot) -> Profile | None:
        return write_profile(self.study, snap, storage.redact(self.storage_url),
                              self.opts.global_batch, self.out_dir / "profile.yaml")



def _shared_failure(m: Measurement, script: str) -> str | None:
    """Why a script's failed baseline stops the run: it reported no step, or exited with an
    error before measuring (every trial runs the same script, and would fail the same way), or
    trained another batch than its config's; None for a failure of the config itself (out of
    memory, too slow, diverged)."""
    if m.script.get("samples_mismatch"):
        return ("the baseline trained another batch than its config (see its reason): no "
                "trial would measure the config it records")
    if m.ok or m.status != Status.ERROR:
        return None
    return (f"the baseline trial of {script} failed ({_first_line(m.reason)}), and every trial "
            "runs the same script: make it train as it is on its own, then run again (its "
            "output is in the trial's folder)")


def _first_line(text: str | None) -> str:
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    return lines[0][:300] if lines else "no reason given"
