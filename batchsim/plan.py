"""``recommend``: the batching policy and worker count that meet a latency SLO.

The question Triton's Model Analyzer answers by measuring for hours -- which
``max_batch_size``, ``max_wait_ms`` and how many model instances keep p99 latency within
the SLO at my traffic -- answered in seconds by a sweep of the fast engine over a grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _check
from .policy import BatchPolicy
from .result import PERCENTILES  # the latency percentiles recommend can hold to an SLO
from .sweep import sweep

#: Default waits to try, as fractions of the SLO (0 is greedy batching).
WAIT_FRACTIONS = (0.0, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2)


@dataclass(frozen=True, eq=False)
class Recommendation:
    """What ``recommend`` found.

    ``policy`` and ``workers`` are the choice (None when nothing meets the SLO);
    ``latency_ms`` its latency at ``percentile`` and ``throughput_rps`` its throughput;
    ``runner_ups`` the next feasible configurations, best first; ``evidence`` every
    configuration tried (averaged over seeds) with ``capacity_rps`` and ``meets_slo``;
    ``reason`` says in plain words what was chosen, or why nothing was.
    """

    policy: BatchPolicy | None
    workers: int | None
    slo_ms: float
    percentile: float
    latency_ms: float
    throughput_rps: float
    runner_ups: object
    evidence: object
    reason: str

    @property
    def met(self) -> bool:
        """Whether some configuration meets the SLO."""
        return self.policy is not None

    def __str__(self) -> str:
        return self.reason


def recommend(workload, service, slo_ms: float, percentile: float = 99, workers=(1, 2, 4),
              max_batch_size=(1, 2, 4, 8, 16, 32, 64, 128), max_wait_ms=None,
              n_requests: int | None = 50_000, seeds=(0,), n_runner_ups: int = 3, engine="auto",
              executor=None, progress: bool = True) -> Recommendation:
    """The policy and worker count that keep ``percentile`` latency within ``slo_ms``.

    Every combination of ``max_batch_size`` x ``max_wait_ms`` x ``workers`` is simulated
    at the workload's own rate (``seeds`` runs each, averaged; the first 10% of each run
    is left out as warm-up). A configuration *meets the SLO* when its latency at
    ``percentile`` is at most ``slo_ms`` and the offered rate is below its capacity (so
    the queue does not grow without bound). Each of those serves every request, so their
    throughputs differ only by when a finite run's last batch ends: the choice has the
    fewest workers, then the lowest latency. ``max_wait_ms`` defaults to 0 and 1/32 ...
    1/2 of the SLO. ``n_requests`` per run; None runs a ``Trace`` whole.
    """
    slo = _check.positive("slo_ms", slo_ms)
    if percentile not in PERCENTILES:
        raise ValueError(f"percentile must be one of {list(PERCENTILES)}, got {percentile!r}")
    n_runner_ups = _check.non_negative_int("n_runner_ups", n_runner_ups)
    waits = [f * slo for f in WAIT_FRACTIONS] if max_wait_ms is None else max_wait_ms
    runs = sweep(workload, service, max_batch_size, waits, workers=workers, seeds=seeds,
                 n_requests=n_requests, engine=engine, executor=executor, progress=progress,
                 warmup_frac=0.1)
    latency = f"latency_ms_p{percentile:g}"
    keys = ["max_batch_size", "max_wait_ms", "workers"]
    ev = (runs.groupby(keys, sort=False)
          .agg(rate_rps=("rate_rps", "first"), latency_ms=(latency, "mean"),
               throughput_rps=("throughput_rps", "mean"),
               mean_batch_size=("mean_batch_size", "mean"),
               utilization=("utilization", "mean"))
          .reset_index())
    ev["capacity_rps"] = [service.capacity_rps(b, w)
                          for b, w in zip(ev["max_batch_size"], ev["workers"], strict=True)]
    ev["meets_slo"] = (ev["latency_ms"] <= slo) & (ev["rate_rps"] < ev["capacity_rps"])
    ev = _ranked(ev.rename(columns={"latency_ms": latency}), latency)

    feasible = ev[ev["meets_slo"]]
    if feasible.empty:
        return Recommendation(None, None, slo, percentile, float("nan"), float("nan"),
                              feasible, ev, _why_not(ev, service, slo, percentile, latency))
    best = feasible.iloc[0]
    policy = BatchPolicy(int(best["max_batch_size"]), float(best["max_wait_ms"]))
    reason = (f"max_batch_size={policy.max_batch_size}, max_wait_ms={policy.max_wait_ms:g} "
              f"with {int(best['workers'])} worker(s): p{percentile:g} latency "
              f"{best[latency]:.3g} ms <= SLO {slo:g} ms at {best['throughput_rps']:.4g} "
              f"requests/s ({len(feasible)} of {len(ev)} configurations meet the SLO)")
    return Recommendation(policy, int(best["workers"]), slo, percentile, float(best[latency]),
                          float(best["throughput_rps"]),
                          feasible.iloc[1:1 + n_runner_ups].reset_index(drop=True), ev, reason)


def _ranked(ev, latency):
    """Feasible first: fewest workers, lowest latency, then smaller batches and waits;
    then the rest by latency."""
    feasible = ev["meets_slo"].to_numpy()
    order = np.lexsort((ev["max_wait_ms"], ev["max_batch_size"], ev[latency].to_numpy(),
                        np.where(feasible, ev["workers"], 0), ~feasible))
    return ev.iloc[order].reset_index(drop=True)


def _why_not(ev, service, slo, percentile, latency) -> str:
    """Plain words for why no configuration meets the SLO."""
    sizes = np.arange(1, int(ev["max_batch_size"].max()) + 1)
    times_ms = service.mean_ms(sizes)
    fastest_ms = float(np.min(times_ms))
    rate = float(ev["rate_rps"].iloc[0])
    biggest = ev.loc[ev["capacity_rps"].idxmax()]
    if slo < fastest_ms:
        return (f"nothing meets the SLO: {slo:g} ms is below the service time of one batch "
                f"(at least {fastest_ms:.3g} ms, for a batch of "
                f"{int(sizes[np.argmin(times_ms)])}), so no policy can meet it")
    if rate >= biggest["capacity_rps"]:
        return (f"nothing meets the SLO: over capacity -- the offered {rate:.4g} requests/s "
                f"exceed the most this grid can serve, {biggest['capacity_rps']:.4g} requests/s "
                f"(max_batch_size={int(biggest['max_batch_size'])}, "
                f"workers={int(biggest['workers'])}); add workers or allow larger batches")
    closest = ev.loc[ev[latency].idxmin()]
    return (f"nothing meets the SLO: the lowest p{percentile:g} latency in the grid is "
            f"{closest[latency]:.3g} ms > {slo:g} ms (max_batch_size="
            f"{int(closest['max_batch_size'])}, max_wait_ms={closest['max_wait_ms']:g}, "
            f"workers={int(closest['workers'])}); try more workers or a looser SLO")
