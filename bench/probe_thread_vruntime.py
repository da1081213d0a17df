"""Who gets the core at the load generator's yield: the Linux scheduler's fair share
between the event loop's thread and the worker's, on one CPU.

On one CPU a load generator that has fallen behind sends ``MAX_BURST`` requests, yields
and goes on; at some of those yields the worker's thread takes the core and keeps it to
its batch's end, and at a batch's end the generator's queued turn may go first and the
worker take the core again, one turn a batch (``bench_worker_pickup.py``: in the tiny
MLP's burst sets, not in its Poisson sets nor in the calibration's runs). The kernel's
fair scheduler (EEVDF since Linux 6.6) picks between two runnable threads by their
virtual runtimes: the one that has had less of the core comes first. This probe serves
``run_load`` traffic on ``--cpu`` (kept awake, as the fidelity bench runs) while a
sampler process on ``--sampler-cpu`` reads every thread's ``se.vruntime`` from
``/proc/PID/task/TID/sched`` (kernels with ``CONFIG_SCHED_DEBUG``), a sample per
thread every few tens of microseconds. For each arrival case it reports, at the
generator's first yield after a full turn while a dispatched batch waited for its worker
(``yields_taken``: taken if the worker picked it up within ``TAKEN_US``) and at its full
turns made at a batch's end before the next dispatch (``chain_turns``: held if its next
turn waited for that batch's end):

* ``loop_ahead_share``: the share made with the loop's virtual runtime ahead of the
  worker's (the worker had had less of the core); ``lead_us_p90``, the 90th percentile
  of the loop's lead there (us; negative: behind);
* ``taken_ahead`` / ``taken_behind`` and ``held_ahead`` / ``held_behind``: the share
  taken (held) with the loop ahead and with it not ahead; NaN where none;
* ``loop_cpu_ms`` and ``worker_cpu_ms``: each thread's time on the core over the run.

On one CPU kept awake (Linux 6.18, the tiny MLP at 64 and 1 ms, two runs:
``bench/results/README.md``) the worker took the core at 74-86% of the first yields in
the burst sets where the loop was ahead and at 1-11% where it was not; with the loop
ahead the chain held at 99-100% of its turns. The bursts put the loop ahead at 37-71% of
them, Poisson traffic (at 0.9 and at 1.1 of the capacity) at 2-3%. The samples are tens
of microseconds apart, so a lead of a few tens of microseconds is within their error.

The cases are ``KIND:LOAD`` (``bursty`` or ``poisson``, the fidelity grid's arrival
processes, at LOAD times the capacity a saturated run measures first) under one policy.
The simulator knows nothing of this: it reads real runs only.

Run: ``.venv/bin/python bench/probe_thread_vruntime.py --cpu 0 --nice -10
[--sampler-cpu 1] [--model mlp] [--cases bursty:0.9,poisson:0.9,poisson:1.1]
[--out FILE]`` (root for the nice and the CPU kept awake; Linux).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from bench_fidelity import add_machine_args, settle_machine, workloads, write_report
from bench_loop_turns import share
from bench_worker_pickup import chain_turns, yields_taken

#: The sampler: the ``se.vruntime`` and ``se.sum_exec_runtime`` (ms) of every thread of
#: the process given, with the instant read (``perf_counter``, s), until it is stopped;
#: then saved to the file.
SAMPLER = """
import signal
signal.signal(signal.SIGTERM, signal.default_int_handler)
import os, sys, time
import numpy as np
os.sched_setaffinity(0, {int(sys.argv[3])})
base, rows, tids, scanned = f"/proc/{sys.argv[1]}/task", [], [], -1.0
open(sys.argv[2] + ".ready", "w").close()
try:
    while True:
        now = time.perf_counter()
        if now - scanned > 0.2:
            tids, scanned = [int(t) for t in os.listdir(base)], now
        for tid in tids:
            try:
                with open(f"{base}/{tid}/sched") as f:
                    text = f.read()
            except (FileNotFoundError, ProcessLookupError):   # the thread has ended
                continue
            at = time.perf_counter()
            got = {k.strip(): float(v) for k, v in (line.split(":", 1) for line in
                   text.splitlines() if line.startswith(("se.vruntime", "se.sum_exec")))}
            if len(got) == 2:                                  # else cut short as it ended
                rows.append((at, tid, got["se.vruntime"], got["se.sum_exec_runtime"]))
except (FileNotFoundError, ProcessLookupError, KeyboardInterrupt):
    pass
finally:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # the stop came: save what was read
    np.save(sys.argv[2], np.array(rows, float).reshape(-1, 4))
"""
#: Seconds of traffic per case: the fidelity grid's rows run 1.5 s at least.
DURATION_S = 1.5


def sampled_ms(samples: np.ndarray, tid: int, column: int, at_s) -> np.ndarray:
    """Thread ``tid``'s sampled ``column`` (2: virtual runtime, 3: time on a core; ms)
    at ``at_s`` (``perf_counter`` s), linear between the samples around each instant;
    zeros for a thread never sampled."""
    mine = samples[samples[:, 1] == tid]
    return np.interp(at_s, mine[:, 0], mine[:, column]) if mine.size else np.zeros(np.shape(at_s))


def vruntime_ms(samples: np.ndarray, tid: int, at_s: np.ndarray) -> np.ndarray:
    """Thread ``tid``'s virtual runtime (ms) at ``at_s``."""
    return sampled_ms(samples, tid, 2, at_s)


def cpu_ms(samples: np.ndarray, tid: int, span_s: tuple[float, float]) -> float:
    """The time (ms) thread ``tid`` had on a core over ``span_s`` (``perf_counter`` s)."""
    return float(np.diff(sampled_ms(samples, tid, 3, span_s))[0])


def busiest_thread(samples: np.ndarray, span_s: tuple[float, float], but: int) -> int:
    """The thread but ``but`` that had the core longest over ``span_s``: the worker's."""
    others = [int(t) for t in np.unique(samples[:, 1]) if t != but]
    return max(others, key=lambda tid: cpu_ms(samples, tid, span_s))


def case_report(res, t0_s: float, samples: np.ndarray, loop_tid: int,
                worker_tid: int) -> dict:
    """The module doc's shares for one run; ``t0_s``: its clock's origin."""
    def lead_ms(at_s):
        at_s = at_s + t0_s
        return vruntime_ms(samples, loop_tid, at_s) - vruntime_ms(samples, worker_tid, at_s)

    yield_s, taken, first = yields_taken(res)
    yield_s, taken = yield_s[first], taken[first]
    chain_s, held = chain_turns(res)
    leads_ms = np.r_[lead_ms(yield_s), lead_ms(chain_s)]
    at_yield, at_chain = leads_ms[:taken.size] > 0, leads_ms[taken.size:] > 0
    return {"first_yields": int(taken.size),
            "loop_ahead_share": share(leads_ms > 0),
            "lead_us_p90": 1e3 * float(np.percentile(leads_ms, 90)) if leads_ms.size
            else float("nan"),
            "taken_ahead": share(taken[at_yield]), "taken_behind": share(taken[~at_yield]),
            "chain_turns": int(held.size),
            "held_ahead": share(held[at_chain]), "held_behind": share(held[~at_chain])}


def wait_for(marker: Path, sampler: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Wait until the sampler has started sampling (it creates ``marker``)."""
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        if sampler.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the sampler did not start (exit code {sampler.returncode})")
        time.sleep(0.01)


def parse_cases(text: str) -> list[tuple[str, float]]:
    """``bursty:0.9,poisson:1.1`` -> ``[("bursty", 0.9), ("poisson", 1.1)]``."""
    cases = []
    for item in text.split(","):
        kind, _, load = item.partition(":")
        if kind not in ("bursty", "poisson") or not load:
            raise SystemExit(f"--cases: each case is bursty:LOAD or poisson:LOAD, got {item!r}")
        try:
            cases.append((kind, float(load)))
        except ValueError:
            raise SystemExit(f"--cases: LOAD must be a number, got {item!r}") from None
    return cases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_machine_args(p, awake_by_default=True)
    p.add_argument("--sampler-cpu", type=int, default=1,
                   help="the CPU the sampler reads on (default %(default)s)")
    p.add_argument("--model", default="mlp", choices=["mlp", "cnn", "encoder"])
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--max-wait-ms", type=float, default=1.0)
    p.add_argument("--cases", default="bursty:0.9,poisson:0.9,poisson:1.1",
                   help="KIND:LOAD, comma separated (default %(default)s)")
    p.add_argument("--out", default=None, help="also write the report as JSON")
    args = p.parse_args()
    cases = parse_cases(args.cases)
    if not Path("/proc/self/sched").exists():
        raise SystemExit("this probe reads /proc/PID/task/TID/sched: a Linux kernel built "
                         "with CONFIG_SCHED_DEBUG")
    settle_machine(args)
    if args.cpu is not None and args.sampler_cpu in args.cpu:
        raise SystemExit(f"--sampler-cpu must be another CPU than --cpu {args.cpu}, "
                         f"got {args.sampler_cpu}")

    import batchsim as bs
    from batchsim.real import DynamicBatcher, make_model, run_load, run_saturated

    model = make_model(args.model, size="tiny")
    policy = bs.BatchPolicy(args.max_batch_size, args.max_wait_ms)
    sat = run_saturated(model, 2000, bs.BatchPolicy(args.max_batch_size, float("inf")))
    capacity_rps = sat.summary()["throughput_rps"]
    shapes = workloads()
    loop_tid = threading.get_native_id()   # run_load runs its loop on this thread
    report = {"model": args.model, "policy": str(policy), "capacity_rps": capacity_rps,
              "cpu": args.cpu, "sampler_cpu": args.sampler_cpu, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for k, (kind, load) in enumerate(cases):
            shape, seed = shapes[kind]
            rate_rps = load * capacity_rps
            batcher = DynamicBatcher(model, policy)
            out = Path(tmp) / f"samples_{k}.npy"
            sampler = subprocess.Popen([sys.executable, "-c", SAMPLER, str(os.getpid()),
                                        str(out), str(args.sampler_cpu)])
            try:
                wait_for(Path(f"{out}.ready"), sampler)
                res = run_load(batcher, shape.with_rate(rate_rps),
                               n_requests=round(rate_rps * DURATION_S), seed=seed)
            finally:
                sampler.terminate()
                sampler.wait()
            samples = np.load(out)
            t0_s = batcher.clock.t0_s
            span_s = (t0_s + res.start_s[0], t0_s + res.end_s[-1])
            worker_tid = busiest_thread(samples, span_s, loop_tid)
            name = f"{kind}:{load:g}"
            report["cases"][name] = {
                "rate_rps": rate_rps,
                **case_report(res, t0_s, samples, loop_tid, worker_tid),
                "loop_cpu_ms": cpu_ms(samples, loop_tid, span_s),
                "worker_cpu_ms": cpu_ms(samples, worker_tid, span_s)}
            print(name, {key: round(v, 3) for key, v in report["cases"][name].items()},
                  flush=True)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
