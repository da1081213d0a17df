"""Real against simulated: the same arrivals served by the real batcher and simulated.

``run_pair`` runs the real batcher and the simulator on the same arrivals (the simulator
gets the load generator's schedule, ``simulate_schedule``); ``fidelity`` does that over a
grid of max_batch_size x max_wait_ms x load and returns a row of errors per
configuration (``calibrate.compare``), with what explains them: the real batcher
against itself, the machine's speed during each row, the speed tracked from the rows
before; ``fidelity_summary`` reduces a grid to its headline errors and ``plot_fidelity``
draws it; ``resimulate`` scores a grid's real runs against another calibration. What
is fitted, and the measures of a run against a calibration (``worker_time_ratio``,
``at_speed``), live in ``batchsim.calibrate``. ``batchsim validate`` and
``bench/bench_fidelity.py`` are this module's grid on the command line.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from . import _check
from .calibrate import METRICS, at_speed, compare, worker_time_ratio
from .policy import BatchPolicy
from .result import RunResult
from .seeding import streams
from .service import CalibratedService, ServiceModel
from .workload import Poisson, Trace, Workload


def run_pair(model_or_batcher, service: ServiceModel, policy: BatchPolicy,
             workload: Workload, n_requests: int, seed: int = 0, *,
             arrivals: str = "scheduled", device=None) -> tuple[RunResult, RunResult]:
    """Serve ``workload`` (seeded) with the real batcher and simulate the same requests.

    The real batcher has one worker and serves the model with the defaults, or as a
    given ``DynamicBatcher`` serves it (``batchsim.real.batcher.one_worker``).

    ``arrivals="scheduled"``: the simulator gets the instants drawn for the seed, when
    the load generator was due to send each request, and models how they reach the
    batcher through its event loop (``simulate(..., sender="loop")``: the generator
    sleeps on the loop's millisecond timer grid and sends what is due whenever the loop
    wakes, for its own timer or for a batch's release). ``"recorded"``: the simulator
    gets the instants the batcher recorded. Those carry the real run's timing -- a
    request sent during a batch is recorded when the loop next runs, right after that
    batch ends and the next one leaves -- so the simulator, whose batches fall a little
    differently, sees arrivals placed for another timeline (a worse prediction; kept to
    show that). Both runs' ``arrival_s`` are when the batcher got each request.
    """
    from .real import run_load
    from .real.batcher import one_worker
    from .sim import simulate

    _check.one_of("arrivals", arrivals, ("scheduled", "recorded"))
    if arrivals == "scheduled":
        _calibrated(service)
    real = run_load(one_worker(model_or_batcher, policy, device=device), workload,
                    n_requests=n_requests, seed=seed)
    if arrivals == "recorded":
        return real, simulate(Trace(real.arrival_s), policy, service, seed=seed)
    return real, simulate_schedule(real, policy, service, seed)


def _calibrated(service) -> CalibratedService:
    """``service`` if it is a ``CalibratedService``: only a calibration models the
    batcher's costs and the load generator on its loop, which the real runs pay."""
    if not isinstance(service, CalibratedService):
        raise ValueError(f"service must be a CalibratedService (batchsim.calibrate's), "
                         f"got {service!r}")
    return service


def checked_grid(max_batch_size, max_wait_ms, load, n_requests: int = 2000,
                 duration_s: float | None = None,
                 seed: int = 0) -> tuple[list[BatchPolicy], list[float]]:
    """``fidelity``'s arguments checked before anything runs (a ``ValueError`` naming
    the parameter and the value): the policies of max_batch_size x max_wait_ms, in the
    grid's order, and the loads. Each axis is a sequence or a single value."""
    sizes = _check.values("max_batch_size", max_batch_size, _check.positive_int)
    waits = _check.values("max_wait_ms", max_wait_ms, _check.non_negative_or_inf)
    loads = _check.values("load", load, _check.positive)
    _check.positive_int("n_requests", n_requests)
    if duration_s is not None:
        _check.positive("duration_s", duration_s)
    streams(seed)
    return [BatchPolicy(mb, mw) for mb, mw in itertools.product(sizes, waits)], loads


def simulate_schedule(real: RunResult, policy: BatchPolicy, service: ServiceModel,
                      seed=0) -> RunResult:
    """``service``'s simulation of the requests a real ``run_load`` run was due to send
    (its ``scheduled_s``), sent by a load generator on the batcher's loop
    (``sender="loop"``), as ``run_pair`` compares them."""
    from .sim import simulate

    return simulate(Trace(real.meta["scheduled_s"]), policy, service, seed=seed,
                    sender="loop")


#: ``fidelity`` flags a row whose real load generator was later than the simulated one
#: by more than this at p99: one tick of asyncio's millisecond timer grid, the most a
#: generator that keeps up is late by (it wakes on that grid).
BEHIND_MS = 1.0
#: ``fidelity`` tracks the machine's level from the speeds of this many real runs made
#: before each row (their median, ``tracked_ratio``). The speed wanders, so recent runs
#: say more: over 55 saved one-CPU grids the median of the last five missed a row's own
#: speed by 0.90x as much as the median of every run before (median |log| 2.9% against
#: 3.3%) and came closer in 41 of the grids; the last run alone did as well at the median
#: but moves with each row's own noise (``bench/bench_tracked_level.py``).
TRACKED_RUNS = 5
#: A speed probe (``fidelity(probe_speed=True)``) serves this many full batches, and at
#: least ``SPEED_PROBE_MIN_REQUESTS`` requests, closed loop.
SPEED_PROBE_BATCHES = 100
SPEED_PROBE_MIN_REQUESTS = 2000


def fidelity(model_or_batcher, service: ServiceModel, max_batch_size=(8, 32),
             max_wait_ms=(0.0, 1.0), load=(0.2, 0.5, 0.8), *, workload: Workload | None = None,
             n_requests: int = 2000, duration_s: float | None = None, seed: int = 0,
             repeat: bool = False, baseline: ServiceModel | None = None, device=None,
             progress: bool = False, runs: list | None = None, probe_speed: bool = False,
             speed_history: list | None = None):
    """Real against simulated over max_batch_size x max_wait_ms x load: a DataFrame.

    ``model_or_batcher``: the model, served with the defaults, or a ``DynamicBatcher``
    that each row serves it as (``run_pair``), one worker.

    ``load`` is a fraction of ``service.capacity_rps(max_batch_size)``; ``workload``
    (default Poisson) is rescaled to that rate. Each run serves ``n_requests``, or with
    ``duration_s`` as many as arrive in that time if more (a run must be long against
    the machine's hiccups to measure a tail). One row per configuration: its
    parameters, both runs' metrics and relative errors (``Comparison.row``), the
    per-request error quantiles, the load generator's lateness (ms, p50 and p99; the
    simulated one's p99, ``sim_lateness_ms_p99``) and ``harness_behind``: the real
    generator fell behind its schedule by more than the simulated one, by over
    ``BEHIND_MS`` at p99. Sending requests costs the event loop time and the GIL that
    the worker thread needs too; past a rate the loop cannot keep up, both threads slow
    each other, and the requests queue in the generator rather than in the batcher, so
    the real latencies (from when the batcher got each request) measure the harness.
    The simulator does not model that contention; such rows are flagged, not dropped.
    With ``repeat`` the real run is made twice on the same seed and the second compared
    with the first too (``floor_err_*`` columns): how far the real batcher is from
    itself, the least error any model of it can show on this machine. With a
    ``baseline`` service model (say ``service.model``, the model's ``s(b)`` alone), the
    same arrivals are simulated with it too (``base_err_*`` columns): what calibration
    buys. ``rec_err_*`` columns: the calibrated simulator fed the arrival instants the
    batcher recorded instead of the load generator's schedule (``run_pair``'s
    ``arrivals="recorded"``): what modelling the sender on the loop buys. ``runs``: a
    list that gets, per row, a dict of its policy, rate and the real ``RunResult`` (and
    with ``repeat`` the second one), to take a row apart or re-simulate it later.
    ``probe_speed``: before the first row, and again right before each row's real run, a
    short saturated run at the row's max_batch_size (``SPEED_PROBE_BATCHES`` full
    batches); ``speed_ratio`` is the second's throughput over the first's. A shared
    machine's speed drifts: ratios above 1 say the row's real run had a faster machine
    than the grid's start had (right after the calibration, where the grid follows it),
    and the simulator then predicts it slower. With a ``CalibratedService``, each row's
    ``worker_time_ratio`` says how slow its real batches ran against the calibration,
    measured on the run itself rather than before it (``worker_time_ratio``), and
    ``speed_err_*`` columns are the errors of the simulator told that speed
    (``at_speed``): what is left when the machine's speed is taken out -- the mechanisms
    the simulator misses, and the spread. ``speed_history`` (a list, with a
    ``CalibratedService``): the ``worker_time_ratio`` of the real runs made before this
    grid, extended with each row's after the row. Each row is also simulated at the
    median of the last ``TRACKED_RUNS`` ratios before it (``tracked_ratio``; 1 when there
    are none), which gives
    the ``tracked_err_*`` columns: a prediction still, since it uses only runs already
    made -- the calibration's level kept up to date from the batcher's own recent
    traffic, as a model next to a live server could be. Pass one list to every
    ``fidelity`` call of a session to carry the level from one grid to the next.
    """
    import pandas as pd

    from .real import run_load
    from .real.batcher import one_worker
    from .sim import simulate

    policies, loads = checked_grid(max_batch_size, max_wait_ms, load, n_requests, duration_s,
                                   seed)
    _calibrated(service)
    shape = Poisson(1.0) if workload is None else workload
    configs = [(policy, x) for policy in policies for x in loads]
    start_rps = ({b: _speed_probe(model_or_batcher, b, device)
                  for b in dict.fromkeys(policy.max_batch_size for policy in policies)}
                 if probe_speed else {})
    rows = []
    for k, (policy, x) in enumerate(configs):
        rate_rps = float(x) * service.capacity_rps(policy.max_batch_size)
        traffic = shape.with_rate(rate_rps)
        n = n_requests if duration_s is None else max(n_requests, round(rate_rps * duration_s))
        speed = {}
        if probe_speed:
            speed["speed_ratio"] = (_speed_probe(model_or_batcher, policy.max_batch_size,
                                                 device)
                                    / start_rps[policy.max_batch_size])
        real, sim = run_pair(model_or_batcher, service, policy, traffic, n, seed,
                             device=device)
        sim_late_ms = 1e3 * (sim.arrival_s - sim.meta["sent_s"])
        row = {"max_batch_size": policy.max_batch_size, "max_wait_ms": policy.max_wait_ms,
               "load": float(x), "rate_rps": rate_rps, "n_requests": n,
               "lateness_ms_p50": real.meta["lateness_ms_p50"],
               "lateness_ms_p99": real.meta["lateness_ms_p99"],
               "sim_lateness_ms_p99": float(np.percentile(sim_late_ms, 99))}
        row["harness_behind"] = bool(row["lateness_ms_p99"]
                                     > row["sim_lateness_ms_p99"] + BEHIND_MS)
        row.update(speed)
        row.update(compare(real, sim).row())
        if isinstance(service, CalibratedService):
            row["worker_time_ratio"] = worker_time_ratio(service, real)
            told = simulate_schedule(real, policy,
                                     at_speed(service, row["worker_time_ratio"]), seed)
            row.update(_rel_errors("speed_err", real, told))
            if speed_history is not None:
                row["tracked_ratio"] = tracked_ratio(speed_history)
                tracked = simulate_schedule(real, policy,
                                            at_speed(service, row["tracked_ratio"]), seed)
                row.update(_rel_errors("tracked_err", real, tracked))
                speed_history.append(row["worker_time_ratio"])
        recorded = simulate(Trace(real.arrival_s), policy, service, seed=seed)
        row.update(_rel_errors("rec_err", real, recorded))
        if baseline is not None:
            base = simulate(Trace(real.arrival_s), policy, baseline, seed=seed)
            row.update(_rel_errors("base_err", real, base))
        again = None
        if repeat:
            again = run_load(one_worker(model_or_batcher, policy, device=device), traffic,
                             n_requests=n, seed=seed)
            row.update(_rel_errors("floor_err", real, again))
        rows.append(row)
        if runs is not None:
            runs.append({"policy": policy, "rate_rps": rate_rps, "seed": seed, "real": real,
                         "again": again})
        if progress:
            print(f"[{k + 1}/{len(configs)}] max_batch_size={policy.max_batch_size} "
                  f"max_wait_ms={policy.max_wait_ms:g} load={x}: "
                  f"p50 {row['err_latency_ms_p50']:+.1%}, p99 {row['err_latency_ms_p99']:+.1%}"
                  + (f" (real vs real: p50 {row['floor_err_latency_ms_p50']:+.1%}, p99 "
                     f"{row['floor_err_latency_ms_p99']:+.1%})" if repeat else ""), flush=True)
    return pd.DataFrame(rows)


def tracked_ratio(speed_history, kept: int | None = TRACKED_RUNS) -> float:
    """The speed ``fidelity`` tracks a row at: the median ``worker_time_ratio`` of the
    last ``kept`` real runs before it (None: all of them), or 1 (the calibration's own
    speed) before any."""
    if kept is not None:
        kept = _check.positive_int("kept", kept)
        speed_history = speed_history[-kept:]
    return float(np.median(speed_history)) if len(speed_history) else 1.0


def _speed_probe(model_or_batcher, max_batch_size: int, device) -> float:
    """How many requests/s the model is served right now: a short saturated run of
    ``one_worker`` of ``model_or_batcher``."""
    from .real import run_saturated
    from .real.batcher import one_worker

    n = max(SPEED_PROBE_BATCHES * max_batch_size, SPEED_PROBE_MIN_REQUESTS)
    res = run_saturated(one_worker(model_or_batcher, BatchPolicy(max_batch_size, math.inf),
                                   device=device), n)
    return res.summary()["throughput_rps"]


def resimulate(df, runs: list, service: ServiceModel, prefix: str = "recal_err") -> None:
    """Add ``{prefix}_*`` columns to a ``fidelity`` DataFrame (or any with a row per
    run): each row's real run (the ``runs`` that ``fidelity(..., runs=)`` collected)
    against ``service``'s simulation of the same scheduled arrivals, as ``run_pair``
    simulates them.

    With ``service`` a second calibration of the same batcher, made after the grid,
    ``fidelity_summary`` then also says how far the two calibrations' predictions are
    apart (``median_abs_between_calibrations_*``): how far the machine drifted between
    them, which two real runs seconds apart (the floor) do not see.
    """
    errors = [_rel_errors(prefix, run["real"], simulate_schedule(
        run["real"], run["policy"], service, run["seed"])) for run in runs]
    for column in errors[0]:
        df[column] = [e[column] for e in errors]


def _rel_errors(prefix: str, real: RunResult, other: RunResult) -> dict:
    """``{prefix}_{metric}``: the relative error of ``other`` against ``real`` per metric."""
    return {f"{prefix}_{m}": v for m, v in compare(real, other).table["rel_error"].items()}


def fidelity_summary(df) -> dict:
    """Median absolute relative errors over a ``fidelity`` grid (also of the baseline, of
    the simulator fed the recorded arrivals, of the real batcher against itself and of
    the simulator with another calibration, ``recal_err_*``, where there are), and the
    worst row by p99. Where rows say ``harness_behind``: how many, and
    ``median_abs_kept_*``, the simulator's errors over the other rows. With another
    calibration (``resimulate``), ``median_abs_between_calibrations_*``: how far its
    prediction is from the first's, relative to the first's. ``median_abs_at_speed_*``:
    the simulator told each row's speed (``speed_err_*``); with ``worker_time_ratio``, its
    5th and 95th percentiles over the rows; ``median_abs_tracked_*``, at the speed of the
    runs before each row (``tracked_err_*``, ``speed_history``);
    ``median_abs_share_latency_ms_p*``, of the latency percentiles' ``share_error``
    (``batchsim.calibrate.Comparison``: a difference of shares of requests, not a
    relative error). With ``speed_ratio``
    (``probe_speed``): its 5th and 95th percentiles over the rows, and the correlation
    of each row's p50 error with it (``speed_corr_err_latency_ms_p50``)."""
    out = {"configurations": len(df)}
    kept = None
    if "harness_behind" in df:
        out["harness_behind"] = int(df["harness_behind"].sum())
        kept = df[~df["harness_behind"].astype(bool)]
    for metric in METRICS:
        out[f"median_abs_err_{metric}"] = float(df[f"err_{metric}"].abs().median())
        if kept is not None:
            out[f"median_abs_kept_{metric}"] = (float(kept[f"err_{metric}"].abs().median())
                                                if len(kept) else math.nan)
        for prefix, name in (("floor_err", "floor"), ("base_err", "base"),
                             ("rec_err", "recorded"), ("recal_err", "recalibrated"),
                             ("speed_err", "at_speed"), ("tracked_err", "tracked"),
                             ("share_err", "share")):
            if f"{prefix}_{metric}" in df:
                out[f"median_abs_{name}_{metric}"] = float(df[f"{prefix}_{metric}"].abs()
                                                           .median())
        if f"recal_err_{metric}" in df:
            apart = (1 + df[f"recal_err_{metric}"]) / (1 + df[f"err_{metric}"]) - 1
            out[f"median_abs_between_calibrations_{metric}"] = float(apart.abs().median())
    if "worker_time_ratio" in df:
        out["worker_time_ratio_p5"], out["worker_time_ratio_p95"] = (
            float(q) for q in np.percentile(df["worker_time_ratio"], [5, 95]))
    if "speed_ratio" in df:
        out["speed_ratio_p5"], out["speed_ratio_p95"] = (
            float(q) for q in np.percentile(df["speed_ratio"], [5, 95]))
        out["speed_corr_err_latency_ms_p50"] = (
            float(np.corrcoef(df["speed_ratio"], df["err_latency_ms_p50"])[0, 1])
            if len(df) > 2 else math.nan)
    worst = df.loc[df["err_latency_ms_p99"].abs().idxmax()]
    out["worst"] = {k: (v.item() if hasattr(v, "item") else v) for k, v in worst[[
        "max_batch_size", "max_wait_ms", "load", "rate_rps", "err_latency_ms_p50",
        "err_latency_ms_p99", "err_throughput_rps"]].items()}
    return out


def plot_fidelity(df, fig=None):
    """Simulated against real latency, p50 and p99, one point per configuration.

    Points on the diagonal are perfect predictions; the band is +-10%. Where the grid was
    repeated (``floor_err_*``), grey crosses show the real batcher's second run against
    its first. Returns the matplotlib ``Figure`` (a new one unless ``fig`` is given).
    """
    from matplotlib.figure import Figure

    fig = fig if fig is not None else Figure(figsize=(11, 4.8), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, q in zip(axes, ("p50", "p99"), strict=True):
        real, sim = df[f"real_latency_ms_{q}"], df[f"sim_latency_ms_{q}"]
        lo, hi = min(real.min(), sim.min()) / 1.5, max(real.max(), sim.max()) * 1.5
        line = np.geomspace(lo, hi, 50)
        ax.fill_between(line, line * 0.9, line * 1.1, color="0.9", label="within 10%")
        ax.plot(line, line, color="0.5", lw=1)
        if f"floor_err_latency_ms_{q}" in df:
            again = real * (1 + df[f"floor_err_latency_ms_{q}"])
            ax.scatter(real, again, marker="x", color="0.55", label="real, run again")
        for mw, part in df.groupby("max_wait_ms"):
            ax.scatter(part[f"real_latency_ms_{q}"], part[f"sim_latency_ms_{q}"],
                       s=20 + 60 * part["load"], label=f"max_wait_ms={mw:g}")
        ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi),
               xlabel=f"real {q} latency (ms)", ylabel=f"simulated {q} latency (ms)",
               title=f"{q}: simulated vs real (size: load)")
        ax.legend(fontsize="small")
    return fig
