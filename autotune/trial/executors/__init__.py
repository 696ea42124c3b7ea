"""Where a trial's processes run: this machine (the default), Slurm job steps or Ray placement
groups.

An executor turns a trial planned for this machine (``trial.plans``) into its engine's: the
process ``trial.launch.execute`` starts is then the engine's client (``srun``, a Ray client),
whose stdout brings back what the trial's nodes relay (``executors.relay``) and whose stderr is
the trial's log. The tuner follows, times out and ends such a trial as it does a local one, and
ends it through the engine as well (``end``). Trials of one executor may run side by side, one
per ``slot`` (disjoint nodes).
"""

from __future__ import annotations

import json
import re
from typing import Protocol

from autotune.errors import UsageError
from autotune.trial.plans import TrialPlan

EXECUTORS = ("local", "slurm", "ray")
NAME_PREFIX = "autotune."
SPEC_ENV = "AUTOTUNE_TRIAL_SPEC"  # the trial's spec, for the node parts (no shared files)


class Executor(Protocol):
    """A cluster engine that runs trials (``slurm.Slurm``, ``ray_cluster.Ray``)."""

    name: str
    slots: int  # trials that fit side by side

    def plan(self, p: TrialPlan, slot: int, trial: str, port_seed: int) -> TrialPlan:
        """``p`` as this engine's trial on ``slot``'s nodes (``trial``: its name there)."""
        ...

    def describe(self) -> str: ...

    def clean(self) -> list[str]:
        """End what an earlier, killed driver of the same study left running; what was ended."""
        ...


def trial_name(study: str, trial: str) -> str:
    """A trial's name on its engine (a Slurm step, a Ray placement group, the rendezvous id):
    how the tuner finds it to end it, and finds what a killed earlier driver of the same study
    left running."""
    return NAME_PREFIX + re.sub(r"[^A-Za-z0-9_.-]", "_", f"{study}.{trial}")


def node_env(p: TrialPlan) -> dict[str, str]:
    """The environment every node part of ``p`` gets: the trial's own, and its spec."""
    return {**p.env, SPEC_ENV: json.dumps(p.spec, separators=(",", ":"))}


def slots(nodes: int, nnodes: int, parallel: int | None, where: str, more: str) -> int:
    """How many trials of ``nnodes`` nodes run side by side on ``nodes`` (``--parallel``, or
    as many as fit); a one-line error when none fits or ``--parallel`` asks for more.
    ``where`` names the nodes (the allocation), ``more`` says how to get more of them."""
    fit = nodes // nnodes
    if fit < 1:
        raise UsageError(f"--nnodes {nnodes}: {where} has {nodes} node(s); {more} "
                         f"{nnodes} or more, or pass --nnodes {max(nodes, 1)}")
    if parallel is not None and parallel > fit:
        raise UsageError(f"--parallel {parallel}: {fit} trial(s) of {nnodes} node(s) fit in "
                         f"{where}'s {nodes} nodes; use --parallel {fit}, or {more} "
                         f"{parallel * nnodes}")
    return parallel or fit


def start_executor(name: str, nnodes: int, nproc: int, parallel: int | None,
                   study: str) -> Executor | None:
    """The executor ``--executor NAME`` names, checked against its engine (the allocation, the
    Ray cluster); None for this machine."""
    if name == "slurm":
        from autotune.trial.executors.slurm import Slurm

        return Slurm(nnodes, nproc, parallel, study)
    if name == "ray":
        from autotune.trial.executors.ray_cluster import Ray

        return Ray(nnodes, nproc, parallel, study)
    return None


def end(p: TrialPlan) -> None:
    """End a trial through its engine, beyond ending its client (a Slurm step is cancelled; a
    Ray trial's client removes its placement group itself when it is ended)."""
    if p.engine == "slurm":
        from autotune.trial.executors.slurm import end as end_step

        end_step(p)
