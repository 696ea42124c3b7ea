"""``autotune agent``: this machine's part of trials that span machines, without an ssh of ours.

A tuner started with ``--nnodes N --rdzv-endpoint HOST:PORT`` (and no ``--launcher``) starts its
own node's torchrun agent for each trial and publishes the trial on the study (the
``node_trial`` attribute: spec, environment, torchrun's flags, rendezvous id). ``autotune agent``
runs on each other node against the same storage: it polls that attribute, starts its node's
torchrun agent for each new trial with the same flags, and ends it when the tuner has ended the
trial (or at the trial's timeout). torchrun's c10d rendezvous does the rest. The tuner's node
writes the result, so the nodes need not share a file system.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna

from autotune.config.knobs import TUNED_ENV
from autotune.errors import UsageError
from autotune.machine.hardware import compare_fingerprints, detect, hostname, process_identity
from autotune.trial import launch
from autotune.trial.merge import node_failure
from autotune.tuner import record
from autotune.tuner.fleet import DeviceLock, trial_devices
from autotune.tuner.record import NODE_REPORT
from autotune.tuner.storage import open_storage, redact, study_lock
from autotune.workloads import builtin_workloads

POLL_S = 0.5


def serve(storage_url: str, study_name: str, out_dir: Path, say: Callable[[str], None],
          wait_s: float = 600.0, allow_workload: str | None = None) -> int:
    """Join the study's trials until its tuner closes the run; returns the trials joined.

    Waits up to ``wait_s`` for the study to exist (the tuner may start later). Runs only what
    this command line allows (``check_published``): the study's storage is shared, and what
    is published there is not trusted to run code."""
    storage = open_storage(storage_url)
    started = time.time()
    study = _wait_for_study(storage, study_name, started + wait_s, say, storage_url)
    stored = record.read_facts(study).fingerprint
    if not isinstance(stored, dict) or not stored:
        raise UsageError(f"study {study_name} has no hardware fingerprint, so `autotune run` did "
                         "not create it: the agent serves only studies its tuner made")
    hw = detect()
    match = compare_fingerprints(stored, hw.fingerprint())
    if match.differs:
        raise UsageError(f"study {study_name} was measured on other hardware "
                         f"({'; '.join(match.differs)}); measurements are not comparable: run "
                         "the agent on a machine like the study's")
    if match.unverified:
        raise UsageError(f"study {study_name} was made by an earlier autotune whose fingerprint "
                         f"did not record the CPU's {match.unverified_words()}, so the agent "
                         "cannot tell whether this machine has the study's CPU: start its tuner "
                         f"(autotune run --study {study_name} ...) first, which records its CPU "
                         "on the study, then the agent")
    say(f"agent on {hostname()} serving study {study_name} in {redact(storage_url)}")
    joined: set[str] = set()
    while True:
        doc = record.node_trial(study)
        if doc.get("state") == "closed" and doc.get("at", 0) > started:
            say(f"the tuner's run ended; {len(joined)} trial(s) joined")
            return len(joined)
        if doc.get("state") == "running" and doc.get("id") not in joined \
                and doc.get("at", 0) > started - 60:
            joined.add(doc["id"])
            why = check_published(doc, allow_workload)
            if why:
                say(f"trial {doc.get('id')}: not run: {why}")
            else:
                _join(study, doc, out_dir, say, hw.device, [g.index for g in hw.gpus])
        time.sleep(POLL_S)


# What a tuner publishes for its agents, beyond these, is not autotune's: refused.
_PUBLISHED_ENV = (*TUNED_ENV, "PYTHONUNBUFFERED", "TOKENIZERS_PARALLELISM")
_TORCHRUN_FLAG = re.compile(r"--(nnodes|nproc-per-node|max-restarts)=\d+|--rdzv-backend=c10d|"
                            r"--rdzv-endpoint=[A-Za-z0-9_.:\[\]-]+|--rdzv-id=[A-Za-z0-9_.-]+")


def check_published(doc: dict[str, Any], allow_workload: str | None) -> str | None:
    """Why the agent must not run a published trial, or None: its workload is neither built in
    nor the one this agent was started for (--allow-workload), its environment holds what
    autotune does not set, or its torchrun flags are not the ones autotune passes."""
    spec = (doc.get("spec") or {}).get("workload") or {}
    name = str(spec.get("spec") or "")
    if name not in builtin_workloads() and name != allow_workload:
        return (f"workload {name!r} is not built in; start the agent with --allow-workload "
                f"{name!r} if you trust that code")
    env = doc.get("env") or {}
    foreign = [k for k in env if k not in _PUBLISHED_ENV]
    if foreign or not all(isinstance(v, str) for v in env.values()):
        return f"its environment sets {', '.join(map(repr, foreign)) or 'non-strings'}"
    flags = doc.get("torchrun") or []
    if not all(isinstance(f, str) and _TORCHRUN_FLAG.fullmatch(f) for f in flags):
        return f"its torchrun flags {flags!r} are not autotune's"
    return None


def _wait_for_study(storage: Any, name: str, deadline: float, say: Callable[[str], None],
                    url: str) -> optuna.Study:
    told = False
    while True:
        try:
            # Under the study lock, as the tuner creates the study and its attributes: a study
            # found here has its fingerprint, so the hardware check below never skips.
            with study_lock(url, name):
                return optuna.load_study(study_name=name, storage=storage)
        except KeyError:
            if time.time() > deadline:
                raise UsageError(f"no study {name!r} in {redact(url)} appeared; start the "
                                 "tuner with the same --storage and --study") from None
            if not told:
                say(f"waiting for study {name} to be created by its tuner")
                told = True
            time.sleep(POLL_S * 2)


def _join(study: optuna.Study, doc: dict[str, Any], out_dir: Path, say: Callable[[str], None],
          device: str, gpus: list[int]) -> None:
    trial_id = str(doc["id"])
    workdir = out_dir / re.sub(r"[^A-Za-z0-9_.-]", "_", trial_id)
    per_node = next((int(f.split("=", 1)[1]) for f in doc["torchrun"]
                     if f.startswith("--nproc-per-node=")), 1)
    # This node's own free block of GPUs, as a tuner picks one for its node.
    names, _, env = trial_devices(device, gpus, per_node)
    p = launch.from_published(doc, workdir, extra_env=env)
    lock = DeviceLock(names, f"autotune agent pid {process_identity()['pid']} on {hostname()}")
    last = [0.0]

    def ended() -> str | None:  # the tuner ended the trial (or the run): so does this node
        now = time.monotonic()
        if now - last[0] < 1.0:
            return None
        last[0] = now
        with contextlib.suppress(Exception):
            current = record.node_trial(study)
            if current.get("id") != trial_id or current.get("state") != "running":
                return "the tuner ended the trial"
        return None

    say(f"trial {trial_id}: starting this node's {per_node} rank(s)")
    with lock.hold(on_wait=say):
        raw = launch.execute(p, should_stop=ended)
    if raw.interrupted:  # Ctrl-C or SIGTERM: this node's ranks are ended; so is the agent
        raise KeyboardInterrupt
    how = "ended with the tuner's trial" if raw.stopped else (
        "timed out" if raw.timed_out else f"exit code {raw.returncode}")
    failure = node_failure(raw, device)
    if failure is not None:
        how += f": {(failure.get('doc') or failure.get('death') or {}).get('reason')}"
    say(f"trial {trial_id}: {how} (log: {p.stderr_path})")
    # How this part ended, for the tuner's record of the trial: the failed rank may be here.
    with contextlib.suppress(Exception):
        study.set_user_attr(f"{NODE_REPORT}:{hostname()}:{process_identity()['pid']}",
                            {"id": trial_id, "host": hostname(), "failure": failure,
                             "at": time.time()})
