"""Trials on a running Ray cluster (``--executor ray``, the ``ray`` extra).

Each trial is one placement group (one bundle per node, ``STRICT_SPREAD``) held by a client
process the tuner starts (``executors.ray_client``), with one actor per node running the same
node part as a Slurm step's task (``executors.node``: torchrun with a c10d rendezvous, the
trial's files relayed back on stdout). The tuner never joins the Ray cluster itself: its
process stays free of Ray's threads, and a trial's client is ended like any trial (SIGTERM, then
the process group).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace

from autotune.errors import UsageError
from autotune.trial.executors import node_env, slots, trial_name
from autotune.trial.executors.ray_client import FORWARD_ENV
from autotune.trial.plans import TrialPlan

CONNECT_S = 120.0  # how long the tuner waits for the Ray cluster to answer


def cluster_nodes() -> list[dict[str, int]]:
    """The Ray cluster's alive nodes (their CPUs and GPUs); a one-line error when there is no
    cluster to reach. Says on stderr first where it asks and for how long at most: Ray keeps
    trying an address that does not answer, silently, until ``CONNECT_S`` runs out."""
    if importlib.util.find_spec("ray") is None:
        raise UsageError("--executor ray needs Ray: pip install ray (or pip install -e '.[ray]' "
                         "in a clone of autotune), in the same environment on every node")
    address = os.environ.get("RAY_ADDRESS") or "auto"
    where = address if address != "auto" else "auto (the cluster `ray start` runs here)"
    print(f"autotune: asking the Ray cluster at {where} for its nodes, for up to "
          f"{CONNECT_S:.0f}s (RAY_ADDRESS sets the address; Ctrl-C stops)", file=sys.stderr,
          flush=True)
    try:
        out = subprocess.run([sys.executable, "-m", "autotune.trial.executors.ray_client",
                              "nodes"], capture_output=True, text=True, timeout=CONNECT_S,
                             check=False)
        found = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError, IndexError):
        found = None
    if not isinstance(found, list) or not found:
        raise UsageError(f"--executor ray: no Ray cluster answers at {address}: start one "
                         "(`ray start --head` here, `ray start --address HEAD:6379` on each other "
                         "node) or set RAY_ADDRESS")
    return found


class Ray:
    """Runs each trial on ``nnodes`` Ray nodes, up to ``slots`` trials at a time."""

    name = "ray"

    def __init__(self, nnodes: int, nproc: int, parallel: int | None, study: str,
                 nodes: list[dict[str, int]] | None = None) -> None:
        self.nodes = nodes if nodes is not None else cluster_nodes()
        self.nnodes, self.nproc, self.study = nnodes, nproc, study
        self.slots = slots(len(self.nodes), nnodes, parallel, "the Ray cluster",
                           "add nodes (`ray start --address HEAD:6379`) to have")
        # A trial takes whole nodes: every CPU of the smallest node, and --nproc GPUs.
        self.cpus = min(n["cpus"] for n in self.nodes)
        self.gpus = nproc if min(n["gpus"] for n in self.nodes) else 0
        if self.gpus and nproc > min(n["gpus"] for n in self.nodes):
            raise UsageError(f"--nproc {nproc}: the Ray cluster's nodes have "
                             f"{min(n['gpus'] for n in self.nodes)} GPU(s) at least; use --nproc "
                             "<= that")

    def describe(self) -> str:
        return (f"Ray placement groups: {len(self.nodes)} node(s), {self.slots} trial(s) at a "
                f"time on {self.nnodes} node(s) each")

    def plan(self, p: TrialPlan, slot: int, trial: str, port_seed: int) -> TrialPlan:
        """``p`` (a trial planned for this machine) as a placement group's trial."""
        name = trial_name(self.study, trial)
        env = node_env(p)
        env[FORWARD_ENV] = ",".join(sorted(k for k in env if k != FORWARD_ENV))
        argv = (sys.executable, "-m", "autotune.trial.executors.ray_client", "run",
                "--nodes", str(self.nnodes), "--nproc", str(self.nproc), "--cpus",
                str(self.cpus), "--gpus", str(self.gpus), "--name", name)
        return replace(p, argv=argv, env=env, engine=self.name, step=name,
                       memory_limit_bytes=None)

    def clean(self) -> list[str]:
        """Nothing to end: a trial's placement group goes with its client's end."""
        return []
