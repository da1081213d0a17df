"""What the event loop's activity during a batch costs that batch, measured directly.

The calibration fits one cost per request sent while a batch runs, on Poisson traffic
(``BatcherCosts.arrival_ms``). This probe separates the loop's work into its parts, with
a one-worker ``DynamicBatcher`` serving full batches of a zoo model back to back:

* ``asleep``: the loop sleeps through the batch (nothing to do until it ends);
* ``timer, n``: the loop sleeps, its timer wakes it during the batch (``call_later``
  half a millisecond after the dispatch: asyncio rounds that up to the next
  millisecond) and it sends ``n`` requests then (``n = 0``: it wakes and does nothing);
* ``at once, n``: the loop sends ``n`` requests right after the dispatch, without
  sleeping first, in one turn of the loop;
* ``one a turn, n``: the same ``n``, one per turn of the loop (a callback that sends
  one and schedules the next; the loop does not sleep between them).

The requests sent during a batch wait for the next one, which is topped up to full. The
configurations are interleaved in a seeded random order; each line is the median time a
batch held its worker. A timer only lands inside batches longer than about a
millisecond (the tiny encoder at 64: yes; the tiny MLP and CNN: no), and those lines
say so.

Run: ``.venv/bin/python bench/probe_loop_wake.py [--model encoder] [--batch 64] [--nice -10]``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random

import numpy as np

COUNTS = (0, 16, 48)
TRIALS = 40


async def serve(model, batch: int, plan: list) -> object:
    """Serve ``len(plan)`` full batches; during each, the loop does what its plan says."""
    import batchsim as bs
    from batchsim.real import DynamicBatcher

    rows = list(model.input_spec.random(64).unbind(0))
    server = DynamicBatcher(model, bs.BatchPolicy(batch, math.inf))
    await server.start(warmup=True)
    loop = asyncio.get_running_loop()

    def send(n: int) -> None:
        for j in range(n):
            server.submit_nowait(rows[j % len(rows)])

    def send_apart(n: int) -> None:
        """One request, then the rest from the loop's next turn (it does not sleep)."""
        if n:
            send(1)
            loop.call_soon(send_apart, n - 1)

    waiting = 0
    for mode, n in plan:
        futures = [server.submit_nowait(rows[j % len(rows)]) for j in range(batch - waiting)]
        if mode == "timer":
            loop.call_later(0.0005, send, n)
        elif mode == "at once":
            loop.call_soon(loop.call_soon, send, n)   # after the decision that dispatches
        elif mode == "one a turn":
            loop.call_soon(loop.call_soon, send_apart, n)
        await asyncio.gather(*futures)
        waiting = n
        await asyncio.sleep(0.002)
    send(batch - waiting)
    await server.close()
    return server.result()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="encoder", choices=["mlp", "cnn", "encoder"])
    p.add_argument("--batch", type=int, default=64, help="max_batch_size (default 64)")
    p.add_argument("--nice", type=int, default=0, help="os.nice increment (negative: root)")
    args = p.parse_args()
    if args.nice:
        os.nice(args.nice)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from batchsim.real import make_model

    torch.set_num_threads(1)
    model = make_model(args.model, size="tiny")
    plan = ([("asleep", 0)] + [("timer", n) for n in COUNTS]
            + [(mode, n) for mode in ("at once", "one a turn") for n in COUNTS if n]) * TRIALS
    random.Random(0).shuffle(plan)
    res = asyncio.run(serve(model, args.batch, plan))
    held_ms = 1e3 * (res.end_s - res.start_s)[:len(plan)]
    a = res.arrival_s
    sent = (np.searchsorted(a, res.end_s, "left")
            - np.searchsorted(a, res.start_s, "right"))[:len(plan)]
    print(f"tiny {args.model}, full batches of {args.batch}: median time a batch held its "
          f"worker ({TRIALS} batches each, the first 4 of the run not counted), and over "
          f"asleep")
    order = ("asleep", "timer", "at once", "one a turn")
    configs = sorted(set(plan), key=lambda c: (order.index(c[0]), c[1]))
    chosen = {c: np.array([step == c for step in plan]) & (np.arange(len(plan)) >= 4)
              for c in configs}
    # Sends at the timer that reached the batcher before the batch ended: the timer fired
    # inside it (for n = 0 there is nothing to see, so this goes by the others).
    inside = min(float(np.mean(sent[m] == n)) for (mode, n), m in chosen.items()
                 if mode == "timer" and n)
    base_ms = None
    for (mode, n), mine in chosen.items():
        median_ms = float(np.median(held_ms[mine]))
        base_ms = median_ms if base_ms is None else base_ms
        note = ("" if mode != "timer" or inside > 0.9 else
                f"  (the timer fired inside only {inside:.0%} of the batches: they are "
                f"shorter than its millisecond)")
        print(f"  {mode:10s} n={n:3d}: {median_ms:.4f} ms, {1e3 * (median_ms - base_ms):+6.1f} µs"
              + note)


if __name__ == "__main__":
    main()
