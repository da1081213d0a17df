"""How many requests a second DynamicBatcher itself can move, and a GPU stand-in on CPU.

Part 1, identity model (``python bench/bench_batcher_cpu.py``): with a model that does
nothing, throughput measures the batcher's own cost per request. Side by side, on the
same inputs, at max_batch_size 64 and under saturation:

* DynamicBatcher fed through ``submit_nowait`` (one future per request, no task), with
  a thread per worker (the CPU default) and with the stage/launch/complete pipeline of
  threads (the CUDA default);
* DynamicBatcher fed by 256 client tasks, each awaiting ``submit()`` in turn (the way a
  server with a task per connection calls it);
* DynamicBatcher fed through ``await submit()`` in a new asyncio task per request;
* the naive polled InferenceBatcher, driven as tutorials drive it (poll every 1 ms);
* offline ``batch_inference`` (fixed batches of 64, no serving at all).

Target: >= 100,000 requests/s through DynamicBatcher. Prints medians of ``--repeats``.
Every variant runs with Python's garbage collector paused, as ``run_saturated`` runs
(``batchsim._gc``).

Part 2, ``--standin``: the H200 timing without a GPU. A ``VirtualGpu`` plays a zoo model
on the H200: a model call holds the GIL for the Python part of each kernel launch and
releases it in between (a real torch call), the launch takes the measured ``s(1)`` of
host time, and a virtual device -- a copy engine each way and a compute engine, each a
FIFO -- runs the batch for the time the measured profile gives; waiting for it sleeps,
GIL released, like a CUDA event. The staging copy into the worker's buffer is real. The
ratio is saturated DynamicBatcher throughput over the stand-in's offline peak (batches
launched back to back from one thread, as ``bench_gpu.py`` measures the real one), for
the stage/launch/complete pipeline and for a thread per worker; in brackets, how much
longer a launch's host time was than offline (GIL hand-overs to other threads stretch
it). How much of a launch holds the GIL is an assumption (``GIL_PATTERN``); on a busy
2-core machine the stand-in is starved of cores, so read its numbers side by side, not
as GPU predictions.

Where the OS runs the event loop and the worker thread matters here more than anywhere:
every batch is a hand-over between them, and nothing else. ``--cpu N`` runs the process
on CPU N alone, both threads on one core (``bench/bench_thread_placement.py``).

Run: ``.venv/bin/python bench/bench_batcher_cpu.py [--quick] [--standin] [--cpu 0]``.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import math
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch

import batchsim as bs
from batchsim._gc import collector_paused
from batchsim.cpus import run_on_cpus
from batchsim.real import DynamicBatcher, InferenceBatcher, InputSpec, batch_inference
from batchsim.real.loadgen import run_saturated
from batchsim.real.runners import CudaSteps, HostSteps, Slot

SPEC = InputSpec((16,), torch.float32)
MAX_BATCH = 64
COMPUTE_ONLY = Path(__file__).with_name("results") / "profile_h200_compute_only.json"
#: model -> (input shape, output shape, Python-level calls a launch makes, GIL-held us
#: per call): assumed, so that about a third of a launch's host time holds the GIL.
GIL_PATTERN = {"encoder": ((128, 512), (128, 512), 12, 15.0),
               "cnn": ((3, 64, 64), (1000,), 10, 6.0),
               "mlp": ((2048,), (2048,), 8, 5.0)}
COPY_GBPS = 55.0  # pinned host <-> H200, each way


# -- part 1: the identity model ------------------------------------------------------------

def identity(x):
    return x


def dynamic_nowait(rows, pipeline=False) -> float:
    batcher = DynamicBatcher(identity, bs.BatchPolicy(MAX_BATCH, 5.0), input_spec=SPEC,
                             pipeline=pipeline)
    res = run_saturated(batcher, len(rows), inputs=torch.stack(rows))
    return res.summary()["throughput_rps"]


def dynamic_clients(rows, clients: int = 256) -> float:
    async def main():
        async with DynamicBatcher(identity, bs.BatchPolicy(MAX_BATCH, 5.0),
                                  input_spec=SPEC) as b:
            async def client(j):
                for x in rows[j::clients]:
                    await b.submit(x)

            t0 = time.perf_counter()
            await asyncio.gather(*(client(j) for j in range(clients)))
            return len(rows) / (time.perf_counter() - t0)

    return asyncio.run(main())


def dynamic_tasks(rows, chunk: int = 4096) -> float:
    async def main():
        async with DynamicBatcher(identity, bs.BatchPolicy(MAX_BATCH, 5.0),
                                  input_spec=SPEC) as b:
            t0 = time.perf_counter()
            for i in range(0, len(rows), chunk):
                await asyncio.gather(*(b.submit(x) for x in rows[i:i + chunk]))
            return len(rows) / (time.perf_counter() - t0)

    return asyncio.run(main())


def naive_polled(rows) -> float:
    res = run_saturated(InferenceBatcher(identity, MAX_BATCH, 5.0), len(rows),
                        inputs=torch.stack(rows))
    return res.summary()["throughput_rps"]


def offline(rows) -> float:
    t0 = time.perf_counter()
    batch_inference(identity, rows, MAX_BATCH)
    return len(rows) / (time.perf_counter() - t0)


def bench_identity(n: int, repeats: int) -> None:
    rows = list(SPEC.random(n).unbind(0))
    runs = {"DynamicBatcher, submit_nowait": dynamic_nowait,
            "DynamicBatcher, submit_nowait, pipeline": lambda r: dynamic_nowait(r, True),
            "DynamicBatcher, 256 clients await submit": dynamic_clients,
            "DynamicBatcher, a new task per request": dynamic_tasks,
            "naive polled InferenceBatcher (1 ms poll)": naive_polled,
            "offline batch_inference": offline}
    rps = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            with collector_paused():  # as run_saturated has it, for every variant alike
                rps[name].append(fn(rows))
    med = {name: statistics.median(v) for name, v in rps.items()}
    ref = med["DynamicBatcher, submit_nowait"]
    print(f"identity model on CPU, max_batch_size={MAX_BATCH}, {n} requests, "
          f"median of {repeats}, torch {torch.__version__}")
    for name, v in med.items():
        spread = f"[{min(rps[name]):,.0f} .. {max(rps[name]):,.0f}]"
        print(f"  {name:<44} {v:>11,.0f} req/s {spread:>26}  "
              f"DynamicBatcher/this = {ref / v:5.2f}")
    verdict = "meets" if ref >= 100_000 else "misses"
    print(f"DynamicBatcher overhead {1e6 / ref:.2f} us/request: {verdict} the "
          f"100,000 req/s target")


# -- part 2: the H200 stand-in --------------------------------------------------------------

class _Engine:
    """One FIFO device engine: work queues behind the work handed to it earlier."""

    def __init__(self):
        self.lock = threading.Lock()
        self.free_s = 0.0

    def run(self, ready_s: float, work_s: float) -> float:
        with self.lock:
            self.free_s = max(self.free_s, ready_s) + work_s
            return self.free_s


class VirtualGpu:
    """A zoo model on the H200, as its host sees it: launches that hold the GIL, then a wait.

    Calling it runs a batch to the end (a thread per worker); ``launch``/``wait`` split
    it the way CUDA does (the pipeline). The device's compute time is the linear fit
    of the compute-only profile where it grows with ``b`` (below that the H200 is
    launch-bound: ``s(b)`` is the host's launch time ``s(1)``).
    """

    def __init__(self, name: str, dtype: str):
        s_ms = json.loads(COMPUTE_ONLY.read_text())["s_ms"][f"{name}/{dtype}"]
        sizes = np.array(sorted(map(int, s_ms)))
        times = np.array([s_ms[str(b)] for b in sizes])
        self.launch_s = times[0] / 1e3
        grows = times > 1.5 * times[0]
        slope, base = np.polyfit(sizes[grows], times[grows], 1) if grows.sum() >= 2 else (0, 0)
        self.compute_ms = lambda b: max(base + slope * b, 0.3 * times[0])
        shape_in, self.out_shape, self.calls, gil_us = GIL_PATTERN[name]
        self.gil_s = gil_us / 1e6
        self.dtype = getattr(torch, dtype)
        self.input_spec = InputSpec(shape_in, self.dtype)
        self.zoo_name = f"standin-{name}"
        self.in_bytes = math.prod(shape_in) * self.dtype.itemsize
        self.out_bytes = math.prod(self.out_shape) * self.dtype.itemsize
        self.h2d, self.compute, self.d2h = _Engine(), _Engine(), _Engine()
        self._tick = torch.zeros(1)
        self.launches, self.launching_s = 0, 0.0  # how long launches took (GIL waits too)

    def launch(self, b: int) -> float:
        """Launch a batch of ``b`` from this thread; the instant it will be done."""
        t0 = time.perf_counter()
        copied_s = self.h2d.run(t0, 1e-5 + b * self.in_bytes / COPY_GBPS / 1e9)
        for _ in range(self.calls):
            held_until = time.perf_counter() + self.gil_s
            while time.perf_counter() < held_until:  # Python work: holds the GIL
                pass
            self._tick.add_(1)                        # a torch call: releases the GIL
        self.wait(t0 + self.launch_s)                 # the rest of the launch, in C++
        launched_s = time.perf_counter()
        self.launches += 1
        self.launching_s += launched_s - t0
        done_s = max(self.compute.run(copied_s, self.compute_ms(b) / 1e3), launched_s)
        return self.d2h.run(done_s, 1e-5 + b * self.out_bytes / COPY_GBPS / 1e9)

    def mean_launch_us(self) -> float:
        """Mean host time of the launches since the last call (then starts over)."""
        mean_us = 1e6 * self.launching_s / max(self.launches, 1)
        self.launches, self.launching_s = 0, 0.0
        return mean_us

    @staticmethod
    def wait(until_s: float) -> None:
        left_s = until_s - time.perf_counter()
        if left_s > 0:
            time.sleep(left_s)

    def output(self, b: int) -> torch.Tensor:
        return torch.empty((b, *self.out_shape), dtype=self.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.wait(self.launch(len(x)))
        return self.output(len(x))

    def offline_peak_rps(self, b: int, seconds: float) -> float:
        """Launch batches back to back from one thread, then wait for the last."""
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            done_s = self.launch(b)
            n += 1
        self.wait(done_s)
        return n * b / (time.perf_counter() - t0)


class _StandInSteps(CudaSteps):
    """DynamicBatcher's CUDA steps with the CUDA calls replaced by the virtual GPU."""

    pinned = False

    def new_slot(self):
        return Slot()

    def allocate(self, slot) -> None:
        HostSteps.allocate(self, slot)

    def launch(self, slot, host_in):
        gpu = self.model_fn
        slot.done_s = gpu.launch(len(host_in))
        return gpu.output(len(host_in))

    def wait(self, slot) -> None:
        self.model_fn.wait(slot.done_s)


class StandInBatcher(DynamicBatcher):
    def _make_steps(self):
        return _StandInSteps(self)


def precise_sleeps() -> None:
    """Let this thread's sleeps, and those of the threads it starts afterwards, end on
    time (``PR_SET_TIMERSLACK`` 1 ns, against Linux's default 50 µs): the stand-in's
    device waits are sleeps, and a CUDA event wait has no such slack."""
    ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)


def bench_standin(configs, repeats: int, seconds: float) -> None:
    precise_sleeps()
    print(f"\nH200 stand-in on CPU ({torch.get_num_threads()} torch threads): saturated "
          f"DynamicBatcher / the stand-in's offline peak, and (in brackets) a launch's host "
          f"time over its time offline, medians of {repeats}")
    variants = {"pipeline x2": (True, 2), "pipeline x4": (True, 4),
                "thread/worker x2": (False, 2), "thread/worker x4": (False, 4)}
    print(f"  {'model':<18} {'b':>4} {'peak req/s':>11} {'launch us':>9}  "
          + "  ".join(f"{k:>16}" for k in variants))
    for name, dtype, b in configs:
        gpu = VirtualGpu(name, dtype)
        inputs = gpu.input_spec.random(64)
        ratio, stretch = ({k: [] for k in variants} for _ in range(2))
        peaks, launch_us = [], []
        for _ in range(repeats):
            with collector_paused():  # as run_saturated has it below
                peaks.append(gpu.offline_peak_rps(b, seconds / 2))
            launch_us.append(gpu.mean_launch_us())
            n = max(20 * b, int(peaks[-1] * seconds))
            for label, (pipeline, workers) in variants.items():
                batcher = StandInBatcher(gpu, bs.BatchPolicy(b, 1.0), workers=workers,
                                         pipeline=pipeline)
                res = run_saturated(batcher, n, inputs=inputs)
                ratio[label].append(res.summary(warmup_frac=0.2)["throughput_rps"] / peaks[-1])
                stretch[label].append(gpu.mean_launch_us() / launch_us[-1])
        med = statistics.median
        cells = "  ".join(f"{med(ratio[k]):>9.2f} ({med(stretch[k]):4.1f})" for k in variants)
        print(f"  {name + '/' + dtype:<18} {b:>4} {statistics.median(peaks):>11,.0f} "
              f"{med(launch_us):>9.0f}  {cells}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=100_000, help="requests per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="20,000 requests, 1 repeat")
    p.add_argument("--standin", action="store_true", help="also the H200 stand-in")
    p.add_argument("--cpu", type=int, default=None,
                   help="run on this one CPU (default: wherever the OS puts the threads)")
    args = p.parse_args(argv)
    if args.cpu is not None:  # before any thread starts: threads inherit it
        run_on_cpus(args.cpu, "--cpu")
    n, repeats = (20_000, 1) if args.quick else (args.n, args.repeats)
    torch.set_num_threads(1)  # nothing to compute; keep OpenMP from competing
    bench_identity(n, repeats)
    if args.standin:
        configs = [("encoder", "bfloat16", 32), ("encoder", "bfloat16", 128),
                   ("cnn", "bfloat16", 32), ("cnn", "bfloat16", 128),
                   ("mlp", "float32", 32)]
        bench_standin(configs, repeats, 0.5 if args.quick else 1.5)


if __name__ == "__main__":
    main()
