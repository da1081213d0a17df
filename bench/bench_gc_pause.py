"""What Python's garbage collector does to the real batcher, and so to the simulator's error.

``run_load`` keeps the cyclic garbage collector out of a timed run by default
(``pause_gc``). This bench shows why, side by side in one run: it calibrates the
simulator once, then serves bench_fidelity's grid (max_batch_size x max_wait_ms x load,
Poisson and bursty arrivals) twice per configuration on the same arrivals -- once with
the collector paused and once left to Python, in alternating order so that a drift of
the machine falls on both alike -- and simulates those arrivals once. Per arrival process
and mode it prints the median absolute error of p50 and p99 latency against the
simulator, the rows where the load generator fell behind its schedule by more than
``BEHIND_MS`` at p99 (the process stalled), and, for the runs left to Python, how many
collections ran during their ``run_load`` calls and the longest (ms).

The simulator knows nothing of the collector, and the stalls come from the harness's
process: a full collection walks every object it holds (the simulator's, pandas', the
earlier runs'), which a serving process without them would not.

Run: ``.venv/bin/python bench/bench_gc_pause.py [--model cnn|encoder] --cpu 0 --nice -10``
(about 4 minutes; ``--quick`` for seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import os
import time

import numpy as np
from bench_fidelity import add_machine_args, settle_machine, workloads, write_report

import batchsim as bs

MODES = {"paused": True, "python": False}


class CollectionTimer:
    """Times the garbage collections that run while it is installed (a ``gc`` callback)."""

    def __init__(self):
        self.pauses_ms: list[float] = []
        self._started_s = 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._started_s = time.perf_counter()
        else:
            self.pauses_ms.append(1e3 * (time.perf_counter() - self._started_s))

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def summarize(rows: list[dict], behind_ms: float) -> dict:
    """Per mode: median |error| of p50 and p99, the rows whose generator fell behind, and
    the longest the generator was late for a request (ms).

    ``rows``: one dict per configuration with, per mode, ``err_p50``, ``err_p99`` and
    ``lateness_ms_p99`` and ``lateness_ms_max`` (the real generator's) and the simulated
    ``sim_lateness_ms_p99``.
    """
    out = {}
    for mode in MODES:
        out[mode] = {
            "median_abs_err_p50": float(np.median([abs(r[mode]["err_p50"]) for r in rows])),
            "median_abs_err_p99": float(np.median([abs(r[mode]["err_p99"]) for r in rows])),
            "behind": sum(r[mode]["lateness_ms_p99"] > r["sim_lateness_ms_p99"] + behind_ms
                          for r in rows),
            "lateness_ms_max": max(r[mode]["lateness_ms_max"] for r in rows),
            "rows": len(rows)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp", choices=["mlp", "cnn", "encoder"])
    p.add_argument("--quick", action="store_true", help="a smoke run of seconds")
    add_machine_args(p)
    p.add_argument("--out", default=None, help="also write the rows and summaries as JSON")
    args = p.parse_args()
    torch = settle_machine(args)

    from batchsim.calibrate import calibrate, compare
    from batchsim.fidelity import BEHIND_MS
    from batchsim.real import make_model, run_load
    from batchsim.real.profiler import device_name
    from batchsim.sim import simulate

    model = make_model(args.model, size="tiny")
    grid = (((8,), (0.0, 1.0), (0.5,)) if args.quick else
            ((4, 16, 64), (0.0, 1.0), (0.2, 0.5, 0.7, 0.9)))
    duration_s = 0.1 if args.quick else 1.5
    service = calibrate(model, max(grid[0]), seed=0, n_requests=200 if args.quick else 1200)
    print(f"{device_name('cpu')}, torch {torch.__version__}, CPUs "
          f"{sorted(os.sched_getaffinity(0))}, tiny {args.model}; garbage collector "
          f"thresholds {gc.get_threshold()}, {len(gc.get_objects())} objects tracked")
    report = {"model": model.zoo_name, "torch": torch.__version__, "cpu": args.cpu,
              "nice": args.nice, "quick": args.quick, "duration_s": duration_s,
              "grid": dict(zip(("max_batch_size", "max_wait_ms", "load"), grid, strict=True)),
              "behind_ms": BEHIND_MS, "calibration": service.to_dict(), "workloads": {}}
    for name in ("poisson", "bursty"):
        shape, seed = workloads()[name]
        rows, timer = [], CollectionTimer()
        for k, (b, wait_ms, load) in enumerate(itertools.product(*grid)):
            policy = bs.BatchPolicy(b, wait_ms)
            rate = load * service.capacity_rps(b)
            n = max(200, round(rate * duration_s))
            traffic = shape.with_rate(rate)
            order = list(MODES) if k % 2 == 0 else list(MODES)[::-1]
            reals = {}
            for mode in order:
                with timer if mode == "python" else contextlib.nullcontext():
                    reals[mode] = run_load(model, traffic, policy, n_requests=n, seed=seed,
                                           pause_gc=MODES[mode])
            sim = simulate(bs.Trace(reals["paused"].meta["scheduled_s"]), policy, service,
                           seed=seed, sender="loop")
            row = {"max_batch_size": b, "max_wait_ms": wait_ms, "load": load,
                   "sim_lateness_ms_p99": float(np.percentile(
                1e3 * (sim.arrival_s - sim.meta["sent_s"]), 99))}
            for mode, real in reals.items():
                c = compare(real, sim).row()
                row[mode] = {"err_p50": c["err_latency_ms_p50"],
                             "err_p99": c["err_latency_ms_p99"],
                             "lateness_ms_p99": real.meta["lateness_ms_p99"],
                             "lateness_ms_max": real.meta["lateness_ms_max"]}
            rows.append(row)
        s = summarize(rows, BEHIND_MS)
        pauses = np.asarray(timer.pauses_ms or [0.0])
        for mode, m in s.items():
            print(f"{name:8s} {mode:6s}: median |error| p50 {m['median_abs_err_p50']:.1%}, "
                  f"p99 {m['median_abs_err_p99']:.1%}; generator behind in {m['behind']} of "
                  f"{m['rows']}, at most {m['lateness_ms_max']:.1f} ms late", flush=True)
        print(f"{name:8s} left to Python: {len(timer.pauses_ms)} collections during its "
              f"run_load calls, longest {pauses.max():.1f} ms, {(pauses > 10).sum()} over 10 ms",
              flush=True)
        report["workloads"][name] = {"seed": seed, "summary": s, "rows": rows,
                                     "python_collection_ms": timer.pauses_ms}
        write_report(report, args.out)


if __name__ == "__main__":
    main()
