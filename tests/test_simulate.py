"""The simulator: hand-checked runs, invariants on random configurations, seeding, errors."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import policies, services, workloads

import batchsim as bs
from batchsim.policy import FLUSH, SIZE, TIMEOUT
from batchsim.result import COMPLETED, EXPIRED, REJECTED

TEN_MS = bs.AffineService(base_ms=10.0, per_item_ms=0.0)


def test_hand_checked_run():
    # t=0 first arrival opens the clock; t=1 ms a second fills the batch (size 2);
    # the worker is busy until 11 ms; meanwhile 2 ms and 10 ms arrive (10 ms closes the
    # stream); at 11 ms both leave together.
    res = bs.simulate(bs.Trace([0.0, 0.001, 0.002, 0.010]), bs.BatchPolicy(2, 5.0), TEN_MS)
    np.testing.assert_allclose(res.dispatch_s, [0.001, 0.001, 0.011, 0.011], rtol=1e-12)
    np.testing.assert_allclose(res.finish_s, [0.011, 0.011, 0.021, 0.021], rtol=1e-12)
    assert list(res.size) == [2, 2] and list(res.trigger) == [SIZE, SIZE]


def test_timeout_then_flush():
    # Alone, the first request waits its 5 ms; the last arrival closes the stream and is
    # flushed as soon as the worker frees.
    res = bs.simulate(bs.Trace([0.0, 0.012]), bs.BatchPolicy(4, 5.0), TEN_MS)
    np.testing.assert_allclose(res.dispatch_s, [0.005, 0.015], rtol=1e-12)
    assert list(res.trigger) == [TIMEOUT, FLUSH]


def test_expiry_and_rejection_by_hand():
    policy = bs.BatchPolicy(2, 5.0, max_queue_size=2, timeout_ms=5.0)
    res = bs.simulate(bs.Trace([0.0, 0.001, 0.002, 0.003, 0.004, 0.012]), policy, TEN_MS)
    # 0 and 1 leave at 1 ms; 2 and 3 wait; 4 finds two waiting: rejected. At 11 ms the
    # worker frees and two wait (size trigger), but they have waited 9 and 8 ms > 5 ms:
    # both expire and no batch leaves. The last arrival, at 12 ms, is flushed alone.
    assert list(res.status) == [COMPLETED, COMPLETED, EXPIRED, EXPIRED, REJECTED, COMPLETED]
    np.testing.assert_allclose(res.dispatch_s[[0, 1, 5]], [0.001, 0.001, 0.012], rtol=1e-12)
    assert list(res.trigger) == [SIZE, FLUSH]
    assert res.dequeue_s[2] == res.dequeue_s[3] == pytest.approx(0.011)


def test_greedy_takes_what_is_waiting_and_arrivals_at_the_dispatch_instant_join():
    res = bs.simulate(bs.Trace([0.0, 0.0, 0.0, 0.004, 0.010, 0.010]),
                      bs.BatchPolicy(8, 0.0), TEN_MS)
    assert list(res.size) == [3, 3]
    np.testing.assert_allclose(res.start_s, [0.0, 0.010], rtol=1e-12)


def test_lowest_numbered_free_worker_takes_the_batch():
    res = bs.simulate(bs.Trace([0.0, 0.001, 0.030]), bs.BatchPolicy(1, 0.0), TEN_MS, workers=3)
    assert list(res.worker) == [0, 1, 0]


# -- invariants on random configurations ----------------------------------------------

def check_invariants(res, policy, workers):
    n = res.n_requests
    done = res.status == COMPLETED
    # Every request accounted for exactly once.
    assert set(np.unique(res.status)) <= {COMPLETED, REJECTED, EXPIRED}
    assert np.array_equal(np.bincount(res.batch_id[done], minlength=res.n_batches), res.size)
    assert np.all(res.batch_id[~done] == -1) and res.size.sum() == done.sum()
    assert np.isnan(res.finish_s[~done]).all() and not np.isnan(res.finish_s[done]).any()
    # Batch sizes within [1, max_batch_size]; workers valid.
    assert np.all((res.size >= 1) & (res.size <= policy.max_batch_size))
    assert np.all((res.worker >= 0) & (res.worker < workers))
    # Batches are FIFO: dispatch order never overtakes arrival order.
    assert np.all(np.diff(res.batch_id[done]) >= 0)
    # A worker serves one batch at a time.
    for w in range(workers):
        mine = res.worker == w
        assert np.all(res.start_s[mine][1:] >= res.end_s[mine][:-1])
    # No batch leaves before the rule allows it.
    last_arrival = res.arrival_s[-1]
    for k in range(res.n_batches):
        t = res.start_s[k]
        # Waiting just before batch k left: members of this and later batches, and requests
        # expired when it was formed, that had arrived by then.
        waiting = (res.arrival_s <= t) & (
            (done & (res.batch_id >= k)) | ((res.status == EXPIRED) & (res.dequeue_s >= t)))
        oldest = res.arrival_s[waiting].min()
        assert (waiting.sum() >= policy.max_batch_size or t >= oldest + policy.max_wait_s
                or t >= last_arrival)
        assert res.arrival_s[res.batch_id == k].max() <= t
    # Expiry and rejection bounds.
    if policy.timeout_ms is not None:
        assert np.all(res.wait_s[done] <= policy.timeout_s)
        expired = res.status == EXPIRED
        assert np.all(res.dequeue_s[expired] - res.arrival_s[expired] > policy.timeout_s)
    _, qlen = res.queue_length()
    if policy.max_queue_size is not None:
        assert qlen.max() <= policy.max_queue_size
    assert qlen[-1] == 0
    # Little's law on the queue-length series: the time integral of the queue length is
    # the total time spent waiting.
    times, qlen = res.queue_length()
    area = np.sum(qlen[:-1] * np.diff(times))
    queued = res.status != REJECTED
    assert area == pytest.approx(np.sum(res.dequeue_s[queued] - res.arrival_s[queued]),
                                 rel=1e-9, abs=1e-12)
    assert n == res.status.size


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads, policy=policies, service=services,
       workers=st.integers(1, 3), n=st.integers(1, 300), seed=st.integers(0, 2**32))
def test_invariants_on_random_configurations(workload, policy, service, workers, n, seed):
    n = min(n, len(workload)) if isinstance(workload, bs.Trace) else n
    res = bs.simulate(workload, policy, service, n_requests=n, workers=workers, seed=seed)
    check_invariants(res, policy, workers)


def test_throughput_equals_the_arrival_rate_when_stable():
    n, rate = 40_000, 3000.0
    res = bs.simulate(bs.Poisson(rate), bs.BatchPolicy(16, 2.0), bs.AffineService(1.9, 0.14),
                      n_requests=n, seed=5)
    # n arrivals over their span estimate the rate with relative s.e. 1/sqrt(n); the
    # drain after the last arrival adds at most a few ms over a ~13 s run.
    assert abs(res.summary()["throughput_rps"] / rate - 1) < 5 / math.sqrt(n)


def test_same_seed_same_run_other_seed_other_run():
    args = (bs.Poisson(2000.0), bs.BatchPolicy(8, 1.0), bs.AffineService(1.0, 0.2, 0.3))
    a, b = (bs.simulate(*args, n_requests=2000, seed=7) for _ in range(2))
    c = bs.simulate(*args, n_requests=2000, seed=8)
    for field in ("arrival_s", "dispatch_s", "finish_s", "batch_id", "status"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert not np.array_equal(a.arrival_s, c.arrival_s)
    # Arrivals and jitter come from separate streams: no jitter, same arrivals.
    d = bs.simulate(args[0], args[1], bs.AffineService(1.0, 0.2), n_requests=2000, seed=7)
    np.testing.assert_array_equal(a.arrival_s, d.arrival_s)


def test_a_seed_sequence_given_again_gives_the_same_run_in_either_engine():
    """``streams`` leaves a ``SeedSequence`` as it was (``spawn`` would move it on), and
    it gives what its integer seed gives."""
    args = (bs.Poisson(2000.0), bs.BatchPolicy(8, 1.0), bs.AffineService(1.0, 0.2, 0.3))
    seq = np.random.SeedSequence(7)
    runs = [bs.simulate(*args, n_requests=500, seed=seq, engine=engine)
            for engine in ("fast", "simpy", "fast")]
    runs.append(bs.simulate(*args, n_requests=500, seed=7))
    for run in runs[1:]:
        np.testing.assert_array_equal(run.arrival_s, runs[0].arrival_s)
        np.testing.assert_array_equal(run.finish_s, runs[0].finish_s)
    assert seq.n_children_spawned == 0


def test_an_uncapped_max_batch_size_costs_no_more_than_the_run():
    """No batch outgrows the run: the table of batch times stops at its size."""
    policy = bs.BatchPolicy(10**12, 1.0)
    for engine in ("fast", "simpy"):
        res = bs.simulate(bs.Poisson(1000.0), policy, bs.AffineService(1.0, 0.1),
                          n_requests=10, seed=0, engine=engine)
        assert res.summary()["n_completed"] == 10


def test_jitter_scales_each_batch_by_a_mean_one_factor():
    service = bs.AffineService(2.0, 0.1, jitter_cv=0.4)
    res = bs.simulate(bs.Poisson(1000.0), bs.BatchPolicy(8, 1.0), service, n_requests=30_000)
    ratio = (res.end_s - res.start_s) / service.mean_s(res.size)
    se = 0.4 / math.sqrt(ratio.size)
    assert abs(ratio.mean() - 1) < 5 * se
    assert abs(ratio.std() - 0.4) < 0.05 * 0.4


@pytest.mark.parametrize("kwargs, name", [
    ({"workload": "poisson"}, "workload"),
    ({"policy": {"max_batch_size": 4}}, "policy"),
    ({"service": 1.5}, "service"),
    ({"n_requests": 0}, "n_requests"),
    ({"n_requests": None}, "n_requests"),
    ({"workers": 0}, "workers"),
    ({"seed": -1}, "seed"),
    ({"engine": "warp"}, "engine"),
])
def test_bad_arguments_raise_naming_the_parameter(kwargs, name):
    args = {"workload": bs.Poisson(100.0), "policy": bs.BatchPolicy(4, 1.0),
            "service": bs.AffineService(1.0, 0.1), "n_requests": 10}
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        bs.simulate(**args)


def test_import_batchsim_is_light():
    import subprocess
    import sys

    code = ("import sys, batchsim; heavy = {'torch', 'simpy', 'pandas', 'matplotlib'} "
            "& set(sys.modules); assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_arrivals_and_jitter_come_from_the_first_and_second_children_of_the_seed():
    """The streams are the two children a fresh ``SeedSequence(seed)`` spawns first:
    arrivals from child 0, service jitter (one factor per batch, in dispatch order)
    from child 1."""
    n, service = 200, bs.AffineService(1.0, 0.0, jitter_cv=0.3)
    workload = bs.Poisson(100.0)
    # max_batch_size=1 on one worker: batch k serves request k, with the k-th factor.
    res = bs.simulate(workload, bs.BatchPolicy(1, 0.0), service, n_requests=n, seed=11)
    arrival_ss, service_ss = np.random.SeedSequence(11).spawn(2)
    np.testing.assert_array_equal(
        res.arrival_s, workload.arrivals_s(n, np.random.default_rng(arrival_ss)))
    np.testing.assert_allclose(
        (res.end_s - res.start_s) / service.mean_s(1),
        service.jitter_factors(np.random.default_rng(service_ss), n), rtol=1e-9)


def test_a_seed_sequences_spawn_key_is_part_of_the_seed():
    """A child ``SeedSequence`` (entropy plus a spawn key) seeds its own run: its streams
    extend its spawn key, so it differs from the run of its bare entropy."""
    workload, n = bs.Poisson(1000.0), 100
    args = (workload, bs.BatchPolicy(4, 1.0), bs.AffineService(1.0, 0.2))
    child = np.random.SeedSequence(7, spawn_key=(3,))
    res = bs.simulate(*args, n_requests=n, seed=child)
    first = np.random.SeedSequence(7, spawn_key=(3,)).spawn(1)[0]   # spawn key (3, 0)
    np.testing.assert_array_equal(
        res.arrival_s, workload.arrivals_s(n, np.random.default_rng(first)))
    assert not np.array_equal(res.arrival_s,
                              bs.simulate(*args, n_requests=n, seed=7).arrival_s)
    assert not np.array_equal(
        res.arrival_s,
        bs.simulate(*args, n_requests=n,
                    seed=np.random.SeedSequence(7, spawn_key=(4,))).arrival_s)


def test_jitter_does_not_depend_on_how_the_arrivals_were_drawn():
    """Common random numbers: jitter has its own stream, so a Trace (which draws nothing)
    and a Poisson workload given the same seed see the same sequence of batch times."""
    n, service = 300, bs.AffineService(2.0, 0.5, jitter_cv=0.5)
    policy = bs.BatchPolicy(1, 0.0)   # one request a batch: batch k serves request k
    factors = []
    for workload in (bs.Trace(np.arange(1, n + 1) * 0.1), bs.Poisson(10.0)):
        res = bs.simulate(workload, policy, service, n_requests=n, seed=5)
        assert list(res.size) == [1] * n
        factors.append((res.end_s - res.start_s) / service.mean_s(1))
    np.testing.assert_allclose(factors[0], factors[1], rtol=1e-9)
