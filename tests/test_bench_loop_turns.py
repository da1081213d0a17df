"""``bench/bench_loop_turns.py``: the load generator's turns, real against simulated."""

from types import SimpleNamespace

import numpy as np
import pytest
from bench_loop_turns import (
    BUSY_MARGIN_US,
    after_turns,
    analyze,
    busy_report,
    busy_wakes,
    chain_rounds,
    linger_split_s,
    turn_report,
    turn_starts,
)
from service_fakes import costly_service

import batchsim as bs
from batchsim.calibrate import SPAN_US
from batchsim.service import BatcherCosts

POLICY = bs.BatchPolicy(8, 0.0)


def sent_runs(n_runs=3, load=0.8):
    """Runs of the simulated generator on the loop (``costly_service``: react 20 us,
    timers on a 1 ms grid)."""
    svc = costly_service()
    return svc, [bs.simulate(bs.Poisson(load * svc.capacity_rps(8)), POLICY, svc,
                             n_requests=4000, seed=k, sender="loop") for k in range(n_runs)]


def test_the_simulated_loop_lingers_one_reaction_after_a_turn():
    """The simulated loop decides one reaction after each turn and then sleeps: a request
    due by then is sent awake, one reaction after that, every later one after a sleep.
    The bench's split falls between the two kinds, and each request sent awake is late
    by twice the reaction less its delay; one sent after a sleep waited for the batch's
    end or the timer."""
    svc, runs = sent_runs()
    react_s = svc.costs.react_s
    delays, awake, late = (np.concatenate(v) for v in zip(
        *(after_turns(r, turn_starts(r), svc.costs.timer_resolution_ms) for r in runs),
        strict=True))
    assert awake.sum() > 50 and (~awake).sum() > 50
    assert delays[awake].max() <= react_s < delays[~awake].min()
    assert delays[awake].max() <= linger_split_s(delays, awake) <= delays[~awake].min()
    np.testing.assert_allclose(late[awake], 2 * react_s - delays[awake], rtol=0, atol=1e-12)
    assert (late[~awake] > SPAN_US / 1e6).all()      # the batch ran on that long


def test_the_report_counts_turns_and_requests_between_batches_as_the_runs_hold_them():
    """Against counts made directly: the receipts outside every batch, and per batch
    that received requests, the distinct instants they came at (the simulated turns)."""
    svc, runs = sent_runs(n_runs=2)
    report = turn_report(runs, svc.costs.timer_resolution_ms)
    between = turns = batches = 0
    for r in runs:
        a = r.arrival_s
        inside = ((a[:, None] > r.start_s[None, :]) & (a[:, None] < r.end_s[None, :])).any(1)
        at_start = np.isin(a, r.start_s)
        between += int((~inside & ~at_start).sum())
        for t0, t1 in zip(r.start_s, r.end_s, strict=True):
            got = a[(a > t0) & (a < t1)]
            if got.size:
                turns += np.unique(got).size
                batches += 1
    assert report["between_share"] == pytest.approx(between / sum(r.arrival_s.size
                                                                  for r in runs))
    assert report["turns_per_batch"] == pytest.approx(turns / batches)
    sizes = np.concatenate([r.meta["turn_sizes"] for r in runs])
    assert report["capped_share"] == pytest.approx(sizes[sizes >= 64].sum() / sizes.sum())


def test_turns_of_a_run_without_a_record_split_where_a_request_was_not_yet_due():
    """Sent at 1.0, 1.001 (due at 0.9, before the send before it: it joined that turn)
    and 3.0 (due at 2.0, after it)."""
    res = SimpleNamespace(meta={"scheduled_s": np.array([0.5, 0.9, 2.0])},
                          arrival_s=np.array([1.0, 1.001, 3.0]))
    assert turn_starts(res).tolist() == [0, 2]
    res.meta["turn_sizes"] = np.array([1, 1, 1])
    assert turn_starts(res).tolist() == [0, 1, 2]


def test_a_generator_behind_sends_turns_of_max_burst():
    """150 requests all due before they were sent, then one due after: turns of 64, 64,
    22 and 1."""
    due = np.r_[np.zeros(150), 10.0]
    res = SimpleNamespace(meta={"scheduled_s": due}, arrival_s=np.r_[1.0 + np.arange(150) * 1e-6,
                                                                      11.0])
    assert turn_starts(res).tolist() == [0, 64, 128, 150]


def test_rounds_between_full_turns_and_whether_a_batch_ended_in_them():
    """150 requests all due at 0: a turn of 64 sent 1 us apart, the next 10 us after it,
    the third 300 us after that, with a batch's end between; the third is not full."""
    us = 1e-6
    second = 63 * us + 10 * us
    third = second + 63 * us + 300 * us
    sent = 1.0 + np.r_[np.arange(64) * us, second + np.arange(64) * us,
                       third + np.arange(22) * us]
    res = SimpleNamespace(meta={"scheduled_s": np.zeros(150)}, arrival_s=sent,
                          end_s=np.array([1.0 + second + 163 * us]))
    rounds_s, ended = chain_rounds(res, turn_starts(res))
    np.testing.assert_allclose(rounds_s, [10 * us, 300 * us], rtol=1e-6)
    assert ended.tolist() == [False, True]


def test_a_grid_simulated_on_its_own_schedules_reads_the_same_as_its_real_side():
    """Saved runs made by the simulator itself (their schedule as a real run's): the
    simulation of each schedule is the run, so both sides of every part agree."""
    svc, runs = sent_runs(n_runs=2, load=0.5)
    for seed, r in enumerate(runs):
        r.meta["scheduled_s"] = r.meta["sent_s"]
        r.meta["policy"], r.meta["seed"] = POLICY, seed
    saved = {"service": svc, "calibration_runs": runs[:1],
             "runs": {"poisson": [{"policy": POLICY, "seed": 1, "real": runs[1]}]}}
    report = analyze(saved)
    assert set(report) == {"calibration_runs", "poisson"}
    for sides in report.values():
        assert sides["real"] == pytest.approx(sides["sim"], nan_ok=True)
        assert sides["real"]["linger_us"] == pytest.approx(20.0, abs=5.0)


def test_the_simulated_loop_wakes_at_its_timer_while_a_batch_runs():
    """``costly_service``'s batches of 8 last about 1.4 ms, so the loop's 1 ms timer fires
    during some: the simulated loop always wakes then, and its turn comes one reaction
    after the fire the bench reads from the same timer model."""
    svc, runs = sent_runs()
    woke, late_s = (np.concatenate(v) for v in zip(
        *(busy_wakes(r, turn_starts(r), svc.costs) for r in runs), strict=True))
    assert woke.size > 50 and woke.all()
    np.testing.assert_allclose(late_s, svc.costs.react_s, rtol=0, atol=1e-12)


def test_a_sleep_that_lasts_until_the_batch_ends_counts_as_not_woken():
    """Batches 0-3 ms and 4-5.4 ms; timers on a 1 ms grid, 50 us late; the loop lingers
    5 us. After the send at 0.1 ms the loop sleeps at 0.105 ms for a request due at 0.3:
    its timer fires at 1.155 ms and the next send comes 100 us later, in the batch. After
    that one it sleeps at 1.26 ms for 1.5: the timer fires at 2.31 ms, but the send comes
    only after the batch's end. The sleep at 4.205 ms for 4.25 fires at 5.255 ms, within
    ``BUSY_MARGIN_US`` of its batch's end: not counted."""
    ms = 1e-3
    res = SimpleNamespace(
        arrival_s=np.array([0.1, 1.255, 3.05, 4.2, 5.5]) * ms,
        meta={"scheduled_s": np.array([0.1, 0.3, 1.5, 4.2, 4.25]) * ms,
              "turn_sizes": np.ones(5, int)},
        start_s=np.array([0.0, 4.0]) * ms, end_s=np.array([3.0, 5.4]) * ms)
    costs = BatcherCosts(timer_resolution_ms=1.0, timer_latency_ms=0.05, linger_ms=0.005)
    assert 5.255 + BUSY_MARGIN_US / 1e3 > 5.4
    woke, late_s = busy_wakes(res, turn_starts(res), costs)
    assert woke.tolist() == [True, False]
    np.testing.assert_allclose(late_s, [0.1 * ms, 0.74 * ms], rtol=1e-9)
    report = busy_report([res], costs)
    assert report["busy_wakes"] == 2 and report["busy_wake_share"] == 0.5
    assert report["busy_wake_late_us"] == pytest.approx(100.0)
