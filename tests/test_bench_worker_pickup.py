"""``bench/bench_worker_pickup.py``: when the worker takes its batch up while the load
generator is behind."""

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from bench_worker_pickup import TAKEN_US, analyze, pickup_report, yields_taken  # noqa: E402

US = 1e-6


def behind_run():
    """264 requests all due at 0, sent 1 us apart in turns of 64, 64, 64, 64 and 8 that
    start at 0, 73, 436, 600 and 800 us (after 1 s). Batch 0 is dispatched 10 us before
    the first turn and picked up 5 us after its last send (the first yield: taken);
    batch 1 is dispatched at 420 us and picked up at 700 us, 201 and 37 us after the
    yields of the third and fourth turns. The second turn's yield comes after batch 0's
    pick-up: no batch waits then."""
    starts_us = [0, 73, 436, 600, 800]
    sizes = [64, 64, 64, 64, 8]
    sent = 1.0 + US * np.concatenate([s + np.arange(n) for s, n in zip(starts_us, sizes,
                                                                        strict=True)])
    start_s = 1.0 + US * np.array([-10.0, 420.0])
    picked_s = 1.0 + US * np.array([68.0, 700.0])
    return SimpleNamespace(arrival_s=sent, start_s=start_s,
                           end_s=1.0 + US * np.array([400.0, 1000.0]),
                           meta={"scheduled_s": np.zeros(sent.size),
                                 "turn_sizes": np.array(sizes),
                                 "batch_phases_s": np.c_[picked_s, np.full(2, np.nan),
                                                         picked_s + 300 * US]})


def test_yields_while_a_batch_waits_are_taken_when_the_pickup_follows_at_once():
    assert 5.0 <= TAKEN_US < 37.0
    taken, first = yields_taken(behind_run())
    assert taken.tolist() == [True, False, False]
    assert first.tolist() == [True, True, False]


def test_the_report_counts_the_yields_and_the_pickup_delay():
    report = pickup_report([behind_run()])
    assert report["pickup_us"] == pytest.approx((78 + 280) / 2)
    assert report["yields_waiting"] == 3
    assert report["taken_at_yield_share"] == pytest.approx(1 / 3)
    assert report["first_taken_share"] == pytest.approx(1 / 2)


def test_a_run_that_never_fell_behind_has_no_yields_to_share():
    """One request a turn, each due 1 ms after the last: no turn of 64, NaN shares."""
    due = 1e-3 * np.arange(1, 11)
    res = SimpleNamespace(arrival_s=due + 5 * US, start_s=due + 20 * US, end_s=due + 300 * US,
                          meta={"scheduled_s": due, "turn_sizes": np.ones(10, int),
                                "batch_phases_s": np.c_[due + 60 * US, np.full(10, np.nan),
                                                        due + 300 * US]})
    report = pickup_report([res])
    assert report["pickup_us"] == pytest.approx(40.0)
    assert report["yields_waiting"] == 0
    assert np.isnan(report["taken_at_yield_share"]) and np.isnan(report["first_taken_share"])


def test_every_part_of_a_saved_grid_is_read():
    res = behind_run()
    report = analyze({"calibration_runs": [res], "runs": {"bursty": [{"real": res}]}})
    assert set(report) == {"calibration_runs", "bursty"}
    assert report["bursty"] == report["calibration_runs"]
