"""The dashboard's panels: one plotly figure each, drawn from ``DashboardData`` alone.

Panels answer what a user asks of a study: how the search went (history), where the memory wall
is (throughput and peak memory against micro-batch size), which knob mattered (PED-ANOVA
importances, parallel coordinates), why the winner wins (where step time goes), what ran when
(timeline), how close to the hardware it gets and what held the GPUs back (MFU, SM
utilisation), what to take (top configs) and how the models' predictions held.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

from autotune.report.data import DashboardData
from autotune.report.effects import Effect
from autotune.report.importance import Importance
from autotune.trial.measurement import Status
from autotune.tuner.record import TrialRecord
from autotune.units import format_bytes

if TYPE_CHECKING:
    from plotly.graph_objects import Figure

PANELS = (
    "Optimization history",
    "Samples/sec by micro-batch size",
    "Peak memory by micro-batch size (and sharding)",
    "Measured effects (one knob at a time)",
    "Statistical importance (PED-ANOVA, sampled trials)",
    "Parallel coordinates",
    "Where step time goes",
    "MFU and GPU utilisation",
    "Trial timeline",
    "Top configs",
    "Predicted and measured",
)
_AMP_COLOURS = {"off": "#1f77b4", "bf16": "#2ca02c", "fp16": "#ff7f0e"}
_STRATEGY_SYMBOLS = {"replicated": "circle", "shard-grad-op": "square", "full-shard": "triangle-up",
                     "hybrid-shard": "star"}
_STATUS_COLOURS = {"ok": "#2ca02c", "oom": "#d62728", "timeout": "#9467bd", "error": "#7f7f7f",
                   "pruned": "#bcbd22", "diverged": "#e377c2"}
_PARTS = (("data_wait", "data wait", "#ff7f0e"), ("comm_wait", "communication", "#9467bd"),
          ("compute", "compute", "#1f77b4"))


def panels(data: DashboardData) -> list[tuple[str, Figure]]:
    """(title, plotly figure) for each panel, in PANELS order."""
    views, limit = list(data.records), data.limit
    figures = [_history(views), _rate_by_micro(views, limit), _memory_by_micro(views, limit),
               _effects(data.effects), _importance(data.importance), _parallel(views),
               _breakdown(views),
               _efficiency(views), _timeline(views), _top_table(views, limit),
               _forecasts(views)]
    for title, fig in zip(PANELS, figures, strict=True):
        # Parallel coordinates put their axis labels above the plot: give them room.
        top = 60 if title == "Parallel coordinates" else 20
        # The importance panel may name the knobs it left out under its axis.
        bottom = 80 if title.startswith("Statistical importance") else 40
        fig.update_layout(margin={"t": top, "b": bottom, "l": 60, "r": 20}, height=420)
    return list(zip(PANELS, figures, strict=True))


def _go() -> ModuleType:
    import plotly.graph_objects as go

    return go


def _history(views: list[TrialRecord]) -> Figure:
    go = _go()
    fig = go.Figure()
    ok = [v for v in views if v.status == Status.OK and v.samples_per_sec]
    fig.add_scatter(x=[v.number for v in ok], y=[v.samples_per_sec for v in ok], mode="markers",
                    name="trial", text=[v.config.describe() for v in ok])
    best, xs, ys = 0.0, [], []
    for v in ok:
        best = max(best, v.samples_per_sec or 0.0)
        xs.append(v.number)
        ys.append(best)
    fig.add_scatter(x=xs, y=ys, mode="lines", line={"shape": "hv"}, name="best so far")
    failed = [v for v in views if v.status != Status.OK]
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


def _rate_by_micro(views: list[TrialRecord], limit: int) -> Figure:
    go = _go()
    fig = go.Figure()
    for amp, group in _by_amp(views).items():
        ok = [v for v in group if v.status == Status.OK and v.samples_per_sec]
        fig.add_scatter(
            x=[v.config.micro_batch_size for v in ok], y=[v.samples_per_sec for v in ok],
            mode="markers", name="fp32" if amp == "off" else amp,
            marker={"color": _AMP_COLOURS.get(amp), "size": 9,
                    # Over the memory limit: measured, but not a config to take.
                    "symbol": ["circle-open" if limit and v.peak_memory_bytes > limit
                               else "circle" for v in ok]},
            text=[v.config.describe() for v in ok])
    failed = [v for v in views
              if v.status in (Status.OOM, Status.TIMEOUT, Status.ERROR, Status.DIVERGED)
              or v.predicted]
    fig.add_scatter(x=[v.config.micro_batch_size for v in failed], y=[0] * len(failed),
                    mode="markers", name="OOM / too slow / error / ruled out",
                    marker={"symbol": "x", "size": 10,
                            "color": [_STATUS_COLOURS.get(v.status) for v in failed]},
                    text=[f"{v.config.describe()}: {v.reason}" for v in failed])
    fig.update_xaxes(title="micro-batch size", type="log", dtick=math.log10(2))
    fig.update_yaxes(title="samples/sec (open: over the memory limit)")
    return fig


def _memory_by_micro(views: list[TrialRecord], limit: int) -> Figure:
    """Peak memory per precision and, where the study sharded, per sharding strategy (each
    its own marker), against the limit; the strategies the memory model ruled out as
    predicted points, each with its prediction."""
    go = _go()
    fig = go.Figure()
    groups: dict[tuple[str, str], list[TrialRecord]] = {}
    for v in views:
        groups.setdefault((v.config.amp, v.config.sharding), []).append(v)
    sharded = len({sharding for _, sharding in groups}) > 1
    for (amp, sharding), group in groups.items():
        ran = [v for v in group if v.peak_memory_bytes and not v.predicted]
        name = "fp32" if amp == "off" else amp
        fig.add_scatter(x=[v.config.micro_batch_size for v in ran],
                        y=[v.peak_memory_bytes / 2**30 for v in ran], mode="markers",
                        name=f"{name}, {sharding}" if sharded else name,
                        marker={"color": _AMP_COLOURS.get(amp), "size": 9,
                                "symbol": ["x" if v.status == Status.OOM else
                                           _STRATEGY_SYMBOLS.get(sharding, "circle")
                                           for v in ran]},
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


def _effects(effects: Sequence[Effect]) -> Figure:
    """Each knob's largest measured effect (``report.effects``), the largest on top: the ratio
    to the trial it changed one knob of, its margin as an error bar, solid where it is beyond
    the noise, and the words in the hover."""
    go = _go()
    fig = go.Figure()
    if not effects:
        fig.add_annotation(text="no trial yet changed one knob of another measured trial",
                           showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
        fig.update_xaxes(visible=False)
        fig.update_yaxes(visible=False)
        return fig
    shown = list(effects)[::-1]  # the largest on top
    fig.add_bar(
        x=[e.ratio - 1.0 for e in shown], y=[e.knob for e in shown], orientation="h",
        error_x={"type": "data", "array": [e.margin for e in shown], "visible": True},
        marker={"color": ["#2ca02c" if e.beyond_noise and e.ratio > 1 else
                          "#d62728" if e.beyond_noise else "#c7c7c7" for e in shown]},
        text=[f"{e.ratio:.2f}x" + (" confirmed" if e.confirmed else "") for e in shown],
        hovertext=[e.words() for e in shown], hoverinfo="text")
    fig.update_xaxes(title="change in samples/sec against the trial it changed one knob of "
                           "(grey: within the noise, the bar's margin)", tickformat="+.0%")
    return fig


def _importance(imp: Importance) -> Figure:
    """The knobs ranked (``importance.rank``), or why none are; the knobs that never changed
    are named, not drawn."""
    go = _go()
    fig = go.Figure()
    unvaried = ("never changed, not ranked: " + ", ".join(imp.unvaried)) if imp.unvaried \
        else ""
    if imp.ranked:
        names = [name for name, _ in imp.ranked][::-1]  # the most important on top
        shares = dict(imp.ranked)
        fig.add_bar(x=[shares[n] for n in names], y=names, orientation="h")
        fig.update_xaxes(title=f"importance for samples/sec (normalised; {imp.trials} measured "
                               "trials)" + (f"<br>{unvaried}" if unvaried else ""))
    else:
        fig.add_annotation(text="<br>".join(filter(None, [imp.why_empty, unvaried])),
                           showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
        fig.update_xaxes(visible=False)
        fig.update_yaxes(visible=False)
    return fig


def _parallel(views: list[TrialRecord]) -> Figure:
    go = _go()
    ok = [v for v in views if v.status == Status.OK and v.samples_per_sec]
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


def _breakdown(views: list[TrialRecord]) -> Figure:
    go = _go()
    ok = [v for v in views if v.status == Status.OK and v.breakdown]
    labels = [f"#{v.number} {v.config.describe()}" for v in ok]
    fig = go.Figure()
    for key, name, colour in _PARTS:
        fig.add_bar(x=labels, y=[100 * v.breakdown.get(key, 0.0) for v in ok], name=name,
                    marker_color=colour)
    fig.update_layout(barmode="stack")
    fig.update_yaxes(title="% of step time", range=[0, 100])
    return fig


def _efficiency(views: list[TrialRecord]) -> Figure:
    """MFU per trial and, when the GPUs were watched, their mean GPU utilisation."""
    go = _go()
    ok = [v for v in views if v.status == Status.OK and v.reused_from is None]
    labels = [f"#{v.number} {v.config.describe()}" for v in ok]
    fig = go.Figure()
    fig.add_bar(x=labels, y=[None if v.mfu is None else 100 * v.mfu for v in ok],
                name="MFU (% of measured peak)", marker_color="#1f77b4")
    if any(v.gpu_util is not None for v in ok):
        fig.add_scatter(x=labels, y=[v.gpu_util for v in ok], mode="markers+lines",
                        name="GPU utilisation (% mean, NVML)", marker_color="#d62728")
    fig.update_yaxes(title="%", rangemode="tozero")
    return fig


def _timeline(trials: list[TrialRecord]) -> Figure:
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


def _top_table(views: list[TrialRecord], limit: int) -> Figure:
    go = _go()
    ok = [v for v in views if v.status == Status.OK and v.samples_per_sec and v.reused_from is None
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


def _forecasts(views: list[TrialRecord]) -> Figure:
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
