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

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from optuna.exceptions import UpdateFinishedTrialError

from autotune.config.knobs import Config, oversubscribed
from autotune.config.space import NarrowedSpace, baseline_for_global_batch, load_space, narrow
from autotune.errors import DiskFull, disk_full, one_line
from autotune.machine.hardware import detect, hostname, process_identity
from autotune.machine.probe import peak_for
from autotune.paths import study_folder
from autotune.trial.command import parse_command
from autotune.trial.executors import Executor, start_executor
from autotune.tuner import (
    budget,
    claims,
    confirm_rounds,
    memory_binds,
    options,
    record,
    rereads,
    stages,
    storage,
)
from autotune.tuner.diagnosis import Finding
from autotune.tuner.export import diagnose_record
from autotune.tuner.identity import Identity, default_name, open_study
from autotune.tuner.measurer import Measurer, MeasureTrial, sentinel_precisions
from autotune.tuner.options import RunOptions
from autotune.tuner.parallel import SerialReporter, run_slots
from autotune.tuner.reporting import Interrupted, Reporter, RunSummary, StartInfo
from autotune.tuner.search import Proposal, noise_of, since_improvement, staged_next
from autotune.tuner.snapshot import StudySnapshot
from autotune.tuner.trial_steps import TrialSteps
from autotune.units import format_duration
from autotune.workloads import WorkloadSpec, declared_knobs, resolve, script_workload

__all__ = ["Interrupted", "Reporter", "RunOptions", "RunSummary", "Runner", "StartInfo", "run"]

MAX_TWINS_IN_A_ROW = 20
# Draws a study's dashboard into a file (report.write_dashboard; the CLI passes it in).
Dashboard = Callable[[optuna.Study, Path], Path]


class Runner:
    """One ``autotune run``: set-up, the trial loop, confirmation and export."""

    def __init__(self, opts: RunOptions, reporter: Reporter,
                 dashboard: Dashboard | None = None, *,
                 measure: MeasureTrial | None = None) -> None:
        """``measure``: what measures one config instead of a trial process (tests in-process,
        the search benchmark: ``autotune.testing.replay``)."""
        hw = opts.hardware or detect()
        options.check(opts, hw)
        self.opts = opts = opts.with_defaults(hw)
        self.hw, self.draw = hw, dashboard
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
        space = narrow(load_space(opts.space), hw, self.world, self.baseline,
                       opts.global_batch, supports=declared_knobs(workload),
                       workload=f"workload {self.workload_name}", nodes=opts.nnodes)
        self.storage_url = opts.storage_url
        self.study_name = opts.study_name or default_name(self.workload_name,
                                                          self.workload_spec, space, hw)
        self._slot = threading.local()  # a slot thread's own measurer (``tuner.parallel``)
        # Where trials run (None: here); an allocation that cannot hold a trial is said now,
        # before anything is written.
        self.executor: Executor | None = start_executor(
            opts.executor, opts.nnodes, opts.nproc or 1, opts.parallel, self.study_name)
        self.out_dir = opts.out_dir or study_folder(opts.studies_dir, self.study_name)
        options.check_out_dir(self.out_dir)
        self.confirm_skipped: str | None = None  # why this run did not confirm, when it did not
        self.storage = storage.open_storage(self.storage_url)
        ident = Identity(self.study_name, self.workload_name, self.workload_spec, space,
                         hw, self.baseline, self.world, opts.global_batch)
        with storage.locked(self.storage_url, self.study_name):
            self.study, self.limit = open_study(
                self.storage, self.storage_url, ident, seed=opts.seed,
                limit=options.memory_limit(opts.memory_limit, hw), limit_spec=opts.memory_limit,
                note=lambda line: reporter.note(line))
        # Who holds a device, as a worker waiting for it is told (tuner.fleet.DeviceLock).
        self.measurer = Measurer(
            hw, self.workload_spec, opts.nproc or 1, opts.nodes, self.limit, self.study,
            owner=f"autotune pid {process_identity()['pid']} on {hostname()}, "
                  f"study {self.study_name}",
            on_wait=lambda line: self.reporter.note(line),
            address_space_bytes=opts.address_space_bytes, command=self.command,
            executor=self.executor, sentinel=sentinel_precisions(space, self.baseline))
        # Knobs the script was found never to apply (a resumed study's, from its first trial).
        unapplied = dict(record.read_facts(self.study).unapplied or {})
        if self.command is not None:  # a script has no way to take them yet
            unapplied.update(memory_binds.SCRIPT_FIXED)
        self.steps = TrialSteps(
            opts, hw, self.study, self.storage, self.storage_url, self.limit,
            space.fix(unapplied, self.baseline), self.baseline, self.command,
            self.out_dir, reporter, lambda: self.measurer, measure)

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> RunSummary:
        start = time.monotonic()
        with self.steps.locked():
            self.steps.recover_dead_trials()
            self._enqueue_baseline()
        self.reporter.started(StartInfo(
            self.study_name, storage.redact(self.storage_url), self.hw, self.space, self.limit,
            self.budget_text(), len(self.steps.read().measured), self.out_dir,
            self.opts.trials, self.opts.timeout_s))
        deadline = start + self.opts.timeout_s if self.opts.timeout_s else None
        if self.command is not None and self.command.untracked:
            self.reporter.note(self.command.untracked)
        self._start_executor()
        self._probe_machine()
        if self.command is None:
            memory_binds.size_once(self.study, self.space, self.workload_spec, self.reporter.note)
        interrupted, stop_reason = self._slot_trials(deadline)
        if not interrupted:
            try:
                self._confirm(deadline)
            except KeyboardInterrupt:
                interrupted, stop_reason = True, "interrupted during confirmation"
        summary = self._summary(time.monotonic() - start, interrupted, stop_reason)
        self.reporter.finished(summary)
        if interrupted:
            raise Interrupted(f"interrupted; study {self.study_name} is saved in "
                              f"{storage.redact(self.storage_url)}: run the same command to "
                              "resume")
        return summary

    @property
    def space(self) -> NarrowedSpace:
        """The space searched, with the knobs a script never applies fixed as they are found
        (the trial steps find them)."""
        return self.steps.space

    @property
    def reporter(self) -> Reporter:
        """Who is told; the trial steps tell the same one (a slot's serialising wrapper while
        trials run side by side)."""
        return self.steps.reporter

    @property
    def measurer(self) -> Measurer:
        """This thread's measurer: a slot's own while trials run side by side."""
        return getattr(self._slot, "measurer", None) or self._measurer

    @measurer.setter
    def measurer(self, m: Measurer) -> None:
        self._measurer = m

    def _start_executor(self) -> None:
        """Say where trials run; end what a killed earlier driver of this study left running
        on the engine (its trials were found dead and are measured again)."""
        if self.executor is None:
            return
        self.reporter.note(f"trials run as {self.executor.describe()}")
        ended = self.executor.clean()
        if ended:
            self.reporter.note(f"ended {len(ended)} trial(s) an earlier run of this study left "
                               f"running on {self.executor.name}: {', '.join(ended)}")

    def _slot_trials(self, deadline: float | None) -> tuple[bool, str]:
        """The trial loop, in one thread per slot when the executor runs trials side by side."""
        if self.executor is None or self.executor.slots == 1:
            return self._trials(deadline)
        reporter, self.steps.reporter = self.reporter, SerialReporter(self.reporter)
        try:
            return run_slots(self._measurer, self.executor.slots,
                             lambda m: setattr(self._slot, "measurer", m),
                             lambda: self._trials(deadline))
        finally:
            self.steps.reporter = reporter

    def _trials(self, deadline: float | None) -> tuple[bool, str]:
        """Ask, claim, measure and record trials until a stop rule says stop; returns
        (interrupted, why it stopped). The study is read once per trial, under the lock."""
        twins_in_a_row = 0
        while True:
            remaining = deadline - time.monotonic() if deadline else None
            # Deciding whether to go on and claiming the next trial read the study and write it:
            # under the study lock, so a fleet's workers never both take the last trial.
            with self.steps.locked():
                self.steps.recover_dead_trials()
                snap = self.steps.read()
                stop_reason = self._stop_reason(snap, remaining, twins_in_a_row)
                trial = None if stop_reason else self._claim(self._ask())
            if trial is None:
                return False, stop_reason
            reserve = self._confirmation_reserve(snap)
            try:
                with storage.beating(self.study, trial):
                    reused = self.steps.run_trial(trial, None if remaining is None
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
        if stop := self.steps.no_room or self.steps.halted:
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
        staging = self._stage(snap, None if remaining is None else remaining - reserve)
        noise = noise_of(snap.observations)
        if not staging and self.opts.patience is not None \
                and since_improvement(snap.observations, noise) >= self.opts.patience:
            return (f"no trial beat the best by more than the noise ({100 * noise:.1f}%) in the "
                    f"last {self.opts.patience} trials")
        return ""

    # -- claiming trials, and recovering dead workers' -------------------------------------------

    def _ask(self) -> optuna.Trial:
        return storage.ask(self.study)

    def _claim(self, trial: optuna.Trial) -> optuna.Trial:
        return claims.claim(self.study, self.storage, trial)

    def _enqueue_baseline(self) -> None:
        claims.enqueue_baseline(self.study, self.space.params_for(self.baseline))

    def _stage(self, snap: StudySnapshot, left: float | None) -> bool:
        """Queue the staged search's next config unless a trial is already waiting; returns
        whether the staged start is still going (queued or waiting). A config the search's
        ``left`` seconds cannot measure is passed over like one too slow for any budget: a
        cheaper step of the search runs in the time instead (a run that stopped at the first
        config without room left two minutes of its search unused)."""
        if snap.pending.waiting:
            return snap.pending.waiting_staged
        model = self.steps.memory_model(snap)
        if memory_binds.next_baseline(self.study, self.space, snap, self.reporter.note,
                                      model.strategies):
            return True
        baseline = memory_binds.baseline_now(snap, self.baseline)
        self.steps.sharding_now = baseline.sharding

        def too_slow(c: Config) -> bool:
            return self.steps.trial_budget(c, left, snap).ruled_out

        running = snap.pending.running
        proposal = staged_next(self.space, baseline, snap.observations, model,
                               too_slow=too_slow, peaks=self._peaks(snap),
                               fastest=budget.StepTimeModel(snap.observations).fastest) \
            or self._diagnosis_stage(snap, lambda c: model.verdict(c) is not None
                                     or too_slow(c)
                                     or oversubscribed(c, self.hw.cpu_cores) is not None,
                                     lambda c: left is not None and self.steps.trial_budget(
                                         c, left / 2, snap).ruled_out)
        if proposal is None:
            return False
        if proposal.config in running:
            return True  # another worker measures it now; this one samples meanwhile
        record.queue_staged(self.study, self.space.params_for(proposal.config), proposal.stage,
                            proposal.reread_of)
        return True

    def _peaks(self, snap: StudySnapshot) -> dict[str, float]:
        """The probe's measured peak (TFLOP/s per device) of each precision, as far as known."""
        probe = snap.facts.probe
        found = {amp: peak_for(probe, amp, self.hw.device) for amp in ("off", "bf16", "fp16")}
        return {amp: peak for amp, peak in found.items() if peak}

    def _diagnosis_stage(self, snap: StudySnapshot, ruled_out: Callable[[Config], bool],
                         last: Callable[[Config], bool]) -> Proposal | None:
        """After the staged start: an unsteady losing reading measured again
        (``rereads``), else the next change ``stages.after_start`` proposes for the incumbent,
        diagnosed again from the study as it stands."""
        if (best := snap.best) is None:
            return None
        tried = {o.config for o in snap.observations} | set(snap.pending.running)
        return rereads.unsteady_loser(snap.observations, best.samples_per_sec or 0.0,
                                      ruled_out) or \
            stages.after_start(self.space, best, snap.observations, diagnose_record(snap, best),
                               tried, ruled_out, last)

    def _nothing_applied(self, snap: StudySnapshot) -> bool:
        """For a script: the knobs it was found never to apply, fixed in this worker's space
        too (another worker of the study may have found them); whether none is left."""
        known = snap.facts.unapplied if self.command is not None else None
        if known is None:
            return False
        self.steps.space = self.space.fix(dict(known), self.baseline)
        return not self.space.searched

    # -- the machine, the confirmation, the results ----------------------------------------------

    def budget_text(self) -> str:
        return options.budget_text(self.opts)

    def _probe_machine(self) -> None:
        if self.opts.probe:
            self.measurer.read_probe(self.out_dir, self.reporter.note)

    def _confirmation_reserve(self, snap: StudySnapshot) -> float:
        o = self.opts
        return confirm_rounds.reserve(snap, o.confirm_top, o.confirm_rounds, o.timeout_s, o.measure)

    def _confirm(self, deadline: float | None) -> None:
        o = self.opts
        self.confirm_skipped = confirm_rounds.confirm(
            self.study, lambda c, w, t, s: self.steps.measure_config(c, w, t, s, report=False),
            o.measure, limit=self.limit, top=o.confirm_top, rounds=o.confirm_rounds,
            headroom=o.headroom, trial_timeout_s=o.trial_timeout_s, deadline=deadline,
            out_dir=self.out_dir, on_round=self.reporter.confirming)

    def _summary(self, wall_s: float, interrupted: bool, stop_reason: str) -> RunSummary:
        snap = self.steps.read()
        profile = self.steps.export(snap)
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
