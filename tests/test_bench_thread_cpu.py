"""``bench/bench_thread_cpu.py``: the loop's and the worker's CPU time, batch by batch."""

from types import SimpleNamespace

import numpy as np
import pytest
from bench_thread_cpu import (
    analyze,
    cpu_report,
    cycles,
    held_after_lead,
    lead_before_s,
    thread_cpu_s,
)

import batchsim as bs

US = 1e-6


def shared_run():
    """Batches of 4, 4, 4 and 2 (max 4) dispatched at 0, 1,050, 2,100 and 3,150 us, each
    picked up 10 us later and ended at 1,000, 2,050, 3,100 and 5,000 us: back to back.
    The worker spends 700 us of CPU from one batch's return to the next; the loop 150,
    140 and 110 us from a dispatch to the next, while the batcher receives 4, 4 and 2
    requests. From the second batch on, the worker waits to run 0, 120 and 150 us from
    one return to the next, the loop 600, 5 and 10 us from dispatch to return: the
    second batch, of 1,000 us, is held."""
    start_s = US * np.array([0.0, 1050.0, 2100.0, 3150.0])
    arrival_s = US * np.r_[[-40.0, -30.0, -20.0, -10.0], [100.0, 200.0, 300.0, 400.0],
                           [1100.0, 1200.0, 1300.0, 1400.0], [2200.0, 2300.0]]
    loop_sent = 10.0 + US * np.array([0.0, 150.0, 290.0, 400.0])
    worker_s = 0.5 + US * np.array([0.0, 700.0, 1400.0, 2100.0])
    return SimpleNamespace(
        arrival_s=arrival_s, start_s=start_s,
        end_s=US * np.array([1000.0, 2050.0, 3100.0, 5000.0]), size=np.array([4, 4, 4, 2]),
        meta={"policy": bs.BatchPolicy(4, 1.0),
              "batch_phases_s": np.c_[start_s + 10 * US, np.full(4, np.nan),
                                      np.full(4, np.nan)],
              "batch_thread_cpu_s": np.c_[loop_sent, loop_sent + 100 * US, worker_s],
              "batch_thread_wait_s": 2.0 + US * np.c_[[0.0, 10.0, 620.0, 630.0],
                                                      [5.0, 610.0, 625.0, 640.0],
                                                      [0.0, 0.0, 120.0, 270.0]]})


def test_a_cycle_counts_when_both_batches_are_full_and_back_to_back():
    """The first batch has no worker time (nothing returned before it); the last no
    cycle (no dispatch after it)."""
    kept, loop_s, worker_s, received = cycles(shared_run(), 4)
    assert kept.tolist() == [True, False]  # the fourth batch holds 2
    np.testing.assert_allclose(loop_s / US, [140.0, 110.0])
    np.testing.assert_allclose(worker_s / US, [700.0, 700.0])
    assert received.tolist() == [4, 2]


def test_the_report_gives_each_threads_share_and_the_loops_cost_per_request():
    report = cpu_report([shared_run()])
    assert report["batches"] == 3 and report["cycles"] == 1
    assert report["worker_share"] == pytest.approx(700.0 / 990.0)
    assert report["worker_cpu_us"] == pytest.approx(700.0)
    assert report["worker_wall_us"] == pytest.approx(990.0)
    assert report["loop_cycle_us"] == pytest.approx(140.0)
    assert report["worker_cycle_us"] == pytest.approx(700.0)
    assert report["loop_lead_us"] == pytest.approx(-560.0)
    # 140 = a + 4 c and 110 = a + 2 c
    assert report["loop_per_request_us"] == pytest.approx(15.0)
    assert report["loop_per_cycle_us"] == pytest.approx(80.0)
    assert report["held_share"] == pytest.approx(1 / 3)
    assert report["worker_wait_us"] == pytest.approx(120.0)
    assert report["worker_wait_held_us"] == pytest.approx(0.0, abs=1e-6)
    assert report["loop_wait_held_us"] == pytest.approx(600.0)


def test_the_loops_lead_grows_by_the_workers_wait_less_its_cpu_and_never_below_0():
    """The worker waits 900 us, then 0 and 0, while it runs 700 us a batch: the lead is
    0, then 200 us, then 0 again (not -500). The third batch is held (the loop waited
    600 of its 1,000 us) after a second that was not, with a lead of 200 us."""
    run = shared_run()
    run.meta["batch_thread_wait_s"] = 2.0 + US * np.c_[[0.0, 10.0, 620.0, 630.0],
                                                       [5.0, 15.0, 1220.0, 640.0],
                                                       [0.0, 900.0, 900.0, 900.0]]
    np.testing.assert_allclose(lead_before_s(US * np.array([900.0, 0.0, 0.0]),
                                             US * np.full(3, 700.0)) / US,
                               [0.0, 200.0, 0.0], atol=1e-6)
    lead_s, held = held_after_lead(run)
    np.testing.assert_allclose(lead_s / US, [200.0], atol=1e-6)
    assert held.tolist() == [True]
    report = cpu_report([run])
    assert report["held_after_lead>100us"] == 1.0 and report["n_after_lead>100us"] == 1
    assert report["n_after_lead=0"] == 0 and np.isnan(report["held_after_lead=0"])


def test_runs_saved_before_the_waits_were_recorded_give_nan_waits_only():
    run = shared_run()
    del run.meta["batch_thread_wait_s"]
    report, before = cpu_report([run]), cpu_report([shared_run()])
    waits = ["held_share", "worker_wait_us", "worker_wait_held_us", "loop_wait_held_us",
             *(f"held_after_{b}" for b in ("lead=0", "lead<=100us", "lead>100us"))]
    counts = [f"n_after_{b}" for b in ("lead=0", "lead<=100us", "lead>100us")]
    assert all(np.isnan(report[key]) for key in waits)
    assert all(report[key] == 0 for key in counts)
    waits += counts
    assert {k: v for k, v in report.items() if k not in waits} == {
        k: v for k, v in before.items() if k not in waits}


def test_each_part_of_a_saved_grid_is_reported_and_old_runs_are_refused():
    run = shared_run()
    report = analyze({"calibration_runs": [run], "runs": {"bursty": [{"real": run}]}})
    assert list(report) == ["calibration_runs", "bursty"]
    np.testing.assert_equal(report["bursty"], report["calibration_runs"])  # NaN as NaN
    run.meta["batch_thread_cpu_s"] = np.zeros((4, 4))  # the reverted trial's four clocks
    with pytest.raises(ValueError, match="batch_thread_cpu_s"):
        thread_cpu_s(run)
    del run.meta["batch_thread_cpu_s"]
    with pytest.raises(ValueError, match="batch_thread_cpu_s"):
        thread_cpu_s(run)
