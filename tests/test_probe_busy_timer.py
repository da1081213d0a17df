"""``bench/probe_busy_timer.py``: how it reads a run whose loop sent during each batch."""

from types import SimpleNamespace

import numpy as np
import pytest
from probe_busy_timer import timer_report


def test_the_report_counts_the_batches_the_timer_got_into_and_the_gaps_after_them():
    """Five batches of 1.5 ms, 2 ms apart (a release of 0.5 ms); the timer's first send
    1.2 ms after the first three dispatches (inside) and 1.7 ms after the last two
    (after the end). The last batch is not read: nothing follows it."""
    ms = 1e-3
    start_s = np.arange(6) * 2 * ms
    sent_s = start_s[:5] + np.array([1.2, 1.2, 1.2, 1.7, 1.7]) * ms
    res = SimpleNamespace(start_s=start_s, end_s=start_s + 1.5 * ms,
                          arrival_s=np.sort(np.r_[sent_s, sent_s + 0.01 * ms]))
    report = timer_report(res, warm=0)
    assert report["batches"] == 5
    assert report["inside_share"] == pytest.approx(3 / 5)
    assert report["sent_us_p50"] == pytest.approx(1200.0)
    assert report["batch_us_p50"] == pytest.approx(1500.0)
    assert report["release_us_p50"] == pytest.approx(500.0)
