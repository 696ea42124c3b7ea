"""What `autotune run` prints outside a terminal: plain lines, or JSON lines with --json."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from tests.conftest import FAST, autotune


@pytest.mark.slow
def test_json_events_parse_line_by_line(workdir: Path) -> None:
    out = autotune("run", "--model", "mlp", "--trials", "2", "--json", *FAST, cwd=workdir)
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines()]  # every line is one object
    kinds = [e["event"] for e in events]
    assert kinds[0] == "started" and kinds[-1] == "finished"
    assert kinds.count("trial_started") == 2 and kinds.count("trial_finished") == 2
    windows = [e for e in events if e["event"] == "trial_progress" and e["kind"] == "window"]
    assert windows and all(w["trial"] in (0, 1) and w["samples_per_sec"] > 0 for w in windows)
    done = events[-1]
    assert done["best"]["samples_per_sec"] > 0 and Path(workdir / done["profile"]).exists()
    assert Path(workdir / done["dashboard"]).exists()
    assert events[0]["fixed"]["pin_memory"]["reason"]  # why a knob is not searched here


@pytest.mark.slow
def test_plain_output_is_line_oriented(workdir: Path) -> None:
    out = autotune("run", "--model", "mlp", "--trials", "2", *FAST, cwd=workdir)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "\r" not in text and "\x1b[" not in text  # no progress bar redraws, no colour codes
    lines = text.splitlines()
    assert any(ln.startswith("trial 1/2 (baseline): ") for ln in lines)
    assert any(ln.startswith("  #1 ") for ln in lines)
    assert any(ln.startswith("dashboard: ") and ln.endswith("dashboard.html") for ln in lines)


# What gloo writes when a peer goes away: a source path in brackets, which rich would read as a
# closing markup tag (the tuner once died of a MarkupError printing it).
GLOO = "[/w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Connection closed by peer"


def test_a_trials_error_prints_as_written_and_the_tuner_goes_on(workdir: Path) -> None:
    out = autotune("run", "--model", "autotune.testing.workloads:crash", "--param",
                   f"message={GLOO} [bold]", "--trials", "1", *FAST, cwd=workdir)
    assert "internal error" not in out.stderr, out.stderr
    assert out.returncode == 1, out.stderr  # its one trial failed: nothing was measured
    assert f"{GLOO} [bold]" in out.stdout


def test_notes_and_reasons_are_not_markup_in_a_terminal() -> None:
    """The terminal reporter (progress bar, table) takes every text as written."""
    from rich.console import Console

    from autotune.console import ConsoleReporter

    for terminal in (True, False):
        buffer = io.StringIO()
        reporter = ConsoleReporter(Console(file=buffer, force_terminal=terminal, width=200))
        reporter.note(f"{GLOO} [red]")
        assert f"{GLOO} [red]" in buffer.getvalue()
