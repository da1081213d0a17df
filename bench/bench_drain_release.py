"""What the load generator's wake-ups cost the batches it measures, while the queue drains.

After its last send, ``run_load`` closes the batcher and lets the outputs go as their
requests finish, waking once per ``RELEASE_EVERY_BATCHES`` batches
(``batchsim.real.loadgen``). Each wake-up is event-loop work (``asyncio.wait``) on the
core the worker needs. This bench sends many requests at once to a zoo model, so that
most batches run after the last send, and serves them with the harness waking every 1,
4 and 16 batches, in alternating order on the same arrivals, so that a drift of the
machine falls on all alike. Per max_batch_size it prints the median over repeats of the
drain's median full-batch time on the worker (ms) and each window's ratio to waking
every batch, paired by repeat.

Run: ``.venv/bin/python bench/bench_drain_release.py --cpu 0 --nice -10`` (about a
minute; ``--quick`` for seconds).
"""

from __future__ import annotations

import argparse

import numpy as np
from bench_fidelity import add_machine_args, settle_machine, write_report

WINDOWS_BATCHES = (1, 4, 16)


def drain_batch_ms(res) -> float:
    """The median time (ms) a full batch held its worker after the run's last arrival."""
    full = res.size == res.size.max()
    drain = (res.start_s > res.arrival_s[-1]) & full
    if not drain.any():
        raise ValueError("the run has no full batch after its last arrival")
    return float(1e3 * np.median((res.end_s - res.start_s)[drain]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp", choices=["mlp", "cnn", "encoder"])
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--quick", action="store_true", help="two repeats of fewer requests")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    add_machine_args(p)
    args = p.parse_args()
    settle_machine(args)

    import batchsim as bs
    from batchsim.real import loadgen, make_model, run_load

    model = make_model(args.model, size="tiny")
    repeats = 2 if args.quick else args.repeats
    report = {"model": model.zoo_name, "nice": args.nice, "cpu": args.cpu,
              "repeats": repeats, "windows_batches": list(WINDOWS_BATCHES), "sizes": {}}
    for b in (4, 16, 64):
        n = (200 if args.quick else 1000) * b
        times = {w: [] for w in WINDOWS_BATCHES}
        for rep in range(repeats):
            order = WINDOWS_BATCHES if rep % 2 == 0 else WINDOWS_BATCHES[::-1]
            for w in order:
                loadgen.RELEASE_EVERY_BATCHES = w
                res = run_load(model, bs.Constant(1e6), bs.BatchPolicy(b, 0.0),
                               n_requests=n, seed=rep)
                times[w].append(drain_batch_ms(res))
        per_batch = np.array(times[1])
        ratios = {w: float(np.median(np.array(times[w]) / per_batch)) for w in WINDOWS_BATCHES}
        report["sizes"][b] = {"drain_batch_ms": times, "ratio_to_every_batch": ratios}
        print(f"max_batch_size={b}: drain's full batch "
              + ", ".join(f"{np.median(times[w]):.4f} ms waking every {w}" for w in WINDOWS_BATCHES)
              + "; ratio to every batch "
              + ", ".join(f"{ratios[w]:.3f}" for w in WINDOWS_BATCHES[1:]), flush=True)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
