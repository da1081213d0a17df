"""Calibration: the batcher-cost model in both engines, compare(), and calibrate() on a
model whose cost is known."""

import inspect
import itertools
import math
import os
import re
import struct
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from service_fakes import costly_service, sleeping_model

import batchsim as bs
from batchsim.calibrate import (
    CALIBRATION_LOADS,
    CAPACITY_TOLERANCE,
    LATENCY_PERCENTILES,
    WARM_BATCHES,
    _after_turns,
    _due_s,
    _later,
    _linger_ms,
    _merged_bins,
    _release_table,
    _releases,
    _timer,
    _turn_times,
    at_speed,
    batch_residuals,
    capacity_check,
    compare,
    refit,
    worker_time_ratio,
)
from batchsim.result import RunRecorder
from batchsim.service import BatcherCosts, CalibratedService
from batchsim.sim.fast import FAIR_SHARE_LEAD_S, MAX_BURST

MS = 1e-3


# -- the cost model ---------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    ({"react_ms": -1.0}, "react_ms"),
    ({"timer_resolution_ms": math.nan}, "timer_resolution_ms"),
    ({"idle_ms": (1.0, 2.0), "wake_ms": (0.1,)}, "one entry per idle_ms"),
    ({"idle_ms": (2.0, 1.0), "wake_ms": (0.1, 0.2)}, "strictly increasing"),
    ({"idle_ms": (0.0,), "wake_ms": (0.1,)}, "idle_ms"),
    ({"release_spread_ms": (0.1,)}, "release_spread_ms"),
    ({"release_spread_ms": (0.1, -0.1)}, "release_spread_ms"),
    ({"release_spread_ms": (0.0, math.nan)}, "release_spread_ms"),
    ({"release_sizes": (1.0, 4.0), "release_table_ms": (0.1,)}, "one entry per release_sizes"),
    ({"release_sizes": (4.0, 1.0), "release_table_ms": (0.1, 0.2)}, "strictly increasing"),
    ({"release_sizes": (0.0,), "release_table_ms": (0.1,)}, "release_sizes"),
    ({"release_sizes": (1.0,), "release_table_ms": (-0.1,)}, "release_table_ms"),
    ({"release_ms": 0.1, "release_sizes": (1.0,), "release_table_ms": (0.1,)}, "not both"),
])
def test_batcher_costs_refuse_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BatcherCosts(**kwargs)


def test_a_release_table_is_linear_in_the_batch_size_within_and_beyond_its_points():
    costs = BatcherCosts(release_sizes=(2.0, 4.0, 52.0), release_table_ms=(0.048, 0.040, 0.088))
    np.testing.assert_allclose(costs.release_s([1, 2, 3, 28, 52, 64]) * 1e3,
                               [0.052, 0.048, 0.044, 0.064, 0.088, 0.100])
    falling = BatcherCosts(release_sizes=(1.0, 2.0), release_table_ms=(0.01, 0.005))
    assert falling.release_s(4) == 0.0


def test_timer_fires_on_the_grid_counted_from_when_the_loop_slept():
    costs = BatcherCosts(timer_resolution_ms=1.0, timer_latency_ms=0.1)
    assert costs.timer_fire_s(0.0, 0.3 * MS) == pytest.approx(1.1 * MS)
    assert costs.timer_fire_s(0.2 * MS, 1.0 * MS) == pytest.approx(1.3 * MS)   # ceil(0.8)
    assert costs.timer_fire_s(0.0, 2.0 * MS) == pytest.approx(2.1 * MS)        # on the grid
    assert costs.timer_fire_s(0.0, math.inf) == math.inf
    assert BatcherCosts().timer_fire_s(0.3, 0.7) == 0.7                        # exact


def test_wake_cost_interpolates_in_log_idle_time_and_is_flat_outside():
    costs = BatcherCosts(idle_ms=(0.1, 1.0), wake_ms=(0.0, 0.2))
    assert costs.wake_s(0.0) == 0.0
    assert costs.wake_s(math.sqrt(0.1) * MS) == pytest.approx(0.1 * MS)       # log midpoint
    assert costs.wake_s(math.inf) == pytest.approx(0.2 * MS)
    assert BatcherCosts().wake_s(5.0) == 0.0


def test_arrivals_during_a_batch_stretch_it_until_none_is_left_out():
    costs = BatcherCosts(arrival_ms=0.5)
    arrivals = [0.0, 0.2 * MS, 0.5 * MS, 1.2 * MS, 1.8 * MS, 3.0 * MS]
    # 1 ms alone; 0.2 and 0.5 fall in -> 2 ms; then 1.2 and 1.8 -> 3 ms; 3.0 is not before.
    assert costs.end_s(0.0, 1 * MS, arrivals) == pytest.approx(3 * MS)
    assert BatcherCosts().end_s(1.0, 0.25, arrivals) == 1.25
    # The first arrival costs 0.3 ms more: 0.2 and 0.5 -> 2.3 ms; 1.2 and 1.8 -> 3.3 ms;
    # then 3.0 falls in -> 3.8 ms.
    first = BatcherCosts(arrival_ms=0.5, first_arrival_ms=0.3)
    assert first.end_s(0.0, 1 * MS, arrivals) == pytest.approx(3.8 * MS)
    # A batch that receives nothing pays nothing.
    assert first.end_s(2.0 * MS, 0.5 * MS, arrivals) == pytest.approx(2.5 * MS)


def test_calibrated_service_mean_is_the_typical_time_times_the_mean_ratio():
    svc = CalibratedService(bs.AffineService(1.0, 0.1), per_batch_ms=0.5, per_item_ms=0.05,
                            jitter_quantiles=(1.0, 3.0))          # ratio uniform on [1, 3]
    b = np.array([1, 8])
    np.testing.assert_allclose(svc.mean_ms(b), 2.0 * (1.5 + 0.15 * b))
    assert svc.jitter_mean == pytest.approx(2.0)
    assert svc.jitter_cv == pytest.approx((2 / math.sqrt(12)) / 2)
    f = svc.jitter_factors(np.random.default_rng(0), 200_000)
    assert f.min() >= 0.5 and f.max() <= 1.5
    assert f.mean() == pytest.approx(1.0, abs=4 * f.std() / math.sqrt(f.size))
    assert CalibratedService(bs.AffineService(1.0, 0.0)).jitter_factors(None, 3) is None


def test_capacity_counts_release_and_the_stretch_of_arrivals():
    plain = CalibratedService(bs.AffineService(1.0, 0.0),
                              costs=BatcherCosts(release_ms=0.25))
    assert plain.capacity_rps(4) == pytest.approx(4 / 1.25e-3)
    svc = CalibratedService(bs.AffineService(1.0, 0.0),
                            costs=BatcherCosts(release_ms=0.25, arrival_ms=0.05))
    cycle_s = 4 / svc.capacity_rps(4)
    rate = 4 / cycle_s                      # at saturation: b arrivals per cycle
    batch_s = cycle_s - 0.25 * MS
    assert batch_s == pytest.approx(1 * MS + 0.05 * MS * rate * batch_s)
    # Every batch receives requests at saturation: the first one's cost, each time.
    first = CalibratedService(bs.AffineService(1.0, 0.0), costs=BatcherCosts(
        release_ms=0.25, arrival_ms=0.05, first_arrival_ms=0.1))
    cycle_s = 4 / first.capacity_rps(4)
    batch_s = cycle_s - 0.25 * MS
    assert batch_s == pytest.approx(1.1 * MS + 0.05 * MS * (4 / cycle_s) * batch_s)
    # A release spread uniformly over 0.25 +- 0.5 ms, never below 0: it averages
    # (0.75 ** 2 / 2) ms; the wake-up after it is averaged too (1 ms from 0.5 ms on).
    spread = CalibratedService(bs.AffineService(1.0, 0.0), costs=BatcherCosts(
        release_ms=0.25, release_spread_ms=(-0.5, 0.5)))
    assert 4 / spread.capacity_rps(4) == pytest.approx(1.28125 * MS, rel=1e-5)
    woken = CalibratedService(bs.AffineService(1.0, 0.0), costs=BatcherCosts(
        release_ms=0.25, release_spread_ms=(-0.5, 0.5), idle_ms=(0.4999, 0.5),
        wake_ms=(0.0, 1.0)))
    assert 4 / woken.capacity_rps(4) == pytest.approx((1.28125 + 0.25) * MS, rel=1e-3)


def test_at_speed_scales_the_workers_time_and_leaves_the_loop_alone():
    svc = costly_service((0.8, 1.0, 1.6))
    slow = at_speed(svc, 1.5)
    b = np.array([1, 4, 8])
    np.testing.assert_allclose(slow.mean_ms(b), 1.5 * svc.mean_ms(b))
    assert slow.jitter_quantiles == svc.jitter_quantiles
    assert slow.costs.arrival_ms == pytest.approx(1.5 * svc.costs.arrival_ms)
    assert slow.costs.first_arrival_ms == pytest.approx(1.5 * svc.costs.first_arrival_ms)
    assert slow.costs.wake_s(0.5e-3) == pytest.approx(1.5 * svc.costs.wake_s(0.5e-3))
    for same in ("react_ms", "release_ms", "release_per_item_ms", "timer_resolution_ms",
                 "timer_latency_ms", "idle_ms"):
        assert getattr(slow.costs, same) == getattr(svc.costs, same)
    affine = CalibratedService(bs.AffineService(1.0, 0.1), per_batch_ms=0.5)
    np.testing.assert_allclose(at_speed(affine, 0.5).mean_ms(b),
                               0.5 * affine.mean_ms(b))
    with pytest.raises(ValueError, match="ratio must be"):
        at_speed(svc, 0.0)
    with pytest.raises(ValueError, match="service must be a CalibratedService"):
        at_speed(bs.AffineService(1.0, 0.1), 2.0)


@pytest.mark.parametrize("speed", [0.7, 1.0, 1.3])
def test_worker_time_ratio_reads_back_the_speed_a_run_was_simulated_at(speed):
    """Without a spread, every batch of a run simulated at ``speed`` holds its worker
    exactly ``speed`` times the typical time: the ratio is ``speed`` to rounding, with
    batches stretched by arrivals, woken after idle, full and timed out."""
    svc = costly_service()
    run = bs.simulate(bs.Poisson(0.6 * svc.capacity_rps(8)), bs.BatchPolicy(8, 0.5),
                      at_speed(svc, speed), n_requests=3000, seed=4)
    assert {int(t) for t in run.trigger} >= {bs.policy.SIZE, bs.policy.TIMEOUT}
    assert worker_time_ratio(svc, run) == pytest.approx(speed, rel=1e-9)
    with pytest.raises(ValueError, match="service must be a CalibratedService"):
        worker_time_ratio(svc.model, run)


def test_worker_time_ratio_is_the_mean_speed_when_slow_batches_are_slower_than_calibrated():
    """The real batches have the calibration's median but a heavier slow tail (their
    spread's mean 1.16 against 1.00): a queue drains at the mean, so the ratio reads the
    tail's cost, the ratio of the two means, within four standard errors of the drawn
    spread's mean (weighted by each batch's typical time), where the median batch's
    ratio reads about 1 (the heavy spread's 55th percentile is 1.1; over 1.15, the
    sample median of about 1,300 batches would be six standard errors off). No costs
    outside the spread, so a batch's time is its typical time times its draw; the
    slowest stay within ``STALL_MS`` of their prediction, so none counts as stalled."""
    no_costs = {"arrival_ms": 0.0, "first_arrival_ms": 0.0, "wake_ms": (0.0, 0.0)}
    calibrated = costly_service(tuple(np.linspace(0.9, 1.1, 21)), **no_costs)
    heavy = np.r_[np.linspace(0.9, 1.0, 11), np.linspace(1.1, 1.7, 10)]
    real = costly_service(tuple(heavy), **no_costs)
    run = bs.simulate(bs.Poisson(0.5 * real.capacity_rps(8)), bs.BatchPolicy(8, 0.5), real,
                      n_requests=4000, seed=6)
    table = batch_residuals(calibrated, run)
    assert table["ratio"].median() < 1.15
    expected = real.jitter_mean / calibrated.jitter_mean
    weights = table["typical_ms"] / table["typical_ms"].sum()
    se = real.jitter_cv * real.jitter_mean * np.sqrt((weights**2).sum())
    assert expected == pytest.approx(1.16, abs=0.01)
    assert abs(worker_time_ratio(calibrated, run) - expected) < 4 * se, (expected, se)


def test_worker_time_ratio_is_one_at_the_calibrations_speed_with_a_skewed_spread():
    """A run simulated with the calibration itself, whose spread is skewed (quantiles
    0.9, 1.0, 1.0, 1.6: median 1, mean 1.0833): each batch holds its worker its typical
    time times a draw from the spread, so the ratio of totals over the mean's
    expectation is 1 within four standard errors (the draw's CV times the root of the
    sum of the squared weights, each batch's share of the typical time); over the
    median's it would read 1.0833, many standard errors off. No costs outside the
    spread; the slowest batch is 0.8 ms over its median time, within ``STALL_MS``."""
    no_costs = {"arrival_ms": 0.0, "first_arrival_ms": 0.0, "wake_ms": (0.0, 0.0)}
    svc = costly_service((0.9, 1.0, 1.0, 1.6), **no_costs)
    assert svc.jitter_mean == pytest.approx(3.25 / 3)
    run = bs.simulate(bs.Poisson(0.5 * svc.capacity_rps(8)), bs.BatchPolicy(8, 0.5), svc,
                      n_requests=4000, seed=7)
    table = batch_residuals(svc, run)
    assert (table["worker_ms"] - table["typical_ms"]).max() < bs.calibrate.STALL_MS
    weights = table["typical_ms"] / table["typical_ms"].sum()
    se = svc.jitter_cv * np.sqrt((weights**2).sum())
    assert svc.jitter_mean - 1 > 10 * se, se        # the median's reading is far off
    assert abs(worker_time_ratio(svc, run) - 1.0) < 4 * se, se


def test_worker_time_ratio_leaves_out_a_batch_stalled_by_the_machine():
    """A spread-free run at the calibration's speed whose last batch was stalled for 5 ms
    (as by a neighbour taking the core): left out, as the calibration leaves stalls out of
    its spread, the ratio stays exactly 1."""
    svc = costly_service()
    run = bs.simulate(bs.Poisson(0.6 * svc.capacity_rps(8)), bs.BatchPolicy(8, 0.5), svc,
                      n_requests=2000, seed=3)
    run.end_s[-1] += 0.005
    assert run.end_s[-1] - run.start_s[-1] > 0.005
    assert worker_time_ratio(svc, run) == pytest.approx(1.0, rel=1e-9)


def test_batch_residuals_set_every_batch_against_its_prediction():
    """A run simulated 1.3 times as slow as a spread-free calibration: every batch reads
    1.3, whatever its size, trigger, idle time or arrivals received; the last batch
    (after the last arrival) stretched by 2 ms reads exactly that much more."""
    svc = costly_service()
    run = bs.simulate(bs.Poisson(0.6 * svc.capacity_rps(8)), bs.BatchPolicy(8, 0.5),
                      at_speed(svc, 1.3), n_requests=2000, seed=4)
    table = batch_residuals(svc, run)
    assert len(table) == run.n_batches - WARM_BATCHES
    np.testing.assert_array_equal(table["size"], run.size[WARM_BATCHES:])
    assert set(table["trigger"]) == {"size", "timeout"}
    assert (table["idle_ms"] > 0).any() and (table["received"] > 0).any()
    np.testing.assert_allclose(table["ratio"], 1.3, rtol=1e-9)
    np.testing.assert_allclose(table["worker_ms"],
                               1e3 * (run.end_s - run.start_s)[WARM_BATCHES:])
    # A simulated run does not say when a worker picked its batch up, nor, without a
    # sender on the loop, in which turns the requests came.
    assert table[["pickup_ms", "launch_ms", "received_after_pickup", "turns"]].isna().all().all()
    assert table["received"].iloc[-1] == 0
    run.end_s[-1] += 0.002
    last = batch_residuals(svc, run).iloc[-1]
    assert last["typical_ms"] == pytest.approx(table["typical_ms"].iloc[-1], rel=1e-12)
    assert last["ratio"] == pytest.approx(1.3 + 2.0 / last["typical_ms"], rel=1e-9)
    with pytest.raises(ValueError, match="service must be a CalibratedService"):
        batch_residuals(svc.model, run)
    two = bs.simulate(bs.Constant(10.0), bs.BatchPolicy(8, 0.0), svc, n_requests=2)
    with pytest.raises(ValueError, match=f"res must have more than {WARM_BATCHES} batches"):
        batch_residuals(svc, two)


def test_batch_residuals_count_each_size_classs_uses_from_the_runs_first_batch():
    """Groups of requests 10 ms apart, each one batch: sizes 1, 2, 3, 4, 5, 8, 1, 3, 2
    fall in the classes up to 1, 2, 4, 4, 8, 8, 1, 4, 2 rows; their uses in the run,
    counted from its first batch (which the table leaves out, warming up), 1, 1, 1, 2,
    1, 2, 2, 3, 2."""
    sizes = (1, 2, 3, 4, 5, 8, 1, 3, 2)
    arrivals = np.concatenate([np.full(k, 0.01 * i) for i, k in enumerate(sizes)])
    run = bs.simulate(bs.Trace(arrivals), bs.BatchPolicy(16, 1.0), costly_service(),
                      n_requests=arrivals.size)
    assert tuple(run.size) == sizes
    table = batch_residuals(costly_service(), run)
    assert table["class_use"].tolist() == [1, 1, 1, 2, 1, 2, 2, 3, 2][WARM_BATCHES:]


def test_calibrated_service_saves_and_loads(tmp_path):
    costs = BatcherCosts(0.02, 0.03, 0.001, 1.0, 0.1, 0.005, (0.01, 1.0), (0.0, 0.15))
    svc = CalibratedService(bs.ProfileService((1, 8), (0.1, 0.3)), 0.05, 0.002,
                            (0.8, 1.0, 1.5), costs, {"model": "tiny-mlp"})
    svc.save(tmp_path / "cal.json")
    back = bs.load_service(tmp_path / "cal.json")
    assert back == svc and back.costs == costs and back.metadata == {"model": "tiny-mlp"}


@pytest.mark.parametrize("kwargs, match", [
    ({"model": 3}, "model must be a service model"),
    ({"per_batch_ms": -0.1}, "per_batch_ms"),
    ({"jitter_quantiles": (1.0,)}, "jitter_quantiles"),
    ({"jitter_quantiles": (2.0, 1.0)}, "jitter_quantiles"),
    ({"costs": {"react_ms": 1.0}}, "costs must be BatcherCosts"),
    ({"jitter_quantiles": ("a", "b")}, "jitter_quantiles must be a sequence of numbers"),
    ({"jitter_quantiles": [[0.9, 1.0], [1.0, 1.1]]},
     "jitter_quantiles must be a sequence of numbers"),
    ({"metadata": 3}, "metadata must be a dict, got 3"),
])
def test_calibrated_service_refuses_bad_values(kwargs, match):
    args = {"model": bs.AffineService(1.0, 0.1), **kwargs}
    with pytest.raises(ValueError, match=match):
        CalibratedService(**args)


def test_batcher_costs_name_a_spread_that_is_not_numbers():
    with pytest.raises(ValueError, match="release_spread_ms must be a sequence of numbers, "
                                         "got 'ab'"):
        BatcherCosts(release_spread_ms="ab")


# -- the engines apply it, identically --------------------------------------------------


def run_both(*args, **kwargs):
    return (bs.simulate(*args, **kwargs, engine="fast"),
            bs.simulate(*args, **kwargs, engine="simpy"))


costs_st = st.builds(
    BatcherCosts, react_ms=st.sampled_from([0.0, 0.02, 0.3]),
    release_ms=st.sampled_from([0.0, 0.05, 0.5]),
    release_per_item_ms=st.sampled_from([0.0, 0.01]),
    timer_resolution_ms=st.sampled_from([0.0, 0.3, 1.0]),
    timer_latency_ms=st.sampled_from([0.0, 0.1]), arrival_ms=st.sampled_from([0.0, 0.05]),
    idle_ms=st.just((0.01, 0.1, 1.0)), wake_ms=st.sampled_from([(0, 0, 0), (0, 0.05, 0.2)]),
    first_arrival_ms=st.sampled_from([0.0, 0.07]),
    release_spread_ms=st.sampled_from([(), (-0.04, 0.0, 0.1)]))
workloads = st.one_of(
    st.builds(bs.Poisson, st.floats(50, 8000)),
    st.builds(bs.Constant, st.sampled_from([250.0, 1000.0, 4000.0])),    # ties
    st.lists(st.integers(0, 40), min_size=1, max_size=60).map(
        lambda xs: bs.Trace(np.sort(np.array(xs)) * 0.5e-3)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads, costs=costs_st, max_b=st.integers(1, 12),
       max_wait_ms=st.sampled_from([0.0, 0.5, 2.5, math.inf]),
       spread=st.sampled_from([(), (0.5, 1.0, 2.0)]), n=st.integers(1, 200),
       seed=st.integers(0, 2**32))
def test_fast_and_simpy_make_the_same_run_with_batcher_costs(workload, costs, max_b,
                                                             max_wait_ms, spread, n, seed):
    svc = CalibratedService(bs.AffineService(0.4, 0.05), 0.05, 0.01, spread, costs)
    n = None if isinstance(workload, bs.Trace) else n
    fast, simpy = run_both(workload, bs.BatchPolicy(max_b, max_wait_ms), svc, n, seed=seed)
    for name in ("size", "trigger", "batch_id", "status"):
        np.testing.assert_array_equal(getattr(fast, name), getattr(simpy, name), name)
    for name in ("start_s", "end_s", "finish_s"):
        np.testing.assert_allclose(getattr(fast, name), getattr(simpy, name), atol=1e-12,
                                   rtol=0, err_msg=name)


@pytest.mark.parametrize("max_wait_ms", [0.0, 1.0, math.inf])
def test_without_costs_a_calibrated_service_runs_like_its_model(max_wait_ms):
    model = bs.AffineService(0.5, 0.1)
    policy = bs.BatchPolicy(6, max_wait_ms)
    plain = bs.simulate(bs.Poisson(3000.0), policy, model, 2000, seed=3)
    for engine in ("fast", "simpy"):
        cal = bs.simulate(bs.Poisson(3000.0), policy, CalibratedService(model), 2000, seed=3,
                          engine=engine)
        np.testing.assert_array_equal(cal.size, plain.size)
        np.testing.assert_array_equal(cal.start_s, plain.start_s)
        np.testing.assert_array_equal(cal.finish_s, plain.finish_s)


def test_what_the_fast_engine_does_not_model_falls_back_to_simpy():
    svc = CalibratedService(bs.AffineService(0.5, 0.1), costs=BatcherCosts(react_ms=0.01))
    for kwargs in ({"workers": 2}, {"policy": bs.BatchPolicy(4, 1.0, max_queue_size=8)}):
        args = {"workload": bs.Poisson(2000.0), "policy": bs.BatchPolicy(4, 1.0),
                "service": svc, "n_requests": 300, **kwargs}
        with pytest.raises(NotImplementedError, match="engine='simpy'"):
            bs.simulate(**args, engine="fast")
        assert bs.simulate(**args).meta["engine"] == "simpy"


def test_a_timer_fires_on_the_grid_from_the_last_wake_up_by_hand():
    """Policy (4, 1 ms); arrivals at 0 and 0.2 ms (and one much later, so that the stream
    stays open); timers on a 1 ms grid. The loop last woke for the second arrival, at
    0.2 ms + react: the timer due at 1 ms rounds up to a whole millisecond from then."""
    trace = bs.Trace([0.0, 0.2 * MS, 50 * MS])
    for react_ms, start_ms in ((0.0, 1.2), (0.05, 1.25)):
        svc = CalibratedService(bs.AffineService(1.0, 0.0), costs=BatcherCosts(
            react_ms=react_ms, timer_resolution_ms=1.0))
        for engine in ("fast", "simpy"):
            res = bs.simulate(trace, bs.BatchPolicy(4, 1.0), svc, engine=engine)
            assert res.start_s[0] == pytest.approx(start_ms * MS)
            assert res.size[0] == 2


def test_a_closed_stream_flushes_at_the_last_arrivals_wake_up():
    trace = bs.Trace([0.0, 0.2 * MS])
    svc = CalibratedService(bs.AffineService(1.0, 0.0), costs=BatcherCosts(
        react_ms=0.05, timer_resolution_ms=1.0))
    for engine in ("fast", "simpy"):
        res = bs.simulate(trace, bs.BatchPolicy(4, 1.0), svc, engine=engine)
        assert res.start_s == pytest.approx([0.25 * MS])
        assert res.trigger.tolist() == [bs.policy.FLUSH]


def test_release_react_and_wake_by_hand():
    """One request a batch; 1 ms each, 0.5 ms release, 0.1 ms react; the wake-up counts
    from the end of the worker's previous batch: none after just the release, 0.3 ms
    after 10 ms or more."""
    costs = BatcherCosts(react_ms=0.1, release_ms=0.5, idle_ms=(0.5, 10.0),
                         wake_ms=(0.0, 0.3))
    svc = CalibratedService(bs.AffineService(1.0, 0.0), costs=costs)
    trace = bs.Trace([0.0, 0.2 * MS, 20 * MS])
    for engine in ("fast", "simpy"):
        res = bs.simulate(trace, bs.BatchPolicy(1, 0.0), svc, engine=engine)
        # First: woken 0.1 ms after its arrival, never-used worker (its last batch: never).
        # Second: waits for the release at 1.4 + 0.5 ms; 0.5 ms after the end, no wake.
        # Third: woken at 20.1 ms, 17.2 ms after the worker's last batch ended.
        assert res.start_s == pytest.approx([0.1 * MS, 1.9 * MS, 20.1 * MS])
        assert res.end_s == pytest.approx([1.4 * MS, 2.9 * MS, 21.4 * MS])
        assert res.latency_s == pytest.approx([1.4 * MS, 2.7 * MS, 1.4 * MS])



# -- a load generator on the batcher's event loop (sender="loop") ------------------------


@pytest.mark.parametrize("workload", [
    bs.Poisson(3000.0),
    bs.Trace(np.arange(2000) * MS),   # on a lattice: arrivals tie with timeouts' instants
], ids=["poisson", "lattice"])
@pytest.mark.parametrize("max_b, max_wait_ms", [(1, 0.0), (8, 0.0), (8, 1.0), (8, 2.0),
                                                (8, math.inf)])
def test_a_sender_on_an_ideal_loop_changes_nothing(workload, max_b, max_wait_ms):
    """With no loop costs every request reaches the batcher when it is sent and the run
    is the plain rule's, ties included: one sent at a dispatch's instant joins it."""
    model = bs.AffineService(0.5, 0.1)
    policy = bs.BatchPolicy(max_b, max_wait_ms)
    plain = bs.simulate(workload, policy, model, 2000, seed=3)
    sent = bs.simulate(workload, policy, CalibratedService(model), 2000, seed=3,
                       sender="loop")
    np.testing.assert_array_equal(sent.arrival_s, plain.arrival_s)
    np.testing.assert_array_equal(sent.meta["sent_s"], plain.arrival_s)
    np.testing.assert_array_equal(sent.size, plain.size)
    np.testing.assert_array_equal(sent.trigger, plain.trigger)
    np.testing.assert_allclose(sent.finish_s, plain.finish_s, atol=1e-12, rtol=0)


def sent_by_hand(due_ms, policy, batch_ms, **costs):
    """The run of a sender on the loop that sends requests due at ``due_ms``, batches of
    ``batch_ms`` whatever their size; timers on a 1 ms grid and 0.1 ms late, react 0.01
    ms, and ``costs``."""
    svc = CalibratedService(bs.AffineService(batch_ms, 0.0), costs=BatcherCosts(
        react_ms=0.01, timer_resolution_ms=1.0, timer_latency_ms=0.1, **costs))
    return bs.simulate(bs.Trace(np.array(due_ms) * MS), policy, svc, sender="loop")


def test_a_sender_on_the_loop_by_hand():
    """Greedy, 0.5 ms a batch; timers on a 1 ms grid and 0.1 ms late; react 0.01 ms,
    release 0.05 ms. The loop sleeps from 0: the send due at 0.3 ms wakes it at 1.1 ms,
    the generator sends at 1.11 ms, the decision comes at 1.12 ms. The loop sleeps again
    at 1.12 ms with the send due at 1.115 ms already due: it does not sleep, and that
    request reaches the batcher at 1.13 ms, the worker busy. The one due at 1.5 ms would
    wake it at 2.22 ms, but the release at 1.62 + 0.05 ms comes first: the worker takes
    the request waiting, then the generator sends the due one at 1.68 ms, which waits
    for the release of 2.17 + 0.05 ms."""
    res = sent_by_hand([0.3, 1.115, 1.5], bs.BatchPolicy(1, 0.0), 0.5, release_ms=0.05)
    assert res.arrival_s == pytest.approx([1.11 * MS, 1.13 * MS, 1.68 * MS])
    assert res.start_s == pytest.approx([1.12 * MS, 1.67 * MS, 2.22 * MS])
    assert res.end_s == pytest.approx([1.62 * MS, 2.17 * MS, 2.72 * MS])


def test_a_request_sent_right_after_a_dispatch_delays_that_batch():
    """max_batch_size 8, max_wait 1 ms, 0.5 ms a batch, 0.2 ms per request received
    during one; timers as above. The first request, due at 0.05 ms, reaches the batcher
    at 1.11 ms; its timeout (2.11 ms) and the second send (due at 1.5 ms) share the timer
    that fires at 2.22 ms. The batch of one leaves then, and the second request, due
    before it, is sent in the turn after it, at 2.23 ms: the batch ends 0.2 ms later,
    at 2.92 ms. The generator closed with that send, so the second goes at the release."""
    res = sent_by_hand([0.05, 1.5], bs.BatchPolicy(8, 1.0), 0.5, arrival_ms=0.2)
    assert res.arrival_s == pytest.approx([1.11 * MS, 2.23 * MS])
    assert res.start_s == pytest.approx([2.22 * MS, 2.92 * MS])
    assert res.end_s == pytest.approx([2.92 * MS, 3.42 * MS])


def test_the_first_request_received_during_a_batch_costs_it_once():
    """max_batch_size 1, 3 ms a batch; 0.2 ms per request received during one and 0.3 ms
    more for the first; timers as above. The first request reaches the batcher at 1.11
    ms and its batch leaves at 1.12 ms. The loop sleeps; the send due at 1.5 ms wakes it
    at 2.22 ms and reaches the batcher at 2.23 ms (0.5 ms more for the batch), the one
    due at 2.5 ms at 3.35 ms (0.2 ms more): the batch ends at 4.82 ms, not 5.12."""
    res = sent_by_hand([0.05, 1.5, 2.5], bs.BatchPolicy(1, 0.0), 3.0, arrival_ms=0.2,
                       first_arrival_ms=0.3)
    assert res.arrival_s == pytest.approx([1.11 * MS, 2.23 * MS, 3.35 * MS])
    assert res.start_s == pytest.approx([1.12 * MS, 4.82 * MS, 7.82 * MS])
    assert res.end_s == pytest.approx([4.82 * MS, 7.82 * MS, 10.82 * MS])


def test_the_sender_on_the_loop_records_its_turns():
    """Greedy batches of one, 3 ms each; timers as above. The loop wakes at 1.1 ms for
    the send due at 0.05 ms and sends the three due by 1.11 ms in one turn; the sends
    due at 1.5 and 2.5 ms come in a turn each, at 2.23 and 3.35 ms."""
    res = sent_by_hand([0.05, 0.2, 0.3, 1.5, 2.5], bs.BatchPolicy(1, 0.0), 3.0)
    assert res.arrival_s == pytest.approx([1.11 * MS] * 3 + [2.23 * MS, 3.35 * MS])
    assert res.meta["turn_sizes"].tolist() == [3, 1, 1]


def test_batch_residuals_count_the_turns_that_brought_a_batch_its_requests():
    """A simulated generator on the loop: each batch's ``turns`` is the number of
    distinct instants at which the requests it received reached the batcher."""
    svc = costly_service()
    run = bs.simulate(bs.Poisson(0.8 * svc.capacity_rps(8)), bs.BatchPolicy(8, 0.0), svc,
                      n_requests=3000, seed=5, sender="loop")
    assert run.meta["turn_sizes"].sum() == 3000
    table = batch_residuals(svc, run)
    a = run.arrival_s
    distinct = [np.unique(a[(a > t0) & (a < t1)]).size
                for t0, t1 in zip(run.start_s[WARM_BATCHES:], run.end_s[WARM_BATCHES:],
                                  strict=True)]
    np.testing.assert_array_equal(table["turns"], distinct)
    assert table["turns"].max() >= 2 and (table["turns"] < table["received"]).any()


@pytest.mark.parametrize("sender", [None, "loop"])
def test_a_refit_recovers_the_costs_that_simulated_runs_were_made_with(sender):
    """Runs simulated without a spread hold each batch's typical time exactly: fitted
    again on them, a calibration that knew nothing of the batcher gets back its costs
    per batch, per request, per arrival and for the first arrival, the release at each
    size of its table and the reaction, and finds no wake-up after idle; ``s(b)`` and
    the timer stay its own. With a sender on the loop it gets back the cost of a later
    turn into a batch too; without, no turn is recorded and none is fitted."""
    svc = costly_service(idle_ms=(), wake_ms=(), linger_ms=0.005, send_ms=0.001,
                         turn_ms=0.004)
    costs = svc.costs
    runs = [bs.simulate(bs.Poisson(load * svc.capacity_rps(8)), bs.BatchPolicy(8, wait_ms),
                        svc, n_requests=1500, seed=k, sender=sender)
            for k, (load, wait_ms) in enumerate(itertools.product((0.1, 0.4, 0.7), (0.0, 1.0)))]
    naive = CalibratedService(svc.model, costs=BatcherCosts(timer_resolution_ms=1.0,
                                                            timer_latency_ms=0.05))
    fit = refit(naive, runs)
    assert fit.model == svc.model
    assert fit.per_batch_ms == pytest.approx(0.1, rel=1e-9)
    assert fit.per_item_ms == pytest.approx(0.01, rel=1e-9)
    c = fit.costs
    for name in ("react_ms", "timer_resolution_ms", "timer_latency_ms", "arrival_ms",
                 "first_arrival_ms"):
        assert getattr(c, name) == pytest.approx(getattr(costs, name), rel=1e-9), name
    assert len(c.release_sizes) >= 3
    np.testing.assert_allclose(c.release_s(c.release_sizes), costs.release_s(c.release_sizes),
                               rtol=1e-9)
    assert c.wake_ms == pytest.approx([0.0] * len(c.wake_ms), abs=1e-9)
    assert c.release_spread_ms == pytest.approx([0.0] * len(c.release_spread_ms), abs=1e-9)
    assert fit.jitter_quantiles == pytest.approx([1.0] * len(fit.jitter_quantiles))
    # The linger, from the sender's turns: midway between the nearest delays either side
    # of the split, so both it and the truth lie between them; runs without a sender
    # recorded no turns, and the engines then take a reaction. The sends' spacing and
    # the hold after a dispatch, from the turns too (none recorded: none).
    if sender == "loop":
        delays_s, awake = (np.concatenate(v) for v in zip(*(
            _after_turns(r, np.r_[0, np.cumsum(r.meta["turn_sizes"])[:-1]], 1.0)[:2]
            for r in runs), strict=True))
        for linger_ms in (c.linger_ms, costs.linger_ms):
            assert delays_s[awake].max() <= linger_ms / 1e3 <= delays_s[~awake].min()
        assert c.send_ms == pytest.approx(costs.send_ms, rel=1e-6)
        assert (c.hold_ms, c.hold_per_item_ms) == pytest.approx((0.0, 0.0), abs=1e-12)
        later_turns = np.concatenate([_later(r)[0] for r in runs])
        assert later_turns.sum() > 50
        assert c.turn_ms == pytest.approx(costs.turn_ms, rel=1e-6)
    else:
        assert c.turn_ms is None
        assert c.linger_ms is None and c.linger_s == c.react_s
        assert (c.send_ms, c.hold_ms, c.hold_per_item_ms) == (0.0, 0.0, 0.0)   # defaults
    with pytest.raises(ValueError, match="service must be a CalibratedService"):
        refit(svc.model, runs)
    with pytest.raises(ValueError, match="runs must be a non-empty list of RunResults"):
        refit(svc, [])


#: Release spreads (ms, quantiles at evenly spaced probabilities): uniform 10 us either
#: side of the line; and two modes, a quarter of the releases 8-9 us short (as a fifth to
#: a quarter of the tiny models' were on one CPU), most within 1 us of the line.
RELEASE_SPREADS = {"uniform": (-0.01, 0.01),
                   "two modes": (-0.009, -0.0085, -0.008, -0.001, -0.00075, -0.0005, 0.0,
                                 0.0005, 0.001)}


@pytest.mark.parametrize("spread", RELEASE_SPREADS.values(), ids=RELEASE_SPREADS.keys())
def test_a_refit_recovers_the_spread_of_the_release(spread):
    """Releases drawn from ``spread`` about their line: fitted again, the table's medians
    and the spread's quantiles come back within four standard errors (a quantile's:
    ``sqrt(p (1 - p) / n)`` over the density there), give or take how far the line moves
    within a table entry's sizes. The short mode stays in: only long releases are
    stalls."""
    svc = costly_service(idle_ms=(), wake_ms=(), release_spread_ms=spread)
    runs = [bs.simulate(bs.Poisson(load * svc.capacity_rps(8)), bs.BatchPolicy(8, 0.0),
                        svc, n_requests=3000, seed=k, sender="loop")
            for k, load in enumerate((0.4, 0.7, 0.9))]
    fit = refit(svc, runs).costs
    sizes = _releases(runs)[0]
    n = sizes.size
    assert n > 1000 and len(fit.release_sizes) >= 3
    # Each entry: the median of its batches' releases (sizes nearest one of 1, 2, 4, 8),
    # over which the line moves by 1 us per request.
    nearest = np.array([1, 2, 4, 8])[np.argmin(np.abs(np.log(sizes)[:, None]
                                                      - np.log([1, 2, 4, 8])), axis=1)]
    worst_se_ms = 0.0
    for at, release_ms in zip(fit.release_sizes, fit.release_table_ms, strict=True):
        mine = sizes[nearest == nearest[np.argmin(np.abs(sizes - at))]]
        se_ms = math.sqrt(0.25 / mine.size) / 50 + 0.001 * np.ptp(mine) / 2
        worst_se_ms = max(worst_se_ms, se_ms)
        assert release_ms == pytest.approx(0.03 + 0.001 * at, abs=4 * se_ms), at
    quantiles = np.interp((0.1, 0.5, 0.9), np.linspace(0, 1, len(fit.release_spread_ms)),
                          fit.release_spread_ms)
    true_q = lambda p: np.interp(p, np.linspace(0, 1, len(spread)), spread)  # noqa: E731
    for p, q in zip((0.1, 0.5, 0.9), quantiles, strict=True):
        per_ms = 0.02 / (true_q(p + 0.01) - true_q(p - 0.01))   # the density at q(p)
        se_ms = math.sqrt(p * (1 - p) / n) / per_ms + worst_se_ms
        assert q == pytest.approx(true_q(p), abs=4 * se_ms), p


def test_releases_leave_out_those_the_loop_took_in_awake_for_a_send():
    """One request a batch, each batch due before the last one ended; releases of 30,
    20 and 40 us. A request reaches the batcher 5 us after the third batch starts,
    within a 10 us reaction: the loop was awake for that send when it took the second
    release in, so with the reaction given that release is left out."""
    arrival_ms = [0.0, 0.05, 0.06, 2.025]
    batches_ms = [(0.0, 1.0), (1.03, 2.0), (2.02, 3.0), (3.04, 4.0)]
    rec = RunRecorder(np.array(arrival_ms) * MS, 1)
    for i, (start_ms, end_ms) in enumerate(batches_ms):
        rec.dispatch([i], start_ms * MS, end_ms * MS, 0, bs.policy.SIZE)
    res = rec.result()
    res.meta["policy"] = bs.BatchPolicy(1, 0.0)
    sizes, gaps_ms = _releases([res])
    np.testing.assert_array_equal(sizes, [1, 1, 1])
    np.testing.assert_allclose(gaps_ms, [0.03, 0.02, 0.04])
    sizes, gaps_ms = _releases([res], react_ms=0.01)
    np.testing.assert_allclose(gaps_ms, [0.03, 0.04])
    assert _releases([res], react_ms=0.004)[1].size == 3   # 5 us after: not within 4


def test_a_batch_is_due_at_its_heads_trigger_by_the_recorded_arrivals():
    """Fixed-size batches of four; arrivals at 0, 1, 2 and 3 ms and a last one at 10 ms.
    The first batch is due when its fourth request arrives, at 3 ms; the second, a lone
    request, when the stream closes with it, at 10 ms. Under max_wait 2.5 ms the first
    is due at 2.5 ms."""
    rec = RunRecorder(np.array([0.0, 1.0, 2.0, 3.0, 10.0]) * MS, 1)
    rec.dispatch([0, 1, 2, 3], 3.2 * MS, 4.0 * MS, 0, bs.policy.SIZE)
    rec.dispatch([4], 10.1 * MS, 11.0 * MS, 0, bs.policy.FLUSH)
    res = rec.result()
    res.meta["policy"] = bs.BatchPolicy(4, math.inf)
    assert _due_s(res).tolist() == [3.0 * MS, 10.0 * MS]
    res.meta["policy"] = bs.BatchPolicy(4, 2.5)
    np.testing.assert_allclose(_due_s(res), [2.5 * MS, 10.0 * MS], rtol=1e-12)


def test_a_sparse_bin_joins_the_next_one_up_and_the_last_the_one_below():
    """Bins with fewer than 10 batches: bin 1 (3 batches) joins bin 2, which with them
    still has 6 and joins bin 3; the last bin, 5, joins bin 3 below it (4 is empty)."""
    bins = np.array([0] * 10 + [1] * 3 + [2] * 3 + [3] * 10 + [5] * 4)
    merged, levels = _merged_bins(bins, 10)
    assert levels == [0, 3]
    assert merged.tolist() == [0] * 10 + [3] * 20
    assert bins.tolist() == [0] * 10 + [1] * 3 + [2] * 3 + [3] * 10 + [5] * 4  # a copy
    # A single bin stays, however few its batches.
    assert _merged_bins(np.array([4, 4]), 10)[1] == [4]


def _fit_timer(monkeypatch, delays_ms, late_ms):
    """``_timer`` fitted on the given probes instead of measured ones."""
    probes = np.column_stack([delays_ms, late_ms])
    monkeypatch.setattr(bs.calibrate, "timer_lateness_ms", lambda n, seed: probes)
    return _timer(len(probes), 0)


#: Probe delays (ms): 200 spread evenly (a golden-ratio sequence) over 0.05-2.95 ms.
TIMER_DELAYS_MS = 0.05 + 2.9 * ((np.arange(200) * 0.6180339887) % 1.0)


def test_the_timer_fit_finds_the_grid_and_the_lighter_sleeps_latency(monkeypatch):
    """Timers that fire on a 1 ms grid counted from when they were armed, then 0.1 ms
    late for two probes in five and 0.2 ms for the rest (a deeper sleep): the 1 ms grid
    leaves only the two latencies, and the latency is their 25th percentile, 0.1 ms,
    not the median, 0.2."""
    d = TIMER_DELAYS_MS
    latency_ms = np.where(np.arange(d.size) % 5 < 2, 0.1, 0.2)
    resolution, latency, record = _fit_timer(monkeypatch, d, np.ceil(d) - d + latency_ms)
    assert resolution == 1.0
    assert latency == pytest.approx(0.1, abs=1e-12)
    assert record["residual_median_ms"] == pytest.approx(0.2, abs=1e-12)
    assert record["residual_mad_ms"] == pytest.approx(0.4 * 0.1, abs=1e-12)
    assert record["n"] == d.size


def test_the_timer_fit_refuses_a_grid_that_puts_timers_after_they_fired(monkeypatch):
    """On a 1 ms grid and 0.1 ms late, but 19 timers in 200 (every tenth the grid gives
    0.1 ms or more) fired 0.1 ms before the grid's instant. That grid still spreads its
    residuals least (0.019 ms), but it would predict those 9.5% of the timers 0.1 ms
    later than they fired, past the 0.02 ms allowed at the 5th percentile: refused, the
    fit takes a grid that predicts no more than 5% of them that late."""
    d = TIMER_DELAYS_MS
    grid = np.ceil(d) - d
    early = (np.arange(d.size) % 10 == 0) & (grid >= 0.1)  # none fired before it was due
    assert early.mean() > 0.09
    late = grid + np.where(early, -0.1, 0.1)
    resolution, latency, record = _fit_timer(monkeypatch, d, late)
    assert resolution != 1.0
    rounding = np.ceil(d / resolution) * resolution - d if resolution > 0 else 0.0
    assert np.quantile(late - rounding, 0.05) >= -0.02
    assert record["residual_mad_ms"] > 0.02


def test_the_release_table_takes_medians_near_the_profile_sizes_and_merges_sparse_ones():
    """Thirty releases of 20 us after batches of one and thirty of 30 us after batches of
    four; five of 50 us after batches of two are too few for an entry of their own and
    join the next size up, whose median they do not move."""
    sizes = np.array([1] * 30 + [2] * 5 + [4] * 30)
    gaps_ms = np.array([0.02] * 30 + [0.05] * 5 + [0.03] * 30)
    table = _release_table(sizes, gaps_ms)
    assert table["release_sizes"] == (1.0, 4.0)
    assert table["release_table_ms"] == pytest.approx((0.02, 0.03))
    assert _release_table(np.array([], int), np.array([])) == {}


def test_runs_without_a_batch_due_at_the_last_ones_end_fit_no_release_spread():
    """One request every 5 ms, each served long before the next arrives: no release is
    ever seen, so none is fitted and there is no spread to draw."""
    svc = costly_service(idle_ms=(), wake_ms=(), release_spread_ms=(-0.01, 0.01))
    runs = [bs.simulate(bs.Constant(200.0), bs.BatchPolicy(8, 0.0), svc, n_requests=60,
                        seed=k) for k in range(2)]
    assert _releases(runs)[1].size == 0
    fit = refit(svc, runs).costs
    assert fit.release_spread_ms == () and fit.release_sizes == ()
    assert fit.release_s(8) == 0.0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads, costs=costs_st, max_b=st.integers(1, 12),
       max_wait_ms=st.sampled_from([0.0, 0.5, 2.5, math.inf]), n=st.integers(1, 200),
       seed=st.integers(0, 2**32))
def test_a_sender_on_the_loop_serves_everyone_by_the_rule(workload, costs, max_b,
                                                          max_wait_ms, n, seed):
    """Whatever the costs: every request reaches the batcher no earlier than it was sent,
    in order; a batch holds only requests already there, at most max_batch_size, and
    never all of them while a trigger is unmet; the one worker runs one batch at a time."""
    svc = CalibratedService(bs.AffineService(0.4, 0.05), 0.05, 0.01, (0.5, 1.0, 2.0), costs)
    policy = bs.BatchPolicy(max_b, max_wait_ms)
    n = None if isinstance(workload, bs.Trace) else n
    res = bs.simulate(workload, policy, svc, n, seed=seed, sender="loop")
    sent, got = res.meta["sent_s"], res.arrival_s
    assert (res.status == bs.COMPLETED).all()
    assert (got >= sent).all() and (np.diff(got) >= 0).all()
    assert (res.dispatch_s >= got).all()
    assert (res.size <= max_b).all()
    assert (res.start_s[1:] >= res.end_s[:-1]).all()
    waiting = np.searchsorted(got, res.start_s, "right") - np.r_[0, np.cumsum(res.size)[:-1]]
    heads = np.r_[0, np.cumsum(res.size)[:-1]]
    on_time = bs.policy.dispatch_time_s(policy, res.start_s, got[heads], np.where(
        waiting >= max_b, got[np.minimum(heads + max_b - 1, got.size - 1)], np.inf),
        got[-1]) <= res.start_s
    assert on_time.all()


@pytest.mark.parametrize("linger_ms, received_us", [
    (0.005, [1, 101, 107, 113, 131]),
    (None, [1, 101, 103, 111, 131]),
])
def test_the_loop_lingers_after_a_senders_turn_while_a_batch_runs(linger_ms, received_us):
    """The first request starts a 1 ms batch. While it runs, a sender's turn asks the
    batcher for nothing and the loop sleeps ``linger_ms`` after it: the request due at
    100 us goes out at 101 (the timer wakes the loop on time, the sender's step takes a
    reaction, 1 us); lingering 5 us, the loop is still awake when the ones due at 101.5
    and 110 fall due, and sends each in a turn of its own (at 107 and 113); the one due
    at 130 waits for the timer. Without a linger, a reaction: awake only until 102, the
    loop sends 101.5 at 103 and sleeps before 110."""
    svc = CalibratedService(bs.AffineService(1.0, 0.0),
                            costs=BatcherCosts(react_ms=0.001, linger_ms=linger_ms))
    due_s = np.array([0.0, 100.0, 101.5, 110.0, 130.0]) / 1e6
    res = bs.simulate(bs.Trace(due_s), bs.BatchPolicy(8, 0.0), svc, sender="loop")
    np.testing.assert_allclose(res.arrival_s * 1e6, received_us, atol=1e-6)
    assert res.meta["turn_sizes"].tolist() == [1] * 5
    # The first turn found the worker free and the queue empty: it asked for a decision,
    # which came a reaction later (a linger there would have started the batch at 6).
    np.testing.assert_allclose(res.start_s * 1e6, [2, 1002], atol=1e-6)


@pytest.mark.parametrize("linger_ms, received_us", [
    (0.005, [1, 3, 9, 21, 2001]),
    (None, [1, 3, 7, 21, 2001]),
])
def test_the_loop_lingers_after_a_turn_that_neither_empties_nor_fills_the_queue(
        linger_ms, received_us):
    """A worker free, a batch waiting up to 1 ms to fill: the first request (sent at 1
    us) asks for a decision and the loop stays a reaction; the second, due at 1.5 us, is
    sent at 3 to a queue neither empty nor filled by it, which asks the batcher for
    nothing (``submit_nowait``), and the loop lingers: 5 us, long enough for the one due
    at 6; a reaction, not (it waits for the timer, on time here)."""
    svc = CalibratedService(bs.AffineService(1.0, 0.0),
                            costs=BatcherCosts(react_ms=0.001, linger_ms=linger_ms))
    due_s = np.array([0.0, 1.5, 6.0, 20.0, 2000.0]) / 1e6
    res = bs.simulate(bs.Trace(due_s), bs.BatchPolicy(8, 1.0), svc, sender="loop")
    np.testing.assert_allclose(res.arrival_s * 1e6, received_us, atol=1e-6)
    np.testing.assert_allclose(res.start_s * 1e6, [1001, 2002], atol=1e-6)


def test_a_turn_sends_its_requests_one_after_another():
    """Sends take 2 us each: the turn woken for the request due at 0 sends it at 1 (a
    reaction), the one due at 0.5 at 3 and the one due at 4.5 at 5 (each due by the time
    the send before it is done, not by its start); the one due at 8 is not, and waits
    for its timer. The decision comes a reaction after the last send, at 6. Without send
    times the first two go at 1 and the decision at 2; the one due at 4.5 then goes at
    5.5, a turn during the batch after which the loop lingers to 10.5, and sends the one
    due at 8 a reaction later."""
    costs = BatcherCosts(react_ms=0.001, linger_ms=0.005, send_ms=0.002)
    svc = CalibratedService(bs.AffineService(1.0, 0.0), costs=costs)
    due_s = np.array([0.0, 0.5, 4.5, 8.0]) / 1e6
    res = bs.simulate(bs.Trace(due_s), bs.BatchPolicy(8, 0.0), svc, sender="loop")
    np.testing.assert_allclose(res.arrival_s * 1e6, [1, 3, 5, 9], atol=1e-6)
    assert res.meta["turn_sizes"].tolist() == [3, 1]
    np.testing.assert_allclose(res.start_s * 1e6, [6, 1006], atol=1e-6)
    at_once = CalibratedService(bs.AffineService(1.0, 0.0),
                                costs=BatcherCosts(react_ms=0.001, linger_ms=0.005))
    res = bs.simulate(bs.Trace(due_s), bs.BatchPolicy(8, 0.0), at_once, sender="loop")
    np.testing.assert_allclose(res.arrival_s * 1e6, [1, 1, 5.5, 11.5], atol=1e-6)
    np.testing.assert_allclose(res.start_s[0] * 1e6, 2, atol=1e-6)


@pytest.mark.parametrize("hold_ms, hold_per_item_ms, third_us", [
    (0.003, 0.001, 1007), (0.0, 0.0, 1003)])
def test_a_dispatch_holds_the_loop_before_the_next_turn(hold_ms, hold_per_item_ms,
                                                         third_us):
    """The first request's batch runs from 2 to 1002 us; the second, sent at 101 while
    it runs, waits. At 1002 the batch ends and the third falls due: the loop dispatches
    the second, which holds it 3 us plus 1 us per request, so the third goes out a
    reaction after that, at 1007; with no hold, at 1003."""
    costs = BatcherCosts(react_ms=0.001, linger_ms=0.005, hold_ms=hold_ms,
                         hold_per_item_ms=hold_per_item_ms)
    svc = CalibratedService(bs.AffineService(1.0, 0.0), costs=costs)
    due_s = np.array([0.0, 100.0, 1002.0]) / 1e6
    res = bs.simulate(bs.Trace(due_s), bs.BatchPolicy(8, 0.0), svc, sender="loop")
    np.testing.assert_allclose(res.arrival_s * 1e6, [1, 101, third_us], atol=1e-6)
    np.testing.assert_allclose(res.start_s[:2] * 1e6, [2, 1002], atol=1e-6)


def test_a_turn_sends_max_burst_requests_then_yields_to_the_batcher():
    """70 requests due at once to an idle worker, sends 1 us apart: the generator sends
    64 (``run_load``'s ``max_burst``) at 1-64 us, yields, and the batcher takes them as
    one batch a reaction later (65 us); the generator goes on at once with the other 6
    (65-70 us), which wait for the next batch. Without the cap one batch of 70."""
    costs = BatcherCosts(react_ms=0.001, linger_ms=0.005, send_ms=0.001)
    svc = CalibratedService(bs.AffineService(1.0, 0.0), costs=costs)
    res = bs.simulate(bs.Trace(np.zeros(70)), bs.BatchPolicy(128, 0.0), svc, sender="loop")
    assert MAX_BURST == inspect.signature(bs.real.run_load).parameters["max_burst"].default
    np.testing.assert_allclose(res.arrival_s * 1e6, np.arange(1, 71), atol=1e-6)
    assert res.meta["turn_sizes"].tolist() == [64, 6]
    assert res.size.tolist() == [64, 6]
    np.testing.assert_allclose(res.start_s[0] * 1e6, 65, atol=1e-6)


@pytest.mark.parametrize("arrival_ms, kept", [(0.00095, 6), (0.0001, 0)])
def test_a_worker_the_loop_ran_ahead_of_keeps_the_core_while_the_lead_lasts(arrival_ms, kept):
    """1,600 requests due at once; sends 1 us apart, 64 to a turn; 50 us batches of 64,
    each request received while one runs delaying it ``arrival_ms``. At 0.95 us a
    request the turns hold the first batch (65 us on) until 540.6 us: its worker waited
    425.6 us for the loop beyond its own 50, a lead of 375.6 us. From then on, at each
    full turn's yield the worker keeps the core: the generator's next turn comes at the
    batch's end, and each such batch spends 50 us of the lead, so six batches are kept
    (the lead falls to 75.6 us, under ``FAIR_SHARE_LEAD_S``). At 0.1 us a request the
    loop never gets ahead and the turns go on 5 us (the linger) after each other."""
    assert FAIR_SHARE_LEAD_S == pytest.approx(100e-6)
    costs = BatcherCosts(react_ms=0.001, linger_ms=0.005, send_ms=0.001, arrival_ms=arrival_ms)
    svc = CalibratedService(bs.AffineService(0.05, 0.0), costs=costs)
    res = bs.simulate(bs.Trace(np.zeros(1600)), bs.BatchPolicy(64, 0.0), svc, sender="loop")
    gaps = np.flatnonzero(np.diff(res.arrival_s) > 6e-6)
    assert gaps.size == kept
    np.testing.assert_allclose(res.arrival_s[gaps + 1], res.end_s[1:kept + 1], atol=1e-9)
    if kept:
        np.testing.assert_allclose(res.end_s[0] * 1e6, 540.6, atol=1e-6)


def test_only_the_sends_before_a_batchs_end_delay_it():
    """A 10 us batch (2-12 us); ten requests due at 5 are sent 1 us apart from 6 us, each
    delaying the batch 0.1 us while it runs: those sent at 6-12 us do (the end moves to
    12.7 us), the three after it do not."""
    costs = BatcherCosts(react_ms=0.001, linger_ms=0.005, send_ms=0.001, arrival_ms=0.0001)
    svc = CalibratedService(bs.AffineService(0.01, 0.0), costs=costs)
    due_s = np.r_[0.0, np.full(10, 5.0)] / 1e6
    res = bs.simulate(bs.Trace(due_s), bs.BatchPolicy(16, 0.0), svc, sender="loop")
    np.testing.assert_allclose(res.arrival_s[1:] * 1e6, np.arange(6, 16), atol=1e-6)
    np.testing.assert_allclose(res.end_s[0] * 1e6, 12.7, atol=1e-6)


@pytest.mark.parametrize("turn_ms, end_us", [(None, 104.4), (0.003, 109.2)])
def test_a_later_turn_into_a_batch_costs_its_own_time_and_a_send_per_request(turn_ms,
                                                                              end_us):
    """A 100 us batch dispatched at 2 us (the first request, due at 0, sent one reaction
    late and decided one more later); two requests due at 10 us are sent at 11 and 12 us,
    the first turn into it (2 us, and 0.1 us each); two due at 50 us at 51 and 52 us, a
    later turn. Without ``turn_ms`` those cost 0.1 us each as well; with it, 3 us for the
    turn and the loop's 1 us per send."""
    costs = BatcherCosts(react_ms=0.001, linger_ms=0.005, send_ms=0.001, arrival_ms=0.0001,
                         first_arrival_ms=0.002, turn_ms=turn_ms)
    svc = CalibratedService(bs.AffineService(0.1, 0.0), costs=costs)
    due_s = np.array([0.0, 10.0, 10.0, 50.0, 50.0]) / 1e6
    res = bs.simulate(bs.Trace(due_s), bs.BatchPolicy(16, 0.0), svc, sender="loop")
    np.testing.assert_allclose(res.arrival_s * 1e6, [1, 11, 12, 51, 52], atol=1e-6)
    np.testing.assert_allclose(res.start_s[0] * 1e6, 2.0, atol=1e-6)
    np.testing.assert_allclose(res.end_s[0] * 1e6, end_us, atol=1e-6)


def test_the_sends_spacing_and_the_hold_after_a_dispatch_are_fitted_on_the_turns():
    """Runs simulated with sends 1 us apart and a dispatch of ``b`` holding the loop
    2 + 0.5 b us: the turns give both back (the delay from a dispatch to the turn right
    after it, less the reaction, a line in the batch's size); without recorded turns,
    nothing is fitted."""
    svc = costly_service(idle_ms=(), wake_ms=(), linger_ms=0.005, send_ms=0.001,
                         hold_ms=0.002, hold_per_item_ms=0.0005)
    runs = [bs.simulate(bs.Poisson(load * svc.capacity_rps(8)), bs.BatchPolicy(8, 0.0),
                        svc, n_requests=1500, seed=k, sender="loop")
            for k, load in enumerate((0.4, 0.7, 0.9))]
    fit = _turn_times(runs, svc.costs.react_ms)
    assert fit == pytest.approx({"send_ms": 0.001, "hold_ms": 0.002,
                                 "hold_per_item_ms": 0.0005}, rel=1e-6)
    for res in runs:
        del res.meta["turn_sizes"]
    assert _turn_times(runs, svc.costs.react_ms) == {}


def test_no_linger_is_fitted_without_a_coarse_timer_or_enough_turns():
    """A sleep shows only where the timer rounds it up (asyncio's epoll selector: to
    whole milliseconds); with a fine timer, or too few turns either side, the engines
    take a reaction."""
    svc = costly_service(linger_ms=0.005)
    runs = [bs.simulate(bs.Poisson(0.9 * svc.capacity_rps(8)), bs.BatchPolicy(8, 0.0), svc,
                        n_requests=3000, seed=seed, sender="loop") for seed in (1, 2)]
    # Midway between the nearest delays either side: a score of turns sent awake here.
    assert _linger_ms(runs, 1.0) == pytest.approx(0.005, abs=5e-4)
    assert _linger_ms(runs, 0.0) is None and _linger_ms(runs, 0.05) is None
    few = bs.simulate(bs.Poisson(0.7 * svc.capacity_rps(8)), bs.BatchPolicy(8, 0.0), svc,
                      n_requests=40, seed=1, sender="loop")
    assert _linger_ms([few], 1.0) is None


def test_a_linger_is_a_non_negative_time_or_none():
    assert BatcherCosts(react_ms=0.01).linger_s == pytest.approx(1e-5)
    assert BatcherCosts(react_ms=0.01, linger_ms=0.004).linger_s == pytest.approx(4e-6)
    with pytest.raises(ValueError, match="linger_ms must be .*, got -0.001"):
        BatcherCosts(linger_ms=-0.001)


@pytest.mark.parametrize("kwargs, match", [
    ({"service": bs.AffineService(0.5, 0.1)}, "sender='loop' needs a calibrated service"),
    ({"engine": "simpy"}, "engine='simpy'"),
    ({"workers": 2}, "workers=2"),
    ({"policy": bs.BatchPolicy(4, 1.0, max_queue_size=8)}, "max_queue_size"),
    ({"sender": "thread"}, "sender"),
])
def test_a_sender_on_the_loop_refuses_what_it_does_not_model(kwargs, match):
    args = {"workload": bs.Poisson(2000.0), "policy": bs.BatchPolicy(4, 1.0),
            "service": CalibratedService(bs.AffineService(0.5, 0.1)), "n_requests": 50,
            "sender": "loop", **kwargs}
    with pytest.raises(ValueError, match=match):
        bs.simulate(**args)


# -- compare ----------------------------------------------------------------------------


def one_request_batches(latency_ms, arrival_s):
    rec = RunRecorder(np.asarray(arrival_s, float), 1)
    for i, (a, lat) in enumerate(zip(arrival_s, latency_ms, strict=True)):
        rec.dispatch([i], a, a + lat * MS, 0, bs.policy.SIZE)
    return rec.result()


def test_compare_gives_the_exact_errors_of_constructed_runs():
    arrival_s = [0.0, 0.01, 0.02, 0.03, 0.04]
    real = one_request_batches([1.0, 2.0, 3.0, 4.0, 5.0], arrival_s)
    sim = one_request_batches([1.1, 2.0, 3.3, 4.0, 5.5], arrival_s)
    c = compare(real, sim)
    t = c.table
    assert t.loc["latency_ms_p50", "rel_error"] == pytest.approx(0.1)
    assert t.loc["latency_ms_mean", "rel_error"] == pytest.approx(3.18 / 3.0 - 1)
    assert t.loc["latency_ms_p99", "real"] == pytest.approx(np.percentile([1, 2, 3, 4, 5], 99))
    assert t.loc["latency_ms_p99", "rel_error"] == pytest.approx(
        np.percentile([1.1, 2, 3.3, 4, 5.5], 99) / np.percentile([1, 2, 3, 4, 5], 99) - 1)
    # Throughput: 5 requests from the first arrival to the last finish.
    assert t.loc["throughput_rps", "real"] == pytest.approx(5 / 0.045)
    assert t.loc["throughput_rps", "rel_error"] == pytest.approx(0.045 / 0.0455 - 1)
    assert t.loc["mean_batch_size", "rel_error"] == 0.0
    np.testing.assert_allclose(c.error_ms, [0.1, 0.0, 0.3, 0.0, 0.5], atol=1e-9)
    assert c.error_quantiles_ms[50] == pytest.approx(0.1)
    assert c.abs_error_ms_median == pytest.approx(0.1)
    row = c.row()
    assert row["err_latency_ms_p50"] == pytest.approx(0.1)
    assert row["real_latency_ms_p50"] == pytest.approx(3.0)
    # At or under the real p50 (3 ms): 1.1 and 2 ms simulated, 1, 2 and 3 ms real; under
    # the real p95 (4.8 ms) and p99 (4.96 ms) four of five in both.
    assert t["share_error"].to_dict() == pytest.approx(
        {"latency_ms_p50": 0.4 - 0.6, "latency_ms_p95": 0.0, "latency_ms_p99": 0.0,
         "latency_ms_mean": np.nan, "throughput_rps": np.nan, "mean_batch_size": np.nan},
        nan_ok=True)
    assert row["share_err_latency_ms_p50"] == pytest.approx(-0.2)
    assert "share_err_throughput_rps" not in row
    # A run against itself: no error either way.
    itself = compare(real, real).table
    assert (itself.loc[list(LATENCY_PERCENTILES), ["rel_error", "share_error"]] == 0).all(axis=None)


def test_a_p50_in_the_gap_between_two_groups_moves_far_on_a_few_requests():
    """51 of 100 real requests take 1 ms and 49 take 10 ms; the simulation has 49 and 51.
    The p50 jumps from 1 to 10 ms (+900%), though the runs disagree on 2 requests in
    100: the simulation has 49% at or under the real p50, the real run 51%."""
    arrival_s = 0.02 * np.arange(100)
    real = one_request_batches([1.0] * 51 + [10.0] * 49, arrival_s)
    sim = one_request_batches([1.0] * 49 + [10.0] * 51, arrival_s)
    t = compare(real, sim).table
    assert t.loc["latency_ms_p50", "rel_error"] == pytest.approx(9.0)
    assert t.loc["latency_ms_p50", "share_error"] == pytest.approx(-0.02)


def test_compare_leaves_the_warmup_out_of_the_table_and_the_errors():
    """Five requests a batch each; the first (the warm-up, a fifth) 100 ms slower in the
    simulation. Left out: the means are of 2, 3, 4, 5 ms and 2, 3.3, 4, 5.5 ms (3.5 and
    3.7), throughput counts four requests from the second arrival (10 ms) to the last
    finish (45 and 45.5 ms), and the errors 0, 0.3, 0, 0.5 ms give the quantiles; the
    per-request errors still hold the first."""
    arrival_s = [0.0, 0.01, 0.02, 0.03, 0.04]
    real = one_request_batches([1.0, 2.0, 3.0, 4.0, 5.0], arrival_s)
    sim = one_request_batches([101.0, 2.0, 3.3, 4.0, 5.5], arrival_s)
    c = compare(real, sim, warmup_frac=0.2)
    t = c.table
    assert t.loc["latency_ms_mean", "real"] == pytest.approx(3.5)
    assert t.loc["latency_ms_mean", "rel_error"] == pytest.approx(3.7 / 3.5 - 1)
    assert t.loc["latency_ms_p50", "rel_error"] == pytest.approx(3.65 / 3.5 - 1)
    assert t.loc["throughput_rps", "rel_error"] == pytest.approx(0.035 / 0.0355 - 1)
    # Sorted 0, 0, 0.3, 0.5; the p-th percentile interpolates at position 3p/100.
    assert c.error_quantiles_ms == pytest.approx(
        {1: 0.0, 5: 0.0, 25: 0.0, 50: 0.15, 75: 0.35, 95: 0.47, 99: 0.494})
    assert c.abs_error_ms_median == pytest.approx(0.15)
    np.testing.assert_allclose(c.error_ms, [100.0, 0.0, 0.3, 0.0, 0.5], atol=1e-9)
    # Two of the four kept simulated requests (2 and 3.3 ms) at or under the real p50
    # of the kept ones (3.5 ms), as two of the four real; with the warm-up, two of five
    # against three of five.
    assert t.loc["latency_ms_p50", "share_error"] == pytest.approx(0.0)


def test_compare_skips_requests_either_run_lost_and_refuses_other_lengths():
    arrival_s = [0.0, 0.01, 0.02]
    real = one_request_batches([1.0, 2.0, 3.0], arrival_s)
    sim = one_request_batches([1.5, 2.0, 3.0], arrival_s)
    sim.status[1] = bs.REJECTED
    sim.finish_s[1] = np.nan
    c = compare(real, sim)
    assert np.isnan(c.error_ms[1]) and c.error_ms[0] == pytest.approx(0.5)
    # One of the two requests the simulation completed at or under the real p50 (2 ms),
    # two of the real three.
    assert c.table.loc["latency_ms_p50", "share_error"] == pytest.approx(1 / 2 - 2 / 3)
    with pytest.raises(ValueError, match="as many requests"):
        compare(real, one_request_batches([1.0], [0.0]))
    with pytest.raises(ValueError, match="real must be a RunResult"):
        compare("real", sim)


def test_compare_takes_runs_of_the_same_requests_only():
    """Same requests: due at the same instants (a real run's schedule, a simulated
    sender's), or arriving at the same ones (a simulation of the recorded arrivals)."""
    arrival_s = np.array([0.0, 0.01, 0.02])
    real = one_request_batches([1.0, 2.0, 3.0], arrival_s + 0.001)
    real.meta["scheduled_s"] = arrival_s            # sent 1 ms late
    of_recorded = one_request_batches([1.5, 2.0, 3.0], arrival_s + 0.001)
    assert compare(real, of_recorded).error_ms[0] == pytest.approx(0.5)
    of_schedule = one_request_batches([1.0, 2.5, 3.0], arrival_s + 0.002)
    of_schedule.meta["sent_s"] = arrival_s.copy()
    assert compare(real, of_schedule).error_ms[1] == pytest.approx(0.5)
    other = one_request_batches([1.0, 2.0, 3.0], [0.001, 0.011, 0.022])
    with pytest.raises(ValueError, match=r"sim must serve real's requests .*, got request 0 "
                                         r"due at 0 s in real and 0\.001 s in sim; "
                                         r"request 2 arrived at 0\.021 s in real and "
                                         r"0\.022 s in sim"):
        compare(real, other)


# -- calibrate() on a model of known cost -----------------------------------------------

BASE_MS, PER_ITEM_MS = 2.0, 0.25


known_cost = sleeping_model(BASE_MS, PER_ITEM_MS, name="known_cost")


@pytest.fixture(scope="module", params=["model", "batcher"])
def calibration(request):
    """Calibrated with ``s(b)`` timed on the model alone and through the batcher; the
    service and the runs its costs were fitted on."""
    runs = []
    service = bs.calibrate(known_cost, 8, n_requests=360, duration_s=0.0, repeats=8,
                           timer_probes=60, profile=request.param, seed=0, runs=runs)
    return service, runs


@pytest.fixture
def calibrated(calibration):
    return calibration[0]


def test_calibration_recovers_the_injected_cost(calibrated):
    """``time.sleep`` never returns early, and oversleeps by a scheduler wake-up: well under
    a millisecond on a loaded machine. Timed through the batcher, ``s(b)`` also holds the
    batcher's own work around the model (sub-millisecond here)."""
    sizes = np.array(calibrated.model.batch_sizes)
    injected = BASE_MS + PER_ITEM_MS * sizes
    over = np.asarray(calibrated.model.times_ms) - injected
    assert (over >= 0).all() and (over < 1.0).all(), over
    slope = np.polyfit(sizes, calibrated.model.times_ms, 1)[0]
    assert slope == pytest.approx(PER_ITEM_MS, rel=0.15)
    # The batcher adds its own costs on top, never less than the model, by < 1 ms.
    typical = calibrated.mean_ms(sizes) / calibrated.jitter_mean
    assert (typical >= np.asarray(calibrated.model.times_ms)).all()
    assert (typical - injected < 1.0).all()
    c = calibrated.costs
    assert 0 < c.react_ms < 1.0 and c.release_ms < 1.0
    assert calibrated.metadata["batches"] > 50
    # Its capacity agrees with the saturated run it measured (calibrate warns if not).
    ratio = calibrated.metadata["capacity_ratio"]
    assert 1 / CAPACITY_TOLERANCE <= ratio <= CAPACITY_TOLERANCE, ratio


def test_calibrate_hands_over_the_runs_it_fitted(calibration):
    """Two policies at each of the calibration's loads; the fit skipped each run's first
    two batches (they warm the worker up)."""
    service, runs = calibration
    assert len(runs) == 2 * len(CALIBRATION_LOADS)
    assert [str(r.meta["policy"]) for r in runs] == service.metadata["calibration_policies"]
    assert sum(r.size.size - 2 for r in runs) == service.metadata["batches"]


def test_capacity_check_warns_when_the_model_misses_the_measured_capacity():
    service = CalibratedService(bs.AffineService(1.0, 0.0))      # 4 requests a ms at b=4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert capacity_check(service, 4, 4000.0) == pytest.approx(1.0)
    for measured_rps, ratio in ((2000.0, "2.00x"), (10000.0, "0.40x")):
        with pytest.warns(RuntimeWarning, match=f"serves {ratio} the saturated throughput"):
            capacity_check(service, 4, measured_rps)
    for bad in (0.0, -5.0, math.nan):
        with pytest.raises(ValueError, match="measured_rps must"):
            capacity_check(service, 4, bad)


def test_calibrate_takes_a_batcher_and_refuses_bad_arguments():
    from batchsim.real import DynamicBatcher

    with pytest.raises(ValueError, match="model_or_batcher"):
        bs.calibrate(42)
    with pytest.raises(ValueError, match="n_requests must be at least 200"):
        bs.calibrate(known_cost, 4, n_requests=100)
    with pytest.raises(ValueError, match="max_batch_size"):
        bs.calibrate(known_cost, 0)
    with pytest.raises(ValueError, match="profile must be one of .* got 'gpu'"):
        bs.calibrate(known_cost, 4, profile="gpu")
    with pytest.raises(ValueError, match="profile_s must be"):
        bs.calibrate(known_cost, 4, profile_s=-1.0)

    def never(x):
        raise AssertionError("calibrate measured before checking its arguments")

    never.input_spec = known_cost.input_spec
    for bad, match in [({"timer_probes": 0}, "timer_probes must be an integer >= 1, got 0"),
                       ({"runs": "x"}, "runs must be a list (to get the calibration's runs) "
                                       "or None, got 'x'"),
                       ({"seed": -1}, "seed must be an integer >= 0")]:
        with pytest.raises(ValueError, match=re.escape(match)):
            bs.calibrate(never, 4, **bad)
    batcher = DynamicBatcher(known_cost, bs.BatchPolicy(2, 1.0))
    svc = bs.calibrate(batcher, n_requests=200, duration_s=0.0, batch_sizes=(1, 2), repeats=3,
                       profile_s=0.2, timer_probes=20)
    assert svc.model.batch_sizes == (1, 2) and svc.metadata["model"] == "known_cost"
    # Rounds of two sizes, each run twice at 2.25-2.5 ms: 0.2 s takes about 20 of them,
    # past the 3 repeats asked unless each sleep overshoots by 14 ms.
    assert svc.model.metadata["repeats"] > 3
    assert svc.metadata["profile"] == "model"   # "auto" off CUDA: the batcher runs the model
    assert svc.metadata["pipeline"] is False     # and a thread per worker, the CPU's default
    if hasattr(os, "sched_getaffinity"):     # where it ran: one CPU or more changes its costs
        assert svc.metadata["cpus"] == sorted(os.sched_getaffinity(0))


def test_calibrate_serves_a_given_batcher_as_it_serves_its_model():
    """A batcher with the pipeline of threads on the CPU (not the default there), pinned:
    its profile's batches and every calibration run go through batchers like it, one
    worker each."""
    from batchsim.real import DynamicBatcher

    cpu = max(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    batcher = DynamicBatcher(known_cost, bs.BatchPolicy(2, 1.0), workers=2, pipeline=True,
                             thread_cpus=None if cpu is None else [cpu])
    runs = []
    svc = bs.calibrate(batcher, n_requests=200, duration_s=0.0, batch_sizes=(1, 2), repeats=3,
                       profile_s=0.0, timer_probes=20, profile="batcher", runs=runs)
    assert svc.model.metadata["through"] == "batcher" and len(runs) == 10
    assert svc.metadata["pipeline"] is True
    for run in runs:
        staged_s = run.meta["batch_phases_s"][:, 1]
        assert run.workers == 1 and np.isfinite(staged_s).all()   # a stager staged each
        if cpu is not None:
            assert set(run.meta["thread_cpus"].values()) == {cpu}


# -- the command line ------------------------------------------------------------------


# A calibration this short measures capacity roughly: its check may warn, beside the point
# (on a loaded machine, --recalibrate's once put capacity at 0.25x the measured one).
@pytest.mark.filterwarnings("ignore:the calibrated model serves:RuntimeWarning")
def test_validate_command_writes_the_table_and_the_plot(tmp_path, capsys):
    """Also ``--recalibrate``: every run simulated with a calibration made after the grid;
    ``--probe-speed``: each row's machine speed against the start's."""
    from batchsim.cli import main

    cal = CalibratedService(bs.AffineService(0.1, 0.002), 0.05, 0.002, (0.9, 1.0, 1.3),
                            BatcherCosts(0.02, 0.02, 0.0, 1.0, 0.1))
    cal.save(tmp_path / "cal.json")
    code = main(["validate", "--model", "tiny-mlp", "--calibration", str(tmp_path / "cal.json"),
                 "--grid", "max_batch_size=4", "max_wait_ms=0,1", "load=0.2",
                 "--duration-s", "0.05", "-n", "200", "--out", str(tmp_path / "v.csv"),
                 "--plot", str(tmp_path / "v.png"), "--recalibrate", "--probe-speed"])
    assert code == 0
    out = capsys.readouterr().out
    assert "median |relative error|: p50" in out and "worst configuration" in out
    assert "the two calibrations' predictions apart by p50" in out
    assert "as fast as at the start" in out
    assert "told each row's speed" in out
    import pandas as pd

    table = pd.read_csv(tmp_path / "v.csv")
    assert len(table) == 2 and set(table["max_wait_ms"]) == {0.0, 1.0}
    assert (table["speed_ratio"] > 0).all() and (table["worker_time_ratio"] > 0).all()
    # the share error at p50 shown, and written for every row
    assert "share_err_latency_ms_p50" in out
    assert table["share_err_latency_ms_p50"].notna().all()
    # the file's made-up calibration and a real one predict apart
    assert (table["recal_err_latency_ms_p50"] != table["err_latency_ms_p50"]).all()
    assert (tmp_path / "v.png").stat().st_size > 0


@pytest.mark.filterwarnings("ignore:the calibrated model serves:RuntimeWarning")
@pytest.mark.parametrize("flag, pipeline", [([], False), (["--pipeline"], True),
                                            (["--no-pipeline"], False)])
def test_validate_serves_the_calibration_and_every_run_with_the_runner_asked(
        flag, pipeline, monkeypatch, tmp_path):
    """``--pipeline``: through the stage/launch/complete pipeline of threads, whose stager
    stages each batch; the CPU's default and ``--no-pipeline``: a thread per worker."""
    import batchsim.fidelity as fid
    from batchsim.cli import main

    runs = {"calibrate": [], "grid": []}
    calibrate, fidelity = bs.calibrate.calibrate, fid.fidelity
    monkeypatch.setattr(bs.calibrate, "calibrate", lambda *a, **k: calibrate(
        *a, **{**k, "runs": runs["calibrate"], "n_requests": 200, "duration_s": 0.0,
               "repeats": 3, "profile_s": 0.0, "timer_probes": 20}))
    monkeypatch.setattr(fid, "fidelity", lambda *a, **k: fidelity(*a, **{**k, "runs": runs[
        "grid"]}))
    assert main(["validate", "--model", "tiny-mlp", "--grid", "max_batch_size=4",
                 "max_wait_ms=1", "load=0.2", "--duration-s", "0.02", "-n", "200",
                 *flag]) == 0
    served = [*runs["calibrate"], *(run["real"] for run in runs["grid"])]
    assert len(served) == 11
    for res in served:
        assert np.isfinite(res.meta["batch_phases_s"][:, 1]).all() == pipeline


def _no_wake_latency_held() -> bool:
    """Whether this process may keep CPUs awake and read the request back, none of no
    latency held by another process (a fidelity bench beside the tests)."""
    from batchsim.cpus import CPU_WAKE_LATENCY, can_keep_awake

    if not (can_keep_awake() and os.access(CPU_WAKE_LATENCY, os.R_OK)):
        return False
    with open(CPU_WAKE_LATENCY, "rb") as f:
        return struct.unpack("i", f.read(4))[0] > 0


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or not _no_wake_latency_held(),
                    reason="CPU affinity and PM QoS requests are Linux's (the latter root's), "
                           "with none of no latency held by another process")
@pytest.mark.parametrize("awake", [[], ["--no-keep-awake"]])
@pytest.mark.parametrize("which", ["last", "all", "pinned"])
def test_validate_on_given_cpus_runs_the_batcher_there(tmp_path, awake, which):
    """``--cpu``: the process is pinned before the batcher starts, so its worker runs on
    those CPUs too (by default with the CPUs kept awake, a PM QoS request of no wake-up
    latency; with ``--no-keep-awake``, left to idle), given as one CPU or as a list; with
    ``--pin-threads``, the worker on the second CPU alone. In a subprocess: pinning this
    one would pin the rest of the tests."""
    cal = CalibratedService(bs.AffineService(0.1, 0.002), 0.05, 0.002, (0.9, 1.0, 1.3),
                            BatcherCosts(0.02, 0.02, 0.0, 1.0, 0.1))
    cal.save(tmp_path / "cal.json")
    cpus = sorted(os.sched_getaffinity(0))
    if which == "last":
        cpus = cpus[-1:]
    if which == "pinned" and len(cpus) < 2:
        pytest.skip("--pin-threads needs two CPUs")
    pinned = ["--pin-threads"] if which == "pinned" else []
    script = textwrap.dedent("""
        import os, struct, sys
        import batchsim.cli
        from batchsim.cpus import CPU_WAKE_LATENCY
        from batchsim.real import models

        seen, awake, make = set(), set(), models.make_model

        def kept_awake():  # whether the CPUs may take no time to wake (PM QoS)
            with open(CPU_WAKE_LATENCY, "rb") as f:
                return struct.unpack("i", f.read(4))[0] == 0

        def spied(*args, **kwargs):  # the zoo model, noting where each batch runs
            model = make(*args, **kwargs)
            forward = model.forward
            def forward_noting_cpus(x):
                seen.update(os.sched_getaffinity(0))
                awake.add(kept_awake())
                return forward(x)
            model.forward = forward_noting_cpus
            return model

        models.make_model = spied
        code = batchsim.cli.main(sys.argv[1:])
        print("worker CPUs", sorted(seen), "kept awake", sorted(awake))
        sys.exit(code)
        """)
    run = subprocess.run([sys.executable, "-c", script, "validate", "--model", "tiny-mlp",
                          "--calibration", str(tmp_path / "cal.json"), "--grid",
                          "max_batch_size=4", "max_wait_ms=0", "load=0.2", "--duration-s",
                          "0.05", "-n", "200", "--cpu", ",".join(map(str, cpus)), *awake,
                          *pinned], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    worker_cpus = cpus[1:2] if pinned else cpus
    assert f"worker CPUs {worker_cpus} kept awake [{not awake}]" in run.stdout


@pytest.mark.parametrize("argv, match", [
    (["--cpu", "4096"], "--cpu must be one of this process's CPUs"),
    (["--cpu", "0-"], "--cpu must be CPU numbers like 0, 2-5 or 2,3,8-9, got '0-'"),
    (["--keep-awake"], "--keep-awake needs --cpu, the CPU to keep awake, got none"),
    (["--pin-threads"], "--pin-threads needs two or more CPUs in --cpu (the event loop on "
                        "the first, a batcher's threads on the others), got None"),
    (["--grid", "max_batch=4"], "--grid entries must look like NAME=V1,V2"),
    (["--grid", "load=a,b"], "--grid load must be floats"),
    (["--model", "tiny-gpt"], "--model must be one of"),
    (["--threads", "0"], "argument --threads: must be an integer >= 1, got '0'"),
    (["--grid", "load=-0.5"], "load must be a positive finite number, got -0.5"),
    (["--grid", "max_batch_size=0"], "max_batch_size must be an integer >= 1, got 0"),
    (["--duration-s", "inf"], "duration_s must be a positive finite number, got inf"),
    (["-n", "0"], "n_requests must be an integer >= 1, got 0"),
    (["--seed", "-1"], "argument --seed: must be an integer >= 0, got '-1'"),
    (["--cpu", "0-100000000"], "--cpu must be CPU numbers like 0, 2-5 or 2,3,8-9"),
    (["--save-calibration", "/"], "argument --save-calibration: '/' is a folder, not a file"),
    (["--out", "/no/such/folder/errors.csv"],
     "argument --out: folder '/no/such/folder' of '/no/such/folder/errors.csv' does not exist"),
])
def test_validate_command_reports_bad_arguments_in_one_line(argv, match, capsys):
    from batchsim.cli import main

    try:
        code = main(["validate", *argv])
    except SystemExit as e:  # argparse's own checks exit
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1


def test_validate_refuses_a_calibration_made_on_another_model(tmp_path, capsys):
    from batchsim.cli import main

    cal = CalibratedService(bs.AffineService(0.1, 0.002), 0.05, 0.002, (0.9, 1.0, 1.3),
                            BatcherCosts(0.02, 0.02, 0.0, 1.0, 0.1),
                            {"model": "tiny-mlp", "dtype": "float32"})
    cal.save(tmp_path / "cal.json")
    assert main(["validate", "--model", "tiny-cnn", "--calibration",
                 str(tmp_path / "cal.json")]) == 2
    assert (f"--calibration {str(tmp_path / 'cal.json')!r} was made on tiny-mlp at float32, "
            f"not the --model 'tiny-cnn' at --dtype 'float32'") in capsys.readouterr().err


def test_simulate_refuses_jitter_for_a_calibrated_service(tmp_path, capsys):
    from batchsim.cli import main

    cal = CalibratedService(bs.AffineService(0.1, 0.002), 0.05, 0.002, (0.9, 1.0, 1.3),
                            BatcherCosts(0.02, 0.02, 0.0, 1.0, 0.1))
    cal.save(tmp_path / "cal.json")
    assert main(["simulate", "--rate", "100", "--profile", str(tmp_path / "cal.json"),
                 "--jitter-cv", "0.1"]) == 2
    assert ("--jitter-cv applies to affine and profile services, not the CalibratedService"
            in capsys.readouterr().err)


def _self_simulated_runs(known):
    """Runs of the calibration's kind, simulated with ``known`` itself."""
    rate = known.capacity_rps(8)
    return [bs.simulate(bs.Poisson(load * rate), bs.BatchPolicy(8, wait_ms), known,
                        n_requests=800, seed=k, sender="loop")
            for k, (load, wait_ms) in enumerate([(0.05, 0.0), (0.3, 0.0), (0.3, 4.0),
                                                 (0.7, 0.0)])]


def test_refit_drops_a_capacity_check_it_cannot_make_again():
    """Simulated runs carry no saturated throughput: the old costs' check goes."""
    known = CalibratedService(bs.AffineService(0.1, 0.01), 0.1, 0.01, (),
                              BatcherCosts(0.02, 0.02, 0.0, 1.0, 0.1),
                              {"model": "known", "capacity_ratio": 0.2})
    refitted = refit(known, _self_simulated_runs(known))
    assert "capacity_ratio" not in refitted.metadata
    assert refitted.metadata["model"] == "known"


def test_a_batch_that_never_ended_is_left_out_of_the_fit_and_the_speed():
    """A batcher closed without draining leaves its last batch without an end: the
    fit and ``worker_time_ratio`` read the batches that ended (here, spread-free runs
    simulated with the calibration itself: the ratio is 1)."""
    known = CalibratedService(bs.AffineService(0.1, 0.01), 0.1, 0.01, (),
                              BatcherCosts(0.02, 0.02, 0.0, 1.0, 0.1))
    runs = _self_simulated_runs(known)
    cut = runs[-1]
    cut.end_s[-1] = np.nan
    assert worker_time_ratio(known, cut) == pytest.approx(1.0, abs=1e-9)
    refitted = refit(known, runs)
    assert refitted.per_batch_ms == pytest.approx(known.per_batch_ms, rel=1e-3)
    assert refitted.per_item_ms == pytest.approx(known.per_item_ms, rel=1e-3)
