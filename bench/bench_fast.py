"""One run, fast engine against SimPy on the same configuration, side by side.

Target (issue 3): at least 30x faster at mean batch size >= 8. Each configuration runs
both engines alternately (so both see the same machine load), 5 times each, and prints
the medians and their ratio; the runs are also checked to be the same. Each run starts
after a garbage collection, so that neither pays for the other's garbage (SimPy leaves
cycles behind). Exit code 1 if a plain policy (no queue bound, no timeout) with mean
batch size >= 8 misses the target. The last-but-one line, with every optional feature
on, is shown for information: queue bounds and timeouts cost rule calls per batch.

    .venv/bin/python bench/bench_fast.py
"""

import argparse
import gc
import statistics
import sys
import time

import numpy as np

import batchsim as bs

SERVICE = bs.AffineService(base_ms=1.9, per_item_ms=0.14)
N = 100_000
REPEATS = 5
TARGET = 30.0
CONFIGS = [  # (policy, load as a fraction of capacity, workers, service)
    (bs.BatchPolicy(32, 5.0), 0.5, 1, SERVICE),
    (bs.BatchPolicy(32, 0.0), 0.8, 1, SERVICE),
    (bs.BatchPolicy(16, 2.0), 0.7, 1, SERVICE),
    (bs.BatchPolicy(64, 10.0), 0.7, 1, SERVICE),
    (bs.BatchPolicy(32, 5.0), 0.7, 4, SERVICE),
    (bs.BatchPolicy(32, 2.0, max_queue_size=256, timeout_ms=20.0), 0.9, 2,
     bs.AffineService(1.9, 0.14, jitter_cv=0.3)),
    (bs.BatchPolicy(8, 1.0), 0.5, 1, SERVICE),
]


def timed(engine, workload, policy, service, workers):
    gc.collect()   # neither engine pays for the garbage the other left behind
    t0 = time.perf_counter()
    res = bs.simulate(workload, policy, service, N, workers=workers, seed=1, engine=engine)
    return time.perf_counter() - t0, res


def main() -> int:
    print(f"{N:,} requests per run, median of {REPEATS}; target >= {TARGET:g}x at mean batch "
          f">= 8")
    print(f"{'policy':<50} {'load':>4} {'wrk':>3} {'mean_b':>6} {'simpy_s':>8} {'fast_s':>7}"
          f" {'ratio':>6}")
    missed = 0
    for policy, load, workers, service in CONFIGS:
        workload = bs.Poisson(load * service.capacity_rps(policy.max_batch_size, workers))
        fast_s, simpy_s = [], []
        for _ in range(REPEATS):
            t, fast = timed("fast", workload, policy, service, workers)
            fast_s.append(t)
            t, simpy = timed("simpy", workload, policy, service, workers)
            simpy_s.append(t)
        assert np.array_equal(fast.size, simpy.size) and np.allclose(
            fast.finish_s, simpy.finish_s, rtol=0, atol=1e-9, equal_nan=True)
        mean_b = fast.size.mean()
        ratio = statistics.median(simpy_s) / statistics.median(fast_s)
        plain = policy.max_queue_size is None and policy.timeout_ms is None
        verdict = ("" if mean_b < 8 else "(info)" if not plain
                   else "ok" if ratio >= TARGET else "MISSED")
        missed += verdict == "MISSED"
        label = (f"b={policy.max_batch_size} wait={policy.max_wait_ms:g}ms"
                 + (f" queue<={policy.max_queue_size}" if policy.max_queue_size else "")
                 + (f" timeout={policy.timeout_ms:g}ms" if policy.timeout_ms else "")
                 + (f" jitter={service.jitter_cv:g}" if service.jitter_cv else ""))
        print(f"{label:<50} {load:>4} {workers:>3} {mean_b:>6.1f} "
              f"{statistics.median(simpy_s):>8.3f} {statistics.median(fast_s):>7.4f} "
              f"{ratio:>5.1f}x {verdict}")
    return 1 if missed else 0


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__,  # --help; no options
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    sys.exit(main())
