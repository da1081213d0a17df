"""A 20 x 20 grid (max_batch_size x max_wait_ms) at 100,000 requests per run.

Target (issue 3): the whole grid -- 40 million simulated requests -- in under 10 seconds
on a 2-core machine, with the default executor (all local cores). Prints the median of
3 sweeps beside one sweep in a single thread, and SimPy's time for the grid's middle
configuration (the SimPy grid would take about 400 times that). Exit code 1 if the
median misses the target.

    .venv/bin/python bench/bench_sweep.py
"""

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import batchsim as bs

WORKLOAD = bs.Poisson(2000.0)
SERVICE = bs.AffineService(base_ms=1.9, per_item_ms=0.14)
SIZES = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 112, 128]
WAITS_MS = [0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0,
            12.0, 14.0, 16.0, 18.0, 20.0]
N = 100_000
TARGET_S = 10.0


def grid(executor=None):
    t0 = time.perf_counter()
    df = bs.sweep(WORKLOAD, SERVICE, SIZES, WAITS_MS, n_requests=N, executor=executor,
                  progress=False)
    return time.perf_counter() - t0, df


def main() -> int:
    runs = len(SIZES) * len(WAITS_MS)
    print(f"{runs} runs x {N:,} requests = {runs * N / 1e6:.0f} M requests, "
          f"{os.cpu_count()} cores")
    times = [grid()[0] for _ in range(3)]
    with ThreadPoolExecutor(max_workers=1) as one_thread:
        serial_s, df = grid(one_thread)
    t0 = time.perf_counter()
    bs.simulate(WORKLOAD, bs.BatchPolicy(16, 5.0), SERVICE, N, engine="simpy")
    simpy_s = time.perf_counter() - t0
    median = statistics.median(times)
    print(f"grid, all cores (median of 3): {median:6.2f} s   "
          f"({runs * N / median / 1e6:.1f} M requests/s)   target < {TARGET_S:g} s: "
          f"{'ok' if median < TARGET_S else 'MISSED'}")
    print(f"grid, one thread:              {serial_s:6.2f} s   "
          f"(parallel speed-up {serial_s / median:.2f}x)")
    print(f"SimPy, one run (b=16, 5 ms):   {simpy_s:6.2f} s   "
          f"(x {runs} runs = {simpy_s * runs:.0f} s; {simpy_s * runs / median:.0f}x the grid)")
    print(f"mean batch size over the grid: {df['mean_batch_size'].mean():.1f} "
          f"(min {df['mean_batch_size'].min():.1f}, max {df['mean_batch_size'].max():.1f})")
    return 0 if median < TARGET_S else 1


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__,  # --help; no options
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    sys.exit(main())
