from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# One probe cache for the session: the first study probes this machine, the others read it, and
# nothing is written under the user's home.
os.environ.setdefault("AUTOTUNE_CACHE_DIR", tempfile.mkdtemp(prefix="autotune-test-cache-"))
# Device locks of this test process's own: tests running beside each other (pytest-xdist) must
# not wait for each other's trials, which would eat their time budgets. The fleet tests give
# their workers one lock directory, as workers on one machine share one.
os.environ.setdefault("AUTOTUNE_LOCK_DIR", tempfile.mkdtemp(prefix="autotune-test-locks-"))
# Short windows keep a tiny-workload trial around two seconds, most of it process start-up.
# No confirmation unless a test asks for it: it re-measures the top configs several times.
FAST = ["--window-seconds", "0.1", "--trial-seconds", "5", "--trial-timeout", "60s",
        "--confirm-top", "0"]


def autotune(*args: str, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None,
             ) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a real subprocess; with ``AUTOTUNE_FAKE_NVML`` in ``env``, on the
    made-up machine that file describes (``python -m autotune.testing``)."""
    entry = "autotune.testing" if env and "AUTOTUNE_FAKE_NVML" in env else "autotune"
    return subprocess.run(
        [sys.executable, "-m", entry, *args], cwd=cwd, capture_output=True, text=True,
        timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """gpu / multi_gpu tests skip without devices (the test process may touch CUDA; the tuner
    may not); tests of the shared tuned study are serial."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        # The shared tuned study is built once, in the serial run (see `make test`), and the
        # tests that compare its figures with new measurements need a quiet machine.
        if "tuned_mlp" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.serial)
        if "gpu" in item.keywords and count < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multi_gpu" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))


@pytest.fixture(scope="session")
def tuned_mlp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The profile of a real, short `mlp` study with its confirmation: what a user exports."""
    cwd = tmp_path_factory.mktemp("tuned-mlp")
    out = autotune("run", "--model", "mlp", "--trials", "3", "--trial-seconds", "6",
                   "--window-seconds", "0.5", "--trial-timeout", "60s", "--confirm-top", "1",
                   "--confirm-rounds", "2", cwd=cwd)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (path,) = cwd.glob("studies/*/profile.yaml")
    return path
