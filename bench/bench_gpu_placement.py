"""GPU: does the batcher's saturated throughput depend on the CPUs its threads may use?

On a GPU the batcher's threads do little but Python: the event loop submits and
resolves requests, the workers stack inputs and launch copies and graph replays. They
all need the interpreter lock, and each hand-over of it between threads on different
cores means waking a thread on another core (``bench/bench_thread_placement.py``
measures what that costs on the CPU). This benchmark serves the zoo models at
saturation with ``DynamicBatcher`` (the variants of ``bench/bench_gpu.py``) with the
process's threads allowed on all CPUs, on 1, 2 or 4 of them, and with all CPUs but the
interpreter's switch interval cut from 5 ms to 0.5 ms (how long a thread that wants the
lock waits before it asks the holder to drop it). The main thread's affinity is set
before each batcher starts, so its threads inherit it, and restored after.

Prints, per model and max_batch_size, the offline end-to-end peak (eager, as in
``bench_gpu.py``) and each variant's requests/s as a ratio to that peak and to the run
on all CPUs; writes ``placement_gpu_<device>.json``.

Run on a GPU machine: ``python bench/bench_gpu_placement.py --out-dir DIR``
(``--dry-run``: the CPU and tiny models, seconds).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_gpu import VARIANTS, Settings, header, offline_peak_rps, saturated, write_json  # noqa: E402

import batchsim as bs  # noqa: E402
from batchsim.real import make_model, profile_model  # noqa: E402
from batchsim.real.profiler import device_slug  # noqa: E402

CONFIGS = (("cnn", "bfloat16", 32), ("cnn", "bfloat16", 128), ("mlp", "float32", 32),
           ("mlp", "float32", 128), ("encoder", "bfloat16", 32))
#: (label, how many CPUs (None: all), switch interval in s (None: the default))
PLACEMENTS = (("all CPUs", None, None), ("1 CPU", 1, None), ("2 CPUs", 2, None),
              ("4 CPUs", 4, None), ("all, switch 0.5 ms", None, 0.0005))
RUN_S = 1.0


def placed(cfg, model, policy, n, inputs, variant, cpus, switch_s) -> float:
    """Saturated requests/s of one runner variant, its threads on ``cpus`` CPUs."""
    everywhere = os.sched_getaffinity(0)
    default_switch_s = sys.getswitchinterval()
    _, pipeline, workers, graphs = variant
    try:
        if cpus is not None:
            os.sched_setaffinity(0, sorted(everywhere)[:cpus])
        if switch_s is not None:
            sys.setswitchinterval(switch_s)
        res, _ = saturated(cfg, model, policy, n, inputs, pipeline, workers, graphs)
        return res.summary(warmup_frac=0.2)["throughput_rps"]
    finally:
        os.sched_setaffinity(0, everywhere)
        sys.setswitchinterval(default_switch_s)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny models, seconds")
    args = p.parse_args()
    cfg = Settings(args.dry_run)
    if not cfg.dry_run and not torch.cuda.is_available():
        print("no CUDA GPU available: nothing measured (use --dry-run to test on CPU)")
        return 0
    torch.set_float32_matmul_precision("high")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"placement_gpu_{device_slug(cfg.device)}.json"
    report = {**header(cfg), "cpus": len(os.sched_getaffinity(0)), "results": []}
    configs = [("cnn", "float32", 8), ("mlp", "float32", 8)] if cfg.dry_run else CONFIGS
    print(f"{report['device']}, {report['cpus']} CPUs: saturated requests/s over the offline "
          f"eager peak (and over the run on all CPUs)", flush=True)
    for name, dtype, b in configs:
        model = make_model(name, cfg.device, dtype, cfg.size)
        inputs = model.input_spec.random(64, seed=1)
        s_ms = profile_model(model, [b], repeats=10, overhead=False).times_ms[0]
        policy = bs.BatchPolicy(b, round(s_ms, 3))
        peak = offline_peak_rps(model, model.input_spec, cfg.device, b, cfg.peak_s)
        row = {"model": name, "dtype": dtype, "max_batch_size": b, "offline_peak_rps": peak,
               "rps": {}}
        n = cfg.n_requests(peak * RUN_S / cfg.run_s)  # RUN_S at the peak, within bounds
        for variant in VARIANTS[:2]:
            t0 = time.perf_counter()
            rps = {label: placed(cfg, model, policy, n, inputs, variant, cpus, switch_s)
                   for label, cpus, switch_s in PLACEMENTS}
            row["rps"][variant[0]] = rps
            cells = "  ".join(f"{label} {r / peak:.2f} ({r / rps['all CPUs']:.2f}x)"
                              for label, r in rps.items())
            print(f"  {name}/{dtype} b={b} {variant[0]} (peak {peak:,.0f}/s): {cells} "
                  f"[{time.perf_counter() - t0:.0f} s]", flush=True)
        report["results"].append(row)
        write_json(path, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
