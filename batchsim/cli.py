"""The ``batchsim`` command (also ``python -m batchsim``).

Each subcommand is a pair of functions: ``_args_NAME(parser)`` declares its arguments
and ``_run_NAME(args)`` does the work and returns an exit code; ``COMMANDS`` lists them.
Bad arguments print one line, ``batchsim: error: ...``, and exit with code 2; output
files are checked before any work starts, and a write that fails anyway exits with 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from .sim import ENGINES

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (and exit code 2)."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"batchsim: error: {message}\n")


def _output_file(text: str) -> str:
    """An argparse type: a file this process can write (its folder exists), not a folder."""
    path = Path(text)
    folder = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"folder {str(folder)!r} of {text!r} does not exist")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}")
    return text


def _figure_file(text: str) -> str:
    """An argparse type: an ``_output_file`` in a format matplotlib can save (checked
    before a sweep or a grid runs, not after)."""
    from matplotlib.backend_bases import FigureCanvasBase

    text = _output_file(text)
    formats = FigureCanvasBase.get_supported_filetypes()
    if Path(text).suffix.lstrip(".").lower() not in formats:
        raise argparse.ArgumentTypeError(f"{text!r}: the figure's format comes from its "
                                          f"suffix, one of {sorted(formats)}")
    return text


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    return _int_from(text, 1)


def _seed(text: str) -> int:
    """An argparse type: an integer >= 0."""
    return _int_from(text, 0)


def _int_from(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {text!r}")
    return value


def _positive_number(text: str) -> float:
    """An argparse type: a positive finite number."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text!r}")
    return value


def _service_spec(text: str):
    """``affine:BASE_MS,PER_ITEM_MS`` -> AffineService."""
    from .service import AffineService

    usage = f"--service must look like affine:BASE_MS,PER_ITEM_MS, got {text!r}"
    kind, _, params = text.partition(":")
    if kind != "affine":
        raise ValueError(usage)
    try:
        base_ms, per_item_ms = (float(v) for v in params.split(","))
    except ValueError:
        raise ValueError(usage) from None
    return AffineService(base_ms, per_item_ms)


def add_model_arguments(p: argparse.ArgumentParser, grid: bool = False) -> None:
    """Arguments shared by commands that simulate: arrivals, service, workers, n, seed.

    With ``grid`` (sweeps), ``--workers`` and ``--seed`` take several values.
    """
    several = {"nargs": "+"} if grid else {}
    p.add_argument("--rate", type=_positive_number, required=True,
                   help="mean arrival rate, requests/s")
    p.add_argument("--arrivals", choices=["poisson", "constant", "gamma"], default="poisson")
    p.add_argument("--cv", type=float, help="gap CV for --arrivals gamma (default 1.0)")
    svc = p.add_mutually_exclusive_group()
    svc.add_argument("--service", default="affine:1.9,0.14",
                     help="affine:BASE_MS,PER_ITEM_MS (default %(default)s)")
    svc.add_argument("--profile", help="service profile JSON file or shipped profile name")
    p.add_argument("--jitter-cv", type=float,
                   help="service-time CV (default: the service's own; 0 for none)")
    p.add_argument("--workers", type=int, default=[1] if grid else 1, **several)
    p.add_argument("-n", "--n-requests", type=int, default=100_000)
    p.add_argument("--seed", type=_seed, default=[0] if grid else 0, **several)
    p.add_argument("--engine", choices=ENGINES, default="auto")


def model_from_args(args):
    """``(workload, service)`` from the shared model arguments."""
    from dataclasses import fields, replace

    from . import workload as wl
    from .service import load_service

    if args.cv is not None and args.arrivals != "gamma":
        raise ValueError(f"--cv applies to --arrivals gamma, not {args.arrivals}: "
                         f"got --cv {args.cv!r}")
    arrivals = {"poisson": lambda: wl.Poisson(args.rate),
                "constant": lambda: wl.Constant(args.rate),
                "gamma": lambda: wl.Gamma(args.rate, 1.0 if args.cv is None else args.cv),
                }[args.arrivals]()
    service = load_service(args.profile) if args.profile else _service_spec(args.service)
    if args.jitter_cv is not None:
        if "jitter_cv" not in {f.name for f in fields(service)}:
            raise ValueError(f"--jitter-cv applies to affine and profile services, not the "
                             f"{type(service).__name__} in --profile {args.profile!r} "
                             f"(it carries its own measured spread), got {args.jitter_cv!r}")
        service = replace(service, jitter_cv=args.jitter_cv)
    return arrivals, service


def _args_simulate(p):
    add_model_arguments(p)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--max-queue-size", type=int, default=None)
    p.add_argument("--timeout-ms", type=float, default=None)
    p.add_argument("--slo-ms", type=float, default=None, help="report goodput within this SLO")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def _run_simulate(args) -> int:
    from .policy import BatchPolicy
    from .sim import simulate

    workload, service = model_from_args(args)
    policy = BatchPolicy(args.max_batch_size, args.max_wait_ms, args.max_queue_size,
                         args.timeout_ms)
    res = simulate(workload, policy, service, n_requests=args.n_requests,
                   workers=args.workers, seed=args.seed, engine=args.engine)
    summary = res.summary(slo_ms=args.slo_ms)
    if args.json:
        print(json.dumps(summary, default=float))
    else:
        print(format_summary(summary))
    return 0


def format_summary(summary: dict) -> str:
    """A two-column text table of a summary dict."""
    width = max(map(len, summary))
    lines = []
    for key, value in summary.items():
        if isinstance(value, float):
            value = f"{value:.4g}" if math.isfinite(value) else str(value)
        elif isinstance(value, list):
            value = ", ".join(f"{v:.3g}" for v in value)
        lines.append(f"{key:<{width}}  {value}")
    return "\n".join(lines)


def _args_profile(p):
    p.add_argument("--model", choices=["mlp", "cnn", "encoder"], required=True)
    p.add_argument("--size", choices=["default", "tiny"], default="default")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16, float16")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256,512")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--compute-only", action="store_true",
                   help="inputs already on the device, no copies (default: end to end)")
    p.add_argument("--through-batcher", action="store_true",
                   help="time full batches through a one-worker DynamicBatcher (on CUDA: "
                        "its graphs and pipeline) instead of the model alone")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    p.add_argument("--out", type=_output_file, required=True, help="profile JSON file to write")


def _run_profile(args) -> int:
    import torch

    from .real.models import make_model
    from .real.profiler import profile_batcher, profile_model

    if args.through_batcher and args.compute_only:
        raise ValueError("--through-batcher times what the batcher runs, copies included: "
                         "it cannot be --compute-only")
    try:
        sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        raise ValueError(f"--batch-sizes must be integers separated by commas, "
                         f"got {args.batch_sizes!r}") from None
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = make_model(args.model, device=args.device, dtype=args.dtype, size=args.size)
    service = (profile_batcher(model, sizes, repeats=args.repeats) if args.through_batcher
               else profile_model(model, sizes, repeats=args.repeats,
                                  end_to_end=not args.compute_only))
    service.save(args.out)
    meta = service.metadata
    print(f"{meta['model']} {meta['dtype']} on {meta['device']} -> {args.out}")
    for b, t_ms, p90_ms in zip(service.batch_sizes, service.times_ms, meta["p90_ms"],
                               strict=True):
        print(f"  b={b:<5} s(b) median {t_ms:9.4f} ms   p90 {p90_ms:9.4f} ms")
    return 0


def _args_sweep(p):
    add_model_arguments(p, grid=True)
    p.add_argument("--max-batch-size", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--max-wait-ms", type=float, nargs="+", default=[0.0, 1.0, 2.0, 5.0, 10.0])
    p.add_argument("--load", type=float, nargs="+", default=None,
                   help="fractions of the capacity of the largest --max-batch-size with "
                   "that many workers (each rescales the arrivals); default: --rate itself")
    p.add_argument("--slo-ms", type=float, default=None, help="goodput columns, SLO line")
    p.add_argument("--warmup-frac", type=float, default=0.0)
    p.add_argument("--out", type=_output_file, help="CSV file for the results (one row per run)")
    p.add_argument("--plot", type=_figure_file, help="PNG file: latency vs throughput (give "
                   "several --load values for curves) and a p99 heatmap")
    p.add_argument("--no-progress", action="store_true")


def _run_sweep(args) -> int:
    from .sweep import sweep

    workload, service = model_from_args(args)
    df = sweep(workload, service, args.max_batch_size, args.max_wait_ms, load=args.load,
               workers=args.workers, seeds=args.seed, n_requests=args.n_requests,
               engine=args.engine, progress=not args.no_progress, slo_ms=args.slo_ms,
               warmup_frac=args.warmup_frac)
    if args.out:
        df.to_csv(args.out, index=False)
    if args.plot:
        _plot_sweep(df, args.plot, args.slo_ms)
    shown = [c for c in ("max_batch_size", "max_wait_ms", "load", "workers", "seed",
                         "throughput_rps", "latency_ms_p50", "latency_ms_p99",
                         "mean_batch_size") if c in df.columns]
    print(df[shown].to_string(index=False, max_rows=40, float_format="{:.4g}".format))
    return 0


def _plot_sweep(df, path, slo_ms) -> None:
    """Latency against throughput (one curve per max_wait_ms) beside a p99 heatmap.

    The heatmap holds workers and load at their first values; with several loads, the
    curves run over load at the largest max_batch_size.
    """
    from matplotlib.figure import Figure

    from .viz.plots import frontier, heatmap

    workers = df["workers"].iloc[0]
    held = df[df["workers"] == workers]
    curves, note = held, f"workers={workers}"
    if "load" in df.columns:
        if held["load"].nunique() > 1:
            biggest = held["max_batch_size"].max()
            curves = held[held["max_batch_size"] == biggest]
            note += f", max_batch_size={biggest}, over load"
        held = held[held["load"] == df["load"].iloc[0]]
    fig = Figure(figsize=(14, 5), layout="constrained")
    left, right = fig.subplots(1, 2)
    frontier(curves, ax=left).set_title(note)
    heatmap(held, "latency_ms_p99", slo_ms=slo_ms, ax=right).set_title(
        f"workers={workers}" + (f", load={df['load'].iloc[0]:g}" if "load" in df.columns
                                else f", rate={df['rate_rps'].iloc[0]:g} requests/s"))
    fig.savefig(path, dpi=110)


def _args_recommend(p):
    from .result import PERCENTILES

    add_model_arguments(p, grid=True)
    p.set_defaults(workers=[1, 2, 4], n_requests=50_000)
    p.add_argument("--slo-ms", type=float, required=True)
    p.add_argument("--percentile", type=float, default=99, choices=PERCENTILES)
    p.add_argument("--max-batch-size", type=int, nargs="+",
                   default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--max-wait-ms", type=float, nargs="+", default=None,
                   help="default: 0 and 1/32 ... 1/2 of the SLO")
    p.add_argument("--out", type=_output_file,
                   help="CSV file for the evidence (every configuration)")
    p.add_argument("--no-progress", action="store_true")


def _run_recommend(args) -> int:
    """Print the recommendation; exit code 1 when nothing meets the SLO."""
    from .plan import recommend

    workload, service = model_from_args(args)
    rec = recommend(workload, service, args.slo_ms, args.percentile, workers=args.workers,
                    max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms,
                    n_requests=args.n_requests, seeds=args.seed, engine=args.engine,
                    progress=not args.no_progress)
    if args.out:
        rec.evidence.to_csv(args.out, index=False)
    print(rec.reason)
    if len(rec.runner_ups):
        print("runner-ups:")
        print(rec.runner_ups.to_string(index=False, float_format="{:.4g}".format))
    return 0 if rec.met else 1


def _args_validate(p):
    p.add_argument("--model", default="tiny-mlp",
                   help="zoo model: mlp, cnn, encoder, or tiny-mlp, ... (default %(default)s)")
    p.add_argument("--grid", nargs="+", default=[],
                   help="NAME=V1,V2,... for max_batch_size, max_wait_ms, load (default "
                   "max_batch_size=8,32 max_wait_ms=0,1 load=0.2,0.5,0.9)")
    p.add_argument("--arrivals", choices=["poisson", "bursty"], default="poisson",
                   help="arrival process of the grid's runs (default %(default)s; bursty: "
                        "on/off, spells of 20 ms at 3.4x the mean rate between spells "
                        "of 60 ms at 0.21x, each of exponential length)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, ...")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=_positive_int, default=1, help="torch CPU threads")
    p.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=None,
                   help="serve every batch through the stage/launch/complete pipeline of "
                   "threads, or a thread per worker (--no-pipeline), in the calibration and "
                   "every run (default: the device's default, the pipeline on CUDA)")
    p.add_argument("--cpu", default=None,
                   help="run on these CPUs, as 0, 2-7 or 2,3: on one, the event loop and "
                   "the batcher's worker share it in the calibration and in every run; a "
                   "GPU batcher's pipeline wants one for each of its four threads (default: "
                   "wherever the OS puts them, which can differ from run to run)")
    p.add_argument("--pin-threads", action="store_true",
                   help="with two or more CPUs in --cpu: the event loop on the first, and "
                   "each of the batcher's threads on one of the others, in turn (default: "
                   "the OS places them among --cpu, and may place each batcher anew)")
    p.add_argument("--keep-awake", action=argparse.BooleanOptionalAction, default=None,
                   help="keep --cpu out of their idle state while it all runs: a PM "
                   "QoS request under which an idle CPU polls, so that a batch after a "
                   "pause does not wait for a virtual machine's CPU to come back (Linux, "
                   "root; the default with --cpu where it can, --no-keep-awake to let it "
                   "idle)")
    p.add_argument("--duration-s", type=float, default=1.0, help="seconds of traffic a run")
    p.add_argument("-n", "--n-requests", type=int, default=1000, help="at least this many")
    p.add_argument("--seed", type=_seed, default=1, help="seed of the arrivals (calibration "
                   "uses its own)")
    p.add_argument("--repeat", action="store_true",
                   help="run the real batcher twice: how far it is from itself")
    p.add_argument("--recalibrate", action="store_true",
                   help="calibrate again after the grid and simulate every run with that "
                   "calibration too: how far two calibrations minutes apart disagree (the "
                   "machine's drift, which --repeat's runs seconds apart do not see)")
    p.add_argument("--probe-speed", action="store_true",
                   help="a short saturated run before the grid and before each row: how "
                   "much faster or slower the machine served each row than at the start "
                   "(speed_ratio), and how the rows' p50 errors go with it")
    p.add_argument("--calibration", help="a calibrated model JSON to use instead of calibrating")
    p.add_argument("--save-calibration", type=_output_file,
                   help="write the calibrated model JSON here")
    p.add_argument("--out", type=_output_file,
                   help="CSV file for the error table (one row per configuration)")
    p.add_argument("--plot", type=_figure_file,
                   help="PNG file: simulated against real p50 and p99")


_GRID_DEFAULTS = {"max_batch_size": (8, 32), "max_wait_ms": (0.0, 1.0), "load": (0.2, 0.5, 0.9)}


def _grid(entries) -> dict:
    """``["max_batch_size=8,32", ...]`` -> ``{"max_batch_size": (8, 32), ...}`` (defaults)."""
    grid = dict(_GRID_DEFAULTS)
    for entry in entries:
        name, _, values = entry.partition("=")
        if name not in grid or not values:
            raise ValueError(f"--grid entries must look like NAME=V1,V2 with NAME one of "
                             f"{sorted(grid)}, got {entry!r}")
        kind = int if name == "max_batch_size" else float
        try:
            grid[name] = tuple(kind(v) for v in values.split(","))
        except ValueError:
            raise ValueError(f"--grid {name} must be {kind.__name__}s separated by commas, "
                             f"got {values!r}") from None
    return grid


def _run_validate(args) -> int:
    import os

    from .cpus import settle_on_cpus, split_for_threads

    # Before any thread starts: the batcher's threads inherit the CPUs.
    cpus, awake = settle_on_cpus(args.cpu, args.keep_awake, args.device, "--cpu",
                                 "--keep-awake")
    loop_cpu, thread_cpus = split_for_threads(cpus) if args.pin_threads else (None, None)
    with awake:
        if loop_cpu is not None:  # after kept_awake has checked the CPUs against ours
            os.sched_setaffinity(0, {loop_cpu})
        return _validate(args, thread_cpus)


def _validate(args, thread_cpus=None) -> int:
    """Calibrate (or load a calibration), run the grid, print and write its errors, with
    the batcher's threads on ``thread_cpus`` (None: where the OS puts them)."""
    import os

    # Before torch loads, so that the batcher's worker threads get it too (set_num_threads
    # below applies to this thread only).
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    from . import calibrate as cal
    from . import fidelity as fid
    from .policy import BatchPolicy
    from .real import DynamicBatcher
    from .real.models import MODELS, make_model
    from .service import CalibratedService, load_service
    from .workload import Bursty, Poisson

    grid = _grid(args.grid)
    fid.checked_grid(**grid, n_requests=args.n_requests, duration_s=args.duration_s,
                     seed=args.seed)
    size, _, name = args.model.rpartition("-")
    if name not in MODELS or size not in ("", "tiny"):
        raise ValueError(f"--model must be one of {list(MODELS)}, optionally tiny-..., "
                         f"got {args.model!r}")
    torch.set_num_threads(args.threads)
    model = make_model(name, device=args.device, dtype=args.dtype, size=size or "default")
    # The calibration and every run serve the model as this batcher would (its ``like``).
    served = DynamicBatcher(model, BatchPolicy(max(grid["max_batch_size"]), 0.0),
                            device=args.device, pipeline=args.pipeline,
                            thread_cpus=thread_cpus)
    if args.calibration:
        service = load_service(args.calibration)
        if not isinstance(service, CalibratedService):
            raise ValueError(f"--calibration must hold a calibrated model, got "
                             f"{type(service).__name__} from {args.calibration!r}")
        serving = {"model": model.zoo_name,
                   "dtype": str(model.input_spec.dtype).removeprefix("torch.")}
        made_on = {key: service.metadata.get(key, value) for key, value in serving.items()}
        if made_on != serving:  # a calibration that does not say is taken at its word
            raise ValueError(f"--calibration {args.calibration!r} was made on "
                             f"{made_on['model']} at {made_on['dtype']}, not the --model "
                             f"{args.model!r} at --dtype {args.dtype!r}")
    else:
        print(f"calibrating {model.zoo_name} on {args.device} ...", flush=True)
        service = cal.calibrate(served, max(grid["max_batch_size"]), device=args.device)
    if args.save_calibration:
        service.save(args.save_calibration)
    shape = Poisson(1.0) if args.arrivals == "poisson" else Bursty(4.0, 0.25, 0.02, 0.06)
    runs = [] if args.recalibrate else None   # the real runs, to simulate them again
    df = fid.fidelity(served, service, workload=shape, n_requests=args.n_requests,
                      duration_s=args.duration_s, seed=args.seed, repeat=args.repeat,
                      device=args.device, progress=True, runs=runs,
                      probe_speed=args.probe_speed, speed_history=[], **grid)
    if args.recalibrate:
        print(f"calibrating {model.zoo_name} again, after the grid ...", flush=True)
        fid.resimulate(df, runs, cal.calibrate(served, max(grid["max_batch_size"]),
                                               device=args.device))
    if args.out:
        df.to_csv(args.out, index=False)
    if args.plot:
        fid.plot_fidelity(df).savefig(args.plot, dpi=110)
    shown = ["max_batch_size", "max_wait_ms", "load", "rate_rps", "real_latency_ms_p50",
             "err_latency_ms_p50", "share_err_latency_ms_p50", "real_latency_ms_p99",
             "err_latency_ms_p99", "err_latency_ms_mean", "err_throughput_rps",
             "err_mean_batch_size", "harness_behind"]
    print(df[shown].to_string(index=False, float_format="{:.3g}".format))
    summary = fid.fidelity_summary(df)
    headline = ("latency_ms_p50", "latency_ms_p99", "throughput_rps")
    print("median |relative error|: " + ", ".join(
        f"{m.removeprefix('latency_ms_')} {summary[f'median_abs_err_{m}']:.1%}"
        for m in headline))
    if summary["harness_behind"]:
        print(f"the load generator fell behind its schedule in {summary['harness_behind']} "
              f"of {len(df)} configurations (harness_behind: the harness, not the batcher, "
              f"set their latencies)" + ("; over the others: " + ", ".join(
                  f"{m.removeprefix('latency_ms_')} {summary[f'median_abs_kept_{m}']:.1%}"
                  for m in headline) if summary["harness_behind"] < len(df) else ""))
    if "worker_time_ratio" in df:
        print(f"told each row's speed (its batches took {summary['worker_time_ratio_p5']:.2f}-"
              f"{summary['worker_time_ratio_p95']:.2f}x the calibration's time, 5th-95th "
              f"percentile): " + ", ".join(
                  f"{m.removeprefix('latency_ms_')} {summary[f'median_abs_at_speed_{m}']:.1%}"
                  for m in headline))
        print("at the speed the last rows before each ran at (tracked): " + ", ".join(
            f"{m.removeprefix('latency_ms_')} {summary[f'median_abs_tracked_{m}']:.1%}"
            for m in headline))
    if args.recalibrate:
        print("with the calibration made after the grid: " + ", ".join(
            f"{m.removeprefix('latency_ms_')} {summary[f'median_abs_recalibrated_{m}']:.1%}"
            for m in headline) + "; the two calibrations' predictions apart by " + ", ".join(
            f"{m.removeprefix('latency_ms_')} "
            f"{summary[f'median_abs_between_calibrations_{m}']:.1%}" for m in headline))
    if args.probe_speed:
        print(f"the machine served {summary['speed_ratio_p5']:.2f}-"
              f"{summary['speed_ratio_p95']:.2f}x as fast as at the start (5th-95th "
              f"percentile over the rows); correlation of a row's p50 error with it: "
              f"{summary['speed_corr_err_latency_ms_p50']:+.2f}")
    print(f"worst configuration (p99): {summary['worst']}")
    return 0


COMMANDS = {
    "simulate": ("simulate one policy and print its summary", _args_simulate, _run_simulate),
    "sweep": ("simulate a grid of policies (--out: a CSV, --plot: a figure)", _args_sweep,
              _run_sweep),
    "recommend": ("the policy and worker count that meet a latency SLO", _args_recommend,
                  _run_recommend),
    "profile": ("measure a zoo model's service time s(b) into a profile JSON",
                _args_profile, _run_profile),
    "validate": ("calibrate the simulator on a real model and measure its error over a grid",
                 _args_validate, _run_validate),
}


def main(argv=None) -> int:
    parser = _Parser(prog="batchsim", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (help_text, add_args, _run) in COMMANDS.items():
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command][2](args)
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"batchsim: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # a write that failed after the checks (a full disk, ...)
        print(f"batchsim: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
