"""``bench/probe_thread_vruntime.py``: the scheduler's virtual runtimes of the loop's
thread and the worker's at the load generator's yields."""

from types import SimpleNamespace

import numpy as np
import pytest
from probe_thread_vruntime import (
    busiest_thread,
    case_report,
    cpu_ms,
    parse_cases,
    vruntime_ms,
)

import batchsim as bs

US = 1e-6
LOOP, WORKER, OTHER = 11, 12, 13


def behind_run():
    """264 requests all due at 0, sent 1 us apart in turns of 64, 64, 64, 64 and 8 from
    0, 73, 436, 600 and 800 us (after 1 s). Batch 0, dispatched at -10 us, is picked up at
    68 us, 5 us after the first turn's yield (taken); batch 1, dispatched at 420 us, at
    700 us, long after the third turn's yield at 499 us (not taken) and the fourth's."""
    starts_us, sizes = [0, 73, 436, 600, 800], [64, 64, 64, 64, 8]
    sent = 1.0 + US * np.concatenate([s + np.arange(n) for s, n in zip(starts_us, sizes,
                                                                        strict=True)])
    start_s, end_s = 1.0 + US * np.array([-10.0, 420.0]), 1.0 + US * np.array([400.0, 1000.0])
    picked_s = 1.0 + US * np.array([68.0, 700.0])
    return SimpleNamespace(arrival_s=sent, start_s=start_s, end_s=end_s, size=np.array([64, 64]),
                           meta={"policy": bs.BatchPolicy(64, 0.0),
                                 "scheduled_s": np.zeros(sent.size),
                                 "turn_sizes": np.array(sizes),
                                 "batch_phases_s": np.c_[picked_s, np.full(2, np.nan), end_s]})


def samples(t0_s: float):
    """The loop's virtual runtime stays at 10 ms; the worker's climbs from 9.9 to 10.1 ms
    between 1 s and 1.0004 s of the run (perf_counter t0_s + run time); the worker runs
    300 us over that span, the loop 100 us and a third thread 5 us."""
    at = t0_s + 1.0 + US * np.array([0.0, 400.0])
    return np.array([[at[0], LOOP, 10.0, 50.0], [at[1], LOOP, 10.0, 50.1],
                     [at[0], WORKER, 9.9, 20.0], [at[1], WORKER, 10.1, 20.3],
                     [at[0], OTHER, 5.0, 1.0], [at[1], OTHER, 5.0, 1.005]])


def test_a_thread_is_read_between_its_samples():
    s = samples(100.0)
    np.testing.assert_allclose(vruntime_ms(s, WORKER, 101.0 + US * np.array([0, 100, 400])),
                               [9.9, 9.95, 10.1])
    span = (101.0, 101.0 + 400 * US)
    assert cpu_ms(s, WORKER, span) == pytest.approx(0.3)
    assert cpu_ms(s, LOOP, span) == pytest.approx(0.1)
    assert cpu_ms(s, 99, span) == 0.0                       # never sampled
    assert busiest_thread(s, span, but=LOOP) == WORKER
    assert busiest_thread(s, span, but=WORKER) == LOOP


def test_the_yields_split_by_whether_the_loop_was_ahead():
    """At the first yield (63 us) the worker's virtual runtime is 9.93 ms, behind the
    loop's: taken there. At batch 1's first yield (499 us) it is 10.1 ms, ahead: not
    taken. No turn is made at a batch's end before a dispatch."""
    report = case_report(behind_run(), 100.0, samples(100.0), LOOP, WORKER)
    assert report["first_yields"] == 2 and report["chain_turns"] == 0
    assert report["loop_ahead_share"] == pytest.approx(0.5)
    assert report["taken_ahead"] == 1.0 and report["taken_behind"] == 0.0
    assert np.isnan(report["held_ahead"]) and np.isnan(report["held_behind"])
    # Leads of +68.5 and -100 us: the 90th percentile between them.
    assert report["lead_us_p90"] == pytest.approx(-100 + 0.9 * 168.5, rel=1e-6)


def test_cases_are_parsed_or_refused_by_name():
    assert parse_cases("bursty:0.9,poisson:1.1") == [("bursty", 0.9), ("poisson", 1.1)]
    with pytest.raises(SystemExit, match="bursty:LOAD or poisson:LOAD, got 'gamma:0.5'"):
        parse_cases("gamma:0.5")
    with pytest.raises(SystemExit, match="LOAD must be a number, got 'poisson:high'"):
        parse_cases("poisson:high")
    with pytest.raises(SystemExit, match="got 'bursty'"):
        parse_cases("bursty")
