"""How much a profile of ``s(b)`` bends with its length, on a machine shared with others.

``calibrate`` times the model alone with ``profile_model`` in rounds of one batch of
every size. 30 rounds of a tiny model last milliseconds, and a neighbour busy for those
moves every median of that profile, one size more than another. This bench takes, in
turn, ``SHORT_PER_LONG`` short profiles (30 rounds) and one long one (30 rounds and at
least ``--long-s`` seconds, what ``calibrate`` does), again and again for ``--seconds``,
and prints per kind how far each profile's *shape* is from the median long profile's:
each size's time over the profile's mean over sizes, relative to the same for the
reference. The shape is what the calibration cannot absorb: its fitted cost per batch
soaks up a level that is off alike for every size, not one size off from the others.
It also prints the spread of the level (the profile's mean over the reference's), the
machine's own drift, which no length of profile removes.

Run: ``.venv/bin/python bench/bench_profile_noise.py [--model cnn|encoder] --cpu 0
--nice -10 [--out bench/results/profile_noise_one_cpu_mlp.json]`` (``--seconds``, 90 by
default; ``--quick`` for a few).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from bench_fidelity import add_machine_args, settle_machine, write_report

SIZES = (1, 2, 4, 8, 16, 32, 64)
SHORT_REPEATS = 30
SHORT_PER_LONG = 20


def summarize(short_ms: np.ndarray, long_ms: np.ndarray) -> dict:
    """Shape and level deviations of profiles (rows: profiles, columns: sizes) from the
    median long profile, per kind: the median, 95th percentile and largest shape
    deviation over every profile and size, and the 5th and 95th percentile of the level.
    """
    reference = np.median(long_ms, axis=0)
    ref_shape = reference / reference.mean()
    out = {}
    for kind, profiles in (("short", short_ms), ("long", long_ms)):
        level = profiles.mean(axis=1, keepdims=True)
        shape_dev = np.abs(profiles / level / ref_shape - 1)
        level_ratio = level[:, 0] / reference.mean()
        out[kind] = {"profiles": len(profiles),
                     "shape_dev_p50": float(np.median(shape_dev)),
                     "shape_dev_p95": float(np.percentile(shape_dev, 95)),
                     "shape_dev_max": float(shape_dev.max()),
                     "level_p5": float(np.percentile(level_ratio, 5)),
                     "level_p95": float(np.percentile(level_ratio, 95))}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp", choices=["mlp", "cnn", "encoder"])
    p.add_argument("--seconds", type=float, default=90.0, help="how long to go on")
    p.add_argument("--long-s", type=float, default=1.0,
                   help="the long profiles' min_duration_s (calibrate's profile_s)")
    p.add_argument("--quick", action="store_true", help="a few seconds")
    p.add_argument("--out", default=None, help="write the summary as JSON here")
    add_machine_args(p)
    args = p.parse_args()
    settle_machine(args)
    from batchsim.real import make_model, profile_model

    seconds, long_s = (3.0, 0.2) if args.quick else (args.seconds, args.long_s)
    model = make_model(args.model, size="tiny")
    short, long = [], []
    end_s = time.perf_counter() + seconds
    while time.perf_counter() < end_s or not long:
        for _ in range(SHORT_PER_LONG):
            short.append(profile_model(model, SIZES, repeats=SHORT_REPEATS,
                                       overhead=False).times_ms)
        long.append(profile_model(model, SIZES, repeats=SHORT_REPEATS, overhead=False,
                                  min_duration_s=long_s).times_ms)
    summary = summarize(np.array(short), np.array(long))
    for kind, s in summary.items():
        print(f"{kind:5s} ({s['profiles']} profiles): a size off the reference's shape by "
              f"{s['shape_dev_p50']:.1%} (median), {s['shape_dev_p95']:.1%} (95th "
              f"percentile), {s['shape_dev_max']:.1%} (largest); level "
              f"{s['level_p5']:.2f}-{s['level_p95']:.2f}x the reference's (5th-95th)")
    if args.out:
        report = {"model": f"tiny-{args.model}", "sizes": SIZES, "seconds": seconds,
                  "short_repeats": SHORT_REPEATS, "long_s": long_s, "cpu": args.cpu,
                  "nice": args.nice, "summary": summary}
        write_report(report, args.out)


if __name__ == "__main__":
    main()
