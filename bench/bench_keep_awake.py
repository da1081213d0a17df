"""Batches after pauses, on a CPU left to idle and on one kept awake, side by side.

A served load leaves its CPU idle between batches. On a virtual machine an idle CPU goes
back to the host, and the batch that wakes it may find its caches taken by a neighbour,
by as much as the neighbour ran meanwhile: the time of such batches changes from second
to second, and a simulator calibrated in one second mispredicts the next.
``batchsim.cpus.kept_awake`` keeps it out of its idle states instead, by a PM QoS request
under which the idle CPU polls (as ``idle=poll`` or C-states off would on a server).

This bench times the model on one CPU (``--cpu``), one batch of ``--batch`` rows at a
time with a pause of ``--pause-us`` after each (about a third of the time idle, as a
batcher at moderate load), for ``--seconds`` with the CPU left to idle, then as long
with it kept awake, ``--rounds`` times. Per condition it prints the median and mean
batch time and how the speed moves: the median batch of each ``WINDOW_S`` window (a
fidelity row's length) over the condition's median, its standard deviation and 10th-90th
percentile; then the ratios, kept awake over left to idle, per round and their median.

Run: ``.venv/bin/python bench/bench_keep_awake.py [--model cnn] --cpu 0 --nice -10
[--out bench/results/keep_awake_cpu_cnn.json]`` (``--quick``: a few seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import numpy as np
from bench_fidelity import add_machine_args, settle_machine, write_report

#: Seconds per window whose median batch time is one reading of the machine's speed.
WINDOW_S = 1.5


def time_batches(model, x, seconds: float, pause_s: float) -> np.ndarray:
    """``(2, n)``: when each batch started (s) and how long it took (s), for ``seconds``,
    sleeping ``pause_s`` after each."""
    import torch

    starts, took = [], []
    end = time.perf_counter() + seconds
    with torch.no_grad():
        while (t0 := time.perf_counter()) < end:
            model(x)
            starts.append(t0)
            took.append(time.perf_counter() - t0)
            time.sleep(pause_s)
    return np.array([starts, took])


def speed_spread(samples: np.ndarray, window_s: float = WINDOW_S) -> dict:
    """The median and mean batch time (µs) of ``samples`` (``time_batches``), and the
    median of each whole ``window_s`` window over the overall median: its standard
    deviation and 10th and 90th percentile."""
    starts, took = samples
    window = ((starts - starts[0]) // window_s).astype(int)
    whole = window < window.max() if window.max() > 0 else window >= 0
    medians = np.array([np.median(took[whole & (window == w)])
                        for w in np.unique(window[whole])])
    overall = float(np.median(took))
    return {"batches": int(took.size), "median_us": 1e6 * overall,
            "mean_us": 1e6 * float(took.mean()), "windows": int(medians.size),
            "window_sd": float(np.std(medians / overall)),
            "window_p10": float(np.percentile(medians / overall, 10)),
            "window_p90": float(np.percentile(medians / overall, 90))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="cnn", choices=["mlp", "cnn", "encoder"])
    p.add_argument("--batch", type=int, default=16, help="rows per batch")
    p.add_argument("--pause-us", type=float, default=300.0, help="idle after each batch")
    p.add_argument("--seconds", type=float, default=30.0, help="per condition and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="a few seconds")
    add_machine_args(p)
    p.add_argument("--out", default=None, help="results JSON")
    args = p.parse_args()
    if args.cpu is None or args.keep_awake:
        raise SystemExit("give --cpu (the CPU to time on) and not --keep-awake: the bench "
                         "keeps the CPU awake and lets it idle in turn itself")
    if args.quick:
        args.seconds, args.rounds = 2 * WINDOW_S + 0.5, 1
    torch = settle_machine(args)
    from batchsim.cpus import kept_awake
    from batchsim.real.models import make_model

    model = make_model(args.model, "cpu", size="tiny")
    x = model.input_spec.random(args.batch)
    with torch.no_grad():
        model(x)                          # warm
    rounds = []
    for k in range(args.rounds):
        spreads = {}
        for cond in ("idle", "awake"):
            with kept_awake(args.cpu, "--cpu") if cond == "awake" else contextlib.nullcontext():
                spreads[cond] = speed_spread(time_batches(model, x, args.seconds,
                                                          args.pause_us / 1e6))
            s = spreads[cond]
            print(f"round {k + 1}, CPU {'kept awake' if cond == 'awake' else 'left to idle'}: "
                  f"median {s['median_us']:.1f} us, mean {s['mean_us']:.1f} us; "
                  f"{WINDOW_S:g} s windows' medians {s['window_p10']:.3f}-"
                  f"{s['window_p90']:.3f}x (sd {s['window_sd']:.3f}), {s['windows']} windows",
                  flush=True)
        spreads["ratio"] = {m: spreads["awake"][m] / spreads["idle"][m]
                            for m in ("median_us", "mean_us", "window_sd")}
        rounds.append(spreads)
    ratios = {m: float(np.median([r["ratio"][m] for r in rounds]))
              for m in ("median_us", "mean_us", "window_sd")}
    print(f"kept awake over left to idle, median of {len(rounds)} rounds: median batch "
          f"{ratios['median_us']:.3f}x, mean {ratios['mean_us']:.3f}x, the windows' sd "
          f"{ratios['window_sd']:.2f}x")
    write_report({"model": args.model, "batch": args.batch, "pause_us": args.pause_us,
                  "seconds": args.seconds, "cpu": args.cpu, "nice": args.nice,
                  "window_s": WINDOW_S, "rounds": rounds, "median_ratios": ratios}, args.out)


if __name__ == "__main__":
    main()
