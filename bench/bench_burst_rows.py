"""The rows at the grid's largest max_batch_size, real against simulated: where the
bursts' p50 error is.

Under bursts the rows at max_batch_size 64 and load 0.5 or more carry the error the
targets miss. This script takes ``bench_fidelity.py --save-runs RUNS.pkl.gz`` pickles,
refits each one's calibration on its Poisson calibration runs (as
``bench_row_errors.py`` does) and, for each such row of each arrival set, told the
row's speed (``at_speed`` by ``worker_time_ratio``), sets the real run beside its
simulation:

* ``p50_err``: the simulated p50 over the real, less 1;
* ``p50_err_from_schedule``: the same with each request's latency counted from when it
  was due to be sent (the load generator's lateness included): where it is as large as
  ``p50_err``, the simulated run is slower as a whole, not only in how the backlog is
  split between the generator and the batcher's queue;
* ``elasticity``: how much the simulated p50 moves with the speed, d ln p50 / d ln
  speed, from simulations 1% faster and 1% slower. A p50 error that is a small speed
  error amplified by a queue near saturation shows as an error about ``elasticity``
  times that speed error; ``speed_equivalent`` is the error read so (ln(1 + p50_err) /
  elasticity);
* ``release_us``: the median gap from a batch's end to the next one's start, for
  batches of at least ``BIG`` of max_batch_size whose successor was due (back to back,
  as ``calibrate`` measures the release), real and simulated;
* ``full_turn_share``: the share of requests the load generator sent in turns of
  ``MAX_BURST`` (it had fallen behind its schedule), real and simulated.

Per grid it also prints the calibration's release at max_batch_size as the engines
read the table (extrapolated along its last segment) and held at its last size, beside
the real releases at that size: the table's sizes end where the calibration's runs
stop dispatching big batches back to back.

Run: ``.venv/bin/python bench/bench_burst_rows.py RUNS.pkl.gz ... [--set bursty]
[--out FILE]``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from bench_fidelity import load_saved_runs, write_report

#: Batches of at least this share of max_batch_size count as big for the release.
BIG = 0.75
#: The speed step (a factor) for the p50's elasticity.
STEP = 1.01


def big_releases_us(res, max_batch_size: int) -> np.ndarray:
    """Gaps (us) from the end of each big batch of ``res`` whose successor was due to
    the successor's start: the releases ``calibrate`` measures, of big batches."""
    from batchsim.calibrate import _releases

    sizes, gaps_ms = _releases([res])
    return 1e3 * gaps_ms[sizes >= BIG * max_batch_size]


def full_turn_share(res) -> float:
    """The share of the requests of ``res`` sent in turns of ``MAX_BURST``."""
    from batchsim.sim.fast import MAX_BURST

    turns = np.asarray(res.meta["turn_sizes"])
    return float(turns[turns >= MAX_BURST].sum() / turns.sum())


def p50_s(res) -> float:
    """The median latency (s) of ``res``."""
    return float(np.median(res.finish_s - res.arrival_s))


def p50_from_schedule_s(res) -> float:
    """The median time (s) from when each request of ``res`` was due to be sent to its
    finish."""
    from batchsim.calibrate import _sending_due_s

    return float(np.median(res.finish_s - _sending_due_s(res)))


def analyze(saved: dict, arrival_set: str) -> dict:
    """Per grid: the release at max_batch_size (table, held, real) and each big row."""
    from batchsim.calibrate import at_speed, refit, worker_time_ratio
    from batchsim.fidelity import simulate_schedule

    poisson = [r for r in saved["calibration_runs"] if r.meta["workload"].startswith("Poisson")]
    service = refit(saved["service"], poisson)
    costs = service.costs
    runs = saved["runs"][arrival_set]
    max_b = max(run["policy"].max_batch_size for run in runs)
    real_release = np.concatenate([big_releases_us(run["real"], max_b) for run in runs])
    out = {"max_batch_size": max_b,
           "release_table_us": 1e6 * float(costs.release_s(max_b)),
           "release_held_us": 1e3 * float(np.interp(max_b, costs.release_sizes,
                                                    costs.release_table_ms)),
           "release_table_last_size": costs.release_sizes[-1],
           "release_real_us": float(np.median(real_release)), "rows": []}
    for run in runs:
        if run["policy"].max_batch_size != max_b:
            continue
        real, policy = run["real"], run["policy"]
        ratio = worker_time_ratio(service, real)
        sims = {f: simulate_schedule(real, policy, at_speed(service, ratio * f), run["seed"])
                for f in (1 / STEP, 1.0, STEP)}
        p50 = {f: p50_s(res) for f, res in sims.items()}
        err = p50[1.0] / p50_s(real) - 1
        releases = [big_releases_us(res, max_b) for res in (real, sims[1.0])]
        elasticity = (np.log(p50[STEP]) - np.log(p50[1 / STEP])) / (2 * np.log(STEP))
        out["rows"].append({
            "max_wait_ms": policy.max_wait_ms, "rate_rps": run.get("rate_rps", np.nan),
            "speed": ratio, "p50_err": err, "elasticity": elasticity,
            "p50_err_from_schedule": p50_from_schedule_s(sims[1.0]) / p50_from_schedule_s(real) - 1,
            "speed_equivalent": np.log1p(err) / elasticity if elasticity > 0.1 else None,
            "release_us": [float(np.median(r)) if r.size else None for r in releases],
            "full_turn_share": [full_turn_share(real), full_turn_share(sims[1.0])]})
    return out


def print_report(grid: str, rep: dict) -> None:
    print(f"{grid}: release at b={rep['max_batch_size']} {rep['release_table_us']:.0f} us "
          f"as the table reads (its last size {rep['release_table_last_size']:.0f}), "
          f"{rep['release_held_us']:.0f} held there; real {rep['release_real_us']:.0f} us")
    for row in rep["rows"]:
        eq = row["speed_equivalent"]
        rel, share = row["release_us"], row["full_turn_share"]
        print(f"  max_wait {row['max_wait_ms']:g} ms, {row['rate_rps']:.0f}/s: p50 "
              f"{row['p50_err']:+.1%} ({row['p50_err_from_schedule']:+.1%} from the "
              f"schedule), elasticity {row['elasticity']:.2f}"
              f"{'' if eq is None else f' ({eq:+.1%} of speed)'}; release real / sim "
              f"{rel[0] or float('nan'):.0f} / {rel[1] or float('nan'):.0f} us; "
              f"sent in full turns {share[0]:.2f} / {share[1]:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="bench_fidelity.py --save-runs pickles (gzipped)")
    p.add_argument("--set", default="bursty", help="arrival set (default %(default)s)")
    p.add_argument("--out", default=None, help="also write the report as JSON")
    args = p.parse_args()
    report = {}
    for f in args.runs:
        grid = Path(f).name.removesuffix(".pkl.gz")
        report[grid] = analyze(load_saved_runs(f), args.set)
        print_report(grid, report[grid])
    write_report(report, args.out)


if __name__ == "__main__":
    main()
