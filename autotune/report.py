"""The study dashboard: one self-contained HTML file (plotly.js embedded, no network request).

Panels answer what a user asks of a study: how the search went (history), where the memory wall
is (throughput and peak memory against micro-batch size), which knob mattered (PED-ANOVA
importances, parallel coordinates), why the winner wins (where step time goes), what ran when
(timeline), how close to the hardware it gets and what held the GPUs back (MFU, SM
utilisation) and what to take (top configs). Built from the study alone, so it can be drawn again
at any time, from any machine that reaches the storage.
"""

from __future__ import annotations

import html
import math
import signal
import threading
import warnings
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.machine.hardware import describe_fingerprint
from autotune.tuner import snapshot
from autotune.tuner.record import TrialRecord
from autotune.tuner.results import compile_payback, efficiency, payback_words, rate_of
from autotune.tuner.snapshot import StudySnapshot
from autotune.tuner.stages import story
from autotune.units import format_bytes

if TYPE_CHECKING:
    import optuna

PANELS = (
    "Optimization history",
    "Samples/sec by micro-batch size",
    "Peak memory by micro-batch size",
    "Parameter importance (PED-ANOVA)",
    "Parallel coordinates",
    "Where step time goes",
    "MFU and GPU utilisation",
    "Trial timeline",
    "Top configs",
    "Predicted and measured",
)
_AMP_COLOURS = {"off": "#1f77b4", "bf16": "#2ca02c", "fp16": "#ff7f0e"}
_STATUS_COLOURS = {"ok": "#2ca02c", "oom": "#d62728", "timeout": "#9467bd", "error": "#7f7f7f",
                   "pruned": "#bcbd22", "diverged": "#e377c2"}
_PARTS = (("data_wait", "data wait", "#ff7f0e"), ("comm_wait", "communication", "#9467bd"),
          ("compute", "compute", "#1f77b4"))


def panels(study: optuna.Study, snap: StudySnapshot | None = None) -> list[tuple[str, Any]]:
    """(title, plotly figure) for each panel, in PANELS order."""
    snap = snap or snapshot.read(study)
    views, limit = list(snap.records), snap.limit
    figures = [_history(views), _rate_by_micro(views, limit), _memory_by_micro(views, limit),
               _importance(study), _parallel(views), _breakdown(views), _efficiency(views),
               _timeline(views), _top_table(views, limit), _forecasts(views)]
    for title, fig in zip(PANELS, figures, strict=True):
        # Parallel coordinates put their axis labels above the plot: give them room.
        top = 60 if title == "Parallel coordinates" else 20
        fig.update_layout(margin={"t": top, "b": 40, "l": 60, "r": 20}, height=420)
    return list(zip(PANELS, figures, strict=True))


def build_dashboard(study: optuna.Study) -> str:
    """The dashboard's HTML: a header and one figure per panel, plotly.js inlined once."""
    snap = snapshot.read(study)
    parts = [_header(snap)]
    for i, (title, fig) in enumerate(panels(study, snap)):
        parts.append(f'<section id="panel-{i}"><h2>{html.escape(title)}</h2>'
                     + fig.to_html(full_html=False, include_plotlyjs=i == 0,
                                   config={"displaylogo": False})
                     + "</section>")
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\">"
            f"<title>autotune: {html.escape(study.study_name)}</title>"
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
    drawn = panels(study)
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


def serve_live(storage_url: str, port: int, on_ready: Any, writable: bool = False) -> None:
    """optuna-dashboard on the storage, bound to 127.0.0.1 (``port`` 0: a free one), until
    Ctrl-C or SIGTERM. ``on_ready(url)`` is called once it listens. Read-only unless
    ``writable``; requests naming another Host are refused (``guard``)."""
    import optuna_dashboard

    from autotune.tuner.storage import open_existing

    bound: list[int] = []
    app = guard(optuna_dashboard.wsgi(open_existing(storage_url)), bound, writable)

    def ready(port: int) -> None:
        bound.append(port)
        on_ready(f"http://127.0.0.1:{port}/dashboard/")

    serve(app, port, ready)


READ_METHODS = ("GET", "HEAD")


def guard(app: Any, bound: list[int], writable: bool) -> Any:
    """The live view's WSGI app behind two checks: the Host header must name this server
    (127.0.0.1 or localhost at the bound port), so a page elsewhere cannot reach it through DNS
    rebinding; and only reads pass unless ``writable`` (optuna-dashboard can delete studies and
    edit notes)."""
    def guarded(environ: dict[str, Any], start_response: Any) -> Any:
        port = bound[0] if bound else None
        host = str(environ.get("HTTP_HOST", "")).lower()
        allowed = {f"127.0.0.1:{port}", f"localhost:{port}"}
        if host not in allowed:
            return _refuse(start_response, "403 Forbidden",
                           f"Host {host!r} is not this server; open http://127.0.0.1:{port}/")
        if not writable and environ.get("REQUEST_METHOD", "GET") not in READ_METHODS:
            return _refuse(start_response, "405 Method Not Allowed",
                           "the live dashboard is read-only; start it with --writable to edit "
                           "or delete studies")
        return app(environ, start_response)

    return guarded


def _refuse(start_response: Any, status: str, why: str) -> list[bytes]:
    body = (why + "\n").encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"),
                            ("Content-Length", str(len(body)))])
    return [body]


def serve(app: Any, port: int, on_ready: Any) -> None:
    """Serve the WSGI ``app`` on 127.0.0.1 until Ctrl-C or SIGTERM, then return.

    The signals stop the server from a thread of their own instead of raising in the main
    thread: wsgiref's request handler catches every exception, KeyboardInterrupt included, so
    a signal that lands while a request is being answered would be swallowed and the server
    would go on serving."""
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
            pass

    with make_server("127.0.0.1", port, app, handler_class=Quiet) as server:
        def stop(signum: int, frame: Any) -> None:
            threading.Thread(target=server.shutdown, daemon=True).start()

        previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            on_ready(server.server_port)
            server.serve_forever()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def _header(snap: StudySnapshot) -> str:
    fp = dict(snap.facts.fingerprint)
    where = describe_fingerprint(fp)
    best, base, limit = snap.winner, snap.baseline, snap.limit
    rows = [("study", snap.name), ("hardware", f"{where}, torch {fp.get('torch_version')}"),
            ("memory limit", format_bytes(limit) if limit else "-")]
    if base is not None:
        rows.append(("baseline", f"{base.config.describe()}: {_rate(base):,.2f} samples/s"))
    if best is not None:
        rows.append(("best", f"{best.config.describe()}: {_rate(best):,.2f} samples/s"))
    if snap.speedup is not None:
        rows.append(("speedup", snap.speedup.words()))
    conf = snap.confirmation
    if conf is not None:
        d = conf.decision
        medians = ", ".join(f"#{c.trial}{' (baseline)' if c.baseline else ''} "
                            f"{c.median:,.2f}" for c in conf.candidates if c.median)
        rows.append(("confirmed", f"{conf.rounds} interleaved rounds, medians {medians}; "
                                  f"winner #{d.winner_trial} by {d.decided_by}"))
    eff = efficiency(snap, best, rate_of(snap, best)) if best is not None else None
    if eff is not None and eff.mfu is not None:
        # The profile's MFU: at the confirmed samples/s when the winner was confirmed.
        rows.append(("MFU", f"{100 * eff.mfu:.1f}% of the measured peak "
                            f"({eff.peak_tflops:g} TFLOP/s per device; "
                            f"{eff.flops_per_sample:.3g} FLOPs/sample)"))
    probe = snap.facts.probe
    if probe:
        peaks = ", ".join(f"{k} {v:g}" for k, v in (probe.get("peak_tflops") or {}).items())
        rows.append(("probe", f"peak TFLOP/s {peaks or 'unknown'}"
                              + "".join(f"; {f}" for f in probe.get("flags", []))))
    if best is not None and (payback := compile_payback(snap, best)) is not None:
        rows.append(("compile", payback_words(payback)))
    for line in story(list(snap.records), _rate(base) if base is not None else None):
        rows.append(("search step", line))
    for finding in snap.facts.diagnosis:
        rows.append(("limits the winner", str(finding.get("text"))))
    counts = Counter("ruled out" if v.predicted else v.status for v in snap.records)
    rows.append(("trials", ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "none"))
    cells = "".join(f"<tr><td><b>{html.escape(k)}</b></td><td>{html.escape(v)}</td></tr>"
                    for k, v in rows)
    return f'<h1>autotune study</h1><table class="head">{cells}</table>'


def _rate(t: TrialRecord) -> float:
    return float(t.samples_per_sec or 0.0)


def _go() -> Any:
    import plotly.graph_objects as go

    return go


def _history(views: list[TrialRecord]) -> Any:
    go = _go()
    fig = go.Figure()
    ok = [v for v in views if v.status == "ok" and v.samples_per_sec]
    fig.add_scatter(x=[v.number for v in ok], y=[v.samples_per_sec for v in ok], mode="markers",
                    name="trial", text=[v.config.describe() for v in ok])
    best, xs, ys = 0.0, [], []
    for v in ok:
        best = max(best, v.samples_per_sec or 0.0)
        xs.append(v.number)
        ys.append(best)
    fig.add_scatter(x=xs, y=ys, mode="lines", line={"shape": "hv"}, name="best so far")
    failed = [v for v in views if v.status != "ok"]
    fig.add_scatter(x=[v.number for v in failed], y=[0] * len(failed), mode="markers",
                    marker={"symbol": "x",
                            "color": [_STATUS_COLOURS.get(v.status) for v in failed]},
                    name="no result", text=[f"{v.status}: {v.reason}" for v in failed])
    base = next((v for v in views if v.is_baseline and v.samples_per_sec), None)
    if base is not None:
        fig.add_hline(y=base.samples_per_sec, line_dash="dot", annotation_text="baseline")
    fig.update_xaxes(title="trial")
    fig.update_yaxes(title="samples/sec")
    return fig


def _by_amp(views: list[TrialRecord]) -> dict[str, list[TrialRecord]]:
    groups: dict[str, list[TrialRecord]] = {}
    for v in views:
        groups.setdefault(v.config.amp, []).append(v)
    return groups


def _rate_by_micro(views: list[TrialRecord], limit: int) -> Any:
    go = _go()
    fig = go.Figure()
    for amp, group in _by_amp(views).items():
        ok = [v for v in group if v.status == "ok" and v.samples_per_sec]
        fig.add_scatter(
            x=[v.config.micro_batch_size for v in ok], y=[v.samples_per_sec for v in ok],
            mode="markers", name="fp32" if amp == "off" else amp,
            marker={"color": _AMP_COLOURS.get(amp), "size": 9,
                    # Over the memory limit: measured, but not a config to take.
                    "symbol": ["circle-open" if limit and v.peak_memory_bytes > limit
                               else "circle" for v in ok]},
            text=[v.config.describe() for v in ok])
    failed = [v for v in views
              if v.status in ("oom", "timeout", "error", "diverged") or v.predicted]
    fig.add_scatter(x=[v.config.micro_batch_size for v in failed], y=[0] * len(failed),
                    mode="markers", name="OOM / too slow / error / ruled out",
                    marker={"symbol": "x", "size": 10,
                            "color": [_STATUS_COLOURS.get(v.status) for v in failed]},
                    text=[f"{v.config.describe()}: {v.reason}" for v in failed])
    fig.update_xaxes(title="micro-batch size", type="log", dtick=math.log10(2))
    fig.update_yaxes(title="samples/sec (open: over the memory limit)")
    return fig


def _memory_by_micro(views: list[TrialRecord], limit: int) -> Any:
    go = _go()
    fig = go.Figure()
    for amp, group in _by_amp(views).items():
        ran = [v for v in group if v.peak_memory_bytes and not v.predicted]
        fig.add_scatter(x=[v.config.micro_batch_size for v in ran],
                        y=[v.peak_memory_bytes / 2**30 for v in ran], mode="markers",
                        name="fp32" if amp == "off" else amp,
                        marker={"color": _AMP_COLOURS.get(amp), "size": 9,
                                "symbol": ["x" if v.status == "oom" else "circle" for v in ran]},
                        text=[f"{v.config.describe()}: {v.status}" for v in ran])
    ruled = [v for v in views if v.predicted and v.peak_memory_bytes]
    if ruled:
        fig.add_scatter(x=[v.config.micro_batch_size for v in ruled],
                        y=[v.peak_memory_bytes / 2**30 for v in ruled], mode="markers",
                        name="predicted (not run)", marker={"symbol": "diamond-open", "size": 10},
                        text=[v.reason for v in ruled])
    if limit:
        fig.add_hline(y=limit / 2**30, line_color="#d62728", annotation_text="memory limit")
    fig.update_xaxes(title="micro-batch size", type="log", dtick=math.log10(2))
    fig.update_yaxes(title="peak memory (GiB)")
    return fig


def _importance(study: optuna.Study) -> Any:
    """PED-ANOVA (no scikit-learn) over the searched knobs of the finished trials."""
    import optuna

    go = _go()
    fig = go.Figure()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            values = optuna.importance.get_param_importances(
                study, evaluator=optuna.importance.PedAnovaImportanceEvaluator())
    except Exception as exc:  # noqa: BLE001 - one panel short is no reason to lose the rest
        values, why = {}, str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    else:
        why = "needs finished trials that differ in more than one knob"
        # With too few trials Optuna warns and returns equal importances: not a finding.
        too_few = [w for w in caught if "too small to compute importances" in str(w.message)]
        if too_few:
            values, why = {}, str(too_few[0].message).rstrip(".")
    if values:
        names = list(values)[::-1]
        fig.add_bar(x=[values[n] for n in names], y=names, orientation="h")
        fig.update_xaxes(title="importance for samples/sec (normalised)")
    else:
        fig.add_annotation(text=f"not enough trials yet: {why}", showarrow=False)
    return fig


def _parallel(views: list[TrialRecord]) -> Any:
    go = _go()
    ok = [v for v in views if v.status == "ok" and v.samples_per_sec]
    amps = sorted({v.config.amp for v in ok})
    dims = [
        {"label": "micro-batch", "values": [v.config.micro_batch_size for v in ok]},
        {"label": "accumulation", "values": [v.config.grad_accum_steps for v in ok]},
        {"label": "precision", "values": [amps.index(v.config.amp) for v in ok],
         "tickvals": list(range(len(amps))),
         "ticktext": ["fp32" if a == "off" else a for a in amps]},
        {"label": "loader workers", "values": [v.config.num_workers for v in ok]},
    ]
    if any(v.config.world_size > 1 for v in ok):
        dims.append({"label": "bucket MB", "values": [v.config.ddp_bucket_cap_mb for v in ok]})
    dims.append({"label": "samples/sec", "values": [v.samples_per_sec for v in ok]})
    return go.Figure(go.Parcoords(
        line={"color": [v.samples_per_sec for v in ok], "colorscale": "Viridis",
              "showscale": True}, dimensions=dims))


def _breakdown(views: list[TrialRecord]) -> Any:
    go = _go()
    ok = [v for v in views if v.status == "ok" and v.breakdown]
    labels = [f"#{v.number} {v.config.describe()}" for v in ok]
    fig = go.Figure()
    for key, name, colour in _PARTS:
        fig.add_bar(x=labels, y=[100 * v.breakdown.get(key, 0.0) for v in ok], name=name,
                    marker_color=colour)
    fig.update_layout(barmode="stack")
    fig.update_yaxes(title="% of step time", range=[0, 100])
    return fig


def _efficiency(views: list[TrialRecord]) -> Any:
    """MFU per trial and, when the GPUs were watched, their mean GPU utilisation."""
    go = _go()
    ok = [v for v in views if v.status == "ok" and v.reused_from is None]
    labels = [f"#{v.number} {v.config.describe()}" for v in ok]
    fig = go.Figure()
    fig.add_bar(x=labels, y=[None if v.mfu is None else 100 * v.mfu for v in ok],
                name="MFU (% of measured peak)", marker_color="#1f77b4")
    if any(v.gpu_util is not None for v in ok):
        fig.add_scatter(x=labels, y=[v.gpu_util for v in ok], mode="markers+lines",
                        name="GPU utilisation (% mean, NVML)", marker_color="#d62728")
    fig.update_yaxes(title="%", rangemode="tozero")
    return fig


def _timeline(trials: list[TrialRecord]) -> Any:
    go = _go()
    fig = go.Figure()
    for t in trials:
        if t.started is None or t.completed is None:
            continue
        status = t.status
        seconds = (t.completed - t.started).total_seconds()
        fig.add_bar(x=[seconds * 1000], base=[t.started], y=[f"#{t.number}"],
                    orientation="h", marker_color=_STATUS_COLOURS.get(status), showlegend=False,
                    hovertext=f"#{t.number} {status}, {seconds:.1f}s")
    fig.update_xaxes(type="date", title="wall clock")
    fig.update_yaxes(autorange="reversed")
    return fig


def _top_table(views: list[TrialRecord], limit: int) -> Any:
    go = _go()
    ok = [v for v in views if v.status == "ok" and v.samples_per_sec and v.reused_from is None
          and (not limit or v.peak_memory_bytes <= limit)]
    top = sorted(ok, key=lambda v: -(v.samples_per_sec or 0.0))[:10]
    cols = [[f"#{v.number}" + (" (baseline)" if v.is_baseline else "") for v in top],
            [v.config.describe() for v in top],
            [f"{v.samples_per_sec:,.2f}" for v in top],
            ["-" if v.spread_cv is None else f"{100 * v.spread_cv:.1f}%" for v in top],
            [format_bytes(v.peak_memory_bytes) for v in top],
            [f"{100 * v.breakdown['data_wait']:.0f}%" if "data_wait" in v.breakdown
             else "unknown" for v in top],
            ["-" if v.mfu is None else f"{100 * v.mfu:.1f}%" for v in top]]
    return go.Figure(go.Table(
        header={"values": ["trial", "config", "samples/sec", "spread", "peak memory",
                           "data wait", "MFU"]},
        cells={"values": cols}))


def _forecasts(views: list[TrialRecord]) -> Any:
    """Each trial that ran or was ruled out: what the step-time and memory models predicted
    before it, beside what it measured (a ruled-out config has only the prediction)."""
    go = _go()
    rows = [v for v in views if v.reused_from is None]

    def step(v: TrialRecord) -> str:
        p = v.forecast.step
        if v.predicted and v.predicted_kind == "too_slow" and v.step_s:
            return f"{v.step_s:.3g}s (not run)"
        return "-" if not p else f"{p.step_s:.3g}s +-{100 * p.error:.0f}%"

    def peak(v: TrialRecord) -> str:
        p = v.forecast.peak_memory_bytes
        return format_bytes(p) if p else "-"

    cols = [[f"#{v.number}" + (" (baseline)" if v.is_baseline else "") for v in rows],
            [v.config.describe() for v in rows],
            ["ruled out" if v.predicted else v.status for v in rows],
            [step(v) for v in rows],
            ["-" if v.predicted or v.step_s is None else f"{v.step_s:.3g}s" for v in rows],
            [peak(v) for v in rows],
            ["-" if v.predicted or not v.peak_memory_bytes else format_bytes(v.peak_memory_bytes)
             for v in rows]]
    return go.Figure(go.Table(
        header={"values": ["trial", "config", "outcome", "step (predicted)", "step (measured)",
                           "peak (predicted)", "peak (measured)"]},
        cells={"values": cols}))
