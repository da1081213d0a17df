"""How many requests a second DynamicBatcher itself can move: an identity model on CPU.

With a model that does nothing, throughput measures the batcher's own cost per request.
Side by side, on the same inputs, at max_batch_size 64 and under saturation:

* DynamicBatcher fed through ``submit_nowait`` (one future per request, no task);
* DynamicBatcher fed by 256 client tasks, each awaiting ``submit()`` in turn (the way a
  server with a task per connection calls it);
* DynamicBatcher fed through ``await submit()`` in a new asyncio task per request;
* the naive polled InferenceBatcher, driven as tutorials drive it (poll every 1 ms);
* offline ``batch_inference`` (fixed batches of 64, no serving at all).

Target: >= 100,000 requests/s through DynamicBatcher. Prints medians of ``--repeats``.
Run: ``.venv/bin/python bench/bench_batcher_cpu.py`` (``--quick`` for a short run).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

import batchsim as bs
from batchsim.real import DynamicBatcher, InferenceBatcher, InputSpec, batch_inference
from batchsim.real.loadgen import run_saturated

SPEC = InputSpec((16,), torch.float32)
MAX_BATCH = 64


def identity(x):
    return x


def dynamic_nowait(rows) -> float:
    batcher = DynamicBatcher(identity, bs.BatchPolicy(MAX_BATCH, 5.0), input_spec=SPEC)
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=100_000, help="requests per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="20,000 requests, 1 repeat")
    args = p.parse_args(argv)
    n, repeats = (20_000, 1) if args.quick else (args.n, args.repeats)
    torch.set_num_threads(1)  # nothing to compute; keep OpenMP from competing
    rows = list(SPEC.random(n).unbind(0))
    runs = {"DynamicBatcher, submit_nowait": dynamic_nowait,
            "DynamicBatcher, 256 clients await submit": dynamic_clients,
            "DynamicBatcher, a new task per request": dynamic_tasks,
            "naive polled InferenceBatcher (1 ms poll)": naive_polled,
            "offline batch_inference": offline}
    rps = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
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


if __name__ == "__main__":
    main()
