"""A trial's launch as data: ``plan`` builds it, ``trial.launch.execute`` runs it.

Pure: tests assert on a plan without starting anything. A one-rank trial is one process
(``python -m autotune.trial.bench``); a trial of N ranks is torchrun with a standalone rendezvous (a
c10d store on a free port) starting N such processes, nccl on CUDA and gloo on CPU; a trial
across machines meets at a c10d endpoint, its nodes started by a cluster launcher template, or
by an executor (``trial.executors``: Slurm job steps, Ray tasks), which turns this machine's plan
into its engine's. A script's trial runs the user's command as typed (``plan_command``).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.bootstrap import MODE_ENV, TRIAL, trainer_env
from autotune.bootstrap.memory import LIMIT_ENV
from autotune.config.knobs import env_for
from autotune.steps import SENTINEL_ENV
from autotune.trial import sentinel
from autotune.trial.command import Command, command_env
from autotune.trial.processes import TRIAL_TOKEN, new_token
from autotune.trial.spec import TrialSpec


@dataclass(frozen=True)
class Nodes:
    """A trial across machines started by a launcher ``template`` (``--launcher``, such as
    ``mpirun ... {cmd}``), which starts the torchrun agent on every node; the ``count`` nodes
    meet at the c10d rendezvous ``endpoint``. The trial's files must be on a file system all
    nodes share, since global rank 0 writes the result wherever it runs."""

    count: int
    endpoint: str
    template: str


@dataclass(frozen=True)
class TrialPlan:
    argv: tuple[str, ...]
    env: dict[str, str]  # set on top of the tuner's environment
    timeout_s: float
    spec: dict[str, Any]  # TrialSpec.to_json(), written to spec_path before the start
    spec_path: str
    result_path: str
    progress_path: str
    stderr_path: str
    memory_limit_bytes: int | None = None  # enforced by the launcher on CPU (tree memory)
    address_space_bytes: int | None = None  # RLIMIT_AS for the trial process, if set
    device: str = "cpu"
    torchrun: tuple[str, ...] = ()  # torchrun's flags, for a multi-rank trial
    rdzv_id: str | None = None  # the rendezvous of a trial across machines
    script: str | None = None  # the user's script a command trial runs (``trial.command``)
    profile: str | None = None  # the candidate profile's YAML, for a command trial to load
    # An executor's trial (``trial.executors``): the engine that runs it (its client is the
    # process ``execute`` starts; the results come back on its stdout) and the trial's name there.
    engine: str | None = None
    step: str | None = None


def _files(workdir: Path) -> dict[str, str]:
    """Where a trial's spec, result, progress events and output go."""
    return {k: str(workdir / f"{k}.{ext}") for k, ext in
            (("spec", "json"), ("result", "json"), ("progress", "jsonl"), ("stderr", "log"))}


def plan(spec: TrialSpec, *, workdir: Path, timeout_s: float, python: str = sys.executable,
         extra_env: Mapping[str, str] | None = None, nodes: Nodes | None = None,
         rdzv_id: str | None = None) -> TrialPlan:
    """The trial launch as data: argv, environment and files. Starts nothing.

    ``spec.config.world_size`` > 1 starts that many ranks through torchrun on this machine, or,
    with ``nodes``, ``world_size / nodes.count`` on each of the nodes (rendezvous ``rdzv_id``).
    """
    # The trial applies the address-space limit and its tie to the tuner itself, first thing
    # in trial.bench.main: a preexec_fn is unsafe once the tuner has threads (Optuna's heartbeat).
    config, device = spec.config, spec.device
    workdir = Path(os.path.abspath(workdir))  # a trial that changes directory still finds it
    env = {
        # Set before torch is imported in the trial: knob env (NCCL_*) and quiet, honest defaults.
        **env_for(config),
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",  # tokenizers' own threads would fight loader workers
        **dict(extra_env or {}),
    }
    files = _files(workdir)
    # Every process of the trial inherits this: how execute finds them all at the end.
    env[TRIAL_TOKEN] = new_token(files["result"])
    bench = ("-m", "autotune.trial.bench", files["spec"], files["result"], files["progress"])
    torchrun: tuple[str, ...] = ()
    if nodes is not None:
        if config.world_size % nodes.count:
            raise ValueError(f"{config.world_size} ranks do not split over {nodes.count} nodes")
        # c10d: the node at the endpoint hosts the store; a fixed node count (min = max)
        # starts the trial as soon as every node has joined. No restarts: a failed rank or a
        # lost node ends the trial.
        torchrun = (f"--nnodes={nodes.count}",
                    f"--nproc-per-node={config.world_size // nodes.count}",
                    "--rdzv-backend=c10d", f"--rdzv-endpoint={nodes.endpoint}",
                    f"--rdzv-id={rdzv_id or 'autotune'}", "--max-restarts=0")
    elif config.world_size == 1:
        # A tuner started inside a distributed job (torchrun, a Kubeflow pod) must not hand its
        # own rank variables to a one-rank trial: it would join that job's process group.
        env.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    else:
        # torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT for each rank, and
        # OMP_NUM_THREADS=1 unless it is set (as a torchrun training run would get it). No
        # restarts: a failed rank ends the trial, and torchrun stops the other ranks.
        torchrun = ("--standalone", f"--nproc-per-node={config.world_size}", "--max-restarts=0")
    argv: tuple[str, ...] = (python, *(("-m", "torch.distributed.run", *torchrun)
                                       if torchrun else ()), *bench)
    if nodes is not None:
        # The launcher gets the trial's environment; srun passes it on to every node's task.
        argv = ("/bin/sh", "-c", nodes.template.replace("{cmd}", shlex.join(argv)))
    return TrialPlan(argv=argv, env=env, timeout_s=timeout_s, spec=spec.to_json(),
                     spec_path=files["spec"], result_path=files["result"],
                     progress_path=files["progress"], stderr_path=files["stderr"],
                     memory_limit_bytes=spec.memory_limit_bytes if device == "cpu" else None,
                     address_space_bytes=spec.address_space_bytes, device=device,
                     torchrun=torchrun, rdzv_id=rdzv_id if nodes is not None else None)


def plan_command(spec: TrialSpec, command: Command, *, workdir: Path, timeout_s: float,
                 profile: str, extra_env: Mapping[str, str] | None = None) -> TrialPlan:
    """A trial that runs the user's command as typed (its own launcher starts its ranks), with
    ``profile`` (a profile's YAML: the candidate config) written as ``workdir/profile.yaml`` for
    it to load, and ``workdir`` the step protocol's folder. The spec is written beside it for
    the record; the command does not read it."""
    config = spec.config
    # Absolute: a script that changes directory (os.chdir before loading its profile, or after)
    # still finds its profile, its step files and the stop request.
    workdir = Path(os.path.abspath(workdir))
    env = {**env_for(config), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           **command_env(workdir, workdir / "profile.yaml", config.samples_per_rank_step),
           # The bootstrap reaches a Trainer script nobody edited (``autotune.bootstrap``);
           # ``execute`` puts its folder first on PYTHONPATH.
           MODE_ENV: TRIAL, **trainer_env(config.amp, config.grad_accum_steps),
           **dict(extra_env or {})}
    if spec.device != "cpu" and spec.memory_limit_bytes:
        env[LIMIT_ENV] = str(spec.memory_limit_bytes)
    if spec.device == "cpu" and spec.sentinel:
        # Read by the script's first step (``autotune.steps``); on CUDA, NVML's clocks.
        env[SENTINEL_ENV] = sentinel.script_request(spec.sentinel, spec.measure.max_seconds)
    files = _files(workdir)
    env[TRIAL_TOKEN] = new_token(files["result"])
    return TrialPlan(argv=command.argv, env=env, timeout_s=timeout_s, spec=spec.to_json(),
                     spec_path=files["spec"], result_path=files["result"],
                     progress_path=files["progress"], stderr_path=files["stderr"],
                     memory_limit_bytes=spec.memory_limit_bytes if spec.device == "cpu" else None,
                     device=spec.device, script=command.name, profile=profile)
