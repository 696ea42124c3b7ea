from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import pytest

if TYPE_CHECKING:
    import optuna
    from click.testing import Result

    from autotune.tuner.measurer import MeasureTrial
    from autotune.tuner.reporting import Reporter, RunSummary
    from autotune.tuner.runner import Dashboard

ROOT = Path(__file__).resolve().parent.parent
# One probe cache for the session: the first study probes this machine, the others read it, and
# nothing is written under the user's home.
os.environ.setdefault("AUTOTUNE_CACHE_DIR", tempfile.mkdtemp(prefix="autotune-test-cache-"))
# Device locks of this test process's own: tests running beside each other (pytest-xdist) must
# not wait for each other's trials, which would eat their time budgets. An xdist worker makes
# its own (it would inherit the controller's, which imported this file first). The fleet tests
# give their workers one lock directory, as workers on one machine share one.
if os.environ.get("PYTEST_XDIST_WORKER") or "AUTOTUNE_LOCK_DIR" not in os.environ:
    os.environ["AUTOTUNE_LOCK_DIR"] = tempfile.mkdtemp(prefix="autotune-test-locks-")
# Two tests at a time (make test's first pass) run two trials at a time on a 2-core machine: one
# intra-op thread each, or the two OpenMP pools oversubscribe the cores and spin against each
# other (a loop read 100x slower once beside another trial here). Set before torch loads; what
# the tests check (outcomes, applied settings, records) does not depend on the thread count.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# Short windows keep a tiny-workload trial around two seconds, most of it process start-up.
# No confirmation unless a test asks for it: it re-measures the top configs several times.
FAST = ["--window-seconds", "0.1", "--trial-seconds", "5", "--trial-timeout", "60s",
        "--confirm-top", "0"]
# The same, for the real tuner run in-process (``replayed``); the machine is never probed there.
REPLAYED: dict[str, Any] = {"trial_timeout_s": 60.0, "confirm_top": 0, "probe": False}
# The storage of a study run in-process where the storage is not what is tested: a journal file
# (in ``memdir``). A run reads and writes its study thousands of times; on SQLite that took
# ~10 s of commits for one study here, on a journal file in memory well under one.
JOURNAL = "journal:///study.log"

EXAMPLES = ROOT / "examples"
# The framework each example trains with (None: torch alone).
EXAMPLE_FRAMEWORKS = {"train_plain.py": None, "train_hf.py": "transformers",
                      "train_lightning.py": "lightning"}


def needs_framework(example: str) -> None:
    """Skip where the example's framework is not installed (the dev extra installs both)."""
    framework = EXAMPLE_FRAMEWORKS[example]
    if framework:
        pytest.importorskip(framework)


def autotune(*args: str, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None,
             ) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a real subprocess; with ``AUTOTUNE_FAKE_NVML`` in ``env``, on the
    made-up machine that file describes (``python -m autotune.testing``)."""
    entry = "autotune.testing" if env and "AUTOTUNE_FAKE_NVML" in env else "autotune"
    return subprocess.run(
        [sys.executable, "-m", entry, *args], cwd=cwd, capture_output=True, text=True,
        timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def replayed(measure: MeasureTrial, *, window_s: float = 0.1, trial_s: float = 5.0,
             reporter: Reporter | None = None, dashboard: Dashboard | None = None,
             **options: Any) -> tuple[RunSummary, str]:
    """The real tuner, in-process, on a made-up 2-core CPU with native bf16 (``hardware=``
    another), every trial answered by ``measure`` (``autotune.testing.replay``) instead of a
    process: returns the run's summary and what `autotune run` prints outside a terminal
    (nothing, when another ``reporter`` is given). ``options`` are RunOptions' fields;
    ``window_s`` and ``trial_s`` its --window-seconds and --trial-seconds."""
    import io

    from rich.console import Console

    from autotune.console import ConsoleReporter
    from autotune.testing.hardware import fake_cpu
    from autotune.trial.spec import MeasureSettings
    from autotune.tuner.runner import Runner, RunOptions

    shown = io.StringIO()
    opts = RunOptions(**{**REPLAYED, "hardware": fake_cpu(),
                         "measure": MeasureSettings(min_window_s=window_s, max_seconds=trial_s),
                         **options})
    reporter = reporter or ConsoleReporter(Console(file=shown, highlight=False, markup=False))
    summary = Runner(opts, reporter, dashboard, measure=measure).run()
    return summary, shown.getvalue()


def cli(*args: str) -> Result:
    """An `autotune` command run in this process (typer's runner): its exit code, stdout and
    stderr, through the same error handling as the real command (``exits.guarded``)."""
    from typer.testing import CliRunner

    from autotune.cli import app

    return CliRunner().invoke(app, list(args))


T = TypeVar("T")


def poll(check: Callable[[], T | None | Literal[False]], timeout: float = 120.0) -> T:
    """What ``check`` returns first that is neither None nor False, polled every 0.2 s: a found
    value that is falsy (trial number 0) still counts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found is not None and found is not False:
            return found
        time.sleep(0.2)
    raise AssertionError(f"not reached in {timeout:g}s")


def trial_processes_under(folder: Path) -> list[int]:
    """Live processes of any trial whose files are under ``folder``: a trial's token (in every
    process it starts, node parts and ranks too) begins with its result file's path."""
    found = []
    needle = f"AUTOTUNE_TRIAL={folder}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if any(v.startswith(needle) for v in f.read().split(b"\0")):
                    found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.fixture
def postgres_url() -> str:
    """The real PostgreSQL server's URL; CI must have it, elsewhere its tests skip without it."""
    url = os.environ.get("AUTOTUNE_TEST_POSTGRES_URL",
                         "postgresql+psycopg2://postgres@127.0.0.1:5432/test")
    try:
        import sqlalchemy

        sqlalchemy.create_engine(url).connect().close()
    except Exception as exc:
        if os.environ.get("CI"):
            raise AssertionError(f"CI must run the PostgreSQL tests, but {url} fails: {exc}") \
                from exc
        pytest.skip(f"no PostgreSQL server answers at {url}")
    return url


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def memdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The test's working folder, in memory where the machine has one (tmpfs): what the
    in-process tuner writes (its study, the profile) never waits for a disk."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        monkeypatch.chdir(tmp_path)
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(prefix="autotune-test-", dir=shm))
    monkeypatch.chdir(folder)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def load_study(url: str = JOURNAL, name: str | None = None) -> optuna.Study:
    """A study as stored (the only one in ``url`` unless named), through autotune's own
    storage opening (a journal file is no URL Optuna opens by itself)."""
    import optuna

    from autotune.tuner.storage import open_storage

    storage = open_storage(url)
    return optuna.load_study(study_name=name or optuna.get_all_study_names(storage)[0],
                             storage=storage)


@pytest.hookimpl(tryfirst=True)  # before -m selects by the marks added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """gpu / multi_gpu tests skip without devices (the test process may touch CUDA; the tuner
    may not); the tests of the shared tuned study are slow (it takes half a minute)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "tuned_mlp" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
        if "gpu" in item.keywords and count < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multi_gpu" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))
    items.sort(key=_start_order)


def _start_order(item: pytest.Item) -> int:
    """The order tests start in (stable within each group): real processes first, the quick
    tests after them, the shared tuned study's last. Several at a time (worksteal), the pass then
    ends on quick tests instead of one worker finishing a minute-long test alone, and no worker
    waits for the tuned study, which tunes in the background from the start."""
    if "tuned_mlp" in getattr(item, "fixturenames", ()):
        return 2
    return 0 if "slow" in item.keywords else 1


# The tests of this study read its confirmation, which needs a winner other than the baseline:
# micro-batch sizes (the larger ones read about twice the baseline's rate on a loaded machine
# too) and loader workers, no pruning. Over the default space, a staged start that tried bf16
# first on a loaded machine once left the baseline the winner.
TUNE_SPACE = "knobs:\n  micro_batch_size: {choices: [32, 128, 256]}\n" \
             "  num_workers: {choices: [0, 1]}\n"
TUNE = ["run", "--model", "mlp", "--space", "space.yaml", "--trials", "3", "--trial-seconds", "4",
        "--window-seconds", "0.25", "--trial-timeout", "60s", "--confirm-top", "1",
        "--confirm-rounds", "2", "--no-prune"]


def _tuned_dir(config: pytest.Config) -> Path:
    """Where the shared tuned study lives: the folder above an xdist worker's own temporary one
    (every worker of the run shares it), else this run's temporary folder."""
    base = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "tuned-mlp"


def pytest_sessionstart(session: pytest.Session) -> None:
    """Probe this machine once for the whole session (and the serial pass after it, which shares
    the cache folder), before any test runs, and cache it even if something else held the cores
    meanwhile. A probe taken under load is never cached by autotune itself, and with tests two
    at a time most probes would be: every study would then probe again (20 s each). What the
    tests check does not depend on the peaks' values; the contention rule has tests of its own
    with caches of their own."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller probes before it starts the workers
    from autotune.machine.hardware import detect
    from autotune.machine.probe import _measure, cached
    from autotune.machine.probe.cache import save
    from autotune.machine.probe.inventory import inventory

    hw = detect()
    if cached(hw) is None:
        gpus = inventory()["gpus"] if hw.device == "cuda" else []
        save(hw, _measure(hw, gpus, None, lambda line: None, allreduce=False))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start tuning the shared study in the background as soon as a selected test needs it, so
    no test waits the whole study out; the first process of the run to get here starts it."""
    if not any("tuned_mlp" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    folder = _tuned_dir(session.config)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(folder / "started", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    (folder / "space.yaml").write_text(TUNE_SPACE)
    command = " ".join([shlex.quote(sys.executable), "-m", "autotune", *TUNE])
    # Its own device locks: it runs beside the tests and must not make them wait.
    locks = tempfile.mkdtemp(prefix="autotune-test-locks-")
    session.config._tuning = subprocess.Popen(  # type: ignore[attr-defined]
        ["/bin/sh", "-c", f"{command} > tune.log 2>&1; echo $? > rc"], cwd=folder,
        env={**os.environ, "PYTHONPATH": str(ROOT), "AUTOTUNE_LOCK_DIR": locks},
        start_new_session=True)


def pytest_sessionfinish(session: pytest.Session) -> None:
    tuning = getattr(session.config, "_tuning", None)
    if tuning is not None and tuning.poll() is None:
        os.killpg(tuning.pid, signal.SIGKILL)  # the run ended before the study: do not leave it


@pytest.fixture(scope="session")
def tuned_mlp(request: pytest.FixtureRequest) -> Path:
    """The profile of a real, short `mlp` study with its confirmation: what a user exports.

    Tuned once per test run, in the background from collection on (pytest_collection_finish);
    this waits for it."""
    folder = _tuned_dir(request.config)
    deadline = time.monotonic() + 600
    while not (folder / "rc").exists():
        assert time.monotonic() < deadline, "the shared tuned study did not finish in 10 min"
        time.sleep(0.5)
    time.sleep(0.1)  # `echo` may not have flushed its line yet
    log = (folder / "tune.log").read_text()
    assert (folder / "rc").read_text().strip() == "0", log[-3000:]
    (path,) = folder.glob("studies/*/profile.yaml")
    return path
