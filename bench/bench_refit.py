"""What a change of the cost model does to a saved fidelity run's predictions.

``bench_fidelity.py --save-runs RUNS.pkl.gz`` keeps the calibrated service, the ten runs
its costs were fitted on and every row's real run. This bench fits the costs again on
those ten runs with the kit's code as it is now (``batchsim.calibrate.refit``: ``s(b)``
and the timer kept), simulates every row's scheduled arrivals with the saved calibration
and with the refitted one (the load generator on the loop, as ``fidelity`` does), and
prints per arrival set the median absolute error of p50, p99 and throughput, and the
signed median p50 error, of each against the same real runs, and in how many rows the
refit comes closer. A change to the model of the batcher's costs then shows on runs
already made -- a GPU machine's too -- rather than on new runs, whose machine has
drifted since. The saved calibration is simulated by the current engines: after a change
in how they read a cost (the wake-up's ``idle_ms`` came to count from the end of the
worker's previous batch), compare the two versions with ``bench_row_errors.py`` instead.

Run: ``.venv/bin/python bench/bench_refit.py RUNS.pkl.gz`` (``--out FILE`` writes JSON).
"""

from __future__ import annotations

import numpy as np
from bench_fidelity import saved_runs_main

METRICS = ("latency_ms_p50", "latency_ms_p99", "throughput_rps")
COSTS = ("per_batch_ms", "per_item_ms", "arrival_ms", "first_arrival_ms")


def row_errors(service, runs) -> dict:
    """Per metric, each row's relative error (simulated over real, less 1) when
    ``service`` simulates the row's scheduled arrivals, as ``fidelity`` does."""
    import pandas as pd

    from batchsim.fidelity import resimulate

    df = pd.DataFrame(index=range(len(runs)))
    resimulate(df, runs, service, prefix="err")
    return {m: df[f"err_{m}"].tolist() for m in METRICS}


def summarize(errors: dict) -> dict:
    """Median absolute error per metric, and the signed median p50 error (the bias)."""
    out = {f"median_abs_err_{m}": float(np.median(np.abs(errors[m]))) for m in METRICS}
    out["median_err_latency_ms_p50"] = float(np.median(errors["latency_ms_p50"]))
    return out


def costs_of(service) -> dict:
    """The worker's fitted costs (ms): per batch, per request, per arrival, the first's;
    and the loop's linger after a sender's turn (a reaction where none was fitted)."""
    return {"per_batch_ms": service.per_batch_ms, "per_item_ms": service.per_item_ms,
            "arrival_ms": service.costs.arrival_ms,
            "first_arrival_ms": getattr(service.costs, "first_arrival_ms", 0.0),
            "linger_ms": 1e3 * service.costs.linger_s}


def compare_fits(saved: dict) -> dict:
    """The saved calibration against its refit, over every saved arrival set."""
    from batchsim.calibrate import refit

    fits = {"saved": saved["service"],
            "refitted": refit(saved["service"], saved["calibration_runs"])}
    report = {"costs": {name: costs_of(svc) for name, svc in fits.items()}}
    for name, runs in saved["runs"].items():
        report[name] = {fit: {**summarize(errors := row_errors(svc, runs)),
                              "rows": errors} for fit, svc in fits.items()}
        report[name]["closer"] = closer_rows(report[name]["saved"]["rows"],
                                             report[name]["refitted"]["rows"])
    return report


def closer_rows(saved: dict, refitted: dict) -> dict:
    """Per metric, in how many rows the refit's error is smaller than the saved one's,
    and in how many larger (a paired count: the rows share their real runs)."""
    out = {}
    for m in METRICS:
        a, b = np.abs(saved[m]), np.abs(refitted[m])
        out[m] = {"refitted_closer": int((b < a).sum()), "saved_closer": int((a < b).sum())}
    return out


def print_report(report: dict) -> None:
    for fit, costs in report["costs"].items():
        print(f"{fit:>9}: " + ", ".join(f"{k} {1e3 * v:.2f} us" for k, v in costs.items()))
    for name, fits in report.items():
        if name == "costs":
            continue
        print(f"-- {name}: median |error| p50, p99, throughput; signed median p50")
        for fit in ("saved", "refitted"):
            s = fits[fit]
            print(f"   {fit:>9}: {s['median_abs_err_latency_ms_p50']:.1%}, "
                  f"{s['median_abs_err_latency_ms_p99']:.1%}, "
                  f"{s['median_abs_err_throughput_rps']:.2%}; "
                  f"{s['median_err_latency_ms_p50']:+.1%}")
        print("   rows where the refit is closer / further: " + ", ".join(
            f"{m.removeprefix('latency_ms_')} {c['refitted_closer']} / {c['saved_closer']}"
            for m, c in fits["closer"].items()))


def main() -> None:
    saved_runs_main(__doc__, compare_fits, print_report)


if __name__ == "__main__":
    main()
