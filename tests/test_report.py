"""The dashboard: drawn from a real study at the end of the run and by `autotune dashboard`."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.distributions import CategoricalDistribution, IntDistribution

from autotune.config.knobs import Config
from autotune.report import PANELS, build_dashboard, gather
from autotune.report.importance import MIN_TRIALS
from autotune.tuner import snapshot
from autotune.tuner.confirmation import NO_WIN
from autotune.tuner.export import build_profile
from tests.conftest import autotune, cli

GIB = 2**30
IMPORTANCE = PANELS.index("Statistical importance (PED-ANOVA, sampled trials)")
EFFECTS = PANELS.index("Measured effects (one knob at a time)")


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
    # The header states what the exported profile states: its speedup, with what it rests on,
    # and its MFU (at the confirmed rate when the winner was confirmed).
    profile = yaml.safe_load(tuned_mlp.read_text())
    rows = dict(header(text))
    kind = "confirmed side by side" if profile.get("confirmation") else \
        "search windows, not confirmed"
    if profile["speedup"] is not None:  # a confirmed win of two or more rounds adds each one's
        conf = profile.get("confirmation") or {}
        decision = conf.get("decision", {})
        no_win = decision.get("decided_by") == NO_WIN  # (the baseline may also win on headroom)
        won = not no_win and decision.get("winner_trial") not in {
            c["trial"] for c in conf.get("candidates", []) if c["baseline"]}
        assert rows["speedup"].startswith(f"{profile['speedup']:.2f}x ("), rows
        assert kind in rows["speedup"], rows
        assert ("; per round " in rows["speedup"]) == (won and conf.get("rounds", 0) >= 2), rows
        assert ("no config beat the baseline" in rows["speedup"]) == (bool(conf) and no_win)
    if profile["result"].get("mfu") is not None:
        assert rows["MFU"].startswith(f"{100 * profile['result']['mfu']:.1f}% "), rows
    # A few staged trials say nothing statistical about which knob matters: the panel says
    # so, and draws no bar; the measured effects panel reads them one knob at a time.
    traces, layout = figure(text, IMPORTANCE)
    assert traces == []
    assert "not ranked: " in annotations(layout)
    (bars,), _ = figure(text, EFFECTS)
    assert bars["type"] == "bar" and bars["y"]


def test_the_dashboard_command(tuned_mlp: Path, tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tuned_mlp.parents[2])  # where the study ran: studies/<study>/profile.yaml
    study = tuned_mlp.parent.name
    out = cli("dashboard", "--out", str(tmp_path / "d.html"))
    assert out.exit_code == 0, out.stderr
    assert f"dashboard for study {study}: {tmp_path / 'd.html'}" in out.stdout
    assert all(f"<h2>{t}</h2>" in (tmp_path / "d.html").read_text() for t in PANELS)
    out = cli("dashboard", "--study", "nope")
    assert out.exit_code == 2 and "no study 'nope'" in out.stderr and study in out.stderr
    # No storage here: a clear error, and no empty database left behind.
    monkeypatch.chdir(tmp_path)
    out = cli("dashboard")
    assert out.exit_code == 2 and "no study storage at studies/autotune.db" in out.stderr
    assert not (tmp_path / "studies").exists()


def test_the_real_dashboard_command_says_a_missing_study_in_one_line(tuned_mlp: Path) -> None:
    """The same error through the real command in its own process: one line, exit 2."""
    out = autotune("dashboard", "--study", "nope", cwd=tuned_mlp.parents[2])
    assert out.returncode == 2 and "no study 'nope'" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


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


def test_studies_lists_trials_best_and_speedup(tuned_mlp: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tuned_mlp.parents[2])
    out = cli("studies")
    assert out.exit_code == 0, out.stderr
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


def test_png_without_kaleido_is_one_clear_line(tuned_mlp: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "kaleido", None)  # `import kaleido` fails, as uninstalled
    monkeypatch.chdir(tuned_mlp.parents[2])
    out = cli("dashboard", "--png", "--out", str(tmp_path / "d.html"))
    assert out.exit_code == 2 and "--png needs kaleido" in out.stderr, out.stderr
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


# -- crafted studies: what the header and the importance panel say follows from the results --

SPACE = {"micro_batch_size": IntDistribution(8, 256, log=True),
         "amp": CategoricalDistribution(["off", "bf16"]),
         "num_workers": IntDistribution(0, 4)}
PEAK_TFLOPS = 1.0  # fp32: MFU is samples/s x FLOPs per sample / 1e12
FLOPS = 1e9


def _trial(config: Config, rate: float, *, baseline: bool = False,
           spread: float | None = 0.02, stage: str | None = None,
           applied: dict[str, Any] | None = None) -> optuna.trial.FrozenTrial:
    """An ok trial as `autotune run` records it, with its MFU at its own rate."""
    measurement = {"status": "ok", "samples_per_sec": rate, "spread_cv": spread,
                   **({"applied": applied} if applied else {}),
                   "peak_memory_bytes": GIB, "wall_s": 10.0,
                   "windows": [{"samples": 64, "seconds": 64 / rate}] * 3,
                   "flops_per_sample": FLOPS, "flops_source": "counted",
                   "mfu": rate * FLOPS / (PEAK_TFLOPS * 1e12), "peak_tflops": PEAK_TFLOPS}
    params = {name: getattr(config, name) for name in SPACE}
    return optuna.trial.create_trial(
        params=params, distributions=dict(SPACE), value=rate,
        user_attrs={"config": config.to_dict(), "status": "ok", "baseline": baseline,
                    "measurement": measurement, "memory_limit_bytes": 16 * GIB,
                    **({"stage": stage} if stage else {})})


def _study(trials: list[optuna.trial.FrozenTrial],
           confirmation: dict[str, Any] | None = None) -> optuna.Study:
    study = optuna.create_study(direction="maximize", study_name="crafted")
    study.set_user_attr("fingerprint", {"device": "cpu", "torch_version": "2.5.0"})
    study.set_user_attr("workload", {"spec": "mlp", "params": {}})
    study.set_user_attr("memory_limit_bytes", 16 * GIB)
    study.set_user_attr("probe", {"peak_tflops": {"fp32": PEAK_TFLOPS}, "flags": []})
    if confirmation is not None:
        study.set_user_attr("confirmation", confirmation)
    for t in trials:
        study.add_trial(t)
    return study


BASE, FAST = Config(micro_batch_size=32), Config(micro_batch_size=64)


def _candidate(trial: int, config: Config, rates: list[float], baseline: bool) -> dict[str, Any]:
    return {"trial": trial, "config": config.to_dict(), "samples_per_sec": rates,
            "median": sum(rates) / len(rates), "spread_cv": 0.02, "peak_memory_bytes": GIB,
            "baseline": baseline, "failures": []}


def _search_won_more_than_confirmed(confirm: bool, spread: float | None = 0.02) -> optuna.Study:
    """The default run's shape: the search trials read 2.16x, the confirmation's interleaved
    rounds 1.63x (the baseline's trial ran cold, first)."""
    trials = [_trial(BASE, 100.0, baseline=True), _trial(FAST, 216.0, spread=spread)]
    confirmation = {
        "measured_trials": 2, "rounds": 2, "planned_rounds": 2, "measure": {},
        "decision": {"winner_trial": 1, "runner_up_trial": 0, "margin": 0.04,
                     "decided_by": "median"},
        "candidates": [_candidate(1, FAST, [160.0, 166.0], False),
                       _candidate(0, BASE, [99.0, 101.0], True)]}
    return _study(trials, confirmation if confirm else None)


def header(text: str) -> list[tuple[str, str]]:
    """The dashboard header's (label, text) rows."""
    return [(html.unescape(k), html.unescape(v)) for k, v in
            re.findall(r"<tr><td><b>(.*?)</b></td><td>(.*?)</td></tr>", text)]


def figure(text: str, panel: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The traces and layout a panel of the dashboard draws, as plotly.js receives them."""
    section = text.split(f'<section id="panel-{panel}">', 1)[1].split("</section>", 1)[0]
    start = section.index("Plotly.newPlot(")
    rest = section[section.index("[", start):]
    decoder = json.JSONDecoder()
    traces, end = decoder.raw_decode(rest)
    layout, _ = decoder.raw_decode(rest[end:].lstrip(", \n"))
    return traces, layout


def annotations(layout: dict[str, Any]) -> str:
    return " ".join(a.get("text", "") for a in layout.get("annotations", []))


def test_the_headline_speedup_is_the_profiles_confirmed_side_by_side() -> None:
    study = _search_won_more_than_confirmed(confirm=True)
    rows = dict(header(build_dashboard(study)))
    profile = build_profile(snapshot.read(study), "sqlite://")
    assert profile is not None and profile.speedup == 1.63
    # With each round's own ratio (160/99, 166/101): how far one round is from another.
    # With its interval (tuner.interval), the profile's: where a re-check of two rounds lands.
    assert rows["speedup"] == ("1.63x (1.46-1.82x, 90% interval; confirmed side by side; per "
                               "round 1.62x, 1.64x)")
    assert profile.speedup_interval is not None
    assert (profile.speedup_interval["low"], profile.speedup_interval["high"]) == (1.46, 1.819)
    assert profile.speedup_interval["rounds"] == 2
    # The time to train a million samples at the profile's rate, with that rate's interval.
    assert rows["to train"].startswith("1,000,000 samples at 163 samples/s (") and \
        "median of 2 confirmation round(s): 1.7 h (" in rows["to train"]
    assert "2.16" not in rows["speedup"]
    # Each figure says what it rests on: the confirmation's medians, the search trial's own.
    assert rows["best"] == ("batch 64x1, fp32, workers 0: 163.00 samples/s (confirmed median; "
                            "its search trial #1 measured 216.00)")
    assert rows["baseline"].startswith("batch 32x1, fp32, workers 0: 100.00 samples/s "
                                       "(confirmed median")


def test_without_a_confirmation_the_speedup_is_the_search_trials_labelled_so() -> None:
    study = _search_won_more_than_confirmed(confirm=False)
    rows = dict(header(build_dashboard(study)))
    profile = build_profile(snapshot.read(study), "sqlite://")
    assert profile is not None and profile.speedup == 2.16
    assert rows["speedup"] == "2.16x (search windows, not confirmed)"
    assert rows["best"] == "batch 64x1, fp32, workers 0: 216.00 samples/s (search trial #1)"
    # A single window has no spread: the profile claims no speedup, and neither does the header.
    study = _search_won_more_than_confirmed(confirm=False, spread=None)
    profile = build_profile(snapshot.read(study), "sqlite://")
    assert profile is not None and profile.speedup is None
    assert dict(header(build_dashboard(study)))["speedup"].startswith(
        "none claimed: the search trials' figures come from a single timed window")


def test_one_mfu_the_profiles_at_the_confirmed_rate(tmp_path: Path) -> None:
    """The search trial measured 216 samples/s (21.6% MFU), the confirmation 163 (16.3%): the
    header, the profile and its diagnosis all say 16.3%."""
    from autotune.tuner.export import write_profile as export

    study = _search_won_more_than_confirmed(confirm=True)
    profile = export(study, snapshot.read(study), "sqlite://", None, tmp_path / "p.yaml")
    assert profile is not None and profile.result["mfu"] == 0.163
    rows = header(build_dashboard(study))
    (mfu,) = [text for label, text in rows if label == "MFU"]
    assert mfu.startswith("16.3% of the measured peak at the confirmed samples/s")
    limits = " ".join(text for label, text in rows if label == "limits the winner")
    assert "16%" in limits and "22%" not in limits and "21.6" not in mfu
    said = [f["evidence"]["mfu"] for f in profile.diagnosis if "mfu" in f["evidence"]]
    assert said and set(said) == {0.163}


def _importance_study(n: int, vary: bool = True) -> optuna.Study:
    """``n`` measured trials; with ``vary``, micro-batch and precision change (larger and bf16
    are faster) while loader workers never do."""
    trials = []
    for i in range(n):
        micro = (8, 16, 32, 64, 128)[i % 5] if vary else 32
        amp = ("off", "bf16")[(i // 5) % 2] if vary else "off"
        rate = micro * (2.0 if amp == "bf16" else 1.0) + i % 3
        trials.append(_trial(Config(micro_batch_size=micro, amp=amp), rate, baseline=i == 0))
    return _study(trials)


def test_importance_ranks_only_knobs_that_varied() -> None:
    study = _importance_study(10)
    imp = gather(study).importance
    assert {name for name, _ in imp.ranked} == {"micro_batch_size", "amp"}
    assert imp.unvaried == ("num_workers",) and imp.why_empty is None
    assert sum(share for _, share in imp.ranked) == pytest.approx(1.0)
    (bars,), layout = figure(build_dashboard(study), IMPORTANCE)
    assert bars["type"] == "bar" and set(bars["y"]) == {"micro_batch_size", "amp"}
    assert "never changed, not ranked: num_workers" in layout["xaxis"]["title"]["text"]


def test_importance_says_why_it_ranks_nothing() -> None:
    # Too few trials: not even the knobs that changed are ranked.
    text = build_dashboard(_importance_study(MIN_TRIALS - 1))
    traces, layout = figure(text, IMPORTANCE)
    assert traces == []
    words = annotations(layout)
    assert f"not ranked: {MIN_TRIALS - 2} of the {MIN_TRIALS - 1} measured trials were " \
        f"sampled broadly (by the sampler); a statistical importance needs {MIN_TRIALS}" in words
    assert "never changed, not ranked: num_workers" in words
    # Enough trials, but none of the searched knobs ever changed.
    traces, layout = figure(build_dashboard(_importance_study(10, vary=False)), IMPORTANCE)
    assert traces == []
    words = annotations(layout)
    assert "nothing to rank: no searched knob changed among the 9 measured trials" in words
    assert "never changed, not ranked: amp, micro_batch_size, num_workers" in words


def test_measured_effects_read_each_one_knob_change_against_its_parent() -> None:
    """The staged walk of a default run: fp32 -> bf16 at the same batch made the gain; a larger
    batch a little; loader workers nothing (within the noise). The effects panel heads with
    precision; the statistical importance ranks nothing (no trial was sampled broadly)."""
    b16 = Config(micro_batch_size=32, amp="bf16")
    trials = [_trial(BASE, 100.0, baseline=True),
              _trial(b16, 178.0, stage="staged: largest micro-batch that fits with amp bf16"),
              _trial(Config(micro_batch_size=64, amp="bf16"), 190.0, stage="staged: larger"),
              _trial(Config(micro_batch_size=64, amp="bf16", num_workers=2), 189.0,
                     stage="diagnosis: input-bound -> num_workers 2")]
    data = gather(_study(trials))
    assert [e.knob for e in data.effects] == ["amp", "micro_batch_size", "num_workers"]
    amp, micro, workers = data.effects
    assert (amp.before, amp.after, amp.parent, amp.child) == ("off", "bf16", 0, 1)
    assert amp.ratio == pytest.approx(1.78) and amp.beyond_noise and not amp.confirmed
    assert micro.ratio == pytest.approx(190 / 178) and micro.beyond_noise
    assert not workers.beyond_noise
    assert amp.words() == ("amp fp32 -> bf16 (trial 0 -> 1): 1.78x, beyond the noise (margin "
                           "4.0%; search trials)")
    text = build_dashboard(_study(trials))
    (bars,), _ = figure(text, EFFECTS)
    assert bars["y"][-1] == "amp"  # drawn bottom-up: the largest on top
    traces, layout = figure(text, IMPORTANCE)
    assert traces == [] and "not ranked: 0 of the 4 measured trials were sampled" in \
        annotations(layout)
    # Both configs in the confirmation: the effect is their side-by-side ratio.
    conf = {"measured_trials": 4, "rounds": 2, "planned_rounds": 2, "measure": {},
            "decision": {"winner_trial": 1, "runner_up_trial": 0, "margin": 0.04,
                         "decided_by": "median"},
            "candidates": [_candidate(1, b16, [150.0, 152.0], False),
                           _candidate(0, BASE, [99.0, 101.0], True)]}
    side = gather(_study(trials, conf)).effects[0]
    assert side.knob == "amp" and side.confirmed and side.ratio == pytest.approx(1.51)
    # One round of one of them (screened out after it): one reading each, the search's pair.
    conf["candidates"] = [_candidate(1, b16, [120.0], False),
                          _candidate(0, BASE, [99.0, 101.0], True)]
    once = gather(_study(trials, conf)).effects[0]
    assert once.knob == "amp" and not once.confirmed and once.ratio == pytest.approx(1.78)


def test_an_effect_within_the_noise_never_heads_the_panel() -> None:
    """A run's 16x1 trial read 43% behind 8x1 at a 40% window spread: within its margin, it
    comes after precision's 1.75x (a smaller ratio), which was beyond it."""
    trials = [_trial(Config(micro_batch_size=8), 1.45, baseline=True),
              _trial(Config(micro_batch_size=8, amp="bf16"), 2.54, stage="staged"),
              _trial(Config(micro_batch_size=16, amp="bf16"), 1.40, stage="staged",
                     spread=0.4)]
    effects = gather(_study(trials)).effects
    assert [(e.knob, e.beyond_noise) for e in effects] == [("amp", True),
                                                          ("micro_batch_size", False)]


def test_a_change_to_what_the_parent_already_ran_as_is_no_effect() -> None:
    """A run's panel read "attention default -> sdpa: 0.90x, beyond the noise": BERT's default
    attention is sdpa (read back in the trial), so the two trials ran the same code."""
    base = Config(micro_batch_size=8, amp="bf16")
    trials = [_trial(base, 3.37, baseline=True, applied={"attention": "sdpa"}),
              _trial(replace(base, attention="eager"), 3.46, stage="diagnosis",
                     applied={"attention": "eager"}),
              _trial(replace(base, attention="sdpa"), 3.01, stage="diagnosis",
                     applied={"attention": "sdpa"})]
    effects = gather(_study(trials)).effects
    assert [(e.knob, e.before, e.after) for e in effects] == [("attention", "default", "eager")]
    # Without the read-back (an older study), the pair counts as before.
    plain = [_trial(base, 3.37, baseline=True), trials[1],
             _trial(replace(base, attention="sdpa"), 3.01, stage="diagnosis")]
    found = gather(_study(plain)).effects
    assert ("attention", "default", "sdpa") in [(e.knob, e.before, e.after) for e in found]
