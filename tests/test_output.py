"""What `autotune run` prints outside a terminal: plain lines, or JSON lines with --json. The
reporters and the dashboard writer as ``cli.run`` hands them to the run, the real tuner
in-process, its trials replayed (``autotune.testing.replay``: each one's windows come as the
progress events a trial's process writes). A real --json run of a real trial:
test_step_reports."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from autotune.testing.replay import Asked, ReplayMeasurer, Row
from tests.conftest import JOURNAL, replayed


def mlp() -> ReplayMeasurer:
    """mlp's trials: faster with the batch, a little noise in each window."""
    return ReplayMeasurer(lambda asked: Row(1000.0 + 20.0 * asked.config.samples_per_step,
                                            window_cv=0.02))


def run_as_the_cli(reporter: object) -> object:
    """Two trials of mlp, reported by ``reporter``, the dashboard drawn as the CLI draws it."""
    from autotune.report import write_dashboard

    summary, _ = replayed(mlp(), model="mlp", trials=2, storage=JOURNAL, reporter=reporter,
                          dashboard=write_dashboard)
    return summary


def test_json_events_parse_line_by_line(memdir: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    from autotune.events import JsonReporter

    run_as_the_cli(JsonReporter())  # on stdout, as `autotune run --json` prints
    out = capsys.readouterr().out
    events = [json.loads(line) for line in out.splitlines()]  # every line is one object
    kinds = [e["event"] for e in events]
    assert kinds[0] == "started" and kinds[-1] == "finished"
    assert kinds.count("trial_started") == 2 and kinds.count("trial_finished") == 2
    windows = [e for e in events if e["event"] == "trial_progress" and e["kind"] == "window"]
    assert windows and all(w["trial"] in (0, 1) and w["samples_per_sec"] > 0 for w in windows)
    done = events[-1]
    assert done["best"]["samples_per_sec"] > 0 and Path(memdir / done["profile"]).exists()
    assert Path(memdir / done["dashboard"]).exists()
    assert events[0]["fixed"]["pin_memory"]["reason"]  # why a knob is not searched here


def test_plain_output_is_line_oriented(memdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from autotune.console import ConsoleReporter

    run_as_the_cli(ConsoleReporter())  # on stdout, as `autotune run` prints outside a terminal
    text = capsys.readouterr().out
    assert "\r" not in text and "\x1b[" not in text  # no progress bar redraws, no colour codes
    lines = text.splitlines()
    assert any(ln.startswith("trial 1/2 (baseline): ") for ln in lines)
    assert any(ln.startswith("  #1 ") for ln in lines)
    assert any(ln.startswith("dashboard: ") and ln.endswith("dashboard.html") for ln in lines)


# What gloo writes when a peer goes away: a source path in brackets, which rich would read as a
# closing markup tag (the tuner once died of a MarkupError printing it).
GLOO = "[/w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Connection closed by peer"


def test_a_trials_error_prints_as_written_and_the_tuner_goes_on(memdir: Path) -> None:
    from autotune.cli import _nothing_measured

    def crash(asked: Asked) -> Row:
        return Row(status="error", reason=f"ValueError: {GLOO} [bold]")

    summary, out = replayed(ReplayMeasurer(crash), model="autotune.testing.workloads:crash",
                            params={"message": f"{GLOO} [bold]"}, trials=1, storage=JOURNAL)
    assert f"{GLOO} [bold]" in out
    # Its one trial failed: nothing was measured, which the CLI says in one line, exit 1.
    assert summary.best is None
    assert _nothing_measured(summary).exit_code == 1


def test_notes_and_reasons_are_not_markup_in_a_terminal() -> None:
    """The terminal reporter (progress bar, table) takes every text as written."""
    from rich.console import Console

    from autotune.console import ConsoleReporter

    for terminal in (True, False):
        buffer = io.StringIO()
        reporter = ConsoleReporter(Console(file=buffer, force_terminal=terminal, width=200))
        reporter.note(f"{GLOO} [red]")
        assert f"{GLOO} [red]" in buffer.getvalue()
