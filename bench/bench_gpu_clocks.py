"""Did the GPU's clocks move the batches' speed? A saved fidelity run against a clock log.

On an H200 the encoder's rows at load 0.2 ran 1.04-1.31x the calibration's time, with
the batcher's CPUs kept awake or not, and the CNN's grid ran 0.77-0.96x its calibration
after the first arrival set (``bench/results/README.md``). A GPU lowers its clocks when
it idles and raises them under load; a calibration made at other clocks than a row ran
at would predict it wrong by that ratio. This bench tests that guess.

``sample CLOCKS.csv`` runs ``nvidia-smi`` until it is stopped, writing the GPU's SM and
memory clocks, power, temperature and utilization every ``SAMPLE_MS`` ms
(``CLOCK_FIELDS``); ``bench/gpu_session.sh`` runs it beside each fidelity run. Then
``RUNS.pkl.gz CLOCKS.csv`` sets every batch of the pickled runs (the calibration's and
each arrival set's, ``bench_batch_residuals.batches``) beside the SM clock sampled
nearest its start on the wall clock (the run's ``meta["started_unix_s"]`` plus the
batch's start), and reports per part the clock's median, 5th percentile and share of
samples below the part's highest, and the batches' median ratio (their time over the
calibration's prediction) by SM clock; per arrival set, each row's median clock and
median ratio and their correlation across rows. Ratios that fall as the clock rises,
and a calibration at other clocks than the rows, would confirm the guess; ratios flat
over the clocks would clear them. Run it where the runs were made: ``nvidia-smi``
writes its timestamps in that machine's local time.

Run: ``python bench/bench_gpu_clocks.py sample clocks.csv &`` before the runs, stop it
after, then ``python bench/bench_gpu_clocks.py RUNS.pkl.gz clocks.csv [--out FILE]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from datetime import datetime

import numpy as np
from bench_batch_residuals import batches
from bench_fidelity import load_saved_runs, write_report

#: What ``sample`` asks ``nvidia-smi`` for, in the order of the log's columns.
CLOCK_FIELDS = ("timestamp", "clocks.sm", "clocks.mem", "power.draw", "temperature.gpu",
                "utilization.gpu")
#: ``sample``'s interval between two readings, ms.
SAMPLE_MS = 50
#: A batch further than this from every sample gets no clock (the log has a gap there).
MAX_GAP_S = 0.5
#: Bins of the SM clock for the ratio by clock: this wide, MHz.
CLOCK_BIN_MHZ = 100


def sample(path) -> None:
    """Replace this process with ``nvidia-smi`` logging ``CLOCK_FIELDS`` to ``path``
    every ``SAMPLE_MS`` ms, until it is stopped."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise SystemExit("sample: nvidia-smi is not on PATH (no NVIDIA GPU driver here)")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.execv(smi, [smi, f"--query-gpu={','.join(CLOCK_FIELDS)}",
                   "--format=csv,noheader,nounits", f"-lms={SAMPLE_MS}"])


def read_clocks(path):
    """The log ``sample`` wrote, as a DataFrame: ``unix_s`` (the timestamp, read in this
    machine's local time) and one float column per other field (NaN where
    ``nvidia-smi`` had none), in time order. Lines cut short when the sampler was
    stopped are left out."""
    import pandas as pd

    rows = []
    with open(path) as f:
        for line in f:
            cells = [c.strip() for c in line.split(",")]
            if len(cells) != len(CLOCK_FIELDS):
                continue
            try:
                when = datetime.strptime(cells[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            except ValueError:
                continue
            rows.append([when] + [_number(c) for c in cells[1:]])
    if not rows:
        raise ValueError(f"clocks: no readings in {path}")
    return pd.DataFrame(rows, columns=["unix_s", *CLOCK_FIELDS[1:]]).sort_values(
        "unix_s", ignore_index=True)


def _number(cell: str) -> float:
    try:
        return float(cell)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return float("nan")


def clocked_batches(service, runs, clocks):
    """``bench_batch_residuals.batches`` of ``runs`` with the SM clock sampled nearest
    each batch's start (``sm_mhz``; NaN where no sample is within ``MAX_GAP_S``)."""
    missing = [k for k, run in enumerate(runs) if "started_unix_s" not in run.meta]
    if missing:
        raise ValueError(f"runs {missing} do not say when they started on the wall clock "
                         f"(meta['started_unix_s']: DynamicBatcher records it since this bench)")
    table = batches(service, runs)
    started = np.array([run.meta["started_unix_s"] for run in runs])
    when_s = started[table["row"].to_numpy()] + table["start_s"].to_numpy()
    t = clocks["unix_s"].to_numpy()
    later = np.clip(np.searchsorted(t, when_s), 0, t.size - 1)
    earlier = np.clip(later - 1, 0, t.size - 1)
    nearest = np.where(np.abs(t[earlier] - when_s) < np.abs(t[later] - when_s), earlier, later)
    sm = clocks["clocks.sm"].to_numpy()[nearest]
    table["sm_mhz"] = np.where(np.abs(t[nearest] - when_s) <= MAX_GAP_S, sm, np.nan)
    return table


def part_report(table) -> dict:
    """One part's clocks and ratios: the SM clock over its batches (median, 5th
    percentile, share below the part's highest) and the median ratio per
    ``CLOCK_BIN_MHZ`` bin of it."""
    clocked = table.dropna(subset=["sm_mhz"])
    if clocked.empty:
        return {"batches": len(table), "clocked": 0}
    sm = clocked["sm_mhz"].to_numpy()
    bins = (sm // CLOCK_BIN_MHZ * CLOCK_BIN_MHZ).astype(int)
    return {"batches": len(table), "clocked": len(clocked),
            "sm_mhz_median": float(np.median(sm)), "sm_mhz_p5": float(np.percentile(sm, 5)),
            "below_top_share": float(np.mean(sm < sm.max())),
            "median_ratio": float(clocked["ratio"].median()),
            "ratio_by_sm_mhz": {f"{b}-{b + CLOCK_BIN_MHZ - 1}": {
                "batches": int(np.sum(bins == b)),
                "median_ratio": float(np.median(clocked["ratio"].to_numpy()[bins == b]))}
                for b in np.unique(bins)}}


def row_report(table) -> dict:
    """Each row's median SM clock and median ratio, and their correlation across the
    rows that have a clock."""
    rows = table.groupby("row", sort=True)
    sm = rows["sm_mhz"].median().to_numpy()
    ratio = rows["ratio"].median().to_numpy()
    both = np.isfinite(sm)
    corr = (float(np.corrcoef(sm[both], ratio[both])[0, 1])
            if both.sum() > 2 and np.ptp(sm[both]) > 0 else float("nan"))
    return {"sm_mhz_median": [float(s) for s in sm], "median_ratio": [float(r) for r in ratio],
            "corr_sm_ratio": corr}


def analyze(saved: dict, clocks) -> dict:
    """The calibration's runs and each arrival set against the clock log."""
    service = saved["service"]
    out = {"calibration_runs": part_report(clocked_batches(service, saved["calibration_runs"],
                                                           clocks))}
    for name, runs in saved["runs"].items():
        table = clocked_batches(service, [run["real"] for run in runs], clocks)
        out[name] = {**part_report(table), "rows": row_report(table)}
    return out


def print_report(report: dict) -> None:
    for part, r in report.items():
        if not r["clocked"]:
            print(f"-- {part}: none of its {r['batches']} batches has a clock sample")
            continue
        print(f"-- {part}: SM clock median {r['sm_mhz_median']:.0f} MHz, 5th percentile "
              f"{r['sm_mhz_p5']:.0f}, {r['below_top_share']:.0%} of batches below the "
              f"part's highest; batches' median ratio {r['median_ratio']:.3f}")
        print("   by SM clock (MHz): " + ", ".join(
            f"{b} {c['median_ratio']:.3f} ({c['batches']})"
            for b, c in r["ratio_by_sm_mhz"].items()))
        if "rows" in r:
            print(f"   rows: correlation of a row's median clock with its median ratio "
                  f"{r['rows']['corr_sm_ratio']:+.2f}")


def main() -> None:
    if sys.argv[1:2] == ["sample"]:
        if len(sys.argv) != 3:
            raise SystemExit("usage: bench_gpu_clocks.py sample CLOCKS.csv")
        sample(sys.argv[2])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", help="a bench_fidelity.py --save-runs pickle (gzipped)")
    p.add_argument("clocks", help="the log of `bench_gpu_clocks.py sample` during those runs")
    p.add_argument("--out", default=None, help="also write the report as JSON")
    args = p.parse_args()
    try:
        clocks = read_clocks(args.clocks)
    except (OSError, ValueError) as e:
        raise SystemExit(str(e)) from None
    try:
        report = analyze(load_saved_runs(args.runs), clocks)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    print_report(report)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
