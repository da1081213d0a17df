"""Does profiling a model slow the batcher that serves it afterwards?

``profile_model`` times the model on a thread of its own, as ``DynamicBatcher``'s
workers run it. Timed on the caller's thread instead, the model's matrix products leave
that thread a pool of BLAS/OpenMP threads, and on a small machine (2 cores here) a
batcher started afterwards in the same process ran its batches 2-3x slower.

Side by side, each in a fresh process with torch's default thread count (no
``OMP_NUM_THREADS``): the saturated throughput of a one-worker ``DynamicBatcher``
serving the tiny MLP (max_batch_size 16, greedy) before and after

* ``profile_model`` (its own thread), and
* the same timings run on the caller's thread (what ``profile_model`` did before).

Prints the after/before ratio of each, the medians of ``--repeats`` runs. Target: the
ratio after ``profile_model`` is about 1 (no slower), where the caller's-thread ratio
shows what it avoids.

Run: ``.venv/bin/python bench/bench_profile_thread.py [--repeats 5]``.
"""

from __future__ import annotations

import json
import os

from fresh_process import arguments, run_child

REQUESTS = 20_000
SIZES = (1, 4, 16)


def child(where: str, repeats: int) -> None:
    """In a fresh process: saturated throughput before and after profiling ``where``."""
    import numpy as np

    import batchsim as bs
    from batchsim.real import make_model, profile_model, run_saturated
    from batchsim.real.profiler import _measure_model, _setup

    model = make_model("mlp", size="tiny")
    policy = bs.BatchPolicy(16, 0.0)

    def throughput_rps() -> float:
        runs = [run_saturated(model, REQUESTS, policy).summary()["throughput_rps"]
                for _ in range(repeats)]
        return float(np.median(runs))

    before = throughput_rps()
    if where == "own thread":
        profile_model(model, SIZES, repeats=20, overhead=False)
    else:
        spec, sizes, reps, dev = _setup(model, SIZES, None, 20, None)
        _measure_model(model, spec, dev, sizes, reps, 3, True, False, 0.0)
    after = throughput_rps()
    print(json.dumps({"where": where, "before_rps": before, "after_rps": after}))


def main() -> None:
    args = arguments(__doc__, "saturated runs per median")
    if args.child:
        child(args.child, args.repeats)
        return
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    print(f"tiny MLP, max_batch_size 16, saturated, {REQUESTS} requests, median of "
          f"{args.repeats} runs; default torch threads ({os.cpu_count()} CPUs)")
    for where in ("own thread", "caller's thread"):
        r = run_child(__file__, where, args.repeats, env)
        print(f"profile on the {where:15s}: {r['before_rps']:9,.0f} -> {r['after_rps']:9,.0f} "
              f"requests/s, after/before {r['after_rps'] / r['before_rps']:.2f}")


if __name__ == "__main__":
    main()
