"""The only Optuna caller: open or resume the study, enqueue the baseline, run and record trials.

Trials are asked and told one at a time (ask/tell), so each gets a per-trial timeout cut to the
remaining budget, Ctrl-C is recorded on the running trial, and a killed tuner's trial is found and
retried on the next run (by its dead process id on this host at once, by heartbeat elsewhere).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.trial import FrozenTrial, TrialState

from autotune.config.knobs import Config
from autotune.config.space import NarrowedSpace, baseline_for_global_batch, load_space, narrow
from autotune.errors import AutotuneError, StorageError, UsageError, one_line
from autotune.machine.hardware import (
    Hardware,
    detect,
    hostname,
    memory_limit,
    process_alive,
    process_identity,
)
from autotune.machine.monitor import GpuMonitor
from autotune.profile import Profile, fingerprint_diff
from autotune.trial import launch
from autotune.trial.measurement import (
    BUDGET,
    INTERRUPTED,
    TOO_SLOW,
    TRIAL_TIMEOUT,
    Measurement,
    RawResult,
    classify,
    node_cause,
)
from autotune.trial.spec import COUNTED, MeasureSettings, TrialSpec
from autotune.tuner.diagnosis import with_efficiency
from autotune.tuner.fleet import DeviceLock, study_lock, trial_devices
from autotune.tuner.results import (
    TrialView,
    build_profile,
    confirmed,
    confirmed_winner,
    measured,
    observations,
    pick_baseline,
    pick_best,
    recorded,
    view,
)
from autotune.tuner.search import (
    HEADROOM,
    PATIENCE,
    Candidate,
    MemoryModel,
    confirmation_seconds,
    decide,
    noise_of,
    plan_confirmation,
    prune_reason,
    since_improvement,
    staged_next,
)
from autotune.units import format_bytes, format_duration
from autotune.workloads import WorkloadSpec, resolve

DEFAULT_TIMEOUT_S = 12 * 60  # with no budget flag: ends within ~15 minutes on a 2-core CPU
HEARTBEAT_S = 10
GRACE_S = 60
STORAGE_ATTEMPTS = 5
RUNNING_TWIN_POLL_S = 1.0
JOURNAL = "journal:///"  # Optuna's journal file storage: for clusters that share only files
NODE_TRIAL = "node_trial"  # the study attribute through which other nodes' agents join trials
NODE_REPORT = "node_report"  # prefix of the attributes where agents say how their part ended
NODE_REPORT_WAIT_S = 10.0  # how long a failed trial across machines waits for those reports
TPE_STARTUP_TRIALS = 5
MAX_TWINS_IN_A_ROW = 20
CONFIRM_SHARE = 0.4  # at most this share of a --timeout is kept for the confirmation

optuna.logging.set_verbosity(optuna.logging.WARNING)


@dataclass
class RunOptions:
    """Everything ``autotune run`` takes; defaults are the CLI's defaults."""

    model: str = "bert"
    params: dict[str, Any] = field(default_factory=dict)
    space: str = "default"
    storage: str | None = None
    study_name: str | None = None
    trials: int | None = None  # the study's total; rerunning the command resumes towards it
    timeout_s: float | None = None  # wall time of this invocation
    memory_limit: str | None = None
    out_dir: Path | None = None
    studies_dir: Path = Path("studies")
    seed: int = 0
    trial_timeout_s: float = 180.0
    nproc: int | None = None  # ranks per trial; None: one per visible GPU, 1 on CPU
    global_batch: int | None = None  # keep micro x accumulation x ranks at this value
    measure: dict[str, Any] = field(default_factory=dict)
    patience: int | None = PATIENCE  # stop after this many trials with no win beyond the noise
    confirm_top: int = 3  # configs re-measured at the end (0: no confirmation)
    confirm_rounds: int = 3  # interleaved rounds of that re-measurement
    headroom: float = HEADROOM  # share of the memory limit the exported config keeps free
    prune: bool = True  # stop trials whose first windows are clearly below the best
    address_space_bytes: int | None = None  # RLIMIT_AS for trial processes (tests)
    hardware: Hardware | None = None  # detected when None
    probe: bool = True  # read the machine's peaks (probing it once) for MFU and the diagnosis
    nnodes: int = 1  # machines per trial; each runs --nproc ranks (torchrun, c10d rendezvous)
    rdzv_endpoint: str | None = None  # host:port of the rendezvous, for --nnodes > 1
    launcher: str | None = None  # a cluster launcher's command template with {cmd}


@dataclass
class StartInfo:
    study_name: str
    storage: str
    hardware: Hardware
    space: NarrowedSpace
    memory_limit_bytes: int
    budget: str
    done_before: int
    out_dir: Path
    trials: int | None = None  # the study's target, for the ETA
    timeout_s: float | None = None


@dataclass
class RunSummary:
    study_name: str
    storage: str
    out_dir: Path
    profile_path: Path | None
    best: TrialView | None
    baseline: TrialView | None
    trials: list[TrialView]
    wall_s: float
    interrupted: bool = False
    stop_reason: str = ""
    confirmation: dict[str, Any] | None = None  # as recorded in the study and the profile
    confirmed_speedup: float | None = None  # winner / baseline, measured side by side
    confirm_skipped: str | None = None  # why this run did not confirm, when it did not
    dashboard: str = ""  # its path, or why it was not written
    diagnosis: list[dict[str, Any]] = field(default_factory=list)  # what limits the winner

    @property
    def speedup(self) -> float | None:
        if self.confirmed_speedup is not None:
            return self.confirmed_speedup
        if self.best and self.baseline and self.baseline.samples_per_sec:
            return (self.best.samples_per_sec or 0.0) / self.baseline.samples_per_sec
        return None


class Reporter(Protocol):
    def started(self, info: StartInfo) -> None: ...
    def trial_started(self, number: int, index: int, total: int | None, config: Config,
                      is_baseline: bool, timeout_s: float) -> None: ...
    def trial_event(self, event: dict[str, Any]) -> None: ...
    def trial_finished(self, view: TrialView, best: TrialView | None) -> None: ...
    def confirming(self, round_index: int, rounds: int, candidate: Candidate,
                   measurement: Measurement) -> None: ...
    def note(self, line: str) -> None: ...
    def finished(self, summary: RunSummary) -> None: ...


class Interrupted(AutotuneError):
    """Ctrl-C: the running trial was ended and recorded; the study is intact and resumable."""

    exit_code = 130


def redact(url: str) -> str:
    """A storage URL without its password, for printing and for the profile."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        return f"{scheme}://{creds.split(':')[0]}:***@{host}" if ":" in creds else url
    return url


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """An RDB storage with heartbeats, or a journal file (``journal:///path``, as sqlite URLs
    name files); bad URLs and unreachable servers become one-line errors."""
    for scheme in ("sqlite:///", JOURNAL):
        if url.startswith(scheme):
            path = url[len(scheme):]
            if path and path != ":memory:":
                with contextlib.suppress(OSError):
                    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if url.startswith(JOURNAL):
        from optuna.storages.journal import JournalFileBackend

        try:
            return optuna.storages.JournalStorage(JournalFileBackend(url[len(JOURNAL):]))
        except OSError as exc:
            raise StorageError(f"cannot open journal file {url[len(JOURNAL):]!r} "
                               f"({one_line(exc)}); pass a writable path: "
                               "journal:///path/to/journal.log") from None
    error: Exception | None = None
    for attempt in range(STORAGE_ATTEMPTS):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(
                    url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                    heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=2))
        except Exception as exc:  # sqlalchemy's ArgumentError, OperationalError, ...
            error = exc
            # Workers started together all create Optuna's tables: the losers of that race see
            # "already exists", a duplicate key, or (SQLite) a locked database. Try again.
            racing = any(word in str(exc).lower() for word in
                         ("already exists", "duplicate", "locked", "unique constraint"))
            if not racing:
                break
            time.sleep(0.2 + 0.3 * attempt)
    assert error is not None
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    raise StorageError(f"cannot open storage {redact(url)!r} ({type(error).__name__}: "
                       f"{first[:200]}); use sqlite:///path/to.db or "
                       "postgresql://user@host:5432/db") from None


def default_study_name(name: str, workload: WorkloadSpec, space: NarrowedSpace,
                       hw: Hardware) -> str:
    """``<workload>-<space>-<hash>``: the hash covers the params, the narrowed space and the
    hardware, so editing a space file or moving machines starts a new study, never a mixed one."""
    blob = json.dumps({"spec": workload.spec, "params": workload.params,
                       "space": space.to_dict()["searched"], "fingerprint": hw.fingerprint(),
                       **_shape(space)}, sort_keys=True, default=str)
    return f"{name}-{space.name}-{hashlib.sha256(blob.encode()).hexdigest()[:8]}"


def _shape(space: NarrowedSpace) -> dict[str, Any]:
    """What, besides the searched knobs, makes two studies' trials incomparable. Empty for one
    rank without --global-batch, so studies made before these options keep their names."""
    shape: dict[str, Any] = {}
    if space.world_size != 1:
        shape["world_size"] = space.world_size
    if space.global_batch is not None:
        shape["global_batch"] = space.global_batch
    return shape


def default_nproc(hw: Hardware) -> int:
    """One rank per visible GPU; one on CPU."""
    return len(hw.gpus) if hw.device == "cuda" and hw.gpus else 1


def check_nproc(nproc: int, hw: Hardware) -> None:
    if nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {nproc}")
    if hw.device == "cuda" and nproc > len(hw.gpus):
        raise UsageError(f"--nproc {nproc} asks for more ranks than the {len(hw.gpus)} visible "
                         "GPU(s); one rank per GPU: pass --nproc <= the GPU count "
                         "(CUDA_VISIBLE_DEVICES selects them)")
    if hw.device == "cpu" and nproc > hw.cpu_cores:
        raise UsageError(f"--nproc {nproc} asks for more ranks than the {hw.cpu_cores} CPU "
                         f"cores; ranks would share cores and time each other: pass --nproc <= "
                         f"{hw.cpu_cores}")


def check_nodes(nnodes: int, endpoint: str | None, template: str | None) -> launch.Nodes | None:
    """The multi-node launch for --nnodes/--rdzv-endpoint/--launcher; None on one node."""
    if nnodes < 1:
        raise UsageError(f"--nnodes must be >= 1, got {nnodes}")
    if template is not None and "{cmd}" not in template:
        raise UsageError(f"--launcher {template!r} has no {{cmd}}: the launcher runs {{cmd}} on "
                         "each node, e.g. --launcher 'srun --nodes 2 --ntasks-per-node 1 {cmd}'")
    if nnodes == 1:
        if endpoint is not None or template is not None:
            raise UsageError("--rdzv-endpoint and --launcher are for trials across machines: "
                             "pass --nnodes N (N > 1) too")
        return None
    if endpoint is None:
        raise UsageError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT, the address every "
                         "node reaches the rendezvous at (a free port on this machine, which "
                         "hosts it)")
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT; pass e.g. "
                         "--rdzv-endpoint node0:29400")
    return launch.Nodes(count=nnodes, endpoint=endpoint, template=template)


def _check_writable(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".autotune-write-check"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"output directory {path} is not writable ({exc.strerror}); "
                         "pass --out DIR with a writable directory") from None


class Runner:
    """One ``autotune run``: set-up, the trial loop, export."""

    def __init__(self, opts: RunOptions, reporter: Reporter) -> None:
        self.opts, self.reporter = opts, reporter
        if opts.trials is not None and opts.trials < 1:
            raise UsageError(f"--trials must be >= 1, got {opts.trials}")
        if opts.timeout_s is not None and opts.timeout_s <= 0:
            raise UsageError(f"--timeout must be positive, got {opts.timeout_s:g}s")
        if opts.trials is None and opts.timeout_s is None:
            opts.timeout_s = DEFAULT_TIMEOUT_S
        self.hw = opts.hardware or detect()
        self.workload_spec = WorkloadSpec(opts.model, dict(opts.params))
        workload = resolve(opts.model, opts.params)
        self.workload_name = str(getattr(workload, "name", self.workload_spec.name))
        self.nproc = opts.nproc if opts.nproc is not None else default_nproc(self.hw)
        check_nproc(self.nproc, self.hw)
        self.nodes = check_nodes(opts.nnodes, opts.rdzv_endpoint, opts.launcher)
        self.world = self.nproc * opts.nnodes  # ranks per trial, all nodes together
        if opts.global_batch is not None:
            self.baseline = baseline_for_global_batch(workload.default_micro_batch,
                                                      opts.global_batch, self.world)
        else:
            self.baseline = Config(micro_batch_size=workload.default_micro_batch,
                                   world_size=self.world)
        self.space = narrow(load_space(opts.space), self.hw, self.world, self.baseline,
                            opts.global_batch)
        self.limit = memory_limit(opts.memory_limit, self.hw)  # a resumed study keeps its own
        self.storage_url = opts.storage or f"sqlite:///{opts.studies_dir}/autotune.db"
        self.study_name = opts.study_name or default_study_name(
            self.workload_name, self.workload_spec, self.space, self.hw)
        self.out_dir = opts.out_dir or opts.studies_dir / self.study_name
        _check_writable(self.out_dir)
        self.confirm_skipped: str | None = None  # why this run did not confirm, when it did not
        self.probe: dict[str, Any] | None = None  # the probe's summary, once run() read it
        self.storage = open_storage(self.storage_url)
        # Who holds a device, as a worker waiting for it is told (autotune.tuner.fleet.DeviceLock).
        self.device_owner = (f"autotune pid {process_identity()['pid']} on {hostname()}, "
                             f"study {self.study_name}")
        self.held: dict[str, Any] = {}  # the devices and wall-clock span of the last trial run
        with self._locked():
            self.study = self._open_study()

    # -- set-up ---------------------------------------------------------------------------------

    def _open_study(self) -> optuna.Study:
        try:
            study = optuna.create_study(
                study_name=self.study_name, storage=self.storage, direction="maximize",
                sampler=self._sampler(0), load_if_exists=True)
        except Exception as exc:
            raise StorageError(f"cannot create or load study {self.study_name!r} in "
                               f"{redact(self.storage_url)}: {exc}") from None
        attrs = study.user_attrs
        fingerprint = self.hw.fingerprint()
        if "fingerprint" in attrs:
            diff = fingerprint_diff(attrs["fingerprint"], fingerprint)
            if diff:
                # A fleet worker on another kind of machine lands here too: its throughput
                # would not be comparable with the study's.
                raise UsageError(f"study {self.study_name} was measured on other hardware "
                                 f"({'; '.join(diff)}); measurements are not comparable: "
                                 "run this worker on a machine like the study's, or pass "
                                 "another --study name")
            stored = attrs.get("workload") or {}
            if (stored.get("spec"), stored.get("params")) != (self.workload_spec.spec,
                                                              self.workload_spec.params):
                raise UsageError(f"study {self.study_name} tunes workload {attrs.get('workload')}, "
                                 "not this one; pass another --study name")
            stored_space = attrs.get("space") or {}
            stored_shape = {"world_size": stored_space.get("world_size", 1),
                            "global_batch": stored_space.get("global_batch")}
            if stored_shape != {"world_size": self.world, "global_batch": self.opts.global_batch}:
                raise UsageError(
                    f"study {self.study_name} was tuned with {stored_shape['world_size']} "
                    f"rank(s) per trial (--nproc x --nnodes) and --global-batch "
                    f"{stored_shape['global_batch'] or 'unset'}, not {self.world} rank(s) and "
                    f"--global-batch {self.opts.global_batch or 'unset'}; pass the same flags "
                    "to resume it, or another --study name")
            searched = stored_space.get("searched")
            if searched != json.loads(json.dumps(self.space.to_dict()["searched"])):
                raise UsageError(f"study {self.study_name} searched another space ({searched}); "
                                 "its trials would not fit this one: pass another --study name")
            self._keep_study_limit(attrs.get("memory_limit_bytes"), attrs.get("memory_limit_spec"))
        else:
            for key, value in {
                "fingerprint": fingerprint, "hardware": self.hw.to_dict(),
                "workload": {"name": self.workload_name, "spec": self.workload_spec.spec,
                             "params": self.workload_spec.params},
                "space": self.space.to_dict(), "baseline": self.baseline.to_dict(),
                "created": datetime.now(UTC).isoformat(timespec="seconds"),
            }.items():
                study.set_user_attr(key, value)
        if "memory_limit_bytes" not in attrs:
            study.set_user_attr("memory_limit_bytes", self.limit)
            study.set_user_attr("memory_limit_spec", self.opts.memory_limit)
        # Reseed on resume so the random start-up trials do not repeat the first run's.
        study.sampler = self._sampler(len(study.get_trials(deepcopy=False)))
        return study

    def _keep_study_limit(self, stored: int | None, stored_spec: str | None) -> None:
        """A study's memory limit is fixed when it is created: constraints of earlier trials
        were computed against it. Resuming uses it; asking for another one is an error. The
        same flag text counts as the same limit (a fraction of available RAM moves a little)."""
        if stored is None:
            return
        asked = self.opts.memory_limit
        if asked is not None and asked != stored_spec and self.limit != stored:
            raise UsageError(
                f"study {self.study_name} was tuned with --memory-limit "
                f"{format_bytes(stored)}, not {format_bytes(self.limit)}; resume it without "
                "--memory-limit, or pass --study NAME to start a new study with the new limit")
        self.limit = int(stored)

    def _sampler(self, offset: int) -> optuna.samplers.BaseSampler:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(
                seed=self.opts.seed + offset, multivariate=True, group=True,
                n_startup_trials=TPE_STARTUP_TRIALS,
                # Trials other workers are running count as bad for now: workers of a fleet
                # are not all sent to the same region.
                constant_liar=True)

    def _recover_dead_trials(self) -> None:
        """Fail and retry RUNNING trials whose tuner is gone: on this host by its pid, on others
        by the heartbeat (Optuna's on a database, autotune's ``alive_at`` on a journal file)."""
        host = hostname()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            retry = RetryHeartbeatStaleTrialCallback(max_retry=2)
        own_heartbeat = not isinstance(self.storage, BaseHeartbeat)
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            owner = t.user_attrs.get("worker") or {}
            if owner.get("host") == host:
                if process_alive(owner):
                    continue
            elif not own_heartbeat or not owner:
                continue
            else:
                start = t.datetime_start.timestamp() if t.datetime_start else time.time()
                if time.time() - float(t.user_attrs.get("alive_at") or start) < GRACE_S:
                    continue
            # A finished trial's attributes are frozen: mark it first, then fail it, then retry.
            # Another tuner may be recovering the same trial: whoever fails it first retries it.
            try:
                self.storage.set_trial_user_attr(t._trial_id, "interrupted", True)
                self.storage.set_trial_user_attr(t._trial_id, "reason", "its tuner process died")
                if self.storage.set_trial_state_values(t._trial_id, TrialState.FAIL):
                    retry(self.study, self.storage.get_trial(t._trial_id))
            except UpdateFinishedTrialError:
                continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(self.study)  # other hosts: by heartbeat

    def _enqueue_baseline(self) -> None:
        """Queue the baseline once: a baseline that ran (even to an OOM) is not run again."""
        trials = self.study.get_trials(deepcopy=False)
        pending = any(t.user_attrs.get("baseline") and t.state in
                      (TrialState.WAITING, TrialState.RUNNING) for t in trials)
        ran = any(t.user_attrs.get("baseline") for t in recorded(self.study))
        if not ran and not pending:
            self.study.enqueue_trial(self.space.params_for(self.baseline),
                                     user_attrs={"baseline": True})

    def budget_text(self) -> str:
        o = self.opts
        parts = []
        if o.trials is not None:
            parts.append(f"{o.trials} measured trials in the study")
        if o.timeout_s is not None:
            parts.append(f"{format_duration(o.timeout_s)} of wall time")
        measuring = float(o.measure.get("max_seconds", 60.0))
        confirm = ""
        if o.confirm_top > 0:
            confirm = (f"; then the top {o.confirm_top} and the baseline are re-measured, "
                       f"{o.confirm_rounds} interleaved rounds"
                       + (f" (within the time budget: up to {100 * CONFIRM_SHARE:.0f}% of it)"
                          if o.timeout_s is not None else ""))
        return (" or ".join(parts) + (", whichever comes first" if len(parts) > 1 else "")
                + f"; each trial measures for at most {measuring:.0f}s and is killed at "
                f"{o.trial_timeout_s:.0f}s" + confirm)

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> RunSummary:
        start = time.monotonic()
        with self._locked():
            self._recover_dead_trials()
            self._enqueue_baseline()
        done_before = len(measured(recorded(self.study)))
        self.reporter.started(StartInfo(
            self.study_name, redact(self.storage_url), self.hw, self.space, self.limit,
            self.budget_text(), done_before, self.out_dir, self.opts.trials, self.opts.timeout_s))
        deadline = start + self.opts.timeout_s if self.opts.timeout_s else None
        self._probe_machine()
        interrupted, stop_reason, twins_in_a_row = False, "", 0
        while True:
            remaining = deadline - time.monotonic() if deadline else None
            # Deciding whether to go on and claiming the next trial read the study and write it:
            # under the study lock, so a fleet's workers never both take the last trial.
            with self._locked():
                stop_reason = self._stop_reason(remaining, twins_in_a_row)
                trial = None if stop_reason else self._claim(self._ask())
            if trial is None:
                break
            reserve = self._confirmation_reserve(recorded(self.study))
            try:
                reused = self._one_trial(trial, None if remaining is None
                                         else remaining - reserve)
            except KeyboardInterrupt:
                interrupted, stop_reason = True, "interrupted"
                break
            except UpdateFinishedTrialError:
                # Another worker ended this trial, taking this one for dead (a heartbeat missed
                # under load): its retry runs elsewhere; this worker goes on.
                self.reporter.note(f"trial {trial.number} was ended by another worker, which "
                                   "took this one for dead; going on")
                reused = False
            twins_in_a_row = twins_in_a_row + 1 if reused else 0
        if not interrupted:
            try:
                self._confirm(deadline)
            except KeyboardInterrupt:
                interrupted, stop_reason = True, "interrupted during confirmation"
        self._close_nodes()
        summary = self._summary(time.monotonic() - start, interrupted, stop_reason)
        self.reporter.finished(summary)
        if interrupted:
            raise Interrupted(f"interrupted; study {self.study_name} is saved in "
                              f"{redact(self.storage_url)}: run the same command to resume")
        return summary

    def _stop_reason(self, remaining: float | None, twins_in_a_row: int) -> str:
        """Why this worker should stop now, or "" to run another trial (then queues the staged
        search's next config when it has one)."""
        self._recover_dead_trials()
        trials = recorded(self.study)
        # --trials counts measurements: a repeated config costs nothing and does not count.
        # Trials other workers are running now count too: they will most likely be measured.
        running = len(self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))
        if self.opts.trials is not None and len(measured(trials)) + running >= self.opts.trials:
            return f"reached {self.opts.trials} trials" + (
                f" ({running} of them still running on other workers)" if running else "")
        reserve = self._confirmation_reserve(trials)
        if remaining is not None and remaining - reserve < _shortest_useful_trial(trials):
            budget = format_duration(self.opts.timeout_s or 0)
            return f"time budget of {budget} spent" + (
                f" ({format_duration(reserve)} of it kept for confirmation)" if reserve else "")
        if twins_in_a_row >= MAX_TWINS_IN_A_ROW:
            return (f"the sampler proposed {twins_in_a_row} measured or ruled-out configs in a "
                    "row: the space looks exhausted")
        staging = self._stage(trials)
        obs = observations(trials)
        noise = noise_of(obs)
        if not staging and self.opts.patience is not None \
                and since_improvement(obs, noise) >= self.opts.patience:
            return (f"no trial beat the best by more than the noise ({100 * noise:.1f}%) in the "
                    f"last {self.opts.patience} trials")
        return ""

    def _claim(self, trial: optuna.Trial) -> optuna.Trial:
        """Mark a trial just asked as this worker's, under the study lock with the ask: a retried
        trial arrives with its dead worker's attributes (owner, last heartbeat mark), and another
        worker recovering dead workers' trials must not take it for that worker's."""
        trial.set_user_attr("worker", process_identity())
        if not isinstance(self.storage, BaseHeartbeat):
            # A retry carries the dead trial's last (stale) mark: beat now, not in a moment.
            trial.set_user_attr("alive_at", time.time())
        if trial.user_attrs.get("interrupted"):
            trial.set_user_attr("interrupted", False)
            frozen = self.storage.get_trial(trial._trial_id)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                trial.set_user_attr("retry_of",
                                    RetryHeartbeatStaleTrialCallback.retried_trial_number(frozen))
        return trial

    def _ask(self) -> optuna.Trial:
        with warnings.catch_warnings():
            # Optuna warns that heartbeats are meant for optimize(); we run the heartbeat
            # thread ourselves around the whole trial.
            warnings.filterwarnings("ignore", message="Heartbeat of storage")
            return self.study.ask()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The study lock (autotune.tuner.fleet): one worker at a time reads-then-writes it."""
        try:
            with study_lock(self.storage_url, self.study_name):
                yield
        except AutotuneError:
            raise
        except OSError as exc:
            raise StorageError(f"cannot take the study lock next to {redact(self.storage_url)} "
                               f"({one_line(exc)}); the directory must be writable") from None

    @contextlib.contextmanager
    def _devices(self) -> Iterator[tuple[list[int], dict[str, str]]]:
        """Hold this machine's devices for one trial: the CPU, or a free block of --nproc GPUs
        (with CUDA_VISIBLE_DEVICES set to it when the worker was not given one). Yields the
        GPUs' NVML indices and the environment the trial needs."""
        names, indices, env = trial_devices(self.hw.device, [g.index for g in self.hw.gpus],
                                            self.nproc)
        lock = DeviceLock(names, self.device_owner)
        start = time.time()
        with lock.hold(on_wait=self.reporter.note):
            self.held = {"devices": lock.names, "waited_s": round(time.time() - start, 3),
                         "start": time.time()}
            try:
                yield indices, env
            finally:
                self.held["end"] = time.time()

    @contextlib.contextmanager
    def _published(self, p: launch.TrialPlan) -> Iterator[None]:
        """For a trial across machines without a cluster launcher: publish it on the study while
        it runs, for the other nodes' ``autotune agent`` to start their part (tuner.agent)."""
        if self.nodes is None or self.nodes.template is not None:
            yield
            return
        self.study.set_user_attr(NODE_TRIAL, {**launch.published(p), "state": "running",
                                              "at": time.time()})
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                self.study.set_user_attr(NODE_TRIAL, {"id": p.rdzv_id, "state": "done",
                                                      "at": time.time()})

    def _with_other_nodes(self, p: launch.TrialPlan, raw: RawResult) -> RawResult:
        """A failed trial across machines started by agents, with its cause found on whichever
        node it happened: this node's ranks often only see a peer close the connection, while
        the rank that failed wrote its report on another machine. Its agent publishes that on
        the study (tuner.agent); this waits up to NODE_REPORT_WAIT_S for every agent's word."""
        local = raw.result
        failed = local is None or "failed_at" in local
        if self.nodes is None or self.nodes.template is not None or not failed \
                or raw.interrupted or raw.stopped or raw.timed_out or raw.killed_for_memory:
            return raw
        deadline = time.monotonic() + NODE_REPORT_WAIT_S
        while True:
            attrs = self.study.user_attrs  # read anew from the storage each time
            reports = [v for k, v in attrs.items() if k.startswith(f"{NODE_REPORT}:")
                       and isinstance(v, dict) and v.get("id") == p.rdzv_id]
            if len(reports) >= self.nodes.count - 1 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        cause = node_cause(local, [{**r["failure"], "host": r.get("host")} for r in reports
                                   if isinstance(r.get("failure"), dict)])
        return raw if cause is local else replace(raw, result=cause)

    def _close_nodes(self) -> None:
        """Tell the other nodes' agents that this run has ended."""
        if self.nodes is not None and self.nodes.template is None:
            with contextlib.suppress(Exception):
                self.study.set_user_attr(NODE_TRIAL, {"id": None, "state": "closed",
                                                      "at": time.time()})

    def _probe_machine(self) -> None:
        """The machine's measured peaks, for MFU and the diagnosis: the cached probe, else a
        probe now (seconds on a CPU; it counts against --timeout). A failed probe costs the
        run nothing but its MFU figures."""
        if not self.opts.probe:
            return
        from autotune.machine.probe import cached, probe, summary

        if cached(self.hw) is None:
            self.reporter.note("probing this machine once (peaks for MFU; cached per "
                               "fingerprint; `autotune probe` shows it)")
        try:
            with self._devices():  # another worker's trial would halve the peaks, and the reverse
                doc = probe(self.hw, workdir=self.out_dir)
        except Exception as exc:  # noqa: BLE001 - the study does not need it to run
            self.reporter.note(f"probe failed ({one_line(exc)}); no MFU in this run")
            return
        self.probe = summary(doc, self.hw.device)
        peaks = ", ".join(f"{k} {v:g}" for k, v in self.probe["peak_tflops"].items())
        self.reporter.note(f"probe ({doc.get('created')}): peak TFLOP/s {peaks or 'unknown'}"
                           + "".join(f"; {f}" for f in self.probe["flags"]))
        self.study.set_user_attr("probe", self.probe)

    def _stage(self, trials: list[FrozenTrial]) -> bool:
        """Queue the staged search's next config unless a trial is already waiting; returns
        whether the staged start is still going (queued or waiting)."""
        waiting = self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        if waiting:
            return any(t.user_attrs.get("stage") or t.user_attrs.get("baseline")
                       for t in waiting)
        obs = observations(trials)
        proposal = staged_next(self.space, self.baseline, obs, self._memory_model(obs))
        if proposal is None:
            return False
        running = [t.user_attrs.get("config") for t in
                   self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
        if proposal.config.to_dict() in running:
            return True  # another worker measures it now; this one samples meanwhile
        self.study.enqueue_trial(self.space.params_for(proposal.config),
                                 user_attrs={"stage": proposal.stage})
        return True

    def _memory_model(self, obs: list[Any] | None = None) -> MemoryModel:
        if obs is None:
            obs = observations(recorded(self.study))
        return MemoryModel(obs, self.hw.device, self.limit, self.opts.headroom)

    def _one_trial(self, trial: optuna.Trial, remaining: float | None) -> bool:
        """Measure (or reuse), record, export an asked trial. Returns whether a measurement was
        reused."""
        from optuna.storages._heartbeat import get_heartbeat_thread

        with get_heartbeat_thread(trial._trial_id, self.study._storage), \
                self._alive_marks(trial._trial_id):
            return self._run_trial(trial, remaining)

    @contextlib.contextmanager
    def _alive_marks(self, trial_id: int) -> Iterator[None]:
        """A heartbeat where the storage has none (a journal file): ``alive_at`` on the trial
        every HEARTBEAT_S seconds while it runs."""
        if isinstance(self.storage, BaseHeartbeat):
            yield
            return
        stop = threading.Event()

        def beat() -> None:
            while True:
                with contextlib.suppress(Exception):  # the trial may have just finished
                    self.storage.set_trial_user_attr(trial_id, "alive_at", time.time())
                if stop.wait(HEARTBEAT_S):
                    return

        thread = threading.Thread(target=beat, daemon=True, name="autotune-alive")
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def _run_trial(self, trial: optuna.Trial, remaining: float | None) -> bool:
        told = False
        self.held = {}
        try:
            config = self.space.suggest(trial, self.baseline)
            is_baseline = bool(trial.user_attrs.get("baseline"))
            trial.set_user_attr("config", config.to_dict())
            done = len(measured(recorded(self.study)))
            cut = remaining is not None and remaining < self.opts.trial_timeout_s
            timeout = max(1.0, min(self.opts.trial_timeout_s, remaining or math.inf))
            if not is_baseline:
                self._wait_for_running_twin(trial.number, config)
            twin = None if is_baseline else self._measured_twin(config)
            verdict = None if is_baseline or twin else self._memory_model().verdict(config)
            if verdict is not None:  # ruled out by the memory model: nothing runs
                self._record_predicted(trial, verdict[0], verdict[1])
                told = True
                self.reporter.trial_finished(view(self.storage.get_trial(trial._trial_id)),
                                             self._best_view())
                return True
            if twin is not None:  # reported once, when recorded: nothing runs
                attrs = twin.user_attrs
                m = Measurement(**{**attrs["measurement"], "stderr_tail": ""})
                trial.set_user_attr("reused_from", twin.number)
            else:
                self.reporter.trial_started(trial.number, done + 1, self.opts.trials, config,
                                            is_baseline, timeout)
                trial.set_user_attr("measure_settings", self._measure_settings())
                m = self._measure(trial, config, timeout, prune=not is_baseline)
                m = self._remeasure_if_promising(trial, config, m, remaining)
                if cut and m.ended_by == TRIAL_TIMEOUT and not trial.user_attrs.get("budget_cut"):
                    # The run's budget ended this trial, not the config's speed: not a result,
                    # measured again once by the next run (twice cut: it is a real timeout).
                    m = replace(m, status="error", reason="stopped by the run's --timeout",
                                ended_by=BUDGET)
            self._record(trial, config, m)
            told = True
            if m.ended_by == INTERRUPTED:
                raise KeyboardInterrupt
            self._export()
            trials = recorded(self.study)
            best = pick_best(trials, self.limit)
            if m.is_result:
                self.reporter.trial_finished(
                    view(self.study._storage.get_trial(trial._trial_id)),
                    view(best) if best else None)
            return twin is not None
        finally:
            if not told:
                with contextlib.suppress(Exception):
                    trial.set_user_attr("interrupted", True)
                    self.study.tell(trial, state=TrialState.FAIL)

    def _best_view(self) -> TrialView | None:
        best = pick_best(recorded(self.study), self.limit)
        return view(best) if best else None

    def _record_predicted(self, trial: optuna.Trial, reason: str, peak: float | None) -> None:
        trial.set_user_attr("status", "pruned")
        trial.set_user_attr("reason", reason)
        trial.set_user_attr("predicted", True)
        trial.set_user_attr("measurement", {
            "status": "pruned", "reason": reason, "peak_memory_bytes": 0, "wall_s": 0.0,
            "windows": [], "predicted_peak_memory_bytes": None if peak is None else int(peak)})
        trial.set_user_attr("memory_limit_bytes", self.limit)
        # Infeasible for the sampler, like an OOM: its constraint is the predicted excess.
        trial.set_constraint("memory", max(1.0, (peak or 0.0) - self.limit))
        self.study.tell(trial, state=TrialState.PRUNED)

    def _measured_twin(self, config: Config) -> FrozenTrial | None:
        """An earlier trial of exactly this config, measured with the same settings: its outcome
        (ok, oom, timeout or error) is reused, not re-run. TPE ignores failed trials and may
        propose them again."""
        for t in recorded(self.study):
            if t.user_attrs.get("reused_from") is None \
                    and t.user_attrs.get("config") == config.to_dict() \
                    and t.user_attrs.get("measure_settings") == self._measure_settings():
                return t
        return None

    def _wait_for_running_twin(self, number: int, config: Config) -> None:
        """Wait while another worker measures exactly this config: its result is then reused,
        so a fleet never measures one config twice at the same time."""
        told = False
        while True:
            busy = [t.number for t in self.study.get_trials(deepcopy=False,
                                                            states=(TrialState.RUNNING,))
                    if t.number != number and t.user_attrs.get("config") == config.to_dict()
                    and t.user_attrs.get("measure_settings") == self._measure_settings()
                    and t.user_attrs.get("reused_from") is None]
            if not busy:
                return
            if not told:
                # Its worker may be dead: found like any other dead worker's trial.
                with self._locked():
                    self._recover_dead_trials()
                self.reporter.note(f"trial {number}: another worker is measuring this config "
                                   f"(trial {busy[0]}); waiting to reuse its result")
                told = True
            time.sleep(RUNNING_TWIN_POLL_S)

    def _measure_settings(self) -> dict[str, Any]:
        return {k: self.opts.measure[k] for k in sorted(self.opts.measure)}

    def _remeasure_if_promising(self, trial: optuna.Trial, config: Config, m: Measurement,
                                remaining: float | None) -> Measurement:
        """A config ended early as too slow to measure whose rough rate (from its first, slowest
        step) already beats the best is measured again with room for warm-up and one window,
        within the hard trial limit: big batches are often the fastest and must not be lost to
        a measuring budget sized for ordinary steps."""
        best = pick_best(recorded(self.study), self.limit)
        rough = m.rough_samples_per_sec
        if m.ended_by != TOO_SLOW or not rough or best is None:
            return m
        if rough <= best.user_attrs["measurement"]["samples_per_sec"]:
            return m
        step_s = config.samples_per_step / rough
        room = min(self.opts.trial_timeout_s, remaining or math.inf)
        budget = 3.5 * step_s  # two warm-up steps and one window, with slack
        if budget * 1.25 + 15 > room:
            return m
        trial.set_user_attr("remeasured", {"first": m.reason, "max_seconds": budget})
        return self._measure(trial, config, room, max_seconds=budget)

    def _measure(self, trial: optuna.Trial, config: Config, timeout: float,
                 max_seconds: float | None = None, prune: bool = False) -> Measurement:
        measure = dict(self.opts.measure)
        if max_seconds is not None:
            measure["max_seconds"] = max_seconds
        best = self._best_view() if prune and self.opts.prune else None
        return self._run_config(config, self.out_dir / "trials" / f"{trial.number:04d}",
                                timeout, measure, best.samples_per_sec if best else None)

    def _run_config(self, config: Config, workdir: Path, timeout: float,
                    measure: dict[str, Any], prune_below_best: float | None = None,
                    report: bool = True) -> Measurement:
        """One trial process (or torchrun group) for ``config``; with ``prune_below_best``, it
        is stopped once its first windows are all clearly below that rate."""
        rates: list[float] = []

        def on_event(event: dict[str, Any]) -> None:
            if event.get("event") == "window":
                rates.append(float(event["samples_per_sec"]))
            if report:
                self.reporter.trial_event(event)

        flops = self.study.user_attrs.get("flops")
        with self._devices() as (gpus, env):
            spec = TrialSpec(
                self.workload_spec, config, self.hw.device, MeasureSettings.from_dict(measure),
                memory_limit_bytes=self.limit, address_space_bytes=self.opts.address_space_bytes,
                flops_per_sample=(flops or {}).get("per_sample"),
                flops_source=(flops or {}).get("source"), count_flops=flops is None)
            p = launch.plan(
                spec, workdir=workdir, timeout_s=timeout, extra_env=env, nodes=self.nodes,
                rdzv_id=f"{self.study_name}-{workdir.parent.name}-{workdir.name}")
            monitor = GpuMonitor(gpus) if self.hw.device == "cuda" else None
            with self._published(p):
                raw = launch.execute(
                    p, on_event=on_event,
                    should_stop=(lambda: prune_reason(rates, prune_below_best))
                    if prune_below_best else None, monitor=monitor)
            m = classify(self._with_other_nodes(p, raw), self.hw.device)
        if flops is None and m.flops_source == COUNTED:
            # Counted once per study; every later trial is measured against the same figure.
            self.study.set_user_attr("flops", {"per_sample": m.flops_per_sample,
                                               "source": COUNTED})
        return with_efficiency(m, config, self.hw.device, self.probe)

    def _record(self, trial: optuna.Trial, config: Config, m: Measurement) -> None:
        data = m.to_dict()
        if m.ok:
            data["stderr_tail"] = ""  # keep the storage small; failures keep theirs
        trial.set_user_attr("status", m.status)
        trial.set_user_attr("reason", m.reason)
        trial.set_user_attr("measurement", data)
        trial.set_user_attr("memory_limit_bytes", self.limit)
        trial.set_user_attr("overhead_share", m.overhead_share())
        if self.held:
            trial.set_user_attr("devices", self.held)  # which, and when (wall clock): the lock
        if not m.is_result:
            # Not a result: not counted, and measured again by the next run.
            trial.set_user_attr("interrupted", True)
            self.study.tell(trial, state=TrialState.FAIL)
            self.study.enqueue_trial(trial.params, user_attrs={
                "retry_of": trial.number, "baseline": bool(trial.user_attrs.get("baseline")),
                "budget_cut": m.ended_by == BUDGET})
            return
        if m.status in ("ok", "oom", "pruned"):
            # <= 0 is feasible. An OOM is infeasible whatever peak was sampled before it died.
            over = float(m.peak_memory_bytes - self.limit)
            trial.set_constraint("memory", max(over, 1.0) if m.status == "oom" else over)
        if m.status == "pruned":
            # Stopped for being clearly slower than the best: its windows tell the sampler how
            # much slower.
            for i, w in enumerate(m.windows):
                trial.report(w["samples"] / w["seconds"], i)
            self.study.tell(trial, state=TrialState.PRUNED)
        elif m.ok:
            for i, w in enumerate(m.windows):
                trial.report(w["samples"] / w["seconds"], i)
            self.study.tell(trial, m.samples_per_sec)
        elif m.status == "oom":
            self.study.tell(trial, 0.0)
        elif m.status == "timeout":
            # Too slow to measure: pruned, with the rough rate as the sampler's only hint.
            if m.rough_samples_per_sec:
                trial.report(m.rough_samples_per_sec, 0)
            self.study.tell(trial, state=TrialState.PRUNED)
        else:
            self.study.tell(trial, state=TrialState.FAIL)

    # -- confirmation ---------------------------------------------------------------------------

    def _confirm_measure(self) -> dict[str, Any]:
        """Longer windows than a trial's (twice as long), within the same measuring budget."""
        return MeasureSettings.from_dict(self.opts.measure).with_longer_windows().to_dict()

    def _candidates(self, trials: list[FrozenTrial]) -> list[Candidate]:
        """The top configs by their trial (distinct, ok, within the limit) and the baseline."""
        ok = [t for t in measured(trials) if t.user_attrs.get("status") == "ok"
              and t.user_attrs["measurement"]["peak_memory_bytes"] <= self.limit]
        ok.sort(key=lambda t: -t.user_attrs["measurement"]["samples_per_sec"])
        top = ok[:self.opts.confirm_top]
        base = pick_baseline(trials)
        if base is not None and base.number not in {t.number for t in top}:
            top.append(base)
        return [Candidate(t.number, Config.from_dict(t.user_attrs["config"]),
                          is_baseline=bool(t.user_attrs.get("baseline"))) for t in top]

    def _confirmation_plan(self, trials: list[FrozenTrial],
                           left: float | None) -> tuple[list[Candidate], int] | str:
        return plan_confirmation(self._candidates(trials), _walls(trials),
                                 self.opts.confirm_rounds, left)

    def _confirmation_reserve(self, trials: list[FrozenTrial]) -> float:
        """Seconds of the --timeout kept for the confirmation: what the largest plan within
        CONFIRM_SHARE of the budget needs; nothing when even the smallest does not fit there."""
        if self.opts.confirm_top <= 0 or not self.opts.timeout_s:
            return 0.0
        share = CONFIRM_SHARE * self.opts.timeout_s
        plan = self._confirmation_plan(trials, share)
        if isinstance(plan, str):
            return 0.0
        return min(share, confirmation_seconds(plan[0], _walls(trials), plan[1]))

    def _confirm(self, deadline: float | None) -> None:
        """Re-measure the top configs and the baseline interleaved (A B C A B C ...) with longer
        windows, and record the decision on the study; the profile is exported from it."""
        trials = recorded(self.study)
        if self.opts.confirm_top <= 0 or confirmed(self.study, trials) is not None:
            return
        plan = self._confirmation_plan(
            trials, None if deadline is None else deadline - time.monotonic())
        if isinstance(plan, str):
            self.confirm_skipped = plan
            return
        cands, rounds = plan
        measure = self._confirm_measure()
        done = 0
        for r in range(rounds):
            # A round counts only when every config ran in it: a round cut by the --timeout would
            # compare one config's fresh run with another's missing one.
            results = []
            for c in cands:
                timeout = self.opts.trial_timeout_s
                if deadline is not None:
                    timeout = min(timeout, deadline - time.monotonic())
                if timeout < 1.0:
                    break
                m = self._run_config(c.config, self.out_dir / "confirm" / f"{r + 1}-{c.number:04d}",
                                     timeout, measure, report=False)
                if m.ended_by == INTERRUPTED:
                    raise KeyboardInterrupt
                if m.ended_by == TRIAL_TIMEOUT and timeout < self.opts.trial_timeout_s:
                    break  # the run's budget ended it, not the config
                results.append((c, m))
                self.reporter.confirming(r, rounds, c, m)
            if len(results) < len(cands):
                break
            for c, m in results:
                if m.ok and m.samples_per_sec:
                    c.rates.append(m.samples_per_sec)
                    c.peaks.append(m.peak_memory_bytes)
                    c.window_cvs.append(m.spread_cv or 0.0)
                else:
                    c.failures.append(f"round {r + 1}: {m.status}: {m.reason}")
            done += 1
        if done < 2:
            self.confirm_skipped = (f"the --timeout ended the confirmation after {done} complete "
                                    "round(s); two are needed for a spread")
            return
        rounds = done
        decision = decide(cands, self.limit, self.opts.headroom)
        self.study.set_user_attr("confirmation", {
            "measured_trials": len(measured(trials)), "rounds": rounds,
            "measure": {k: measure[k] for k in sorted(measure)},
            "candidates": [c.to_dict() for c in cands], "decision": decision.to_dict(),
            "created": datetime.now(UTC).isoformat(timespec="seconds")})

    # -- results --------------------------------------------------------------------------------

    def _export(self) -> Profile | None:
        """Write studies/<study>/profile.yaml from the confirmed winner, else the best trial."""
        trials = recorded(self.study)
        best = confirmed_winner(self.study, trials, self.limit)
        if best is None:
            return None
        profile = build_profile(self.study, best, pick_baseline(trials), trials, self.limit,
                                redact(self.storage_url), self.opts.global_batch,
                                confirmed(self.study, trials))
        profile.save(self.out_dir / "profile.yaml")
        if self.study.user_attrs.get("diagnosis") != profile.diagnosis:
            self.study.set_user_attr("diagnosis", profile.diagnosis)  # for the dashboard
        return profile

    def _summary(self, wall_s: float, interrupted: bool, stop_reason: str) -> RunSummary:
        trials = recorded(self.study)
        best, base = confirmed_winner(self.study, trials, self.limit), pick_baseline(trials)
        profile = self._export()
        path = self.out_dir / "profile.yaml" if profile else None
        conf = confirmed(self.study, trials)
        # The profile's speedup is the confirmation's side-by-side ratio when the baseline ran
        # in it.
        side_by_side = conf is not None and any(c["baseline"] and c["median"]
                                                for c in conf["candidates"])
        speedup = profile.speedup if profile and side_by_side else None
        return RunSummary(self.study_name, redact(self.storage_url), self.out_dir, path,
                          view(best) if best else None, view(base) if base else None,
                          [view(t) for t in trials], wall_s, interrupted, stop_reason,
                          confirmation=conf, confirmed_speedup=speedup,
                          confirm_skipped=self.confirm_skipped, dashboard=self._dashboard(),
                          diagnosis=list(profile.diagnosis) if profile else [])

    def _dashboard(self) -> str:
        """Draw studies/<study>/dashboard.html again; failing to draw never fails the run."""
        from autotune.report import write_dashboard

        try:
            return str(write_dashboard(self.study, self.out_dir / "dashboard.html"))
        except Exception as exc:  # noqa: BLE001 - the study and the profile are already saved
            return f"not written ({one_line(exc)})"


def _walls(trials: list[FrozenTrial]) -> dict[int, float]:
    return {t.number: float(t.user_attrs["measurement"].get("wall_s") or 0.0) for t in trials}


def _shortest_useful_trial(trials: list[FrozenTrial]) -> float:
    """Starting a trial with less time left than half the typical ok trial wastes the time."""
    walls = sorted(t.user_attrs["measurement"]["wall_s"] for t in trials
                   if t.user_attrs.get("status") == "ok"
                   and t.user_attrs.get("reused_from") is None)
    return max(5.0, 0.5 * walls[len(walls) // 2]) if walls else 5.0



def run(opts: RunOptions, reporter: Reporter) -> RunSummary:
    """Run (or resume) a study and export its profile; see ``RunOptions`` for the knobs."""
    return Runner(opts, reporter).run()


