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

The batches run in threads (``batchsim.real.runners``): on the CPU a thread per worker
runs each batch to the end, and the workers compute in parallel; on CUDA each batch goes
down a pipeline of threads (stage, launch, complete) so that one thread alone calls the
model, and the model replays from CUDA graphs captured at ``start()`` (``cuda_graphs``,
on by default on CUDA when the input spec is known): a small model is otherwise bound by
the Python that launches its kernels. ``pipeline=False`` runs CUDA batches on a thread
per worker instead. The model must treat rows independently (batching needs that
anyway) and, for graphs, be capturable (no host synchronisation, no data-dependent
control flow); when a capture fails, that worker runs the model eagerly and
``result().meta["cuda_graphs"]`` says why.

Failures stay with the requests that cause them: a model exception (or a CUDA
out-of-memory error) splits the batch in halves and retries each, down to single
requests; an output without one row per input fails its whole batch at once. Every
request ends exactly one way: a result, or an exception (its own model error,
``RequestExpiredError``, ``QueueFullError``, ``BatcherClosedError``), or cancellation by
its caller; ``result()`` then returns the run as a ``RunResult``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import math
import time
import warnings
import weakref
from collections import deque
from dataclasses import replace

import numpy as np
import torch

from .. import _check
from .. import policy as rule
from ..cpus import checked_thread_cpus
from ..policy import BatchPolicy
from ..result import RunRecorder, RunResult
from .models import InputSpec, model_device
from .runners import (
    Clock,
    CudaSteps,
    HostSteps,
    PipelineRunner,
    Runner,
    ThreadRunner,
    graph_buckets,
    pinned_host_allocs,
)

_done = asyncio.Future.done


class QueueFullError(RuntimeError):
    """The waiting queue already held ``max_queue_size`` requests: rejected at once."""


class BatcherClosedError(RuntimeError):
    """The batcher is closed (or closed without draining before this request ran)."""


class RequestExpiredError(TimeoutError):
    """The request waited past its ``timeout_ms`` before its batch was formed: it never ran.

    A ``TimeoutError``, as callers that catch one expect, but its own class, so that a
    caller's ``asyncio.wait_for`` giving up (also a ``TimeoutError``) tells apart from it.
    """


class RunLog:
    """What happened to every request and batch, in order; frozen into a RunResult.

    Times are seconds on the caller's clock. Shared by DynamicBatcher and the load
    generator's driver of the naive batcher. A batch may carry the instants its worker
    picked it up, had staged its inputs and had launched the model (``phases``); the
    result's ``meta["batch_phases_s"]`` holds them, one row per batch. It may also carry
    its threads' scheduler counters (seconds): the event loop's thread's at its dispatch
    and when the loop took it back, and its worker's thread's then, of CPU time run
    (``meta["batch_thread_cpu_s"]``) and of time waited to run
    (``meta["batch_thread_wait_s"]``), one row per batch each.
    """

    def __init__(self):
        self.arrival_s: list[float] = []
        # [ids, start_s, end_s, worker, trigger, phases, [3 CPU times, 3 waits]]
        self.batches: list[list] = []
        self.rejected: list[int] = []
        self.expired: list[tuple] = []     # (ids, now_s)
        self.failed: list[tuple] = []      # (ids, now_s)

    def batch(self, ids, start_s: float, worker: int, trigger: int,
              loop_cpu_s: float = math.nan, loop_wait_s: float = math.nan) -> int:
        self.batches.append([ids, start_s, math.nan, worker, trigger, None,
                             [loop_cpu_s, math.nan, math.nan, loop_wait_s, math.nan, math.nan]])
        return len(self.batches) - 1

    def result(self, workers: int, **meta) -> RunResult:
        rec = RunRecorder(np.asarray(self.arrival_s, float), workers)
        for i in self.rejected:
            rec.reject(i)
        for ids, now_s in self.expired:
            rec.expire(ids, now_s)
        for ids, start_s, end_s, worker, trigger, _, _ in self.batches:
            rec.dispatch(ids, start_s, end_s, worker, trigger)
        for ids, now_s in self.failed:
            rec.fail(ids, now_s)
        phases = [b[5] or (math.nan,) * 3 for b in self.batches]
        if any(b[5] for b in self.batches):
            meta["batch_phases_s"] = np.asarray(phases, float).reshape(-1, 3)
        sched_s = np.asarray([b[6] for b in self.batches], float).reshape(-1, 6)
        for name, part in (("batch_thread_cpu_s", sched_s[:, :3]),
                           ("batch_thread_wait_s", sched_s[:, 3:])):
            if np.isfinite(part).any():
                meta[name] = part
        return rec.result(**meta)


@functools.lru_cache(maxsize=256)
def _with_timeout(policy: BatchPolicy, timeout_ms: float) -> BatchPolicy:
    """``policy`` with a request's own ``timeout_ms``. Cached, as callers tend to repeat a
    few values; bounded, as a caller passing each request's remaining budget never does."""
    return replace(policy, timeout_ms=timeout_ms)


class DynamicBatcher:
    """Serve ``model_fn`` (batched tensor in, batched tensor out) under ``policy``.

    ``input_spec`` (shape without the batch dimension, dtype) checks every request;
    left out, it is the model's ``input_spec`` attribute (zoo models have one), else the
    first request fixes it. ``device``: where the model runs (default: the device of
    the model's parameters, else CPU); inputs arrive on the CPU and outputs go back to
    it. ``pipeline``: run batches through the stage/launch/complete pipeline of threads
    rather than a thread per worker (default: on CUDA only; ``batchsim.real.runners``).
    ``cuda_graphs``: replay the model from CUDA graphs captured at ``start()``
    (default: on CUDA when the input spec is known; ``batchsim.real.runners``).
    ``thread_cpus``: CPUs to pin the batcher's own threads to, one each in their order
    (a pipeline's stagers, then its launcher and its completer; else a thread per
    worker), in turn when there are more threads than CPUs; the event loop runs on the
    caller's thread, wherever the caller put it. Left out, the OS places the threads,
    and each batcher may land differently: on an H200 the encoder's batches under one
    batcher spent up to twice as long as under another, same configuration, between
    dispatch and launch (the threads' part), while the part from launch to the end moved
    little (``bench/results/README.md``). ``like`` keeps them, so ``calibrate`` and
    ``fidelity`` given a pinned batcher serve pinned batchers. Linux only.

    Inputs are not copied at submit: leave one unchanged until its future is done. Each
    output is a row of its batch's output (a view that shares its storage, so saving or
    pickling one writes the whole batch's: ``.clone()`` one to keep or send it alone),
    and the model must return a new tensor for each batch (one that reuses its own
    buffer overwrites the rows handed out before). The batcher keeps a record of every
    request and batch (``result()``), some 70 bytes a request: serve one run with it,
    not a server's lifetime. Close it (``async with``, or ``await close()``): until it
    closes it holds its threads and staging buffers (on CUDA, its streams, device buffers
    and graphs too). A started batcher that nobody refers to any more -- a notebook cell
    run again, say -- is collected once its batches in flight have come back: it warns
    (``ResourceWarning``), fails its waiting requests with ``BatcherClosedError`` and
    stops its threads.

    Use it inside a running event loop, and submit on that loop (``submit_threadsafe``
    from other threads)::

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
        self._pinned_at_start: int | None = None   # pinned host blocks so far, at start
        self._pinned_during: int | None = None     # and those the run added, at its close
        self.input_spec = spec
        self._spec_source = "the model's input spec" if spec is not None else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.clock = Clock()               # seconds since start(), shared with the threads
        self._abandoned: weakref.finalize | None = None
        self._started = False  # True once start() has returned: the clock runs
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
        self._runner: Runner | None = None

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
        only (``runners.warmup_sizes``), and captures the graphs after it.
        """
        if not isinstance(warmup, bool):
            raise ValueError(f"warmup must be True or False, got {warmup!r}")
        if self._loop is not None:
            raise RuntimeError("this DynamicBatcher was already started; make a new one")
        self._loop = asyncio.get_running_loop()
        self._runner = self._make_runner()
        self._abandoned = weakref.finalize(self, _abandoned, self._runner, self._waiting,
                                           self._loop, _name(self.model_fn))
        self._abandoned.atexit = False    # at exit the daemon threads just end
        self._free = list(range(self.workers))
        capture = self._graphs_wanted()
        if (warmup or capture) and self.input_spec is not None:
            t0 = time.perf_counter()
            try:
                errors = await self._runner.warmup(capture)
            except BaseException:  # the warm-up failed or start() was cancelled
                self._begin_close(0.0)
                self._idle.set_result(None)
                self._abandoned.detach()
                self._runner.stop(join=False)  # a hung model must not hang the loop too
                raise
            if capture:
                self._graphs_meta.update(
                    capture_s=time.perf_counter() - t0, errors=[e for e in errors if e],
                    workers_with_graphs=sum(e is None for e in errors))
        self._pinned_at_start = pinned_host_allocs(self.device)
        self.clock.start()
        self._started_unix_s = time.time()
        self._started = True
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

    def _make_runner(self) -> Runner:
        runner = PipelineRunner if self.pipeline else ThreadRunner
        return runner(self, self._make_steps())

    def _make_steps(self) -> HostSteps:
        return (CudaSteps if self.device.type == "cuda" else HostSteps)(self)

    def like(self, policy: BatchPolicy, *, workers: int | None = None, device=None,
             input_spec: InputSpec | None = None) -> DynamicBatcher:
        """A new, unstarted batcher that serves this one's model as this one does -- with
        its runner (``pipeline``), CUDA graphs and thread CPUs, and its workers, device
        and input spec unless given -- under ``policy``. A batcher serves one run;
        ``calibrate``, ``profile_batcher`` and ``fidelity``, given a batcher, measure it
        through new ones made by this."""
        return DynamicBatcher(self.model_fn, policy,
                              self.workers if workers is None else workers,
                              self.device if device is None else device,
                              self.input_spec if input_spec is None else input_spec,
                              pipeline=self.pipeline, cuda_graphs=self.cuda_graphs,
                              thread_cpus=self.thread_cpus)

    async def __aenter__(self) -> DynamicBatcher:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close(drain=True)

    @property
    def max_batch_size(self) -> int:
        return self.policy.max_batch_size

    def now_s(self) -> float:
        """Seconds since ``start()`` on the batcher's monotonic clock (``perf_counter``)."""
        return self.clock.now_s()

    async def close(self, drain: bool = True) -> None:
        """Stop accepting requests; finish the queued ones (``drain``) or fail them.

        With ``drain=True`` waiting requests are flushed in partial batches as workers
        free up; with ``drain=False`` they fail with ``BatcherClosedError`` (also when a
        drain is already under way). Batches already running always finish. Returns when
        every request has ended and the worker threads have stopped; cancelled, the close
        goes on without it.
        """
        if not isinstance(drain, bool):
            raise ValueError(f"drain must be True or False, got {drain!r}")
        if self._loop is None:
            raise RuntimeError("close() before start(): nothing to close")
        if not self._closed:
            self._begin_close(self.now_s())
            if not drain:
                self._fail_waiting(self._close_s)
            self._decide()
        elif not drain and self._waiting:
            self._fail_waiting(self.now_s())
            self._check_idle()
        await asyncio.shield(self._idle)
        if self._pinned_at_start is not None and self._pinned_during is None:
            self._pinned_during = pinned_host_allocs(self.device) - self._pinned_at_start

    def _begin_close(self, close_s: float) -> None:
        """Accept no more requests from ``close_s`` on; ``close()`` waits for ``_idle``."""
        self._closed, self._close_s = True, close_s
        self._idle = self._loop.create_future()

    def result(self) -> RunResult:
        """The run so far as a RunResult (times in seconds since ``start()``).

        ``meta["started_unix_s"]`` is that start on the wall clock (``time.time()``), to
        line the run up with what other tools log by the wall clock, such as a GPU's
        clocks sampled by ``nvidia-smi`` (``bench/bench_gpu_clocks.py``);
        ``meta["pipeline"]`` says which runner served it. On CUDA
        ``meta["pinned_host_allocs"]`` counts the pinned host blocks this process
        allocated from the start's end to the first close's (each a ``cudaHostAlloc``,
        milliseconds for a few MB; the warm-up leaves blocks for the outputs cached:
        ``CudaSteps.prime_outputs``), other batchers' in the same process included.
        ``meta["batch_thread_cpu_s"]`` holds, per batch, the event loop's thread's CPU
        time (s) at its dispatch and at its return, and its worker's thread's at its
        return (NaN through a pipeline; ``bench/bench_thread_cpu.py`` reads them);
        ``meta["batch_thread_wait_s"]`` the same threads' time waited to run, runnable
        while another thread had their CPU (Linux's ``run_delay``; ``SchedStat``). Only
        once ``close()`` has returned, so that every request has ended.
        """
        if self._idle is None or not self._idle.done():
            raise RuntimeError("result() needs a closed batcher: await batcher.close() first")
        extra = {} if self._graphs_meta is None else {"cuda_graphs": self._graphs_meta}
        if self._pinned_during is not None:
            extra["pinned_host_allocs"] = self._pinned_during
        if self.thread_cpus is not None:
            extra["thread_cpus"] = {t.name.removeprefix("batchsim-"): cpu for t, cpu
                                    in zip(self._runner.threads, self._runner.cpus, strict=True)}
        return self._log.result(self.workers, engine="real", policy=self.policy,
                                device=str(self.device), pipeline=self.pipeline,
                                close_s=self._close_s,
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
        ``BatcherClosedError`` after ``close()``. A request its caller cancelled, like
        one past its timeout, keeps its place (towards ``max_queue_size`` and the size
        trigger) until the next batch is formed, as the rule counts expired ones: looking
        for them at every arrival to a full queue cost up to 0.2 ms an arrival with
        10,000 waiting. ``timeout_ms`` overrides the policy's ``timeout_ms`` for this
        request: if it has waited longer when its batch is formed, its future fails with
        ``RequestExpiredError`` (a ``TimeoutError``) and it never runs (by the rule, expiry
        is checked when a batch is formed, so that is when the error comes).
        """
        if self._closed or not self._started:
            raise self._not_open()
        if asyncio._get_running_loop() is not self._loop:
            raise RuntimeError("submit on the event loop the batcher was started on "
                               "(submit_threadsafe from another thread)")
        if type(x) is not torch.Tensor:
            x = self._as_tensor(x)
        pol = self.policy
        expiry = (self._expiry_policy(timeout_ms)
                  if timeout_ms is not None or pol.timeout_ms is not None else None)
        spec = self.input_spec
        if (spec is None or x.shape != spec.shape or x.dtype != spec.dtype or not x.is_cpu
                or x.layout is not torch.strided):
            self._check_input(x)
        now = self.clock.now_s()
        waiting = self._waiting
        n = len(waiting)
        arrivals = self._log.arrival_s
        rid = len(arrivals)
        arrivals.append(now)
        if rule.rejects(pol, n):
            self._log.rejected.append(rid)
            raise QueueFullError(f"queue full: {n} requests waiting "
                                 f"(max_queue_size={pol.max_queue_size})")
        fut = self._loop.create_future()
        waiting.append((rid, x, fut, expiry))
        if (n == 0 or n + 1 >= pol.max_batch_size) and self._free:
            self._ask_for_decision()
        return fut

    def submit_threadsafe(self, x, timeout_ms: float | None = None):
        """From another thread: queue ``x``; returns a ``concurrent.futures.Future``."""
        if self._closed or not self._started:
            raise self._not_open()
        request = self.submit(x, timeout_ms)
        try:
            return asyncio.run_coroutine_threadsafe(request, self._loop)
        except RuntimeError:  # the loop has closed
            request.close()
            raise BatcherClosedError("the batcher's event loop is closed: it accepts no "
                                     "requests") from None

    def _not_open(self) -> BatcherClosedError:
        """Why a submit is refused before ``start()`` has returned or after ``close()``."""
        return BatcherClosedError("submit after close(): the batcher accepts no requests"
                                  if self._closed else
                                  "submit before start() has returned: await "
                                  "batcher.start() first")

    @staticmethod
    def _as_tensor(x):
        if isinstance(x, torch.Tensor):
            return x
        if isinstance(x, np.ndarray):
            try:
                return torch.from_numpy(x)
            except TypeError:   # strings, objects: no tensor holds them
                raise ValueError(f"x must be an array of numbers, got one of dtype "
                                 f"{x.dtype}") from None
        raise ValueError(f"x must be a torch.Tensor or numpy array, got {type(x).__name__}")

    def _check_input(self, x) -> None:
        if not x.is_cpu or x.layout is not torch.strided:
            # Its batch would fail at staging, and again for every half it was split into.
            raise ValueError(f"x must be a dense CPU tensor (the batcher stacks inputs in "
                             f"host memory and moves the batch to the model's device), got "
                             f"one on {x.device} with layout {x.layout}")
        spec = self.input_spec
        if spec is None:
            self.input_spec = InputSpec(tuple(x.shape), x.dtype)
            self._spec_source = "the input spec, set by the first request"
            return
        raise ValueError(f"x must have shape {tuple(spec.shape)} and dtype {spec.dtype} "
                         f"({self._spec_source}), got shape {tuple(x.shape)} and dtype "
                         f"{x.dtype}")

    def _expiry_policy(self, timeout_ms) -> BatchPolicy:
        """The policy whose ``timeout_ms`` applies to a request that may expire (checked
        before the request is logged, so that a refused one leaves no trace)."""
        if timeout_ms is None:
            return self.policy
        return _with_timeout(self.policy, _check.non_negative("timeout_ms", timeout_ms))

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
                k = self._log.batch(ids, now, worker, trigger, time.thread_time(),
                                    self._runner.loop_stat.read()[1])
                self._in_flight += 1
                self._runner.holding = self
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
            fut.set_exception(RequestExpiredError(
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
        """Once closed with every request ended: stop the threads, and let close() return."""
        if (self._idle is not None and not self._idle.done() and not self._waiting
                and not self._in_flight):
            if self._timer is not None:
                self._timer.cancel()
            self._abandoned.detach()
            try:
                self._runner.stop()
            finally:
                self._idle.set_result(None)

    # -- results back from the workers (one callback per batch) ---------------------------
    def _finished(self, worker: int, k: int, futs, outs, failed: list[int], end_s: float,
                  phases=None):
        batch = self._log.batches[k]
        sched = batch[6]   # the loop's clock first, as at the dispatch
        sched[1] = time.thread_time()
        sched[2], sched[5] = self._runner.worker_sched(worker)
        sched[4] = self._runner.loop_stat.read()[1]
        batch[2] = end_s
        batch[5] = phases
        try:
            self._resolve(batch, futs, outs, failed, end_s)
        finally:  # whatever a future refused, the worker must not be lost
            self._in_flight -= 1
            if not self._in_flight:
                self._runner.holding = None
            heapq.heappush(self._free, worker)
            self._decide()

    def _resolve(self, batch, futs, outs, failed: list[int], end_s: float) -> None:
        """Give each request of a finished batch its output or its error."""
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


def _abandoned(runner: Runner, waiting: deque, loop: asyncio.AbstractEventLoop,
               model: str) -> None:
    """A started batcher collected unclosed, with no batch in flight: warn, fail its waiting
    requests (on their loop, if it still runs) and stop its threads. It must not join
    them: the collection may run on one of them."""
    warnings.warn(f"a DynamicBatcher serving {model} was never closed: it fails its "
                  f"{len(waiting)} waiting requests and stops its threads now (close it: "
                  f"`async with DynamicBatcher(...)` or `await batcher.close()`)",
                  ResourceWarning, stacklevel=2)
    futs = [fut for _, _, fut, _ in waiting]
    waiting.clear()

    def fail_waiting():
        for fut in futs:
            if not fut.done():
                fut.set_exception(BatcherClosedError(
                    "the batcher was collected without close() before this request ran"))

    if futs:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(fail_waiting)
    runner.stop(join=False)


def one_worker(model_or_batcher, policy: BatchPolicy, *, device=None,
               input_spec: InputSpec | None = None) -> DynamicBatcher:
    """A new one-worker batcher under ``policy``: ``like`` ``model_or_batcher`` if that
    is a ``DynamicBatcher``, else serving that model with the defaults; on ``device``
    and with ``input_spec`` where given. What the measurements run: ``calibrate`` fits
    one worker, and ``simulate`` scales to more."""
    if isinstance(model_or_batcher, DynamicBatcher):
        return model_or_batcher.like(policy, workers=1, device=device, input_spec=input_spec)
    return DynamicBatcher(model_or_batcher, policy, device=device, input_spec=input_spec)


def served_model(model_or_batcher, device=None, input_spec: InputSpec | None = None):
    """``(model, device, input_spec)`` that a measurement of ``model_or_batcher`` serves:
    a ``DynamicBatcher``'s model, and its device and input spec unless given; else the
    model and what was given."""
    if isinstance(model_or_batcher, DynamicBatcher):
        return (model_or_batcher.model_fn,
                model_or_batcher.device if device is None else device,
                model_or_batcher.input_spec if input_spec is None else input_spec)
    return model_or_batcher, device, input_spec


def _name(model_fn) -> str:
    return getattr(model_fn, "zoo_name", None) or getattr(model_fn, "__name__",
                                                          type(model_fn).__name__)
