"""One ``autotune run``: the loop that asks for a config, claims it, measures it (or reuses a
twin, or rules it out on the memory or step-time model's word), records it, and stops; then the
confirmation and the profile.

Trials are asked and told one at a time (ask/tell), so each gets a per-trial timeout cut to the
remaining budget, Ctrl-C is recorded on the running trial, and a killed tuner's trial is found and
retried on the next run (by its dead process id on this host at once, by heartbeat elsewhere).
The parts live next door: options (checked at once), storage (Optuna and its internals), study
(identity and the resume guard), measure (one config), record (what is written on a trial),
search (the staged start, memory model, pruning, early stop), budget (the step-time model and
each trial's measuring budget), confirm (the winner and export).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState

from autotune.config.knobs import Config, oversubscribed, unapplied
from autotune.config.space import baseline_for_global_batch, load_space, narrow
from autotune.errors import DiskFull, disk_full, one_line
from autotune.machine.hardware import detect, hostname, process_identity
from autotune.paths import study_folder
from autotune.profile import Profile
from autotune.trial.command import parse_command
from autotune.trial.measurement import BUDGET, INTERRUPTED, TRIAL_TIMEOUT, Measurement
from autotune.trial.spec import MeasureSettings
from autotune.tuner import (
    budget,
    claims,
    confirm,
    fleet,
    options,
    record,
    snapshot,
    stages,
    storage,
    verdict,
)
from autotune.tuner.diagnosis import Finding
from autotune.tuner.measure import Measurer
from autotune.tuner.options import RunOptions
from autotune.tuner.reporting import Interrupted, Reporter, RunSummary, StartInfo
from autotune.tuner.results import diagnose_record
from autotune.tuner.search import (
    MemoryModel,
    Proposal,
    noise_of,
    since_improvement,
    staged_next,
)
from autotune.tuner.snapshot import StudySnapshot
from autotune.tuner.study import Identity, default_name, open_study
from autotune.units import format_duration
from autotune.workloads import WorkloadSpec, declared_knobs, resolve, script_workload

# A script's trial runs two steps outside its measuring budget: the first (its start is not
# reported) and the one it stops after (trial.driver).
SCRIPT_UNMEASURED_STEPS = 2

__all__ = ["Interrupted", "Reporter", "RunOptions", "RunSummary", "Runner", "StartInfo", "run"]

RUNNING_TWIN_POLL_S = 1.0
MAX_TWINS_IN_A_ROW = 20
# Draws a study's dashboard into a file (report.write_dashboard; the CLI passes it in).
Dashboard = Callable[[optuna.Study, Path], Path]


class Runner:
    """One ``autotune run``: set-up, the trial loop, confirmation and export."""

    def __init__(self, opts: RunOptions, reporter: Reporter,
                 dashboard: Dashboard | None = None) -> None:
        hw = opts.hardware or detect()
        options.check(opts, hw)
        self.opts = opts = opts.with_defaults(hw)
        self.reporter, self.hw, self.draw = reporter, hw, dashboard
        # A script tuned as it runs (autotune run -- CMD), or a workload autotune's loop trains.
        self.command = parse_command(opts.command) if opts.command else None
        workload: Any
        if self.command is not None:
            workload = script_workload(Path(self.command.name).stem, opts.params)
            self.workload_spec = WorkloadSpec(
                "command", self.command.to_params(workload.default_micro_batch))
        else:
            self.workload_spec = WorkloadSpec(opts.model, dict(opts.params))
            workload = resolve(opts.model, opts.params)
        self.workload_name = str(getattr(workload, "name", self.workload_spec.name))
        self.world = opts.world
        self.baseline = Config(micro_batch_size=workload.default_micro_batch,
                               world_size=self.world) if opts.global_batch is None else \
            baseline_for_global_batch(workload.default_micro_batch, opts.global_batch,
                                      self.world)
        self.space = narrow(load_space(opts.space), hw, self.world, self.baseline,
                            opts.global_batch, supports=declared_knobs(workload),
                            workload=f"workload {self.workload_name}")
        self.storage_url = opts.storage_url
        self.study_name = opts.study_name or default_name(self.workload_name,
                                                          self.workload_spec, self.space, hw)
        self.out_dir = opts.out_dir or study_folder(opts.studies_dir, self.study_name)
        options.check_out_dir(self.out_dir)
        self.confirm_skipped: str | None = None  # why this run did not confirm, when it did not
        self.no_room: str | None = None  # the next config does not fit what is left of --timeout
        self.halted: str | None = None  # why no later trial can measure anything (a script's)
        self.storage = storage.open_storage(self.storage_url)
        ident = Identity(self.study_name, self.workload_name, self.workload_spec, self.space,
                         hw, self.baseline, self.world, opts.global_batch)
        with self._locked():
            self.study, self.limit = open_study(
                self.storage, self.storage_url, ident, seed=opts.seed,
                limit=options.memory_limit(opts.memory_limit, hw), limit_spec=opts.memory_limit,
                note=lambda line: self.reporter.note(line))
        # Who holds a device, as a worker waiting for it is told (tuner.fleet.DeviceLock).
        self.measurer = Measurer(
            hw, self.workload_spec, opts.nproc or 1, opts.nodes, self.limit, self.study,
            owner=f"autotune pid {process_identity()['pid']} on {hostname()}, "
                  f"study {self.study_name}",
            on_wait=lambda line: self.reporter.note(line),
            address_space_bytes=opts.address_space_bytes, command=self.command)
        # Knobs the script was found never to apply (a resumed study's, from its first trial).
        self.space = self.space.fix(dict(record.read_facts(self.study).unapplied or {}), self.baseline)

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> RunSummary:
        start = time.monotonic()
        with self._locked():
            self._recover_dead_trials()
            self._enqueue_baseline()
        self.reporter.started(StartInfo(
            self.study_name, storage.redact(self.storage_url), self.hw, self.space, self.limit,
            self.budget_text(), len(self._read().measured), self.out_dir,
            self.opts.trials, self.opts.timeout_s))
        deadline = start + self.opts.timeout_s if self.opts.timeout_s else None
        self._probe_machine()
        interrupted, stop_reason = self._trials(deadline)
        if not interrupted:
            try:
                self._confirm(deadline)
            except KeyboardInterrupt:
                interrupted, stop_reason = True, "interrupted during confirmation"
        fleet.close_nodes(self.study, self.opts.nodes)
        summary = self._summary(time.monotonic() - start, interrupted, stop_reason)
        self.reporter.finished(summary)
        if interrupted:
            raise Interrupted(f"interrupted; study {self.study_name} is saved in "
                              f"{storage.redact(self.storage_url)}: run the same command to "
                              "resume")
        return summary

    def _trials(self, deadline: float | None) -> tuple[bool, str]:
        """Ask, claim, measure and record trials until a stop rule says stop; returns
        (interrupted, why it stopped). The study is read once per trial, under the lock."""
        twins_in_a_row = 0
        while True:
            remaining = deadline - time.monotonic() if deadline else None
            # Deciding whether to go on and claiming the next trial read the study and write it:
            # under the study lock, so a fleet's workers never both take the last trial.
            with self._locked():
                self._recover_dead_trials()
                snap = self._read()
                stop_reason = self._stop_reason(snap, remaining, twins_in_a_row)
                trial = None if stop_reason else self._claim(self._ask())
            if trial is None:
                return False, stop_reason
            reserve = self._confirmation_reserve(snap)
            try:
                with storage.beating(self.study, trial):
                    reused = self._run_trial(trial, None if remaining is None
                                             else remaining - reserve)
            except KeyboardInterrupt:
                return True, "interrupted"
            except UpdateFinishedTrialError:
                # Another worker ended this trial, taking this one for dead (a heartbeat missed
                # under load): its retry runs elsewhere; this worker goes on.
                self.reporter.note(f"trial {trial.number} was ended by another worker, which "
                                   "took this one for dead; going on")
                reused = False
            twins_in_a_row = twins_in_a_row + 1 if reused else 0

    def _stop_reason(self, snap: StudySnapshot, remaining: float | None,
                     twins_in_a_row: int) -> str:
        """Why this worker should stop now, or "" to run another trial (then queues the staged
        search's next config when it has one)."""
        # --trials counts measurements: a repeated config costs nothing and does not count.
        # Trials other workers are running now count too: they will most likely be measured.
        running = snap.pending.running_count
        if self.opts.trials is not None and len(snap.measured) + running >= self.opts.trials:
            return f"reached {self.opts.trials} trials" + (
                f" ({running} of them still running on other workers)" if running else "")
        if stop := self.no_room or self.halted:
            return stop
        if self._nothing_applied(snap):
            return (f"nothing to search: {self.command.name if self.command else 'the script'} "
                    "applies none of the searched knobs (see the lines 'fixed: ...')")
        reserve = self._confirmation_reserve(snap)
        if remaining is not None and remaining - reserve < snap.shortest_useful_trial():
            budget = format_duration(self.opts.timeout_s or 0)
            return f"time budget of {budget} spent" + (
                f" ({format_duration(reserve)} of it kept for confirmation)" if reserve else "")
        if twins_in_a_row >= MAX_TWINS_IN_A_ROW:
            return (f"the sampler proposed {twins_in_a_row} measured or ruled-out configs in a "
                    "row: the space looks exhausted")
        staging = self._stage(snap)
        noise = noise_of(snap.observations)
        if not staging and self.opts.patience is not None \
                and since_improvement(snap.observations, noise) >= self.opts.patience:
            return (f"no trial beat the best by more than the noise ({100 * noise:.1f}%) in the "
                    f"last {self.opts.patience} trials")
        return ""

    def _read(self) -> StudySnapshot:
        """The study as stored now, its trials judged against this run's memory limit."""
        return snapshot.read(self.study, self.limit)

    # -- claiming trials, and recovering dead workers' -------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The study lock: one worker at a time reads-then-writes the study."""
        with storage.locked(self.storage_url, self.study_name):
            yield

    def _ask(self) -> optuna.Trial:
        return storage.ask(self.study)

    def _claim(self, trial: optuna.Trial) -> optuna.Trial:
        return claims.claim(self.study, self.storage, trial)

    def _recover_dead_trials(self) -> None:
        claims.recover_dead(self.study, self.storage)

    def _enqueue_baseline(self) -> None:
        claims.enqueue_baseline(self.study, self.space.params_for(self.baseline))

    def _stage(self, snap: StudySnapshot) -> bool:
        """Queue the staged search's next config unless a trial is already waiting; returns
        whether the staged start is still going (queued or waiting)."""
        if snap.pending.waiting:
            return snap.pending.waiting_staged
        model = self._memory_model(snap)

        def too_slow(c: Config) -> bool:
            return self._trial_budget(c, None, snap).too_slow is not None

        running = snap.pending.running
        proposal = staged_next(self.space, self.baseline, snap.observations, model,
                               too_slow=too_slow) \
            or self._diagnosis_stage(snap, lambda c: model.verdict(c) is not None
                                     or too_slow(c)
                                     or oversubscribed(c, self.hw.cpu_cores) is not None)
        if proposal is None:
            return False
        if proposal.config in running:
            return True  # another worker measures it now; this one samples meanwhile
        self.study.enqueue_trial(self.space.params_for(proposal.config),
                                 user_attrs={"stage": proposal.stage})
        return True

    def _diagnosis_stage(self, snap: StudySnapshot,
                         ruled_out: Callable[[Config], bool]) -> Proposal | None:
        """After the staged start: the next change that addresses what limits the incumbent
        (``tuner.stages``), diagnosed again from the study as it stands."""
        best = snap.best
        if best is None:
            return None
        tried = {o.config for o in snap.observations} | set(snap.pending.running)
        return stages.diagnosis_next(self.space, best.config, diagnose_record(snap, best),
                                     tried, ruled_out)

    # -- one trial ------------------------------------------------------------------------------

    def _run_trial(self, trial: optuna.Trial, remaining: float | None) -> bool:
        """Measure (or reuse, or rule out), record and export an asked trial. Returns whether
        nothing ran (a twin's measurement reused, or ruled out without running)."""
        told = False
        self.measurer.held = {}
        try:
            config = self.space.suggest(trial, self.baseline)
            is_baseline = record.is_baseline(trial)
            trial.set_user_attr("config", config.to_dict())
            v, snap = self._verdict(trial.number, config, is_baseline, remaining)
            if v.record is not None:  # nothing runs
                self._write(trial, v.record)
                told = True
                if v.kind == verdict.NO_ROOM:
                    self.no_room = v.plan.no_room if v.plan else v.kind
                if v.reported:
                    self._report(trial)
                return True
            if v.twin is not None:  # reported once, when recorded: nothing runs
                m = replace(v.twin.measurement, stderr_tail="")
                trial.set_user_attr("reused_from", v.twin.number)
            else:
                assert v.plan is not None
                self._forecast(trial, config, v.plan, snap)
                m = self._measure_trial(trial, config, is_baseline, len(snap.measured) + 1,
                                        remaining, v.plan.settings, snap)
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
                self._export(self._read())
            return v.twin is not None
        finally:
            if not told:
                with contextlib.suppress(Exception):
                    trial.set_user_attr("interrupted", True)
                    self.study.tell(trial, state=TrialState.FAIL)

    def _verdict(self, number: int, config: Config, is_baseline: bool,
                 remaining: float | None) -> tuple[verdict.Verdict, StudySnapshot]:
        """What happens to ``config`` (``tuner.verdict``), from the study as it stands; while
        another worker measures exactly this config, wait for it: its result is then reused,
        so a fleet never measures one config twice at the same time."""
        told = False
        while True:
            snap = self._read()
            running = () if is_baseline else tuple(
                claims.running_twins(self.study, number, config, self.opts.measure))
            twin = None if is_baseline or running else \
                claims.measured_twin(snap, config, self.opts.measure)
            v = verdict.decide(verdict.Facts(
                config, number, is_baseline, self.limit, twin=twin, running_twins=running,
                rule=oversubscribed(config, self.hw.cpu_cores),
                memory=self._memory_model(snap).verdict(config),
                plan=None if twin else self._trial_budget(config, remaining, snap)))
            if v.kind != verdict.TWIN_RUNNING:
                return v, snap
            if not told:
                # Its worker may be dead: found like any other dead worker's trial.
                with self._locked():
                    self._recover_dead_trials()
                self.reporter.note(f"trial {number}: another worker is measuring this config "
                                   f"(trial {running[0]}); waiting to reuse its result")
                told = True
            time.sleep(RUNNING_TWIN_POLL_S)

    def _report(self, trial: optuna.Trial) -> None:
        """Export the profile as the study stands now, and show the trial beside the best."""
        snap = self._read()
        self._export(snap)
        done = snap.trial(trial.number)
        if done is not None:
            self.reporter.trial_finished(done, snap.best)

    def _nothing_applied(self, snap: StudySnapshot) -> bool:
        """For a script: the knobs it was found never to apply, fixed in this worker's space
        too (another worker of the study may have found them); whether none is left."""
        known = snap.facts.unapplied if self.command is not None else None
        if known is None:
            return False
        self.space = self.space.fix(dict(known), self.baseline)
        return not self.space.searched

    def _learn_applied(self, m: Measurement, is_baseline: bool) -> None:
        """After a script's first measured trial: fix the knobs it never applies (it called
        none of their Profile methods), say why, and keep that on the study. A baseline that
        trained another batch than its config's halts the run: so would every config."""
        if self.command is not None and is_baseline and m.script.get("samples_mismatch"):
            self.halted = ("the baseline trained another batch than its config (see its "
                           "reason): no trial would measure the config it records")
        if self.command is None or not m.ok \
                or record.read_facts(self.study).unapplied is not None:
            return
        accessed = set(m.script.get("accessed") or ())
        reasons = unapplied(list(self.space.searched), accessed, self.command.name)
        self.study.set_user_attr("unapplied", reasons)
        self.space = self.space.fix(reasons, self.baseline)
        if reasons and not accessed:  # one line for all: the script never loaded a profile
            self.reporter.note(f"fixed: {self.command.name} never loads a profile "
                               f"(autotune.load_profile()): {', '.join(reasons)} are not searched")
        for why in reasons.values() if accessed else ():
            self.reporter.note(f"fixed: {why}")
        if m.script.get("default_samples") and "micro_batch_size" in reasons:
            self.reporter.note(
                f"{self.command.name} reports steps without a sample count and never reads the "
                f"batch size from the profile: samples/s counts {self.baseline.micro_batch_size}"
                " per rank and step; pass --param batch=N (its batch) or autotune.step(samples)")

    def _trial_budget(self, config: Config, remaining: float | None,
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
        peak = self._memory_model(snap).predict(config)
        trial.set_user_attr("forecast", {
            "step": plan.prediction.to_dict() if plan.prediction else None,
            "peak_memory_bytes": None if peak is None else int(peak),
            "max_seconds": round(plan.settings.max_seconds, 2)})

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
        trial.set_user_attr("measure_settings", self.opts.measure.to_dict())
        if settings != self.opts.measure:
            trial.set_user_attr("budget", {
                k: v for k, v in settings.to_dict().items()
                if v != self.opts.measure.to_dict()[k]})
        best = snap.best if self.opts.prune and not is_baseline else None
        m = self.measure_config(config, self._workdir(trial), timeout, settings,
                                best.samples_per_sec if best else None)
        if cut and m.ended_by == TRIAL_TIMEOUT and not record.budget_cut_before(trial):
            # The run's budget ended this trial, not the config's speed: not a result, measured
            # again once by the next run (twice cut: it is a real timeout).
            m = replace(m, status="error", reason="stopped by the run's --timeout",
                        ended_by=BUDGET)
        return m

    def measure_config(self, config: Config, workdir: Path, timeout: float,
                       settings: MeasureSettings, prune_below: float | None = None,
                       report: bool = True) -> Measurement:
        """One trial process for ``config`` (the search benchmark replaces this)."""
        return self.measurer.run(config, workdir, timeout, settings, prune_below,
                                 self.reporter.trial_event if report else None)

    def _workdir(self, trial: optuna.Trial) -> Path:
        return self.out_dir / "trials" / f"{trial.number:04d}"

    def _write(self, trial: optuna.Trial, rec: record.Record) -> None:
        """Write a record on the trial and end it (``tuner.record`` decides what)."""
        for key, value in rec.attrs.items():
            trial.set_user_attr(key, value)
        if rec.constraint is not None:
            trial.set_constraint("memory", rec.constraint)
        for i, value in enumerate(rec.intermediate):
            trial.report(value, i)
        if rec.state == TrialState.COMPLETE:
            self.study.tell(trial, rec.value)
        else:
            self.study.tell(trial, state=rec.state)
        if rec.retry_attrs is not None:
            self.study.enqueue_trial(trial.params, user_attrs=rec.retry_attrs)

    def _memory_model(self, snap: StudySnapshot) -> MemoryModel:
        return MemoryModel(snap.observations, self.hw.device, self.limit, self.opts.headroom)

    # -- the machine, the confirmation, the results ----------------------------------------------

    def budget_text(self) -> str:
        return options.budget_text(self.opts)

    def _probe_machine(self) -> None:
        if self.opts.probe:
            self.measurer.read_probe(self.out_dir, self.reporter.note)

    def _confirmation_reserve(self, snap: StudySnapshot) -> float:
        o = self.opts
        return confirm.reserve(snap, o.confirm_top, o.confirm_rounds, o.timeout_s, o.measure)

    def _confirm(self, deadline: float | None) -> None:
        o = self.opts
        self.confirm_skipped = confirm.confirm(
            self.study, lambda c, w, t, s: self.measure_config(c, w, t, s, report=False),
            o.measure, limit=self.limit, top=o.confirm_top, rounds=o.confirm_rounds,
            headroom=o.headroom, trial_timeout_s=o.trial_timeout_s, deadline=deadline,
            out_dir=self.out_dir, on_round=self.reporter.confirming)

    def _export(self, snap: StudySnapshot) -> Profile | None:
        return confirm.export(self.study, snap, storage.redact(self.storage_url),
                              self.opts.global_batch, self.out_dir / "profile.yaml")

    def _summary(self, wall_s: float, interrupted: bool, stop_reason: str) -> RunSummary:
        snap = self._read()
        profile = self._export(snap)
        return RunSummary(
            self.study_name, storage.redact(self.storage_url), self.out_dir,
            self.out_dir / "profile.yaml" if profile else None, snap.winner, snap.baseline,
            list(snap.records), wall_s, interrupted, stop_reason,
            confirmation=snap.confirmation, speedup=snap.speedup if profile else None,
            confirm_skipped=self.confirm_skipped, dashboard=self._dashboard(),
            diagnosis=[Finding.from_dict(f) for f in profile.diagnosis] if profile else [],
            mfu=profile.result.get("mfu") if profile else None)

    def _dashboard(self) -> str:
        """Draw studies/<study>/dashboard.html again; failing to draw never fails the run."""
        if self.draw is None:
            return ""
        try:
            return str(self.draw(self.study, self.out_dir / "dashboard.html"))
        except Exception as exc:  # noqa: BLE001 - the study and the profile are already saved
            return f"not written ({one_line(exc)})"


def run(opts: RunOptions, reporter: Reporter, dashboard: Dashboard | None = None) -> RunSummary:
    """Run (or resume) a study and export its profile; see ``RunOptions`` for the knobs."""
    try:
        return Runner(opts, reporter, dashboard).run()
    except Exception as exc:
        why = disk_full(exc)
        if why is None:
            raise
        # Each finished trial was committed when it ended; the one that was running when the
        # write failed is found as dead and measured again when the run resumes.
        raise DiskFull(f"disk full ({why}) writing the study to "
                       f"{storage.redact(opts.storage_url)} or its outputs; free space and run "
                       "the same command to resume: completed trials are kept") from None
