"""Drive a real batcher with load and record the run as a RunResult.

``run_load`` replays a workload open loop: the arrival times are the ones the simulator
draws for the same seed (``batchsim.seeding``), so a real run and a simulated one see
the same requests. It sleeps until each arrival -- never spins: a spinning thread holds
the GIL for whole switch intervals (5 ms) and would slow the batcher it measures -- and
reports its own lateness (recorded arrival minus scheduled arrival) in the result's
``meta``, so a user can tell when the harness, not the batcher, is the limit.

``run_saturated`` is the closed-loop counterpart: it keeps a window of requests
outstanding, which measures the most a batcher can serve.

Both measure the steady state: by default the batcher first runs an untimed batch of
every size (with CUDA graphs, of every bucket's) through every worker (``warmup``), so
that a thread's first CUDA/cuBLAS use, buffer allocation, allocator growth and a batch
size's first run do not land on the first requests; and the inputs are
rows of one tensor made up front, sent in turn, so the harness costs a submit per
request and nothing more.

And by default (``pause_gc``) Python's cyclic garbage collector does not run during a
run (``batchsim._gc``): a full collection stops the event loop for as long as it takes
to walk everything the harness's process holds, tens to a hundred milliseconds.

The target is a ``DynamicBatcher`` (not yet started), a naive ``InferenceBatcher``
(driven the way tutorials drive it: a task on the event loop polls it every
``poll_ms``), or a model, served by a new ``DynamicBatcher(model, policy, workers,
device)`` (``workers`` 1 unless given). A batcher brings its own policy, workers and
device: given ones must match. Both functions are synchronous; inside a running event
loop (Jupyter) they run their own loop on a helper thread. Whatever goes wrong while
they run, the server is closed before the error propagates, so no thread of it
outlives the call.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import numpy as np
import torch

from .. import _check
from .. import policy as rule
from .._aio import run_to_completion
from .._gc import collector_paused
from ..policy import BatchPolicy
from ..result import RunResult
from ..seeding import streams
from ..workload import Workload
from .batcher import DynamicBatcher, QueueFullError, RunLog
from .models import resolve_device
from .naive import InferenceBatcher
from .runners import warmup_sizes


def run_load(target, workload: Workload, policy: BatchPolicy | None = None,
             n_requests: int = 1000, seed=0, *, inputs=None, workers: int | None = None,
             device=None, poll_ms: float = 1.0, max_burst: int = 64, warmup: bool = True,
             pause_gc: bool = True) -> RunResult:
    """Replay ``n_requests`` arrivals of ``workload`` (seeded) open loop against ``target``.

    ``inputs``: a ``(m, *shape)`` tensor whose rows are sent in turn (default: 64 random
    inputs of the model's ``input_spec``), a pool made once, so that the harness costs
    no more than a submit per request. When the harness falls behind it submits what is
    due, at most ``max_burst`` at a time, before letting the batcher run. ``warmup``:
    run one untimed batch of zeros through every worker first (see
    ``DynamicBatcher.start``), so the run measures the steady state. ``meta`` of the
    result holds ``scheduled_s`` (the drawn arrivals), ``turn_sizes`` (how many requests
    the generator submitted in each of its turns on the loop, in order: each turn costs
    the batch that runs meanwhile its own work, beyond its requests') and the lateness of
    the submissions, ``lateness_ms_p50`` / ``_p99`` / ``_max``. ``pause_gc``: no automatic
    garbage collection during the run (see the module doc; False leaves it to Python).
    """
    if not isinstance(workload, Workload):
        raise ValueError(f"workload must be a batchsim workload, got {workload!r}")
    n = _check.positive_int("n_requests", n_requests)
    burst = _check.positive_int("max_burst", max_burst)
    arrival_rng, _ = streams(seed)  # checks the seed before anything starts
    server = _server(target, policy, workers, device, poll_ms)
    rows = _rows(server, inputs)
    scheduled_s = np.asarray(workload.arrivals_s(n, arrival_rng), float)

    turn_sizes = []     # requests sent in each of the generator's turns on the loop

    async def replay():
        pending: deque = deque()
        submit, now_s, m = server.submit_nowait, server.now_s, len(rows)
        due_s = scheduled_s.tolist()
        i = 0
        while i < n:
            sent = 0
            while i < n and sent < burst and due_s[i] <= now_s():
                try:
                    pending.append(submit(rows[i % m]))
                except QueueFullError:
                    pass  # recorded as rejected by the batcher
                i += 1
                sent += 1
            if sent:
                turn_sizes.append(sent)
            _release(pending)
            if i < n:
                await asyncio.sleep(max(0.0, due_s[i] - now_s()))
        await _close_releasing(server, pending)
        return server.result()

    with collector_paused(pause_gc):
        res = run_to_completion(_serving(server, warmup, replay))
    late_ms = 1000.0 * (res.arrival_s - scheduled_s)
    res.meta.update(harness="open loop", workload=repr(workload), seed=seed,
                    scheduled_s=scheduled_s, turn_sizes=np.array(turn_sizes, int),
                    lateness_ms_p50=float(np.percentile(late_ms, 50)),
                    lateness_ms_p99=float(np.percentile(late_ms, 99)),
                    lateness_ms_max=float(late_ms.max()))
    return res


def run_saturated(target, n_requests: int, policy: BatchPolicy | None = None, *,
                  inputs=None, window: int | None = None, workers: int | None = None,
                  device=None, poll_ms: float = 1.0, warmup: bool = True,
                  pause_gc: bool = True) -> RunResult:
    """Serve ``n_requests`` keeping ``window`` of them outstanding (closed loop).

    The default window, ``2 * (workers + 1) * max_batch_size``, keeps a full batch
    waiting whenever a worker frees up, so the result's throughput is the batcher's
    capacity with this model. ``inputs``, ``warmup`` and ``pause_gc`` as in ``run_load``.
    """
    n = _check.positive_int("n_requests", n_requests)
    server = _server(target, policy, workers, device, poll_ms)
    rows = _rows(server, inputs)
    if window is None:
        window = 2 * (server.workers + 1) * server.max_batch_size
    window = _check.positive_int("window", window)

    async def saturate():
        pending: deque = deque()
        submit, m = server.submit_nowait, len(rows)
        for i in range(n):
            if len(pending) >= window:
                oldest = pending.popleft()
                if not oldest.done():
                    await asyncio.wait((oldest,))
                _settle(oldest)
            try:
                pending.append(submit(rows[i % m]))
            except QueueFullError:
                pass  # recorded as rejected by the batcher
        await server.close()
        _release(pending)
        return server.result()

    with collector_paused(pause_gc):
        res = run_to_completion(_serving(server, warmup, saturate))
    res.meta.update(harness="saturated", window=window)
    return res


def _serving(server, warmup: bool, run):
    """A coroutine function: start ``server``, then ``run()``; if that raises, close the
    server (failing what still waits) before the error goes on."""
    async def served():
        await server.start(warmup=warmup)
        try:
            return await run()
        except BaseException:
            await server.close(drain=False)
            raise
    return served


def _settle(fut) -> None:
    """Mark a finished future's outcome as seen (no 'exception never retrieved' noise)."""
    if not fut.cancelled():
        fut.exception()


def _release(pending: deque) -> None:
    """Drop finished futures from the front, so finished outputs are not kept alive."""
    while pending and pending[0].done():
        _settle(pending.popleft())


#: While the queue drains after the last send, the harness wakes to let outputs go once
#: per this many batches, so that outputs of at most this many batches more stay alive.
#: Each wake-up is event-loop work (``asyncio.wait``, about 10 us) on the core the worker
#: needs: waking for every batch made the drain's batches 12-16% slower for the tiny MLP
#: and up to 7% for the CNN, on one CPU (``bench/bench_drain_release.py``); every 4,
#: they run about as fast as the batches while the generator sends.
RELEASE_EVERY_BATCHES = 4


async def _close_releasing(server, pending: deque) -> None:
    """Close ``server`` (it serves what is still queued) and let the outputs go as their
    requests finish, a few batches at a time, as a server that answers its requests does.

    After a burst the queue can outlast the sending by hundreds of batches. Kept to the
    end, every output stays alive, and each batch allocates its output anew: on CUDA a
    new pinned host buffer, which made the encoder's batches of 32 2.1-2.9x slower on an
    H200 (``bench/results/README.md``). Closing runs alongside, since a batch that waits
    for more requests is only dispatched once the batcher closes.
    """
    closing = asyncio.ensure_future(server.close())
    window = RELEASE_EVERY_BATCHES * server.max_batch_size
    while pending and not closing.done():
        last = pending[min(window, len(pending)) - 1]
        # With several workers a later batch can finish first: then wait for the oldest.
        wanted = pending[0] if last.done() else last
        await asyncio.wait((wanted, closing), return_when=asyncio.FIRST_COMPLETED)
        _release(pending)
    await closing
    _release(pending)


def _rows(server, inputs) -> list:
    """The inputs to send, as a list of per-request tensors."""
    if inputs is None:
        spec = server.input_spec
        if spec is None:
            raise ValueError("inputs is required when the model has no input_spec, got None")
        inputs = spec.random(64)
    if isinstance(inputs, np.ndarray):
        inputs = torch.from_numpy(inputs)
    if not isinstance(inputs, torch.Tensor) or inputs.ndim < 1 or len(inputs) == 0:
        raise ValueError(f"inputs must be a non-empty (m, *shape) tensor, got {inputs!r}")
    return list(inputs.unbind(0))


def _server(target, policy, workers, device, poll_ms):
    """What serves ``target``; a batcher's own settings may be given again, not changed."""
    if isinstance(target, DynamicBatcher):
        own = {"policy": target.policy, "workers": target.workers, "device": target.device}
        given = {"policy": policy, "workers": workers,
                 "device": None if device is None else resolve_device(device)}
        for name, value in given.items():
            if value is not None and value != own[name]:
                raise ValueError(f"{name} must be None or the batcher's own {own[name]}, "
                                 f"got {value!r}")
        return target
    if isinstance(target, InferenceBatcher):
        for name, value, ok in (("policy", policy, None), ("workers", workers, 1),
                                ("device", device, None)):
            if value is not None and value != ok:
                raise ValueError(f"{name} must be None for an InferenceBatcher (it has its "
                                 f"own max_batch_size and max_wait_ms, one worker, and runs "
                                 f"where its model is), got {value!r}")
        return _Polled(target, poll_ms)
    if policy is None:
        raise ValueError("policy is required to serve a model, got None")
    return DynamicBatcher(target, policy, workers=1 if workers is None else workers,
                          device=device)


class _Polled:
    """Serve an InferenceBatcher the way tutorials do, with DynamicBatcher's interface.

    A task on the event loop asks ``should_process()``, runs ``process_batch()`` (on
    the loop itself) when it says yes, and sleeps ``poll_ms`` between checks.
    """

    workers = 1

    def __init__(self, batcher: InferenceBatcher, poll_ms: float):
        self.batcher = batcher
        self.poll_s = _check.positive("poll_ms", poll_ms) / 1000.0
        self.max_batch_size = batcher.max_batch_size
        self.input_spec = getattr(batcher.model_fn, "input_spec", None)
        self.log = RunLog()
        self.futures: dict[int, asyncio.Future] = {}
        self.closing = False

    async def start(self, warmup: bool = False):
        """Start polling; ``warmup`` first runs the model on a batch of zeros of every
        size, as the ``DynamicBatcher`` warms up."""
        self.loop = asyncio.get_running_loop()
        b, spec = self.batcher, self.input_spec
        if warmup and spec is not None:
            with torch.no_grad():
                for size in warmup_sizes(b.max_batch_size, graphs=False):
                    b.model_fn(torch.zeros((size, *spec.shape), dtype=spec.dtype))
        self.t0 = time.perf_counter()
        self.task = asyncio.create_task(self._poll())

    def now_s(self) -> float:
        return time.perf_counter() - self.t0

    def submit_nowait(self, x):
        rid = len(self.log.arrival_s)
        self.log.arrival_s.append(self.now_s())
        fut = self.futures[rid] = self.loop.create_future()
        self.batcher.add_request(x, rid)
        return fut

    async def close(self, drain: bool = True):
        """Stop polling once the queue is empty (the naive batcher always drains)."""
        self.closing = True
        await self.task

    def result(self) -> RunResult:
        b = self.batcher
        return self.log.result(1, engine="naive", max_batch_size=b.max_batch_size,
                               max_wait_ms=b.max_wait_ms, poll_ms=1000.0 * self.poll_s)

    async def _poll(self):
        b = self.batcher
        while not (self.closing and not len(b)):
            ready = b.should_process()
            if ready or (self.closing and len(b)):
                trigger = (rule.SIZE if len(b) >= b.max_batch_size
                           else rule.TIMEOUT if ready else rule.FLUSH)
                ids = [rid for rid, _, _ in b.queue[:b.max_batch_size]]
                start_s = self.now_s()
                k = self.log.batch(ids, start_s, 0, trigger)
                try:
                    done = [(r["id"], r["output"]) for r in b.process_batch()]
                except Exception as e:  # the naive batcher loses the whole batch
                    done = [(rid, e) for rid in ids]
                    self.log.failed.append((ids, self.now_s()))
                self.log.batches[k][2] = self.now_s()
                for rid, out in done:
                    fut = self.futures.pop(rid)
                    if fut.done():  # cancelled by its caller
                        continue
                    if isinstance(out, BaseException):
                        fut.set_exception(out)
                    else:
                        fut.set_result(out)
            await asyncio.sleep(self.poll_s)
