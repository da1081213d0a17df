"""RunResult: what happened to every request and every batch in one run.

The simulator engines and the real batcher all return this type, so every summary,
plot and comparison works on both. Per-request arrays are in arrival order; times of
requests that were rejected or expired are NaN. Per-batch arrays are in dispatch order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import _check
from .policy import TRIGGER_NAMES

#: FAILED (real batcher only): never served -- the model raised on it, its caller
#: cancelled it, or the batcher closed without draining.
COMPLETED, REJECTED, EXPIRED, FAILED = 0, 1, 2, 3
STATUS_NAMES = ("completed", "rejected", "expired", "failed")
#: Latency percentiles that ``RunResult.summary`` reports (``latency_ms_p50``, ...).
PERCENTILES = (50, 90, 95, 99)


@dataclass(eq=False)
class RunResult:
    """Per-request and per-batch records of one run.

    Per request (arrival order): ``arrival_s``, ``dispatch_s`` (its batch left),
    ``finish_s`` (its batch finished), ``batch_id`` (index into the batch arrays, -1 if
    none), ``status`` (COMPLETED / REJECTED / EXPIRED / FAILED codes, names in STATUS_NAMES) and
    ``dequeue_s`` (when it left the waiting queue: dispatch, expiry, or its arrival if
    rejected; used for queue lengths). Per batch (dispatch order): ``start_s``,
    ``end_s``, ``size``, ``worker`` and ``trigger`` (policy.SIZE / TIMEOUT / FLUSH).
    """

    arrival_s: np.ndarray
    dispatch_s: np.ndarray
    finish_s: np.ndarray
    batch_id: np.ndarray
    status: np.ndarray
    dequeue_s: np.ndarray
    start_s: np.ndarray
    end_s: np.ndarray
    size: np.ndarray
    worker: np.ndarray
    trigger: np.ndarray
    workers: int = 1
    meta: dict = field(default_factory=dict)

    # -- derived per-request views -------------------------------------------------
    @property
    def latency_s(self) -> np.ndarray:
        """Arrival to finish (NaN unless completed)."""
        return self.finish_s - self.arrival_s

    @property
    def wait_s(self) -> np.ndarray:
        """Arrival to dispatch: time spent queued (NaN unless completed)."""
        return self.dispatch_s - self.arrival_s

    @property
    def batch_sizes(self) -> np.ndarray:
        return self.size

    @property
    def n_requests(self) -> int:
        return self.arrival_s.size

    @property
    def n_batches(self) -> int:
        return self.size.size

    # -- summaries -----------------------------------------------------------------
    def summary(self, slo_ms: float | None = None, warmup_frac: float = 0.0) -> dict:
        """Headline numbers, optionally skipping the first ``warmup_frac`` of requests.

        Throughput counts completed requests over the window from the first kept arrival
        to the last kept finish (or the last arrival, if later: rejected and expired
        requests end the run too); utilization is busy time over ``workers`` times that
        window (also per worker). With ``slo_ms``, ``goodput`` is the share of kept
        requests (rejected and expired ones included) that completed within the SLO, and
        ``goodput_rps`` their rate.
        """
        warm = _check.non_negative("warmup_frac", warmup_frac)
        if warm >= 1:
            raise ValueError(f"warmup_frac must be below 1, got {warmup_frac!r}")
        first = int(warm * self.n_requests)
        status = self.status[first:]
        done = status == COMPLETED
        lat_ms = 1000.0 * self.latency_s[first:][done]
        t0 = self.arrival_s[first] if self.n_requests > first else 0.0
        finishes = self.finish_s[first:][done]
        t1 = max(finishes.max() if finishes.size else t0,
                 self.arrival_s[-1] if self.n_requests else t0)
        span_s = t1 - t0
        in_window = self.start_s >= t0
        busy = np.clip(self.end_s, t0, t1) - np.clip(self.start_s, t0, t1)
        per_worker = np.bincount(self.worker, weights=busy, minlength=self.workers)
        per_worker = per_worker / span_s if span_s > 0 else np.zeros(self.workers)

        # One partition for all percentiles (sweeps summarise hundreds of runs).
        at = (np.percentile(lat_ms, PERCENTILES).tolist() if lat_ms.size
              else [float("nan")] * len(PERCENTILES))

        out = {
            "throughput_rps": float(done.sum() / span_s) if span_s > 0 else float("nan"),
            "latency_ms_mean": float(lat_ms.mean()) if lat_ms.size else float("nan"),
            **{f"latency_ms_p{q}": v for q, v in zip(PERCENTILES, at, strict=True)},
            "latency_ms_max": float(lat_ms.max()) if lat_ms.size else float("nan"),
            "mean_batch_size": (float(self.size[in_window].mean()) if in_window.any()
                                else float("nan")),
            "utilization": float(per_worker.mean()),
            "utilization_per_worker": per_worker.tolist(),
            "n_requests": int(status.size),
            "n_completed": int(done.sum()),
            "n_rejected": int((status == REJECTED).sum()),
            "n_expired": int((status == EXPIRED).sum()),
            "n_failed": int((status == FAILED).sum()),
        }
        if slo_ms is not None:
            slo = _check.positive("slo_ms", slo_ms)
            good = int((lat_ms <= slo).sum())
            out["slo_ms"] = slo
            out["goodput"] = good / status.size if status.size else float("nan")
            out["goodput_rps"] = float(good / span_s) if span_s > 0 else float("nan")
        return out

    def queue_length(self) -> tuple[np.ndarray, np.ndarray]:
        """Number of requests waiting as a right-continuous step series ``(times_s, n)``.

        ``n[i]`` holds from ``times_s[i]`` until ``times_s[i+1]``. Arrivals at an instant
        count before the departures at that instant; rejected requests never wait.
        """
        queued = self.status != REJECTED
        ups = self.arrival_s[queued]
        downs = self.dequeue_s[queued]
        times = np.concatenate([ups, downs])
        steps = np.concatenate([np.ones(ups.size, np.int64), -np.ones(downs.size, np.int64)])
        order = np.lexsort((-steps, times))
        times, steps = times[order], steps[order]
        n = np.cumsum(steps)
        last = np.ones(times.size, bool)                # each instant's last step
        last[:-1] = times[1:] != times[:-1]
        return times[last], n[last]

    def to_pandas(self):
        """``(requests, batches)`` as pandas DataFrames, times in seconds."""
        import pandas as pd

        requests = pd.DataFrame({
            "arrival_s": self.arrival_s, "dispatch_s": self.dispatch_s,
            "finish_s": self.finish_s, "latency_s": self.latency_s, "wait_s": self.wait_s,
            "batch_id": self.batch_id,
            "status": pd.Categorical.from_codes(self.status, STATUS_NAMES),
        })
        batches = pd.DataFrame({
            "start_s": self.start_s, "end_s": self.end_s, "size": self.size,
            "worker": self.worker,
            "trigger": pd.Categorical.from_codes(self.trigger, TRIGGER_NAMES),
        })
        return requests, batches


class RunRecorder:
    """Collects a run as it happens and freezes it into a RunResult.

    Engines and the real batcher call ``reject``, ``expire`` and ``dispatch`` in the
    order things happen; ``result()`` builds the arrays.
    """

    def __init__(self, arrival_s: np.ndarray, workers: int):
        n = arrival_s.size
        self.arrival_s = arrival_s
        self.workers = workers
        self.dispatch_s = np.full(n, np.nan)
        self.finish_s = np.full(n, np.nan)
        self.dequeue_s = np.full(n, np.nan)
        self.batch_id = np.full(n, -1, np.int64)
        self.status = np.full(n, COMPLETED, np.int8)
        self._batches: list[tuple] = []

    def reject(self, i: int) -> None:
        self.status[i] = REJECTED
        self.dequeue_s[i] = self.arrival_s[i]

    def expire(self, ids, now_s: float) -> None:
        self.status[ids] = EXPIRED
        self.dequeue_s[ids] = now_s

    def fail(self, ids, now_s: float) -> None:
        """Requests never served (FAILED); those not dispatched left the queue at ``now_s``."""
        self.status[ids] = FAILED
        self.finish_s[ids] = np.nan
        self.dequeue_s[ids] = np.where(np.isnan(self.dequeue_s[ids]), now_s, self.dequeue_s[ids])

    @property
    def n_batches(self) -> int:
        return len(self._batches)

    def dispatch(self, ids, start_s: float, end_s: float, worker: int, trigger: int) -> int:
        """Record a batch of request indices ``ids``; returns its batch id."""
        k = len(self._batches)
        self._batches.append((start_s, end_s, len(ids), worker, trigger))
        self.dispatch_s[ids] = start_s
        self.dequeue_s[ids] = start_s
        self.finish_s[ids] = end_s
        self.batch_id[ids] = k
        return k

    def result(self, **meta) -> RunResult:
        cols = list(zip(*self._batches, strict=True)) if self._batches else [[]] * 5
        return RunResult(
            arrival_s=self.arrival_s, dispatch_s=self.dispatch_s, finish_s=self.finish_s,
            batch_id=self.batch_id, status=self.status, dequeue_s=self.dequeue_s,
            start_s=np.asarray(cols[0], float), end_s=np.asarray(cols[1], float),
            size=np.asarray(cols[2], np.int64), worker=np.asarray(cols[3], np.int64),
            trigger=np.asarray(cols[4], np.int8), workers=self.workers, meta=meta)
