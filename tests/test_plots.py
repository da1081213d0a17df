"""Every plot on small simulated runs: axis labels carry units, drawn data match the run."""

import re
import subprocess
import sys

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import LineCollection
from matplotlib.container import BarContainer
from matplotlib.patches import StepPatch

import batchsim as bs
from batchsim.policy import TRIGGER_NAMES
from batchsim.result import COMPLETED, RunRecorder
from batchsim.viz import plots

SERVICE = bs.AffineService(base_ms=1.9, per_item_ms=0.14)


@pytest.fixture(scope="module")
def run():
    """Two workers, batches closed by size and by timeout, the last one flushed."""
    rate = 0.8 * SERVICE.capacity_rps(4, workers=2)
    return bs.simulate(bs.Poisson(rate), bs.BatchPolicy(4, 1.0), SERVICE, n_requests=600,
                       workers=2, seed=3)


@pytest.fixture(scope="module")
def overloaded():
    """Twice the capacity, a bounded queue and a timeout: rejected and expired requests."""
    policy = bs.BatchPolicy(4, 1.0, max_queue_size=6, timeout_ms=3.0)
    return bs.simulate(bs.Poisson(2 * SERVICE.capacity_rps(4)), policy, SERVICE,
                       n_requests=300, seed=3)


def steps(ax):
    """``(heights, edges)`` of the one histogram drawn on ``ax`` as a step patch."""
    (patch,) = [p for p in ax.patches if isinstance(p, StepPatch)]
    heights, edges, _baseline = patch.get_data()
    return heights, edges


def bars(ax):
    """``{label: BarContainer}`` of the bar groups drawn on ``ax``."""
    return {c.get_label(): c for c in ax.containers if isinstance(c, BarContainer)}


def test_import_batchsim_leaves_plotting_libraries_unloaded():
    code = ("import sys, batchsim; "
            "print(sorted(m for m in ('matplotlib', 'ipywidgets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_timeline_whole_run_draws_every_batch_by_trigger(run):
    ax = plots.timeline(run, t0_s=0.0, t1_s=float(run.end_s.max()))
    groups = bars(ax)
    counts = np.bincount(run.trigger, minlength=3)
    assert (counts > 0).all(), "the fixture should exercise size, timeout and flush"
    for code, name in enumerate(TRIGGER_NAMES):
        group = groups[f"batch closed by {name}"]
        sel = run.trigger == code
        assert len(group) == counts[code]
        np.testing.assert_allclose([p.get_x() for p in group], 1000 * run.start_s[sel])
        np.testing.assert_allclose([p.get_width() for p in group],
                                   1000 * (run.end_s[sel] - run.start_s[sel]))
        np.testing.assert_array_equal([p.get_y() + p.get_height() / 2 for p in group],
                                      run.worker[sel])
    assert ax.get_xlabel() == "time (ms)"
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["arrivals", "worker 0", "worker 1"]
    (ticks,) = [line for line in ax.get_lines() if line.get_label() == "arrival"]
    assert ticks.get_xdata().size == run.n_requests
    joins = [c for c in ax.collections if isinstance(c, LineCollection)]
    assert len(joins) == 1 and len(joins[0].get_segments()) == run.n_requests


def test_timeline_default_window_shows_the_first_batches(run):
    ax = plots.timeline(run)
    first = slice(0, plots.TIMELINE_BATCHES)
    t0_ms, t1_ms = ax.get_xlim()
    assert t0_ms == pytest.approx(1000 * run.arrival_s[0])
    assert t1_ms == pytest.approx(1000 * run.end_s[first].max())
    in_range = (run.end_s * 1000 > t0_ms) & (run.start_s * 1000 < t1_ms)
    assert sum(len(g) for g in bars(ax).values()) == in_range.sum()
    arrivals = (run.arrival_s * 1000 >= t0_ms) & (run.arrival_s * 1000 <= t1_ms)
    (ticks,) = [line for line in ax.get_lines() if line.get_label() == "arrival"]
    assert ticks.get_xdata().size == arrivals.sum()


def test_timeline_marks_dropped_arrivals(overloaded):
    ax = plots.timeline(overloaded, t0_s=0.0, t1_s=float(overloaded.arrival_s[-1]))
    (crosses,) = [line for line in ax.get_lines()
                  if line.get_label() == "arrival not served"]
    dropped = overloaded.status != COMPLETED
    assert dropped.sum() > 0
    np.testing.assert_allclose(crosses.get_xdata(), 1000 * overloaded.arrival_s[dropped])


def test_timeline_rejects_an_empty_window(run):
    with pytest.raises(ValueError, match="t1_s"):
        plots.timeline(run, t0_s=0.1, t1_s=0.05)
    with pytest.raises(ValueError, match=r"t0_s must be before the run's end \(.* s\), got 1000"):
        plots.timeline(run, t0_s=1000)


def test_latency_hist_counts_completed_requests_and_marks_percentiles(overloaded):
    s = overloaded.summary()
    ax = plots.latency_hist(overloaded)
    heights, edges_ms = steps(ax)
    assert heights.sum() == s["n_completed"] < overloaded.n_requests
    lat_ms = 1000 * overloaded.latency_s[overloaded.status == COMPLETED]
    assert edges_ms[0] == lat_ms.min() and edges_ms[-1] == lat_ms.max()
    marks = {line.get_label().split(" =")[0]: line.get_xdata()[0] for line in ax.get_lines()}
    assert marks == pytest.approx({"p50": s["latency_ms_p50"], "p99": s["latency_ms_p99"]})
    assert ax.get_xlabel() == "latency (ms)" and ax.get_ylabel() == "requests"


def test_latency_cdf_is_the_sorted_latencies_ending_at_one(run, overloaded):
    ax = plots.latency_cdf(run, label="a")
    plots.latency_cdf(overloaded, ax=ax, label="b")
    curves = [line for line in ax.get_lines() if line.get_label().startswith(("a:", "b:"))]
    assert len(curves) == 2
    for res, curve in zip((run, overloaded), curves, strict=True):
        lat_ms = np.sort(1000 * res.latency_s[res.status == COMPLETED])
        np.testing.assert_allclose(curve.get_xdata(), lat_ms)
        y = curve.get_ydata()
        assert y[-1] == 1.0 and np.all(np.diff(y) > 0)
        s = res.summary()
        assert f"p99 {s['latency_ms_p99']:.2f} ms" in curve.get_label()
    assert "(ms)" in ax.get_xlabel()


def test_batch_size_hist_counts_every_batch(run):
    ax = plots.batch_size_hist(run)
    heights, edges = steps(ax)
    sizes = (edges[:-1] + edges[1:]) / 2
    assert sizes.tolist() == list(range(1, run.size.max() + 1))
    assert heights.tolist() == np.bincount(run.size)[1:].tolist()
    assert heights.sum() == run.n_batches
    assert ax.get_xlabel() == "batch size (requests)"


def test_batch_size_hist_of_a_run_without_batches_is_empty():
    rec = RunRecorder(np.array([0.1]), workers=1)
    rec.reject(0)
    heights, _ = steps(plots.batch_size_hist(rec.result()))
    assert heights.size == 0


@pytest.mark.parametrize("draw, says", [
    (lambda: plots.timeline(None), "res must be a RunResult, got None"),
    (lambda: plots.latency_cdf("run.json"), "res must be a RunResult, got 'run.json'"),
    (lambda: plots.service_profile(None, 8), "service must be a service model, got None"),
    (lambda: plots.frontier(None), "df must be a pandas DataFrame (a sweep's), got None"),
])
def test_plots_name_an_argument_of_the_wrong_kind(draw, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        draw()


def test_queue_length_plots_the_step_series(run):
    ax = plots.queue_length(run)
    t_s, n = run.queue_length()
    (line,) = ax.get_lines()
    np.testing.assert_allclose(line.get_xdata(), 1000 * t_s)
    np.testing.assert_array_equal(line.get_ydata(), n)
    assert ax.get_xlabel() == "time (ms)" and ax.get_ylabel() == "requests waiting"


def test_service_profile_shows_s_of_b_and_capacity():
    ax = plots.service_profile(SERVICE, 16)
    (times,) = ax.get_lines()
    (twin,) = [a for a in ax.figure.axes if a is not ax]
    (capacity,) = twin.get_lines()
    b = np.arange(1, 17)
    np.testing.assert_allclose(times.get_ydata(), 1.9 + 0.14 * b)
    np.testing.assert_allclose(capacity.get_ydata(), 1000 * b / (1.9 + 0.14 * b))
    assert "(ms)" in ax.get_ylabel() and "(requests/s)" in twin.get_ylabel()
    assert "(requests)" in ax.get_xlabel()
    with pytest.raises(ValueError, match="max_batch_size"):
        plots.service_profile(SERVICE, 0)


@pytest.fixture(scope="module")
def sweep():
    """A sweep frame as batchsim.sweep shapes it: one row per configuration and seed."""
    rows = []
    for b in (1, 8):
        for wait_ms in (0.0, 2.0):
            for load in (0.3, 0.6):
                for seed in (0, 1):
                    res = bs.simulate(bs.Poisson(load * SERVICE.capacity_rps(8)),
                                      bs.BatchPolicy(b, wait_ms), SERVICE, n_requests=300,
                                      seed=seed)
                    summary = res.summary()
                    summary.pop("utilization_per_worker")
                    rows.append({"max_batch_size": b, "max_wait_ms": wait_ms, "load": load,
                                 "seed": seed, **summary})
    return pd.DataFrame(rows)


def test_frontier_draws_seed_means_per_max_wait(sweep):
    df = sweep[sweep.max_batch_size == 8]
    ax = plots.frontier(df)
    means = df.groupby(["max_wait_ms", "load"])[
        ["throughput_rps", "latency_ms_p50", "latency_ms_p99"]].mean()
    lines = ax.get_lines()
    assert len(lines) == 4  # p99 and p50 for each of two max_wait_ms values
    for k, wait_ms in enumerate((0.0, 2.0)):
        expect = means.loc[wait_ms].sort_values("throughput_rps")
        p99, p50 = lines[2 * k], lines[2 * k + 1]
        assert p99.get_label() == f"max_wait_ms = {wait_ms:g}"
        np.testing.assert_allclose(p99.get_xdata(), expect["throughput_rps"])
        np.testing.assert_allclose(p99.get_ydata(), expect["latency_ms_p99"])
        np.testing.assert_allclose(p50.get_ydata(), expect["latency_ms_p50"])
    assert ax.get_xlabel() == "throughput (requests/s)" and "(ms)" in ax.get_ylabel()


def test_heatmap_shows_seed_means_on_the_grid(sweep):
    df = sweep[sweep.load == 0.6]
    ax = plots.heatmap(df, value="mean_batch_size")
    grid = df.groupby(["max_wait_ms", "max_batch_size"])["mean_batch_size"].mean().unstack()
    np.testing.assert_allclose(ax.images[0].get_array(), grid.to_numpy())
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "8"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "2"]
    assert "(requests)" in ax.get_xlabel() and "(ms)" in ax.get_ylabel()
    (colorbar,) = [a for a in ax.figure.axes if a is not ax]
    assert colorbar.get_ylabel() == "mean batch size (requests)"


def test_heatmap_slo_line_separates_cells_within_the_slo():
    # p99 over (max_wait_ms rows 0, 5) x (max_batch_size columns 1, 8, 32): the SLO of
    # 10 ms holds in the three cells marked *.  wait 0: 50  9*  8*   wait 5: 60 12  7*
    cells = {(0, 1): 50, (0, 8): 9, (0, 32): 8, (5, 1): 60, (5, 8): 12, (5, 32): 7}
    df = pd.DataFrame([{"max_wait_ms": w, "max_batch_size": b, "latency_ms_p99": v,
                        "throughput_rps": 1.0} for (w, b), v in cells.items()])
    ax = plots.heatmap(df, slo_ms=10)
    (edges,) = [c for c in ax.collections if isinstance(c, LineCollection)]
    got = sorted(tuple(map(tuple, np.round(seg, 2))) for seg in edges.get_segments())
    expected = sorted([((0.5, -0.5), (0.5, 0.5)),    # wait 0: 1 | 8
                       ((0.5, 0.5), (1.5, 0.5)),     # batch 8: wait 0 above wait 5
                       ((1.5, 0.5), (1.5, 1.5))])    # wait 5: 8 | 32
    assert got == expected
    assert "10 ms" in edges.get_label()


def test_sweep_plots_refuse_frames_they_cannot_draw(sweep):
    with pytest.raises(ValueError, match="'load'"):
        plots.heatmap(sweep)
    with pytest.raises(ValueError, match="value"):
        plots.heatmap(sweep[sweep.load == 0.3], value="no_such_column")
    with pytest.raises(ValueError, match="'max_wait_ms'"):
        plots.frontier(sweep.drop(columns="max_wait_ms"))


def test_plots_draw_into_a_given_axes(run):
    fig, axes = plt.subplots(1, 3)
    assert plots.latency_hist(run, ax=axes[0]) is axes[0]
    assert plots.batch_size_hist(run, ax=axes[1]) is axes[1]
    assert plots.timeline(run, ax=axes[2]) is axes[2]
    assert plt.get_fignums() == [fig.number]
