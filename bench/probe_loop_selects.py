"""When the batcher's event loop wakes during open-loop runs, logged at its selector.

The simulator's sender model (``simulate(..., sender="loop")``) says when the load
generator's loop sleeps and wakes: asyncio rounds every sleep up to whole milliseconds,
so a timer due during a batch shorter than that fires only after the batch has ended
and woken the loop. This probe checks that on the real batcher. It runs
``DynamicBatcher`` open loop on a loop built on a selector that logs each ``select``
call (``asyncio.SelectorEventLoop`` takes any selector), then counts, per run:

* the timer wake-ups (a ``select`` that slept and returned no event) that came while a
  batch ran, and those while the worker was idle;
* how late the idle ones fired past their timeout rounded up to a whole millisecond
  (``BatcherCosts.timer_latency_ms`` in a calibration);
* the batches that received no request while they ran, and those that received some:
  with no timer wake-up inside a batch, those requests were all sent in the loop's turn
  right after the dispatch, and the batch waited for that turn.

Rates are fractions of the saturated throughput at each max_batch_size. Run:
``.venv/bin/python bench/probe_loop_selects.py [--model cnn] [--cpu 0] [--nice -10]``;
``--quick`` for a smoke run of seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import selectors
import time

import numpy as np

from batchsim.calibrate import _received_during  # the count the calibration fits on

#: (max_batch_size, max_wait_ms, load) of the runs, then the arrival process.
CONFIGS = ((4, 0.0, 0.5), (16, 1.0, 0.2), (16, 1.0, 0.5), (16, 0.0, 0.7), (64, 0.0, 0.5),
           (64, 1.0, 0.2), (64, 1.0, 0.7))
#: A ``select`` that took longer than this slept.
SLEPT_S = 20e-6


class LoggingSelector(selectors.DefaultSelector):
    """The default selector, logging ``(entered_s, returned_s, timeout_s, events)``."""

    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def select(self, timeout=None):
        entered = time.perf_counter()
        ready = super().select(timeout)
        self.log.append((entered, time.perf_counter(), math.inf if timeout is None
                         else timeout, len(ready)))
        return ready


class LoggingPolicy(asyncio.DefaultEventLoopPolicy):
    """New event loops log their selector's calls into ``log``."""

    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def new_event_loop(self):
        return asyncio.SelectorEventLoop(LoggingSelector(self.log))


def wakes(res, log: np.ndarray) -> dict:
    """What the loop did during ``res``: ``log`` rows on the batcher's clock."""
    entered, returned, timeout, events = log.T
    timer = (returned - entered > SLEPT_S) & (events == 0) & np.isfinite(timeout)
    k = np.searchsorted(res.start_s, returned, "right") - 1
    in_batch = (k >= 0) & (returned < res.end_s[np.maximum(k, 0)])
    whole_ms_s = np.ceil(timeout * 1e3 - 1e-9) / 1e3
    late_us = 1e6 * (returned - entered - whole_ms_s)[timer & ~in_batch]
    during = _received_during(res)
    return {"batches": int(res.size.size), "timer_wakes_in_batch": int((timer & in_batch).sum()),
            "timer_wakes_idle": int((timer & ~in_batch).sum()),
            "idle_wake_late_us_p50": float(np.median(late_us)) if late_us.size else math.nan,
            "batches_receiving": int((during > 0).sum()),
            "received_per_receiving_batch": float(during[during > 0].mean())
            if (during > 0).any() else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="cnn", choices=("mlp", "cnn", "encoder"))
    p.add_argument("--cpu", type=int, default=None, help="run on this one CPU")
    p.add_argument("--nice", type=int, default=0, help="os.nice increment (negative: root)")
    p.add_argument("--quick", action="store_true", help="short runs (a smoke test)")
    args = p.parse_args()
    if args.nice:
        os.nice(args.nice)
    if args.cpu is not None:  # before any thread starts: threads inherit it
        from batchsim.cpus import run_on_cpus
        run_on_cpus(args.cpu, "--cpu")

    import torch
    torch.set_num_threads(1)
    import batchsim as bs
    from batchsim.real import DynamicBatcher, make_model, run_load, run_saturated
    from batchsim.real.profiler import device_name

    model = make_model(args.model, size="tiny")
    sat_rps = {b: run_saturated(model, 300 if args.quick else 2000, bs.BatchPolicy(
        b, math.inf)).summary()["throughput_rps"] for b in sorted({c[0] for c in CONFIGS})}
    cpus = sorted(os.sched_getaffinity(0))
    print(f"{device_name('cpu')}, torch {torch.__version__}, CPUs {cpus}")
    print(f"tiny {args.model}, saturated (requests/s): "
          + ", ".join(f"{r:,.0f} at max_batch_size {b}" for b, r in sat_rps.items()))
    print("arrivals max_b wait_ms load | batches | timer wake-ups in a batch / idle | idle "
          "wake past the whole ms (us) | batches receiving requests, requests each")
    log: list = []
    asyncio.set_event_loop_policy(LoggingPolicy(log))
    try:
        for name, shape in (("poisson", bs.Poisson(1.0)),
                            ("bursty", bs.Bursty(4.0, 0.25, 0.02, 0.06))):
            for b, wait_ms, load in CONFIGS:
                server = DynamicBatcher(model, bs.BatchPolicy(b, wait_ms))
                rate = load * sat_rps[b]
                log.clear()
                res = run_load(server, shape.with_rate(rate), n_requests=200 if args.quick
                               else max(1000, round(1.5 * rate)), seed=1)
                t0 = time.perf_counter() - server.now_s()
                w = wakes(res, np.asarray(log, float) - [t0, t0, 0, 0])
                print(f"{name:8s} {b:5d} {wait_ms:7.1f} {load:4.1f} | {w['batches']:7d} | "
                      f"{w['timer_wakes_in_batch']:6d} / {w['timer_wakes_idle']:6d} | "
                      f"{w['idle_wake_late_us_p50']:8.0f} | {w['batches_receiving']:6d}, "
                      f"{w['received_per_receiving_batch']:.1f}")
    finally:
        asyncio.set_event_loop_policy(None)


if __name__ == "__main__":
    main()
