"""The trade-off dashboard driven like a user: move each control, check what is drawn."""

import math

import numpy as np
import pytest
from service_fakes import MeasuredUpTo8

import batchsim as bs
from batchsim.viz import tradeoff_dashboard
from batchsim.viz.widgets import (
    ARRIVALS,
    FRONTIER_LOADS,
    FRONTIER_SIZES,
    default_services,
    wait_grid_ms,
)

N = 2000
AFFINE = bs.AffineService(base_ms=1.9, per_item_ms=0.14)
GPU = "h200_encoder_bfloat16"


def dashboard(**kwargs):
    services = {"affine": AFFINE, GPU: bs.load_service(GPU)}
    return tradeoff_dashboard(services=services, n_requests=N, progress=False, **kwargs)


def marked(dash, gid="chosen_p99"):
    """Where a marker is drawn, in data coordinates."""
    return tuple(dash.marks[gid].get_xydata()[0])


def assert_shows_its_result(dash):
    """No error, and the markers sit on the run on show, inside the axes."""
    assert dash.error is None
    assert "color:#b00020" not in dash.status.value
    s = dash.result.summary
    assert marked(dash, "chosen_p99") == (s["throughput_rps"], s["latency_ms_p99"])
    assert marked(dash, "chosen_p50") == (s["throughput_rps"], s["latency_ms_p50"])
    (x0, x1), (y0, y1) = dash.axes["frontier"].get_xlim(), dash.axes["frontier"].get_ylim()
    assert x0 <= s["throughput_rps"] <= x1
    assert y0 <= s["latency_ms_p50"] <= s["latency_ms_p99"] <= y1
    assert dash.image.value[:8] == b"\x89PNG\r\n\x1a\n"


def grid_row(dash, b, wait_ms):
    return dash.result.here.set_index(["max_batch_size", "max_wait_ms"]).loc[(b, wait_ms)]


def test_controls_and_the_first_draw():
    dash = dashboard()
    assert list(dash.controls) == ["max_batch_size", "max_wait_ms", "load", "workers",
                                   "slo_ms", "service", "arrival"]
    first = dash.controls["max_batch_size"]  # the slider the browser test types 8 into
    assert first.min <= 8 <= first.max and first.value != 8
    sliders = [c for name, c in dash.controls.items() if name not in ("service", "arrival")]
    assert all(c.continuous_update is False for c in sliders)
    assert_shows_its_result(dash)
    t = dash.result
    # One sweep of the grid at each frontier load, and the chosen policy (32, 2 ms at
    # load 0.3) is a grid point: its run is the sweep's run, number for number.
    assert len(dash.grids) == len(FRONTIER_LOADS)
    assert len(t.runs) == len(FRONTIER_LOADS) * len(FRONTIER_SIZES) * len(wait_grid_ms(AFFINE))
    assert grid_row(dash, 32, 2.0)["latency_ms_p99"] == t.summary["latency_ms_p99"]
    assert list(t.frontier["load"]) == list(FRONTIER_LOADS)
    per_load = t.runs.groupby("load")["latency_ms_p99"].min().to_numpy()
    assert np.array_equal(dash.axes["frontier"].get_lines()[0].get_ydata(), per_load)


def test_max_batch_size_moves_the_point_without_sweeping_or_redrawing_the_backdrop():
    dash = dashboard(load=0.4)
    before_png, before, backdrop = dash.image.value, marked(dash), dash.axes["frontier"]
    n_grids = len(dash.grids)
    dash.controls["max_batch_size"].value = 8
    assert_shows_its_result(dash)
    assert dash.result.policy.max_batch_size == 8
    assert marked(dash) != before and dash.image.value != before_png
    assert len(dash.grids) == n_grids            # no new sweep: one run simulated
    assert dash.axes["frontier"] is backdrop     # the backdrop is reused
    assert marked(dash, "chosen_cell") == (FRONTIER_SIZES.index(8), 2.0)  # wait 2: row 2
    assert grid_row(dash, 8, 2.0)["latency_ms_p99"] == dash.result.summary["latency_ms_p99"]
    # At load 0.4 (2,583 requests/s), batches of at most 8 (capacity 2,649) barely keep
    # up: the worker is busy more than 95% of the time and requests queue behind it.
    assert dash.result.summary["utilization"] > 0.95
    assert dash.result.summary["latency_ms_p99"] > before[1]


def test_max_wait_costs_latency_and_saves_gpu_time_at_low_load():
    dash = dashboard(load=0.1, max_wait_ms=0.0)
    greedy = dash.result.summary
    dash.controls["max_wait_ms"].value = 5.0
    assert_shows_its_result(dash)
    waited = dash.result.summary
    assert waited["mean_batch_size"] > 1.5 * greedy["mean_batch_size"]
    assert waited["utilization"] < 0.8 * greedy["utilization"]
    assert waited["latency_ms_p50"] > greedy["latency_ms_p50"] + 2.0
    assert marked(dash, "chosen_cell") == (FRONTIER_SIZES.index(32),
                                           wait_grid_ms(AFFINE).index(5.0))
    # Off the grid, the square sits between the cells around it.
    dash.controls["max_wait_ms"].value = 3.5
    assert_shows_its_result(dash)
    assert marked(dash, "chosen_cell") == (FRONTIER_SIZES.index(32), 2.5)


def test_load_sets_the_rate_and_sweeps_only_an_unseen_load():
    dash = dashboard()
    capacity_rps = AFFINE.capacity_rps(FRONTIER_SIZES[-1])
    dash.controls["load"].value = 0.6  # a frontier load: already swept
    assert_shows_its_result(dash)
    assert len(dash.grids) == len(FRONTIER_LOADS)
    # Throughput of a stable run is the arrival rate: relative SE 1/sqrt(n), allow 5.
    assert dash.result.summary["throughput_rps"] == pytest.approx(0.6 * capacity_rps,
                                                                  rel=5 / math.sqrt(N))
    assert f"{0.6 * capacity_rps:,.0f} requests/s" in dash.status.value
    dash.controls["load"].value = 0.55
    assert_shows_its_result(dash)
    assert len(dash.grids) == len(FRONTIER_LOADS) + 1
    assert set(dash.result.here["load"]) == {0.55}
    assert dash.axes["grid"].get_title() == "p99 latency (ms) at load 0.55"


def test_workers_sweep_their_own_frontier():
    dash = dashboard(load=0.5)
    one = dash.result
    dash.controls["workers"].value = 2
    assert_shows_its_result(dash)
    two = dash.result
    assert len(dash.grids) == 2 * len(FRONTIER_LOADS)
    assert set(two.runs["workers"]) == {2}
    # load is a fraction of the capacity of all workers: twice the traffic.
    assert two.rate_rps == pytest.approx(2 * one.rate_rps)
    assert two.summary["throughput_rps"] == pytest.approx(2 * one.summary["throughput_rps"],
                                                          rel=10 / math.sqrt(N))
    assert marked(dash) != (one.summary["throughput_rps"], one.summary["latency_ms_p99"])


def test_slo_moves_the_line_and_the_best_point():
    dash = dashboard(slo_ms=10.0)
    slo_line = next(a for a in dash.axes["frontier"].get_lines() if a.get_gid() == "slo")
    assert slo_line.get_ydata()[0] == 10.0
    best = dash.result.best
    dash.controls["slo_ms"].value = 20.0
    assert_shows_its_result(dash)
    slo_line = next(a for a in dash.axes["frontier"].get_lines() if a.get_gid() == "slo")
    assert slo_line.get_ydata()[0] == 20.0
    looser = dash.result.best
    assert looser["throughput_rps"] > best["throughput_rps"]
    assert looser["latency_ms_p99"] <= 20.0
    within = dash.result.frontier[dash.result.frontier["latency_ms_p99"] <= 20.0]
    assert looser["throughput_rps"] == within["throughput_rps"].max()
    # Below s(1) = 2.04 ms nothing can meet it.
    dash.controls["slo_ms"].value = 1.0
    assert_shows_its_result(dash)
    assert dash.result.best is None
    assert "no load of the grid meets the SLO" in dash.status.value
    assert "misses the SLO" in dash.marks["title"].get_text()


def test_service_dropdown_switches_to_the_gpu_profile():
    dash = dashboard(max_wait_ms=0.2)
    dash.controls["service"].value = GPU
    assert_shows_its_result(dash)
    gpu = bs.load_service(GPU)
    assert set(dash.result.runs["max_wait_ms"]) == set(wait_grid_ms(gpu)) == {
        0.0, 0.1, 0.2, 0.5, 1.0}
    capacity_rps = gpu.capacity_rps(FRONTIER_SIZES[-1])
    assert dash.result.rate_rps == pytest.approx(0.3 * capacity_rps)
    assert dash.result.summary["throughput_rps"] == pytest.approx(0.3 * capacity_rps,
                                                                  rel=5 / math.sqrt(N))
    assert GPU in dash.status.value
    dash.controls["service"].value = "affine"  # cached: back without a sweep
    assert_shows_its_result(dash)
    assert len(dash.grids) == 2 * len(FRONTIER_LOADS)


def test_the_wait_slider_spans_the_chosen_services_wait_grid(monkeypatch):
    """0 to the largest wait of the service's grid: a GPU's waits end at 1 ms, the affine
    model's at 10; a wait past the new end is clamped, and the switch draws once."""
    dash = dashboard(max_wait_ms=2.0)
    wait = dash.controls["max_wait_ms"]
    assert (wait.min, wait.max) == (0.0, wait_grid_ms(AFFINE)[-1]) == (0.0, 10.0)
    draws = []
    monkeypatch.setattr(dash, "update", lambda: draws.append(wait.value))
    dash.controls["service"].value = GPU
    assert wait.max == wait_grid_ms(bs.load_service(GPU))[-1] == 1.0
    assert draws == [1.0] and wait.step <= wait.max / 100


def test_arrival_dropdown_bursts_raise_p99():
    dash = dashboard(load=0.3)
    poisson = dash.result.summary
    dash.controls["arrival"].value = "Bursty (on/off MMPP)"
    assert_shows_its_result(dash)
    bursty = dash.result.summary
    # On 40% of the time at twice the mean rate: queues build in every burst.
    assert bursty["latency_ms_p99"] > poisson["latency_ms_p99"]
    assert marked(dash) != (poisson["throughput_rps"], poisson["latency_ms_p99"])
    assert "Bursty (on/off MMPP) arrivals" in dash.status.value


def test_the_point_stays_in_view_when_it_leaves_the_backdrop():
    dash = dashboard()
    dash.controls["load"].value = 1.2     # past the frontier's loads
    dash.controls["max_batch_size"].value = 1  # far past this batch size's capacity
    assert_shows_its_result(dash)          # the axes grew to show it


def test_an_invalid_combination_shows_its_error_and_recovers():
    dash = tradeoff_dashboard(services={"affine": AFFINE, "up to 8": MeasuredUpTo8()},
                              n_requests=N, progress=False)
    good_png = dash.image.value
    dash.controls["service"].value = "up to 8"  # the grid goes up to batches of 128
    assert dash.error.startswith("ValueError: batch_size must be at most 8")
    assert dash.result is None
    assert "color:#b00020" in dash.status.value and "at most 8" in dash.status.value
    assert dash.image.value != good_png  # the figure shows the error, not a stale run
    dash.controls["service"].value = "affine"
    assert_shows_its_result(dash)


def test_arrivals_keep_their_mean_rate_and_waits_fit_the_service():
    for make in ARRIVALS.values():
        assert make(3000.0, 2.0).rate_rps == pytest.approx(3000.0)
    assert wait_grid_ms(AFFINE) == (0.0, 1.0, 2.0, 5.0, 10.0)     # s(128) = 19.8 ms
    assert wait_grid_ms(bs.AffineService(0.05, 0.0)) == (0.0, 0.005, 0.01, 0.02, 0.05)
    services = default_services()
    assert set(bs.shipped_profiles()) < set(services) and GPU in services


def test_bad_arguments_raise_naming_the_parameter():
    with pytest.raises(ValueError, match="services"):
        tradeoff_dashboard(services={})
    with pytest.raises(ValueError, match="services"):
        tradeoff_dashboard(services={"x": "affine"})
    with pytest.raises(ValueError, match="service"):
        dashboard(service="tpu")
    with pytest.raises(ValueError, match="arrival"):
        dashboard(arrival="poisson")
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        dashboard(seed=-1)
    with pytest.raises(ValueError, match="max_batch_size"):
        dashboard(max_batch_size=256)
    with pytest.raises(ValueError, match="slo_ms"):
        dashboard(slo_ms=5000)
    with pytest.raises(ValueError, match="n_requests"):
        tradeoff_dashboard(n_requests=0)
