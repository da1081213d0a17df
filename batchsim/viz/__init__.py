"""Figures and dashboards: ``batchsim.viz.plots`` (matplotlib) and ``.widgets`` (ipywidgets).

Not imported by ``import batchsim``: matplotlib and ipywidgets load only when this
package is.
"""

from .plots import (
    batch_size_hist,
    frontier,
    heatmap,
    latency_cdf,
    latency_hist,
    queue_length,
    service_profile,
    timeline,
)
from .widgets import basics_dashboard, tradeoff_dashboard

__all__ = ["timeline", "latency_hist", "latency_cdf", "batch_size_hist", "queue_length",
           "service_profile", "frontier", "heatmap", "basics_dashboard", "tradeoff_dashboard"]
