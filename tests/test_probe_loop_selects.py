"""``bench/probe_loop_selects.py``: its logging selector and how it counts the loop's wake-ups."""

import asyncio
import math
from types import SimpleNamespace

import numpy as np
import pytest
from probe_loop_selects import LoggingPolicy, wakes


def test_counts_timer_wake_ups_inside_batches_and_while_idle():
    run = SimpleNamespace(start_s=np.array([0.0, 0.010]), end_s=np.array([0.0005, 0.0105]),
                          size=np.array([2, 1]),
                          arrival_s=np.array([-0.001, 0.0002, 0.0003, 0.009]))
    log = np.array([
        (0.0001, 0.0004, 0.0002, 0),      # slept, no event: a timer, inside batch 0
        (0.0006, 0.0020, 0.0005, 0),      # a timer while idle: 0.4 ms past the whole ms
        (0.0021, 0.002105, 0.0, 0),       # did not sleep
        (0.003, 0.0095, 0.002, 1),        # woken by an event (its timer not yet due)
        (0.0095, 0.0102, 0.002, 0),       # a timer, inside batch 1
        (0.0110, 0.0112, math.inf, 0),    # no timer armed: not a timer's wake-up
    ])
    w = wakes(run, log)
    assert w["batches"] == 2
    assert (w["timer_wakes_in_batch"], w["timer_wakes_idle"]) == (2, 1)
    assert w["idle_wake_late_us_p50"] == pytest.approx(400.0)
    assert (w["batches_receiving"], w["received_per_receiving_batch"]) == (1, 2.0)


def test_logging_policy_records_each_select_with_its_timeout():
    log = []

    async def nap():
        await asyncio.sleep(0.0003)

    with asyncio.Runner(loop_factory=LoggingPolicy(log).new_event_loop) as runner:
        runner.run(nap())
    timeouts = [row[2] for row in log]
    assert any(0 < t <= 0.0003 for t in timeouts), timeouts
    assert all(returned >= entered for entered, returned, _, _ in log)
