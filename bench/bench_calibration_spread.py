"""How far calibrations of one model, made one after another, disagree, by profile length.

Two calibrations minutes apart predicted p50 latencies 2-18% apart on an H200
(``bench/results/README.md``): as far apart as the real batcher is from itself, or
further. A calibration is a profile of ``s(b)`` (on CUDA through a one-worker batcher,
a new batcher instance per size and pass) and ten open-loop runs (a new batcher each).
This bench makes ``--calibrations`` calibrations with each ``--profile-s`` in turn
(interleaved, so that a drift of the machine falls on every length alike) and prints,
per length, how far apart their predictions are: the p50 and p99 that each predicts for
the quick fidelity grid's configurations on the same Poisson arrivals (``simulate`` with
the sender on the loop, as ``fidelity`` simulates), and each size's ``s(b)``. A longer
profile averages over more batcher instances; if the calibrations then agree better,
the profile was the part that moved. ``--duration-s`` compares the length of each of
the ten runs instead (``calibrate``'s ``duration_s``, 0.5 s by default), the profile
timed for 1 s: longer runs average the batcher's costs over more of the machine's moments.

Run: ``python bench/bench_calibration_spread.py --device cuda --dtype bfloat16 --size
default --model cnn --out ...`` on a GPU; ``.venv/bin/python
bench/bench_calibration_spread.py --cpu 0 --nice -10`` on this CPU (``--quick`` for a
smoke run). No SimPy is needed (the fast engine simulates).
"""

from __future__ import annotations

import argparse
import itertools
import time

import numpy as np
from bench_fidelity import QUICK_GRID as GRID
from bench_fidelity import add_machine_args, settle_machine, write_report

N_REQUESTS = 4000


def predictions(service, rates_rps: dict, seed: int = 1) -> dict:
    """``{config: (p50_ms, p99_ms)}``: what ``service`` predicts for each configuration
    of ``GRID`` at its rate, on the same Poisson arrivals for every service."""
    import batchsim as bs

    out = {}
    for (b, mw, load), rate in rates_rps.items():
        res = bs.simulate(bs.Poisson(rate), bs.BatchPolicy(b, mw), service,
                          n_requests=N_REQUESTS, seed=seed, sender="loop")
        s = res.summary()
        out[(b, mw, load)] = (s["latency_ms_p50"], s["latency_ms_p99"])
    return out


def spread(values) -> float:
    """How far apart a set of positive predictions is: largest over smallest, less 1."""
    values = np.asarray(values, float)
    return float(values.max() / values.min() - 1.0)


def summarize(by_length: dict) -> dict:
    """Per profile length: the median over configurations of the predictions' spread
    (p50, p99) and of the p50s' coefficient of variation across the calibrations, and
    per batch size the spread of ``s(b)`` across the calibrations."""
    out = {}
    for length, cals in by_length.items():
        configs = cals[0]["predictions"].keys()
        p50 = [spread([c["predictions"][k][0] for c in cals]) for k in configs]
        p99 = [spread([c["predictions"][k][1] for c in cals]) for k in configs]
        p50s = np.array([[c["predictions"][k][0] for k in configs] for c in cals])
        times = np.array([c["times_ms"] for c in cals])
        out[length] = {"calibrations": len(cals),
                       "median_p50_cv": (float(np.median(p50s.std(axis=0, ddof=1)
                                                         / p50s.mean(axis=0)))
                                         if len(cals) > 1 else None),  # needs two
                       "median_p50_spread": float(np.median(p50)),
                       "median_p99_spread": float(np.median(p99)),
                       "max_p50_spread": float(np.max(p50)),
                       "s_b_spread": [spread(t) for t in times.T]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("mlp", "cnn", "encoder"), default="cnn")
    p.add_argument("--size", choices=("tiny", "default"), default="tiny")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--profile-s", default="1,4",
                   help="comma-separated profile lengths (s) to compare (default 1,4)")
    p.add_argument("--duration-s", default=None,
                   help="comma-separated lengths (s) of each calibration run to compare "
                        "instead, profile_s 1")
    p.add_argument("--calibrations", type=int, default=4, help="per length")
    p.add_argument("--quick", action="store_true", help="short runs: a smoke test")
    p.add_argument("--out", default=None, help="results JSON")
    add_machine_args(p)
    args = p.parse_args()
    settle_machine(args)

    from batchsim.calibrate import calibrate
    from batchsim.real import make_model

    model = make_model(args.model, device=args.device, dtype=args.dtype, size=args.size)
    varied = "duration_s" if args.duration_s else "profile_s"
    lengths = [float(x) for x in (args.duration_s or args.profile_s).split(",")]
    extra = ({"n_requests": 200, "duration_s": 0.0, "timer_probes": 30, "repeats": 3}
             if args.quick else {})
    max_b = max(GRID["max_batch_size"])
    by_length = {length: [] for length in lengths}
    rates_rps = None
    t0 = time.perf_counter()
    for k in range(args.calibrations):
        for length in lengths:
            start_s = time.perf_counter()
            service = calibrate(model, max_b, device=args.device, seed=0,
                                **{**extra, "profile_s": 1.0, varied: length})
            if rates_rps is None:   # the first calibration sets every rate, for all
                rates_rps = {c: c[2] * service.capacity_rps(c[0])
                             for c in itertools.product(*GRID.values())}
            by_length[length].append({
                "times_ms": list(service.model.times_ms),
                "capacity_ratio": service.metadata["capacity_ratio"],
                "calibrate_s": time.perf_counter() - start_s,
                "predictions": predictions(service, rates_rps)})
            print(f"[{k + 1}/{args.calibrations}] {varied}={length:g}: s(b) "
                  f"{np.round(service.model.times_ms, 3).tolist()} ms, capacity "
                  f"{service.metadata['capacity_ratio']:.2f}x the measured", flush=True)
        if args.out:    # after every round, so that a run cut short keeps what it made
            write(args, varied, by_length, time.perf_counter() - t0)
    for length, s in summarize(by_length).items():
        cv = "n/a" if s["median_p50_cv"] is None else f"{s['median_p50_cv']:.1%}"
        print(f"{varied}={length:g}: {s['calibrations']} calibrations predict p50s "
              f"{s['median_p50_spread']:.1%} apart, largest over smallest (median over "
              f"configurations; largest {s['max_p50_spread']:.1%}; coefficient of "
              f"variation {cv}), p99s {s['median_p99_spread']:.1%}; s(b) "
              f"{np.round(100 * np.array(s['s_b_spread']), 1).tolist()}% apart by size",
              flush=True)


def write(args, varied: str, by_length: dict, elapsed_s: float) -> None:
    """The results JSON: the settings, the summary and every calibration's numbers, by
    the ``varied`` length."""
    report = {"model": args.model, "size": args.size, "device": args.device, "varied": varied,
              "dtype": args.dtype, "nice": args.nice, "cpu": args.cpu, "quick": args.quick,
              "grid": GRID, "elapsed_s": elapsed_s,
              "summary": {f"{k:g}": v for k, v in summarize(by_length).items()},
              "calibrations": {f"{k:g}": [{**c, "predictions": {
                  f"{b}/{mw:g}/{x:g}": v for (b, mw, x), v in c["predictions"].items()}}
                  for c in cals] for k, cals in by_length.items()}}
    write_report(report, args.out)

if __name__ == "__main__":
    main()
