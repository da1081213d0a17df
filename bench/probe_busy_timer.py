"""Does the event loop's timer get in while a batch runs? Left to idle, under a PM QoS
request, and beside a spinner at idle priority, on one CPU.

A one-worker ``DynamicBatcher`` serves full batches of a zoo model back to back. Right
after each dispatch a task on the loop sleeps half a millisecond (asyncio rounds the
sleep up to the next millisecond) and then sends 16 requests, which wait for the next
batch. Per condition and round the probe prints the share of batches whose 16 reached
the batcher before the batch's end (the loop got the core and the interpreter back
while the worker ran), when (us after the dispatch), the median batch and the median
gap from a batch's end to the next one's start (the release).

The conditions, in a seeded random order per round: the CPU left to idle; kept awake
by ``batchsim.cpus.kept_awake`` (a PM QoS request of no wake-up latency: the idle CPU
polls); and kept awake by a separate process spinning at ``SCHED_IDLE`` priority on the
same CPU, as ``kept_awake`` did before. A batch must outlast the timer by a few hundred
microseconds for the probe to say anything: the tiny encoder's batches of 64 do.

Run: ``.venv/bin/python bench/probe_busy_timer.py --cpu 0 --nice -10 [--model encoder]
[--batch 64] [--rounds 3] [--out FILE]`` (root, Linux).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import subprocess
import sys

import numpy as np
from bench_fidelity import add_machine_args, settle_machine, write_report

#: Requests the timer's task sends during each batch.
SENT = 16
#: The timer's delay after each dispatch (s): asyncio sleeps to the next millisecond.
DELAY_S = 0.0005
#: A busy loop at the lowest priority Linux has, pinned to the CPU given as its argument,
#: ending when the process that started it does: what ``kept_awake`` ran before.
SPINNER = """
import os, sys
parent = os.getppid()
os.sched_setaffinity(0, {int(sys.argv[1])})
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
while os.getppid() == parent:
    for _ in range(100_000):
        pass
"""


@contextlib.contextmanager
def spinning(cpu: int):
    """A spinner at ``SCHED_IDLE`` priority on ``cpu`` while the block runs."""
    spinner = subprocess.Popen([sys.executable, "-c", SPINNER, str(cpu)])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


async def serve(model, batch: int, n_batches: int):
    """Full batches back to back; during each, a task sleeps ``DELAY_S`` and sends
    ``SENT`` requests (they top the next batch up)."""
    import batchsim as bs
    from batchsim.real import DynamicBatcher

    rows = list(model.input_spec.random(64).unbind(0))
    server = DynamicBatcher(model, bs.BatchPolicy(batch, math.inf))
    await server.start(warmup=True)

    async def later():
        await asyncio.sleep(DELAY_S)
        for j in range(SENT):
            server.submit_nowait(rows[j % len(rows)])

    waiting, sender = 0, None
    for _ in range(n_batches):
        futures = [server.submit_nowait(rows[j % len(rows)]) for j in range(batch - waiting)]
        sender = asyncio.get_running_loop().create_task(later())
        await asyncio.gather(*futures)
        waiting = SENT
    await sender                      # its sends top up the last batch
    for j in range(batch - waiting):
        server.submit_nowait(rows[j % len(rows)])
    await server.close()
    return server.result()


def timer_report(res, warm: int = 4) -> dict:
    """Per batch after the first ``warm``: whether the timer's first send reached the
    batcher before the batch's end, and when; the median batch and release."""
    start_s, end_s, a = res.start_s[warm:-1], res.end_s[warm:-1], res.arrival_s
    first = np.searchsorted(a, start_s, "right")        # the timer's first send
    sent_s = a[np.minimum(first, a.size - 1)]
    inside = (first < a.size) & (sent_s < end_s)
    return {"batches": int(start_s.size), "inside_share": float(inside.mean()),
            "sent_us_p50": (1e6 * float(np.median((sent_s - start_s)[inside]))
                            if inside.any() else float("nan")),
            "batch_us_p50": 1e6 * float(np.median(end_s - start_s)),
            "release_us_p50": 1e6 * float(np.median(res.start_s[warm + 1:] - end_s))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="encoder", choices=["mlp", "cnn", "encoder"])
    p.add_argument("--batch", type=int, default=64, help="max_batch_size (default 64)")
    p.add_argument("--batches", type=int, default=150, help="per condition and round")
    p.add_argument("--rounds", type=int, default=3)
    add_machine_args(p)
    p.add_argument("--out", default=None, help="results JSON")
    args = p.parse_args()
    if args.cpu is None or args.keep_awake:
        raise SystemExit("give --cpu (one CPU) and not --keep-awake: the probe keeps the CPU "
                         "awake in each of its ways in turn itself")
    settle_machine(args)
    if len(args.cpu) != 1:
        raise SystemExit(f"give one CPU in --cpu, got {args.cpu}")
    from batchsim.cpus import kept_awake
    from batchsim.real import make_model

    cpu = args.cpu[0]
    model = make_model(args.model, size="tiny")
    ways = {"idle": contextlib.nullcontext, "request": lambda: kept_awake(cpu, "--cpu"),
            "spinner": lambda: spinning(cpu)}
    rounds = []
    for k in range(args.rounds):
        order = list(ways)
        random.Random(k).shuffle(order)
        report = {}
        for way in order:
            with ways[way]():
                report[way] = timer_report(asyncio.run(serve(model, args.batch, args.batches)))
            r = report[way]
            print(f"round {k + 1}, {way:8s}: timer in before the batch's end in "
                  f"{r['inside_share']:.2f} of {r['batches']} batches (at {r['sent_us_p50']:.0f} "
                  f"us); batch {r['batch_us_p50']:.0f} us, release {r['release_us_p50']:.0f} us",
                  flush=True)
        rounds.append(report)
    write_report({"model": args.model, "batch": args.batch, "cpu": args.cpu,
                  "nice": args.nice, "rounds": rounds}, args.out)


if __name__ == "__main__":
    main()
