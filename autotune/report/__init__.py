"""What a study shows a person: the static dashboard (``dashboard``: one self-contained HTML
file, its header and ``panels``, drawn from what ``data.gather`` reads of the study) and the
live view beside a running study (``live``: optuna-dashboard on 127.0.0.1)."""

from autotune.report.dashboard import (
    build_dashboard,
    load_for_dashboard,
    render,
    write_dashboard,
    write_pngs,
)
from autotune.report.data import DashboardData, gather
from autotune.report.live import READ_METHODS, guard, serve, serve_live
from autotune.report.panels import PANELS, panels

__all__ = [
    "PANELS", "READ_METHODS", "DashboardData", "build_dashboard", "gather", "guard",
    "load_for_dashboard", "panels", "render", "serve", "serve_live", "write_dashboard",
    "write_pngs",
]
