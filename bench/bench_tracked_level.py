"""How well the speeds of the rows run before predict a row's own, by how many are kept.

``fidelity`` tracks the calibration's level from the real runs made before each row
(``batchsim.fidelity.tracked_ratio``): the row is simulated at the median
``worker_time_ratio`` of the last few of them. A machine's speed wanders: the older a
run, the less it says about now, but the fewer runs kept, the more one row's own noise
moves the level. This bench reads that trade-off off saved results: for every row of the
given ``bench_fidelity.py`` results files (their rows in the order they ran, the arrival
sets one after another), how far each rule's level is from the speed the row's batches
actually ran at, ``|log(tracked / own)|``, with the median of the last 1, 3, 5, 8 or 12
rows, of all the rows before, and of none (the calibration's own level, 1). It prints,
per rule, the median and 90th percentile of that error over all rows, the median over
the grids of each grid's median, and the grids where the rule comes closer than the
median of all the rows before (the rule ``fidelity`` used first); then each rule's
median over that of all the rows before, side by side. A files' grid without
``worker_time_ratio`` columns (made before it) is skipped.

No part of a row's own run enters its level, so this is the prediction error of the
level alone; the p50 error it causes grows with the load (a queue amplifies a capacity
error). ``bench_row_errors.py --tracked`` replays the latencies on saved runs.

Run: ``python bench/bench_tracked_level.py bench/results/fidelity_cpu*_one_cpu_*.json
[--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from bench_fidelity import write_report

#: The rules compared: how many of the rows run before each is kept (None: all of them,
#: 0: none, the calibration's own level).
KEPT = (0, None, 1, 3, 5, 8, 12)


def rule_name(kept: int | None) -> str:
    """How a rule is named in the report."""
    return "calibration" if kept == 0 else "all before" if kept is None else f"last {kept}"


def speeds_in_run_order(results: dict) -> list[float]:
    """The ``worker_time_ratio`` of every row of a ``bench_fidelity.py`` results file, in
    the order they ran (an empty list where the file has none)."""
    return [row["worker_time_ratio"] for workload in results["workloads"].values()
            for row in workload["rows"] if "worker_time_ratio" in row]


def level_errors(speeds: list[float], kept: int | None) -> np.ndarray:
    """Per row, ``|log(tracked / own)|``: the level tracked from the ``kept`` rows before
    it (``tracked_ratio``) against the speed the row itself ran at."""
    from batchsim.fidelity import tracked_ratio

    levels = [1.0 if kept == 0 else tracked_ratio(speeds[:i], kept)
              for i in range(len(speeds))]
    return np.abs(np.log(np.array(levels) / np.array(speeds)))


def compare_rules(grids: dict[str, list[float]]) -> dict:
    """Per rule over ``grids`` (name -> speeds in run order): the median, 90th percentile
    and per-grid median of the level's error, and the grids where it beats "all
    before"."""
    errors = {rule_name(k): {g: level_errors(s, k) for g, s in grids.items()} for k in KEPT}
    base = {g: np.median(e) for g, e in errors["all before"].items()}
    report = {}
    for rule, per_grid in errors.items():
        every = np.concatenate(list(per_grid.values()))
        medians = {g: float(np.median(e)) for g, e in per_grid.items()}
        report[rule] = {"median": float(np.median(every)),
                        "p90": float(np.percentile(every, 90)),
                        "median_of_grid_medians": float(np.median(list(medians.values()))),
                        "grids_closer_than_all_before": sum(m < base[g]
                                                            for g, m in medians.items()),
                        "grid_medians": medians}
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="bench_fidelity.py results files (JSON)")
    p.add_argument("--out", default=None, help="also write the report as JSON")
    args = p.parse_args()
    grids = {Path(f).stem: speeds_in_run_order(json.loads(Path(f).read_text()))
             for f in args.results}
    grids = {g: s for g, s in grids.items() if s}
    if not grids:
        p.error("none of the files has worker_time_ratio columns")
    report = compare_rules(grids)
    print(f"{len(grids)} grids, {sum(map(len, grids.values()))} rows; |log(tracked / own)|:")
    for rule, r in report.items():
        print(f"{rule:>12}: median {r['median']:.4f}, p90 {r['p90']:.4f}, median grid "
              f"{r['median_of_grid_medians']:.4f}; closer than all before in "
              f"{r['grids_closer_than_all_before']} of {len(grids)} grids")
    base = report["all before"]["median"]
    print("median over all before: " + ", ".join(
        f"{rule} {r['median'] / base:.2f}x" for rule, r in report.items()))
    write_report({"grids": len(grids), "rules": report}, args.out)


if __name__ == "__main__":
    main()
