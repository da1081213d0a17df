"""GPU benchmark of the real batcher: DynamicBatcher against the offline peak and the naive one.

``bench`` (what ``bench/gpu_session.sh`` runs): for each zoo model (encoder and CNN in
bfloat16, the MLP in float32) and max_batch_size in {32, 128, 8} (in that order, so
that the targets come first if time runs out):

* the offline end-to-end peak ``b / s(b)``: pre-stacked pinned batches, host-to-device
  copy, model, device-to-host copy into pinned memory, pipelined over two CUDA streams;
  eagerly (the issue's definition and the primary ratio) and with the model replayed
  from a CUDA graph (a second, stricter ratio: graphs against graphs);
* saturated DynamicBatcher throughput over those peaks (the ratio of issue 5), for the
  stage/launch/complete pipeline of threads with 2 workers and a thread per worker
  with 4 workers, both with CUDA graphs, and the best run-2 variant (a thread per worker
  with 4 workers) eagerly; where each batch's time went (dispatch to pick-up, staging
  copy, launch, device and completion, release) and how long graph capture took;
* the naive polled batcher's saturated throughput over the same peak;
* p50/p99 latency at 30% and 70% of the peak (Poisson arrivals, max_wait_ms = one
  batch's end-to-end time) for the best DynamicBatcher and the naive one.

Every run is honest about start-up: each DynamicBatcher first runs one untimed batch
of ``max_batch_size`` through every worker, the first ``WARMUP_FRAC`` of the requests
is left out of every summary, and each point runs for at least 1.5 s at its rate or
150,000 requests. Results: ``bench_gpu_{device}.json``, rewritten after every configuration,
and a table at the end.

``profiles`` (optional): each zoo model at float32 and bfloat16, end to end -> profile
JSONs, and the compute-only ``s(b)`` next to the H200 reference.

Needs only torch and numpy (run from the repository root with ``PYTHONPATH=.``).
``--dry-run`` runs the same code on the CPU with tiny models in seconds.
Usage: ``python bench/bench_gpu.py [bench|profiles|all] --out-dir DIR [--budget-s S]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

import batchsim as bs
from batchsim._gc import collector_paused
from batchsim.real import DynamicBatcher, InferenceBatcher, make_model, profile_model
from batchsim.real.loadgen import run_load, run_saturated
from batchsim.real.profiler import device_name, device_slug, profile_filename

REFERENCE = Path(__file__).with_name("reference_h200_compute_only.json")
MODELS = ("encoder", "cnn", "mlp")
BENCH_MODELS = (("encoder", "bfloat16"), ("cnn", "bfloat16"), ("mlp", "float32"))
#: (label, pipeline, workers, CUDA graphs)
VARIANTS = (("pipe x2 graphs", True, 2, True), ("threads x4 graphs", False, 4, True),
            ("threads x4", False, 4, False))
LOADS = (0.3, 0.7)
WARMUP_FRAC = 0.2
#: Issue 5's targets for the best saturated ratio at max_batch_size >= 32.
TARGETS = {"encoder": 0.9, "cnn": 0.9, "mlp": 0.7}


class Settings:
    def __init__(self, dry_run: bool):
        self.dry_run = dry_run
        self.device = torch.device("cpu" if dry_run else "cuda")
        self.size = "tiny" if dry_run else "default"
        self.profile_sizes = (1, 8, 32) if dry_run else (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
        self.repeats = 3 if dry_run else 20
        self.max_batch_sizes = (8,) if dry_run else (32, 128, 8)
        self.peak_s = 0.1 if dry_run else 1.0        # offline peak measurement
        self.run_s = 0.15 if dry_run else 1.5        # a point's length at its rate
        self.min_requests = 300 if dry_run else 2_000
        self.max_requests = 3_000 if dry_run else 150_000  # >= 20,000: long enough too

    def n_requests(self, rate_rps: float) -> int:
        """``run_s`` worth of requests at ``rate_rps``, within the bounds above."""
        return int(np.clip(rate_rps * self.run_s, self.min_requests, self.max_requests))


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def write_json(path: Path, data) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)
    print(f"  wrote {path}", flush=True)


def header(cfg: Settings) -> dict:
    return {"device": device_name(cfg.device), "torch": torch.__version__, "date": now_iso(),
            "python": sys.version.split()[0], "dry_run": cfg.dry_run, "model_size": cfg.size,
            "cpu_threads": torch.get_num_threads(), "warmup_frac": WARMUP_FRAC,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


# -- profiles and the reference check (optional) ---------------------------------------

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
    meta = e2e.metadata
    print(f"\n{key}: s(b) ms   compute-only vs H200 reference (ratio), end to end; one-worker "
          f"batcher overhead {meta.get('batcher_overhead_ms')}, staging copy "
          f"{meta.get('staging_ms')}")
    for b, t_ms, e_ms in zip(only.batch_sizes, only.times_ms, e2e.times_ms, strict=True):
        r = ref.get(str(b))
        vs = f"{r:9.4f}  ({t_ms / r:5.2f}x)" if r else "        -"
        print(f"  b={b:<4} {t_ms:9.4f}  ref {vs}   e2e {e_ms:9.4f}")


# -- DynamicBatcher against the offline peak and the naive batcher ------------------------

def offline_peak_rps(model, spec, dev, b: int, seconds: float, graphs: bool = False):
    """Pre-stacked pinned batches: H2D, model, D2H pipelined over two CUDA streams.

    ``graphs``: the model replayed from a CUDA graph per stream (None if that fails or
    there is no GPU).
    """
    cuda = dev.type == "cuda"
    if graphs and not cuda:
        return None
    lanes = 2 if cuda else 1
    host_in = spec.random(b, pin_memory=cuda)
    dev_in = [host_in.to(dev) for _ in range(lanes)]
    streams = [torch.cuda.Stream(dev) if cuda else None for _ in range(lanes)]
    host_out = [None] * lanes
    forward = [model] * lanes
    if graphs:
        try:
            forward = [captured(model, x, s) for x, s in zip(dev_in, streams, strict=True)]
        except Exception as e:
            print(f"    offline graph capture failed: {e!r}", flush=True)
            return None

    def run(n):
        for i in range(n):
            j = i % lanes
            with torch.cuda.stream(streams[j]):
                if cuda:
                    dev_in[j].copy_(host_in, non_blocking=True)
                y = forward[j](dev_in[j])
                if cuda:
                    if host_out[j] is None:
                        host_out[j] = torch.empty(y.shape, dtype=y.dtype, pin_memory=True)
                    host_out[j].copy_(y, non_blocking=True)
        if cuda:
            torch.cuda.synchronize(dev)

    with torch.no_grad(), collector_paused():  # as run_saturated has it for the batchers
        run(10)
        t0 = time.perf_counter()
        run(10)
        n = max(20, int(seconds / 3 / ((time.perf_counter() - t0) / 10)))
        rates = []
        for _ in range(3):  # the median of three: one slow moment does not set the peak
            t0 = time.perf_counter()
            run(n)
            rates.append(n * b / (time.perf_counter() - t0))
        return float(np.median(rates))


def captured(model, x, stream):
    """``model`` as a CUDA graph on the static input ``x``: a call replays it."""
    with torch.no_grad(), torch.cuda.stream(stream):
        for _ in range(2):
            model(x)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph, stream=stream):
        y = model(x)

    def replay(_x):
        graph.replay()
        return y
    return replay


def naive_model(model, dev):
    """What a tutorial serves: unpinned blocking copies around the model."""
    if dev.type == "cpu":
        return model
    return lambda x: model(x.to(dev)).cpu()


def served(res, **extra) -> dict:
    s = res.summary(warmup_frac=WARMUP_FRAC)
    out = {k: s[k] for k in ("throughput_rps", "latency_ms_p50", "latency_ms_p99",
                             "mean_batch_size", "n_completed", "n_failed")}
    if "lateness_ms_p99" in res.meta:
        out["harness_lateness_ms_p99"] = res.meta["lateness_ms_p99"]
    return {**out, **extra}


def phases_ms(res) -> dict:
    """Medians over the kept batches of where a batch's time went, in ms.

    ``pickup``: dispatch to a worker thread taking it; ``stage``: the staging copy
    (pipeline only); ``launch``: staged (or picked up) to launched, waiting for the
    launcher included; ``finish``: launched to done (device work, copy back, the
    completer's wait); ``release``: done to the same worker's next dispatch.
    """
    ph = res.meta.get("batch_phases_s")
    if ph is None or res.n_batches < 3:
        return {}
    keep = res.start_s >= res.arrival_s[int(WARMUP_FRAC * res.n_requests)]
    picked, staged, launched = ph.T
    ready = np.where(np.isnan(staged), picked, staged)
    nxt = np.full(res.n_batches, np.nan)
    last = {}
    for k in range(res.n_batches - 1, -1, -1):
        nxt[k] = last.get(res.worker[k], np.nan)
        last[res.worker[k]] = res.start_s[k]
    parts = {"pickup": picked - res.start_s, "stage": staged - picked,
             "launch": launched - ready, "finish": res.end_s - launched,
             "release": nxt - res.end_s}
    return {k: float(1e3 * np.nanmedian(v[keep])) if np.isfinite(v[keep]).any() else None
            for k, v in parts.items()}


def saturated(cfg, model, policy, n, inputs, pipeline, workers, graphs):
    """Saturated DynamicBatcher run; the result and the CPU cores the process used."""
    batcher = DynamicBatcher(model, policy, workers=workers, device=cfg.device,
                             pipeline=pipeline, cuda_graphs=graphs)
    cpu0, t0 = time.process_time(), time.perf_counter()
    res = run_saturated(batcher, n, inputs=inputs)
    return res, (time.process_time() - cpu0) / (time.perf_counter() - t0)


def graphs_note(res) -> str:
    """How the CUDA graph capture went, for the log."""
    g = res.meta.get("cuda_graphs")
    if g is None:
        return "eager"
    took = f", captured in {g['capture_s']:.2f} s" if "capture_s" in g else ""
    errors = f", errors {g['errors'][:1]}" if g["errors"] else ""
    return f"graphs on {g['workers_with_graphs']} workers{took}{errors}"


def bench_one(cfg: Settings, model, b: int) -> dict:
    dev, spec = cfg.device, model.input_spec
    inputs = spec.random(64, seed=1)  # the request pool: rows are sent in turn
    s_ms = profile_model(model, [b], repeats=10, overhead=False).times_ms[0]
    policy = bs.BatchPolicy(b, round(s_ms, 3))
    peak = offline_peak_rps(model, spec, dev, b, cfg.peak_s)
    graph_peak = offline_peak_rps(model, spec, dev, b, cfg.peak_s, graphs=True)
    row = {"max_batch_size": b, "s_e2e_ms": s_ms, "max_wait_ms": policy.max_wait_ms,
           "offline_peak_rps": peak, "offline_graph_peak_rps": graph_peak,
           "dynamic": {}, "loads": {}}
    gp = f"{graph_peak:,.0f}" if graph_peak else "n/a"
    print(f"  b={b}: s_e2e {s_ms:.3f} ms, offline peak {peak:,.0f} req/s eager (the ratio's "
          f"peak), {gp} req/s with a CUDA graph", flush=True)
    n_sat = cfg.n_requests(max(peak, graph_peak or 0.0))
    for label, pipeline, workers, graphs in VARIANTS:
        res, cores = saturated(cfg, model, policy, n_sat, inputs, pipeline, workers, graphs)
        rps = res.summary(warmup_frac=WARMUP_FRAC)["throughput_rps"]
        row["dynamic"][label] = served(
            res, ratio_to_offline_peak=rps / peak, phases_ms=phases_ms(res), cpu_cores=cores,
            ratio_to_offline_graph_peak=rps / graph_peak if graph_peak else None,
            cuda_graphs=res.meta.get("cuda_graphs"))
        ph = " ".join(f"{k} {v:.3f}" for k, v in row["dynamic"][label]["phases_ms"].items()
                      if v is not None)
        vs_graph = f" ({rps / graph_peak:.2f} of graph peak)" if graph_peak else ""
        print(f"    DynamicBatcher {label:<17}: {rps:>10,.0f} req/s = {rps / peak:.2f} of peak"
              f"{vs_graph}; {cores:.1f} cores; median ms: {ph}; {graphs_note(res)}",
              flush=True)
    best = max(row["dynamic"], key=lambda k: row["dynamic"][k]["throughput_rps"])
    row["best"] = best
    label, pipeline, workers, graphs = next(v for v in VARIANTS if v[0] == best)
    naive_fn = naive_model(model, dev)
    naive_guess_rps = b / (s_ms + 1.0) * 1000.0  # one batch per model call plus a 1 ms poll
    res = run_saturated(InferenceBatcher(naive_fn, b, policy.max_wait_ms),
                        cfg.n_requests(naive_guess_rps), inputs=inputs)
    naive_rps = res.summary(warmup_frac=WARMUP_FRAC)["throughput_rps"]
    row["naive"] = served(res, ratio_to_offline_peak=naive_rps / peak)
    print(f"    naive polled                     : {naive_rps:>10,.0f} req/s = "
          f"{naive_rps / peak:.2f} of peak", flush=True)
    for load in LOADS:
        rate = load * peak
        work = bs.Poisson(rate)
        n = cfg.n_requests(rate)
        dyn = run_load(DynamicBatcher(model, policy, workers=workers, device=dev,
                                      pipeline=pipeline, cuda_graphs=graphs),
                       work, n_requests=n, seed=1, inputs=inputs)
        n_naive = min(n, cfg.n_requests(naive_rps))
        nai = run_load(InferenceBatcher(naive_fn, b, policy.max_wait_ms), work,
                       n_requests=n_naive, seed=1, inputs=inputs)
        row["loads"][str(load)] = {
            "rate_rps": rate, "dynamic": served(dyn, variant=best),
            "naive": served(nai, overloaded=bool(rate > naive_rps))}
        d, v = row["loads"][str(load)]["dynamic"], row["loads"][str(load)]["naive"]
        print(f"    {load:.0%} load ({rate:,.0f} req/s): {best} p50/p99 "
              f"{d['latency_ms_p50']:.2f}/{d['latency_ms_p99']:.2f} ms, mean batch "
              f"{d['mean_batch_size']:.1f} (harness late {d['harness_lateness_ms_p99']:.2f} ms "
              f"p99); naive {v['latency_ms_p50']:.2f}/{v['latency_ms_p99']:.2f} ms"
              f"{' (overloaded)' if v['overloaded'] else ''}", flush=True)
    return row


def part_bench(cfg: Settings, out: Path, budget_s: float, only=None) -> None:
    """``only``: the configurations to run, as ``model/max_batch_size`` (None: all)."""
    t_start = time.perf_counter()
    path = out / f"bench_gpu_{device_slug(cfg.device)}.json"
    report = {**header(cfg), "results": [], "skipped": [], "errors": [],
              "note": "ratio_to_offline_peak (the issue's ratio): saturated req/s over the "
                      "offline pipelined end-to-end peak (pre-stacked pinned batches, two "
                      "streams, eager model); ratio_to_offline_graph_peak: over the same "
                      "peak with the model replayed from a CUDA graph"}
    per_config_s = None
    for b in cfg.max_batch_sizes:
        for name, dtype in BENCH_MODELS:
            if only is not None and f"{name}/{b}" not in only:
                continue
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
    print(f"\n{report['device']} (torch {report['torch']}): saturated throughput / offline "
          f"end-to-end peak (eager; the graph peak's ratio is in the JSON); p50/p99 ms of "
          f"the best DynamicBatcher | naive")
    labels = [v[0] for v in VARIANTS]
    print(f"  {'model':<8} {'dtype':<9} {'b':>4} {'peak req/s':>11} "
          + " ".join(f"{lab:>17}" for lab in labels)
          + f" {'naive':>6} {'target':>7} {'graph peak':>11} {'best/it':>7}"
          + f"   at 30%{'':>16} at 70%")
    for r in sorted(report["results"], key=lambda r: (r["model"], r["max_batch_size"])):
        ratios = " ".join(f"{r['dynamic'][lab]['ratio_to_offline_peak']:>17.2f}"
                          for lab in labels)
        best = r["dynamic"][r["best"]]["ratio_to_offline_peak"]
        goal = TARGETS[r["model"]] if r["max_batch_size"] >= 32 else None
        verdict = "-" if goal is None else ("met" if best >= goal else f"<{goal}")
        graph_peak = r.get("offline_graph_peak_rps")
        top_rps = max(d["throughput_rps"] for d in r["dynamic"].values())
        vs_graph = (f"{graph_peak:>11,.0f} {top_rps / graph_peak:>7.2f}" if graph_peak
                    else f"{'-':>11} {'-':>7}")
        loads = "  ".join(f"{v['dynamic']['latency_ms_p50']:.2f}/"
                          f"{v['dynamic']['latency_ms_p99']:.2f} | "
                          f"{v['naive']['latency_ms_p50']:.1f}/{v['naive']['latency_ms_p99']:.1f}"
                          for v in r["loads"].values())
        print(f"  {r['model']:<8} {r['dtype']:<9} {r['max_batch_size']:>4} "
              f"{r['offline_peak_rps']:>11,.0f} {ratios} "
              f"{r['naive']['ratio_to_offline_peak']:>6.2f} {verdict:>7} {vs_graph}   {loads}")
    if report["skipped"] or report["errors"]:
        print(f"  skipped: {report['skipped']}; errors: {report['errors']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", nargs="?", choices=["bench", "profiles", "all"], default="bench")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--budget-s", type=float, default=165.0,
                   help="bench: start no configuration that would end after this long")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny models, seconds")
    p.add_argument("--only", default=None, metavar="MODEL/B,...",
                   help="bench: only these configurations, e.g. mlp/128,cnn/32")
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
        only = None if args.only is None else set(args.only.split(","))
        known = {f"{name}/{b}" for b in cfg.max_batch_sizes for name, _ in BENCH_MODELS}
        if only is not None and not only <= known:
            raise SystemExit(f"--only: no configuration {sorted(only - known)} in this grid "
                             f"(it has {sorted(known)})")
        part_bench(cfg, out, args.budget_s, only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
