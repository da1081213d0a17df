"""Sim-to-real: calibrate the simulator on a real batcher, then measure how well it predicts.

``calibrate(model)`` measures what the simulator needs to predict ``DynamicBatcher``
serving ``model`` and returns a ``CalibratedService`` that ``simulate`` accepts:

* ``s(b)``: the model's own (``profile_model``: median of timed batches per size) on a
  CPU, where the batcher runs that very call; on CUDA the batcher replays CUDA graphs
  through a pipeline of threads, another program than the eager model, so ``s(b)`` is
  timed through a one-worker batcher (``profile_batcher``) and only the costs around
  it are fitted below (``profile=`` chooses);
* from open-loop runs of the real batcher (Poisson at 2% to 70% of its saturated
  throughput, under a policy that waits for batches to fill and a greedy one), batch by
  batch: the worker's cost around the model per batch and per request, the slower start
  of a worker that went without a batch (a table over the time since its previous
  batch ended), the delay each request sent during a batch causes it (the event loop's
  work for it needs the GIL) and the first one's more (the loop's turn that sends), a
  later turn's own delay (its requests then cost the loop's work per send), the
  spread of it all; the release (from a batch's end to its worker taking the next,
  which was already due), a table by batch size, and its spread; the reaction (from an
  arrival to the batch it starts on an idle worker);
* the timer: when asyncio wakes for a timer (``loop.call_later``), fitted to
  ``armed + ceil((due - armed) / resolution) * resolution + latency``.

The batcher's costs are a ``BatcherCosts`` that both simulation engines apply.
``compare(real, sim)`` puts two runs over the same requests side by side (percentiles,
mean, throughput, mean batch size and their relative errors, and the error of every
request); ``batchsim.fidelity`` makes such runs and compares them over a grid.
``worker_time_ratio`` measures how slow a real run's batches ran against the
calibration, and ``at_speed`` gives the service on a machine that slow: how much of an
error the machine's drifting speed explains; ``batch_residuals`` sets each batch of a
real run against the calibration's prediction, and ``refit`` fits a calibration's costs
again on its saved runs.
Importing this module is light; torch loads when something real runs.

The module is callable: ``batchsim.calibrate(model)`` is ``batchsim.calibrate.calibrate``
(the package attribute and the module share the name).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import sys
import time
import types
import warnings
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np

from . import _check
from ._aio import run_to_completion
from ._gc import collector_paused
from .cpus import process_cpus
from .policy import BatchPolicy
from .result import COMPLETED, RunResult
from .seeding import streams
from .service import BatcherCosts, CalibratedService, ServiceModel, quantile_at
from .workload import Poisson

#: Quantiles of the measured worker-time ratio kept in a calibrated model.
N_QUANTILES = 201
#: Summary columns compared between a real run and a simulated one.
METRICS = ("latency_ms_p50", "latency_ms_p95", "latency_ms_p99", "latency_ms_mean",
           "throughput_rps", "mean_batch_size")
#: The latency percentiles among them (``compare`` gives their ``share_error`` too).
LATENCY_PERCENTILES = ("latency_ms_p50", "latency_ms_p95", "latency_ms_p99")


# -- calibration ----------------------------------------------------------------------


def calibrate(model_or_batcher, max_batch_size: int | None = None, *, batch_sizes=None,
              n_requests: int = 1200, duration_s: float = 0.5, repeats: int = 30,
              profile_s: float = 1.0, timer_probes: int = 300, device=None, input_spec=None,
              profile: str = "auto", seed: int = 0, runs: list | None = None
              ) -> CalibratedService:
    """Measure ``model_or_batcher`` and its batcher; a ``CalibratedService`` for ``simulate``.

    ``model_or_batcher``: a model (a callable on a batched tensor with an ``input_spec``
    attribute, or give ``input_spec``), served by batchers with the defaults, or a
    ``DynamicBatcher``, served as it serves it (``DynamicBatcher.like``: its runner, CUDA
    graphs and thread CPUs, and its device and input spec unless given), whose
    max_batch_size is the default. Either way the calibration makes batchers of its
    own, one worker each (``batchsim.real.batcher.one_worker``); a given batcher is not
    started. ``batch_sizes``: where ``s(b)`` is timed,
    ``repeats`` times each (default: powers of two up to ``max_batch_size``, and it).
    ``profile``: how ``s(b)`` is timed -- ``"model"``, the model alone
    (``profile_model``); ``"batcher"``, full batches through a one-worker batcher
    (``profile_batcher``); either for at least ``profile_s`` seconds (their
    ``min_duration_s``: 30 rounds of a tiny model last milliseconds, and a neighbour's
    moment of load bent the profile); ``"auto"``, the batcher on CUDA (whose graphs and
    pipeline the model alone misses: on an H200, a calibration on the eager encoder put
    its capacity at twice the measured one), else the model. The batcher is measured on
    ten open-loop runs, Poisson at 2%, 10%, 25%, 40% and 70% of its saturated
    throughput, each under a policy that waits for batches to fill and a greedy one:
    ``n_requests`` in all, or more, ``duration_s`` of traffic per run. ``timer_probes``
    asyncio timers give the timer model. ``seed`` fixes the calibration's arrivals
    (validate on other seeds). ``metadata`` keeps what was measured, and
    ``cpus``, the CPUs this process may run on: on one CPU the event loop and the worker
    thread hand batches over faster than across two (``bench/bench_thread_placement.py``),
    so a calibration holds for runs placed as it was (``batchsim validate --cpu``); and
    ``pipeline``, whether its batchers ran the pipeline of threads.
    ``runs``: a list that gets the ten runs the costs were fitted on (``RunResult``s),
    to refit them or take them apart later.
    """
    from .real import DynamicBatcher, profile_batcher, profile_model
    from .real.batcher import served_model
    from .real.models import model_device

    model, device, input_spec = served_model(model_or_batcher, device, input_spec)
    if isinstance(model_or_batcher, DynamicBatcher) and max_batch_size is None:
        max_batch_size = model_or_batcher.max_batch_size
    if not callable(model):
        raise ValueError(f"model_or_batcher must be a model or a DynamicBatcher, "
                         f"got {model_or_batcher!r}")
    max_b = _check.positive_int("max_batch_size", 32 if max_batch_size is None
                                else max_batch_size)
    sizes = (sorted({_check.positive_int("batch_sizes", b) for b in batch_sizes})
             if batch_sizes is not None else _default_sizes(max_b))
    if not sizes:
        raise ValueError(f"batch_sizes must not be empty, got {batch_sizes!r}")
    n = _check.positive_int("n_requests", n_requests)
    if n < 200:
        raise ValueError(f"n_requests must be at least 200, got {n_requests!r}")
    duration_s = _check.non_negative("duration_s", duration_s)
    profile_s = _check.non_negative("profile_s", profile_s)
    timer_probes = _check.positive_int("timer_probes", timer_probes)
    if runs is not None and not isinstance(runs, list):
        raise ValueError(f"runs must be a list (to get the calibration's runs) or None, "
                         f"got {runs!r}")
    streams(seed)  # checks the seed before anything is measured
    spec = input_spec if input_spec is not None else getattr(model, "input_spec", None)

    _check.one_of("profile", profile, ("auto", "model", "batcher"))
    if profile == "auto":
        profile = "batcher" if model_device(model, device).type == "cuda" else "model"
    if profile == "batcher":
        s_b = profile_batcher(model_or_batcher, sizes, device=device, repeats=repeats,
                              input_spec=spec, min_duration_s=profile_s)
    else:
        s_b = profile_model(model, sizes, device=device, repeats=repeats, input_spec=spec,
                            overhead=False, min_duration_s=profile_s)
    measured = _calibration_runs(model_or_batcher, max_b, n, duration_s, device, spec, seed)
    if runs is not None:
        runs.extend(measured)
    resolution_ms, latency_ms, timer_fit = _timer(timer_probes, seed)
    metadata = {
        "model": getattr(model, "zoo_name", None) or getattr(model, "__name__",
                                                             type(model).__name__),
        "device": s_b.metadata.get("device"),
        "dtype": s_b.metadata.get("dtype"), "torch": s_b.metadata.get("torch"),
        "cpu_threads": s_b.metadata.get("cpu_threads"), "cpus": process_cpus(), "profile": profile,
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "n_requests": n,
        "seed": seed, "calibration_policies": [str(r.meta["policy"]) for r in measured],
        "saturated_rps": measured[0].meta["saturated_rps"], "timer_fit": timer_fit,
        "pipeline": measured[0].meta["pipeline"],
    }
    timer = BatcherCosts(timer_resolution_ms=resolution_ms, timer_latency_ms=latency_ms)
    service = _fitted(s_b, measured, timer, metadata)
    service.metadata["capacity_ratio"] = capacity_check(service, max_b,
                                                        metadata["saturated_rps"])
    return service


def refit(service: CalibratedService, runs: list) -> CalibratedService:
    """``service`` with the batcher's costs fitted again on ``runs``, its ``s(b)`` and
    timer kept: the runs a calibration measured (``calibrate(..., runs=)``, or
    ``bench_fidelity.py --save-runs``), fitted as ``calibrate`` fits them now. After a
    change to the cost model, a saved calibration refitted says what the change does to
    the predictions of the very same real runs (``bench/bench_refit.py``).
    """
    if not isinstance(service, CalibratedService):
        raise ValueError(f"service must be a CalibratedService, got {service!r}")
    if not runs or not all(isinstance(r, RunResult) for r in runs):
        raise ValueError(f"runs must be a non-empty list of RunResults, got {runs!r}")
    # The capacity check was of the old costs: made again below where the runs allow.
    metadata = {k: v for k, v in service.metadata.items() if k != "capacity_ratio"}
    refitted = _fitted(service.model, runs, service.costs, metadata)
    if "saturated_rps" in runs[0].meta:        # a calibration's runs: check capacity again
        refitted.metadata["capacity_ratio"] = capacity_check(
            refitted, runs[0].meta["policy"].max_batch_size, runs[0].meta["saturated_rps"])
    return refitted


def _fitted(s_b: ServiceModel, measured: list, timer: BatcherCosts,
            metadata: dict) -> CalibratedService:
    """The calibrated service: ``s(b)``, the costs fitted on the ``measured`` runs and
    ``timer``'s timer model; ``metadata`` with what the fit found added."""
    # The reaction, with the releases of every back-to-back batch; then the releases
    # without those the loop took in early, awake for a send (the engines do that).
    react_ms = _react_ms(measured, BatcherCosts(**_release_table(*_releases(measured))))
    sizes, gaps_ms = _releases(measured, react_ms)
    release = BatcherCosts(**_release_table(sizes, gaps_ms))
    deviation_ms = gaps_ms - 1e3 * release.release_s(sizes)
    # No batch followed another that was due (a short run at light load): no spread.
    spread_ms = ()
    if deviation_ms.size:
        # A stall makes a release long, never short: only the long ones beyond four
        # median deviations are left out. A fifth to a quarter of the tiny models'
        # releases on one CPU took 8-11 us less than the median, a second mode that a
        # cut on both sides dropped: the simulated release came out ~2 us too long.
        kept = _within(deviation_ms) | (deviation_ms < np.median(deviation_ms))
        spread_ms = tuple(np.quantile(deviation_ms[kept], np.linspace(0, 1, N_QUANTILES)))
    turn_times = _turn_times(measured, react_ms)
    worker = _worker_fit(measured, s_b, send_ms=turn_times.get("send_ms"))
    costs = BatcherCosts(react_ms, linger_ms=_linger_ms(measured, timer.timer_resolution_ms),
                         **turn_times, turn_ms=worker["turn_ms"],
                         timer_resolution_ms=timer.timer_resolution_ms,
                         timer_latency_ms=timer.timer_latency_ms,
                         arrival_ms=worker["arrival_ms"], idle_ms=worker["idle_ms"],
                         wake_ms=worker["wake_ms"],
                         first_arrival_ms=worker["first_arrival_ms"],
                         release_spread_ms=spread_ms, release_sizes=release.release_sizes,
                         release_table_ms=release.release_table_ms)
    metadata = {**metadata, "batches": worker["batches"],
                "stalled_batches": worker["stalled_batches"],
                "stall_ms_per_s": worker["stall_ms_per_s"]}
    return CalibratedService(s_b, worker["per_batch_ms"], worker["per_item_ms"],
                             worker["jitter_quantiles"], costs, metadata)


#: ``calibrate`` warns when its model's capacity is off the measured one by this factor.
CAPACITY_TOLERANCE = 1.5


def capacity_check(service: CalibratedService, max_batch_size: int,
                   measured_rps: float) -> float:
    """The model's capacity at ``max_batch_size`` over the saturated throughput measured
    on the real batcher; a warning (``RuntimeWarning``) when it is off by more than
    ``CAPACITY_TOLERANCE``: the calibration then misses how the batcher spends its time
    at full load (on a GPU, say, the event loop rather than the model may be the limit),
    and predictions near saturation will be wrong."""
    ratio = service.capacity_rps(max_batch_size) / _check.positive("measured_rps",
                                                                    measured_rps)
    if not 1 / CAPACITY_TOLERANCE <= ratio <= CAPACITY_TOLERANCE:
        warnings.warn(f"the calibrated model serves {ratio:.2f}x the saturated throughput "
                      f"measured at max_batch_size={max_batch_size} "
                      f"({measured_rps:,.0f} requests/s): it misses how the batcher spends "
                      f"its time at full load; expect errors near saturation",
                      RuntimeWarning, stacklevel=3)
    return ratio


#: Requests (at least) in the saturated run that sets the calibration's rates and the
#: capacity check: 640 gave a coefficient of variation of 0.29 on the tiny MLP at b=32
#: (a run of a few milliseconds), 2,000 gave 0.02.
SATURATED_REQUESTS = 2000
#: Rates of the calibration runs, as fractions of the batcher's saturated throughput:
#: up to the loads the simulator is asked about. A request arriving while a batch runs
#: costs it less under load than at light load (about 1.1 us each when sent in a stream,
#: against 3-4 us fitted at light load; ``bench/probe_loop_wake.py`` finds most of the
#: cost in the loop's wake-ups, which one cost per request does not model): fitted on
#: light loads only (up to 0.4), the tiny encoder's cost per arrival came out 4.4 us
#: against 3.0 us with runs at 0.6 and 0.8 added, and the simulated p50 under bursts at
#: max_batch_size=64 was 50-100% high. The first request's extra cost
#: (``first_arrival_ms``) now takes in part of it. Runs above 1 (overload) would show
#: batches receiving more requests than they hold, as bursts do, but two at 1.5 did not
#: bring the bursts closer (``bench/results/README.md``).
CALIBRATION_LOADS = (0.02, 0.1, 0.25, 0.4, 0.7)
#: A batch this much (ms) slower than predicted was stalled by the machine (descheduled
#: for a Linux time slice of a few ms, or paused by a garbage collection).
STALL_MS = 1.0
#: Edges (ms) of the bins of the time a worker went without a batch (from the end of its
#: previous one), in the calibration's regression. Fine below 0.1 ms: on one CPU a batch
#: dispatched within about 10 us of the previous one's end starts at once, one dispatched
#: 15-20 us after it pays the worker thread's wake-up (about 40 us for the tiny MLP), and
#: the releases themselves spread over that step (``bench/results/README.md``).
IDLE_EDGES_MS = (0.0, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.06,
                 0.08, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, math.inf)


def _worker_fit(runs, profile, send_ms: float | None = None, min_batches: int = 10) -> dict:
    """The worker's time beyond the model's ``s(b)``, by regression over the batches.

    ``worker - s(b) = wake(idle) + per_item * b + arrival * first + first_arrival *
    (received > 0) + turn * later_turns + send * later``: ``received`` the requests
    received during it, ``first`` those of them the load generator's first turn into it
    brought, ``later_turns`` its later turns into it and ``later`` the requests they
    brought (``_later``); ``wake`` one level per bin of the time its worker went without
    a batch (``IDLE_EDGES_MS``; bins with fewer than ``min_batches`` merged into a
    neighbour); the least idle level is the fixed cost per batch, the others' excess
    over it the wake-up table. ``send`` is not fitted: it is the loop's work per request
    in a turn, ``send_ms`` (measured on the turns' spacing, ``_turn_times``). In the
    calibration's runs a turn into a running batch brings one request or two, so a cost
    per request fitted on them carries the turn's; in a burst's backlog a turn brings
    dozens. Without ``send_ms`` or a later turn in the runs (none recorded) every request
    received costs ``arrival`` and ``turn_ms`` is None. The spread: each batch's time
    over its prediction.
    """
    b, worker_ms, during, idle = (np.concatenate(v) for v in zip(
        *(_batches(res) for res in runs), strict=True))
    later_turns, later = (np.concatenate(v) for v in zip(*(_later(res) for res in runs),
                                                         strict=True))
    y = worker_ms - profile.mean_ms(b)
    bins, levels = _merged_bins(np.digitize(idle, IDLE_EDGES_MS[1:-1]), min_batches)
    indicators = (bins[:, None] == np.array(levels)[None, :]).astype(float)
    turn_ms = None
    if send_ms is not None and later_turns.any():
        *coef, turn_ms = _nonnegative_fit(
            np.column_stack([b, during - later, during > 0, later_turns]),
            y - send_ms * later, intercepts=indicators, groups=bins)
    else:
        coef = _nonnegative_fit(np.column_stack([b, during, during > 0]), y,
                                intercepts=indicators, groups=bins)
    wake = np.array(coef[:len(levels)])
    per_item_ms, arrival_ms, first_arrival_ms = coef[-3:]
    # Each level stands at the median idle time of its batches (at least a nanosecond).
    at_ms = [max(float(np.median(idle[bins == k])), 1e-6) for k in levels]
    per_batch_ms = float(wake[0])
    idle_ms, wake_ms = [], []
    for t, w in zip(at_ms, wake - per_batch_ms, strict=True):
        if not idle_ms or t > idle_ms[-1]:
            idle_ms.append(t)
            wake_ms.append(max(float(w), 0.0))
    fitted = CalibratedService(profile, per_batch_ms, per_item_ms, costs=BatcherCosts(
        arrival_ms=arrival_ms, first_arrival_ms=first_arrival_ms, idle_ms=tuple(idle_ms),
        wake_ms=tuple(wake_ms), turn_ms=turn_ms, send_ms=send_ms or 0.0))
    predicted = _typical_ms(fitted, b, during, idle, (later_turns, later))
    # The spread is the batcher's own. A batch that took over STALL_MS longer than
    # predicted (and beyond four median deviations) was stalled by the machine: a
    # neighbour took the core, the interpreter collected garbage. Such stalls come at
    # their own times, not per batch: they are reported, not drawn for every batch.
    resid = worker_ms - predicted
    stalled = _stalled(resid, bins)
    inside = ~stalled
    span_s = sum(float(r.end_s[-1] - r.start_s[0]) for r in runs)
    return {"per_batch_ms": per_batch_ms, "per_item_ms": per_item_ms,
            "arrival_ms": arrival_ms, "first_arrival_ms": first_arrival_ms, "turn_ms": turn_ms,
            "idle_ms": tuple(idle_ms), "wake_ms": tuple(wake_ms),
            "jitter_quantiles": tuple(np.quantile(worker_ms[inside] / predicted[inside],
                                                  np.linspace(0, 1, N_QUANTILES))),
            "batches": int(b.size), "stalled_batches": int(stalled.sum()),
            "stall_ms_per_s": float(resid[stalled].sum() / span_s)}


def _merged_bins(bins: np.ndarray, min_batches: int) -> tuple[np.ndarray, list]:
    """``bins`` (a bin number per batch) with each bin of fewer than ``min_batches``
    batches joined to the next one up (the last, to the one below), and the bins left."""
    bins, levels = bins.copy(), np.unique(bins).tolist()
    for k in list(levels):
        if (bins == k).sum() < min_batches and len(levels) > 1:
            i = levels.index(k)
            bins[bins == k] = levels[i + 1] if i + 1 < len(levels) else levels[i - 1]
            levels.remove(k)
    return bins, levels


def _release_table(sizes: np.ndarray, gaps_ms: np.ndarray, min_batches: int = 10) -> dict:
    """The release by batch size: the median gap (ms) of the batches nearest (in the
    logarithm) each of the profile's sizes (``_default_sizes``), at their median size;
    sizes with fewer than ``min_batches`` batches join a neighbour. A median, not a line:
    on one CPU the release rose 16 us from a batch of one to two and fell from 26 to 64
    (the encoder, ``bench/results/README.md``). No batch followed another that was due:
    no release."""
    if not sizes.size:
        return {}
    anchors = np.array(_default_sizes(int(sizes.max())))
    nearest = np.argmin(np.abs(np.log(sizes)[:, None] - np.log(anchors)[None, :]), axis=1)
    bins, levels = _merged_bins(nearest, min_batches)
    return {"release_sizes": tuple(float(np.median(sizes[bins == k])) for k in levels),
            "release_table_ms": tuple(float(np.median(gaps_ms[bins == k])) for k in levels)}


#: The first batches of a run warm its worker up; the fits and residuals leave them out.
WARM_BATCHES = 2


def _batches(res: RunResult) -> tuple[np.ndarray, ...]:
    """Per batch of ``res`` but its first ``WARM_BATCHES``: its size, the time it held
    its worker (ms), the requests received during it and how long (ms) its worker went
    without a batch before it (from the end of the worker's previous batch; one worker).
    A batch that never ended (a batcher closed without draining) is left out."""
    last_end_s = np.r_[-np.inf, res.end_s[:-1]]
    keep = _kept_batches(res)
    return (res.size[keep], 1e3 * (res.end_s - res.start_s)[keep],
            _received_during(res)[keep], 1e3 * (res.start_s - last_end_s)[keep])


def _later(res: RunResult) -> tuple[np.ndarray, np.ndarray]:
    """Per batch of ``res`` that a fit reads (``_kept_batches``): the load generator's
    turns after the first that brought it requests while it ran, and the requests those
    later turns brought (zeros where the run recorded no turns)."""
    during = _received_during(res)
    turns, requests = np.zeros(during.size), np.zeros(during.size)
    if res.meta.get("turn_sizes") is not None and len(res.meta["turn_sizes"]):
        turn_of = _turn_of(res)
        lo = np.searchsorted(res.arrival_s, res.start_s, "right")
        got = np.flatnonzero(during > 0)
        t = turn_of[lo[got]]
        turns[got] = turn_of[lo[got] + during[got] - 1] - t
        turn_end = np.cumsum(res.meta["turn_sizes"])       # one past each turn's last
        first_turn = np.minimum(turn_end[t], lo[got] + during[got]) - lo[got]
        requests[got] = during[got] - first_turn
    keep = _kept_batches(res)
    return turns[keep], requests[keep]


def _kept_batches(res: RunResult) -> np.ndarray:
    """Which batches of ``res`` a fit reads: all but the first ``WARM_BATCHES`` (they
    warm the worker up) and any that never ended."""
    keep = np.isfinite(res.end_s)
    keep[:WARM_BATCHES] = False
    return keep


def _typical_ms(service: CalibratedService, b, during, idle_ms, later=None) -> np.ndarray:
    """The typical time (ms) a batch of ``b`` holds its worker, ``during`` requests
    received while it ran, ``idle_ms`` since its worker's previous batch ended: before
    the spread. ``later``: its later turns and the requests they brought (``_later``),
    priced by ``turn_ms`` and ``send_ms`` where the costs have a ``turn_ms``."""
    costs, during = service.costs, np.asarray(during)
    turns, later_requests = (0, 0) if later is None or costs.turn_ms is None else later
    return (service.model.mean_ms(b) + service.per_batch_ms + service.per_item_ms * b
            + costs.arrival_ms * (during - later_requests)
            + costs.first_arrival_ms * (during > 0)
            + (costs.turn_ms or 0.0) * turns + costs.send_ms * later_requests
            + 1e3 * np.array([costs.wake_s(t / 1e3) for t in idle_ms]))


def batch_residuals(service: CalibratedService, res: RunResult):
    """Each batch of a real run against what ``service`` predicts for it: a DataFrame.

    One row per batch but the first ``WARM_BATCHES`` (they warm the worker up), in
    dispatch order: ``start_s``, ``size``, ``trigger`` (``"size"``, ``"timeout"`` or
    ``"flush"``), ``idle_ms`` (how long its worker went without a batch before it, from
    the end of its previous one), ``received`` (the
    requests the batcher received while it ran), ``worker_ms`` (the time it held its
    worker), ``typical_ms`` (the calibration's prediction for such a batch, the spread's
    median included) and ``ratio``, the one over the other. Grouped by a column, the
    ratios say which batches the simulator gets wrong (by size: the profile's shape; by
    idle time: the wake-up table; by ``received``: the cost per arrival). Where the run
    recorded when each batch's worker picked it up (``meta["batch_phases_s"]``, the real
    batcher), ``pickup_ms`` is the time from its dispatch to then and
    ``received_after_pickup`` the part of ``received`` that came later, while the model
    ran (NaN otherwise): which of the two the loop's work for a request delays; and
    ``launch_ms`` the time from its dispatch to its launch (a CUDA pipeline's threads
    picking it up, staging and launching it; the rest of ``worker_ms`` is the device's
    part and the completer's; on the CPU a thread per worker launches as it ends). Where the
    run recorded its load generator's turns (``meta["turn_sizes"]``: ``run_load``, and
    ``simulate(..., sender="loop")``), ``turns`` is how many of them brought the requests
    it received (NaN otherwise): at the same count of requests, each further turn costs
    a batch more (``bench/results/README.md``). ``class_use`` says which use of its size
    class (sizes up to the same power of two: the CUDA graphs' buckets, and the pinned
    host allocator's block sizes where an output row is a power of two of bytes) in the
    run the batch was, counting from the run's first batch: on an H200 a class's first
    uses launched 1-2 ms late.
    """
    import pandas as pd

    from .policy import TRIGGER_NAMES

    if not isinstance(service, CalibratedService):
        raise ValueError(f"service must be a CalibratedService, got {service!r}")
    b, worker_ms, during, idle = _batches(res)
    if not b.size:
        raise ValueError(f"res must have more than {WARM_BATCHES} batches, got "
                         f"{res.size.size}")
    typical_ms = _spread_median(service) * _typical_ms(service, b, during, idle, _later(res))
    keep = _kept_batches(res)
    start_s = res.start_s[keep]
    phases_s = (res.meta["batch_phases_s"][keep] if "batch_phases_s" in res.meta
                else np.full((b.size, 3), np.nan))
    picked_s = phases_s[:, 0]
    after = (np.searchsorted(res.arrival_s, res.end_s[keep], "left")
             - np.searchsorted(res.arrival_s, np.maximum(picked_s, start_s), "right"))
    turns = np.full(b.size, np.nan)
    if "turn_sizes" in res.meta:
        # Each request's turn; a batch's requests are consecutive, so are their turns.
        turn_of = _turn_of(res)
        first = np.searchsorted(res.arrival_s, start_s, "right")
        got = during > 0
        turns[~got] = 0
        turns[got] = turn_of[first[got] + during[got] - 1] - turn_of[first[got]] + 1
    size_class = np.ceil(np.log2(res.size))
    class_use = pd.Series(size_class).groupby(size_class).cumcount().to_numpy() + 1
    return pd.DataFrame({"start_s": start_s, "size": b,
                         "trigger": np.array(TRIGGER_NAMES)[res.trigger[keep]],
                         "idle_ms": idle, "received": during, "worker_ms": worker_ms,
                         "typical_ms": typical_ms, "ratio": worker_ms / typical_ms,
                         "pickup_ms": 1e3 * (picked_s - start_s),
                         "launch_ms": 1e3 * (phases_s[:, 2] - start_s),
                         "received_after_pickup": np.where(np.isnan(picked_s), np.nan,
                                                           np.maximum(after, 0)),
                         "turns": turns, "class_use": class_use[keep]})


def worker_time_ratio(service: CalibratedService, res: RunResult) -> float:
    """How slow the machine ran a real run's batches against the calibration: the time
    its batches held their worker, all together, over the time ``service`` expects those
    very batches to take on average (each one's typical time, ``batch_residuals``, over
    the spread's median times its mean).

    1 is the calibration's speed; 1.1, batches 10% slower. A shared machine's speed
    drifts by that much within a minute (``bench/bench_profile_noise.py``), and the
    simulator cannot know it beforehand; ``at_speed`` tells it, after the fact. A ratio
    of totals, not the median batch's ratio: a queue drains at the batches' mean time,
    so a run whose slow batches are slower than the calibration's spread says ran on a
    slower machine for every request waiting in a backlog (on bursts, the simulator
    told the median came out further off: ``bench/results/README.md``). Batches stalled
    by the machine are left out, as the calibration leaves them out of its spread.
    """
    return _time_ratio(service, batch_residuals(service, res))


def _time_ratio(service: CalibratedService, table) -> float:
    """``worker_time_ratio`` of a run's ``batch_residuals`` table."""
    kept = table[~_stalled((table["worker_ms"] - table["typical_ms"]).to_numpy())]
    mean_over_median = service.jitter_mean / _spread_median(service)
    return float(kept["worker_ms"].sum() / (mean_over_median * kept["typical_ms"].sum()))


def _spread_median(service: CalibratedService) -> float:
    """The median of ``service``'s spread of batch times (1 without one)."""
    q = np.asarray(service.jitter_quantiles)
    return float(quantile_at(q, 0.5)) if q.size else 1.0


def at_speed(service: CalibratedService, ratio: float) -> CalibratedService:
    """``service`` on a machine ``ratio`` times as slow: every part of a batch's time on
    its worker (``s(b)``, the costs per batch and per request, the delays per arrival
    during it, the wake-up after idle) times ``ratio``; the event loop's delays and the
    timer as they were."""
    from dataclasses import replace

    from .service import AffineService, ProfileService

    ratio = _check.positive("ratio", ratio)
    model = getattr(service, "model", None)
    if isinstance(model, ProfileService):
        model = replace(model, times_ms=tuple(ratio * t for t in model.times_ms))
    elif isinstance(model, AffineService):
        model = replace(model, base_ms=ratio * model.base_ms,
                        per_item_ms=ratio * model.per_item_ms)
    else:
        raise ValueError(f"service must be a CalibratedService of a profile or an affine "
                         f"s(b), got {service!r}")
    costs = service.costs
    return replace(service, model=model, per_batch_ms=ratio * service.per_batch_ms,
                   per_item_ms=ratio * service.per_item_ms, costs=replace(
                       costs, arrival_ms=ratio * costs.arrival_ms,
                       first_arrival_ms=ratio * costs.first_arrival_ms,
                       turn_ms=None if costs.turn_ms is None else ratio * costs.turn_ms,
                       wake_ms=tuple(ratio * w for w in costs.wake_ms)))


def _stalled(resid_ms: np.ndarray, groups=None) -> np.ndarray:
    """Batches stalled by the machine: over ``STALL_MS`` slower than predicted
    (``resid_ms``) and beyond four median deviations of their group's residuals."""
    return ~_within(resid_ms, groups) & (resid_ms > STALL_MS)


def _within(resid: np.ndarray, groups=None, mads: float = 4.0) -> np.ndarray:
    """Points within ``mads`` median absolute deviations of the median residual of their
    group (``groups``: a label per point; the spread differs, say, with idle time)."""
    groups = np.zeros(resid.size, int) if groups is None else np.asarray(groups)
    inside = np.zeros(resid.size, bool)
    for g in np.unique(groups):
        mine = groups == g
        dev = np.abs(resid[mine] - np.median(resid[mine]))
        inside[mine] = dev <= mads * np.median(dev) + 1e-12
    return inside


def _default_sizes(max_b: int) -> list[int]:
    return sorted({2**k for k in range(max_b.bit_length()) if 2**k <= max_b} | {max_b})


def _calibration_runs(model_or_batcher, max_b, n, duration_s, device, spec,
                      seed) -> list[RunResult]:
    """The calibration runs: Poisson at ``CALIBRATION_LOADS`` of the saturated throughput,
    from a mostly idle worker (it wakes cold) to a busy one.

    At each rate one batcher waits up to four saturated batch cycles for a batch to fill
    (batch sizes and the arrivals during a batch vary apart) and one is greedy (its
    decisions are woken by arrivals); ``n`` requests in all, or ``duration_s`` of
    traffic per run if that is more. Each run's batcher is ``one_worker`` of
    ``model_or_batcher``.
    """
    from .real import run_load, run_saturated
    from .real.batcher import one_worker

    def batcher(policy):
        return one_worker(model_or_batcher, policy, device=device, input_spec=spec)

    inputs = None if spec is None else spec.random(max_b)
    sat = run_saturated(batcher(BatchPolicy(max_b, math.inf)),
                        max(20 * max_b, SATURATED_REQUESTS), inputs=inputs)
    cap_rps = sat.summary()["throughput_rps"]
    cycle_ms = 1e3 * max_b / cap_rps
    policies = (BatchPolicy(max_b, round(4 * cycle_ms, 3)), BatchPolicy(max_b, 0.0))
    configs = list(itertools.product(CALIBRATION_LOADS, policies))
    runs = []
    for k, (load, policy) in enumerate(configs):
        count = max(n // len(configs), round(load * cap_rps * duration_s))
        res = run_load(batcher(policy), Poisson(load * cap_rps), n_requests=count,
                       seed=seed + k, inputs=inputs)
        res.meta["saturated_rps"] = cap_rps
        runs.append(res)
    return runs


def _received_during(res: RunResult) -> np.ndarray:
    """Per batch, the requests the batcher received strictly between its start and its
    end: what every engine charges ``arrival_ms`` for (the sender model as it sends
    them). Counted by the load generator's schedule instead, the requests due just
    before a dispatch and sent in the loop's turn right after it were missed, though they
    delay the batch (on one CPU, by all the loop's work for them): the calibration put
    that cost into the wake-up after idle, which then charged batches without it.
    """
    a = res.arrival_s
    return np.searchsorted(a, res.end_s, "left") - np.searchsorted(a, res.start_s, "right")


def _releases(runs, react_ms: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Batch sizes and the gaps (ms) from a batch's end to the next batch's start, for the
    batches whose successor was due when they ended (its head waiting, a trigger met).

    With ``react_ms``, not those whose release the loop took in awake for a send: a
    request reached the batcher after the batch's end and within ``react_ms`` of the
    next one's start (a nanosecond more, for rounding). Every engine's load generator
    on the loop takes a release in so; the fitted release is the loop's own, asleep.
    On one CPU the real loop did so after 0-1.2% of them (the tiny models). Not told
    apart: a loop still awake after a turn when the batch ended, which dispatched at
    once and sent only after the dispatch's hold (``BatcherCosts.hold_ms``): its next
    send comes as late after the start as when the batch's end woke the loop.
    """
    sizes, gaps = [], []
    for res in runs:
        due_s = _due_s(res)
        back_to_back = due_s[1:] <= res.end_s[:-1]
        if react_ms is not None:
            a = res.arrival_s
            woken = (np.searchsorted(a, res.start_s[1:] + react_ms / 1e3 + 1e-9, "right")
                     > np.searchsorted(a, res.end_s[:-1], "right"))
            back_to_back &= ~woken
        sizes.append(res.size[:-1][back_to_back])
        gaps.append(1e3 * (res.start_s[1:] - res.end_s[:-1])[back_to_back])
    return np.concatenate(sizes), np.concatenate(gaps)


def _due_s(res: RunResult) -> np.ndarray:
    """Per batch, the rule's instant with a free worker: its head's trigger (by the
    recorded arrivals: the queue full, the head's max_wait over, or the stream closed)."""
    from .policy import dispatch_time_s

    a, policy = res.arrival_s, res.meta["policy"]
    heads = _heads(res)
    last = heads + policy.max_batch_size - 1
    full_s = np.where(last < a.size, a[np.minimum(last, a.size - 1)], np.inf)
    return dispatch_time_s(policy, -np.inf, a[heads], full_s, np.full(heads.size, a[-1]))


def _heads(res: RunResult) -> np.ndarray:
    """Index of the first request of each batch (requests of a batch are consecutive)."""
    served = np.flatnonzero(res.batch_id >= 0)
    ids = res.batch_id[served]
    first = np.r_[True, ids[1:] != ids[:-1]]
    return served[first]


#: How far past a load generator's turn (us) ``_after_turns`` looks for the next
#: request's due instant: several lingers, a tenth of the loop's millisecond timer grid.
SPAN_US = 100.0


#: ``_linger_ms`` fits a linger only from at least this many turns on either side of it
#: (requests sent without a sleep, and after one).
LINGER_MIN_TURNS = 10


def _linger_ms(runs, timer_resolution_ms: float) -> float | None:
    """How long the event loop stayed awake after a load generator's turn sent while a
    batch ran, before it slept (``BatcherCosts.linger_ms``): the delay from the turn's
    last send to the next request's due instant that best splits the requests sent
    without a sleep from those sent after one (``_linger_split_s``), over the runs that
    recorded their turns (``run_load``'s ``meta["turn_sizes"]``). A sleep shows only
    where the timer rounds it up past the delays looked at (``SPAN_US``: asyncio's epoll
    selector rounds to whole milliseconds). None where it does not, where no run
    recorded its turns or where fewer than ``LINGER_MIN_TURNS`` fall on either side:
    the engines then take a reaction."""
    if 1e3 * timer_resolution_ms <= SPAN_US:
        return None
    split = [_after_turns(r, first, timer_resolution_ms)[:2]
             for r in runs if (first := _turn_firsts(r)) is not None]
    if not split:
        return None
    delays_s, awake = (np.concatenate(v) for v in zip(*split, strict=True))
    if min(awake.sum(), (~awake).sum()) < LINGER_MIN_TURNS:
        return None
    return 1e3 * _linger_split_s(delays_s, awake)


def _turn_times(runs, react_ms: float) -> dict:
    """``BatcherCosts``'s ``send_ms``, the median time between two requests of one turn
    of a load generator (``run_load``'s ``meta["turn_sizes"]``), and ``hold_ms`` and
    ``hold_per_item_ms``, a line in the batch's size (non-negative, ``_nonnegative_fit``)
    through the delay from a dispatch to the first send of the turn right after it (a
    request already due at the dispatch, sent before the batch ended), less
    ``react_ms``: on one CPU that turn came 16-22 us after the tiny MLP's dispatches,
    against a reaction of 12 us, later for a larger batch (``bench/results/README.md``).
    Empty where no run recorded its turns (the defaults, zeros, stand); no hold from
    fewer than ten such turns."""
    spacing, sizes, delays = [], [], []
    for res in runs:
        first = _turn_firsts(res)
        if first is None:
            continue
        a, due = res.arrival_s, _sending_due_s(res)
        inside = _turn_of(res)
        gaps = np.diff(a)
        spacing.append(gaps[inside[1:] == inside[:-1]])
        k = np.searchsorted(a[first], res.start_s, "left")   # the first turn after each start
        ok = k < len(first)
        nxt = first[k[ok]]
        start, end, b = res.start_s[ok], res.end_s[ok], res.size[ok]
        after = (due[nxt] <= start) & (a[nxt] < end)
        sizes.append(b[after])
        delays.append(1e3 * (a[nxt] - start)[after] - react_ms)
    if not spacing:
        return {}
    spacing, sizes, delays = (np.concatenate(v) for v in (spacing, sizes, delays))
    out = {"send_ms": 1e3 * float(np.median(spacing)) if spacing.size else 0.0}
    if delays.size >= 10:
        out["hold_ms"], out["hold_per_item_ms"] = _nonnegative_fit(sizes, delays)
    return out


def _turn_firsts(res: RunResult) -> np.ndarray | None:
    """The index of the first request of each of the load generator's turns, where the
    run recorded them (``run_load``'s and a simulated sender's ``meta["turn_sizes"]``);
    None where it did not."""
    turns = res.meta.get("turn_sizes")
    if turns is None or not len(turns):
        return None
    return np.r_[0, np.cumsum(turns)[:-1]]


def _turn_of(res: RunResult) -> np.ndarray:
    """Each request's turn of the load generator, numbered from 0, in a run that
    recorded its turns (``meta["turn_sizes"]``)."""
    turns = res.meta["turn_sizes"]
    return np.repeat(np.arange(len(turns)), turns)


def _after_turns(res: RunResult, first: np.ndarray, timer_resolution_ms: float):
    """For each turn (``first``: the index of each turn's first request) sent while a
    batch ran whose next request fell due within ``SPAN_US`` of its last send, with the
    batch running on ``SPAN_US`` beyond: that delay (s), whether the request was sent
    without a sleep (before the batch's end and before a sleep of one timer resolution
    could end) and its lateness (s)."""
    a, due = res.arrival_s, _sending_due_s(res)
    last_s, next_due_s, next_s = a[first[1:] - 1], due[first[1:]], a[first[1:]]
    k = np.searchsorted(res.start_s, last_s, "right") - 1
    end_s = res.end_s[np.maximum(k, 0)]
    delay_s = next_due_s - last_s
    span_s = SPAN_US / 1e6
    kept = ((k >= 0) & (last_s < end_s) & (delay_s > 0) & (delay_s <= span_s)
            & (end_s > next_due_s + span_s))
    awake = next_s < np.minimum(end_s, last_s + timer_resolution_ms / 1e3)
    return delay_s[kept], awake[kept], (next_s - next_due_s)[kept]


def _linger_split_s(delays_s: np.ndarray, awake: np.ndarray) -> float:
    """The delay that splits the requests sent awake from those sent after a sleep with
    the fewest on the wrong side, midway between the delays either side (NaN: none)."""
    if not delays_s.size:
        return float("nan")
    order = np.argsort(delays_s)
    delays_s, awake = delays_s[order], awake[order]
    # Split after the first i: the asleep among them and the awake beyond are wrong.
    wrong = np.r_[0, np.cumsum(~awake)] + awake.sum() - np.r_[0, np.cumsum(awake)]
    i = int(np.argmin(wrong))
    below = delays_s[i - 1] if i else 0.0
    above = delays_s[i] if i < delays_s.size else delays_s[-1]
    return 0.5 * (below + above)


def _react_ms(runs, release: BatcherCosts) -> float:
    """Median delay from the arrival that made a batch due to its start, over batches
    whose worker was idle by then (the arrival itself woke the decision)."""
    delays = []
    for res in runs:
        a, heads, due_s = res.arrival_s, _heads(res), _due_s(res)
        free_s = np.r_[-np.inf, res.end_s[:-1] + release.release_s(res.size[:-1])]
        by_arrival = np.isin(due_s, a) & (free_s < due_s) & (heads > 0)
        delays.append(1e3 * (res.start_s - due_s)[by_arrival])
    delays = np.concatenate(delays)
    if not delays.size:
        raise RuntimeError("no batch in the calibration runs was started by an arrival on "
                           "an idle worker: cannot measure the reaction delay")
    return max(float(np.median(delays)), 0.0)


def _nonnegative_fit(x, y, intercepts=None, groups=None) -> tuple[float, ...]:
    """Non-negative coefficients of ``y ~ intercepts @ c0 + x @ c1`` (``intercepts``: one
    column of ones by default): least absolute deviations (robust to the batches a busy
    machine stalled), then least squares on the points within four median deviations of
    that fit, in their ``groups`` (the mean is what queues feel). A coefficient of ``x``
    that comes out negative is dropped and the fit redone (a cost is never negative);
    intercepts are clipped at 0.
    """
    x, y = np.atleast_2d(np.asarray(x, float).T).T, np.asarray(y, float)
    ones = np.ones((len(y), 1)) if intercepts is None else np.asarray(intercepts, float)
    keep = np.ones(x.shape[1], bool)
    while True:
        design = np.column_stack([ones, x[:, keep]])
        coef = np.linalg.lstsq(design, y, rcond=None)[0]
        for _ in range(50):   # least absolute deviations by reweighted least squares
            w = 1.0 / np.sqrt(np.maximum(np.abs(y - design @ coef), 1e-9))
            coef = np.linalg.lstsq(design * w[:, None], y * w, rcond=None)[0]
        inside = _within(y - design @ coef, groups)
        coef = np.linalg.lstsq(design[inside], y[inside], rcond=None)[0]
        slopes = coef[ones.shape[1]:]
        if (slopes >= 0).all():
            out = np.zeros(ones.shape[1] + x.shape[1])
            out[:ones.shape[1]] = np.maximum(coef[:ones.shape[1]], 0.0)
            out[ones.shape[1] + np.flatnonzero(keep)] = slopes
            return tuple(float(c) for c in out)
        keep[np.flatnonzero(keep)[np.argmin(slopes)]] = False


def timer_lateness_ms(n: int = 300, seed: int = 0, max_delay_ms: float = 3.0) -> np.ndarray:
    """``(n, 2)``: asyncio timers of random delays (ms) and how late each fired (ms).

    Each timer is armed right after the previous one fired, on a loop with nothing else
    to do, as ``DynamicBatcher`` arms its max_wait timer; no automatic garbage collection
    runs meanwhile (``batchsim._gc``).
    """
    delays_ms = np.random.default_rng(seed).uniform(0.05, max_delay_ms, n)

    async def probe():
        loop = asyncio.get_running_loop()
        late = np.empty(n)
        for i, d_ms in enumerate(delays_ms):
            fired = loop.create_future()
            t0 = time.perf_counter()
            loop.call_later(d_ms / 1e3, lambda f=fired: f.set_result(time.perf_counter()))
            late[i] = 1e3 * (await fired - t0) - d_ms
        return late

    with collector_paused():
        return np.column_stack([delays_ms, run_to_completion(probe)])


def _timer(n: int, seed: int) -> tuple[float, float, dict]:
    """Fit the timer model to probes: ``(resolution_ms, latency_ms, record)``.

    For each candidate resolution ``g`` the residual lateness (measured minus the rounding
    ``ceil(d / g) * g - d``) should be a constant latency: the resolution whose residuals
    spread least (mean absolute deviation from their median) among those that do not
    predict timers later than they fired. The latency is the 25th percentile of its
    residuals, not their median: the operating system's wake-up is bimodal on an idle
    machine (about 0.1 ms, or twice that when the core had dropped into a deeper sleep,
    for stretches of the probes), and the loop of a batcher that serves traffic wakes
    from the lighter sleep. A median caught in the slower mode puts every simulated
    timer after the requests the real loop took in just after it fired.
    """
    probes = timer_lateness_ms(n, seed)
    d_ms, late_ms = probes[:, 0], probes[:, 1]
    best = (math.inf, 0.0, late_ms)
    for g in np.round(np.arange(0.0, 4.0001, 0.01), 10):
        rounding = np.ceil(d_ms / g) * g - d_ms if g > 0 else 0.0
        resid = late_ms - rounding
        if np.quantile(resid, 0.05) < -0.02:
            continue
        spread = float(np.mean(np.abs(resid - np.median(resid))))
        if spread < best[0] - 1e-6:
            best = (spread, float(g), resid)
    spread, g, resid = best
    latency = float(np.percentile(resid, 25))
    return g, max(latency, 0.0), {"n": n, "lateness_ms_median": float(np.median(late_ms)),
                                  "residual_median_ms": float(np.median(resid)),
                                  "residual_mad_ms": spread}


# -- comparison -----------------------------------------------------------------------


@dataclass(eq=False)
class Comparison:
    """A real run and a simulated one over the same requests, side by side.

    ``table``: one row per metric (``METRICS``) with ``real``, ``sim``, ``rel_error``
    (``sim / real - 1``) and, for the latency percentiles (``LATENCY_PERCENTILES``),
    ``share_error``: the share of the simulated requests at or under the real
    percentile, less the real run's own share there (about the percentile's: a half at
    p50), both over the requests ``summary`` keeps (completed, after the warm-up). A
    fraction of the requests, not a relative error: -0.01, one request in a hundred fewer
    at or under it, the simulation slower there. The two read the latency distributions'
    difference along either axis. Where a percentile falls in a gap between two groups
    of latencies (a p50 between the requests that filled a batch and those that waited
    for the timeout), a fraction of a percent of requests moves it across the gap:
    ``rel_error`` can be 100% where ``share_error`` says how few requests the runs
    disagree on; where many requests take nearly the same time, a small ``rel_error``
    can hide a large ``share_error`` (``bench/results/README.md``). NaN for the other
    metrics.
    ``error_ms``: per request, simulated minus real latency (NaN where either run did
    not complete it). ``error_quantiles_ms``: its 1st, 5th, 25th, 50th, 75th, 95th and
    99th percentiles; ``abs_error_ms_median``, its typical size.
    """

    table: object
    error_ms: np.ndarray
    error_quantiles_ms: dict
    abs_error_ms_median: float

    def row(self) -> dict:
        """A flat dict: ``real_X``, ``sim_X``, ``err_X`` per metric, ``share_err_X`` per
        latency percentile (``share_error``), and the request errors."""
        out = {}
        for metric, r in self.table.iterrows():
            out[f"real_{metric}"], out[f"sim_{metric}"] = r["real"], r["sim"]
            out[f"err_{metric}"] = r["rel_error"]
            if metric in LATENCY_PERCENTILES:
                out[f"share_err_{metric}"] = r["share_error"]
        out.update({f"req_err_ms_p{q}": v for q, v in self.error_quantiles_ms.items()})
        out["req_abs_err_ms_median"] = self.abs_error_ms_median
        return out


def compare(real: RunResult, sim: RunResult, warmup_frac: float = 0.0) -> Comparison:
    """Compare ``sim`` with ``real``, two runs over the same requests (matched by index).

    The same requests: both were due at the same instants (``_sending_due_s``: a load
    generator's schedule, or the arrivals themselves), or arrived at the same instants
    (a simulation of the arrivals a real run recorded); anything else is refused, as
    its per-request errors would set unrelated requests side by side. Both summaries
    skip the first ``warmup_frac`` of requests, and so do the per-request errors.
    """
    import pandas as pd

    for name, res in (("real", real), ("sim", sim)):
        if not isinstance(res, RunResult):
            raise ValueError(f"{name} must be a RunResult, got {res!r}")
    if real.n_requests != sim.n_requests:
        raise ValueError(f"sim must have as many requests as real ({real.n_requests}), "
                         f"got {sim.n_requests}")
    _check_same_requests(real, sim)
    a, b = real.summary(warmup_frac=warmup_frac), sim.summary(warmup_frac=warmup_frac)
    table = pd.DataFrame({"real": [a[m] for m in METRICS], "sim": [b[m] for m in METRICS]},
                         index=list(METRICS))
    table["rel_error"] = table["sim"] / table["real"] - 1.0
    first = int(_check.non_negative("warmup_frac", warmup_frac) * real.n_requests)
    real_ms, sim_ms = (1e3 * r.latency_s[first:][r.status[first:] == COMPLETED]
                       for r in (real, sim))
    table["share_error"] = [_share_error(real_ms, sim_ms, a[m])
                            if m in LATENCY_PERCENTILES else math.nan for m in METRICS]
    both = (real.status == COMPLETED) & (sim.status == COMPLETED)
    error_ms = np.where(both, 1e3 * (sim.latency_s - real.latency_s), np.nan)
    kept = error_ms[first:][both[first:]]
    qs = (1, 5, 25, 50, 75, 95, 99)
    quantiles = (dict(zip(qs, np.percentile(kept, qs).tolist(), strict=True)) if kept.size
                 else dict.fromkeys(qs, math.nan))
    median_abs = float(np.median(np.abs(kept))) if kept.size else math.nan
    return Comparison(table, error_ms, quantiles, median_abs)


def _share_error(real_ms: np.ndarray, sim_ms: np.ndarray, at_ms: float) -> float:
    """The share of ``sim_ms`` at or under ``at_ms`` less the share of ``real_ms``; NaN
    where either run has no latency to compare."""
    if not (real_ms.size and sim_ms.size) or math.isnan(at_ms):
        return math.nan
    return float(np.mean(sim_ms <= at_ms) - np.mean(real_ms <= at_ms))


def _sending_due_s(res: RunResult) -> np.ndarray:
    """When each request of ``res`` was due to be sent: a load generator's schedule
    (``run_load``'s ``scheduled_s``; a simulated sender's ``sent_s``), else its arrivals."""
    return res.meta.get("scheduled_s", res.meta.get("sent_s", res.arrival_s))


def _check_same_requests(real: RunResult, sim: RunResult) -> None:
    """A ``ValueError`` naming where ``real`` and ``sim`` first differ, in when their
    requests were due and in when they arrived, unless they agree in either (to 1 ns)."""
    differ = []
    for what, a, b in (("due", _sending_due_s(real), _sending_due_s(sim)),
                       ("arrived", real.arrival_s, sim.arrival_s)):
        off = ~np.isclose(a, b, rtol=0.0, atol=1e-9, equal_nan=True)
        if not off.any():
            return
        i = int(np.argmax(off))
        differ.append(f"request {i} {what} at {a[i]:.9g} s in real and {b[i]:.9g} s in sim")
    raise ValueError(f"sim must serve real's requests (due, or arriving, at the same "
                     f"instants), got {'; '.join(differ)}")


class _CallableModule(types.ModuleType):
    """This module, which called is its ``calibrate`` function."""

    def __call__(self, *args, **kwargs):
        return calibrate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
