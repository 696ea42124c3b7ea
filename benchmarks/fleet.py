"""What a shared study costs: storage time per trial, and the wall time of a worker fleet.

    python benchmarks/fleet.py storage --postgres postgresql+psycopg2://postgres@127.0.0.1/test
    python benchmarks/fleet.py workers --postgres URL --workers 3 --trials 12
    sbatch --nodes 4 --wrap "python benchmarks/fleet.py driver --trials 12"   # inside Slurm

``storage`` runs the same small mlp study in this process on SQLite, on PostgreSQL and on a
journal file, in turn, and times every storage call the tuner's thread makes (the outermost call
only: Optuna's cache calls the database underneath) and the study lock: milliseconds per trial,
next to the trial's own wall time. ``workers`` runs the study with 1 worker and then with N
workers (processes on this machine, each with its own output directory) against PostgreSQL
and prints both wall times; on one machine the device lock serialises the trials, so the
difference is what coordination costs. ``driver`` (inside a Slurm allocation of 4 nodes) counts
the storage calls per trial of one driver running 2-node trials as Slurm steps, one slot and
then two side by side (its slot threads' calls counted too), on SQLite.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import optuna  # noqa: E402

import autotune.tuner.storage as storage_module  # noqa: E402
from autotune.console import QuietReporter  # noqa: E402
from autotune.trial.spec import MeasureSettings  # noqa: E402
from autotune.tuner.runner import Runner, RunOptions  # noqa: E402

FAST = MeasureSettings(max_seconds=3.0, min_window_s=0.1)


class Timer:
    """Seconds spent in wrapped calls on the main thread, outermost calls only."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._local = threading.local()
        self._lock = threading.Lock()

    @staticmethod
    def counted() -> bool:
        """The tuner's threads: the main one and a parallel driver's slots (not heartbeats)."""
        t = threading.current_thread()
        return t is threading.main_thread() or t.name.startswith("slot-")

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.counted() or getattr(self._local, "depth", 0):
                return fn(*args, **kwargs)
            self._local.depth = 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.seconds += time.perf_counter() - start
                    self.calls += 1
                self._local.depth = 0
        return timed


def instrument(timer: Timer) -> None:
    for cls in (optuna.storages.RDBStorage, optuna.storages.JournalStorage):
        for name in dir(cls):
            attr = getattr(cls, name)
            if not name.startswith("_") and callable(attr) and name not in ("engine",):
                setattr(cls, name, timer.wrap(attr))
    lock = storage_module.study_lock

    @contextlib.contextmanager
    def timed_lock(*args: Any, **kwargs: Any) -> Iterator[None]:
        start = time.perf_counter()
        with lock(*args, **kwargs):
            timer.seconds += time.perf_counter() - start  # waiting for and taking the lock
            yield
    storage_module.study_lock = timed_lock  # type: ignore[assignment]


def storage_overhead(url: str, trials: int, workdir: Path, timer: Timer,
                     **more: Any) -> dict[str, float]:
    opts = RunOptions(model="mlp", storage=url, study_name=f"bench-{uuid.uuid4().hex[:8]}",
                      trials=trials, out_dir=workdir / "out", measure=FAST,
                      confirm_top=0, patience=None, probe=False, **more)
    before_s, before_calls = timer.seconds, timer.calls
    start = time.perf_counter()
    summary = Runner(opts, QuietReporter()).run()
    wall = time.perf_counter() - start
    n = len([t for t in summary.trials if t.reused_from is None])
    spent = timer.seconds - before_s
    with contextlib.suppress(Exception):
        if url.startswith("postgresql"):
            optuna.delete_study(study_name=opts.study_name or "", storage=url)
    return {"trials": n, "storage_ms_per_trial": 1000 * spent / n,
            "calls_per_trial": (timer.calls - before_calls) / n, "wall_s_per_trial": wall / n}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("storage", "workers", "driver"))
    parser.add_argument("--postgres", help="PostgreSQL URL (storage, workers)")
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--workers", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="autotune-fleet-bench-"))
    if args.what == "driver":
        timer = Timer()
        instrument(timer)
        for parallel in (1, 2):
            r = storage_overhead(f"sqlite:///{work}/s.db", args.trials, work / str(parallel),
                                 timer, executor="slurm", nnodes=2, nproc=1, parallel=parallel,
                                 prune=False)
            print(f"slurm driver, {parallel} slot(s): {r['storage_ms_per_trial']:7.1f} ms of "
                  f"storage calls per trial ({r['calls_per_trial']:.0f} calls), "
                  f"{r['wall_s_per_trial']:.2f} s of wall per trial ({r['trials']} trials)",
                  flush=True)
        return 0
    if not args.postgres:
        parser.error(f"{args.what} needs --postgres URL")
    if args.what == "storage":
        timer = Timer()
        instrument(timer)
        for label, url in (("sqlite", f"sqlite:///{work}/s.db"), ("postgresql", args.postgres),
                           ("journal", f"journal:///{work}/j.log")):
            r = storage_overhead(url, args.trials, work / label, timer)
            print(f"{label:10s} {r['storage_ms_per_trial']:7.1f} ms of storage calls per trial "
                  f"({r['calls_per_trial']:.0f} calls), trials {r['wall_s_per_trial']:.2f} s each "
                  f"({r['trials']} trials)", flush=True)
        return 0
    for n in (1, args.workers):
        name = f"bench-{uuid.uuid4().hex[:8]}"
        cmd = [sys.executable, "-m", "autotune", "run", "--model", "mlp", "--trials",
               str(args.trials), "--storage", args.postgres, "--study", name, "--patience", "0",
               "--confirm-top", "0", "--trial-seconds", "3", "--window-seconds", "0.1",
               "--trial-timeout", "60s"]
        start = time.perf_counter()
        procs = [subprocess.Popen([*cmd, "--out", str(work / name / str(i))], cwd=work,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for i in range(n)]
        codes = [p.wait() for p in procs]
        wall = time.perf_counter() - start
        study = optuna.load_study(study_name=name, storage=args.postgres)
        done = [t for t in study.trials if t.user_attrs.get("measurement")
                and t.user_attrs.get("reused_from") is None]
        print(f"{n} worker(s): {wall:.1f} s wall for {len(done)} measured trials "
              f"(exit codes {codes})", flush=True)
        optuna.delete_study(study_name=name, storage=args.postgres)
    return 0


if __name__ == "__main__":
    sys.exit(main())
