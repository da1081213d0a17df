"""DynamicBatcher: an asyncio dynamic batcher serving a PyTorch model, by the one rule.

Requests wait in one FIFO queue on the event loop. Every change that could let a batch
go (a first waiter, a full queue, a worker finishing, the oldest request's wait running
out, ``close()``) asks for one decision, and the decision calls ``batchsim.policy`` --
the same functions the simulator calls -- so the real batcher and the simulator cannot
disagree about when a batch leaves or what it holds.

The model runs off the event loop, so the loop keeps accepting requests while the model
works; with ``workers=k`` up to ``k`` batches are in flight, each worker with its own
preallocated staging buffer (pinned on CUDA) and, on CUDA, its own stream. Results go
back to the loop with one callback per batch.

How the batches run depends on the device, because Python threads share one lock (the
GIL), every PyTorch call hands it over, and each hand-over to a waiting thread costs a
thread wake-up:

* CPU: a thread per worker stacks its batch into its staging buffer and runs the model;
  the model's arithmetic releases the GIL, so the workers compute in parallel.
* CUDA: a model call only *launches* kernels, mostly Python, so worker threads
  launching side by side pass the GIL back and forth at every layer. Instead each batch
  goes down a pipeline: its worker's stager thread stacks the inputs into the worker's
  pinned staging buffer (the only bulk host copy; stagers of different workers copy in
  parallel, each single-threaded), one launcher thread -- the only one that calls the
  model, back to back like an offline loop -- enqueues on the worker's stream a
  non-blocking copy to the device, the model, a non-blocking copy back into pinned
  memory and a completion event, and one completer thread waits for the events and
  hands the results back. The copy of one batch overlaps the launch of another and the
  GPU runs them on their own streams; the only device synchronisation is the event.
  ``pipeline=False`` runs CUDA batches on a thread per worker instead.

CUDA graphs (``cuda_graphs``, on by default on CUDA when the input spec is known at
``start()``): a model call launches dozens of kernels, each a few microseconds of Python
holding the GIL, so a small model is launch-bound. At start-up every worker captures the
model once per batch-size bucket (``graph_buckets``: powers of two, and max_batch_size)
on its stream and its device input buffer; a batch of ``n`` then runs as the smallest
bucket ``>= n`` -- the pad rows hold whatever the buffer held, are computed and dropped
-- by one graph replay, one host call. The model must treat rows independently (batching
needs that anyway) and be capturable (no host synchronisation, no data-dependent control
flow); when a capture fails, that worker runs the model eagerly and ``result().meta
["cuda_graphs"]`` says why.

Failures stay with the requests that cause them: a model exception (or a CUDA
out-of-memory error) splits the batch in halves and retries each, down to single
requests. Every request ends exactly one way: a result, or an exception (its own
model error, ``TimeoutError``, ``QueueFullError``, ``BatcherClosedError``), or
cancellation by its caller; ``result()`` then returns the run as a ``RunResult``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import math
import queue
import threading
import time
from bisect import bisect_left
from collections import deque
from dataclasses import replace

import numpy as np
import torch

from .. import _check
from .. import policy as rule
from ..cpus import checked_thread_cpus, on_cpu
from ..policy import BatchPolicy
from ..result import RunRecorder, RunResult
from .models import InputSpec, model_device

_done = asyncio.Future.done


class QueueFullError(RuntimeError):
    """The waiting queue already held ``max_queue_size`` requests: rejected at once."""


class BatcherClosedError(RuntimeError):
    """The batcher is closed (or closed without draining before this request ran)."""


class RunLog:
    """What happened to every request and batch, in order; frozen into a RunResult.

    Times are seconds on the caller's clock. Shared by DynamicBatcher and the load
    generator's driver of the naive batcher. A batch may carry the instants its worker
    picked it up, had staged its inputs and had launched the model (``phases``); the
    result's ``meta["batch_phases_s"]`` holds them, one row per batch.
    """

    def __init__(self):
        self.arrival_s: list[float] = []
        self.batches: list[list] = []      # [ids, start_s, end_s, worker, trigger, phases]
        self.rejected: list[int] = []
        self.expired: list[tuple] = []     # (ids, now_s)
        self.failed: list[tuple] = []      # (ids, now_s)

    def batch(self, ids, start_s: float, worker: int, trigger: int) -> int:
        self.batches.append([ids, start_s, math.nan, worker, trigger, None])
        return len(self.batches) - 1

    def result(self, workers: int, **meta) -> RunResult:
        rec = RunRecorder(np.asarray(self.arrival_s, float), workers)
        for i in self.rejected:
            rec.reject(i)
        for ids, now_s in self.expired:
            rec.expire(ids, now_s)
        for ids, start_s, end_s, worker, trigger, _ in self.batches:
            rec.dispatch(ids, start_s, end_s, worker, trigger)
        for ids, now_s in self.failed:
            rec.fail(ids, now_s)
        phases = [b[5] or (math.nan,) * 3 for b in self.batches]
        if any(b[5] for b in self.batches):
            meta["batch_phases_s"] = np.asarray(phases, float).reshape(-1, 3)
        return rec.result(**meta)


class DynamicBatcher:
    """Serve ``model_fn`` (batched tensor in, batched tensor out) under ``policy``.

    ``input_spec`` (shape without the batch dimension, dtype) checks every request;
    left out, it is the model's ``input_spec`` attribute (zoo models have one), else the
    first request fixes it. ``device``: where the model runs (default: the device of
    the model's parameters, else CPU); inputs arrive on the CPU and outputs go back to
    it. ``pipeline``: run batches through the stage/launch/complete pipeline of threads
    rather than a thread per worker (default: on CUDA only; see the module doc).
    ``cuda_graphs``: replay the model from CUDA graphs captured at ``start()``
    (default: on CUDA when the input spec is known; see the module doc).
    ``thread_cpus``: CPUs to pin the batcher's own threads to, one each in their order
    (a pipeline's stagers, then its launcher and its completer; else a thread per
    worker), in turn when there are more threads than CPUs; the event loop runs on the
    caller's thread, wherever the caller put it. Left out, it is the CPUs the
    environment variable ``BATCHSIM_THREAD_CPUS`` lists
    (``batchsim.cpus.THREAD_CPUS_ENV``, comma-separated; the benches' ``--pin-threads``
    sets it, so that the batchers ``calibrate`` and ``fidelity`` make are pinned too),
    else none: the OS places the threads, and each batcher may land differently. On an
    H200 the encoder's batches under one batcher spent up to twice as long as under
    another, same configuration, between dispatch and launch (the threads' part), while
    the part from launch to the end moved little (``bench/results/README.md``). Linux
    only. Use it inside a running event loop::

        async with DynamicBatcher(model, BatchPolicy(32, 5.0)) as batcher:
            y = await batcher.submit(x)
        res = batcher.result()
    """

    def __init__(self, model_fn, policy: BatchPolicy, workers: int = 1, device=None,
                 input_spec: InputSpec | None = None, *, pipeline: bool | None = None,
                 cuda_graphs: bool | None = None, thread_cpus=None):
        if not callable(model_fn):
            raise ValueError(f"model_fn must be callable, got {model_fn!r}")
        if not isinstance(policy, BatchPolicy):
            raise ValueError(f"policy must be a BatchPolicy, got {policy!r}")
        spec = input_spec if input_spec is not None else getattr(model_fn, "input_spec", None)
        if spec is not None and not isinstance(spec, InputSpec):
            raise ValueError(f"input_spec must be an InputSpec, got {spec!r}")
        self.model_fn = model_fn
        self.policy = policy
        self.workers = _check.positive_int("workers", workers)
        self.device = model_device(model_fn, device)
        if pipeline is not None and not isinstance(pipeline, bool):
            raise ValueError(f"pipeline must be True, False or None, got {pipeline!r}")
        self.pipeline = self.device.type == "cuda" if pipeline is None else pipeline
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be True, False or None, got {cuda_graphs!r}")
        self.cuda_graphs = cuda_graphs
        self.thread_cpus = checked_thread_cpus(thread_cpus)
        self._graphs_meta: dict | None = None
        self.input_spec = spec
        self._loop: asyncio.AbstractEventLoop | None = None
        self._t0 = 0.0
        self._started_unix_s = math.nan
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
        self._runner: _Runner | None = None
        self._timeout_policies: dict[float, BatchPolicy] = {}

    # -- lifecycle -------------------------------------------------------------------
    async def start(self, warmup: bool = False) -> DynamicBatcher:
        """Start the worker threads and bind to the running event loop; the clock starts.

        ``warmup=True`` (needs a known input spec) first runs a batch of zeros of every
        size from ``max_batch_size`` down to 1 through every worker, so that one-time
        costs (buffer allocation, a thread's first use of cuBLAS/cuDNN on its stream,
        allocator growth, the kernels a library prepares for each new input shape) are
        paid before the first request; it is not part of the run. On the CPU a batch
        size's first run took 2.2x its later ones for the tiny CNN and 1.6x for the tiny
        MLP: in a calibration that warmed only the largest size, the first batch of each
        size. With CUDA graphs on, the warm-up always runs, at the graphs' bucket sizes
        only (``warmup_sizes``), and captures the graphs after it.
        """
        if self._loop is not None:
            raise RuntimeError("this DynamicBatcher was already started; make a new one")
        self._loop = asyncio.get_running_loop()
        self._runner = self._make_runner()
        self._free = list(range(self.workers))
        capture = self._graphs_wanted()
        if (warmup or capture) and self.input_spec is not None:
            t0 = time.perf_counter()
            errors = await self._runner.warmup(capture)
            if capture:
                self._graphs_meta.update(
                    capture_s=time.perf_counter() - t0, errors=[e for e in errors if e],
                    workers_with_graphs=sum(e is None for e in errors))
        self._t0 = time.perf_counter()
        self._started_unix_s = time.time()
        return self

    def _graphs_wanted(self) -> bool:
        """Whether to capture CUDA graphs at start; says why not in ``_graphs_meta``."""
        want = self.device.type == "cuda" if self.cuda_graphs is None else self.cuda_graphs
        if not want:
            return False
        self._graphs_meta = {"buckets": list(graph_buckets(self.policy.max_batch_size))}
        reason = ("the input spec is unknown at start()" if self.input_spec is None else
                  None if self._runner.steps.can_capture else
                  f"no graph capture on {self.device.type}")
        if reason is not None:
            self._graphs_meta.update(workers_with_graphs=0, errors=[reason])
        return reason is None

    def _make_runner(self) -> _Runner:
        runner = _PipelineRunner if self.pipeline else _ThreadRunner
        return runner(self, self._make_steps())

    def _make_steps(self) -> _HostSteps:
        return (_CudaSteps if self.device.type == "cuda" else _HostSteps)(self)

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
        self._runner.stop()

    def result(self) -> RunResult:
        """The run so far as a RunResult (times in seconds since ``start()``).

        ``meta["started_unix_s"]`` is that start on the wall clock (``time.time()``), to
        line the run up with what other tools log by the wall clock, such as a GPU's
        clocks sampled by ``nvidia-smi`` (``bench/bench_gpu_clocks.py``). Only once
        ``close()`` has returned, so that every request has ended.
        """
        if self._idle is None or not self._idle.done():
            raise RuntimeError("result() needs a closed batcher: await batcher.close() first")
        extra = {} if self._graphs_meta is None else {"cuda_graphs": self._graphs_meta}
        if self.thread_cpus is not None:
            extra["thread_cpus"] = {t.name.removeprefix("batchsim-"): cpu for t, cpu
                                    in zip(self._runner.threads, self._runner.cpus, strict=True)}
        return self._log.result(self.workers, engine="real", policy=self.policy,
                                device=str(self.device), close_s=self._close_s,
                                started_unix_s=self._started_unix_s,
                                model=_name(self.model_fn), **extra)

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
        pol = self.policy
        if rule.rejects(pol, n):
            self._log.rejected.append(rid)
            raise QueueFullError(f"queue full: {n} requests waiting "
                                 f"(max_queue_size={pol.max_queue_size})")
        fut = self._loop.create_future()
        waiting.append((rid, x, fut, self._expiry_policy(timeout_ms)
                        if timeout_ms is not None or pol.timeout_ms is not None else None))
        if (n == 0 or n + 1 >= pol.max_batch_size) and self._free:
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

    def _expiry_policy(self, timeout_ms) -> BatchPolicy:
        """The policy whose ``timeout_ms`` applies to a request that may expire."""
        if timeout_ms is None:
            return self.policy
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
                self._runner.put(worker, k, xs, futs)
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
        take = waiting.popleft
        items = [take() for _ in range(rule.batch_size(self.policy, len(waiting)))]
        if items:
            ids, xs, futs, pols = zip(*items, strict=True)
            if pols.count(None) < len(pols) or any(map(_done, futs)):
                items = [item for item in items if not self._ended(item, now_s)]
                ids, xs, futs, _ = zip(*items, strict=True) if items else ((), (), (), ())
            return list(ids), xs, futs
        return [], (), ()

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
    def _finished(self, worker: int, k: int, futs, outs, failed: list[int], end_s: float,
                  phases=None):
        batch = self._log.batches[k]
        batch[2] = end_s
        batch[5] = phases
        if not failed and not any(map(_done, futs)):
            for fut, out in zip(futs, outs, strict=True):
                fut.set_result(out)
        else:  # some were cancelled by their callers meanwhile, or failed in the model
            lost = []
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


def _checked(out, n: int) -> torch.Tensor:
    if not isinstance(out, torch.Tensor) or out.ndim == 0 or out.shape[0] != n:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(f"model_fn must return a tensor with one row per input: got "
                        f"{got} for a batch of {n}")
    return out


def graph_buckets(max_batch_size: int) -> tuple[int, ...]:
    """The batch sizes captured as CUDA graphs: powers of two below max_batch_size, and it."""
    b = _check.positive_int("max_batch_size", max_batch_size)
    return (*(1 << i for i in range(b.bit_length()) if 1 << i < b), b)


def warmup_sizes(max_batch_size: int, graphs: bool) -> tuple[int, ...]:
    """The batch sizes a warm-up runs, the largest first: every size from
    ``max_batch_size`` down to 1, or with CUDA graphs to capture their buckets only.

    A size's first run in a process pays one-time costs (on the CPU 2.2x a later run for
    the tiny CNN). With graphs a batch of ``n`` replays the graph of its bucket, so the
    eager shapes between buckets never run again; on an H200 warming all 32 sizes before
    the capture took the encoder 1.3-2.5 s at every batcher start
    (``bench/results/README.md``).
    """
    return (tuple(reversed(graph_buckets(max_batch_size))) if graphs
            else tuple(range(_check.positive_int("max_batch_size", max_batch_size), 0, -1)))


#: Warm-ups and graph captures run one at a time: a capture synchronises the device and
#: empties the allocator's cache, which must not happen under another thread's capture.
_WARMUP_LOCK = threading.Lock()


class _Graphs:
    """A model captured once per batch-size bucket on one input buffer; replays by size.

    ``capture(x)`` (a view of the first rows of the buffer) returns ``(replay, out)``:
    calling ``replay()`` recomputes ``out`` from whatever the buffer's rows hold then.
    A batch of ``n`` rows, already in the buffer, runs as the smallest bucket ``>= n``;
    the output's first ``n`` rows are its answers, the pad rows are dropped. Captured
    largest first, so that the smaller graphs can reuse the larger one's memory pool.
    """

    def __init__(self, capture, static_in: torch.Tensor, buckets):
        self.buckets = tuple(sorted(buckets))
        self.replays = {b: capture(static_in[:b]) for b in reversed(self.buckets)}

    def bucket(self, n: int) -> int:
        return self.buckets[bisect_left(self.buckets, n)]

    def __call__(self, n: int) -> torch.Tensor:
        replay, out = self.replays[self.bucket(n)]
        replay()
        return out[:n]


def _single_threaded_ops() -> None:
    """Make the calling thread's CPU ops single-threaded; other threads keep their count.

    For the staging copy: ATen copies each input of more than 32K elements as its own
    OpenMP parallel region, and a few threads doing that at once oversubscribe the
    cores (a 16 MB stack of 128 KB inputs took 31 ms with 2 OpenMP threads and 7 ms
    with 1, on a busy 2-core machine), while one plain copy per thread, several threads
    in parallel, is as fast as memory allows. With OpenMP, ``torch.set_num_threads``
    sets the calling thread's count and the default that threads take on their first
    parallel op; a helper thread puts that default back.
    """
    n = torch.get_num_threads()  # fixes this thread's count first, so the next call sticks
    if n > 1:
        torch.set_num_threads(1)
        helper = threading.Thread(target=torch.set_num_threads, args=(n,))
        helper.start()
        helper.join()


class _Slot:
    """One worker's buffers: staging (host), device input, CUDA stream and event, graphs."""

    def __init__(self, stream=None, event=None):
        self.staging = self.device_in = None
        self.stream, self.event = stream, event
        self.graphs: _Graphs | None = None
        self.pool = None  # the memory pool its graphs share


class _HostSteps:
    """How one batch runs on the CPU (or another device the model copies to itself).

    ``launch`` starts a staged batch and returns its output (here: runs it to the
    end), ``wait`` waits for the worker's batch in flight, ``recover`` cleans up after
    an error. ``_CudaSteps`` makes ``launch`` asynchronous. ``capture`` (where
    ``can_capture``) records one graph of the model for ``capture_graphs``.
    """

    pinned = False
    can_capture = False

    def __init__(self, batcher: DynamicBatcher):
        self.batcher = batcher
        self.model_fn = batcher.model_fn

    def new_slot(self) -> _Slot:
        return _Slot()

    def thread_started(self) -> None:
        """Called first in every runner thread that stages batches."""

    def stage(self, slot: _Slot, xs) -> torch.Tensor:
        """Stack the inputs into the slot's staging buffer (one copy for the batch)."""
        if slot.staging is None:
            self.allocate(slot)
        host_in = slot.staging[:len(xs)]
        torch.stack(xs, out=host_in)
        return host_in

    def allocate(self, slot: _Slot) -> None:
        b = self.batcher
        shape = (b.policy.max_batch_size, *b.input_spec.shape)
        slot.staging = torch.empty(shape, dtype=b.input_spec.dtype, pin_memory=self.pinned)

    def graph_input(self, slot: _Slot) -> torch.Tensor:
        """The buffer a batch's model input is a view of (what graphs are captured on)."""
        return slot.staging

    def forward(self, slot: _Slot, x: torch.Tensor) -> torch.Tensor:
        """The model on ``x``, the first rows of the graph input: a replay if captured."""
        if slot.graphs is not None:
            return slot.graphs(len(x))
        return _checked(self.model_fn(x), len(x))

    def capture(self, slot: _Slot, x: torch.Tensor):
        raise NotImplementedError(f"no graph capture on {self.batcher.device.type}")

    def capture_graphs(self, slot: _Slot) -> str | None:
        """Capture the model per bucket for this slot; else why not (it then runs eagerly)."""
        try:
            if slot.staging is None:
                self.allocate(slot)
            slot.graphs = _Graphs(lambda x: self.capture(slot, x), self.graph_input(slot),
                                  graph_buckets(self.batcher.policy.max_batch_size))
            return None
        except Exception as e:
            slot.graphs = slot.pool = None
            self.recover(slot, e)
            return f"capture failed, eager: {type(e).__name__}: {e}"

    def launch(self, slot: _Slot, host_in: torch.Tensor) -> torch.Tensor:
        """Run the model; the output is a CPU tensor that aliases no buffer of the slot."""
        out = self.forward(slot, host_in.to(self.batcher.device)).cpu()
        if (slot.graphs is not None or out.untyped_storage().data_ptr()
                == slot.staging.untyped_storage().data_ptr()):
            out = out.clone()  # a graph's static output, or (a view of) the staging buffer
        return out

    def wait(self, slot: _Slot) -> None:
        pass

    def recover(self, slot: _Slot, error: Exception) -> None:
        pass


class _CudaSteps(_HostSteps):
    """On CUDA: pinned staging, and a stream and a completion event per worker."""

    pinned = True
    can_capture = True

    def new_slot(self) -> _Slot:
        device = self.batcher.device
        return _Slot(torch.cuda.Stream(device), torch.cuda.Event())

    def thread_started(self) -> None:
        """The model runs on the GPU: a thread's CPU work is copies, best done alone."""
        _single_threaded_ops()

    def allocate(self, slot: _Slot) -> None:
        super().allocate(slot)
        slot.device_in = torch.zeros(slot.staging.shape, dtype=slot.staging.dtype,
                                     device=self.batcher.device)  # finite pad rows

    def graph_input(self, slot: _Slot) -> torch.Tensor:
        return slot.device_in

    def capture(self, slot: _Slot, x: torch.Tensor):
        """One graph of the model on ``x``, on the slot's stream, in its shared pool.

        Two eager calls on that (side) stream first, as capture requires: lazy
        initialisations (cuBLAS workspaces, kernel choices for this shape) must not
        happen inside the capture.
        """
        torch.cuda.set_stream(slot.stream)
        for _ in range(2):
            self.model_fn(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=slot.pool, stream=slot.stream,
                              capture_error_mode="thread_local"):
            out = _checked(self.model_fn(x), len(x))
        slot.pool = graph.pool()
        return graph.replay, out

    def launch(self, slot: _Slot, host_in: torch.Tensor) -> torch.Tensor:
        """Enqueue on the slot's stream: copy in, model, copy back, completion event."""
        n = len(host_in)
        torch.cuda.set_stream(slot.stream)
        dev_in = slot.device_in[:n]
        dev_in.copy_(host_in, non_blocking=True)
        out = self.forward(slot, dev_in)
        host_out = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        host_out.copy_(out, non_blocking=True)
        slot.event.record(slot.stream)
        return host_out

    def wait(self, slot: _Slot) -> None:
        slot.event.synchronize()

    def recover(self, slot: _Slot, error: Exception) -> None:
        """Let what the failed launch enqueued finish (its staging may still be read)."""
        try:
            slot.stream.synchronize()
            if isinstance(error, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
        except Exception:
            pass  # a broken context fails every retry, one request at a time


class _Runner:
    """Runs a DynamicBatcher's batches off the event loop; one ``_Slot`` per worker.

    ``steps`` say what the device does with a batch; subclasses say which threads do
    it (``_threads``, ``put``). Results go back with one ``call_soon_threadsafe`` per
    batch, with the instants the batch was picked up, staged and launched.
    """

    def __init__(self, batcher: DynamicBatcher, steps: _HostSteps):
        self.batcher = batcher
        self.steps = steps
        self.slots = [steps.new_slot() for _ in range(batcher.workers)]
        runs = self._threads()
        cpus = batcher.thread_cpus
        self.cpus = [None if cpus is None else cpus[k % len(cpus)] for k in range(len(runs))]
        self.threads = [threading.Thread(target=on_cpu(run, cpu), daemon=True,
                                         name=f"batchsim-{name}")
                        for (name, run), cpu in zip(runs, self.cpus, strict=True)]
        for thread in self.threads:
            thread.start()

    def _threads(self):
        raise NotImplementedError

    def put(self, worker: int, k, xs, futs) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    async def warmup(self, capture: bool = False) -> list:
        """Run a batch of zeros of each of ``warmup_sizes`` through every worker; wait.

        ``capture``: then capture each worker's CUDA graphs. Returns, per worker, why
        its capture failed, or None.
        """
        spec, max_b = self.batcher.input_spec, self.batcher.policy.max_batch_size
        rows = torch.zeros((max_b, *spec.shape), dtype=spec.dtype).unbind(0)
        done = [concurrent.futures.Future() for _ in self.slots]
        for worker, fut in enumerate(done):
            self.put(worker, None, (rows, capture), fut)
        return await asyncio.gather(*map(asyncio.wrap_future, done))

    def _warm(self, slot: _Slot, job, done: concurrent.futures.Future) -> None:
        xs, capture = job
        with _WARMUP_LOCK:
            for b in warmup_sizes(len(xs), capture):
                if self._serve(slot, xs[:b])[1]:
                    break  # a model that cannot take zeros fails later, per request
            done.set_result(self.steps.capture_graphs(slot) if capture else None)

    def _serve(self, slot: _Slot, xs, error: Exception | None = None):
        """Run ``xs`` to the end: ``(outputs, failed positions)``.

        On an error (``error``: one already raised by this batch) split the batch and
        retry the halves, down to single requests, so that only the inputs that cause
        an error fail.
        """
        steps = self.steps
        if error is None:
            try:
                out = steps.launch(slot, steps.stage(slot, xs))
                steps.wait(slot)
                return out.unbind(0), []
            except Exception as e:
                error = e
        if len(xs) == 1:
            return [error], [0]
        steps.recover(slot, error)
        half = len(xs) // 2
        outs_a, failed_a = self._serve(slot, xs[:half])
        outs_b, failed_b = self._serve(slot, xs[half:])
        return [*outs_a, *outs_b], failed_a + [half + i for i in failed_b]

    def _report(self, worker: int, k: int, futs, outs, failed, phases) -> bool:
        """Hand a finished batch to the loop; False once the loop is gone."""
        b = self.batcher
        try:
            b._loop.call_soon_threadsafe(b._finished, worker, k, futs, outs, failed,
                                         b.now_s(), phases)
            return True
        except RuntimeError:  # the event loop is closed: nobody waits any more
            return False


class _ThreadRunner(_Runner):
    """A thread per worker runs each of its batches to the end (the CPU default)."""

    def __init__(self, batcher: DynamicBatcher, steps: _HostSteps):
        self.inboxes = [queue.SimpleQueue() for _ in range(batcher.workers)]
        super().__init__(batcher, steps)

    def _threads(self):
        return [(f"worker-{w}", lambda w=w: self._work(w)) for w in range(len(self.inboxes))]

    def put(self, worker: int, k, xs, futs) -> None:
        self.inboxes[worker].put((k, xs, futs))

    def stop(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for thread in self.threads:
            thread.join()

    def _work(self, worker: int) -> None:
        slot, inbox, now = self.slots[worker], self.inboxes[worker], self.batcher.now_s
        self.steps.thread_started()
        with torch.no_grad():
            while (job := inbox.get()) is not None:
                k, xs, futs = job
                if k is None:
                    self._warm(slot, xs, futs)
                    continue
                picked = now()
                outs, failed = self._serve(slot, xs)
                if not self._report(worker, k, futs, outs, failed, (picked, math.nan, now())):
                    return


class _PipelineRunner(_Runner):
    """A pipeline of threads: stage (one per worker) -> launch (one) -> complete (one).

    A worker's stager stacks its batch into the worker's staging buffer (host copies of
    different workers run in parallel); the launcher -- the only thread that calls the
    model -- starts it (on CUDA ``launch`` returns before the device is done); the
    completer waits for each launched batch, in launch order, and reports. Queues join
    them. When a launch raises, the launcher finishes that batch itself, synchronously,
    by ``_serve``'s split-and-retry. The CUDA default.
    """

    def __init__(self, batcher: DynamicBatcher, steps: _HostSteps):
        self.inboxes = [queue.SimpleQueue() for _ in range(batcher.workers)]
        self.to_launch, self.to_complete = queue.SimpleQueue(), queue.SimpleQueue()
        super().__init__(batcher, steps)

    def _threads(self):
        return [*((f"stage-{w}", lambda w=w: self._stager(w))
                  for w in range(len(self.inboxes))),
                ("launch", self._launcher), ("complete", self._completer)]

    def put(self, worker: int, k, xs, futs) -> None:
        self.inboxes[worker].put((k, xs, futs))

    def stop(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for thread in self.threads[:-2]:
            thread.join()
        self.to_launch.put(None)
        for thread in self.threads[-2:]:
            thread.join()

    def _stager(self, worker: int) -> None:
        slot, inbox, now, stage = (self.slots[worker], self.inboxes[worker],
                                   self.batcher.now_s, self.steps.stage)
        self.steps.thread_started()
        while (job := inbox.get()) is not None:
            k, xs, futs = job
            picked, host_in, error = now(), None, None
            if k is not None:  # a warm-up batch is staged by the launcher
                try:
                    host_in = stage(slot, xs)
                except Exception as e:
                    error = e
            self.to_launch.put((worker, k, xs, futs, host_in, error, picked, now()))

    def _launcher(self) -> None:
        now, launch = self.batcher.now_s, self.steps.launch
        self.steps.thread_started()  # it stages warm-up and retried batches
        with torch.no_grad():
            while (job := self.to_launch.get()) is not None:
                worker, k, xs, futs, host_in, error, picked, staged = job
                slot = self.slots[worker]
                if k is None:
                    self._warm(slot, xs, futs)
                    continue
                out = failed = None
                if error is None:
                    try:
                        out = launch(slot, host_in)
                    except Exception as e:
                        error = e
                if error is not None:
                    out, failed = self._serve(slot, xs, error)
                self.to_complete.put((worker, k, futs, out, failed, (picked, staged, now())))
        self.to_complete.put(None)

    def _completer(self) -> None:
        wait = self.steps.wait
        while (item := self.to_complete.get()) is not None:
            worker, k, futs, out, failed, phases = item
            if failed is None:  # launched: wait for it
                try:
                    wait(self.slots[worker])
                    out, failed = out.unbind(0), []
                except Exception as e:  # an asynchronous device error fails the batch
                    out, failed = [e] * len(futs), list(range(len(futs)))
            if not self._report(worker, k, futs, out, failed, phases):
                return
