"""Load generation: the simulator's arrivals, replayed open loop; saturation runs."""

import asyncio
import gc
import math
import threading
import time

import numpy as np
import pytest
import torch
from collector import collections_started

import batchsim as bs
from batchsim.real import DynamicBatcher, InferenceBatcher, InputSpec, run_load, run_saturated
from batchsim.real.loadgen import RELEASE_EVERY_BATCHES

SPEC = InputSpec((3,), torch.float32)


def sleepy(x):
    """Half a millisecond a batch, GIL released, like a small GPU model."""
    time.sleep(0.0005)
    return x + 1


sleepy.input_spec = SPEC


def test_replays_the_arrivals_the_simulator_draws_for_the_seed():
    workload, policy = bs.Gamma(800.0, cv=2.0), bs.BatchPolicy(8, 2.0)
    res = run_load(sleepy, workload, policy, n_requests=300, seed=11)
    sim = bs.simulate(workload, policy, bs.AffineService(0.5, 0.01), n_requests=300, seed=11)
    np.testing.assert_array_equal(res.meta["scheduled_s"], sim.arrival_s)
    assert res.summary()["n_completed"] == 300


def test_never_submits_early_and_reports_its_lateness():
    res = run_load(sleepy, bs.Poisson(1000.0), bs.BatchPolicy(4, 1.0), n_requests=200, seed=2)
    late_ms = 1000 * (res.arrival_s - res.meta["scheduled_s"])
    assert (late_ms >= 0).all()
    assert res.meta["lateness_ms_p99"] == pytest.approx(np.percentile(late_ms, 99))
    assert res.meta["lateness_ms_max"] == pytest.approx(late_ms.max())
    assert res.meta["harness"] == "open loop" and res.meta["seed"] == 2


def test_records_the_requests_it_sent_in_each_turn():
    """Three requests due at once, two more 50 ms later: two turns of the generator."""
    res = run_load(sleepy, bs.Trace([0.0, 0.0, 0.0, 0.05, 0.05]), bs.BatchPolicy(4, 0.0),
                   n_requests=5)
    assert res.meta["turn_sizes"].tolist() == [3, 2]


def test_sleeps_rather_than_spins_between_sparse_arrivals():
    """Arrivals 5 ms apart: a spinning harness would burn a whole core for the run."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    run_load(sleepy, bs.Constant(200.0), bs.BatchPolicy(4, 0.0), n_requests=80)
    cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    assert cpu_s < 0.3 * wall_s


def test_drives_a_given_batcher_or_the_naive_one():
    policy = bs.BatchPolicy(4, 1.0)
    res = run_load(DynamicBatcher(sleepy, policy), bs.Poisson(500.0), policy, 50)
    assert res.meta["engine"] == "real" and res.summary()["n_completed"] == 50
    naive = run_load(InferenceBatcher(sleepy, 4, 1.0), bs.Poisson(500.0), n_requests=50)
    assert naive.meta["engine"] == "naive" and naive.summary()["n_completed"] == 50
    # The same seed replays the same schedule against both.
    np.testing.assert_array_equal(res.meta["scheduled_s"], naive.meta["scheduled_s"])


def test_works_inside_a_running_event_loop():
    async def notebook_cell():
        return run_load(sleepy, bs.Poisson(500.0), bs.BatchPolicy(4, 1.0), n_requests=30)

    assert asyncio.run(notebook_cell()).summary()["n_completed"] == 30


def test_saturated_run_keeps_the_window_outstanding():
    res = run_saturated(sleepy, 400, bs.BatchPolicy(8, math.inf), window=24)
    assert res.summary()["n_completed"] == 400 and res.meta["window"] == 24
    # Request i + window was submitted only after request i had finished.
    assert (res.finish_s[:-24] <= res.arrival_s[24:]).all()
    # A full batch always waits when the worker frees: every batch but the last is full.
    assert (res.size[:-1] == 8).all()


@pytest.mark.parametrize("max_wait_ms", [0.0, math.inf])
def test_outputs_go_as_their_requests_finish_while_the_queue_drains(max_wait_ms):
    """196 requests sent at once: the sender is done long before the batcher, which then
    drains its queue for about 25 batches. A server that answers its requests lets each
    output go; kept to the end, every batch allocates anew (on CUDA it pins a new output
    buffer: the encoder's batches of 32 ran 2.1-2.9x slow on an H200). The model counts,
    at each call, how many earlier outputs are still alive: the harness lets them go
    ``RELEASE_EVERY_BATCHES`` batches at a time, and the last of those may still be
    alive when the next batch starts (the callback that wakes the harness runs after
    it); older ones not. With ``max_wait_ms=inf`` the last batch is only dispatched when
    the run closes the batcher: waiting for it before closing would never end."""
    import weakref

    earlier, alive = [], []

    def model(x):
        alive.append(sum(ref() is not None for ref in earlier))
        time.sleep(0.0005)
        out = x + 1
        earlier.append(weakref.ref(out))
        return out

    model.input_spec = SPEC
    res = run_load(model, bs.Constant(1e6), bs.BatchPolicy(8, max_wait_ms), n_requests=196)
    assert res.summary()["n_completed"] == 196
    assert len(alive) >= 25 and max(alive) <= RELEASE_EVERY_BATCHES + 1, alive
    # Nor does the harness wake for every batch: each wake-up costs the loop ~10 us.
    assert max(alive) >= RELEASE_EVERY_BATCHES - 1, alive


def _serving() -> bool:
    """Whether this thread serves requests now: it runs the harness's event loop, or it is
    one of the batcher's worker threads (setting up before and building the result after
    may collect)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return threading.current_thread() is not threading.main_thread()
    return True


@pytest.mark.parametrize("harness", [
    lambda **kw: run_load(sleepy, bs.Poisson(4000.0), bs.BatchPolicy(8, 0.5), 2000, **kw),
    lambda **kw: run_saturated(sleepy, 2000, bs.BatchPolicy(8, math.inf), **kw),
])
def test_the_garbage_collector_does_not_run_during_a_run_unless_asked(harness):
    """A full collection would stop the event loop for as long as the process's heap takes.

    2000 requests allocate a future and a queue entry each, well past the collector's
    first threshold (700), so left to Python it collects during the run.
    """
    assert gc.isenabled()
    assert collections_started(harness, _serving) == 0
    assert gc.isenabled()
    assert collections_started(lambda: harness(pause_gc=False), _serving) > 0


def test_a_collector_turned_off_by_the_caller_stays_off():
    gc.disable()
    try:
        run_load(sleepy, bs.Poisson(2000.0), bs.BatchPolicy(4, 0.5), n_requests=50)
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("kwargs, match", [
    ({"target": sleepy, "policy": None}, "policy is required"),
    ({"target": InferenceBatcher(sleepy), "policy": bs.BatchPolicy(2, 1.0)},
     "policy must be None for an InferenceBatcher"),
    ({"target": DynamicBatcher(sleepy, bs.BatchPolicy(2, 1.0)), "policy": bs.BatchPolicy(3, 1.0)},
     "policy must be None or the batcher's own"),
    ({"target": DynamicBatcher(sleepy, bs.BatchPolicy(2, 1.0)), "workers": 4},
     "workers must be None or the batcher's own 1, got 4"),
    ({"target": DynamicBatcher(sleepy, bs.BatchPolicy(2, 1.0)), "device": "meta"},
     "device must be None or the batcher's own cpu, got device"),
    ({"target": InferenceBatcher(sleepy), "policy": None, "workers": 2},
     "workers must be None for an InferenceBatcher"),
    ({"target": InferenceBatcher(sleepy), "policy": None, "device": "cpu"},
     "device must be None for an InferenceBatcher"),
    ({"target": sleepy, "seed": -1}, "seed must be"),
    ({"target": sleepy, "n_requests": 0}, "n_requests"),
    ({"target": sleepy, "workload": "poisson"}, "workload must be"),
    ({"target": lambda x: x, "inputs": None}, "inputs is required"),
])
def test_bad_arguments_name_the_parameter(kwargs, match):
    args = {"workload": bs.Poisson(100.0), "policy": bs.BatchPolicy(2, 1.0),
            "n_requests": 5, **kwargs}
    with pytest.raises(ValueError, match=match):
        run_load(**args)


def test_a_batcher_given_again_its_own_settings_serves():
    batcher = DynamicBatcher(sleepy, bs.BatchPolicy(2, 1.0), workers=2)
    res = run_saturated(batcher, 20, bs.BatchPolicy(2, 1.0), workers=2, device="cpu")
    assert res.workers == 2 and res.summary()["n_completed"] == 20


@pytest.mark.parametrize("harness", ["open loop", "saturated"])
def test_an_error_mid_run_closes_the_batcher_before_it_propagates(harness):
    """Inputs that do not fit the model fail at the first submit, after the batcher
    started: it is closed, and none of its threads outlives the call."""
    batcher = DynamicBatcher(sleepy, bs.BatchPolicy(2, 1.0))
    wrong = torch.zeros(4, 5)
    with pytest.raises(ValueError, match="x must have shape"):
        if harness == "open loop":
            run_load(batcher, bs.Poisson(1000.0), n_requests=10, inputs=wrong, warmup=False)
        else:
            run_saturated(batcher, 10, inputs=wrong, warmup=False)
    assert not [t for t in threading.enumerate() if t.name.startswith("batchsim")]
    assert batcher.result().n_requests == 0  # closed (else result() raises); none lost
