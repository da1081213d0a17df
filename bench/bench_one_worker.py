"""With one worker, what does the CUDA pipeline of threads cost a batch?

A batcher dispatches a batch only to a free worker, and a worker is free again only once
its batch has ended. With one worker, then, one batch is in flight at a time, and the
pipeline (``batchsim.real.runners.PipelineRunner``: a stager, a launcher and a completer
thread, built so that one batch's copies and launch overlap another's) has nothing to
overlap: it adds two hand-overs between threads to every batch. On a virtual machine a
hand-over is a thread wake-up, tens to hundreds of microseconds (on an H200 machine the
pipeline's pick-up alone took a median 0.34-0.40 ms, ``bench_gpu_h200_run3.log``), and
where the OS puts each thread changes it. The fidelity grids and ``calibrate`` serve one
worker; on an H200, half to four fifths of their batches' time was those threads' part.

This bench starts batcher after batcher of one worker on the same arrivals, at the two
configurations of ``bench_thread_pinning.py`` (its ``alternate``), alternating:

* ``pipeline``: the pipeline of threads (the CUDA default before this bench);
* ``thread``: a thread per worker that stages, launches and waits for its batch itself.

Per arm: the median time a batch held its worker, against the median over both arms
(``speed``), how far the batchers spread (sd of log speed), and the median p50 latency.
On a CPU the model is the H200 stand-in of ``bench_batcher_cpu.py`` (``VirtualGpu``:
launches that hold the GIL for part of their host time, and a virtual device that the
worker waits for); with ``--device cuda`` the zoo model itself. The results go to
``bench/results/one_worker_<device>_<model>.json``.

Run: ``python bench/bench_one_worker.py --model encoder --cpu 0,1`` (the stand-in, about a
minute per model); on a GPU machine ``python3 bench/bench_one_worker.py --model encoder
--device cuda --dtype bfloat16 --cpu 2-7``. Needs torch, numpy and pandas only.
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import numpy as np
from bench_fidelity import settle_machine
from bench_thread_pinning import RESULTS, add_alternate_args, alternate

import batchsim as bs

ARMS = ("pipeline", "thread")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="encoder", choices=["mlp", "cnn", "encoder"])
    p.add_argument("--device", default=None,
                   help="cuda: the zoo model at --dtype (default: the H200 stand-in on CPU)")
    p.add_argument("--dtype", default="bfloat16")
    add_alternate_args(p, pin_threads=True)
    args = p.parse_args()
    torch = settle_machine(args)

    from batchsim.real import DynamicBatcher, make_model, run_saturated

    if args.device is None:
        from bench_batcher_cpu import StandInBatcher, VirtualGpu, precise_sleeps

        precise_sleeps()  # before the batchers' threads start: they inherit it
        model, batcher_type = VirtualGpu(args.model, args.dtype), StandInBatcher
    else:
        model = make_model(args.model, device=args.device, dtype=args.dtype, size="default")
        batcher_type = DynamicBatcher
    report = {"model": model.zoo_name, "dtype": args.dtype, "device": args.device or "cpu",
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "torch": torch.__version__, "python": platform.python_version(),
              "cpus": args.cpu, "keep_awake": args.keep_awake, "pin_threads": args.pin_threads,
              "instances": 2 if args.quick else args.instances,
              "duration_s": 0.05 if args.quick else args.duration_s, "configs": {}}
    out = Path(args.out or RESULTS / f"one_worker_{report['device']}_{args.model}.json")

    def make_batcher(arm: str, policy):
        return batcher_type(model, policy, device=args.device, pipeline=arm == "pipeline",
                            thread_cpus=args.thread_cpus)

    def saturated_rps(max_b: int) -> float:
        """The model's capacity with one worker, through the pipeline."""
        sat = run_saturated(make_batcher("pipeline", bs.BatchPolicy(max_b, np.inf)),
                            20 * max_b)
        return sat.summary()["throughput_rps"]

    alternate(ARMS, make_batcher, saturated_rps, report["instances"], report["duration_s"],
              report, out)
    for name, config in report["configs"].items():
        thread, pipeline = config["summary"]["thread"], config["summary"]["pipeline"]
        print(f"{name}: a thread per worker's batches took "
              f"{thread['median_speed'] / pipeline['median_speed']:.3f}x the pipeline's, "
              f"its p50 {thread['median_p50_ms'] / pipeline['median_p50_ms']:.3f}x")


if __name__ == "__main__":
    main()
