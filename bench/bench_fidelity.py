"""Sim-to-real fidelity: how well the calibrated simulator predicts the real batcher.

Calibrates the simulator on a tiny zoo model served by ``DynamicBatcher`` on the CPU
(``batchsim.calibrate``), then serves a grid of max_batch_size x max_wait_ms x load
(0.2 to 0.9 of the calibrated capacity) with the real batcher and simulates the same
arrivals. Reports, per arrival process, the median absolute relative error of p50 and
p99 latency and of throughput (targets: 5%, 10%, 2%) and the worst configuration:

* ``poisson``: Poisson arrivals, seed 1 (the calibration runs used seeds 0 to 9, at other
  rates and policies);
* ``poisson-seed2``: the same grid on another seed;
* ``bursty``: on/off bursts (MMPP: spells of 20 ms at 3.4x the mean rate between spells of
  60 ms at 0.21x, each of exponential length).

Every real run is made twice on the same arrivals: the second against the first
(``floor``) is how far the real batcher is from itself on this machine -- no model of
it can be closer. The simulator gets the load generator's schedule and models how the
requests reach the batcher through its event loop (``sender="loop"``); each run is also
simulated from the arrival instants the batcher recorded (``recorded``: what modelling
the sender buys), with the model's ``s(b)`` alone (``base``: what calibration buys), and
with the calibration at the speed the run's own batches ran (``at_speed``: what is left
once the machine's drift is taken out).
Rows where the real load generator fell behind its schedule (``harness_behind``) measure
the harness more than the batcher; each summary also gives the errors without them. The
calibration times ``s(b)`` through the batcher on CUDA and on the model alone elsewhere
(``--profile`` overrides). The results go to ``bench/results/fidelity_cpu.json``.

Run: ``.venv/bin/python bench/bench_fidelity.py`` (``--quick`` for a short run). On a
shared machine, ``--nice -10`` (as root) keeps neighbours' load out of the measurement.
``--cpu 0`` runs everything on one CPU: the event loop and the batcher's worker thread
hand each batch to each other, and where the OS puts them (one core or two, its choice,
which can differ between the calibration and a run) changes what a hand-over costs
more than twofold (``bench/bench_thread_placement.py``). ``--cpu 2-7`` runs it on six:
a GPU batcher's pipeline has four threads, which queue for one CPU.
On a GPU: ``python bench/bench_fidelity.py --device cuda --dtype bfloat16 --size default
--model encoder --quick --workloads poisson --out bench/results/fidelity_<gpu>_encoder.json``
-- with one worker and no queue limits the simulator runs on the fast engine, which needs
numpy only, so this runs where SimPy is not installed. The JSON is rewritten after every
arrival process, so a run cut short keeps what it measured.
``--save-runs FILE`` also keeps the calibrated service, the runs its costs were fitted on
and each row's real run (gzipped pickle, rewritten with the JSON; with ``--recalibrate``
the second calibration and its runs too): a GPU machine's minutes are few, and the runs
can then be taken apart, refitted and re-simulated elsewhere.
``--probe-speed`` runs a short saturated run at each max_batch_size before each arrival
set's grid and another before each row (``speed_ratio``: the row's over the start's),
and correlates each row's p50 error with it: how much of the error is the machine's
speed moving after the calibration.
``--recalibrate`` calibrates again after the grid and simulates every row's arrivals with
that calibration too (``recal_err_*``, ``median_abs_recalibrated_*``): a machine whose
speed drifts over minutes moves a calibration, and with it every prediction, by more than
two runs a few seconds apart differ (the ``floor``). The two calibrations bracket the
grid; how far their predictions differ (``median_abs_between_calibrations_*``) is the
calibration's own reproducibility.
Every row is also simulated at the median speed the last rows before it ran at, over
the arrival sets in order (``tracked_err_*``, ``fidelity(speed_history=)``,
``TRACKED_RUNS``): the calibration's level kept up to date from runs already made.
With ``--cpu`` the bench keeps those CPUs out of their idle state
(``batchsim.cpus.awake_when_pinned``); ``--no-keep-awake`` lets it idle, as the
grids before that default did. ``--pin-threads`` puts the event loop on the first of
those CPUs and every batcher's threads one per CPU on the others, in the calibration and
every row alike (``DynamicBatcher(thread_cpus=...)``): on an H200 each row's batcher ran
at a speed of its own, in its threads' part of each batch (``bench_thread_pinning.py``).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gzip
import json
import os
import pickle
import platform
import time
from pathlib import Path

import numpy as np

import batchsim as bs

TARGETS = {"latency_ms_p50": 0.05, "latency_ms_p99": 0.10, "throughput_rps": 0.02}
#: What ``--keep-awake`` started, closed when the bench exits.
_AWAKE = contextlib.ExitStack()
atexit.register(_AWAKE.close)
RESULTS = Path(__file__).parent / "results" / "fidelity_cpu.json"
#: The grids of max_batch_size x max_wait_ms x load: ``--quick`` (12 configurations, the
#: GPU runs) and the full one (24).
QUICK_GRID = {"max_batch_size": (8, 32), "max_wait_ms": (0.0, 1.0), "load": (0.2, 0.5, 0.9)}
FULL_GRID = {"max_batch_size": (4, 16, 64), "max_wait_ms": (0.0, 1.0),
             "load": (0.2, 0.5, 0.7, 0.9)}


def workloads() -> dict:
    """Arrival processes at mean rate 1 (the grid rescales them) and their seeds."""
    return {"poisson": (bs.Poisson(1.0), 1), "poisson-seed2": (bs.Poisson(1.0), 2),
            "bursty": (bs.Bursty(4.0, 0.25, 0.02, 0.06), 3)}


def add_machine_args(p: argparse.ArgumentParser, awake_by_default: bool = False,
                     pin_threads: bool = False) -> None:
    """``--nice``, ``--cpu``, ``--keep-awake`` and, for a bench that passes
    ``settle_machine``'s ``args.thread_cpus`` to its batchers (``pin_threads``),
    ``--pin-threads``: how the bench keeps the machine's noise out. ``awake_by_default``:
    ``--cpu`` is kept awake unless ``--no-keep-awake`` (the fidelity bench's default,
    ``batchsim.cpus.awake_when_pinned``); else only with ``--keep-awake``."""
    p.add_argument("--nice", type=int, default=0, help="os.nice increment (negative: root)")
    p.add_argument("--cpu", default=None,
                   help="run on these CPUs, as 0, 2-7 or 2,3 (on one CPU the event loop and "
                        "the batcher's worker share it; a GPU batcher's pipeline wants a CPU "
                        "for each of its four threads; default: wherever the OS puts them)")
    if pin_threads:
        p.add_argument("--pin-threads", action="store_true",
                       help="the event loop on the first of --cpu and each of a batcher's "
                            "threads on one of the others, in every batcher the bench makes "
                            "(DynamicBatcher(thread_cpus=...)); needs two or more CPUs")
    p.add_argument("--keep-awake", action=argparse.BooleanOptionalAction,
                   default=None if awake_by_default else False,
                   help="keep --cpu out of their idle state: a PM QoS request under which "
                        "an idle CPU polls, root only (batchsim.cpus.kept_awake)"
                        + ("; the default with --cpu" if awake_by_default else ""))


def settle_machine(args):
    """Apply ``--nice``, ``--cpu`` and ``--keep-awake``, then load torch with one thread,
    then ``--pin-threads`` (the event loop's CPU now; the CPUs for the batchers' threads
    in ``args.thread_cpus``, None without it); returns torch.

    Before any thread starts (threads inherit the CPU) and before torch loads: tiny
    models want one thread, and the environment variable reaches the worker threads too
    (``torch.set_num_threads`` alone sets it for this thread only).
    """
    from batchsim.cpus import settle_on_cpus, split_for_threads

    if args.nice:
        os.nice(args.nice)
    pin = getattr(args, "pin_threads", False)
    try:
        cpus, awake = settle_on_cpus(args.cpu, args.keep_awake, getattr(args, "device", None),
                                     "--cpu", "--keep-awake")
        loop_cpu, args.thread_cpus = split_for_threads(cpus) if pin else (None, None)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    args.cpu = None if cpus is None else list(cpus)  # as the results file keeps it
    kept = _AWAKE.enter_context(awake)
    args.keep_awake = kept is not None  # what was done, for the results file
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    if loop_cpu is not None:  # after kept_awake has checked the CPUs against ours
        os.sched_setaffinity(0, {loop_cpu})
    return torch


def save_runs(saved: dict, path) -> None:
    """Pickle (gzipped) what ``--save-runs`` keeps, replacing what was there."""
    Path(path).write_bytes(gzip.compress(pickle.dumps(saved)))


def load_saved_runs(path) -> dict:
    """What ``--save-runs`` pickled: ``service``, ``calibration_runs``, ``runs`` (per
    arrival set, each row's policy, rate, seed and real run), and with ``--recalibrate``
    ``recalibration`` and ``recalibration_runs``."""
    return pickle.loads(gzip.decompress(Path(path).read_bytes()))


def write_report(report: dict, out) -> None:
    """Write ``report`` as JSON to ``out`` (numpy numbers as floats; its folder made if
    need be) and say so (nothing when ``out`` is None)."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1, default=float) + "\n")
        print(f"wrote {out}", flush=True)


def real_runs_by_part(saved: dict) -> dict:
    """A ``--save-runs`` pickle's real runs by part: the calibration's, then each arrival
    set's."""
    return {"calibration_runs": saved["calibration_runs"],
            **{name: [row["real"] for row in rows] for name, rows in saved["runs"].items()}}


def print_measures(report: dict) -> None:
    """Print a report of measures by part, a line a measure."""
    for name, measures in report.items():
        print(f"{name}:")
        for key, value in measures.items():
            print(f"   {key:>24}: {value:10.3f}")


def saved_runs_main(doc: str, analyze, print_report) -> None:
    """The command line of a bench that reads one ``--save-runs`` pickle: ``analyze``
    it, print the report and, with ``--out FILE``, write it as JSON."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("runs", help="a bench_fidelity.py --save-runs pickle (gzipped)")
    p.add_argument("--out", default=None, help="also write the report as JSON")
    args = p.parse_args()
    report = analyze(load_saved_runs(args.runs))
    print_report(report)
    write_report(report, args.out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp", choices=["mlp", "cnn", "encoder"],
                   help="zoo model (default %(default)s)")
    p.add_argument("--size", default="tiny", choices=["tiny", "default"],
                   help="zoo model size (default %(default)s)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default float32)")
    p.add_argument("--workloads", default=",".join(workloads()),
                   help="comma-separated arrival processes (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="smaller grid and runs")
    p.add_argument("--duration-s", type=float, default=None, help="seconds of traffic a run")
    p.add_argument("--profile", default="auto", choices=["auto", "model", "batcher"],
                   help="how calibrate times s(b) (default %(default)s: through the batcher "
                        "on CUDA, the model alone elsewhere)")
    p.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=None,
                   help="serve every batch through the stage/launch/complete pipeline of "
                        "threads, or not (a thread per worker); default: the device's "
                        "default (the pipeline on CUDA)")
    add_machine_args(p, awake_by_default=True, pin_threads=True)
    p.add_argument("--out", default=str(RESULTS), help="results JSON (default %(default)s)")
    p.add_argument("--recalibrate", action="store_true",
                   help="calibrate again after the grid and simulate every row with that "
                        "calibration too (the calibration's reproducibility)")
    p.add_argument("--probe-speed", action="store_true",
                   help="a short saturated run before the grid and before each row: how "
                        "much faster or slower the machine served than at the start "
                        "(speed_ratio)")
    p.add_argument("--save-runs", default=None, metavar="PICKLE",
                   help="also pickle (gzipped) the calibrated service, its calibration runs "
                        "and each row's first real run, per arrival process (to take rows "
                        "apart, refit or re-simulate them later)")
    args = p.parse_args()
    torch = settle_machine(args)

    from batchsim.calibrate import calibrate
    from batchsim.fidelity import fidelity, resimulate
    from batchsim.real import DynamicBatcher, make_model

    model = make_model(args.model, device=args.device, dtype=args.dtype, size=args.size)
    grid = QUICK_GRID if args.quick else FULL_GRID
    # The calibration and every row serve the model as this batcher would (its ``like``).
    served = DynamicBatcher(model, bs.BatchPolicy(max(grid["max_batch_size"]), 0.0),
                            device=args.device, pipeline=args.pipeline,
                            thread_cpus=args.thread_cpus)
    chosen = {name: workloads()[name] for name in args.workloads.split(",")}
    duration_s = args.duration_s or (0.5 if args.quick else 1.5)
    t0 = time.perf_counter()
    calibration_runs = []
    service = calibrate(served, max(grid["max_batch_size"]), seed=0, device=args.device,
                        profile=args.profile, runs=calibration_runs)
    calibrate_s = time.perf_counter() - t0
    costs = service.costs
    wake_ms = dict(zip(np.round(costs.idle_ms, 3).tolist(), np.round(costs.wake_ms, 3).tolist(),
                       strict=True))
    release_ms = dict(zip(np.round(costs.release_sizes, 1).tolist(),
                          np.round(costs.release_table_ms, 3).tolist(), strict=True))
    spread_ms = np.round(np.quantile(costs.release_spread_ms or 0.0, (0.1, 0.9)), 3).tolist()
    print(f"calibrated {model.zoo_name} in {calibrate_s:.1f} s (s(b) timed through the "
          f"{service.metadata['profile']}): worker +{service.per_batch_ms:.3f}"
          f" ms/batch +{service.per_item_ms:.4f} ms/request, jitter CV {service.jitter_cv:.2f};"
          f" react {costs.react_ms:.3f} ms, release by batch size (ms) {release_ms} (spread "
          f"{spread_ms} ms, 10th-90th percentile), timer "
          f"{costs.timer_resolution_ms:.2f} ms grid +{costs.timer_latency_ms:.3f} ms, "
          f"{costs.arrival_ms:.4f} ms per arrival (the first {costs.first_arrival_ms:.4f} ms "
          f"more), wake-up by the time since the worker's last batch ended (ms) {wake_ms}; "
          f"capacity {service.metadata['capacity_ratio']:.2f}x the measured saturated "
          f"throughput", flush=True)

    report = {"model": model.zoo_name, "device": service.metadata.get("device"),
              "dtype": str(model.input_spec.dtype).removeprefix("torch."),
              "torch": torch.__version__, "python": platform.python_version(),
              "cpu_count": os.cpu_count(), "torch_threads": 1, "nice": args.nice, "cpu": args.cpu,
              "keep_awake": args.keep_awake, "pin_threads": args.pin_threads,
              "pipeline": args.pipeline,
              "quick": args.quick, "duration_s": duration_s, "grid": grid, "targets": TARGETS,
              "calibration": service.to_dict(), "calibrate_s": calibrate_s,
              "loadavg_start": os.getloadavg(), "workloads": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    saved = {"service": service, "calibration_runs": calibration_runs, "runs": {}}
    frames = {}
    speed_history = []    # each row's worker_time_ratio, in run order, across the sets
    for name, (shape, seed) in chosen.items():
        print(f"-- {name} (seed {seed})", flush=True)
        saved["runs"][name] = []
        df = fidelity(served, service, workload=shape, n_requests=1000, duration_s=duration_s,
                      seed=seed, repeat=True, baseline=service.model, progress=True,
                      device=args.device, runs=saved["runs"][name],
                      probe_speed=args.probe_speed, speed_history=speed_history, **grid)
        frames[name] = df
        summary = report_workload(report, name, df)
        print(f"   median |error|: p50 {summary['median_abs_err_latency_ms_p50']:.1%} "
              f"(target 5%), p99 {summary['median_abs_err_latency_ms_p99']:.1%} (10%), "
              f"throughput {summary['median_abs_err_throughput_rps']:.2%} (2%); real vs real:"
              f" p50 {summary['median_abs_floor_latency_ms_p50']:.1%}, p99 "
              f"{summary['median_abs_floor_latency_ms_p99']:.1%}; model alone: p50 "
              f"{summary['median_abs_base_latency_ms_p50']:.1%}, p99 "
              f"{summary['median_abs_base_latency_ms_p99']:.1%}; fed the recorded arrivals: p50 "
              f"{summary['median_abs_recorded_latency_ms_p50']:.1%}, p99 "
              f"{summary['median_abs_recorded_latency_ms_p99']:.1%}; the load generator fell "
              f"behind in {summary['harness_behind']} of {summary['configurations']}, over "
              f"the others: p50 {summary['median_abs_kept_latency_ms_p50']:.1%}, p99 "
              f"{summary['median_abs_kept_latency_ms_p99']:.1%}; worst: {summary['worst']}",
              flush=True)
        print(f"   told each row's speed (its batches took "
              f"{summary['worker_time_ratio_p5']:.2f}-{summary['worker_time_ratio_p95']:.2f}x "
              f"the calibration's time, 5th-95th percentile): p50 "
              f"{summary['median_abs_at_speed_latency_ms_p50']:.1%}, p99 "
              f"{summary['median_abs_at_speed_latency_ms_p99']:.1%}; at the speed of the last rows "
              f"before each (tracked): p50 {summary['median_abs_tracked_latency_ms_p50']:.1%}, "
              f"p99 {summary['median_abs_tracked_latency_ms_p99']:.1%}", flush=True)
        if args.probe_speed:
            print(f"   the machine served {summary['speed_ratio_p5']:.2f}-"
                  f"{summary['speed_ratio_p95']:.2f}x as fast as at the start of the set "
                  f"(5th-95th percentile over the rows); correlation of a row's p50 error "
                  f"with it: {summary['speed_corr_err_latency_ms_p50']:+.2f}", flush=True)
        report["loadavg_end"] = os.getloadavg()
        report["elapsed_s"] = time.perf_counter() - t0
        write_report(report, out)
        for run in saved["runs"][name]:
            run.pop("again")  # the floor's second run: only its errors are needed
        if args.save_runs:
            save_runs(saved, args.save_runs)
    if args.recalibrate:
        saved["recalibration_runs"] = []
        again = calibrate(served, max(grid["max_batch_size"]), seed=0, device=args.device,
                          profile=args.profile, runs=saved["recalibration_runs"])
        saved["recalibration"] = again
        report["recalibration"] = again.to_dict()
        for name, df in frames.items():
            resimulate(df, saved["runs"][name], again)
            summary = report_workload(report, name, df)
            print(f"-- {name}, simulated with a calibration made after the grid: median "
                  f"|error| p50 {summary['median_abs_recalibrated_latency_ms_p50']:.1%}, p99 "
                  f"{summary['median_abs_recalibrated_latency_ms_p99']:.1%}, throughput "
                  f"{summary['median_abs_recalibrated_throughput_rps']:.2%} (with the first: "
                  f"{summary['median_abs_err_latency_ms_p50']:.1%}, "
                  f"{summary['median_abs_err_latency_ms_p99']:.1%}, "
                  f"{summary['median_abs_err_throughput_rps']:.2%}); the two calibrations' "
                  f"predictions differ by p50 "
                  f"{summary['median_abs_between_calibrations_latency_ms_p50']:.1%}, p99 "
                  f"{summary['median_abs_between_calibrations_latency_ms_p99']:.1%}",
                  flush=True)
        write_report(report, out)
        if args.save_runs:
            save_runs(saved, args.save_runs)


def report_workload(report: dict, name: str, df) -> dict:
    """Put one arrival process's rows and summary (with ``meets_targets``) in the report."""
    from batchsim.fidelity import fidelity_summary

    summary = fidelity_summary(df)
    summary["meets_targets"] = {m: summary[f"median_abs_err_{m}"] <= t
                                for m, t in TARGETS.items()}
    report["workloads"][name] = {"summary": summary, "rows": df.to_dict("records")}
    return summary


if __name__ == "__main__":
    main()
