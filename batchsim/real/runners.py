"""Where a DynamicBatcher's batches run: off the event loop, in threads, on the device.

Python threads share one lock (the GIL), every PyTorch call hands it over, and each
hand-over to a waiting thread costs a thread wake-up, so how a batch runs depends on
the device:

* CPU (``ThreadRunner``): a thread per worker stacks its batch into its staging buffer
  and runs the model; the model's arithmetic releases the GIL, so the workers compute
  in parallel.
* CUDA (``PipelineRunner``): a model call only *launches* kernels, mostly Python, so
  worker threads launching side by side pass the GIL back and forth at every layer.
  Instead each batch goes down a pipeline: its worker's stager thread stacks the inputs
  into the worker's pinned staging buffer (the only bulk host copy; stagers of different
  workers copy in parallel, each single-threaded), one launcher thread -- the only one
  that calls the model, back to back like an offline loop -- enqueues on the worker's
  stream a non-blocking copy to the device, the model, a non-blocking copy back into
  pinned memory and a completion event, and one completer thread waits for the events
  and hands the results back. The copy of one batch overlaps the launch of another and
  the GPU runs them on their own streams; the only device synchronisation is the event.

What the device does with a batch is a ``HostSteps`` (``CudaSteps`` on CUDA); which
threads do it is a ``Runner``. Each worker has a ``Slot``: its preallocated staging
buffer, and on CUDA its device input buffer, stream, event and ``Graphs``.

CUDA graphs: a model call launches dozens of kernels, each a few microseconds of Python
holding the GIL, so a small model is launch-bound. At start-up every worker captures the
model once per batch-size bucket (``graph_buckets``: powers of two, and max_batch_size)
on its stream and its device input buffer; a batch of ``n`` then runs as the smallest
bucket ``>= n`` -- the pad rows hold whatever the buffer held, are computed and dropped
-- by one graph replay, one host call.

The threads refer to their batcher only weakly (``weakref.proxy``), and keep it alive
only while it has batches in flight (``Runner.holding``): a started batcher that its
caller drops without closing it can be collected, and then stops its threads
(``DynamicBatcher``'s finalizer) instead of keeping them, its buffers and, on CUDA, its
streams and graphs for the rest of the process.

A model error (or a CUDA out-of-memory error) splits the batch in halves and retries
each, down to single requests (``Runner._serve``), so that only the inputs that cause
an error fail. An output without one row per input (``OutputRowsError``) is the
model's fault, not an input's: it fails the whole batch at once. (A model whose output
rows depend on its inputs, dropping some, breaks the contract batching rests on, that
rows are independent; halving the batch would only hide that.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import queue
import threading
import time
import weakref
from bisect import bisect_left
from typing import TYPE_CHECKING

import torch

from .. import _check
from ..cpus import SchedStat, on_cpu

if TYPE_CHECKING:
    from .batcher import DynamicBatcher


class OutputRowsError(TypeError):
    """A model returned something other than a tensor with one row per input."""


def checked_output(out, n: int) -> torch.Tensor:
    """``out``, a model's output for a batch of ``n``, if it has one row per input; else
    an ``OutputRowsError`` saying what came back."""
    if not isinstance(out, torch.Tensor) or out.ndim == 0 or out.shape[0] != n:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise OutputRowsError(f"model_fn must return a tensor with one row per input: "
                              f"got {got} for a batch of {n}")
    return out


def as_exception(error: BaseException) -> Exception:
    """What a request's future carries when the model raised ``error``: an
    ``Exception`` as it is; anything else (``KeyboardInterrupt``, ``SystemExit``, a
    custom ``BaseException``) as a ``RuntimeError`` raised from it, and so too a
    ``StopIteration`` (``next(model.parameters())`` of a model without any), which an
    asyncio future refuses to carry. The batcher's threads
    catch both, so that one model call cannot end a thread and leave its requests
    waiting for ever, and the caller's task gets an error rather than an exception that
    stops the event loop."""
    if isinstance(error, Exception) and not isinstance(error, StopIteration):
        return error
    wrapped = RuntimeError(f"model_fn raised {type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped


def all_failed(error: Exception, n: int) -> tuple[list, list[int]]:
    """A batch of ``n`` whose every request fails with ``error``: ``(outputs, failed
    positions)``, as ``Runner._serve`` returns them."""
    return [error] * n, list(range(n))


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
WARMUP_LOCK = threading.Lock()

#: Pinned host blocks a CUDA worker's warm-up leaves cached for each size of its outputs
#: (``CudaSteps.prime_outputs``). A block is taken while any row of its output is held,
#: and once let go it waits for the work then queued on its worker's stream; on an H200
#: the grids' batches found a block cached from their third of a size on (runs then
#: allocate what more they hold at once: ``meta["pinned_host_allocs"]`` counts it).
PINNED_BLOCKS_PER_SIZE = 4


def pinned_block_bytes(row_bytes: int, max_batch_size: int) -> tuple[int, ...]:
    """The pinned host blocks that outputs of 1 to ``max_batch_size`` rows of
    ``row_bytes`` each are copied into, in bytes, largest first: PyTorch's caching host
    allocator rounds every request up to a power of two and serves it from the freed
    blocks of that size (``torch.cuda.host_memory_stats``)."""
    row_bytes = _check.positive_int("row_bytes", row_bytes)
    rows = range(1, _check.positive_int("max_batch_size", max_batch_size) + 1)
    return tuple(sorted({1 << (n * row_bytes - 1).bit_length() for n in rows}, reverse=True))


def pinned_host_allocs(device: torch.device) -> int | None:
    """How many pinned host blocks this process has allocated so far (each one a
    ``cudaHostAlloc``, which can take a millisecond for a few MB), on CUDA; else, or
    where PyTorch does not say, None."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if device.type != "cuda" or stats is None:
        return None
    allocs = stats().get("num_host_alloc")
    return None if allocs is None else int(allocs)


class Graphs:
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


def single_threaded_ops() -> None:
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


class Slot:
    """One worker's buffers: staging (host), device input, CUDA stream and event, graphs."""

    def __init__(self, stream=None, event=None):
        self.staging = self.device_in = None
        self.stream, self.event = stream, event
        self.graphs: Graphs | None = None
        self.pool = None  # the memory pool its graphs share

    def release(self) -> None:
        """Let its buffers and graphs go now: a closed batcher keeps its runner (its
        ``result()`` reads the threads), so without this they would last as long as the
        batcher, holding pinned host and device memory."""
        self.staging = self.device_in = self.graphs = self.pool = None


class Clock:
    """Seconds since a batcher's ``start()`` (``perf_counter``): one clock that the batcher
    and its threads share, so that the threads need not refer to the batcher for it."""

    def __init__(self):
        self.t0_s = 0.0

    def start(self) -> None:
        self.t0_s = time.perf_counter()

    def now_s(self) -> float:
        return time.perf_counter() - self.t0_s


class HostSteps:
    """How one batch runs on the CPU (or another device the model copies to itself).

    ``launch`` starts a staged batch and returns its output (here: runs it to the
    end), ``wait`` waits for the worker's batch in flight, ``recover`` cleans up after
    an error. ``CudaSteps`` makes ``launch`` asynchronous. ``capture`` (where
    ``can_capture``) records one graph of the model for ``capture_graphs``.
    """

    pinned = False
    can_capture = False

    def __init__(self, batcher: DynamicBatcher):
        self.batcher = weakref.proxy(batcher)   # see the module's docstring
        self.model_fn = batcher.model_fn

    def new_slot(self) -> Slot:
        return Slot()

    def thread_started(self) -> None:
        """Called first in every runner thread that stages batches."""

    def stage(self, slot: Slot, xs) -> torch.Tensor:
        """Stack the inputs into the slot's staging buffer (one copy for the batch)."""
        if slot.staging is None:
            self.allocate(slot)
        host_in = slot.staging[:len(xs)]
        torch.stack(xs, out=host_in)
        return host_in

    def allocate(self, slot: Slot) -> None:
        b = self.batcher
        shape = (b.policy.max_batch_size, *b.input_spec.shape)
        try:
            slot.staging = torch.empty(shape, dtype=b.input_spec.dtype, pin_memory=self.pinned)
        except RuntimeError as e:   # a max_batch_size meant as "no cap", as in a simulation
            gib = math.prod(shape) * b.input_spec.dtype.itemsize / 2**30
            raise RuntimeError(f"no staging buffer for max_batch_size={shape[0]} inputs of "
                               f"{tuple(b.input_spec.shape)} {b.input_spec.dtype} "
                               f"({gib:,.1f} GiB): the batcher stacks a batch in a buffer "
                               f"of max_batch_size rows, made once ({e})") from e

    def graph_input(self, slot: Slot) -> torch.Tensor:
        """The buffer a batch's model input is a view of (what graphs are captured on)."""
        return slot.staging

    def forward(self, slot: Slot, x: torch.Tensor) -> torch.Tensor:
        """The model on ``x``, the first rows of the graph input: a replay if captured."""
        if slot.graphs is not None:
            return slot.graphs(len(x))
        return checked_output(self.model_fn(x), len(x))

    def capture(self, slot: Slot, x: torch.Tensor):
        raise NotImplementedError(f"no graph capture on {self.batcher.device.type}")

    def capture_graphs(self, slot: Slot) -> str | None:
        """Capture the model per bucket for this slot; else why not (it then runs eagerly)."""
        try:
            if slot.staging is None:
                self.allocate(slot)
            slot.graphs = Graphs(lambda x: self.capture(slot, x), self.graph_input(slot),
                                 graph_buckets(self.batcher.policy.max_batch_size))
            return None
        except BaseException as e:
            slot.graphs = slot.pool = None
            self.recover(slot, e)
            return f"capture failed, eager: {type(e).__name__}: {e}"

    def launch(self, slot: Slot, host_in: torch.Tensor) -> torch.Tensor:
        """Run the model; the output is a CPU tensor that aliases no buffer of the slot."""
        out = self.forward(slot, host_in.to(self.batcher.device)).cpu()
        if (slot.graphs is not None or out.untyped_storage().data_ptr()
                == slot.staging.untyped_storage().data_ptr()):
            out = out.clone()  # a graph's static output, or (a view of) the staging buffer
        return out

    def wait(self, slot: Slot) -> None:
        pass

    def recover(self, slot: Slot, error: Exception) -> None:
        pass

    def prime_outputs(self, row: torch.Tensor) -> None:
        """Prepare for the outputs of every batch size, ``row`` one row of an output (on
        the host: nothing to prepare)."""


class CudaSteps(HostSteps):
    """On CUDA: pinned staging, and a stream and a completion event per worker."""

    pinned = True
    can_capture = True

    def new_slot(self) -> Slot:
        device = self.batcher.device
        return Slot(torch.cuda.Stream(device), torch.cuda.Event())

    def thread_started(self) -> None:
        """The model runs on the GPU: a thread's CPU work is copies, best done alone."""
        single_threaded_ops()

    def allocate(self, slot: Slot) -> None:
        super().allocate(slot)
        # Zeroed on the slot's stream, which every later copy into it uses: on the
        # thread's default stream, nothing would order the fill before the first copy.
        with torch.cuda.stream(slot.stream):
            slot.device_in = torch.zeros(slot.staging.shape, dtype=slot.staging.dtype,
                                         device=self.batcher.device)  # finite pad rows

    def graph_input(self, slot: Slot) -> torch.Tensor:
        return slot.device_in

    def capture(self, slot: Slot, x: torch.Tensor):
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
            out = checked_output(self.model_fn(x), len(x))
        slot.pool = graph.pool()
        return graph.replay, out

    def launch(self, slot: Slot, host_in: torch.Tensor) -> torch.Tensor:
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

    def wait(self, slot: Slot) -> None:
        slot.event.synchronize()

    def prime_outputs(self, row: torch.Tensor) -> None:
        """Leave ``PINNED_BLOCKS_PER_SIZE`` pinned host blocks cached for every size of
        output (``pinned_block_bytes``), each size's held all at once, then let go.

        Every batch copies its output back into a new pinned tensor (``launch``), and
        each block the allocator has not cached costs a ``cudaHostAlloc``. A graph
        capture empties that cache (``torch.cuda.graph``), so this runs after it; before
        it did, on an H200 the encoder's first and second batches of a size in each run
        (outputs of 128 KB a row) took over twice their time in 12-35% and 4-22% of
        cases, against 0.0-0.2% later (``bench/results/README.md``). A size whose blocks
        cannot be pinned is left to the first batches that need them.
        """
        row_bytes = row.numel() * row.element_size()
        if not row_bytes:
            return  # empty outputs take no memory
        for n in pinned_block_bytes(row_bytes, self.batcher.policy.max_batch_size):
            with contextlib.suppress(RuntimeError):
                held = [torch.empty(n, dtype=torch.uint8, pin_memory=True)
                        for _ in range(PINNED_BLOCKS_PER_SIZE)]
                del held

    def recover(self, slot: Slot, error: Exception) -> None:
        """Let what the failed launch enqueued finish (its staging may still be read)."""
        try:
            slot.stream.synchronize()
            if isinstance(error, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
        except Exception:
            pass  # a broken context fails every retry, one request at a time


class Runner:
    """Runs a DynamicBatcher's batches off the event loop; one ``Slot`` per worker.

    ``steps`` say what the device does with a batch; subclasses say which threads do
    it (``_threads``, ``put``). Results go back with one ``call_soon_threadsafe`` per
    batch, with the instants the batch was picked up, staged and launched.

    ``holding`` is the batcher while it has batches in flight, else None: the threads
    refer to it only weakly, and a batch must still come back to a batcher that nobody
    else refers to.
    """

    def __init__(self, batcher: DynamicBatcher, steps: HostSteps):
        self.batcher = weakref.proxy(batcher)   # see the module's docstring
        self.clock = batcher.clock
        self.holding: DynamicBatcher | None = None
        self.steps = steps
        self.slots = [steps.new_slot() for _ in range(batcher.workers)]
        self.loop_stat = SchedStat(threading.get_native_id())  # made on the loop's thread
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

    def stop(self, join: bool = True) -> None:
        """Stop the threads once they have run what they were given; let the buffers go.

        ``join=False``: only tell the threads to stop, and return at once, for a start
        that failed or was cancelled while a model runs (it must not wait for the
        model); a batch still on its way through a pipeline may be dropped, and the
        buffers go with the batcher.
        """
        self._join(join)
        if join:
            for slot in self.slots:
                slot.release()
            for stat in self._stats():
                stat.close()

    def _join(self, wait: bool) -> None:
        """Send each thread its stop, and (``wait``) wait for it to end."""
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

    def _warm(self, slot: Slot, job, done: concurrent.futures.Future) -> None:
        xs, capture = job
        with WARMUP_LOCK, contextlib.suppress(concurrent.futures.InvalidStateError):
            # InvalidStateError: start() was cancelled, and nobody waits for ``done``.
            try:
                for b in warmup_sizes(len(xs), capture):
                    outs, failed = self._serve(slot, xs[:b])
                    if failed:
                        break  # a model that cannot take zeros fails later, per request
                why_not = self.steps.capture_graphs(slot) if capture else None
                if not failed:  # after the capture, which empties the pinned cache
                    self.steps.prime_outputs(outs[0])
            except Exception as e:  # start() fails with it rather than waiting forever
                done.set_exception(e)
            else:
                done.set_result(why_not)

    def _serve(self, slot: Slot, xs, error: Exception | None = None):
        """Run ``xs`` to the end: ``(outputs, failed positions)``. Never raises.

        On an error (``error``: one already raised by this batch) split the batch and
        retry the halves, down to single requests, so that only the inputs that cause
        an error fail (each with it, ``as_exception``). An ``OutputRowsError`` fails
        every request of ``xs`` at once: halves would only call a model that breaks its
        contract ``2 len(xs) - 2`` more times. An error of the steps' own (a recovery
        that raises) fails the whole batch with it, rather than end the thread and
        leave the batch's requests, and every later one, waiting for ever.
        """
        try:
            return self._serve_or_split(slot, xs, error)
        except BaseException as e:
            return all_failed(as_exception(e), len(xs))

    def _serve_or_split(self, slot: Slot, xs, error: Exception | None):
        steps = self.steps
        if error is None:
            try:
                out = steps.launch(slot, steps.stage(slot, xs))
                steps.wait(slot)
                return out.unbind(0), []
            except BaseException as e:
                error = as_exception(e)
        steps.recover(slot, error)
        if len(xs) == 1 or isinstance(error, OutputRowsError):
            return all_failed(error, len(xs))
        half = len(xs) // 2
        outs_a, failed_a = self._serve_or_split(slot, xs[:half], None)
        outs_b, failed_b = self._serve_or_split(slot, xs[half:], None)
        return [*outs_a, *outs_b], failed_a + [half + i for i in failed_b]

    def worker_sched(self, worker: int) -> tuple[float, float]:
        """The CPU time (s) that the thread running ``worker``'s batches has run and its
        time waited to run (``SchedStat``); NaN where no one thread does."""
        return math.nan, math.nan

    def _stats(self) -> list[SchedStat]:
        """The scheduler counters it reads: the event loop's thread's, and its workers'."""
        return [self.loop_stat]

    def _report(self, worker: int, k: int, futs, outs, failed, phases) -> bool:
        """Hand a finished batch to the loop; False once the loop is gone."""
        b = self.batcher
        try:
            b._loop.call_soon_threadsafe(b._finished, worker, k, futs, outs, failed,
                                         self.clock.now_s(), phases)
            return True
        except RuntimeError:  # the event loop is closed: nobody waits any more
            return False


class ThreadRunner(Runner):
    """A thread per worker runs each of its batches to the end (the CPU default).

    ``worker_sched`` reads the worker's thread's counters from Linux's
    ``/proc/self/task/<tid>/schedstat`` (``SchedStat``), which the thread opens when it
    starts, rather than have the thread read its own clock: a thread's read of its own
    CPU clock while it runs brings the scheduler's accounting of it up to date first, and
    on one CPU that changed how the worker and the event loop shared the core
    (``bench/results/README.md``). On one CPU, read by the running loop, its CPU time is
    exact; a wait still under way is counted when it ends.
    """

    def __init__(self, batcher: DynamicBatcher, steps: HostSteps):
        self.inboxes = [queue.SimpleQueue() for _ in range(batcher.workers)]
        self.worker_stats = [SchedStat(None)] * batcher.workers  # each thread opens its own
        super().__init__(batcher, steps)

    def worker_sched(self, worker: int) -> tuple[float, float]:
        return self.worker_stats[worker].read()

    def _stats(self) -> list[SchedStat]:
        return [self.loop_stat, *self.worker_stats]

    def _threads(self):
        return [(f"worker-{w}", lambda w=w: self._work(w)) for w in range(len(self.inboxes))]

    def put(self, worker: int, k, xs, futs) -> None:
        self.inboxes[worker].put((k, xs, futs))

    def _join(self, wait: bool) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for thread in self.threads if wait else ():
            thread.join()

    def _work(self, worker: int) -> None:
        slot, inbox, now = self.slots[worker], self.inboxes[worker], self.clock.now_s
        self.worker_stats[worker] = SchedStat(threading.get_native_id())
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


class PipelineRunner(Runner):
    """A pipeline of threads: stage (one per worker) -> launch (one) -> complete (one).

    A worker's stager stacks its batch into the worker's staging buffer (host copies of
    different workers run in parallel); the launcher -- the only thread that calls the
    model -- starts it (on CUDA ``launch`` returns before the device is done); the
    completer waits for each launched batch, in launch order, and reports. Queues join
    them. When a launch raises, the launcher finishes that batch itself, synchronously,
    by ``_serve``'s split-and-retry. The CUDA default.
    """

    def __init__(self, batcher: DynamicBatcher, steps: HostSteps):
        self.inboxes = [queue.SimpleQueue() for _ in range(batcher.workers)]
        self.to_launch, self.to_complete = queue.SimpleQueue(), queue.SimpleQueue()
        super().__init__(batcher, steps)

    def _threads(self):
        return [*((f"stage-{w}", lambda w=w: self._stager(w))
                  for w in range(len(self.inboxes))),
                ("launch", self._launcher), ("complete", self._completer)]

    def put(self, worker: int, k, xs, futs) -> None:
        self.inboxes[worker].put((k, xs, futs))

    def _join(self, wait: bool) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for thread in self.threads[:-2] if wait else ():
            thread.join()
        self.to_launch.put(None)
        for thread in self.threads[-2:] if wait else ():
            thread.join()

    def _stager(self, worker: int) -> None:
        slot, inbox, now, stage = (self.slots[worker], self.inboxes[worker],
                                   self.clock.now_s, self.steps.stage)
        self.steps.thread_started()
        with torch.no_grad():  # an input that requires grad cannot be stacked into a buffer
            while (job := inbox.get()) is not None:
                k, xs, futs = job
                picked, host_in, error = now(), None, None
                if k is not None:  # a warm-up batch is staged by the launcher
                    try:
                        host_in = stage(slot, xs)
                    except BaseException as e:
                        error = as_exception(e)
                self.to_launch.put((worker, k, xs, futs, host_in, error, picked, now()))

    def _launcher(self) -> None:
        now, launch = self.clock.now_s, self.steps.launch
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
                    except BaseException as e:
                        error = as_exception(e)
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
                except BaseException as e:  # an asynchronous device error fails the batch
                    out, failed = all_failed(as_exception(e), len(futs))
            if not self._report(worker, k, futs, out, failed, phases):
                return
