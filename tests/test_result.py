"""RunResult summaries and queue-length series on hand-built runs."""

import numpy as np
import pytest

import batchsim as bs
from batchsim.policy import SIZE, TIMEOUT
from batchsim.result import COMPLETED, EXPIRED, REJECTED, RunRecorder


def hand_run():
    """Four requests: two served together, one rejected, one expired."""
    rec = RunRecorder(np.array([0.0, 0.1, 0.2, 0.3]), workers=2)
    rec.dispatch([0, 1], 0.2, 0.5, worker=0, trigger=SIZE)
    rec.reject(2)
    rec.expire([3], 0.6)
    return rec.result()


def test_arrays_and_statuses():
    r = hand_run()
    np.testing.assert_allclose(r.latency_s[:2], [0.5, 0.4])
    np.testing.assert_allclose(r.wait_s[:2], [0.2, 0.1])
    assert np.isnan(r.latency_s[2:]).all() and np.isnan(r.dispatch_s[2:]).all()
    assert list(r.status) == [COMPLETED, COMPLETED, REJECTED, EXPIRED]
    assert list(r.batch_id) == [0, 0, -1, -1] and list(r.batch_sizes) == [2]


def test_summary_counts_rates_and_goodput():
    s = hand_run().summary(slo_ms=450.0)
    assert hand_run().summary(slo_ms=500.0)["goodput"] == pytest.approx(2 / 4)
    assert s["n_completed"] == 2 and s["n_rejected"] == 1 and s["n_expired"] == 1
    assert s["throughput_rps"] == pytest.approx(2 / 0.5)
    assert s["latency_ms_mean"] == pytest.approx(450.0)
    assert s["latency_ms_max"] == pytest.approx(500.0)
    assert s["mean_batch_size"] == 2.0
    assert s["utilization_per_worker"] == pytest.approx([0.3 / 0.5, 0.0])
    assert s["utilization"] == pytest.approx(0.3)
    assert s["goodput"] == pytest.approx(1 / 4)  # of 500 and 400 ms, one is within 450 ms
    assert s["goodput_rps"] == pytest.approx(1 / 0.5)


def test_warmup_drops_the_first_requests():
    rec = RunRecorder(np.array([0.0, 1.0, 2.0, 3.0]), workers=1)
    for i, t in enumerate([0.0, 1.0, 2.0, 3.0]):
        rec.dispatch([i], t, t + 0.1 * (i + 1), worker=0, trigger=TIMEOUT)
    s = rec.result().summary(warmup_frac=0.5)
    assert s["n_requests"] == 2
    assert s["latency_ms_mean"] == pytest.approx(350.0)
    with pytest.raises(ValueError, match="warmup_frac"):
        rec.result().summary(warmup_frac=1.0)
    with pytest.raises(ValueError, match="slo_ms"):
        rec.result().summary(slo_ms=-1)


def test_queue_length_steps():
    times, n = hand_run().queue_length()
    # 0: +1, 0.1: +1, 0.2: two leave (the rejected one never waits), 0.3: +1, 0.6: -1.
    np.testing.assert_allclose(times, [0.0, 0.1, 0.2, 0.3, 0.6])
    assert list(n) == [1, 2, 0, 1, 0]


def test_to_pandas():
    requests, batches = hand_run().to_pandas()
    assert list(requests["status"]) == ["completed", "completed", "rejected", "expired"]
    assert list(batches["trigger"]) == ["size"] and batches["size"].tolist() == [2]


def test_a_run_without_requests_summarises_to_nothing():
    s = RunRecorder(np.array([]), workers=2).result().summary(slo_ms=10.0)
    assert s["n_requests"] == s["n_completed"] == 0
    assert np.isnan(s["throughput_rps"]) and np.isnan(s["latency_ms_p50"])
    assert np.isnan(s["mean_batch_size"]) and np.isnan(s["goodput"])
    assert s["utilization_per_worker"] == [0.0, 0.0]
    times, n = RunRecorder(np.array([]), workers=1).result().queue_length()
    assert times.size == n.size == 0


def test_percentiles_interpolate_linearly_between_latencies():
    """p50..p99 are numpy's default (linear) percentiles of the completed latencies."""
    rec = RunRecorder(np.arange(5.0), workers=1)
    for i in range(5):   # request i waits nothing and is served in 100 * (i + 1) ms
        rec.dispatch([i], float(i), i + 0.1 * (i + 1), worker=0, trigger=SIZE)
    s = rec.result().summary()
    # Latencies 100..500 ms: the q-th percentile sits at rank q/100 * 4, e.g. p90 at 3.6,
    # 60% of the way from 400 to 500 ms.
    assert [s[f"latency_ms_p{q}"] for q in (50, 90, 95, 99)] == pytest.approx(
        [300.0, 460.0, 480.0, 496.0])
    assert s["latency_ms_mean"] == pytest.approx(300.0)
    assert s["latency_ms_max"] == pytest.approx(500.0)


def warm_up_run():
    """Ten requests at 0..9 s served in three batches on one worker; the first batch
    starts before request 2 arrives and ends after it."""
    rec = RunRecorder(np.arange(10.0), workers=1)
    rec.dispatch([0, 1], 1.0, 3.0, worker=0, trigger=SIZE)
    rec.dispatch([2, 3, 4], 4.0, 6.0, worker=0, trigger=SIZE)
    rec.dispatch([5, 6, 7, 8, 9], 9.0, 12.0, worker=0, trigger=SIZE)
    return rec.result()


def test_warmup_window_starts_at_the_first_kept_arrival():
    """warmup_frac=0.25 of 10 requests drops floor(2.5) = 2: the window runs from request
    2's arrival (2 s) to the last finish (12 s). Batches count toward the mean size if
    they start in the window; busy time is clipped to the window."""
    s = warm_up_run().summary(warmup_frac=0.25)
    assert s["n_requests"] == 8 and s["n_completed"] == 8
    assert s["throughput_rps"] == pytest.approx(8 / 10.0)
    assert s["mean_batch_size"] == pytest.approx((3 + 5) / 2)
    # Busy within [2, 12]: 1 s of the first batch (2..3), then 2 s and 3 s.
    assert s["utilization"] == pytest.approx((1.0 + 2.0 + 3.0) / 10.0)
    assert s["utilization_per_worker"] == pytest.approx([0.6])
    # Requests 2..4 finish at 6 s, 5..9 at 12 s.
    assert s["latency_ms_mean"] == pytest.approx(1000.0 * (4 + 3 + 2 + 7 + 6 + 5 + 4 + 3) / 8)


def test_a_request_rejected_after_the_last_finish_ends_the_window():
    """The window ends at the later of the last finish and the last arrival: a request
    rejected at 1 s, after the only batch finished at 0.5 s, stretches it to 1 s."""
    rec = RunRecorder(np.array([0.0, 0.1, 1.0]), workers=1)
    rec.dispatch([0, 1], 0.2, 0.5, worker=0, trigger=SIZE)
    rec.reject(2)
    s = rec.result().summary()
    assert s["throughput_rps"] == pytest.approx(2 / 1.0)
    assert s["utilization"] == pytest.approx(0.3 / 1.0)
    assert s["n_rejected"] == 1


def test_every_status_code_is_exported_under_its_name():
    """``bs.FAILED`` (a real run's failed requests) was missing beside the other three."""
    from batchsim.result import STATUS_NAMES

    codes = [bs.COMPLETED, bs.REJECTED, bs.EXPIRED, bs.FAILED]
    assert [STATUS_NAMES[c] for c in codes] == ["completed", "rejected", "expired", "failed"]
