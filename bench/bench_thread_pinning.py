"""Does each batcher run at a speed of its own because of where its threads land?

On an H200, rows of a fidelity grid ran at speeds of their own: a row's first half of
batches predicted its second (correlation +0.6 to +0.95), the next row's not (about 0).
Taken apart (``bench_batch_residuals.py``'s ``phase_spread``), the encoder's part of a
batch between its dispatch and its launch -- the pipeline's threads picking it up,
staging and launching it -- moved 1.2-3x as far from row to row as the part from its
launch to its end, and in its slowest rows only the first part grew (the CNN's two
parts moved alike). Every row starts a new batcher, whose threads the OS places anew
among the process's CPUs. This bench
tests that: at each configuration it starts batcher after batcher on the same arrivals,
alternating where the threads go:

* ``os``: where the OS puts them, among the process's CPUs (``--cpu``, default all);
* ``pinned``: the event loop's thread on the first of those CPUs and the batcher's
  threads one each on the next (``DynamicBatcher(thread_cpus=...)``).

Per batcher it measures how long its batches held their worker against the median
batch of the same size over every batcher of the configuration (``speed``), the
median time from dispatch to launch (``cpu_us``) and from launch to the end
(``device_us``), and the run's p50 latency. Per arm: the median of each, and how far
the batchers spread, the standard deviation of ``log(speed)``. If the threads' places
set a batcher's speed, the pinned batchers spread less. (On the CPU a thread per worker
runs each batch to its end before it reports it launched: all of it counts as dispatch
to launch.) The results go to
``bench/results/thread_pinning_<device>_<model>.json``.

Run on a GPU machine: ``python3 bench/bench_thread_pinning.py --model encoder --device cuda
--dtype bfloat16 --size default --cpu 2-7 --out ...`` (about a minute per model);
``--quick`` for a CPU check in seconds. Needs torch, numpy and pandas only.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np
from bench_batch_residuals import sd_log
from bench_fidelity import add_machine_args, settle_machine, write_report

import batchsim as bs
from batchsim.calibrate import WARM_BATCHES

RESULTS = Path(__file__).resolve().parent / "results"
#: (max_batch_size, max_wait_ms, load as a fraction of the saturated throughput): the
#: H200 rows that ran slowest (small batches after a millisecond idle), and busy ones.
CONFIGS = ((8, 1.0, 0.2), (32, 0.0, 0.5))
ARMS = ("os", "pinned")


def batch_table(run, arm: str, instance: int):
    """One row per batch of ``run`` but the first ``WARM_BATCHES`` (they warm the worker
    up): size, time on its worker and its two parts (dispatch to launch, launch to end),
    µs."""
    import pandas as pd

    launched = run.meta["batch_phases_s"][:, 2]
    keep = slice(WARM_BATCHES, None)
    return pd.DataFrame({"arm": arm, "instance": instance, "size": run.size[keep],
                         "worker_us": 1e6 * (run.end_s - run.start_s)[keep],
                         "cpu_us": 1e6 * (launched - run.start_s)[keep],
                         "device_us": 1e6 * (run.end_s - launched)[keep]})


def instance_speeds(table):
    """Per batcher (arm, instance): its batches' median time over the median of their
    size across every batcher (``speed``) and its median ``cpu_us`` and ``device_us``."""
    table = table.assign(ratio=table["worker_us"]
                         / table.groupby("size")["worker_us"].transform("median"))
    return table.groupby(["arm", "instance"]).agg(
        speed=("ratio", "median"), cpu_us=("cpu_us", "median"),
        device_us=("device_us", "median"), batches=("ratio", "size")).reset_index()


def arm_summary(per_instance) -> dict:
    """Per arm: how many batchers, the median of each measure and the spread of
    ``log(speed)`` (and of ``log(cpu_us)``, ``log(device_us)``) across them."""
    out = {}
    for arm, part in per_instance.groupby("arm"):
        out[arm] = {"batchers": len(part),
                    **{f"median_{m}": float(part[m].median())
                       for m in ("speed", "cpu_us", "device_us", "p50_ms")},
                    **{f"sd_log_{m}": sd_log(part[m])
                       for m in ("speed", "cpu_us", "device_us", "p50_ms")}}
    return out


def add_alternate_args(p, pin_threads: bool) -> None:
    """The options of a bench built on ``alternate``: how many batchers, how long each
    runs, ``--quick``, the machine (``bench_fidelity.add_machine_args``, with
    ``--pin-threads`` if ``pin_threads``) and ``--out``."""
    p.add_argument("--instances", type=int, default=8, help="batchers per arm and configuration")
    p.add_argument("--duration-s", type=float, default=0.5, help="seconds of traffic a run")
    p.add_argument("--quick", action="store_true", help="2 batchers per arm, 0.05 s runs")
    add_machine_args(p, awake_by_default=True, pin_threads=pin_threads)
    p.add_argument("--out", default=None, help="results JSON (default bench/results/...)")


def alternate(arms, make_batcher, saturated_rps, instances: int, duration_s: float,
              report: dict, out: Path) -> None:
    """At each of ``CONFIGS``, batcher after batcher on the same arrivals, the ``arms``
    in turn (``make_batcher(arm, policy)`` makes each, ``instances`` per arm), at the
    configuration's load of ``saturated_rps(max_batch_size)``; per configuration, the
    batchers' measures (``instance_speeds``, ``p50_ms``) and their ``arm_summary`` go
    into ``report["configs"]``, printed and written to ``out`` as they come."""
    import pandas as pd

    from batchsim.real import run_load

    t0 = time.perf_counter()
    for max_b, max_wait_ms, load in CONFIGS:
        policy = bs.BatchPolicy(max_b, max_wait_ms)
        rate_rps = load * saturated_rps(max_b)
        n = max(200, round(rate_rps * duration_s))
        tables, p50 = [], {}
        for k in range(len(arms) * instances):
            arm, instance = arms[k % len(arms)], k // len(arms)
            run = run_load(make_batcher(arm, policy), bs.Poisson(rate_rps), n_requests=n,
                           seed=instance)
            tables.append(batch_table(run, arm, instance))
            p50[(arm, instance)] = run.summary()["latency_ms_p50"]
        per_instance = instance_speeds(pd.concat(tables, ignore_index=True))
        per_instance["p50_ms"] = [p50[(a, i)] for a, i in
                                  zip(per_instance["arm"], per_instance["instance"], strict=True)]
        name = f"b{max_b}_w{max_wait_ms:g}_load{load:g}"
        report["configs"][name] = {"rate_rps": rate_rps, "n_requests": n,
                                   "summary": arm_summary(per_instance),
                                   "instances": per_instance.to_dict("records")}
        s = report["configs"][name]["summary"]
        took_s = time.perf_counter() - t0
        print(f"{name} ({rate_rps:,.0f} requests/s, {took_s:.0f} s): " + "; ".join(
            f"{arm}: {v['batchers']} batchers, speed {v['median_speed']:.3f} (sd(log) "
            f"{v['sd_log_speed']:.3f}), dispatch to launch {v['median_cpu_us']:.0f} us "
            f"(sd(log) {v['sd_log_cpu_us']:.3f}), launch to end {v['median_device_us']:.0f} "
            f"us ({v['sd_log_device_us']:.3f}), p50 {v['median_p50_ms']:.3f} ms "
            f"({v['sd_log_p50_ms']:.3f})" for arm, v in s.items()), flush=True)
        write_report(report, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="encoder", choices=["mlp", "cnn", "encoder"])
    p.add_argument("--size", default="tiny", choices=["tiny", "default"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default=None)
    add_alternate_args(p, pin_threads=False)  # it pins every other batcher itself
    args = p.parse_args()
    torch = settle_machine(args)

    from batchsim.real import DynamicBatcher, make_model, run_saturated

    instances = 2 if args.quick else args.instances
    duration_s = 0.05 if args.quick else args.duration_s
    cpus = sorted(os.sched_getaffinity(0))
    loop_cpu, thread_cpus = cpus[0], cpus[1:] or cpus
    model = make_model(args.model, device=args.device, dtype=args.dtype, size=args.size)
    report = {"model": model.zoo_name, "device": args.device or "cpu",
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "torch": torch.__version__, "python": platform.python_version(),
              "cpus": cpus, "loop_cpu": loop_cpu, "thread_cpus": thread_cpus,
              "keep_awake": args.keep_awake, "instances": instances,
              "duration_s": duration_s, "configs": {}}
    out = Path(args.out or RESULTS / f"thread_pinning_{report['device']}_{args.model}.json")

    def make_batcher(arm: str, policy):
        pinned = arm == "pinned"
        os.sched_setaffinity(0, {loop_cpu} if pinned else set(cpus))  # the loop's
        return DynamicBatcher(model, policy, device=args.device,
                              thread_cpus=thread_cpus if pinned else None)

    def saturated_rps(max_b: int) -> float:
        sat = run_saturated(DynamicBatcher(model, bs.BatchPolicy(max_b, np.inf),
                                           device=args.device), 20 * max_b)
        return sat.summary()["throughput_rps"]

    alternate(ARMS, make_batcher, saturated_rps, instances, duration_s, report, out)
    os.sched_setaffinity(0, set(cpus))


if __name__ == "__main__":
    main()
