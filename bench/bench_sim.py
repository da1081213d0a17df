"""Simulated requests per second of the SimPy engine, for a few configurations.

Target (issue 2): 100,000 requests at max_batch_size=32 in under one second on a 2-core
machine. Prints the median of 5 runs per configuration.

    .venv/bin/python bench/bench_sim.py
"""

import argparse
import statistics
import time

import batchsim as bs

SERVICE = bs.AffineService(base_ms=1.9, per_item_ms=0.14)
N = 100_000
CONFIGS = [  # (max_batch_size, max_wait_ms, load as a fraction of capacity, workers)
    (32, 5.0, 0.7, 1),
    (32, 0.0, 0.7, 1),
    (8, 2.0, 0.5, 1),
    (1, 0.0, 0.5, 1),
    (32, 5.0, 0.7, 4),
]


def main():
    print(f"{'b':>4} {'wait_ms':>8} {'load':>5} {'workers':>7} {'median_s':>9} {'req/s':>10}"
          f" {'mean_batch':>10}")
    for b, wait_ms, load, workers in CONFIGS:
        rate = load * SERVICE.capacity_rps(b, workers)
        policy = bs.BatchPolicy(b, wait_ms)
        times = []
        for seed in range(5):
            t0 = time.perf_counter()
            res = bs.simulate(bs.Poisson(rate), policy, SERVICE, n_requests=N, workers=workers,
                              seed=seed, engine="simpy")
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        print(f"{b:>4} {wait_ms:>8} {load:>5} {workers:>7} {med:>9.3f} {N / med:>10.0f}"
              f" {res.summary()['mean_batch_size']:>10.2f}")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__,  # --help; no options
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
