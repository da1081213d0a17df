"""The basics dashboard driven like a user: move sliders, check what is drawn."""

import math

import pytest
from matplotlib.container import BarContainer
from service_fakes import MeasuredUpTo8

import batchsim as bs
from batchsim.viz import basics_dashboard

N = 2000


def timeline_bars(dash):
    ax = dash.axes["timeline"]
    return [p for c in ax.containers if isinstance(c, BarContainer) for p in c]


def assert_shows_its_result(dash):
    """No error, and the figure draws the run on show."""
    assert dash.error is None
    assert "color:#b00020" not in dash.status.value
    res = dash.result
    t0_ms, t1_ms = dash.axes["timeline"].get_xlim()
    in_window = (1000 * res.end_s > t0_ms) & (1000 * res.start_s < t1_ms)
    assert len(timeline_bars(dash)) == in_window.sum() > 0
    (latency_steps,) = dash.axes["latency"].patches
    assert latency_steps.get_data().values.sum() == res.summary()["n_completed"]
    assert dash.image.value[:8] == b"\x89PNG\r\n\x1a\n"


def test_controls_are_sliders_that_update_on_release():
    dash = basics_dashboard(n_requests=N)
    assert set(dash.controls) == {"max_batch_size", "max_wait_ms", "load", "workers"}
    assert all(c.continuous_update is False for c in dash.controls.values())
    assert_shows_its_result(dash)
    assert dash.result.n_requests == N


def test_moving_max_wait_fills_batches_and_redraws():
    dash = basics_dashboard(n_requests=N, max_wait_ms=0.0, load=0.3)
    before_png, before = dash.image.value, dash.summary
    dash.controls["max_wait_ms"].value = 8.0
    assert_shows_its_result(dash)
    assert dash.result.meta["policy"].max_wait_ms == 8.0
    assert dash.image.value != before_png
    # Same arrivals (same seed and rate); waiting up to 8 ms at 30% load fills batches.
    assert dash.summary["mean_batch_size"] > 1.5 * before["mean_batch_size"]


def test_load_sets_the_arrival_rate_and_workers_the_rows():
    dash = basics_dashboard(n_requests=N, load=0.4)
    capacity_rps = bs.AffineService(1.9, 0.14).capacity_rps(32)
    dash.controls["load"].value = 0.8
    dash.controls["workers"].value = 3
    assert_shows_its_result(dash)
    # Throughput of a stable run is the arrival rate; n Poisson arrivals over the span
    # give it a relative standard error of 1/sqrt(n): allow 5 of them.
    assert dash.summary["throughput_rps"] == pytest.approx(0.8 * capacity_rps,
                                                           rel=5 / math.sqrt(N))
    labels = [t.get_text() for t in dash.axes["timeline"].get_yticklabels()]
    assert labels == ["arrivals", "worker 0", "worker 1", "worker 2"]
    assert dash.result.workers == 3
    assert f"{0.8 * capacity_rps:,.0f} requests/s" in dash.status.value


def test_max_batch_size_bounds_the_batches_drawn():
    dash = basics_dashboard(n_requests=N, load=0.9)
    dash.controls["max_batch_size"].value = 6
    assert_shows_its_result(dash)
    (size_steps,) = dash.axes["batch"].patches
    heights, edges = size_steps.get_data().values, size_steps.get_data().edges
    assert edges[-1] - 0.5 == 6 == dash.result.size.max() and heights[-1] > 0


def test_an_error_is_shown_and_cleared():
    dash = basics_dashboard(service=MeasuredUpTo8(), n_requests=N, max_batch_size=4)
    assert_shows_its_result(dash)
    good_png = dash.image.value
    dash.controls["max_batch_size"].value = 12
    assert dash.error == "ValueError: batch_size must be at most 8 for this profile, got 12"
    assert dash.result is None and dash.summary is None
    assert "batch_size must be at most 8" in dash.status.value
    assert "color:#b00020" in dash.status.value
    assert dash.image.value != good_png  # the figure shows the error, not a stale run
    dash.controls["max_batch_size"].value = 8
    assert_shows_its_result(dash)


def test_bad_arguments_raise_naming_the_parameter():
    with pytest.raises(ValueError, match="n_requests"):
        basics_dashboard(n_requests=0)
    with pytest.raises(ValueError, match="load"):
        basics_dashboard(load=-0.5)
    with pytest.raises(ValueError, match="workload"):
        basics_dashboard(workload="poisson")
    with pytest.raises(ValueError, match="service must be a service model .* got 'affine'"):
        basics_dashboard(service="affine")
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        basics_dashboard(seed=-1)


def test_a_light_starting_load_is_kept_not_raised_to_the_sliders_minimum():
    dash = basics_dashboard(n_requests=500, load=0.01)
    assert dash.controls["load"].value == 0.01 == dash.controls["load"].min
