"""Measuring one config, from the tuner's side: hold this machine's devices, plan the trial, run
it (here, or through a cluster engine's executor on its slot's nodes), watch its GPUs, classify
what came back and add its efficiency figures. Search trials, the confirmation's rounds and
nothing else go through here."""

from __future__ import annotations

import contextlib
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, cast

import optuna

from autotune.config.domains import Choices
from autotune.config.knobs import Config, env_for
from autotune.config.narrowing import NarrowedSpace
from autotune.errors import one_line
from autotune.machine.hardware import Hardware
from autotune.machine.monitor import GpuMonitor
from autotune.profile import Profile
from autotune.profile.documents import ProbeDoc
from autotune.trial import launch
from autotune.trial.command import Command
from autotune.trial.executors import Executor
from autotune.trial.launch import Nodes
from autotune.trial.measurement import Measurement, classify
from autotune.trial.progress import OnEvent, ProgressEvent
from autotune.trial.reports import finite_number
from autotune.trial.sentinel import precisions_of
from autotune.trial.spec import COUNTED, MeasureSettings, TrialSpec
from autotune.tuner import fleet, record
from autotune.tuner.diagnosis import with_efficiency
from autotune.tuner.pruning import prune_reason
from autotune.workloads import WorkloadSpec


class MeasureTrial(Protocol):
    """How a run measures one config: ``Measurer.run`` (a real trial process), or what a test
    or the search benchmark injects in its place (``autotune.testing.replay``)."""

    def __call__(self, config: Config, workdir: Path, timeout: float, settings: MeasureSettings,
                 prune_below: float | None = None,
                 on_event: OnEvent | None = None) -> Measurement: ...


def sentinel_precisions(space: NarrowedSpace, baseline: Config) -> tuple[str, ...]:
    """The precisions the study's configs run in, for the sentinel to read in each trial: the
    searched amp values, the fixed one and the baseline's."""
    domain = space.searched.get("amp")
    amps = list(domain.values) if isinstance(domain, Choices) else []
    fixed = space.fixed.get("amp")
    return precisions_of([*amps, baseline.amp, *([fixed[0]] if fixed else [])])


def compile_cache(workdir: Path) -> Path:
    """The study's torch.compile cache, for a trial folder ``<study>/trials/NNNN``."""
    return workdir.parent.parent / "compile-cache"


@dataclass
class Measurer:
    """What every trial of a run shares: the machine, the workload, the ranks, the memory
    limit, the study (for its FLOPs figure) and the probe's peaks; with an ``executor``, the
    slot of the engine's nodes its trials run on."""

    hw: Hardware
    workload: WorkloadSpec
    nproc: int
    nodes: Nodes | None
    limit: int
    study: optuna.Study
    owner: str  # who holds a device, as a worker waiting for it is told
    on_wait: Callable[[str], None]
    address_space_bytes: int | None = None
    command: Command | None = None  # the user's script, run as each trial (autotune run -- CMD)
    probe: ProbeDoc | None = None  # the probe's summary, once the run has read it
    held: record.DevicesHeld = field(default_factory=record.DevicesHeld)  # the last trial's
    executor: Executor | None = None  # a cluster engine (``trial.executors``); None: here
    slot: int = 0  # which of the executor's node sets this measurer's trials take
    interrupt: threading.Event | None = None  # set: end the trial as Ctrl-C would (threads)
    sentinel: tuple[str, ...] = ()  # the precisions the sentinel reads in each trial

    @contextlib.contextmanager
    def devices(self) -> Iterator[tuple[list[int], dict[str, str]]]:
        """Hold this machine's devices for one trial: the CPU, or a free block of ``nproc``
        GPUs (with CUDA_VISIBLE_DEVICES set to it when the worker was not given one). Yields
        the GPUs' NVML indices and the environment the trial needs. On a cluster engine the
        engine binds the devices of its nodes: nothing is held here."""
        if self.executor is not None:
            self.held = {"devices": [f"{self.executor.name} slot {self.slot}"], "waited_s": 0.0,
                         "start": time.time()}
            try:
                yield [], {}
            finally:
                self.held["end"] = time.time()
            return
        names, indices, env = fleet.trial_devices(self.hw.device,
                                                  [g.index for g in self.hw.gpus], self.nproc)
        lock = fleet.DeviceLock(names, self.owner)
        start = time.time()
        with lock.hold(on_wait=self.on_wait):
            self.held = {"devices": lock.names, "waited_s": round(time.time() - start, 3),
                         "start": time.time()}
            try:
                yield indices, env
            finally:
                self.held["end"] = time.time()

    def run(self, config: Config, workdir: Path, timeout: float, settings: MeasureSettings,
            prune_below: float | None = None,
            on_event: OnEvent | None = None) -> Measurement:
        """One trial process (or torchrun group) for ``config``; with ``prune_below`` (the best
        rate so far), it is stopped once its first windows are all clearly below it."""
        rates: list[float] = []
        one_step: list[bool] = []  # whether each window was one whole step

        def event(e: ProgressEvent) -> None:
            seen = window_event(e, config.samples_per_step, settings.min_window_s)
            if seen is not None:
                rates.append(seen[0])
                one_step.append(seen[1])
            if on_event is not None:
                on_event(e)

        # A script's FLOPs are not counted (autotune does not hold its model): no MFU.
        flops = record.read_facts(self.study).flops
        spec = TrialSpec(self.workload, config, self.hw.device, settings,
                         memory_limit_bytes=self.limit,
                         address_space_bytes=self.address_space_bytes,
                         flops_per_sample=flops.get("per_sample"),
                         flops_source=flops.get("source"),
                         count_flops=not flops and self.command is None,
                         sentinel=self.sentinel)
        with self.devices() as (gpus, env):
            if config.compile != "off":
                # One Inductor cache per study (next to its trials): a config compiled once
                # compiles in a fraction of the time in every later trial.
                env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(compile_cache(workdir))}
            if self.command is not None:
                p = launch.plan_command(spec, self.command, workdir=workdir, timeout_s=timeout,
                                        profile=self._candidate(config, workdir).to_yaml(),
                                        extra_env=env)
            else:
                p = launch.plan(spec, workdir=workdir, timeout_s=timeout, extra_env=env,
                                nodes=self.nodes,
                                rdzv_id=f"{self.study.study_name}-{workdir.parent.name}-"
                                        f"{workdir.name}")
                if self.executor is not None:
                    p = self.executor.plan(p, self.slot, f"{workdir.parent.name}-{workdir.name}",
                                           zlib.crc32(str(workdir).encode()))
            # The GPUs of an engine's nodes are not this machine's to watch.
            monitor = GpuMonitor(gpus) if self.hw.device == "cuda" and gpus else None
            raw = launch.execute(p, on_event=event, monitor=monitor,
                                 poll_s=launch.poll_interval(settings.min_window_s),
                                 should_stop=(lambda: prune_reason(
                                     rates, prune_below, one_step_windows=all(one_step)))
                                 if prune_below else None, interrupt=self.interrupt)
            m = classify(raw, self.hw.device)
        if not flops and m.flops_source == COUNTED:
            # Counted once per study; every later trial is measured against the same figure.
            record.write_flops(self.study, m.flops_per_sample, COUNTED)
        return with_efficiency(m, config, self.hw.device, self.probe)

    def _candidate(self, config: Config, workdir: Path) -> Profile:
        """The config as the profile a script's trial loads (``AUTOTUNE_PROFILE``): like an
        exported one, marked as a candidate with nothing measured yet."""
        return Profile(
            workload=dict(record.read_facts(self.study).workload), config=config,
            env=env_for(config), result={"samples_per_sec": 0.0}, baseline={}, speedup=None,
            fingerprint=self.hw.fingerprint(),
            provenance={"study": self.study.study_name, "trial": workdir.name,
                        "candidate": True},
            notes=["the candidate config of one trial, written before it ran: not a result"])

    def read_probe(self, workdir: Path, note: Callable[[str], None]) -> None:
        """The machine's measured peaks, for MFU and the diagnosis: the cached probe, else a
        probe now (seconds on a CPU; it counts against --timeout), under the device lock
        (another worker's trial would halve the peaks, and the reverse). A failed probe costs
        the run nothing but its MFU figures."""
        from autotune.machine.probe import cached, contended_line, probe, stale_cache, summary

        if cached(self.hw) is None:
            stale = stale_cache(self.hw)
            note("probing this machine "
                 + (f"again: the cached probe is not used, {stale}" if stale else "once")
                 + " (peaks for MFU; cached per fingerprint; `autotune probe` shows it)")
        try:
            with self.devices():
                doc = probe(self.hw, workdir=workdir)
        except Exception as exc:  # noqa: BLE001 - the study does not need it to run
            note(f"probe failed ({one_line(exc)}); no MFU in this run")
            return
        found = self.probe = cast(ProbeDoc, summary(doc, self.hw.device))
        peaks = ", ".join(f"{k} {v:g}" for k, v in found["peak_tflops"].items())
        note(f"probe ({doc.get('created')}): peak TFLOP/s {peaks or 'unknown'}"
             + "".join(f"; {f}" for f in found["flags"]))
        if doc.get("contended"):
            note(contended_line(doc))
        record.write_probe(self.study, found)


def window_event(e: ProgressEvent, samples_per_step: int,
                 min_window_s: float) -> tuple[float, bool] | None:
    """A progress event's window, as pruning reads it: its samples/s and whether it was one
    whole step; None for any other event, or one whose numbers are not finite numbers (a
    script's trial folder is the script's to write: what is read there is checked)."""
    rate = finite_number(e, "samples_per_sec") if e.get("event") == "window" else None
    if rate is None:
        return None
    return rate, ((finite_number(e, "samples") or 0.0) <= samples_per_step
                  and (finite_number(e, "seconds") or 0.0) >= min_window_s)
