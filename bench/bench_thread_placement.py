"""Where the OS runs the batcher's two threads: one core or two?

``DynamicBatcher`` runs its event loop on the caller's thread and a batch on a worker
thread; both need the interpreter lock for their Python work. Every batch hands the
lock and the work across: the loop dispatches, the worker wakes; the worker ends, the
loop wakes. With a tiny model the batch's own compute is small next to these
hand-overs, and what they cost depends on where the OS put the threads: a thread on
the same core runs as soon as the other blocks, one on another core must be woken
there. The OS chooses, and may choose differently from one run to the next.

Side by side, each in a fresh process, the tiny MLP served by a one-worker batcher
(max_batch_size 16, one torch thread):

* ``OS``: the threads wherever the OS puts them (the default);
* ``one core``: the process pinned to one CPU before the batcher starts (its worker
  thread inherits it): ``os.sched_setaffinity(0, {0})``.

Prints, as medians of ``--repeats`` runs each, the saturated throughput and, under
Poisson load at half of it, the median time from a batch's end to the next dispatch
when the next was already due (the hand-over back through the loop), and the ratios
one core / OS. ``bench/bench_fidelity.py --cpu 0`` pins the same way, so that the
calibration and the runs it predicts see one placement.

Run: ``.venv/bin/python bench/bench_thread_placement.py [--repeats 5]``.
"""

from __future__ import annotations

import json
import os

from fresh_process import arguments, run_child

REQUESTS = 20_000
PLACEMENTS = ("OS", "one core")


def child(placement: str, repeats: int) -> None:
    """In a fresh process: throughput and hand-over gap of the tiny MLP's batcher."""
    if placement == "one core":
        os.sched_setaffinity(0, {0})
    import numpy as np
    import torch

    import batchsim as bs
    from batchsim.calibrate import _due_s
    from batchsim.real import make_model, run_load, run_saturated

    torch.set_num_threads(1)
    model = make_model("mlp", size="tiny")
    policy = bs.BatchPolicy(16, 0.0)
    rps, gap_us = [], []
    for seed in range(repeats):
        rps.append(run_saturated(model, REQUESTS, policy).summary()["throughput_rps"])
        res = run_load(model, bs.Poisson(0.5 * rps[-1]), policy, n_requests=REQUESTS // 2,
                       seed=seed)
        due = _due_s(res)[1:] <= res.end_s[:-1]
        gap_us.append(np.median(1e6 * (res.start_s[1:] - res.end_s[:-1])[due]))
    print(json.dumps({"rps": float(np.median(rps)), "gap_us": float(np.median(gap_us))}))


def main() -> None:
    args = arguments(__doc__, "runs per median")
    if args.child:
        child(args.child, args.repeats)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"tiny MLP, max_batch_size 16, one torch thread, {os.cpu_count()} CPUs; medians "
          f"of {args.repeats} runs")
    out = {}
    for placement in PLACEMENTS:
        out[placement] = run_child(__file__, placement, args.repeats, env)
        print(f"{placement:9s}: saturated {out[placement]['rps']:9,.0f} requests/s; batch end "
              f"to next dispatch {out[placement]['gap_us']:5.1f} us (Poisson at half load)")
    one, os_ = out["one core"], out["OS"]
    print(f"one core / OS: throughput {one['rps'] / os_['rps']:.2f}x, hand-over "
          f"{one['gap_us'] / os_['gap_us']:.2f}x")


if __name__ == "__main__":
    main()
