"""Which batches the calibration mispredicts: a saved fidelity run taken apart, batch by batch.

``bench_fidelity.py --save-runs RUNS.pkl.gz`` keeps the calibrated service, the ten runs
its costs were fitted on and every row's real run. This script sets each batch of those
runs against what the calibration predicts for it (``batchsim.calibrate.batch_residuals``:
the time it held its worker over the typical time for its size, idle time and the
requests received during it) and prints the median ratio, per part (the calibration's
runs, then each arrival set), by:

* batch size (powers of two): the profile's shape;
* trigger (size, timeout, flush) and whether the batch started after the run's last
  request arrived (a queue draining);
* how long the worker sat idle before it: the wake-up table;
* how many requests the batcher received while it ran: the cost per arrival; and, where
  the real batcher recorded when its worker picked each batch up, the median time from
  the dispatch to then and the share of the received requests that came after it, while
  the model ran (on one CPU the event loop sends what fell due before the worker gets
  the core: the requests delay the batch's start, not its model);
* batch size and idle time together: how far the cells' ratios stray from the part's
  (``size_by_idle``), a pattern no single cost fits;
* where a CUDA batcher counted them, the pinned host blocks each run had to allocate
  (none, if the warm-up left enough cached);
* the batch's use of its size class in its run (the first, the second, later; classes
  are powers of two: the CUDA graphs' buckets, and the pinned host allocator's block
  sizes where an output row is a power of two of bytes),
  with the share of batches that held their worker over twice their prediction: on an
  H200 a class's first uses in each run launched 1-2 ms late;
* where the runs recorded each batch's launch (a CUDA pipeline): which part of a batch
  moves from row to row, the threads' (dispatch to launch) or the device's
  (``phase_spread``);
* those requests and the load generator's turns that brought them, where the run
  recorded its turns (``run_load`` does): at the same count of requests, what each
  further turn costs;

and, per arrival set, how fast each row ran: the rows' medians (5th-95th percentile),
the correlation of consecutive rows' medians (a drifting machine: high; a speed of each
batcher's own: near 0) and of each row's first half of batches with its second half.
A ratio of 1 is the calibration's prediction; 1.2, batches 20% slower. The bench
simulates nothing and needs numpy and pandas only, so it runs where the GPU runs did.

Run: ``.venv/bin/python bench/bench_batch_residuals.py RUNS.pkl.gz`` (``--recalibration``
sets the runs against the calibration made after the grid, ``--out FILE`` writes JSON).
"""

from __future__ import annotations

import argparse

import numpy as np
from bench_fidelity import load_saved_runs, write_report

#: Bin edges (lower ends) of batch size and of the requests received during a batch.
SIZE_EDGES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RECEIVED_EDGES = (0, 1, 2, 4, 16, 64)
#: Bin edges (lower ends) of the load generator's turns during a batch.
TURN_EDGES = (0, 1, 2, 3)
#: Bin edges (lower ends) of a batch's use of its size class in its run.
USE_EDGES = (1, 2, 3)


def label_bins(values, edges):
    """Each value's bin among ``edges`` (lower ends, the last open), as ``"lo-hi"``: an
    ordered categorical, so that groups come out in the bins' order."""
    import pandas as pd

    names = [f"{lo}" if hi == lo + 1 else f"{lo}-{hi - 1}"
             for lo, hi in zip(edges, edges[1:], strict=False)] + [f"{edges[-1]}+"]
    return pd.Categorical.from_codes(np.digitize(values, edges[1:]), names, ordered=True)


def idle_bins(idle_ms):
    """Each idle time's bin among the calibration's own (``IDLE_EDGES_MS``), in ms: an
    ordered categorical."""
    import pandas as pd

    from batchsim.calibrate import IDLE_EDGES_MS

    edges = IDLE_EDGES_MS
    names = [f"{lo:g}-{hi:g} ms" for lo, hi in zip(edges, edges[1:-1], strict=False)]
    names.append(f">= {edges[-2]:g} ms")
    return pd.Categorical.from_codes(np.digitize(idle_ms, edges[1:-1]), names, ordered=True)


def batches(service, runs) -> object:
    """One DataFrame of every batch of ``runs`` (``RunResult``s) against ``service``,
    with the run's index (``row``), ``after_last_arrival`` and the bins to group by."""
    import pandas as pd

    from batchsim.calibrate import batch_residuals

    frames = []
    for k, res in enumerate(runs):
        table = batch_residuals(service, res)
        table["row"] = k
        table["after_last_arrival"] = table["start_s"] > np.nanmax(res.arrival_s)
        frames.append(table)
    table = pd.concat(frames, ignore_index=True)
    table["size_bin"] = label_bins(table["size"], SIZE_EDGES)
    table["idle_bin"] = idle_bins(table["idle_ms"])
    table["received_bin"] = label_bins(table["received"], RECEIVED_EDGES)
    table["class_use"] = label_bins(table["class_use"], USE_EDGES)
    if table["turns"].notna().all():
        table["turns_bin"] = label_bins(table["turns"], TURN_EDGES)
    return table


def by_group(table) -> dict:
    """``{grouping: {group: {"batches": n, "median_ratio": r}}}`` over the groupings,
    in the bins' order (groups without batches left out); by requests received, also
    the median ``pickup_ms`` and the share received after the pickup (NaN where the
    runs did not record it)."""
    out = {}
    for column in ("size_bin", "trigger", "after_last_arrival", "idle_bin", "received_bin",
                   "class_use"):
        groups = table.groupby(column, sort=True, observed=True)
        out[column] = {str(g): {"batches": len(part),
                                "median_ratio": float(part["ratio"].median())}
                       for g, part in groups}
    for g, part in table.groupby("class_use", sort=True, observed=True):
        out["class_use"][str(g)]["over_2x_share"] = float((part["ratio"] > 2).mean())
    for g, part in table.groupby("received_bin", sort=True, observed=True):
        received = part["received"].sum()
        out["received_bin"][str(g)].update(
            median_pickup_ms=float(part["pickup_ms"].median()),
            after_pickup_share=(float(part["received_after_pickup"].sum(min_count=1)
                                      / received) if received else float("nan")))
    if "turns_bin" in table:
        out["received_turns"] = {
            f"{r} in {t} turns": {"batches": len(part),
                                  "median_ratio": float(part["ratio"].median())}
            for (r, t), part in table.groupby(["received_bin", "turns_bin"], sort=True,
                                              observed=True)}
    return out


#: ``size_by_idle`` reads only the cells of size x idle time with this many batches.
PATTERN_MIN_BATCHES = 20


def size_by_idle(table, min_batches: int = PATTERN_MIN_BATCHES) -> dict:
    """How far the calibration's prediction is off by batch size and idle time together:
    each cell's (size bin x idle bin, ``min_batches`` or more) median ratio against the
    part's, as ``|log(cell / part)|``; the mean weighted by batches and the largest.

    0 where the costs the calibration fitted fit every kind of batch alike; a speed of
    the whole part, the same in every cell, adds nothing. On an H200 with the batcher's
    threads wherever the OS put them, the CNN's calibration runs read 12.8%: small
    batches after 0.1-2 ms of idle ran 1.2-1.6x their prediction, full ones 0.8x, which
    no additive wake-up fits; on the same machine with its CPUs kept awake, 3.6%
    (``bench/results/README.md``).
    """
    cells = table.groupby(["size_bin", "idle_bin"], observed=True)["ratio"].agg(
        ["median", "size"])
    cells = cells[cells["size"] >= min_batches]
    off = np.abs(np.log(cells["median"].to_numpy() / table["ratio"].median()))
    return {"cells": int(off.size),
            "mean_abs_log": float(np.average(off, weights=cells["size"])) if off.size
            else float("nan"),
            "max_abs_log": float(off.max()) if off.size else float("nan")}


def phase_spread(table, min_batches: int = PATTERN_MIN_BATCHES) -> dict:
    """Which part of a batch carries the rows' own speeds, where the runs recorded when
    each batch was launched (``launch_ms``; empty otherwise): per cell of row x size bin
    (``min_batches`` or more), the median ratio, and the median time from dispatch to
    launch (the threads picking the batch up, staging and launching it) and from launch
    to the end (the device's part), each over its size bin's median across the cells;
    the standard deviation of their logs across the cells, and the median share of the
    first part in a batch's time. On an H200 the encoder's first part spread 1.2-3x
    as far as its second, the CNN's both alike; the first was 46-79% of a batch's time
    (``bench/results/README.md``)."""
    if table["launch_ms"].isna().all():
        return {}
    parts = table.assign(device_ms=table["worker_ms"] - table["launch_ms"])
    cells = parts.groupby(["row", "size_bin"], observed=True).agg(
        batches=("ratio", "size"), ratio=("ratio", "median"),
        launch=("launch_ms", "median"), device=("device_ms", "median"))
    cells = cells[cells["batches"] >= min_batches]
    by_size = cells.groupby(level="size_bin", observed=True)
    rel = {part: cells[part] / by_size[part].transform("median")
           for part in ("launch", "device")}
    return {"cells": len(cells), "sd_log_ratio": sd_log(cells["ratio"]),
            "sd_log_launch": sd_log(rel["launch"]), "sd_log_device": sd_log(rel["device"]),
            "launch_share": float((cells["launch"] / (cells["launch"] + cells["device"]))
                                  .median()) if len(cells) else float("nan")}


def sd_log(values) -> float:
    """The standard deviation of ``log(values)``; NaN unless there are two or more and
    every one is positive (on the CPU a batch ends as it is launched: no device part)."""
    values = np.asarray(values, float)
    return (float(np.log(values).std(ddof=1)) if values.size > 1 and (values > 0).all()
            else float("nan"))


def row_speeds(table) -> dict:
    """How fast each row ran (its batches' median ratio) and how rows' speeds relate:
    their 5th and 95th percentiles and standard deviation, the correlation of
    consecutive rows, and the correlation across rows of each row's first half of
    batches with its second (with the standard deviation of half their difference)."""
    rows = table.groupby("row", sort=True)
    medians = rows["ratio"].median().to_numpy()
    halves = np.array([[np.median(r[: len(r) // 2]), np.median(r[len(r) // 2:])]
                       for r in (g["ratio"].to_numpy() for _, g in rows)])
    return {"rows": int(medians.size), "median_ratio": [float(m) for m in medians],
            "p5": float(np.percentile(medians, 5)), "p95": float(np.percentile(medians, 95)),
            "sd": float(medians.std(ddof=1)),
            "lag1_corr": float(np.corrcoef(medians[:-1], medians[1:])[0, 1]),
            "halves_corr": float(np.corrcoef(halves[:, 0], halves[:, 1])[0, 1]),
            "half_diff_sd": float((np.diff(halves, axis=1)[:, 0] / 2).std(ddof=1))}


def pinned_allocs(runs) -> dict:
    """The pinned host blocks each run allocated while it ran, where the runs counted
    them (a CUDA batcher's ``meta["pinned_host_allocs"]``; empty otherwise): a warm-up
    that left too few cached shows here."""
    counts = [res.meta.get("pinned_host_allocs") for res in runs]
    return {} if None in counts else {"per_run": counts, "total": sum(counts)}


def analyze(saved: dict, recalibration: bool = False) -> dict:
    """The groupings for the calibration's runs and each arrival set, and each set's
    row speeds, against the first calibration (or the one made after the grid)."""
    service = saved["recalibration" if recalibration else "service"]
    table = batches(service, saved["calibration_runs"])
    out = {"calibration_runs": {**by_group(table), "size_by_idle": size_by_idle(table),
                                "phase_spread": phase_spread(table),
                                "pinned_allocs": pinned_allocs(saved["calibration_runs"])}}
    for name, runs in saved["runs"].items():
        reals = [run["real"] for run in runs]
        table = batches(service, reals)
        out[name] = {**by_group(table), "size_by_idle": size_by_idle(table),
                     "row_speeds": row_speeds(table), "phase_spread": phase_spread(table),
                     "pinned_allocs": pinned_allocs(reals)}
    return out


def print_report(report: dict) -> None:
    for part, groups in report.items():
        print(f"-- {part}: median ratio of worker time to the calibration's prediction "
              f"(batches)")
        for column, cells in groups.items():
            if column == "pinned_allocs":
                if cells:
                    print(f"   {'pinned allocs':>18}: {cells['total']} over the runs "
                          f"(per run: {cells['per_run']})")
                continue
            if column == "row_speeds":
                s = cells
                print(f"   rows: {s['rows']}, median ratio {s['p5']:.2f}-{s['p95']:.2f} "
                      f"(5th-95th), sd {s['sd']:.3f}; consecutive rows' correlation "
                      f"{s['lag1_corr']:+.2f}; halves' correlation {s['halves_corr']:+.2f}, "
                      f"half their difference sd {s['half_diff_sd']:.3f}")
                continue
            if column == "phase_spread":
                if cells:
                    print(f"   {'batch parts':>18}: over {cells['cells']} cells of row x "
                          f"size, sd of log: ratio {cells['sd_log_ratio']:.3f}, dispatch to "
                          f"launch {cells['sd_log_launch']:.3f}, launch to end "
                          f"{cells['sd_log_device']:.3f} (dispatch to launch a median "
                          f"{cells['launch_share']:.0%} of a batch's time)")
                continue
            if column == "size_by_idle":
                print(f"   {'size x idle':>18}: cells off the part's median by "
                      f"{cells['mean_abs_log']:.1%} on average (weighted by batches), at "
                      f"most {cells['max_abs_log']:.1%} ({cells['cells']} cells of "
                      f">= {PATTERN_MIN_BATCHES} batches; |log ratio|)")
                continue
            print(f"   {column:>18}: " + ", ".join(
                f"{g} {c['median_ratio']:.2f} ({c['batches']})" for g, c in cells.items()))
            if column == "class_use":
                print(f"   {'over 2x':>18}: " + ", ".join(
                    f"{g} {c['over_2x_share']:.1%}" for g, c in cells.items()))
            if column == "received_bin":
                print(f"   {'pickup':>18}: " + ", ".join(
                    f"{g} {1e3 * c['median_pickup_ms']:.0f} us"
                    + (f" ({c['after_pickup_share']:.0%} after)"
                       if np.isfinite(c["after_pickup_share"]) else "")
                    for g, c in cells.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", help="a bench_fidelity.py --save-runs pickle (gzipped)")
    p.add_argument("--recalibration", action="store_true",
                   help="against the calibration made after the grid (--recalibrate)")
    p.add_argument("--out", default=None, help="also write the report as JSON")
    args = p.parse_args()
    saved = load_saved_runs(args.runs)
    if args.recalibration and "recalibration" not in saved:
        raise SystemExit(f"--recalibration: {args.runs} has no second calibration "
                         f"(bench_fidelity.py --recalibrate makes one)")
    report = analyze(saved, args.recalibration)
    print_report(report)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
