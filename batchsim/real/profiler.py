"""Measure a model's service time ``s(b)`` and the batcher's own cost on top of it.

``profile_model`` times one batch of each size ``b``, ``repeats`` times after a warm-up
(in rounds of one batch of every size, so that a drift falls on all sizes alike), and
returns a ``ProfileService`` of the medians (p90s and provenance in its metadata),
ready for the simulator. ``end_to_end=True`` times what a batch costs a worker of
``DynamicBatcher``: pinned host input -> one non-blocking copy to the device -> model ->
one copy back to pinned host memory -> synchronize. ``end_to_end=False`` times the
model alone on inputs already on the device (what the reference GPU numbers measure).
On a CPU both are the same.

``profile_batcher`` measures ``s(b)`` as ``DynamicBatcher`` serves the model instead:
full batches through a one-worker batcher, each timed from dispatch to end. On CUDA
that is another program than the eager model (CUDA graph replays, a pipeline of
threads), and only this profile measures it.

What the batcher adds per batch is measured by serving the model with a saturated,
warmed-up one-worker ``DynamicBatcher`` and reported in the metadata, not folded into
``s(b)``: ``batcher_overhead_ms`` is the median time a batch of ``b`` holds its worker
(dispatch to end) minus ``s(b)`` -- handing the batch over, stacking the inputs into the
staging buffer, splitting the output -- and ``release_ms`` the median time from a
batch's end to the next dispatch (the result's trip back through the event loop).
``staging_ms`` times the stacking alone: it is a copy of ``b`` inputs, so it grows with
``b`` times the input's bytes (512 inputs of 256 KB are 128 MB to copy, ~10 ms), and it
is most of the overhead for large inputs. With more than one worker these costs
overlap with other batches' compute; with one, they add up.
"""

from __future__ import annotations

import concurrent.futures
import platform
import re
import time
from datetime import UTC, datetime

import numpy as np
import torch

from .. import _check
from .._aio import run_to_completion
from .._gc import collector_paused
from ..policy import BatchPolicy
from ..service import ProfileService
from .models import InputSpec, model_device, resolve_device
from .runners import checked_output

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def profile_model(model, batch_sizes=DEFAULT_BATCH_SIZES, device=None, repeats: int = 20,
                  end_to_end: bool = True, *, warmup: int = 3, input_spec=None,
                  overhead: bool = True, min_duration_s: float = 0.0) -> ProfileService:
    """Measure ``s(b)`` of ``model`` for each of ``batch_sizes``; a ``ProfileService``.

    ``model``: a callable on a batched tensor with an ``input_spec`` (zoo models have
    one) or given ``input_spec``. ``device``: where it runs (default: where its
    parameters are). The service's ``jitter_cv`` is the median over sizes of the
    measured coefficient of variation; ``metadata`` holds the device, model, dtype,
    torch version, date, ``p90_ms``, and at the smallest and largest size
    ``batcher_overhead_ms``, ``release_ms`` and ``staging_ms`` (see the module doc;
    skipped when ``overhead`` is False). The model runs on a thread of its own, as the
    batcher's workers run it (``_on_own_thread``). No automatic garbage collection runs
    while it measures (``batchsim._gc``). ``min_duration_s``: keep timing rounds past
    ``repeats`` until the rounds have taken this long (``metadata["repeats"]`` says how
    many ran), so that a few milliseconds of a busy neighbour do not decide the medians
    of a model whose rounds are short (see ``_time_batches``).
    """
    spec, sizes, repeats, dev = _setup(model, batch_sizes, device, repeats, input_spec)
    warmup = _check.non_negative_int("warmup", warmup)
    min_duration_s = _check.non_negative("min_duration_s", min_duration_s)
    with collector_paused():
        return _on_own_thread(_measure_model, model, spec, dev, sizes, repeats, warmup,
                              bool(end_to_end), bool(overhead), min_duration_s)


def _on_own_thread(fn, *args):
    """``fn(*args)`` on a new thread (its result, or its exception raised here).

    ``DynamicBatcher`` runs a model on worker threads, never on the caller's, and a
    profile times it the same way. On the caller's thread it would time the model with
    that thread's thread settings, and its matrix products would leave that thread a
    pool of BLAS/OpenMP threads: on a 2-core machine with the default thread count, the
    batcher served the tiny MLP 2-3x slower after its profile had run on the caller's
    thread (``bench/bench_profile_thread.py``).
    """
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="batchsim-profile") as pool:
        return pool.submit(fn, *args).result()


def _measure_model(model, spec, dev, sizes, repeats, warmup, end_to_end,
                   overhead, min_duration_s) -> ProfileService:
    """``profile_model``'s measurements, on the thread that calls this."""
    samples_ms = _time_batches(model, spec, dev, sizes, repeats, warmup, end_to_end,
                               min_duration_s)
    prof = _profile(model, spec, dev, sizes, samples_ms, through="model",
                    end_to_end=end_to_end or dev.type == "cpu", warmup=warmup)
    if overhead:
        ends = {sizes[0]: prof.times_ms[0], sizes[-1]: prof.times_ms[-1]}
        costs = {b: _batcher_costs_ms(model, spec, dev, b, s_ms) for b, s_ms in ends.items()}
        for i, key in enumerate(("batcher_overhead_ms", "release_ms", "staging_ms")):
            prof.metadata[key] = {str(b): c[i] for b, c in costs.items()}
    return prof


def profile_batcher(model_or_batcher, batch_sizes=DEFAULT_BATCH_SIZES, device=None,
                    repeats: int = 20, *, input_spec=None,
                    min_duration_s: float = 0.0) -> ProfileService:
    """``s(b)`` as ``DynamicBatcher`` serves a model: for each ``b``, the median time a
    full batch holds the worker (dispatch to end) of a one-worker batcher of
    ``max_batch_size=b`` that was handed ``repeats + 2`` batches at once (the first two
    are not counted; nothing arrives while a batch runs). ``model_or_batcher``: the
    model, served with the defaults, or a ``DynamicBatcher``, served as it serves it
    (``DynamicBatcher.like``). Such a pass over the sizes is
    made again until the passes have taken ``min_duration_s``, as ``profile_model``'s
    rounds are (``metadata["repeats"]``: the batches timed per size).

    Unlike ``profile_model``, this times what the batcher runs: on CUDA, its CUDA graph
    replays and its stage/launch/complete pipeline of threads with their copies, which
    the eager model timed alone misses in both directions; and the batcher's own work
    around the model (handing the batch over, stacking the inputs, splitting the
    output). ``calibrate`` builds on it where the two differ (see its ``profile``). No
    automatic garbage collection runs while it measures (``batchsim._gc``).
    """
    from .batcher import served_model

    model, device, input_spec = served_model(model_or_batcher, device, input_spec)
    spec, sizes, repeats, dev = _setup(model, batch_sizes, device, repeats, input_spec)
    min_duration_s = _check.non_negative("min_duration_s", min_duration_s)
    samples_ms = [[] for _ in sizes]
    with collector_paused():
        for b in sizes:
            _check_rows(model, spec.random(b).to(dev))
        start_s = time.perf_counter()
        while not samples_ms[0] or time.perf_counter() - start_s < min_duration_s:
            for timed, b in zip(samples_ms, sizes, strict=True):
                res = _saturated(model_or_batcher, spec, dev, b, repeats + 2)
                timed.extend(1000.0 * (res.end_s - res.start_s)[2:])
    return _profile(model, spec, dev, sizes, [np.array(t) for t in samples_ms],
                    through="batcher")


def _setup(model, batch_sizes, device, repeats, input_spec):
    """The checked ``(input spec, sorted sizes, repeats, device)`` of a profile."""
    spec = input_spec if input_spec is not None else getattr(model, "input_spec", None)
    if not isinstance(spec, InputSpec):
        raise ValueError(f"input_spec must be an InputSpec (or the model's input_spec "
                         f"attribute), got {spec!r}")
    sizes = sorted({_check.positive_int("batch_sizes", b)
                    for b in np.atleast_1d(np.asarray(batch_sizes, dtype=object)).tolist()})
    if not sizes:
        raise ValueError(f"batch_sizes must not be empty, got {batch_sizes!r}")
    repeats = _check.positive_int("repeats", repeats)
    return spec, sizes, repeats, model_device(model, device)


def _profile(model, spec, dev, sizes, samples_ms, **meta) -> ProfileService:
    """The ``ProfileService`` of timings ``samples_ms`` (one array per size), with
    its provenance."""
    median_ms = [float(np.median(t)) for t in samples_ms]
    cv = float(np.median([np.std(t) / np.mean(t) for t in samples_ms]))
    metadata = {
        "model": getattr(model, "zoo_name", type(model).__name__),
        "device": device_name(dev),
        "dtype": str(spec.dtype).removeprefix("torch."),
        "input_shape": list(spec.shape),
        "torch": torch.__version__,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **meta,
        "repeats": len(samples_ms[0]),
        "p90_ms": [float(np.percentile(t, 90)) for t in samples_ms],
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cpu_threads": torch.get_num_threads(),
    }
    return ProfileService(sizes, median_ms, jitter_cv=cv, metadata=metadata)


def _saturated(model_or_batcher, spec: InputSpec, dev: torch.device, b: int, batches: int):
    """The run of a one-worker ``DynamicBatcher`` of ``max_batch_size=b`` (``one_worker``
    of ``model_or_batcher``) handed ``batches * b`` requests at once (so nothing arrives
    while a batch runs).

    Each output is let go as soon as its batch ends, as a server that answers its
    requests does. Kept to the end of the run (``run_saturated`` with a window of every
    request), each batch's output buffer stayed in use, so on CUDA every batch had to
    pin a new one: on an H100 the encoder's ``s(32)`` came out 2.92 ms against 1.35 ms
    (``bench/probe_profile_release.py``).
    """
    from .batcher import one_worker

    batcher = one_worker(model_or_batcher, BatchPolicy(b, float("inf")), device=dev,
                         input_spec=spec)
    rows = spec.random(min(b, 64)).unbind(0)

    async def serve():
        await batcher.start(warmup=True)
        failed = []  # the first error only: keeping the futures would keep their outputs

        def settle(fut):
            if fut.exception() is not None and not failed:
                failed.append(fut.exception())

        for i in range(batches * b):
            batcher.submit_nowait(rows[i % len(rows)]).add_done_callback(settle)
        await batcher.close()
        if failed:  # a profile of failures would time the error path
            raise ValueError(f"the model failed while served in batches of {b}: "
                             f"{type(failed[0]).__name__}: {failed[0]}") from failed[0]
        return batcher.result()

    return run_to_completion(serve)


def _time_batches(model, spec: InputSpec, dev: torch.device, sizes: list[int], repeats: int,
                  warmup: int, end_to_end: bool, min_duration_s: float = 0.0) -> list[np.ndarray]:
    """Per size in ``sizes``, timings in ms of one batch of it: ``repeats`` rounds, and
    more until the rounds have taken ``min_duration_s``.

    Each size first runs ``warmup`` times untimed; then the sizes are timed in rounds,
    one batch of each per round, each right after an untimed batch of its own size (so
    that the caches a size uses are warm, as when one size is timed over and over).
    Timed one size after another instead, the first size carried what the first timed
    runs of a thread still pay: the tiny MLP's ``s(1)`` came out 20% above ``s(2)`` in
    each of four fresh processes, and a simulator calibrated on it made the batches of
    one too slow. In rounds, such a drift -- and a neighbour's load coming and going -- falls on
    every size alike. But when a round is short, a few rounds are a few milliseconds, and
    a neighbour busy for those moved every median: on one shared CPU, profiles of the tiny
    MLP 30 rounds long (about 15 ms) had a size off the shape of the typical profile by
    12.8% at the 95th percentile and up to 27%; a second long, by 4.6% and 6.6%
    (``bench/bench_profile_noise.py``).
    """
    cuda = dev.type == "cuda"
    steps = [_step(model, spec, dev, b, cuda and end_to_end) for b in sizes]
    rounds = []
    with torch.no_grad():
        for step in steps:
            for _ in range(warmup):
                step()
        start_s = time.perf_counter()
        while len(rounds) < repeats or time.perf_counter() - start_s < min_duration_s:
            times_ms = []
            for step in steps:
                step()
                t0 = time.perf_counter()
                step()
                times_ms.append(1000.0 * (time.perf_counter() - t0))
            rounds.append(times_ms)
    return list(np.array(rounds).T)


def _step(model, spec: InputSpec, dev: torch.device, b: int, copies: bool):
    """One batch of ``b`` through ``model``, to the end: with ``copies``, from pinned
    host memory to the device and back, as a CUDA worker of the batcher does. Its first
    run (untimed: each size runs once before it is timed) refuses a model that does not
    return one row per input (``TypeError``)."""
    cuda = dev.type == "cuda"
    host_in = spec.random(b, pin_memory=cuda)
    dev_in = host_in.to(dev)
    host_out = None
    checked = False

    def step():
        nonlocal host_out, checked
        if copies:
            dev_in.copy_(host_in, non_blocking=True)
        out = model(dev_in)
        if not checked:
            checked_output(out, b)
            checked = True
        if copies:
            if host_out is None:
                host_out = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            host_out.copy_(out, non_blocking=True)
        if cuda:
            torch.cuda.synchronize(dev)

    return step


def _check_rows(model, x: torch.Tensor) -> None:
    """Run ``model`` once on the batch ``x``, untimed: a ``TypeError`` if it does not
    return one row per input (a batcher would fail every such batch at once, and a
    profile would time that)."""
    with torch.no_grad():
        checked_output(model(x), len(x))


def _batcher_costs_ms(model, spec: InputSpec, dev: torch.device, b: int, s_ms: float,
                      batches: int = 30) -> tuple[float, float, float]:
    """``(overhead, release, staging)`` in ms for batches of ``b`` (see the module doc)."""
    res = _saturated(model, spec, dev, b, batches)
    held_ms = 1000.0 * (res.end_s - res.start_s)[2:]
    release_ms = 1000.0 * (res.start_s[1:] - res.end_s[:-1])[2:]
    pool = spec.random(min(b, 64))
    rows = [pool[i % len(pool)] for i in range(b)]
    staging = torch.empty((b, *spec.shape), dtype=spec.dtype, pin_memory=dev.type == "cuda")
    stack_ms = []
    for _ in range(5):
        t0 = time.perf_counter()
        torch.stack(rows, out=staging)
        stack_ms.append(1000.0 * (time.perf_counter() - t0))
    return (float(np.median(held_ms) - s_ms), float(np.median(release_ms)),
            float(np.median(stack_ms[1:])))


def device_name(device) -> str:
    """A readable name of the device: the GPU's name, or the CPU's."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    try:  # Linux names the CPU model here; platform.processor() often says only "x86_64"
        with open("/proc/cpuinfo") as f:
            found = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.MULTILINE)
        if found:
            return found.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or dev.type


def device_slug(device) -> str:
    """A short lowercase tag for file names: ``"h200"`` for an NVIDIA H200, ``"cpu"``."""
    dev = resolve_device(device)
    if dev.type != "cuda":
        return dev.type
    name = torch.cuda.get_device_name(dev)
    found = re.search(r"\b([A-Z]+\d+)", name)
    return (found.group(1) if found else re.sub(r"\W+", "-", name)).lower()


def profile_filename(device, model_name: str, dtype) -> str:
    """``{device}_{model}_{dtype}.json``, e.g. ``h200_encoder_bfloat16.json``."""
    return f"{device_slug(device)}_{model_name}_{str(dtype).removeprefix('torch.')}.json"
