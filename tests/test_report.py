"""The dashboard: drawn from a real study at the end of the run and by `autotune dashboard`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from autotune.report import PANELS
from tests.conftest import autotune


def test_the_run_writes_a_self_contained_dashboard_with_every_panel(tuned_mlp: Path) -> None:
    path = tuned_mlp.parent / "dashboard.html"
    text = path.read_text()
    for title in PANELS:
        assert f"<h2>{title}</h2>" in text, title
    assert 'src="http' not in text and "src='http" not in text  # no network request at all
    assert text.count("<script") >= len(PANELS) and len(text) > 1_000_000  # plotly.js inlined
    assert "speedup" in text and "memory limit" in text
    # How close to the hardware, and what holds the winner back.
    assert "<b>MFU</b>" in text and "of the measured peak" in text and "<b>probe</b>" in text
    assert "<b>limits the winner</b>" in text
    assert not list(tuned_mlp.parent.glob("*.tmp"))


def test_the_dashboard_command(tuned_mlp: Path, tmp_path: Path) -> None:
    cwd = tuned_mlp.parents[2]  # where the study ran: studies/<study>/profile.yaml
    study = tuned_mlp.parent.name
    out = autotune("dashboard", "--out", str(tmp_path / "d.html"), cwd=cwd)
    assert out.returncode == 0, out.stderr
    assert f"dashboard for study {study}: {tmp_path / 'd.html'}" in out.stdout
    assert all(f"<h2>{t}</h2>" in (tmp_path / "d.html").read_text() for t in PANELS)
    out = autotune("dashboard", "--study", "nope", cwd=cwd)
    assert out.returncode == 2 and "no study 'nope'" in out.stderr and study in out.stderr
    # No storage here: a clear error, and no empty database left behind.
    out = autotune("dashboard", cwd=tmp_path)
    assert out.returncode == 2 and "no study storage at studies/autotune.db" in out.stderr
    assert not (tmp_path / "studies").exists()


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Flags for a headless Chromium on a machine with no network and no screen.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--enable-unsafe-swiftshader",
         "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--window-size=1280,4200"]


def chromium(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    profile_dir = tempfile.mkdtemp(dir=tmp)
    return subprocess.run([CHROMIUM or "chromium", *FLAGS, f"--user-data-dir={profile_dir}",
                           *args], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"),
                    reason="needs Chromium (Debian package chromium; .ci/run installs it)")
def test_the_dashboard_loads_in_chromium_without_errors(tuned_mlp: Path, tmp_path: Path) -> None:
    url = (tuned_mlp.parent / "dashboard.html").resolve().as_uri()
    # The page's console and failed requests reach stderr with --enable-logging.
    out = chromium("--enable-logging=stderr", "--v=0", "--dump-dom", url, tmp=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    console = [ln for ln in out.stderr.splitlines() if ":CONSOLE" in ln]
    # Chromium's own GL notes about software rendering are not the page's errors.
    errors = [ln for ln in console if "GL Driver Message" not in ln
              and re.search(r"Uncaught|Error|Failed|net::ERR", ln)]
    assert not errors, errors
    assert out.stdout.count('class="plot-container plotly"') == len(PANELS), "a panel did not draw"
    shot = tmp_path / "dashboard.png"
    chromium(f"--screenshot={shot}", url, tmp=tmp_path)
    blank_page = tmp_path / "blank.html"
    blank_page.write_text("<!DOCTYPE html><html><body></body></html>")
    blank = tmp_path / "blank.png"
    chromium(f"--screenshot={blank}", blank_page.as_uri(), tmp=tmp_path)
    # A blank page of the same size compresses to ~24 KB; the drawn dashboard to ~200 KB.
    assert shot.stat().st_size > 4 * blank.stat().st_size, (shot.stat().st_size,
                                                             blank.stat().st_size)


def test_the_live_dashboard_answers_on_localhost_then_stops(tmp_path: Path) -> None:
    import signal
    import sys
    import time
    import urllib.request

    import optuna

    # A storage of its own: the shared tuned study's SQLite file is read by other tests now.
    (tmp_path / "studies").mkdir()
    study = optuna.create_study(study_name="s",
                                storage=f"sqlite:///{tmp_path}/studies/autotune.db")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    proc = subprocess.Popen([sys.executable, "-m", "autotune", "dashboard", "--live"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        match = re.search(r"http://127\.0\.0\.1:(\d+)/dashboard/", line)
        assert match, line + (proc.stderr.read() if proc.stderr else "")
        for path in ("/dashboard/", "/api/studies"):
            with urllib.request.urlopen(f"http://127.0.0.1:{match.group(1)}{path}",
                                        timeout=20) as response:
                assert response.status == 200
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"still serving 20 s after SIGTERM: {out[-500:]} "
                                 f"{err[-2000:]}") from None
        assert proc.returncode == 0 and time.monotonic() - start < 20, err
        assert "live dashboard stopped" in out
    finally:
        proc.kill()
        proc.wait()


def test_studies_lists_trials_best_and_speedup(tuned_mlp: Path) -> None:
    out = autotune("studies", cwd=tuned_mlp.parents[2])
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()[:2]
    assert header.split()[:4] == ["study", "trials", "best", "samples/s"]
    assert row.split()[0] == tuned_mlp.parent.name and row.split()[1] == "3"
    assert row.split()[3].endswith("x")


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"),
                    reason="needs Chromium (Debian package chromium; .ci/run installs it)")
def test_png_panels(tuned_mlp: Path, tmp_path: Path) -> None:
    out = autotune("dashboard", "--png", "--out", str(tmp_path / "d.html"),
                   cwd=tuned_mlp.parents[2])
    assert out.returncode == 0, out.stderr
    images = sorted((tmp_path / "panels").glob("*.png"))
    assert len(images) == len(PANELS) and images[0].name == "01-optimization-history.png"
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
               for p in images)


def test_png_without_kaleido_is_one_clear_line(tuned_mlp: Path, tmp_path: Path) -> None:
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "kaleido.py").write_text("raise ImportError('kaleido is not installed')\n")
    root = Path(__file__).parents[1]
    out = autotune("dashboard", "--png", "--out", str(tmp_path / "d.html"),
                   cwd=tuned_mlp.parents[2], env={"PYTHONPATH": f"{fake}:{root}"})
    assert out.returncode == 2 and "--png needs kaleido" in out.stderr, out.stderr
    assert (tmp_path / "d.html").exists()  # the HTML dashboard is written all the same


def test_a_signal_in_the_middle_of_a_request_still_stops_the_server(tmp_path: Path) -> None:
    """wsgiref's handler catches every exception, KeyboardInterrupt too: a SIGTERM raised while
    a request is being answered was once swallowed, and the live dashboard went on serving."""
    import signal
    import sys
    import threading
    import time
    import urllib.request

    code = ("import sys, time\n"
            "from autotune.report import serve\n"
            "def app(environ, start_response):\n"
            "    print('answering', flush=True)\n"
            "    time.sleep(3)\n"
            "    start_response('200 OK', [('Content-Type', 'text/plain')])\n"
            "    return [b'late']\n"
            "serve(app, 0, lambda port: print(port, flush=True))\n"
            "print('stopped', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        threading.Thread(target=lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{port}/", timeout=30).read(), daemon=True).start()
        assert proc.stdout.readline().strip() == "answering"
        proc.send_signal(signal.SIGTERM)  # while the app sleeps inside the request
        start = time.monotonic()
        assert proc.wait(timeout=30) == 0 and time.monotonic() - start < 30
        assert proc.stdout.read().strip() == "stopped"
    finally:
        proc.kill()
        proc.wait()
