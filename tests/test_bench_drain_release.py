"""``bench/bench_drain_release.py``: which batches it times."""


import numpy as np
import pytest
from bench_drain_release import drain_batch_ms

from batchsim.policy import FLUSH, SIZE
from batchsim.result import RunRecorder


def test_times_only_the_full_batches_that_start_after_the_last_arrival():
    """Seven requests, the last at 0.3 s. A full batch before it (1 s long) and the
    partial last batch (5 s) are left out; the two full batches of the drain took 0.2
    and 0.4 s: their median is 300 ms."""
    rec = RunRecorder(np.array([0.0, 0.1, 0.2, 0.25, 0.28, 0.3, 0.3]), workers=1)
    rec.dispatch([0, 1], 0.2, 1.2, worker=0, trigger=SIZE)
    rec.dispatch([2, 3], 1.2, 1.4, worker=0, trigger=SIZE)
    rec.dispatch([4, 5], 1.4, 1.8, worker=0, trigger=SIZE)
    rec.dispatch([6], 1.8, 6.8, worker=0, trigger=FLUSH)
    assert drain_batch_ms(rec.result()) == pytest.approx(300.0)


def test_a_run_without_a_drain_is_refused():
    rec = RunRecorder(np.array([0.0, 0.1, 0.2]), workers=1)
    rec.dispatch([0, 1], 0.1, 0.15, worker=0, trigger=SIZE)
    rec.dispatch([2], 0.2, 0.3, worker=0, trigger=FLUSH)
    with pytest.raises(ValueError, match="no full batch after its last arrival"):
        drain_batch_ms(rec.result())
