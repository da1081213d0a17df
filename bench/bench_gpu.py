"""GPU benchmark of the real batcher: profiles, reference check, batcher vs offline peak.

Two parts, each its own process in ``bench/gpu_session.sh`` so a crash in one keeps
the other's files; every JSON is written as soon as its numbers exist.

``profiles``: each zoo model (default size) at float32 and bfloat16, end to end
(pinned H2D + model + D2H) -> ``{device}_{model}_{dtype}.json`` profiles, plus the
compute-only ``s(b)`` compared with the H200 reference
(``bench/reference_h200_compute_only.json``, TF32 matmul allowed, as here).

``bench``: for each model, dtype and max_batch_size in {8, 32, 128}: the offline
end-to-end peak (pre-stacked pinned batches, copies and compute pipelined on two
streams), the saturated throughput of DynamicBatcher (2 and 4 workers) and of the naive
polled batcher, and p50/p99 latency at 30% and 70% of the offline peak (Poisson
arrivals, max_wait_ms = one batch's end-to-end time) for both.
Results: ``bench_gpu_{device}.json``, rewritten after every configuration.

Needs only torch, numpy and pandas (run from the repository root with
``PYTHONPATH=.``). ``--dry-run`` runs the same code on the CPU with tiny models in
seconds. Usage: ``python bench/bench_gpu.py [profiles|bench|all] --out-dir DIR``.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

import torch

import batchsim as bs
from batchsim.real import DynamicBatcher, InferenceBatcher, make_model, profile_model
from batchsim.real.loadgen import run_load, run_saturated
from batchsim.real.profiler import device_name, device_slug, profile_filename

REFERENCE = Path(__file__).with_name("reference_h200_compute_only.json")
MODELS = ("encoder", "cnn", "mlp")
#: Bench order: the fidelity targets first (encoder and CNN in bfloat16, the MLP).
BENCH_CONFIGS = (("encoder", "bfloat16"), ("cnn", "bfloat16"), ("mlp", "float32"),
                 ("encoder", "float32"), ("cnn", "float32"), ("mlp", "bfloat16"))
LOADS = (0.3, 0.7)


class Settings:
    def __init__(self, dry_run: bool):
        self.dry_run = dry_run
        self.device = torch.device("cpu" if dry_run else "cuda")
        self.size = "tiny" if dry_run else "default"
        self.profile_sizes = (1, 8, 32) if dry_run else (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
        self.repeats = 3 if dry_run else 20
        self.max_batch_sizes = (8,) if dry_run else (8, 32, 128)
        self.sat_s = 0.1 if dry_run else 0.6       # length of a saturated run
        self.load_s = 0.15 if dry_run else 0.8     # length of a run at 30% / 70% load
        self.workers = (2, 4)


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def write_json(path: Path, data) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)
    print(f"  wrote {path}", flush=True)


def header(cfg: Settings) -> dict:
    return {"device": device_name(cfg.device), "torch": torch.__version__, "date": now_iso(),
            "dry_run": cfg.dry_run, "model_size": cfg.size,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


# -- part 1: profiles and the reference check --------------------------------------------

def part_profiles(cfg: Settings, out: Path) -> None:
    reference = json.loads(REFERENCE.read_text())["s_ms"]
    slug = device_slug(cfg.device)
    compute = {**header(cfg), "what": "compute-only s(b) in ms, median", "s_ms": {},
               "errors": []}
    for name in MODELS:
        for dtype in ("float32", "bfloat16"):
            t0 = time.perf_counter()
            try:
                model = make_model(name, cfg.device, dtype, cfg.size)
                e2e = profile_model(model, cfg.profile_sizes, repeats=cfg.repeats)
                e2e.save(out / profile_filename(cfg.device, model.zoo_name, dtype))
                only = profile_model(model, cfg.profile_sizes, repeats=cfg.repeats,
                                     end_to_end=False, overhead=False)
                compute["s_ms"][f"{name}/{dtype}"] = dict(
                    zip(map(str, only.batch_sizes), only.times_ms, strict=True))
                write_json(out / f"{slug}_compute_only.json", compute)
                compare(f"{name}/{dtype}", only, e2e, reference.get(f"{name}/{dtype}", {}))
            except Exception as e:
                traceback.print_exc()
                compute["errors"].append(f"{name}/{dtype}: {e!r}")
                write_json(out / f"{slug}_compute_only.json", compute)
            print(f"  {name}/{dtype} profiled in {time.perf_counter() - t0:.1f} s", flush=True)


def compare(key: str, only, e2e, ref: dict) -> None:
    """Print measured compute-only and end-to-end s(b) next to the H200 reference."""
    print(f"\n{key}: s(b) ms   compute-only vs H200 reference (ratio), end to end, "
          f"batcher overhead {e2e.metadata.get('batcher_overhead_ms')}")
    for b, t_ms, e_ms in zip(only.batch_sizes, only.times_ms, e2e.times_ms, strict=True):
        r = ref.get(str(b))
        vs = f"{r:9.4f}  ({t_ms / r:5.2f}x)" if r else "        -"
        print(f"  b={b:<4} {t_ms:9.4f}  ref {vs}   e2e {e_ms:9.4f}")


# -- part 2: batcher against the offline peak and the naive batcher -------------------------

def offline_peak_rps(model, spec, dev, b: int, seconds: float) -> float:
    """Pre-stacked pinned batches: H2D, model, D2H pipelined over two CUDA streams."""
    cuda = dev.type == "cuda"
    lanes = 2 if cuda else 1
    host_in = spec.random(b, pin_memory=cuda)
    dev_in = [host_in.to(dev) for _ in range(lanes)]
    streams = [torch.cuda.Stream(dev) if cuda else None for _ in range(lanes)]
    host_out = [None] * lanes

    def run(n):
        for i in range(n):
            j = i % lanes
            with torch.cuda.stream(streams[j]):
                if cuda:
                    dev_in[j].copy_(host_in, non_blocking=True)
                y = model(dev_in[j])
                if cuda:
                    if host_out[j] is None:
                        host_out[j] = torch.empty(y.shape, dtype=y.dtype, pin_memory=True)
                    host_out[j].copy_(y, non_blocking=True)
        if cuda:
            torch.cuda.synchronize(dev)

    with torch.no_grad():
        run(4)
        t0 = time.perf_counter()
        run(4)
        n = max(10, int(seconds / ((time.perf_counter() - t0) / 4)))
        t0 = time.perf_counter()
        run(n)
        return n * b / (time.perf_counter() - t0)


def naive_model(model, dev):
    """What a tutorial serves: unpinned blocking copies around the model."""
    if dev.type == "cpu":
        return model
    return lambda x: model(x.to(dev)).cpu()


def served(res, **extra) -> dict:
    s = res.summary(warmup_frac=0.1)
    out = {k: s[k] for k in ("throughput_rps", "latency_ms_p50", "latency_ms_p99",
                             "mean_batch_size", "n_completed", "n_failed")}
    if "lateness_ms_p99" in res.meta:
        out["harness_lateness_ms_p99"] = res.meta["lateness_ms_p99"]
    return {**out, **extra}


def bench_one(cfg: Settings, model, b: int) -> dict:
    dev, spec = cfg.device, model.input_spec
    inputs = spec.random(64, seed=1)
    s_ms = profile_model(model, [b], repeats=5, overhead=False).times_ms[0]
    policy = bs.BatchPolicy(b, round(s_ms, 3))
    peak = offline_peak_rps(model, spec, dev, b, cfg.sat_s)
    row = {"max_batch_size": b, "s_e2e_ms": s_ms, "max_wait_ms": policy.max_wait_ms,
           "offline_peak_rps": peak, "dynamic": {}, "loads": {}}
    print(f"  b={b}: s_e2e {s_ms:.3f} ms, offline peak {peak:,.0f} req/s", flush=True)
    n_sat = int(min(max(20 * b, peak * cfg.sat_s), 300_000))
    for workers in cfg.workers:
        res = run_saturated(DynamicBatcher(model, policy, workers=workers, device=dev), n_sat,
                            inputs=inputs)
        row["dynamic"][str(workers)] = served(res, ratio_to_offline_peak=(
            res.summary(warmup_frac=0.1)["throughput_rps"] / peak))
        print(f"    DynamicBatcher x{workers}: "
              f"{row['dynamic'][str(workers)]['throughput_rps']:,.0f} req/s "
              f"= {row['dynamic'][str(workers)]['ratio_to_offline_peak']:.2f} of peak",
              flush=True)
    best = max(row["dynamic"], key=lambda w: row["dynamic"][w]["throughput_rps"])
    row["best_workers"] = int(best)
    naive_fn = naive_model(model, dev)
    naive_n = int(min(n_sat, max(10 * b, b / (s_ms + 1.0) * 1000.0 * cfg.sat_s)))
    res = run_saturated(InferenceBatcher(naive_fn, b, policy.max_wait_ms), naive_n,
                        inputs=inputs)
    row["naive"] = served(res, ratio_to_offline_peak=res.summary(warmup_frac=0.1)[
        "throughput_rps"] / peak)
    naive_rps = row["naive"]["throughput_rps"]
    print(f"    naive polled: {naive_rps:,.0f} req/s = "
          f"{row['naive']['ratio_to_offline_peak']:.2f} of peak", flush=True)
    for load in LOADS:
        rate = load * peak
        n = int(min(max(200, rate * cfg.load_s), 60_000))
        work = bs.Poisson(rate)
        dyn = run_load(DynamicBatcher(model, policy, workers=int(best), device=dev), work,
                       n_requests=n, seed=1, inputs=inputs)
        n_naive = int(min(n, max(200, 1.5 * naive_rps * cfg.load_s)))
        nai = run_load(InferenceBatcher(naive_fn, b, policy.max_wait_ms), work,
                       n_requests=n_naive, seed=1, inputs=inputs)
        row["loads"][str(load)] = {
            "rate_rps": rate, "dynamic": served(dyn),
            "naive": served(nai, overloaded=bool(rate > naive_rps))}
        d, v = row["loads"][str(load)]["dynamic"], row["loads"][str(load)]["naive"]
        print(f"    {load:.0%} load ({rate:,.0f} req/s): dynamic p50/p99 "
              f"{d['latency_ms_p50']:.2f}/{d['latency_ms_p99']:.2f} ms (harness late "
              f"{d['harness_lateness_ms_p99']:.2f} ms p99), naive "
              f"{v['latency_ms_p50']:.2f}/{v['latency_ms_p99']:.2f} ms", flush=True)
    return row


def part_bench(cfg: Settings, out: Path, budget_s: float) -> None:
    t_start = time.perf_counter()
    path = out / f"bench_gpu_{device_slug(cfg.device)}.json"
    report = {**header(cfg), "results": [], "skipped": [], "errors": [],
              "note": "ratio_to_offline_peak: saturated req/s over the offline pipelined "
                      "end-to-end peak (pre-stacked pinned batches, two streams)"}
    per_config_s = None
    for name, dtype in BENCH_CONFIGS:
        for b in cfg.max_batch_sizes:
            elapsed = time.perf_counter() - t_start
            if per_config_s is not None and elapsed + 1.3 * per_config_s > budget_s:
                report["skipped"].append(f"{name}/{dtype}/b={b}: time budget")
                print(f"skip {name}/{dtype} b={b}: {elapsed:.0f} s of {budget_s:.0f} used",
                      flush=True)
                continue
            t0 = time.perf_counter()
            print(f"{name}/{dtype} b={b} ({elapsed:.0f} s elapsed)", flush=True)
            try:
                model = make_model(name, cfg.device, dtype, cfg.size)
                row = bench_one(cfg, model, b)
                report["results"].append({"model": name, "dtype": dtype, **row})
            except Exception as e:
                traceback.print_exc()
                report["errors"].append(f"{name}/{dtype}/b={b}: {e!r}")
            took = time.perf_counter() - t0
            per_config_s = took if per_config_s is None else max(per_config_s, took)
            report["elapsed_s"] = time.perf_counter() - t_start
            write_json(path, report)
    write_json(path, report)  # with the skipped ones
    print_table(report)


def print_table(report: dict) -> None:
    print(f"\n{report['device']}: saturated throughput / offline end-to-end peak")
    print(f"  {'model':<8} {'dtype':<9} {'b':>4} {'peak req/s':>12} {'dyn best':>9} "
          f"{'naive':>7}   p99 ms at 30% / 70% (dynamic | naive)")
    for r in report["results"]:
        loads = r["loads"]
        p99 = " / ".join(f"{loads[k]['dynamic']['latency_ms_p99']:.2f} | "
                         f"{loads[k]['naive']['latency_ms_p99']:.2f}" for k in loads)
        best = r["dynamic"][str(r["best_workers"])]["ratio_to_offline_peak"]
        print(f"  {r['model']:<8} {r['dtype']:<9} {r['max_batch_size']:>4} "
              f"{r['offline_peak_rps']:>12,.0f} {best:>9.2f} "
              f"{r['naive']['ratio_to_offline_peak']:>7.2f}   {p99}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", nargs="?", choices=["profiles", "bench", "all"], default="all")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--budget-s", type=float, default=170.0,
                   help="bench: stop starting new configurations after this long")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny models, seconds")
    args = p.parse_args(argv)
    cfg = Settings(args.dry_run)
    if not cfg.dry_run and not torch.cuda.is_available():
        print("no CUDA GPU available: nothing measured (use --dry-run to test on CPU)")
        return 0
    torch.set_float32_matmul_precision("high")  # TF32 matmul, as in the reference
    if cfg.dry_run:
        torch.set_num_threads(1)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{args.part} on {device_name(cfg.device)}, torch {torch.__version__}", flush=True)
    if args.part in ("profiles", "all"):
        part_profiles(cfg, out)
    if args.part in ("bench", "all"):
        part_bench(cfg, out, args.budget_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
