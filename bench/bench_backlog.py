"""How fast the simulator serves a backlog against the real batcher: a saved fidelity run.

Under bursts, and near saturation, a queue builds up, and a request's latency is then
mostly the time the batcher takes to serve the requests ahead of it: a few percent too
much service rate in the simulator becomes tens of percent too little latency. This
script takes a ``bench_fidelity.py --save-runs RUNS.pkl.gz`` pickle, simulates each
row's scheduled arrivals again with the saved calibration (as the bench did), and for
the batches that started with at least two full batches waiting (a backlog; before the
run's last arrival) compares, real against simulated:

* the service rate: the requests those batches served over the time from each one's
  start to the next's (requests/s);
* the mean time a batch held its worker over the mean of the calibration's typical
  times for those very batches (their size, idle time and the requests received while
  they ran, before the spread: ``batchsim.calibrate._typical_ms``): above 1, batches
  slower than the calibration says, whatever the reason; the simulated batches read
  the mean of the calibration's spread (about 1);
* the requests received per batch (the load generator's sends that delay it).

Per arrival set it prints each row with a backlog (at least ``MIN_BATCHES`` such
batches) and the medians over them, with the correlation between the service rate's
error and the p50 error over the rows. Then, over the set's real runs, whether the
backlog's batches ran slower than the other batches of their kind
(``backlog_by_kind``): a backlog that is slow only because its batches are of slow
kinds (back to back, receiving many requests over many turns) needs those kinds
modelled, not the backlog.

Run: ``.venv/bin/python bench/bench_backlog.py RUNS.pkl.gz [--out FILE]``; with
``--kind-only RUNS.pkl.gz ...``, only ``backlog_by_kind`` for each set of each pickle.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from bench_batch_residuals import (
    RECEIVED_EDGES,
    SIZE_EDGES,
    TURN_EDGES,
    idle_bins,
    label_bins,
)
from bench_fidelity import load_saved_runs, write_report

#: A row is compared when at least this many of its batches started in a backlog.
MIN_BATCHES = 50
#: ``backlog_by_kind`` sets a backlog's batches against the other batches of their kind
#: where the set has at least this many of those.
KIND_MIN_BATCHES = 30


def in_backlog(res, batches) -> np.ndarray:
    """Whether each of the batches of ``res`` at the positions ``batches`` (in dispatch
    order) found at least two full batches waiting, before the run's last arrival
    (rejected arrivals never wait)."""
    from batchsim.result import REJECTED

    batches = np.asarray(batches)
    start_s = res.start_s[batches]
    arrived_s = res.arrival_s[res.status != REJECTED]
    served_before = np.r_[0, np.cumsum(res.size)][batches]
    waiting = np.searchsorted(arrived_s, start_s, "right") - served_before
    return (waiting >= 2 * res.size.max()) & (start_s < res.arrival_s[-1])


def backlog_stats(service, res) -> dict | None:
    """For the batches of ``res`` that started with at least two full batches waiting
    and before its last arrival: the service rate (requests/s), mean worker time over
    the calibration's mean typical time, and mean requests received (None if fewer than
    ``MIN_BATCHES``)."""
    from batchsim.calibrate import _batches, _kept_batches, _later, _typical_ms

    kept = np.flatnonzero(_kept_batches(res))
    b, worker_ms, received, idle_ms = _batches(res)
    backlog = in_backlog(res, kept)
    backlog[-1] = False                      # the last batch has no next start
    if backlog.sum() < MIN_BATCHES:
        return None
    cycle_s = np.diff(res.start_s[kept])
    later = tuple(x[backlog] for x in _later(res))
    typical_ms = _typical_ms(service, b[backlog], received[backlog], idle_ms[backlog], later)
    return {"batches": int(backlog.sum()),
            "service_rps": float(b[backlog].sum() / cycle_s[backlog[:-1]].sum()),
            "time_over_typical": float(worker_ms[backlog].mean() / typical_ms.mean()),
            "received": float(received[backlog].mean())}


def compare_backlogs(service, runs) -> list[dict]:
    """A row per run with a backlog in both the real run and its simulation: its
    configuration, both sides' ``backlog_stats``, the service rate's relative error
    (simulated over real, minus 1) and the p50 latency's."""
    from batchsim.calibrate import compare
    from batchsim.fidelity import simulate_schedule

    rows = []
    for run in runs:
        real = run["real"]
        sim = simulate_schedule(real, run["policy"], service, run["seed"])
        stats = backlog_stats(service, real), backlog_stats(service, sim)
        if None in stats:
            continue
        rows.append({"max_batch_size": run["policy"].max_batch_size,
                     "max_wait_ms": run["policy"].max_wait_ms, "rate_rps": run["rate_rps"],
                     "real": stats[0], "sim": stats[1],
                     "err_service_rps": stats[1]["service_rps"] / stats[0]["service_rps"] - 1,
                     "err_latency_ms_p50": compare(real, sim).table["rel_error"][
                         "latency_ms_p50"]})
    return rows


def kind_table(service, runs):
    """Every batch of the real ``runs`` (the rows of one arrival set) but the stalled
    ones: its ``typical_ms`` (``batchsim.calibrate.batch_residuals``), ``told_ms`` (the
    time it held its worker over its row's ``worker_time_ratio``: its row's speed taken
    out), whether it started in a ``backlog`` (``in_backlog``), and its ``kind``: the
    row's max_batch_size, and the bins of its size, of the requests it received, of the
    load generator's turns that brought them (where the runs recorded their turns) and
    of the time its worker sat idle before it."""
    import pandas as pd

    from batchsim.calibrate import _kept_batches, _stalled, _time_ratio, batch_residuals

    frames = []
    for run in runs:
        real = run["real"]
        t = batch_residuals(service, real)
        ratio = _time_ratio(service, t)       # the row's worker_time_ratio
        t["backlog"] = in_backlog(real, np.flatnonzero(_kept_batches(real)))
        t = t[~_stalled((t["worker_ms"] - t["typical_ms"]).to_numpy())]
        bins = [label_bins(t["size"], SIZE_EDGES), label_bins(t["received"], RECEIVED_EDGES),
                idle_bins(t["idle_ms"])]
        if t["turns"].notna().all():
            bins.insert(2, label_bins(t["turns"], TURN_EDGES))
        kind = pd.Series(str(run["policy"].max_batch_size), index=t.index)
        for part in bins:
            kind = kind + "/" + pd.Series(part, index=t.index).astype(str)
        frames.append(pd.DataFrame({
            "typical_ms": t["typical_ms"],
            "told_ms": t["worker_ms"] / ratio,
            "backlog": t["backlog"], "kind": kind}))
    return pd.concat(frames, ignore_index=True)


def backlog_by_kind(table, min_batches: int = KIND_MIN_BATCHES) -> dict:
    """Whether a backlog's batches ran slower than the other batches of their kind, over
    a ``kind_table``: ``backlog_told`` and ``other_told``, the total ``told_ms`` of the
    backlog's batches and of the others over their total ``typical_ms`` (each row's
    speed taken out); ``expected_from_kind``, the backlog's batches each at its kind's
    ratio among the other batches (the others' overall ratio for a kind with fewer than
    ``min_batches`` of them: ``covered`` is the share of the backlog's batches with a
    kind of their own); ``backlog_over_kind``, the one over the other. Totals, as a queue
    drains at its batches' mean time. ``{"backlog_batches": n}`` alone where there is
    no backlog, or nothing else."""
    backlog, other = table[table["backlog"]], table[~table["backlog"]]
    if backlog.empty or other.empty:
        return {"backlog_batches": len(backlog)}
    cells = other.groupby("kind").agg(told_ms=("told_ms", "sum"),
                                      typical_ms=("typical_ms", "sum"),
                                      batches=("told_ms", "size"))
    cells = cells[cells["batches"] >= min_batches]
    ratio = cells["told_ms"] / cells["typical_ms"]
    other_told = other["told_ms"].sum() / other["typical_ms"].sum()
    per_batch = backlog["kind"].map(ratio)
    expected = ((backlog["typical_ms"] * per_batch.fillna(other_told)).sum()
                / backlog["typical_ms"].sum())
    backlog_told = backlog["told_ms"].sum() / backlog["typical_ms"].sum()
    return {"backlog_batches": len(backlog), "backlog_told": float(backlog_told),
            "other_told": float(other_told), "expected_from_kind": float(expected),
            "backlog_over_kind": float(backlog_told / expected),
            "covered": float(per_batch.notna().mean())}


def summarize(rows: list[dict]) -> dict:
    """Medians over the rows, and how the p50 error follows the service rate's."""
    if not rows:
        return {"rows": 0}
    err_rate = np.array([r["err_service_rps"] for r in rows])
    err_p50 = np.array([r["err_latency_ms_p50"] for r in rows])
    return {"rows": len(rows),
            "median_err_service_rps": float(np.median(err_rate)),
            "median_abs_err_latency_ms_p50": float(np.median(np.abs(err_p50))),
            "median_real_time_over_typical": float(np.median(
                [r["real"]["time_over_typical"] for r in rows])),
            "median_sim_time_over_typical": float(np.median(
                [r["sim"]["time_over_typical"] for r in rows])),
            "corr_service_rps_latency_p50": (float(np.corrcoef(err_rate, err_p50)[0, 1])
                                             if len(rows) > 2 else float("nan"))}


def print_by_kind(kind: dict) -> None:
    if "expected_from_kind" in kind:
        print(f"   backlog by kind, each row's speed taken out: the backlog's "
              f"{kind['backlog_batches']} batches ran {kind['backlog_told']:.3f}x their "
              f"typical time, the others {kind['other_told']:.3f}x; the others of "
              f"their kind would have run {kind['expected_from_kind']:.3f}x "
              f"(backlog over kind {kind['backlog_over_kind']:.3f}; "
              f"{kind['covered']:.0%} of the backlog's batches of a kind with "
              f">= {KIND_MIN_BATCHES} others)", flush=True)


def report_one(saved: dict) -> dict:
    """Per arrival set of one pickle: its rows with a backlog, their summary and
    ``by_kind``, printed as they come."""
    report = {}
    for name, runs in saved["runs"].items():
        rows = compare_backlogs(saved["service"], runs)
        kind = backlog_by_kind(kind_table(saved["service"], runs))
        report[name] = {"summary": summarize(rows), "rows": rows, "by_kind": kind}
        print(f"-- {name}: rows with a backlog (>= {MIN_BATCHES} batches started with two "
              f"full batches waiting)")
        for r in rows:
            real, sim = r["real"], r["sim"]
            print(f"   b={r['max_batch_size']:3d} wait={r['max_wait_ms']:g} ms "
                  f"{r['rate_rps']:8.0f}/s: service rate sim/real {r['err_service_rps']:+.1%}"
                  f" (p50 {r['err_latency_ms_p50']:+.1%}); time over the calibration's "
                  f"real {real['time_over_typical']:.3f}, sim {sim['time_over_typical']:.3f}; "
                  f"received per batch {real['received']:.1f} / {sim['received']:.1f}")
        s = report[name]["summary"]
        if s["rows"]:
            print(f"   median over {s['rows']} rows: service rate "
                  f"{s['median_err_service_rps']:+.1%}, |p50| "
                  f"{s['median_abs_err_latency_ms_p50']:.1%}; time over the "
                  f"calibration's real {s['median_real_time_over_typical']:.3f}, sim "
                  f"{s['median_sim_time_over_typical']:.3f}; correlation of the two errors "
                  f"{s['corr_service_rps_latency_p50']:+.2f}", flush=True)
        print_by_kind(kind)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="bench_fidelity.py --save-runs pickles (gzipped): "
                   "one, or several with --kind-only")
    p.add_argument("--kind-only", action="store_true",
                   help="only each set's backlog against the others of its kind "
                        "(nothing simulated), per pickle")
    p.add_argument("--out", default=None, help="also write the report as JSON")
    args = p.parse_args()
    if not args.kind_only:
        if len(args.runs) > 1:
            p.error("several pickles need --kind-only")
        report = report_one(load_saved_runs(args.runs[0]))
    else:
        report = {}
        for path in args.runs:
            saved = load_saved_runs(path)
            grid = Path(path).name.removesuffix(".pkl.gz")
            report[grid] = {}
            for name, runs in saved["runs"].items():
                print(f"-- {grid}, {name}")
                report[grid][name] = backlog_by_kind(kind_table(saved["service"], runs))
                print_by_kind(report[grid][name])
    write_report(report, args.out)


if __name__ == "__main__":
    main()
