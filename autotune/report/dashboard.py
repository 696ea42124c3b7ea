"""The study dashboard: one self-contained HTML file (plotly.js embedded, no network request),
a header of what the study concluded above the panels (``panels.py``), and the panels as PNGs.
Built from the study alone (``data.gather``), so it can be drawn again at any time, from any
machine that reaches the storage.
"""

from __future__ import annotations

import html
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.report.data import DashboardData, Headline, gather
from autotune.report.panels import panels
from autotune.tuner.reporting import story
from autotune.units import format_bytes

if TYPE_CHECKING:
    import optuna


def build_dashboard(study: optuna.Study) -> str:
    """The dashboard's HTML: a header and one figure per panel, plotly.js inlined once."""
    return render(gather(study))


def render(data: DashboardData) -> str:
    """The dashboard's HTML for what ``gather`` read."""
    parts = [_header(data)]
    for i, (title, fig) in enumerate(panels(data)):
        parts.append(f'<section id="panel-{i}"><h2>{html.escape(title)}</h2>'
                     + fig.to_html(full_html=False, include_plotlyjs=i == 0,
                                   config={"displaylogo": False})
                     + "</section>")
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\">"
            f"<title>autotune: {html.escape(data.name)}</title>"
            "<style>body{font-family:sans-serif;margin:1.5em;max-width:1200px}"
            "table.head td{padding:2px 12px 2px 0}</style></head><body>"
            + "".join(parts) + "</body></html>")


def write_dashboard(study: optuna.Study, path: Path) -> Path:
    """Write the dashboard to ``path`` atomically (a reader never sees half a file)."""
    import os

    tmp = path.with_suffix(".html.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(build_dashboard(study))
    os.replace(tmp, path)
    return path


def write_pngs(study: optuna.Study, folder: Path) -> list[Path]:
    """Each panel as ``folder/NN-name.png`` through kaleido, which drives a Chromium."""
    import re

    from autotune.errors import AutotuneError, UsageError

    try:
        import kaleido  # noqa: F401 - plotly's image export needs it
    except ImportError:
        raise UsageError("--png needs kaleido (from a clone of autotune: pip install -e "
                         "'.[png]') and a Chromium (e.g. Debian's package chromium); the HTML "
                         "dashboard needs neither"
                         ) from None
    import plotly.io

    folder.mkdir(parents=True, exist_ok=True)
    drawn = panels(gather(study))
    paths = [folder / f"{i + 1:02d}-{re.sub(r'[^a-z0-9]+', '-', title.lower()).strip('-')}.png"
             for i, (title, _) in enumerate(drawn)]
    try:  # one browser for all panels
        plotly.io.write_images([fig for _, fig in drawn], paths, width=1200, height=420)
    except Exception as exc:  # noqa: BLE001 - kaleido's errors name the missing browser
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise AutotuneError(f"PNG export failed ({type(exc).__name__}: {first[:200]}); it needs "
                            "a Chromium (e.g. Debian's package chromium)") from None
    return paths


def load_for_dashboard(storage_url: str, study_name: str | None) -> tuple[optuna.Study, str]:
    """The study to draw: ``study_name``, else the only one, else the most recently started
    (the second value says which, and why). Never creates a storage that is not there."""
    from autotune.tuner.storage import choose_study

    return choose_study(storage_url, study_name)


def header_rows(data: DashboardData) -> list[tuple[str, str]]:
    """The header's (label, text) rows, in order: where and what was tuned, the winner as the
    exported profile states it, the machine, the search, what limits the winner, the trials."""
    rows = [("study", data.name), ("hardware", data.hardware),
            ("memory limit", format_bytes(data.limit) if data.limit else "-")]
    if data.headline is not None:
        rows += _winner_rows(data.headline)
    conf = data.confirmation
    if conf is not None:
        medians = ", ".join(f"#{c.trial}{' (baseline)' if c.baseline else ''} {c.median:,.2f}"
                            for c in conf.candidates if c.median)
        rows.append(("confirmed", f"{conf.rounds} interleaved rounds, medians {medians}; "
                                  f"winner #{conf.decision.winner_trial} by "
                                  f"{conf.decision.decided_by}"))
    eff = data.headline.efficiency if data.headline is not None else None
    if eff is not None and eff.mfu is not None and data.headline is not None:
        at = "confirmed" if data.headline.best.confirmed else "search trial's"
        rows.append(("MFU", f"{100 * eff.mfu:.1f}% of the measured peak at the {at} "
                            f"samples/s ({eff.peak_tflops:g} TFLOP/s per device; "
                            f"{eff.flops_per_sample:.3g} FLOPs/sample)"))
    if data.probe is not None:
        peaks = ", ".join(f"{k} {v:g}" for k, v in data.probe.peaks)
        rows.append(("probe", f"peak TFLOP/s {peaks or 'unknown'}"
                              + "".join(f"; {f}" for f in data.probe.flags)))
    if data.headline is not None and data.headline.compile is not None:
        rows.append(("compile", data.headline.compile))
    if data.headline is not None:
        rows += [("to train", line) for line in data.headline.training]
    rows += [("search step", line) for line in story(list(data.records),
                                                     data.search_baseline_rate)]
    rows += [("limits the winner", text) for text in data.limits_the_winner]
    counts = Counter("ruled out" if r.predicted else r.status for r in data.records)
    rows.append(("trials", ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "none"))
    return rows


def _winner_rows(h: Headline) -> list[tuple[str, str]]:
    """The baseline, the winner and the speedup: the exported profile's figures, each saying
    what it rests on."""
    rows = [] if h.baseline is None else [("baseline", h.baseline.words())]
    rows.append(("best", h.best.words()))
    if h.speedup is not None:
        rows.append(("speedup", h.speedup.words() + (
            ": no config beat the baseline beyond the measured noise, its settings are kept"
            if h.no_win else "")))
    elif h.baseline is None:
        rows.append(("speedup", "none claimed: the baseline has not been measured yet"))
    else:
        rows.append(("speedup", "none claimed: the search trials' figures come from a single "
                                "timed window (spread unknown)"))
    return rows


def _header(data: DashboardData) -> str:
    cells = "".join(f"<tr><td><b>{html.escape(k)}</b></td><td>{html.escape(v)}</td></tr>"
                    for k, v in header_rows(data))
    return f'<h1>autotune study</h1><table class="head">{cells}</table>'
