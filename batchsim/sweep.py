"""Grid sweeps: one workload kind and one service model over many configurations.

``sweep`` simulates every combination of ``max_batch_size`` x ``max_wait_ms`` x load x
workers x seed and returns a pandas DataFrame, one row per run: the configuration, then
the summary numbers. Common random numbers: a run's arrivals depend on its seed alone,
so for a given seed every configuration at one load sees the same arrival times and
differences between rows come from the policy, not from noise; and from load to load
they are the same arrivals moved, not drawn anew (``batchsim.workload``).

Runs go to a ``concurrent.futures.Executor`` in chunks: by default a process pool over
all local cores, or any executor passed in, such as a Dask cluster's
(``dask.distributed.Client(...).get_executor()``). Progress shows through ``tqdm.auto``.
"""

from __future__ import annotations

import itertools
import os

from . import _check
from .policy import BatchPolicy
from .service import ServiceModel
from .sim import ENGINES, simulate
from .workload import Trace, Workload

#: Sweeps with fewer simulated requests than this run in this process: starting worker
#: processes would take longer than the runs.
INLINE_MAX_REQUESTS = 1_000_000
#: Chunks per local core: enough to balance uneven runs and move the progress bar.
CHUNKS_PER_CORE = 8


def sweep(workload: Workload, service: ServiceModel,
          max_batch_size=(1, 2, 4, 8, 16, 32, 64), max_wait_ms=(0.0, 1.0, 2.0, 5.0, 10.0),
          load=None, workers=(1,), seeds=(0,), n_requests: int | None = 100_000,
          engine: str = "auto", executor=None, progress: bool = True, *, rate_rps=None,
          slo_ms: float | None = None, warmup_frac: float = 0.0):
    """Simulate every configuration of the grid; a DataFrame with one row per run.

    ``load``: fractions of capacity -- each rescales the workload's mean rate to that
    fraction of ``service.capacity_rps(max(max_batch_size), workers)``, the most the
    grid's largest batches can serve with that many workers. ``rate_rps``: mean rates in
    requests/s instead. With neither, the workload runs at its own rate. Each grid
    argument takes a list (or a single value). ``executor``: any
    ``concurrent.futures.Executor``; None uses a process pool over all local cores (or
    this process for small sweeps). ``slo_ms`` adds goodput columns; ``warmup_frac``
    leaves the first part of each run out of its summary.

    Columns: ``max_batch_size``, ``max_wait_ms``, ``load`` (with ``load``),
    ``rate_rps``, ``workers``, ``seed``, then the scalar ``RunResult.summary()`` numbers
    (``utilization_per_worker``, a list, is left out).
    """
    import pandas as pd
    from tqdm.auto import tqdm

    if not isinstance(workload, Workload):
        raise ValueError(f"workload must be a batchsim workload (Poisson, Trace, ...), "
                         f"got {workload!r}")
    if not isinstance(service, ServiceModel):
        raise ValueError(f"service must be a service model (AffineService, ProfileService), "
                         f"got {service!r}")
    sizes = _check.values("max_batch_size", max_batch_size, _check.positive_int)
    waits = _check.values("max_wait_ms", max_wait_ms, _check.non_negative_or_inf)
    worker_counts = _check.values("workers", workers, _check.positive_int)
    seed_list = _check.values("seeds", seeds, _check.non_negative_int)
    if load is not None and rate_rps is not None:
        raise ValueError(f"give load or rate_rps, not both: got load={load!r}, "
                         f"rate_rps={rate_rps!r}")
    if n_requests is not None or not isinstance(workload, Trace):
        n_requests = _check.positive_int("n_requests", n_requests)
    _check.one_of("engine", engine, ENGINES)
    if executor is not None and not hasattr(executor, "submit"):
        raise ValueError(f"executor must be a concurrent.futures.Executor, got {executor!r}")
    if slo_ms is not None:
        _check.positive("slo_ms", slo_ms)
    if _check.non_negative("warmup_frac", warmup_frac) >= 1:
        raise ValueError(f"warmup_frac must be below 1, got {warmup_frac!r}")
    summary_args = {"slo_ms": slo_ms, "warmup_frac": warmup_frac}

    if load is not None:
        loads = _check.values("load", load, _check.positive)
        traffic = [(w, {"load": x}, x * service.capacity_rps(max(sizes), w))
                   for x in loads for w in worker_counts]
    else:
        rates = (_check.values("rate_rps", rate_rps, _check.positive) if rate_rps is not None
                 else [workload.rate_rps])
        traffic = [(w, {}, r) for r in rates for w in worker_counts]
    configs, jobs = [], []
    for w, extra, rate in traffic:
        at_rate = workload if rate == workload.rate_rps else workload.with_rate(rate)
        for b, wait_ms, seed in itertools.product(sizes, waits, seed_list):
            configs.append({"max_batch_size": b, "max_wait_ms": wait_ms, **extra,
                            "rate_rps": rate, "workers": w, "seed": seed})
            jobs.append((len(jobs), at_rate, BatchPolicy(b, wait_ms), w, seed))

    rows = [None] * len(jobs)
    n_each = n_requests if n_requests is not None else len(workload)
    with tqdm(total=len(jobs), desc="sweep", unit="run", disable=not progress) as bar:
        for chunk in _execute(executor, jobs, len(jobs) * n_each, service, n_requests, engine,
                              summary_args):
            for i, summary in chunk:
                rows[i] = {**configs[i], **summary}
            bar.update(len(chunk))
    return pd.DataFrame(rows)


def _execute(executor, jobs, total_requests, service, n_requests, engine, summary_args):
    """Yield lists of ``(job index, summary)`` as chunks of jobs finish."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    cores = os.cpu_count() or 1
    if executor is None and (cores == 1 or total_requests < INLINE_MAX_REQUESTS):
        for job in jobs:
            yield _run_chunk(service, n_requests, engine, summary_args, [job])
        return
    n_chunks = min(len(jobs), CHUNKS_PER_CORE * cores)
    chunks = [jobs[i::n_chunks] for i in range(n_chunks)]   # interleaved: balanced chunks
    own = executor is None
    pool = ProcessPoolExecutor(max_workers=min(cores, n_chunks)) if own else executor
    futures = []
    try:
        futures = [pool.submit(_run_chunk, service, n_requests, engine, summary_args, chunk)
                   for chunk in chunks]
        for future in as_completed(futures):
            yield future.result()
    finally:                         # on an error or interrupt, drop the work not started
        for future in futures:
            future.cancel()
        if own:
            pool.shutdown()


def _run_chunk(service, n_requests, engine, summary_args, jobs):
    """Run some configurations (in a worker process); their scalar summary numbers."""
    out = []
    for i, workload, policy, workers, seed in jobs:
        res = simulate(workload, policy, service, n_requests=n_requests, workers=workers,
                       seed=seed, engine=engine)
        summary = res.summary(**summary_args)
        out.append((i, {k: v for k, v in summary.items() if not isinstance(v, list)}))
    return out
