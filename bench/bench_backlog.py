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
error and the p50 error over the rows.

Run: ``.venv/bin/python bench/bench_backlog.py RUNS.pkl.gz [--out FILE]``.
"""

from __future__ import annotations

import argparse

import numpy as np
from bench_fidelity import load_saved_runs, write_report

#: A row is compared when at least this many of its batches started in a backlog.
MIN_BATCHES = 50


def backlog_stats(service, res) -> dict | None:
    """For the batches of ``res`` that started with at least two full batches waiting
    and before its last arrival: the service rate (requests/s), mean worker time over
    the calibration's mean typical time, and mean requests received (None if fewer than
    ``MIN_BATCHES``)."""
    from batchsim.calibrate import WARM_BATCHES, _batches, _typical_ms

    b, worker_ms, received, idle_ms = _batches(res)
    start_s = res.start_s[WARM_BATCHES:]
    waiting = (np.searchsorted(res.arrival_s, start_s, "right")
               - np.cumsum(res.size)[WARM_BATCHES:] + b)
    backlog = (waiting >= 2 * res.size.max()) & (start_s < res.arrival_s[-1])
    backlog[-1] = False                      # the last batch has no next start
    if backlog.sum() < MIN_BATCHES:
        return None
    cycle_s = np.diff(res.start_s[WARM_BATCHES:])
    typical_ms = _typical_ms(service, b[backlog], received[backlog], idle_ms[backlog])
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", help="a bench_fidelity.py --save-runs pickle (gzipped)")
    p.add_argument("--out", default=None, help="also write the report as JSON")
    args = p.parse_args()
    saved = load_saved_runs(args.runs)
    report = {}
    for name, runs in saved["runs"].items():
        rows = compare_backlogs(saved["service"], runs)
        report[name] = {"summary": summarize(rows), "rows": rows}
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
    write_report(report, args.out)


if __name__ == "__main__":
    main()
