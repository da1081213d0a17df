"""``bench/bench_gc_pause.py``: how it times collections and sums up the two modes."""

import gc

import pytest
from bench_gc_pause import CollectionTimer, summarize


def test_times_each_collection_while_installed_and_no_other():
    with CollectionTimer() as timer:
        gc.collect()
        gc.collect(0)
    gc.collect()  # after it is removed
    assert len(timer.pauses_ms) == 2 and min(timer.pauses_ms) >= 0.0
    assert timer not in gc.callbacks


def test_summary_gives_median_errors_and_stalled_rows_per_mode():
    def row(p50, p99, late_paused, late_python):
        return {"sim_lateness_ms_p99": 1.0,
                "paused": {"err_p50": p50, "err_p99": p99, "lateness_ms_p99": late_paused,
                           "lateness_ms_max": 2 * late_paused},
                "python": {"err_p50": -2 * p50, "err_p99": 10 * p99,
                           "lateness_ms_p99": late_python, "lateness_ms_max": late_python + 1}}

    rows = [row(0.01, 0.02, 1.1, 1.2), row(-0.03, -0.04, 1.5, 80.0), row(0.05, 0.06, 3.5, 2.9)]
    s = summarize(rows, behind_ms=2.0)
    assert s["paused"]["median_abs_err_p50"] == pytest.approx(0.03)
    assert s["paused"]["median_abs_err_p99"] == pytest.approx(0.04)
    assert s["python"]["median_abs_err_p50"] == pytest.approx(0.06)
    assert s["python"]["median_abs_err_p99"] == pytest.approx(0.4)
    # Behind: the real generator's p99 lateness past the simulated one's by over 2 ms.
    assert (s["paused"]["behind"], s["python"]["behind"]) == (1, 1)
    assert (s["paused"]["lateness_ms_max"], s["python"]["lateness_ms_max"]) == (7.0, 81.0)
    assert s["paused"]["rows"] == 3
