"""Slider feel: how long notebook 01's dashboard takes to re-simulate and redraw.

Target (issue 3): the callback that re-simulates and redraws notebook 01's figure at its
default size returns in under 150 ms (median). Each sample moves one slider, which runs
the whole callback (simulate, draw the timeline, histogram and batch sizes, render the
PNG). Prints the median and 90th percentile per slider, and the median over all of
them against the target.

    .venv/bin/python bench/bench_slider.py
"""

import argparse
import statistics
import time

import matplotlib

matplotlib.use("Agg")

from batchsim.viz import basics_dashboard  # noqa: E402

MOVES = {  # slider -> values it cycles through
    "max_batch_size": [16, 32, 24, 48],
    "max_wait_ms": [1.0, 2.0, 4.0, 0.5],
    "load": [0.5, 0.7, 0.9, 0.3],
    "workers": [2, 1, 3, 1],
}
REPEATS = 5  # rounds through every slider's values


def timed_moves(dash) -> dict[str, list[float]]:
    """Wall-clock seconds of each callback, per slider."""
    times = {name: [] for name in MOVES}
    for _ in range(REPEATS):
        for name, values in MOVES.items():
            for value in values:
                t0 = time.perf_counter()
                dash.controls[name].value = value
                times[name].append(time.perf_counter() - t0)
                assert dash.error is None, dash.error
    return times


def main():
    dash = basics_dashboard()  # notebook 01's default size
    print(f"notebook 01 dashboard, {dash.result.n_requests} requests per run, "
          f"{REPEATS * 4} moves per slider")
    print(f"{'slider':<16} {'median_ms':>10} {'p90_ms':>8}")
    everything = []
    for name, samples in timed_moves(dash).items():
        everything += samples
        p90 = statistics.quantiles(samples, n=10)[-1]
        print(f"{name:<16} {1000 * statistics.median(samples):>10.1f} {1000 * p90:>8.1f}")
    median_ms = 1000 * statistics.median(everything)
    print(f"{'all':<16} {median_ms:>10.1f}   target < 150 ms: "
          f"{'met' if median_ms < 150 else 'NOT met'}")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__,  # --help; no options
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
