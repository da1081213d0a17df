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
import math
import traceback
from dataclasses import dataclass

import ipywidgets as widgets
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import LogLocator, NullLocator
from PIL import Image

from .. import _check, quick
from ..policy import BatchPolicy
from ..seeding import streams
from ..service import AffineService, ServiceModel, load_service, shipped_profiles
from ..sim import simulate
from ..sweep import sweep
from ..workload import Bursty, Diurnal, Gamma, Poisson, Ramp, Workload
from . import plots

_SLIDER = {"continuous_update": False, "style": {"description_width": "initial"},
           "layout": widgets.Layout(width="320px")}


def _n_requests(n_requests) -> int:
    """Requests per run: ``n_requests`` checked, or by default 20,000 (4,000 in quick mode)."""
    if n_requests is None:
        n_requests = 4000 if quick() else 20_000
    return _check.positive_int("n_requests", n_requests)


def _load_and_workers(load, max_load: float, workers) -> dict:
    """The ``load`` (fraction of a capacity, up to ``max_load``) and ``workers`` sliders."""
    return {
        "load": widgets.FloatSlider(value=_check.positive("load", load), min=min(0.05, load),
                                    max=max(max_load, load), step=0.05, description="load",
                                    **_SLIDER),
        "workers": widgets.IntSlider(value=_check.positive_int("workers", workers), min=1,
                                     max=max(4, workers), description="workers", **_SLIDER),
    }


class Dashboard:
    """Controls, one figure redrawn on every change, and a status line.

    Subclasses implement ``compute(**values)`` (returns the result to show),
    ``draw(figure, result)`` (draws it into the cleared figure) and ``describe(result)``
    (HTML for the status line). ``update()`` runs the three and renders the PNG.
    """

    def __init__(self, controls: dict, figsize=(10, 6.5), dpi=90):
        self.controls = controls
        self.figure = Figure(figsize=figsize, dpi=dpi, layout="constrained")
        FigureCanvasAgg(self.figure)
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
        self.image.value = self.png()

    def png(self) -> bytes:
        """The figure as PNG bytes: drawn once on its Agg canvas, encoded at a fast zlib
        level (the image is shown once, never stored). ``savefig`` would draw it twice."""
        canvas = self.figure.canvas
        canvas.draw()
        buf = io.BytesIO()
        Image.frombuffer("RGBA", canvas.get_width_height(), canvas.buffer_rgba()).save(
            buf, format="png", compress_level=1)
        return buf.getvalue()

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
        # Fixed margins instead of constrained layout: the panels never change shape,
        # and laying out every text on each slider move would cost a fifth of the redraw.
        self.figure.set_layout_engine("none")
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
        self.axes = figure.subplot_mosaic(
            [["timeline", "timeline"], ["latency", "batch"]], height_ratios=[1, 1.1],
            gridspec_kw={"left": 0.085, "right": 0.79, "bottom": 0.085, "top": 0.9,
                         "hspace": 0.4, "wspace": 0.22})
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
    if not isinstance(service, ServiceModel):
        raise ValueError(f"service must be a service model (AffineService, ...), got "
                         f"{service!r}")
    workload = Poisson(rate_rps=1.0) if workload is None else workload
    if not isinstance(workload, Workload):
        raise ValueError(f"workload must be a batchsim workload (Poisson, ...), got {workload!r}")
    streams(seed)  # checks the seed before a run shows it as an error
    n = _n_requests(n_requests)
    b = _check.positive_int("max_batch_size", max_batch_size)
    controls = {
        "max_batch_size": widgets.IntSlider(value=b, min=1, max=max(64, b),
                                            description="max_batch_size", **_SLIDER),
        "max_wait_ms": widgets.FloatSlider(
            value=_check.non_negative("max_wait_ms", max_wait_ms),
            min=0.0, max=max(20.0, max_wait_ms), step=0.5, description="max_wait_ms",
            **_SLIDER),
        **_load_and_workers(load, 1.5, workers),
    }
    return BasicsDashboard(service, workload, n, seed, service.capacity_rps(b), b, controls)


# -- the trade-off explorer --------------------------------------------------------------
#: max_batch_size values of the frontier grid; the dashboard's slider ends at the largest.
FRONTIER_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
#: Loads of the frontier grid, as fractions of the capacity at the largest batch size.
FRONTIER_LOADS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
#: Arrival processes of the trade-off dashboard, each built from a mean rate and the
#: expected span of the run (``n_requests / rate_rps``): a ramp spans the run, a "day"
#: lasts half of it and about 20 bursts come in it, whatever the load.
ARRIVALS = {
    "Poisson": lambda rate_rps, span_s: Poisson(rate_rps),
    "Gamma, cv 0.5 (smoother)": lambda rate_rps, span_s: Gamma(rate_rps, cv=0.5),
    "Gamma, cv 2 (burstier)": lambda rate_rps, span_s: Gamma(rate_rps, cv=2.0),
    # on 40% of the time at twice the mean rate, off 60% of it at a third of the mean
    "Bursty (on/off MMPP)": lambda rate_rps, span_s: Bursty(
        2 * rate_rps, rate_rps / 3, mean_on_s=0.02 * span_s, mean_off_s=0.03 * span_s),
    "Ramp (0.5× to 1.5× the mean)": lambda rate_rps, span_s: Ramp(
        0.5 * rate_rps, 1.5 * rate_rps, duration_s=span_s),
    "Diurnal (±50%, two cycles)": lambda rate_rps, span_s: Diurnal(
        rate_rps, amplitude=0.5, period_s=span_s / 2),
}


def wait_grid_ms(service: ServiceModel) -> tuple:
    """max_wait_ms values of the frontier grid: 0, then the 1-2-5 steps from ``s(top)/20``
    to ``s(top)``, ``top`` the largest grid batch size: waits on the time scale of a batch,
    so that a 0.1 ms GPU kernel and a 20 ms one both get a useful grid."""
    top_ms = float(service.mean_ms(FRONTIER_SIZES[-1]))
    low_ms = top_ms / 20
    decades = range(math.floor(math.log10(low_ms)), math.ceil(math.log10(top_ms)) + 1)
    steps = (float(f"{m * 10.0**e:.12g}") for e in decades for m in (1, 2, 5))
    return (0.0,) + tuple(v for v in steps if low_ms <= v <= top_ms)


def _wait_step_ms(top_ms: float) -> float:
    """The max_wait_ms slider's step: a 200th of its range, to three significant digits."""
    return float(f"{top_ms / 200:.3g}")


def default_services() -> dict:
    """Name -> service model: the GPU-like affine model of notebook 01, then every shipped
    measured profile (the tiny CPU models and the NVIDIA H200 ones)."""
    return {"affine 1.9 ms + 0.14 ms × b": AffineService(base_ms=1.9, per_item_ms=0.14),
            **{name: load_service(name) for name in shipped_profiles()}}


@dataclass(frozen=True, eq=False)
class Tradeoff:
    """What the trade-off dashboard shows.

    ``summary``: the run of ``policy`` on ``workers`` workers of ``service`` under
    ``arrival`` traffic at ``rate_rps``, which is ``load`` times the capacity at the
    largest grid batch size. ``runs``: sweep rows of every grid configuration at every
    frontier load; ``frontier``: at each load, the row with the lowest p99; ``here``: the
    grid at the chosen load; ``best``: the frontier row with the most throughput within
    ``slo_ms`` (None when no load meets it).
    """

    service: str
    arrival: str
    summary: dict
    policy: BatchPolicy
    workers: int
    load: float
    rate_rps: float
    slo_ms: float
    runs: pd.DataFrame
    frontier: pd.DataFrame
    here: pd.DataFrame
    best: pd.Series | None

    @property
    def backdrop_key(self) -> tuple:
        """What the figure shows besides the chosen policy: a change redraws it all."""
        return (self.service, self.arrival, self.workers, round(self.load, 9), self.slo_ms)


class TradeoffDashboard(Dashboard):
    """Where one configuration sits on the latency/throughput frontier.

    Left: every configuration of the grid ``FRONTIER_SIZES`` x ``wait_grid_ms(service)``
    at every load of ``FRONTIER_LOADS`` (grey dots: p99 against throughput), the
    frontier (the lowest p99 at each load), the SLO, and the chosen configuration (star:
    p99, ring: p50). Right: p99 over the grid at the chosen load, with the SLO boundary
    and the chosen policy (a square, between cells when off the grid).

    Moving max_batch_size or max_wait_ms must feel instant, so nothing is redone that
    does not change: grid sweeps are cached per (service, arrival, workers, load), and
    the backdrop (everything but the chosen policy) is drawn once into a figure of its
    own and kept as a bitmap. A move simulates one run, pastes the bitmap, draws the
    markers and the title over it (blitting) and shows the result. ``grids`` is the
    cache: (service, arrival, workers, load) -> sweep rows. ``axes`` are the backdrop's;
    ``marks`` holds the markers drawn over it (Line2D artists with gids ``chosen_p50``,
    ``chosen_p99`` and ``chosen_cell``) and the title.
    """

    def __init__(self, services: dict, n_requests: int, seed: int, controls: dict,
                 progress: bool):
        self.services = services
        self.n_requests = n_requests
        self.seed = seed
        self.grids: dict = {}
        self._fitting = False  # True while the max_wait_ms slider is fitted to a service
        # Registered before the dashboard's own observers: a new service first gets its
        # slider range, then one update runs with the (possibly clamped) wait.
        controls["service"].observe(self._fit_wait_slider, names="value")
        super().__init__(controls, figsize=(11, 4.8))
        self.figure.set_layout_engine("none")  # it holds only the composed bitmap
        self.backdrop = Figure(figsize=self.figure.get_size_inches(), dpi=self.figure.dpi)
        FigureCanvasAgg(self.backdrop)
        self._drawn: tuple | None = None  # the Tradeoff.backdrop_key drawn, if any
        self.axes: dict = {}
        self.marks: dict = {}
        v = self.values()
        self.grid(v["service"], v["arrival"], v["workers"], FRONTIER_LOADS, progress=progress)
        self.update()

    def _changed(self, change) -> None:
        if not self._fitting:  # a wait clamped by _fit_wait_slider: the service's update follows
            super()._changed(change)

    def _fit_wait_slider(self, change) -> None:
        """The max_wait_ms slider spans the new service's wait grid, 0 to its largest wait,
        in 200 steps; a wait past the new end is clamped to it. A service whose grid cannot
        be made leaves the slider as it is (the update shows the error)."""
        try:
            top_ms = wait_grid_ms(self.services[change["new"]])[-1]
        except Exception:
            return
        slider = self.controls["max_wait_ms"]
        self._fitting = True
        try:
            slider.step = _wait_step_ms(top_ms)
            slider.max = top_ms
        finally:
            self._fitting = False

    def rate_rps(self, service: str, workers: int, load: float) -> float:
        """``load`` times the capacity of ``workers`` workers at the largest grid size."""
        return load * self.services[service].capacity_rps(FRONTIER_SIZES[-1], workers)

    def workload(self, arrival: str, rate_rps: float) -> Workload:
        return ARRIVALS[arrival](rate_rps, self.n_requests / rate_rps)

    def grid(self, service: str, arrival: str, workers: int, loads,
             progress: bool = False) -> pd.DataFrame:
        """Sweep rows of the whole grid at each of ``loads``; only uncached loads run."""
        from tqdm.auto import tqdm

        keys = [(service, arrival, workers, round(float(x), 9)) for x in loads]
        missing = [k for k in dict.fromkeys(keys) if k not in self.grids]
        model = self.services[service]
        waits = wait_grid_ms(model)
        if missing:
            self.status.value = (f"<i>simulating {len(missing) * len(FRONTIER_SIZES) * len(waits)}"
                                 f" configurations of {html.escape(service)} …</i>")
        for key in tqdm(missing, desc="frontier", unit="load", disable=not (progress and missing)):
            runs = sweep(self.workload(arrival, self.rate_rps(service, workers, key[-1])), model,
                         FRONTIER_SIZES, waits, workers=workers, seeds=self.seed,
                         n_requests=self.n_requests, progress=False)
            runs.insert(2, "load", key[-1])
            self.grids[key] = runs
        return pd.concat([self.grids[k] for k in keys], ignore_index=True)

    def compute(self, max_batch_size, max_wait_ms, load, workers, slo_ms, service, arrival):
        policy = BatchPolicy(max_batch_size=max_batch_size, max_wait_ms=max_wait_ms)
        runs = self.grid(service, arrival, workers, FRONTIER_LOADS)
        here = self.grid(service, arrival, workers, [load])
        rate_rps = self.rate_rps(service, workers, load)
        res = simulate(self.workload(arrival, rate_rps), policy, self.services[service],
                       n_requests=self.n_requests, workers=workers, seed=self.seed)
        frontier = runs.loc[runs.groupby("load")["latency_ms_p99"].idxmin()]
        within = frontier[frontier["latency_ms_p99"] <= slo_ms]
        best = within.loc[within["throughput_rps"].idxmax()] if len(within) else None
        return Tradeoff(service, arrival, res.summary(), policy, workers, load, rate_rps,
                        slo_ms, runs, frontier.reset_index(drop=True), here, best)

    def draw(self, figure, t):
        s = t.summary
        x, p50, p99 = s["throughput_rps"], s["latency_ms_p50"], s["latency_ms_p99"]
        if t.backdrop_key != self._drawn or not self._in_view(x, p50, p99):
            self._drawn = None
            self._draw_backdrop(t)  # autoscaled to show the chosen point too
            self._drawn = t.backdrop_key
        self.marks["chosen_p50"].set_data([x], [p50])
        self.marks["chosen_p99"].set_data([x], [p99])
        waits = np.sort(t.here["max_wait_ms"].unique())
        self.marks["chosen_cell"].set_data(
            [np.interp(np.log2(t.policy.max_batch_size), np.log2(FRONTIER_SIZES),
                       np.arange(len(FRONTIER_SIZES)))],
            [np.interp(t.policy.max_wait_ms, waits, np.arange(waits.size))])
        verdict = "meets" if p99 <= t.slo_ms else "misses"
        self.marks["title"].set_text(
            f"max_batch_size={t.policy.max_batch_size}, max_wait_ms={t.policy.max_wait_ms:g},"
            f" {t.workers} worker(s) at {t.rate_rps:,.0f} requests/s: p50 {p50:.3g} ms, "
            f"p99 {p99:.3g} ms {verdict} the SLO of {t.slo_ms:.3g} ms")
        canvas = self.backdrop.canvas
        canvas.restore_region(self._bitmap)
        for artist in self.marks.values():
            self.backdrop.draw_artist(artist)
        figure.figimage(np.asarray(canvas.buffer_rgba()).copy())

    def _in_view(self, x, *latencies_ms) -> bool:
        ax = self.axes.get("frontier")
        if ax is None:
            return False
        (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
        return x0 <= x <= x1 and all(y0 <= y <= y1 for y in latencies_ms)

    def _draw_backdrop(self, t):
        """Draw everything but the chosen policy and keep it as ``self._bitmap``."""
        fig = self.backdrop
        fig.clear()
        ax, grid_ax = fig.subplots(1, 2, width_ratios=(1.25, 1), gridspec_kw=dict(
            left=0.075, right=0.975, bottom=0.16, top=0.86, wspace=0.2))
        self.axes = {"frontier": ax, "grid": grid_ax}
        s, slo = t.summary, t.slo_ms
        ax.scatter(t.runs["throughput_rps"], t.runs["latency_ms_p99"], s=9, color="0.75",
                   label="p99 of each configuration", gid="runs")
        ax.plot(t.frontier["throughput_rps"], t.frontier["latency_ms_p99"], "o-",
                color="black", markersize=3, label="frontier: lowest p99 at each load",
                gid="frontier")
        ax.axhline(slo, color="red", linestyle="--", label=f"SLO: p99 ≤ {slo:.3g} ms",
                   gid="slo")
        if t.best is not None:
            ax.plot(t.best["throughput_rps"], t.best["latency_ms_p99"], "D", color="red",
                    markersize=8, gid="best",
                    label=f"most within the SLO: {t.best['throughput_rps']:,.0f} requests/s")
        self.marks = {
            "chosen_p50": ax.plot(s["throughput_rps"], s["latency_ms_p50"], "o",
                                  markerfacecolor="none", markeredgecolor="tab:orange",
                                  markeredgewidth=2, markersize=9, animated=True,
                                  label="chosen policy: p50", gid="chosen_p50")[0],
            "chosen_p99": ax.plot(s["throughput_rps"], s["latency_ms_p99"], "*",
                                  color="tab:orange", markeredgecolor="black",
                                  markersize=17, animated=True, label="chosen policy: p99",
                                  gid="chosen_p99")[0],
        }
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter("{x:g}")
        ax.yaxis.set_minor_locator(NullLocator())
        ax.set_xlabel(plots.axis_label("throughput_rps"))
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"The frontier over load, {t.workers} worker(s)")
        ax.legend(fontsize="small", loc="upper left")

        plots.heatmap(t.here, value="latency_ms_p99", slo_ms=slo, ax=grid_ax)
        grid_ax.set_title(f"p99 latency (ms) at load {t.load:.2f}")
        self.marks["chosen_cell"] = grid_ax.plot(
            [], [], "s", markerfacecolor="none", markeredgecolor="tab:orange",
            markeredgewidth=3, markersize=22, animated=True, gid="chosen_cell")[0]
        self.marks["title"] = fig.suptitle("", animated=True)
        fig.canvas.draw()
        self._bitmap = fig.canvas.copy_from_bbox(fig.bbox)

    def describe(self, t):
        s = t.summary
        lowest = t.here.loc[t.here["latency_ms_p99"].idxmin()]
        most = ("no load of the grid meets the SLO" if t.best is None else
                f"the most throughput within the SLO is {t.best['throughput_rps']:,.0f} "
                f"requests/s (load {t.best['load']:g}, max_batch_size="
                f"{int(t.best['max_batch_size'])}, max_wait_ms={t.best['max_wait_ms']:g})")
        return (f"{html.escape(t.arrival)} arrivals at {t.rate_rps:,.0f} requests/s = "
                f"load {t.load:.2f} × {t.rate_rps / t.load:,.0f} requests/s, the capacity of "
                f"{t.workers} worker(s) of {html.escape(t.service)} at batch size "
                f"{FRONTIER_SIZES[-1]}; {self.n_requests:,} requests per run, seed "
                f"{self.seed}.<br>Chosen policy: p50 {s['latency_ms_p50']:.3g} ms, p99 "
                f"{s['latency_ms_p99']:.3g} ms, mean batch {s['mean_batch_size']:.1f}, "
                f"utilization {100 * s['utilization']:.0f}%. Lowest p99 of the grid at this "
                f"load: {lowest['latency_ms_p99']:.3g} ms (max_batch_size="
                f"{int(lowest['max_batch_size'])}, max_wait_ms={lowest['max_wait_ms']:g}). "
                f"On the frontier, {most}.")


def tradeoff_dashboard(services=None, service=None, arrival="Poisson", n_requests=None,
                       seed=0, progress=True, max_batch_size=32, max_wait_ms=2.0, load=0.3,
                       workers=1, slo_ms=10.0):
    """Sliders and dropdowns that place one configuration on the latency/throughput frontier.

    ``services``: name -> service model for the dropdown (default ``default_services()``:
    the affine model of notebook 01 and every shipped profile, the H200 ones included);
    ``service``: the name shown first (default the first). ``arrival``: a key of
    ``ARRIVALS``. ``n_requests`` per run defaults to 20,000 (4,000 in quick mode). The
    first frontier sweep shows a progress bar when ``progress``. The keyword arguments
    after ``progress`` are the controls' starting values; ``load`` is a fraction of the
    capacity of ``workers`` workers at batch size 128. The max_wait_ms slider runs from 0
    to the largest wait of the chosen service's grid (``wait_grid_ms``), and follows the
    service dropdown.
    """
    services = default_services() if services is None else services
    if not isinstance(services, dict) or not services or not all(
            isinstance(name, str) and isinstance(m, ServiceModel)
            for name, m in services.items()):
        raise ValueError(f"services must be a non-empty dict of name -> service model, "
                         f"got {services!r}")
    service = next(iter(services)) if service is None else service
    _check.one_of("service", service, services)
    _check.one_of("arrival", arrival, ARRIVALS)
    streams(seed)
    n = _n_requests(n_requests)
    top = FRONTIER_SIZES[-1]
    b = _check.positive_int("max_batch_size", max_batch_size)
    if b > top:
        raise ValueError(f"max_batch_size must be at most {top}, got {max_batch_size!r}")
    wait = _check.non_negative("max_wait_ms", max_wait_ms)
    slo = _check.positive("slo_ms", slo_ms)
    if not 0.1 <= slo <= 1000:
        raise ValueError(f"slo_ms must be between 0.1 and 1000, got {slo_ms!r}")
    top_wait_ms = wait_grid_ms(services[service])[-1]
    menu = {"style": {"description_width": "initial"}, "layout": widgets.Layout(width="320px")}
    controls = {
        "max_batch_size": widgets.IntSlider(value=b, min=1, max=top,
                                            description="max_batch_size", **_SLIDER),
        # 0 to the largest wait of the service's grid (the chosen wait, if larger); a new
        # service refits it (TradeoffDashboard._fit_wait_slider).
        "max_wait_ms": widgets.FloatSlider(value=wait, min=0.0, max=max(top_wait_ms, wait),
                                           step=_wait_step_ms(top_wait_ms),
                                           readout_format=".3g", description="max_wait_ms",
                                           **_SLIDER),
        **_load_and_workers(load, 1.2, workers),
        "slo_ms": widgets.FloatLogSlider(value=slo, base=10, min=-1, max=3, step=0.05,
                                         readout_format=".3g", description="slo_ms (p99)",
                                         **_SLIDER),
        "service": widgets.Dropdown(options=list(services), value=service,
                                    description="service", **menu),
        "arrival": widgets.Dropdown(options=list(ARRIVALS), value=arrival,
                                    description="arrival", **menu),
    }
    return TradeoffDashboard(services, n, seed, controls, progress)
