"""The Ray engine's client: one trial on a running Ray cluster, or what the cluster holds.

    python -m autotune.trial.executors.ray_client nodes
    python -m autotune.trial.executors.ray_client run --nodes N --nproc P --cpus C --gpus G
        --name NAME

``run`` reserves one placement group for the trial (one bundle per node, ``STRICT_SPREAD``),
places one actor per bundle, and has each start the node's part of the trial
(``executors.node``) with torchrun's flags: a c10d rendezvous at the first actor's address. It
prints what the parts send on stdout (the relayed files) and their logs on stderr as it comes,
and exits with the first failing part's exit code. SIGTERM stops every part (each ends its
ranks, found by their token: they run in sessions of their own, which Ray's cleanup of an actor
does not reach). A node that dies (its actor is lost) ends the trial with ``NODE_LOST`` and the
line ``autotune: node lost: ...``; the tuner then queues the trial again. The placement group is
removed at the end, whatever ended the trial.

Not Ray Train's TorchTrainer: it would own the process group and change what is measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

NODE_LOST = 75  # the exit code of a trial a lost node ended (EX_TEMPFAIL)
FORWARD_ENV = "AUTOTUNE_RAY_FORWARD"  # the trial's environment variables the nodes get
READY_S = 120.0  # how long the placement group may wait for nodes
POLL_S = 0.25


class NodePart:
    """A Ray actor on one node: starts that node's part of the trial, buffers its output."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.out: list[bytes] = []
        self.err: list[bytes] = []
        self.lock = threading.Lock()

    def address(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def start(self, argv: list[str], env: dict[str, str]) -> int:
        self.proc = subprocess.Popen(argv, env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
        for stream, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._pump, args=(stream, into), daemon=True).start()
        return self.proc.pid

    def _pump(self, stream: Any, into: list[bytes]) -> None:
        for line in iter(stream.readline, b""):
            with self.lock:
                into.append(line)

    def read(self) -> tuple[bytes, bytes, int | None]:
        """What the part wrote since the last read, and its exit code once it ended."""
        code = self.proc.poll() if self.proc is not None else None
        if code is not None:
            time.sleep(0.05)  # the pumps' last lines
        with self.lock:
            out, err = b"".join(self.out), b"".join(self.err)
            self.out.clear()
            self.err.clear()
        return out, err, code

    def stop(self, wait_s: float = 20.0) -> int | None:
        """SIGTERM to the part (it ends its ranks), SIGKILL after ``wait_s``."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.terminate()
        try:
            return self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _connect() -> Any:
    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", logging_level=logging.ERROR,
             log_to_driver=False, configure_logging=False, include_dashboard=False)
    return ray


def nodes() -> int:
    """Print the alive nodes' CPUs and GPUs as JSON."""
    ray = _connect()
    alive = [n for n in ray.nodes() if n.get("Alive")]
    print(json.dumps([{"cpus": int(n["Resources"].get("CPU", 0)),
                       "gpus": int(n["Resources"].get("GPU", 0))} for n in alive]))
    return 0


def run(args: argparse.Namespace) -> int:
    ray = _connect()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ended: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda s, frame: ended.append(s))
    bundle = {"CPU": float(args.cpus), **({"GPU": float(args.gpus)} if args.gpus else {})}
    pg = placement_group([bundle] * args.nodes, strategy="STRICT_SPREAD", name=args.name)
    actors: list[Any] = []
    try:
        try:
            ray.get(pg.ready(), timeout=READY_S)
        except ray.exceptions.GetTimeoutError:
            print(f"autotune: the Ray cluster has no {args.nodes} node(s) with {bundle} free "
                  f"after {READY_S:.0f}s", file=sys.stderr)
            return 1
        part = ray.remote(NodePart)
        actors = [part.options(num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=i)).remote() for i in range(args.nodes)]
        return _follow(ray, actors, args, ended)
    except (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError,
            ray.exceptions.ActorUnavailableError) as exc:
        print(f"autotune: node lost: {str(exc).splitlines()[0][:300]}", file=sys.stderr)
        return NODE_LOST
    finally:
        for a in actors:
            try:
                ray.get(a.stop.remote(), timeout=30)
            except Exception:  # noqa: BLE001, S110 - a lost actor's part ends with its parent
                pass
        remove_placement_group(pg)


def _follow(ray: Any, actors: list[Any], args: argparse.Namespace, ended: list[int]) -> int:
    host = ray.get(actors[0].address.remote())
    flags: list[str] = []
    if args.nodes * args.nproc > 1:
        port = ray.get(actors[0].free_port.remote())
        flags = [f"--nnodes={args.nodes}", f"--nproc-per-node={args.nproc}",
                 "--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{port}",
                 f"--rdzv-id={args.name}", "--max-restarts=0"]
    keys = [k for k in os.environ.get(FORWARD_ENV, "").split(",") if k in os.environ]
    env = {k: os.environ[k] for k in keys}
    argv = [sys.executable, "-m", "autotune.trial.executors.node", *flags]
    # The first node hosts the rendezvous store, whether or not its address is one torchrun
    # recognises as its own (a node's outward address need not resolve from its hostname).
    ray.get([a.start.remote(argv + ([f"--rdzv-conf=is_host={int(i == 0)}"] if flags else []),
                            env) for i, a in enumerate(actors)])
    codes: list[int | None] = [None] * len(actors)
    while not ended and any(c is None for c in codes):
        for i, (out, err, code) in enumerate(ray.get([a.read.remote() for a in actors])):
            sys.stdout.buffer.write(out)
            sys.stderr.buffer.write(err)
            codes[i] = code
        sys.stdout.flush()
        sys.stderr.flush()
        if any(codes):  # a failing part ends the trial, as srun's --kill-on-bad-exit does
            break
        time.sleep(POLL_S)
    # The other parts end too (each its ranks); what they said last still comes back.
    stopped = ray.get([a.stop.remote() for a in actors])
    for out, err, _ in ray.get([a.read.remote() for a in actors]):
        sys.stdout.buffer.write(out)
        sys.stderr.buffer.write(err)
    sys.stdout.flush()
    sys.stderr.flush()
    if ended:
        return 128 + ended[0]
    return next((c for c in codes if c), None) or next((c for c in stopped if c), 0)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m autotune.trial.executors.ray_client")
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("nodes")
    r = sub.add_parser("run")
    r.add_argument("--nodes", type=int, required=True)
    r.add_argument("--nproc", type=int, required=True)
    r.add_argument("--cpus", type=int, required=True)
    r.add_argument("--gpus", type=int, default=0)
    r.add_argument("--name", required=True)
    args = parser.parse_args(argv)
    return nodes() if args.what == "nodes" else run(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
