"""Matplotlib figures of runs, service models and sweeps.

Every function takes results (a ``RunResult``, a sweep DataFrame or a service model)
and an optional ``ax`` to draw into. It returns the Axes it drew on (a new figure's when
``ax`` is None), labels every axis with its unit and never calls ``plt.show()``: the same
function serves notebooks (inline figures), dashboards (redrawn in place) and tests.
Times are shown in milliseconds.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.colors import LogNorm
from matplotlib.lines import Line2D

from .. import _check
from ..policy import FLUSH, SIZE, TIMEOUT, TRIGGER_NAMES
from ..result import COMPLETED, RunResult
from ..service import ServiceModel

TRIGGER_COLORS = {SIZE: "tab:blue", TIMEOUT: "tab:orange", FLUSH: "tab:gray"}
#: Without ``t1_s``, a timeline shows this many batches from ``t0_s`` on.
TIMELINE_BATCHES = 30
#: Sweep columns that hold measured results; the others describe the configuration.
RESULT_PREFIXES = ("throughput_rps", "latency_ms_", "mean_batch_size", "utilization", "n_",
                   "goodput")


def _axes(ax, figsize):
    if ax is None:
        _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


def _run(res) -> RunResult:
    """``res``, which must be a ``RunResult`` (a ``ValueError`` naming it otherwise)."""
    if not isinstance(res, RunResult):
        raise ValueError(f"res must be a RunResult, got {res!r:.80}")
    return res


def _ms(t_s):
    return 1000.0 * np.asarray(t_s, dtype=float)


def axis_label(name: str) -> str:
    """An axis label with units for a summary or sweep column name."""
    if name.startswith("latency_ms_"):
        return f"{name.removeprefix('latency_ms_')} latency (ms)"
    known = {"throughput_rps": "throughput (requests/s)",
             "mean_batch_size": "mean batch size (requests)",
             "utilization": "utilization (fraction of time busy)",
             "goodput": "goodput (fraction within SLO)",
             "max_batch_size": "max batch size (requests)",
             "max_wait_ms": "max wait (ms)"}
    if name in known:
        return known[name]
    for suffix, unit in (("_ms", "ms"), ("_rps", "requests/s"), ("_s", "s")):
        if name.endswith(suffix):
            return f"{name.removesuffix(suffix)} ({unit})"
    return name


# -- one run ---------------------------------------------------------------------------
def timeline(res, t0_s=None, t1_s=None, ax=None):
    """Arrivals as ticks above the batches each worker ran, coloured by trigger.

    One row per worker; each bar is a batch from its dispatch to its end, labelled with
    its size when wide enough, and coloured by what closed it (size, timeout or flush).
    Thin grey lines join each arrival to the start of the batch it rode in: their slant
    is the request's wait. Arrivals never served (rejected, expired or failed) are red
    crosses. The window defaults to ``TIMELINE_BATCHES`` batches starting at ``t0_s``
    (default: the first arrival).
    """
    _run(res)
    t0 = float(res.arrival_s[0]) if t0_s is None else _check.non_negative("t0_s", t0_s)
    last_s = max(float(res.arrival_s[-1]), float(np.nanmax(res.end_s, initial=0.0)))
    if t0 >= last_s:
        raise ValueError(f"t0_s must be before the run's end ({last_s:.6g} s), got {t0_s!r}")
    if t1_s is None:
        later = np.flatnonzero(res.start_s >= t0)[:TIMELINE_BATCHES]
        t1 = float(res.end_s[later].max()) if later.size else float(res.arrival_s[-1])
    else:
        t1 = _check.non_negative("t1_s", t1_s)
    if t1 <= t0:
        raise ValueError(f"t1_s must be after t0_s ({t0!r}), got {t1!r}")
    ax = _axes(ax, figsize=(10, 1.4 + 0.55 * (res.workers + 1)))
    arrivals_row = -1  # drawn above worker 0 once the y axis is inverted

    shown = (res.end_s > t0) & (res.start_s < t1)
    for code, name in enumerate(TRIGGER_NAMES):
        sel = shown & (res.trigger == code)
        if sel.any():
            ax.barh(res.worker[sel], _ms(res.end_s[sel] - res.start_s[sel]),
                    left=_ms(res.start_s[sel]), height=0.6, color=TRIGGER_COLORS[code],
                    edgecolor="white", linewidth=0.6, label=f"batch closed by {name}")
    wide = shown & (res.end_s - res.start_s > 0.02 * (t1 - t0))
    for k in np.flatnonzero(wide):
        mid_s = 0.5 * (max(res.start_s[k], t0) + min(res.end_s[k], t1))
        ax.text(_ms(mid_s), res.worker[k], str(res.size[k]), ha="center", va="center",
                color="white", fontsize="small", clip_on=True)

    in_window = (res.arrival_s >= t0) & (res.arrival_s <= t1)
    served = in_window & (res.status == COMPLETED)
    arrival_ms = _ms(res.arrival_s[served])
    rows = res.worker[res.batch_id[served]]
    joins = np.stack([np.column_stack([arrival_ms, np.full(arrival_ms.size, arrivals_row)]),
                      np.column_stack([_ms(res.dispatch_s[served]), rows - 0.3])], axis=1)
    ax.add_collection(LineCollection(joins, colors="0.6", linewidths=0.5, zorder=0))
    ax.plot(arrival_ms, np.full(arrival_ms.size, arrivals_row), "|", color="black",
            markersize=12, linestyle="none", label="arrival")
    dropped = in_window & (res.status != COMPLETED)
    if dropped.any():
        ax.plot(_ms(res.arrival_s[dropped]), np.full(dropped.sum(), arrivals_row), "x",
                color="tab:red", linestyle="none", label="arrival not served")

    ax.set_yticks(range(arrivals_row, res.workers),
                  ["arrivals"] + [f"worker {w}" for w in range(res.workers)])
    ax.set_ylim(res.workers - 0.4, arrivals_row - 0.6)
    ax.set_xlim(_ms(t0), _ms(t1))
    ax.set_xlabel("time (ms)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize="small", frameon=False)
    return ax


def _served_latency_ms(res):
    return _ms(res.latency_s[res.status == COMPLETED])


def _percentiles(res):
    """p50 and p99 of the completed requests' latency, as ``res.summary()`` reports them."""
    s = res.summary()
    return ((50, s["latency_ms_p50"]), (99, s["latency_ms_p99"]))


def latency_hist(res, ax=None, bins=50, label=None):
    """Histogram of the completed requests' latency, p50 and p99 as vertical lines.

    Drawn as one filled step patch (``ax.stairs``) rather than a bar per bin: the same
    picture at a fraction of the drawing time, which keeps dashboards responsive.
    """
    _run(res)
    ax = _axes(ax, figsize=(6, 3.5))
    counts, edges_ms = np.histogram(_served_latency_ms(res), bins=bins)
    color = ax.stairs(counts, edges_ms, fill=True, alpha=0.7, label=label).get_facecolor()
    for q, p in _percentiles(res):
        ax.axvline(p, color=color, linestyle="--" if q == 50 else ":", linewidth=1.5,
                   label=f"p{q} = {p:.2f} ms")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("requests")
    ax.legend(fontsize="small")
    return ax


def latency_cdf(res, ax=None, label=None):
    """Empirical CDF of the completed requests' latency, p50 and p99 marked on the curve."""
    _run(res)
    ax = _axes(ax, figsize=(6, 3.5))
    lat_ms = np.sort(_served_latency_ms(res))
    frac = np.arange(1, lat_ms.size + 1) / max(lat_ms.size, 1)
    (p50, p99) = (p for _, p in _percentiles(res))
    marks = f"p50 {p50:.2f} ms, p99 {p99:.2f} ms"
    (line,) = ax.step(lat_ms, frac, where="post",
                      label=marks if label is None else f"{label}: {marks}")
    ax.plot([p50, p99], [0.5, 0.99], "o", color=line.get_color())
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of requests ≤ latency")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize="small", loc="lower right")
    return ax


def batch_size_hist(res, ax=None):
    """How many batches of each size were dispatched, with the mean size marked."""
    _run(res)
    ax = _axes(ax, figsize=(6, 3.5))
    counts = np.bincount(res.size, minlength=1)
    # One step patch, each step centred on its batch size (see latency_hist for why).
    ax.stairs(counts[1:], np.arange(1, counts.size + 1) - 0.5, fill=True, color="tab:blue")
    if res.n_batches:
        mean = float(res.size.mean())
        ax.axvline(mean, color="black", linestyle="--", label=f"mean {mean:.1f}")
        ax.legend(fontsize="small")
    ax.set_xlabel("batch size (requests)")
    ax.set_ylabel("batches")
    return ax


def queue_length(res, ax=None):
    """Requests waiting (not yet in a batch) over time, a step series."""
    _run(res)
    ax = _axes(ax, figsize=(8, 3))
    t_s, n = res.queue_length()
    ax.step(_ms(t_s), n, where="post", linewidth=0.8)
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("requests waiting")
    return ax


# -- a service model -----------------------------------------------------------------
def service_profile(service, max_batch_size, ax=None):
    """``s(b)`` in ms and the capacity ``b / s(b)`` in requests/s (twin axis), b = 1..max."""
    if not isinstance(service, ServiceModel):
        raise ValueError(f"service must be a service model, got {service!r:.80}")
    top = _check.positive_int("max_batch_size", max_batch_size)
    ax = _axes(ax, figsize=(6, 3.5))
    b = np.arange(1, top + 1)
    style = "o-" if top <= 64 else "-"
    ax.plot(b, service.mean_ms(b), style, color="tab:blue", markersize=3)
    ax.set_xlabel("batch size b (requests)")
    ax.set_ylabel("service time s(b) (ms)", color="tab:blue")
    ax.set_ylim(bottom=0)
    cap = ax.twinx()
    cap.plot(b, [service.capacity_rps(int(k)) for k in b], style, color="tab:orange",
             markersize=3)
    cap.set_ylabel("capacity b / s(b) (requests/s)", color="tab:orange")
    cap.set_ylim(bottom=0)
    return ax


# -- sweeps --------------------------------------------------------------------------
def _is_result(column: str) -> bool:
    return column.startswith(RESULT_PREFIXES)


def seed_means(df, needed=("max_batch_size", "max_wait_ms")):
    """One row per configuration: numeric results averaged over seeds (and repeats).

    Raises ValueError when a column in ``needed`` is missing.
    """
    if not hasattr(df, "columns"):
        raise ValueError(f"df must be a pandas DataFrame (a sweep's), got {df!r:.80}")
    for column in needed:
        if column not in df.columns:
            raise ValueError(f"df must have a {column!r} column, got columns {list(df.columns)}")
    results = [c for c in df.columns if _is_result(c) and np.issubdtype(df[c].dtype, np.number)]
    keys = [c for c in df.columns if not _is_result(c) and c != "seed"]
    return df.groupby(keys, dropna=False, sort=True)[results].mean().reset_index()


def frontier(df, ax=None):
    """p99 (solid) and p50 (dashed) latency against throughput, one curve per max_wait_ms.

    ``df`` is a sweep frame (one row per configuration and seed); results are averaged
    over seeds. Each curve joins its configurations in order of throughput, so select
    one value of any parameter that should not vary along a curve first.
    """
    means = seed_means(df, needed=("max_wait_ms", "throughput_rps", "latency_ms_p50",
                                   "latency_ms_p99"))
    ax = _axes(ax, figsize=(7, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (wait_ms, curve) in enumerate(means.groupby("max_wait_ms", sort=True)):
        curve = curve.sort_values("throughput_rps")
        c = colors[i % len(colors)]
        ax.plot(curve["throughput_rps"], curve["latency_ms_p99"], "o-", color=c,
                label=f"max_wait_ms = {wait_ms:g}")
        ax.plot(curve["throughput_rps"], curve["latency_ms_p50"], "s--", color=c,
                markersize=4)
    handles, _ = ax.get_legend_handles_labels()
    handles += [Line2D([], [], color="black", marker="o", label="p99"),
                Line2D([], [], color="black", marker="s", linestyle="--", label="p50")]
    ax.legend(handles=handles, fontsize="small")
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("latency (ms)")
    return ax


def _short(v: float) -> str:
    if not np.isfinite(v):
        return "—"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _slo_edges(ok):
    """Segments along the cell edges that separate cells meeting the SLO from the rest."""
    segments = []
    rows, cols = ok.shape
    for i in range(rows):
        for j in range(cols):
            if j + 1 < cols and ok[i, j] != ok[i, j + 1]:
                segments.append([(j + 0.5, i - 0.5), (j + 0.5, i + 0.5)])
            if i + 1 < rows and ok[i, j] != ok[i + 1, j]:
                segments.append([(j - 0.5, i + 0.5), (j + 0.5, i + 0.5)])
    return segments


def heatmap(df, value="latency_ms_p99", slo_ms=None, ax=None):
    """``value`` over max_batch_size (x) and max_wait_ms (y), averaged over seeds.

    With ``slo_ms``, a red line runs along the cell edges that separate configurations
    whose p99 latency is within the SLO from those that miss it (unstable ones miss).
    Any other parameter of the sweep must take a single value: select it first.
    """
    means = seed_means(df, needed=("max_batch_size", "max_wait_ms")
                       + (("latency_ms_p99",) if slo_ms is not None else ()))
    if value not in means.columns:
        raise ValueError(f"value must be a numeric result column of df, got {value!r}")
    for col in means.columns:
        if not _is_result(col) and col not in ("max_batch_size", "max_wait_ms"):
            if means[col].nunique(dropna=False) > 1:
                raise ValueError(f"df has several values of {col!r} "
                                 f"({sorted(means[col].unique())}); select one first")
    grid = means.pivot(index="max_wait_ms", columns="max_batch_size", values=value)
    ax = _axes(ax, figsize=(1.2 + 0.7 * grid.shape[1], 1.0 + 0.5 * grid.shape[0]))
    values = grid.to_numpy(float)
    data = np.ma.masked_invalid(values)
    spread = data.max() / data.min() if data.count() and data.min() > 0 else 1.0
    norm = LogNorm() if spread > 30 else None  # an unstable corner must not flatten the rest
    im = ax.imshow(data, origin="lower", aspect="auto", cmap="viridis", norm=norm,
                   interpolation="nearest")
    ax.figure.colorbar(im, ax=ax, label=axis_label(value))
    if grid.size <= 150:
        for (i, j), v in np.ndenumerate(values):
            dark = np.isfinite(v) and sum(im.cmap(im.norm(v))[:3]) < 1.5
            ax.text(j, i, _short(v), ha="center", va="center", fontsize="x-small",
                    color="white" if dark else "black")
    ax.set_xticks(range(grid.shape[1]), [f"{b:g}" for b in grid.columns])
    ax.set_yticks(range(grid.shape[0]), [f"{w:g}" for w in grid.index])
    ax.set_xlabel(axis_label("max_batch_size"))
    ax.set_ylabel(axis_label("max_wait_ms"))
    if slo_ms is not None:
        slo = _check.positive("slo_ms", slo_ms)
        p99 = means.pivot(index="max_wait_ms", columns="max_batch_size",
                          values="latency_ms_p99").to_numpy(float)
        ok = np.isfinite(p99) & (p99 <= slo)
        ax.add_collection(LineCollection(_slo_edges(ok), colors="red", linewidths=2.5,
                                         label=f"SLO: p99 ≤ {slo:g} ms"))
        ax.legend(loc="upper left", bbox_to_anchor=(0, -0.15), fontsize="small",
                  frameon=False)
    return ax
