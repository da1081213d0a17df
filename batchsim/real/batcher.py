"""DynamicBatcher: an asyncio dynamic batcher serving a PyTorch model, by the one rule.

Requests wait in one FIFO queue on the event loop. Every change that could let a batch
go (a first waiter, a full queue, a worker finishing, the oldest request's wait running
out, ``close()``) asks for one decision, and the decision calls ``batchsim.policy`` --
the same functions the simulator calls -- so the real batcher and the simulator cannot
disagree about when a batch leaves or what it holds.

The model runs off the event loop, in one thread per worker, so the loop keeps
accepting requests while the model works; with ``workers=k`` up to ``k`` batches are in
flight. Each worker copies its batch into a preallocated staging buffer (pinned on
CUDA), moves it to the device with one non-blocking copy on the worker's own CUDA
stream (so one worker's copy overlaps another's compute), brings the output back with
one copy, and hands the whole batch back to the loop with one callback.

Failures stay with the requests that cause them: a model exception (or a CUDA
out-of-memory error) splits the batch in halves and retries each, down to single
requests. Every request ends exactly one way: a result, or an exception (its own
model error, ``TimeoutError``, ``QueueFullError``, ``BatcherClosedError``), or
cancellation by its caller; ``result()`` then returns the run as a ``RunResult``.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import queue
import threading
import time
from collections import deque
from dataclasses import replace

import numpy as np
import torch

from .. import _check
from .. import policy as rule
from ..policy import BatchPolicy
from ..result import RunRecorder, RunResult
from .models import InputSpec, resolve_device


class QueueFullError(RuntimeError):
    """The waiting queue already held ``max_queue_size`` requests: rejected at once."""


class BatcherClosedError(RuntimeError):
    """The batcher is closed (or closed without draining before this request ran)."""


class RunLog:
    """What happened to every request and batch, in order; frozen into a RunResult.

    Times are seconds on the caller's clock. Shared by DynamicBatcher and the load
    generator's driver of the naive batcher.
    """

    def __init__(self):
        self.arrival_s: list[float] = []
        self.batches: list[list] = []      # [ids, start_s, end_s, worker, trigger]
        self.rejected: list[int] = []
        self.expired: list[tuple] = []     # (ids, now_s)
        self.failed: list[tuple] = []      # (ids, now_s)

    def batch(self, ids, start_s: float, worker: int, trigger: int) -> int:
        self.batches.append([ids, start_s, math.nan, worker, trigger])
        return len(self.batches) - 1

    def result(self, workers: int, **meta) -> RunResult:
        rec = RunRecorder(np.asarray(self.arrival_s, float), workers)
        for i in self.rejected:
            rec.reject(i)
        for ids, now_s in self.expired:
            rec.expire(ids, now_s)
        for ids, start_s, end_s, worker, trigger in self.batches:
            rec.dispatch(ids, start_s, end_s, worker, trigger)
        for ids, now_s in self.failed:
            rec.fail(ids, now_s)
        return rec.result(**meta)


class DynamicBatcher:
    """Serve ``model_fn`` (batched tensor in, batched tensor out) under ``policy``.

    ``input_spec`` (shape without the batch dimension, dtype) checks every request;
    left out, it is the model's ``input_spec`` attribute (zoo models have one), else the
    first request fixes it. ``device``: where the model runs (default: the device of
    the model's parameters, else CPU); inputs arrive on the CPU and outputs go back to
    it. Use it inside a running event loop::

        async with DynamicBatcher(model, BatchPolicy(32, 5.0)) as batcher:
            y = await batcher.submit(x)
        res = batcher.result()
    """

    def __init__(self, model_fn, policy: BatchPolicy, workers: int = 1, device=None,
                 input_spec: InputSpec | None = None):
        if not callable(model_fn):
            raise ValueError(f"model_fn must be callable, got {model_fn!r}")
        if not isinstance(policy, BatchPolicy):
            raise ValueError(f"policy must be a BatchPolicy, got {policy!r}")
        spec = input_spec if input_spec is not None else getattr(model_fn, "input_spec", None)
        if spec is not None and not isinstance(spec, InputSpec):
            raise ValueError(f"input_spec must be an InputSpec, got {spec!r}")
        if device is None and isinstance(model_fn, torch.nn.Module):
            device = next((p.device for p in model_fn.parameters()), None)
        self.model_fn = model_fn
        self.policy = policy
        self.workers = _check.positive_int("workers", workers)
        self.device = resolve_device(device)
        self.input_spec = spec
        self._loop: asyncio.AbstractEventLoop | None = None
        self._t0 = 0.0
        self._closed = False
        self._close_s = math.inf
        self._log = RunLog()
        self._waiting: deque = deque()     # (request id, input, future, policy or None)
        self._free: list[int] = []         # heap of free worker numbers
        self._in_flight = 0
        self._deciding = False
        self._timer = None
        self._timer_s = math.nan
        self._idle: asyncio.Future | None = None
        self._workers: list[_Worker] = []
        self._timeout_policies: dict[float, BatchPolicy] = {}

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> DynamicBatcher:
        """Start the worker threads; bind to the running event loop; the clock starts."""
        if self._loop is not None:
            raise RuntimeError("this DynamicBatcher was already started; make a new one")
        self._loop = asyncio.get_running_loop()
        self._workers = [_Worker(self, w) for w in range(self.workers)]
        self._free = list(range(self.workers))
        self._t0 = time.perf_counter()
        return self

    async def __aenter__(self) -> DynamicBatcher:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close(drain=True)

    @property
    def max_batch_size(self) -> int:
        return self.policy.max_batch_size

    def now_s(self) -> float:
        """Seconds since ``start()`` on the batcher's monotonic clock (``perf_counter``)."""
        return time.perf_counter() - self._t0

    async def close(self, drain: bool = True) -> None:
        """Stop accepting requests; finish the queued ones (``drain``) or fail them.

        With ``drain=True`` waiting requests are flushed in partial batches as workers
        free up; with ``drain=False`` they fail with ``BatcherClosedError``. Batches
        already running always finish. Returns when every request has ended and the
        worker threads have stopped.
        """
        if self._loop is None:
            raise RuntimeError("close() before start(): nothing to close")
        if not self._closed:
            self._closed = True
            self._close_s = self.now_s()
            self._idle = self._loop.create_future()
            if not drain:
                self._fail_waiting(self._close_s)
            self._decide()
        await asyncio.shield(self._idle)
        for worker in self._workers:
            worker.stop()

    def result(self) -> RunResult:
        """The run so far as a RunResult (times in seconds since ``start()``).

        Only once ``close()`` has returned, so that every request has ended.
        """
        if self._idle is None or not self._idle.done():
            raise RuntimeError("result() needs a closed batcher: await batcher.close() first")
        return self._log.result(self.workers, engine="real", policy=self.policy,
                                device=str(self.device), close_s=self._close_s,
                                model=_name(self.model_fn))

    # -- submitting ------------------------------------------------------------------
    async def submit(self, x, timeout_ms: float | None = None):
        """Queue one input (a tensor of the input spec's shape) and return its output."""
        return await self.submit_nowait(x, timeout_ms)

    def submit_nowait(self, x, timeout_ms: float | None = None) -> asyncio.Future:
        """Queue one input and return an ``asyncio.Future`` of its output at once.

        For callers on the event loop's thread that want to avoid one coroutine per
        request (load generators). Raises ``ValueError`` for an input that does not fit
        the spec, ``QueueFullError`` when ``max_queue_size`` requests already wait and
        ``BatcherClosedError`` after ``close()``. ``timeout_ms`` overrides the policy's
        ``timeout_ms`` for this request: if it has waited longer when its batch is
        formed, its future fails with ``TimeoutError`` and it never runs (by the rule,
        expiry is checked when a batch is formed, so that is when the error comes).
        """
        if self._closed or self._loop is None:
            raise BatcherClosedError("submit after close(): the batcher accepts no requests"
                                     if self._closed else
                                     "submit before start(): await batcher.start() first")
        if type(x) is not torch.Tensor:
            x = self._as_tensor(x)
        spec = self.input_spec
        if spec is None or x.shape != spec.shape or x.dtype != spec.dtype:
            self._check_input(x)
        now = time.perf_counter() - self._t0
        waiting = self._waiting
        n = len(waiting)
        arrivals = self._log.arrival_s
        rid = len(arrivals)
        arrivals.append(now)
        if rule.rejects(self.policy, n):
            self._log.rejected.append(rid)
            raise QueueFullError(f"queue full: {n} requests waiting "
                                 f"(max_queue_size={self.policy.max_queue_size})")
        fut = self._loop.create_future()
        waiting.append((rid, x, fut, self._expiry_policy(timeout_ms)))
        if (n == 0 or n + 1 >= self.policy.max_batch_size) and self._free:
            self._ask_for_decision()
        return fut

    def submit_threadsafe(self, x, timeout_ms: float | None = None):
        """From another thread: queue ``x``; returns a ``concurrent.futures.Future``."""
        if self._loop is None:
            raise BatcherClosedError("submit before start(): await batcher.start() first")
        return asyncio.run_coroutine_threadsafe(self.submit(x, timeout_ms), self._loop)

    @staticmethod
    def _as_tensor(x):
        if isinstance(x, torch.Tensor):
            return x
        if isinstance(x, np.ndarray):
            return torch.from_numpy(x)
        raise ValueError(f"x must be a torch.Tensor or numpy array, got {type(x).__name__}")

    def _check_input(self, x) -> None:
        spec = self.input_spec
        if spec is None:
            self.input_spec = InputSpec(tuple(x.shape), x.dtype)
            return
        raise ValueError(f"x must have shape {tuple(spec.shape)} and dtype {spec.dtype} "
                         f"(the model's input spec), got shape {tuple(x.shape)} and dtype "
                         f"{x.dtype}")

    def _expiry_policy(self, timeout_ms) -> BatchPolicy | None:
        """The policy whose ``timeout_ms`` applies to a request (None: it never expires)."""
        if timeout_ms is None:
            return self.policy if self.policy.timeout_ms is not None else None
        pol = self._timeout_policies.get(timeout_ms)
        if pol is None:
            pol = replace(self.policy, timeout_ms=timeout_ms)
            self._timeout_policies[timeout_ms] = pol
        return pol

    # -- deciding, by the rule -----------------------------------------------------------
    def _ask_for_decision(self, *_):
        """Decide once, after the other callbacks of this loop iteration (like the DES)."""
        if not self._deciding:
            self._deciding = True
            self._loop.call_soon(self._decide)

    def _decide(self) -> None:
        self._deciding = False
        waiting, free, pol = self._waiting, self._free, self.policy
        arrivals = self._log.arrival_s
        max_b = pol.max_batch_size
        while free and waiting:
            now = self.now_s()
            n = len(waiting)
            oldest_s = arrivals[waiting[0][0]]
            full_s = arrivals[waiting[max_b - 1][0]] if n >= max_b else math.inf
            t = rule.dispatch_time_s(pol, now, oldest_s, full_s, self._close_s)
            if t > now:
                self._set_timer(t, now)
                break
            trigger = rule.trigger(pol, now, n, oldest_s)
            ids, xs, futs = self._take(now)
            if ids:
                worker = heapq.heappop(free)
                k = self._log.batch(ids, now, worker, trigger)
                self._in_flight += 1
                self._workers[worker].inbox.put((k, xs, futs))
        self._check_idle()

    def _set_timer(self, t_s: float, now_s: float) -> None:
        """Decide again at ``t_s`` (never, if infinite: only an arrival or close can help)."""
        if t_s != self._timer_s:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_s = t_s
            self._timer = (None if math.isinf(t_s)
                           else self._loop.call_later(t_s - now_s, self._on_timer))

    def _on_timer(self) -> None:
        self._timer, self._timer_s = None, math.nan
        self._decide()

    def _take(self, now_s: float):
        """Form a batch: drop ended requests from the head, then take the rule's count.

        Cancelled requests and expired ones (waited past their timeout) leave the
        queue here; among the requests taken, any that ended meanwhile are skipped.
        """
        waiting = self._waiting
        while waiting and self._ended(waiting[0], now_s):
            waiting.popleft()
        ids, xs, futs = [], [], []
        for _ in range(rule.batch_size(self.policy, len(waiting))):
            item = waiting.popleft()
            rid, x, fut, pol = item
            if (pol is not None or fut.done()) and self._ended(item, now_s):
                continue
            ids.append(rid)
            xs.append(x)
            futs.append(fut)
        return ids, xs, futs

    def _ended(self, item, now_s: float) -> bool:
        """Whether a waiting request is cancelled or expired (and record it so)."""
        rid, _, fut, pol = item
        if fut.done():
            self._log.failed.append(([rid], now_s))
            return True
        arrival_s = self._log.arrival_s[rid]
        if pol is not None and rule.expired(pol, arrival_s, now_s):
            self._log.expired.append(([rid], now_s))
            fut.set_exception(TimeoutError(
                f"request waited {1000 * (now_s - arrival_s):.3f} ms, past its timeout of "
                f"{pol.timeout_ms} ms, before its batch was formed; it never ran"))
            return True
        return False

    def _fail_waiting(self, now_s: float) -> None:
        ids = []
        while self._waiting:
            rid, _, fut, _ = self._waiting.popleft()
            ids.append(rid)
            if not fut.done():
                fut.set_exception(BatcherClosedError(
                    "batcher closed with drain=False before this request ran"))
        if ids:
            self._log.failed.append((ids, now_s))

    def _check_idle(self) -> None:
        if (self._idle is not None and not self._idle.done() and not self._waiting
                and not self._in_flight):
            if self._timer is not None:
                self._timer.cancel()
            self._idle.set_result(None)

    # -- results back from the workers (one callback per batch) ---------------------------
    def _finished(self, worker: int, k: int, futs, outs, failed: list[int], end_s: float):
        batch = self._log.batches[k]
        batch[2] = end_s
        lost = []  # cancelled by their callers meanwhile, or failed in the model
        for i, fut in enumerate(futs):
            if fut.done():
                lost.append(i)
            elif failed and isinstance(outs[i], BaseException):
                fut.set_exception(outs[i])
                lost.append(i)
            else:
                fut.set_result(outs[i])
        if lost:
            ids = batch[0]
            self._log.failed.append(([ids[i] for i in lost], end_s))
        self._in_flight -= 1
        heapq.heappush(self._free, worker)
        self._decide()


def _name(model_fn) -> str:
    return getattr(model_fn, "zoo_name", None) or getattr(model_fn, "__name__",
                                                          type(model_fn).__name__)


class _Worker:
    """One thread that runs batches: staging copy, device copy, model, copy back."""

    def __init__(self, batcher: DynamicBatcher, index: int):
        self.batcher = batcher
        self.index = index
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.cuda = batcher.device.type == "cuda"
        self.staging = self.device_in = None
        self.stream = torch.cuda.Stream(batcher.device) if self.cuda else None
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"batchsim-worker-{index}")
        self.thread.start()

    def stop(self) -> None:
        self.inbox.put(None)
        self.thread.join()

    def _run(self) -> None:
        b = self.batcher
        with torch.no_grad(), torch.cuda.stream(self.stream):
            while (job := self.inbox.get()) is not None:
                k, xs, futs = job
                outs, failed = self._serve(xs)
                end_s = b.now_s()
                try:
                    b._loop.call_soon_threadsafe(b._finished, self.index, k, futs, outs,
                                                 failed, end_s)
                except RuntimeError:  # the event loop is gone: nobody waits any more
                    return

    def _serve(self, xs):
        """``(outputs, failed positions)``; on an error, split and retry the halves."""
        try:
            return self._forward(xs).unbind(0), []
        except Exception as e:
            if len(xs) == 1:
                return [e], [0]
            if self.cuda and isinstance(e, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
            half = len(xs) // 2
            outs_a, failed_a = self._serve(xs[:half])
            outs_b, failed_b = self._serve(xs[half:])
            return [*outs_a, *outs_b], failed_a + [half + i for i in failed_b]

    def _forward(self, xs) -> torch.Tensor:
        """Run one batch; the output is a fresh CPU tensor of ``len(xs)`` rows."""
        if self.staging is None:
            self._allocate()
        n = len(xs)
        host_in = self.staging[:n]
        torch.stack(xs, out=host_in)
        if self.cuda:
            dev_in = self.device_in[:n]
            dev_in.copy_(host_in, non_blocking=True)
            out = self._checked(self.batcher.model_fn(dev_in), n)
            host_out = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            host_out.copy_(out, non_blocking=True)
            self.stream.synchronize()
        else:
            out = self.batcher.model_fn(host_in.to(self.batcher.device))
            host_out = self._checked(out, n).cpu()
            if host_out.untyped_storage().data_ptr() == self.staging.untyped_storage().data_ptr():
                host_out = host_out.clone()  # the output aliases the staging buffer
        return host_out

    @staticmethod
    def _checked(out, n: int) -> torch.Tensor:
        if not isinstance(out, torch.Tensor) or out.ndim == 0 or out.shape[0] != n:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise TypeError(f"model_fn must return a tensor with one row per input: got "
                            f"{got} for a batch of {n}")
        return out

    def _allocate(self) -> None:
        b = self.batcher
        shape = (b.policy.max_batch_size, *b.input_spec.shape)
        if self.cuda:
            self.device_in = torch.empty(shape, dtype=b.input_spec.dtype, device=b.device)
        self.staging = torch.empty(shape, dtype=b.input_spec.dtype, pin_memory=self.cuda)
