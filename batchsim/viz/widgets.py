"""Dashboards: sliders that re-run the simulator and redraw one figure in place.

A dashboard shows its controls, then one matplotlib figure rendered as a PNG into an
``ipywidgets.Image`` of fixed size, then a status line. Moving a control (sliders use
``continuous_update=False``, so on release) re-simulates, redraws the same figure and
replaces the image: this works in JupyterLab, in classic Notebook and under nbval
without ipympl. An error is drawn into the figure and shown in red in the status line,
never swallowed. ``controls``, ``result``, ``summary``, ``figure``, ``image`` and
``error`` are attributes, so pytest drives a dashboard like a user would.
"""

from __future__ import annotations

import html
import io
import traceback

import ipywidgets as widgets
from matplotlib.figure import Figure

from .. import _check, quick
from ..policy import BatchPolicy
from ..service import AffineService
from ..sim import simulate
from ..workload import Poisson, Workload
from . import plots

_SLIDER = {"continuous_update": False, "style": {"description_width": "initial"},
           "layout": widgets.Layout(width="320px")}


class Dashboard:
    """Controls, one figure redrawn on every change, and a status line.

    Subclasses implement ``compute(**values)`` (returns the result to show),
    ``draw(figure, result)`` (draws it into the cleared figure) and ``describe(result)``
    (HTML for the status line). ``update()`` runs the three and renders the PNG.
    """

    def __init__(self, controls: dict, figsize=(10, 6.5), dpi=90):
        self.controls = controls
        self.figure = Figure(figsize=figsize, dpi=dpi, layout="constrained")
        width_px, height_px = (int(v * dpi) for v in figsize)
        self.image = widgets.Image(format="png", layout=widgets.Layout(
            width=f"{width_px}px", height=f"{height_px}px"))
        self.status = widgets.HTML()
        self.result = None
        self.error: str | None = None
        rows = [widgets.HBox(list(controls.values())[i:i + 3])
                for i in range(0, len(controls), 3)]
        self.widget = widgets.VBox(rows + [self.image, self.status])
        for control in controls.values():
            control.observe(self._changed, names="value")

    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def _changed(self, _change) -> None:
        self.update()

    def update(self) -> None:
        """Re-compute and redraw for the current control values."""
        self.figure.clear()
        try:
            result = self.compute(**self.values())
            self.draw(self.figure, result)
            self.result, self.error = result, None
            self.status.value = self.describe(result)
        except Exception as exc:  # shown to the user, not swallowed
            self.result = None
            self.error = "".join(traceback.format_exception_only(exc)).strip()
            self.figure.clear()
            self.figure.text(0.5, 0.5, self.error, ha="center", va="center", color="#b00020",
                             wrap=True)
            detail = html.escape("".join(traceback.format_exception(exc)))
            self.status.value = (f'<b style="color:#b00020">{html.escape(self.error)}</b>'
                                 f"<details><summary>traceback</summary><pre>{detail}</pre>"
                                 f"</details>")
        buf = io.BytesIO()
        self.figure.savefig(buf, format="png")
        self.image.value = buf.getvalue()

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def compute(self, **values):
        raise NotImplementedError

    def draw(self, figure: Figure, result) -> None:
        raise NotImplementedError

    def describe(self, result) -> str:
        raise NotImplementedError


class BasicsDashboard(Dashboard):
    """One simulated run: the timeline, the latency distribution and batch sizes.

    The arrival rate is ``load`` times the capacity of one worker at the initial
    ``max_batch_size`` (``reference_rps``): the traffic stays put while the policy
    sliders and the number of workers change, as it would in front of a real server.
    """

    def __init__(self, service, workload: Workload, n_requests: int, seed: int,
                 reference_rps: float, reference_batch_size: int, controls: dict):
        self.service = service
        self.workload = workload
        self.n_requests = n_requests
        self.seed = seed
        self.reference_rps = reference_rps
        self.reference_batch_size = reference_batch_size
        super().__init__(controls)
        self.axes: dict = {}
        self.update()

    def compute(self, max_batch_size, max_wait_ms, load, workers):
        policy = BatchPolicy(max_batch_size=max_batch_size, max_wait_ms=max_wait_ms)
        workload = self.workload.with_rate(load * self.reference_rps)
        return simulate(workload, policy, self.service, n_requests=self.n_requests,
                        workers=workers, seed=self.seed)

    @property
    def summary(self) -> dict | None:
        """``result.summary()`` of the run on show (None after an error)."""
        return None if self.result is None else self.result.summary()

    def draw(self, figure, res):
        self.axes = figure.subplot_mosaic([["timeline", "timeline"], ["latency", "batch"]],
                                          height_ratios=[1, 1.1])
        middle_s = res.arrival_s[res.n_requests // 2]  # a window in steady state
        plots.timeline(res, t0_s=middle_s, ax=self.axes["timeline"])
        plots.latency_hist(res, ax=self.axes["latency"])
        plots.batch_size_hist(res, ax=self.axes["batch"])
        s = res.summary()
        figure.suptitle(f"p50 {s['latency_ms_p50']:.2f} ms   p99 {s['latency_ms_p99']:.2f} ms"
                        f"   throughput {s['throughput_rps']:,.0f} requests/s"
                        f"   mean batch {s['mean_batch_size']:.1f}"
                        f"   utilization {100 * s['utilization']:.0f}%")

    def describe(self, res):
        load = self.controls["load"].value
        return (f"{type(self.workload).__name__} arrivals at "
                f"{load * self.reference_rps:,.0f} requests/s = {load:.2f} × "
                f"{self.reference_rps:,.0f} requests/s, the capacity of one worker at batch "
                f"size {self.reference_batch_size}; {self.n_requests:,} requests, "
                f"seed {self.seed}.")


def basics_dashboard(service=None, n_requests=None, workload=None, seed=0,
                     max_batch_size=32, max_wait_ms=2.0, load=0.7, workers=1):
    """Sliders for max_batch_size, max_wait_ms, load and workers over one simulated run.

    ``service`` defaults to a GPU-like ``AffineService(base_ms=1.9, per_item_ms=0.14)``,
    ``workload`` to Poisson arrivals (any workload works: its shape is kept and its rate
    set by the load slider), ``n_requests`` to 20,000 (4,000 in quick mode). The keyword
    arguments after ``seed`` are the sliders' starting values.
    """
    service = AffineService(base_ms=1.9, per_item_ms=0.14) if service is None else service
    workload = Poisson(rate_rps=1.0) if workload is None else workload
    if not isinstance(workload, Workload):
        raise ValueError(f"workload must be a batchsim workload (Poisson, ...), got {workload!r}")
    n = (4000 if quick() else 20_000) if n_requests is None else n_requests
    n = _check.positive_int("n_requests", n)
    b = _check.positive_int("max_batch_size", max_batch_size)
    controls = {
        "max_batch_size": widgets.IntSlider(value=b, min=1, max=max(64, b),
                                            description="max_batch_size", **_SLIDER),
        "max_wait_ms": widgets.FloatSlider(
            value=_check.non_negative("max_wait_ms", max_wait_ms),
            min=0.0, max=max(20.0, max_wait_ms), step=0.5, description="max_wait_ms",
            **_SLIDER),
        "load": widgets.FloatSlider(value=_check.positive("load", load), min=0.05,
                                    max=max(1.5, load), step=0.05, description="load",
                                    **_SLIDER),
        "workers": widgets.IntSlider(value=_check.positive_int("workers", workers), min=1,
                                     max=max(4, workers), description="workers", **_SLIDER),
    }
    return BasicsDashboard(service, workload, n, seed, service.capacity_rps(b), b, controls)
