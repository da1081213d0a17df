"""Two versions of the simulator on the same real runs: every row's error, then a tally.

When a change alters how the engines read a calibration (as when the wake-up came to
count from the end of the worker's previous batch), ``bench_refit.py`` cannot compare
the two models: it simulates the saved calibration with the current engines. This bench
measures each version with its own code instead. Run it once with each version of
batchsim on the path: it refits each saved grid's calibration on that grid's Poisson
calibration runs (``batchsim.calibrate.refit``, the ``s(b)`` and timer kept) and writes
every row's p50 and p99 error, simulated as ``fidelity`` simulates it. ``--compare``
then sets two such files side by side: per model, the rows each version brings closer
at p50 and p99, and the arrival sets whose median |p50 error| falls or rises.
``--told-speed`` simulates each row at the speed its own batches ran: a machine that
drifts between the calibration and the rows moves every row's error one way, so that a
change which moves the predictions the other way looks better or worse than its
mechanism is; told the speed, the tally sees the mechanism. ``--tracked`` simulates each
row at the median speed of the last few rows run before it, over the arrival sets in
order (``fidelity``'s ``tracked_err_*``, ``batchsim.fidelity.tracked_ratio``): against
a file made without it, the tally says what keeping the calibration's level up to date
from runs already made buys.

Run: ``PYTHONPATH=<a checkout of the previous commit> .venv/bin/python
bench/bench_row_errors.py RUNS.pkl.gz ... --out before.json``, the same with this
checkout into ``after.json``, then ``.venv/bin/python bench/bench_row_errors.py
--compare before.json after.json --out FILE``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from bench_fidelity import load_saved_runs, write_report
from bench_refit import row_errors as refit_row_errors


def row_errors(saved: dict, told_speed: bool = False, tracked: bool = False) -> dict:
    """Per arrival set, each row's ``[p50, p99]`` relative error (simulated over real,
    less 1, as ``bench_refit.row_errors`` measures it), with the saved calibration
    refitted on its Poisson calibration runs; ``told_speed``: each row simulated at the
    speed its own batches ran (``at_speed`` by ``worker_time_ratio``), which takes the
    machine's drift since the calibration out of the comparison; ``tracked``: each row
    at the median speed of the last ``TRACKED_RUNS`` rows before it (the first at the
    calibration's own)."""
    from batchsim.calibrate import at_speed, refit, worker_time_ratio
    from batchsim.fidelity import tracked_ratio

    if told_speed and tracked:
        raise ValueError("told_speed and tracked exclude each other")
    poisson = [r for r in saved["calibration_runs"] if r.meta["workload"].startswith("Poisson")]
    service = refit(saved["service"], poisson)
    errors, history = {}, []
    for name, runs in saved["runs"].items():
        if told_speed or tracked:
            rows = []
            for run in runs:
                own = worker_time_ratio(service, run["real"])
                ratio = own if told_speed else tracked_ratio(history)
                rows.append(refit_row_errors(at_speed(service, ratio), [run]))
                history.append(own)
            e = {m: [row[m][0] for row in rows] for m in ("latency_ms_p50", "latency_ms_p99")}
        else:
            e = refit_row_errors(service, runs)
        errors[name] = [list(pair) for pair in zip(e["latency_ms_p50"], e["latency_ms_p99"],
                                                   strict=True)]
    return errors


def tally(before: dict, after: dict, model_of=lambda grid: grid) -> dict:
    """Per model (``model_of`` a grid's name) and over all: rows where ``after`` is
    closer than ``before`` at p50 and p99, rows where it is further, and the arrival
    sets whose median |p50 error| falls, rises or stays."""
    out = {}
    for grid, sets in before.items():
        for model in (model_of(grid), "all"):
            t = out.setdefault(model, {"p50": [0, 0], "p99": [0, 0], "median_p50": [0, 0, 0]})
            for name, rows in sets.items():
                a, b = np.abs(np.array(rows)), np.abs(np.array(after[grid][name]))
                for j, metric in enumerate(("p50", "p99")):
                    t[metric][0] += int((b[:, j] < a[:, j]).sum())
                    t[metric][1] += int((b[:, j] > a[:, j]).sum())
                m_a, m_b = np.median(a[:, 0]), np.median(b[:, 0])
                t["median_p50"][0 if m_b < m_a else 1 if m_b > m_a else 2] += 1
    return out


def model_of(grid: str) -> str:
    """The zoo model a grid's file is named after (``..._mlp``, ``..._cnn``, ...)."""
    return next((m for m in ("encoder", "cnn", "mlp") if m in grid), grid)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="*", help="bench_fidelity.py --save-runs pickles (gzipped)")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                   help="two files this bench wrote: tally them instead")
    p.add_argument("--told-speed", action="store_true",
                   help="simulate each row at the speed its own batches ran")
    p.add_argument("--tracked", action="store_true",
                   help="simulate each row at the median speed of the last rows before it")
    p.add_argument("--out", default=None, help="also write the result as JSON")
    args = p.parse_args()
    if args.told_speed and args.tracked:
        p.error("--told-speed and --tracked exclude each other")
    if args.compare:
        import json

        before, after = (json.loads(Path(f).read_text()) for f in args.compare)
        report = {"before": before, "after": after, "tally": tally(before, after, model_of)}
        for model, t in report["tally"].items():
            print(f"{model:>8}: rows closer / further p50 {t['p50'][0]} / {t['p50'][1]}, "
                  f"p99 {t['p99'][0]} / {t['p99'][1]}; median |p50| fell / rose / stayed "
                  f"in {' / '.join(map(str, t['median_p50']))} sets")
    else:
        report = {Path(f).name.removesuffix(".pkl.gz"): row_errors(
            load_saved_runs(f), args.told_speed, args.tracked) for f in args.runs}
        for grid, sets in report.items():
            print(grid + ": " + ", ".join(
                f"{name} median |p50| {np.median(np.abs(np.array(rows)[:, 0])):.1%}"
                for name, rows in sets.items()), flush=True)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
