"""Service-time models ``s(b)``: how long one batch of ``b`` requests keeps a worker busy.

``AffineService`` is ``base + per_item * b``; ``ProfileService`` interpolates a measured
table (piecewise linear, extrapolated linearly past the largest measured size). Both
can add multiplicative lognormal jitter with mean 1 and a given coefficient of
variation. Profiles save to and load from JSON with their provenance (device, model,
dtype, torch version, date); measured ones ship in ``batchsim/data/profiles/``.
``CalibratedService`` (what ``batchsim.calibrate`` returns) wraps a model's ``s(b)`` with
the real batcher's own costs (``BatcherCosts``), which the simulation engines apply.
"""

from __future__ import annotations

import json
import math
import os
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from . import _check


class ServiceModel:
    """Base class: subclasses define ``mean_ms(b)``; jitter and capacity come from here."""

    jitter_cv: float

    def mean_ms(self, batch_size):
        """Mean service time in ms of a batch of ``batch_size`` (scalar or array)."""
        raise NotImplementedError

    def mean_s(self, batch_size):
        return self.mean_ms(batch_size) / 1000.0

    def jitter_factors(self, rng: np.random.Generator, n: int) -> np.ndarray | None:
        """``n`` multiplicative factors, lognormal with mean 1 and CV ``jitter_cv``.

        ``None`` when there is no jitter (and then no random numbers are drawn). Engines
        draw these once, up front, and use the k-th for the k-th batch dispatched.
        """
        if self.jitter_cv == 0:
            return None
        sigma2 = math.log1p(self.jitter_cv**2)
        return rng.lognormal(-0.5 * sigma2, math.sqrt(sigma2), n)

    def capacity_rps(self, max_batch_size: int, workers: int = 1) -> float:
        """Saturation throughput: ``workers * b / s(b)`` with every batch full (mean times)."""
        b = _check.positive_int("max_batch_size", max_batch_size)
        w = _check.positive_int("workers", workers)
        return w * b / float(self.mean_s(b))

    def save(self, path) -> None:
        """Write this model as JSON (``load_service`` reads it back)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


@dataclass(frozen=True)
class AffineService(ServiceModel):
    """``s(b) = base_ms + per_item_ms * b``: a fixed launch cost plus a cost per request."""

    base_ms: float
    per_item_ms: float
    jitter_cv: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "base_ms", _check.non_negative("base_ms", self.base_ms))
        object.__setattr__(self, "per_item_ms",
                           _check.non_negative("per_item_ms", self.per_item_ms))
        object.__setattr__(self, "jitter_cv", _check.non_negative("jitter_cv", self.jitter_cv))
        if self.base_ms + self.per_item_ms == 0:
            raise ValueError("base_ms and per_item_ms must not both be 0 (s(1) would be 0)")

    def mean_ms(self, batch_size):
        return self.base_ms + self.per_item_ms * np.asarray(batch_size, dtype=float)

    def to_dict(self) -> dict:
        return {"kind": "affine", "base_ms": self.base_ms, "per_item_ms": self.per_item_ms,
                "jitter_cv": self.jitter_cv}


def _set_metadata(service) -> None:
    """Keep a copy of ``service.metadata``, which must be a dict (it is saved as JSON)."""
    if not isinstance(service.metadata, dict):
        raise ValueError(f"metadata must be a dict, got {service.metadata!r}")
    object.__setattr__(service, "metadata", dict(service.metadata))


@dataclass(frozen=True, eq=False)
class ProfileService(ServiceModel):
    """A measured ``s(b)`` table, linear between points and past the last one.

    ``batch_sizes`` strictly increasing integers >= 1, ``times_ms`` positive. Below the
    smallest and above the largest measured size the nearest segment is extended
    (clipped to stay positive). ``metadata`` records where the numbers came from.
    """

    batch_sizes: tuple
    times_ms: tuple
    jitter_cv: float = 0.0
    metadata: dict = field(default_factory=dict)

    def __post_init__(self):
        sizes = [_check.positive_int("batch_sizes", b)   # as given: True is not a size
                 for b in np.atleast_1d(np.asarray(self.batch_sizes, dtype=object)).tolist()]
        times = [_check.positive("times_ms", t)
                 for t in _numbers("times_ms", self.times_ms).tolist()]
        if not sizes:
            raise ValueError("batch_sizes must not be empty, got []")
        if len(sizes) != len(times):
            raise ValueError(f"times_ms must have one entry per batch size: "
                             f"{len(sizes)} sizes, got {len(times)} times")
        if any(b2 <= b1 for b1, b2 in zip(sizes, sizes[1:], strict=False)):
            raise ValueError(f"batch_sizes must be strictly increasing, got {sizes}")
        object.__setattr__(self, "batch_sizes", tuple(sizes))
        object.__setattr__(self, "times_ms", tuple(times))
        object.__setattr__(self, "jitter_cv", _check.non_negative("jitter_cv", self.jitter_cv))
        _set_metadata(self)

    def __eq__(self, other):
        return (isinstance(other, ProfileService) and self.to_dict() == other.to_dict())

    def __hash__(self):
        return hash((self.batch_sizes, self.times_ms, self.jitter_cv))

    def mean_ms(self, batch_size):
        out = _piecewise_linear(batch_size, self.batch_sizes, self.times_ms)
        return np.maximum(out, min(self.times_ms) * 1e-3)

    def to_dict(self) -> dict:
        return {"kind": "profile", "batch_sizes": list(self.batch_sizes),
                "times_ms": list(self.times_ms), "jitter_cv": self.jitter_cv,
                "metadata": self.metadata}


def _piecewise_linear(x, xs, ys) -> np.ndarray:
    """The table ``ys`` over ``xs`` at ``x``: interpolated linearly, extrapolated along
    its first and last segments (constant with one point)."""
    x, xs, ys = np.asarray(x, float), np.asarray(xs, float), np.asarray(ys, float)
    if xs.size == 1:
        return np.full_like(x, ys[0])
    below = ys[0] + (ys[1] - ys[0]) / (xs[1] - xs[0]) * (x - xs[0])
    above = ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (x - xs[-1])
    return np.where(x < xs[0], below, np.where(x > xs[-1], above, np.interp(x, xs, ys)))


#: ``BatcherCosts`` fields that are tables, checked on their own.
_TABLES = ("idle_ms", "wake_ms", "release_spread_ms", "release_sizes", "release_table_ms")
#: ``BatcherCosts`` fields that may be None (what the engines then do instead: a reaction for
#: the linger, ``arrival_ms`` for every request of a later turn).
_OPTIONAL = ("linger_ms", "turn_ms")


@dataclass(frozen=True)
class BatcherCosts:
    """What a real batcher on an event loop adds around the model, as the simulator runs it.

    With these costs the engines decide only when the loop is awake, as the real batcher
    does: ``react_ms`` after each arrival (the callback it schedules runs once the code
    that submitted it yields), when a worker is released, and when a timer fires. A
    worker stays busy ``release_ms + release_per_item_ms * b`` after its batch's requests
    finish, on average (its results are handed back on the loop before it may take the
    next batch), or, measured, a table over batch sizes (``release_sizes``,
    ``release_table_ms``; linear in the size between and beyond its points, as a
    profile's ``s(b)``, and never below 0): on one CPU the tiny CNN's release took 32 us
    after a batch of one, 48 us after two and 88 us after 52, the encoder's 66 us after
    26 and 45 us after 64, which no line follows (``bench/results/README.md``). Each
    batch's release deviates from that by a draw from
    ``release_spread_ms`` (quantiles at evenly spaced probabilities from 0 to 1; empty:
    none): on one CPU a tenth of the tiny MLP's releases took about 10 us and half over
    24 us, and the batch after follows (below).
    A timer due at ``T``, armed when the loop last went to sleep at ``s``, fires at
    ``s + ceil((T - s) / timer_resolution_ms) * timer_resolution_ms +
    timer_latency_ms``: asyncio's epoll selector rounds every sleep up to whole
    milliseconds, counted from the moment the loop goes to sleep, and the operating
    system wakes the thread a little later still. Each arrival while a batch runs delays
    it by ``arrival_ms``: the loop's work for that request needs the interpreter (the
    GIL) or the core the worker needs (``calibrate`` fits it per request the batcher
    received during a batch, as every engine counts them). The first such arrival delays
    it by ``first_arrival_ms`` more: the loop's turn that hands requests over (the load
    generator resumes, lets go of the finished requests, sends what is due and re-arms
    its sleep) costs several requests' own work. On one CPU, the worker picked a batch
    up 20-26 us later when one request came in right after its dispatch than when none
    did (the tiny MLP, CNN and encoder), and each further request added about 1-8 us
    (``bench/bench_batch_residuals.py``). A worker that went without a batch for a while
    is slower to get going (its thread has gone to sleep, its caches are cold): the
    batch takes ``wake_ms`` longer, a table over ``idle_ms``, the time from the end of
    the worker's previous batch to this one's dispatch, release included (interpolated
    in the logarithm of that time, flat beyond its ends). On one CPU the step is steep:
    a tiny MLP's batch dispatched within 10 us of the previous one's end started at
    once, one dispatched 15-20 us after it ran about 40 us longer. A turn of a load
    generator on the loop (``simulate(..., sender="loop")``) asks the batcher for a
    decision only when the worker is free and the queue was empty or the turn fills it;
    after any other turn, most often one while a batch runs, the loop sleeps
    ``linger_ms`` after it (a request falling due by then goes out in a turn of its own
    without a sleep; a later one waits for the loop's next wake-up, most often the
    batch's end); ``None``: a reaction, ``react_ms``, as after a turn that asks for a
    decision. A turn sends its requests one after another, ``send_ms`` apart (the
    loop's work for each), each as it falls due by then; and a dispatch of ``b`` holds
    the loop ``hold_ms + hold_per_item_ms * b`` before its next step (the worker's thread
    takes the interpreter to gather its batch). On one CPU, over 27 grids' calibrations
    of the tiny models, the loop lingered 3.8-5.0 us (reactions: 10.3-16.4 us), sent a
    request every 0.70-1.19 us and was held 2.9-9.4 us plus 0-0.29 us per request after
    a dispatch (``bench/results/turns_paired_cpu.json``). A later turn into a running
    batch, after the first that brought it requests, delays it by ``turn_ms`` and each
    request it brings by ``send_ms`` rather than ``arrival_ms``; None: every request
    received costs ``arrival_ms``. In the calibration's runs a turn into a batch brings
    a request or two, so ``arrival_ms`` carries a turn's cost; in a burst's backlog a turn
    brings dozens. On one CPU the real batches of 64 cost 1.0-2.0 us per request
    received, about ``send_ms``, where ``arrival_ms`` was up to 5.5 us
    (``bench/results/README.md``). All zero: the ideal batcher.
    """

    react_ms: float = 0.0
    release_ms: float = 0.0
    release_per_item_ms: float = 0.0
    timer_resolution_ms: float = 0.0
    timer_latency_ms: float = 0.0
    arrival_ms: float = 0.0
    idle_ms: tuple = ()
    wake_ms: tuple = ()
    first_arrival_ms: float = 0.0
    release_spread_ms: tuple = ()
    release_sizes: tuple = ()
    release_table_ms: tuple = ()
    linger_ms: float | None = None
    send_ms: float = 0.0
    hold_ms: float = 0.0
    hold_per_item_ms: float = 0.0
    turn_ms: float | None = None

    def __post_init__(self):
        for name in self.__dataclass_fields__:
            if name not in _TABLES and not (name in _OPTIONAL and getattr(self, name) is None):
                object.__setattr__(self, name, _check.non_negative(name, getattr(self, name)))
        self._set_table("release_sizes", "release_table_ms")
        if self.release_sizes and (self.release_ms or self.release_per_item_ms):
            raise ValueError(f"give the release as a line (release_ms={self.release_ms}, "
                             f"release_per_item_ms={self.release_per_item_ms}) or as a "
                             f"table (release_sizes, release_table_ms), not both")
        spread = _numbers("release_spread_ms", self.release_spread_ms)
        if spread.size and (spread.size < 2 or not np.all(np.isfinite(spread))
                            or np.any(np.diff(spread) < 0)):
            raise ValueError(f"release_spread_ms must be at least two finite, non-decreasing "
                             f"numbers, got {self.release_spread_ms!r}")
        object.__setattr__(self, "release_spread_ms", tuple(spread.tolist()))
        self._set_table("idle_ms", "wake_ms")

    def _set_table(self, x_name: str, y_name: str) -> None:
        """Check a table (``x_name``: positive, strictly increasing; ``y_name``: one
        non-negative value per point) and keep it as tuples of floats."""
        x = tuple(_check.positive(x_name, v)
                  for v in _numbers(x_name, getattr(self, x_name)).tolist())
        y = tuple(_check.non_negative(y_name, v)
                  for v in _numbers(y_name, getattr(self, y_name)).tolist())
        if len(x) != len(y):
            raise ValueError(f"{y_name} must have one entry per {x_name}: {len(x)} points, "
                             f"got {len(y)}")
        if any(b <= a for a, b in zip(x, x[1:], strict=False)):
            raise ValueError(f"{x_name} must be strictly increasing, got {x}")
        object.__setattr__(self, x_name, x)
        object.__setattr__(self, y_name, y)

    @property
    def react_s(self) -> float:
        return self.react_ms / 1000.0

    def hold_s(self, batch_size: int) -> float:
        """How long a dispatch of ``batch_size`` holds the loop before its next step (the
        worker's thread gathers the batch holding the interpreter)."""
        return (self.hold_ms + self.hold_per_item_ms * batch_size) / 1000.0

    @property
    def linger_s(self) -> float:
        """How long the loop stays awake after a sender's turn while a batch runs."""
        return self.react_s if self.linger_ms is None else self.linger_ms / 1000.0

    def release_s(self, batch_size):
        """How long a worker stays busy after its batch of ``batch_size`` finished, on
        average."""
        if self.release_sizes:
            return np.maximum(_piecewise_linear(batch_size, self.release_sizes,
                                                self.release_table_ms), 0.0) / 1e3
        return (self.release_ms + self.release_per_item_ms * np.asarray(batch_size, float)) / 1e3

    def release_deviations_s(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` draws (s) from ``release_spread_ms``, one per batch in dispatch order, to
        add to ``release_s`` (the sum taken as at least 0); zeros without a spread."""
        spread = np.asarray(self.release_spread_ms)
        if not spread.size:
            return np.zeros(n)
        return quantile_at(spread, rng.random(n)) / 1e3

    def wake_s(self, idle_s: float) -> float:
        """Extra time of a batch whose worker sat idle ``idle_s`` before it (``wake_ms``)."""
        idle, wake = self.idle_ms, self.wake_ms
        if not idle:
            return 0.0
        x = idle_s * 1000.0
        if x <= idle[0]:
            return wake[0] / 1000.0
        if x >= idle[-1]:
            return wake[-1] / 1000.0
        i = bisect_right(idle, x)
        f = math.log(x / idle[i - 1]) / math.log(idle[i] / idle[i - 1])
        return (wake[i - 1] + f * (wake[i] - wake[i - 1])) / 1000.0

    def end_s(self, start_s: float, service_s: float, arrival_s: list,
              idle_s: float = math.inf) -> float:
        """When a batch that needs ``service_s`` from ``start_s`` ends: slower by
        ``wake_s(idle_s)`` after ``idle_s`` of idleness, delayed by the arrivals (sorted
        ``arrival_s``) strictly between its start and its end (``arrival_ms`` each, and
        ``first_arrival_ms`` once if there are any)."""
        service_s = service_s + self.wake_s(idle_s)
        end_s = start_s + service_s
        if self.arrival_ms == 0 and self.first_arrival_ms == 0:
            return end_s
        first, during = bisect_right(arrival_s, start_s), 0
        while (now_during := bisect_left(arrival_s, end_s, first) - first) != during:
            during = now_during
            end_s = (start_s + service_s
                     + (self.first_arrival_ms + self.arrival_ms * during) / 1000.0)
        return end_s

    def timer_fire_s(self, armed_s: float, due_s: float) -> float:
        """When a timer due at ``due_s``, armed as the loop slept at ``armed_s``, fires.

        A timer already due then fires at once: the loop does not go to sleep at all.
        """
        if math.isinf(due_s):
            return math.inf
        if due_s <= armed_s:
            return armed_s
        g = self.timer_resolution_ms / 1000.0
        fire_s = max(armed_s + g * math.ceil((due_s - armed_s) / g), due_s) if g > 0 else due_s
        return fire_s + self.timer_latency_ms / 1000.0

    def to_dict(self) -> dict:
        return {name: (list(v) if isinstance(v := getattr(self, name), tuple) else v)
                for name in self.__dataclass_fields__}


@dataclass(frozen=True, eq=False)
class CalibratedService(ServiceModel):
    """A model's own ``s(b)`` plus what a real batcher adds: what ``calibrate`` returns.

    A typical batch of ``b`` keeps its worker ``model.mean_ms(b) + per_batch_ms +
    per_item_ms * b`` (handing the batch to the worker thread, stacking the inputs,
    splitting the outputs); a batch's actual time is that times a ratio drawn from the
    measured spread: ``jitter_quantiles`` are quantiles of the measured ratio (time /
    typical time) at evenly spaced probabilities from 0 to 1 (empty: no spread). The
    mean time ``mean_ms(b)`` is the typical time times the mean ratio (above 1 when the
    slow batches outweigh the fast ones); the jitter factors are the ratios over it.
    ``costs`` are the event loop's own delays (``BatcherCosts``), applied by both
    simulation engines.
    """

    model: ServiceModel
    per_batch_ms: float = 0.0
    per_item_ms: float = 0.0
    jitter_quantiles: tuple = ()
    costs: BatcherCosts = field(default_factory=BatcherCosts)
    metadata: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.model, ServiceModel):
            raise ValueError(f"model must be a service model, got {self.model!r}")
        if not isinstance(self.costs, BatcherCosts):
            raise ValueError(f"costs must be BatcherCosts, got {self.costs!r}")
        object.__setattr__(self, "per_batch_ms", _check.non_negative("per_batch_ms",
                                                                     self.per_batch_ms))
        object.__setattr__(self, "per_item_ms", _check.non_negative("per_item_ms",
                                                                    self.per_item_ms))
        q = _numbers("jitter_quantiles", self.jitter_quantiles)
        if q.size and (q.size < 2 or not np.all(np.isfinite(q)) or q[0] <= 0
                       or np.any(np.diff(q) < 0)):
            raise ValueError(f"jitter_quantiles must be at least two positive, finite, "
                             f"non-decreasing numbers, got {self.jitter_quantiles!r}")
        object.__setattr__(self, "jitter_quantiles", tuple(q.tolist()))
        _set_metadata(self)

    def __eq__(self, other):
        return isinstance(other, CalibratedService) and self.to_dict() == other.to_dict()

    def __hash__(self):
        return hash((self.per_batch_ms, self.per_item_ms, self.jitter_quantiles, self.costs))

    @property
    def jitter_mean(self) -> float:
        """Mean of the measured ratio (1 without a spread)."""
        q = np.asarray(self.jitter_quantiles)
        return _quantile_moment(q, 1) if q.size else 1.0

    @property
    def jitter_cv(self) -> float:
        """Coefficient of variation of the measured ratio (a piecewise-linear quantile
        function through ``jitter_quantiles``)."""
        q = np.asarray(self.jitter_quantiles)
        if not q.size:
            return 0.0
        return float(math.sqrt(max(_quantile_moment(q, 2) / self.jitter_mean**2 - 1.0, 0.0)))

    def mean_ms(self, batch_size):
        b = np.asarray(batch_size, dtype=float)
        typical_ms = self.model.mean_ms(b) + self.per_batch_ms + self.per_item_ms * b
        return self.jitter_mean * typical_ms

    def jitter_factors(self, rng: np.random.Generator, n: int) -> np.ndarray | None:
        """``n`` factors of mean 1 drawn from the measured spread (inverse CDF), ``None``
        without one."""
        q = np.asarray(self.jitter_quantiles)
        if not q.size:
            return None
        return quantile_at(q / self.jitter_mean, rng.random(n))

    def capacity_rps(self, max_batch_size: int, workers: int = 1) -> float:
        """Saturation throughput of full batches, the batcher's costs included.

        A worker's cycle ``C`` is its batch's time ``S`` plus the release ``r``; at
        saturation ``b`` requests arrive per cycle (``workers`` cycles share them), and
        those arriving during the batch stretch it by ``arrival`` each (and the first by
        ``first_arrival`` more, folded into ``s(b)``):
        ``S = s(b) + arrival * (workers * b / C) * S``. Solved for ``C``. The release and
        the wake-up after it are averaged over the release's spread.
        """
        b = _check.positive_int("max_batch_size", max_batch_size)
        w = _check.positive_int("workers", workers)
        costs = self.costs
        # The release's distribution, by the midpoints of 1000 equal slices of probability.
        spread = np.asarray(costs.release_spread_ms or (0.0, 0.0))
        slices = (np.arange(_SLICES) + 0.5) / _SLICES
        releases_s = np.maximum(float(costs.release_s(b)) + quantile_at(spread, slices) / 1e3,
                                0.0)
        r = float(releases_s.mean())
        # Back to back: the worker went without a batch for its release; and every
        # batch receives requests, the first costlier.
        wake_s = float(np.mean([costs.wake_s(x) for x in releases_s]))
        s = float(self.mean_s(b)) + wake_s + costs.first_arrival_ms / 1e3
        c = costs.arrival_ms / 1000.0 * w * b            # stretch per unit of 1/C
        # C**2 - (s + r + c) C + r c = 0, the larger root (C > c).
        cycle_s = 0.5 * (s + r + c + math.sqrt((s + r + c) ** 2 - 4 * r * c))
        return w * b / cycle_s

    def to_dict(self) -> dict:
        return {"kind": "calibrated", "model": self.model.to_dict(),
                "per_batch_ms": self.per_batch_ms, "per_item_ms": self.per_item_ms,
                "jitter_quantiles": list(self.jitter_quantiles),
                "costs": self.costs.to_dict(), "metadata": self.metadata}


#: Slices of probability over which ``capacity_rps`` averages the release.
_SLICES = 1000


def quantile_at(q, p):
    """The value at probability ``p`` of a distribution given by quantiles ``q`` at evenly
    spaced probabilities from 0 to 1 (piecewise linear between them), as the spreads of
    a calibration are kept."""
    q = np.asarray(q, float)
    return np.interp(p, np.linspace(0.0, 1.0, q.size), q)


def _numbers(name: str, values) -> np.ndarray:
    """``values`` (numbers, or one number) as a flat array of floats (the checks of their
    order and range are the caller's); else a ``ValueError`` naming ``name``."""
    q = _check.float_array(values)
    if q is None or q.ndim > 1:
        raise ValueError(f"{name} must be a sequence of numbers, got {values!r}")
    return q.ravel()


def _quantile_moment(q: np.ndarray, power: int) -> float:
    """``E[X]`` (power 1) or ``E[X**2]`` (power 2) of a variable whose quantile function is
    piecewise linear through ``q`` at evenly spaced probabilities (exact, segment by
    segment: a segment from ``x`` to ``y`` is uniform on it)."""
    x, y = q[:-1], q[1:]
    if power == 1:
        return float(np.mean((x + y) / 2))
    return float(np.mean((x * x + x * y + y * y) / 3))


def service_from_dict(d: dict) -> ServiceModel:
    """Rebuild a service model from ``to_dict()`` output; a ``ValueError`` names a key
    that is missing."""
    if not isinstance(d, dict):
        raise ValueError(f"a service model is a dict with a 'kind', got {d!r:.80}")
    try:
        return _service_from_dict(d)
    except KeyError as e:
        raise ValueError(f"a service model of kind {d.get('kind')!r} needs the key "
                         f"{e.args[0]!r}, got keys {sorted(d)}") from None


def _service_from_dict(d: dict) -> ServiceModel:
    kind = d.get("kind")
    if kind == "affine":
        return AffineService(d["base_ms"], d["per_item_ms"], d.get("jitter_cv", 0.0))
    if kind == "profile":
        return ProfileService(d["batch_sizes"], d["times_ms"], d.get("jitter_cv", 0.0),
                              d.get("metadata", {}))
    if kind == "calibrated":
        costs, known = d["costs"], set(BatcherCosts.__dataclass_fields__)
        if not isinstance(costs, dict) or not set(costs) <= known:
            raise ValueError(f"costs must be a dict of {sorted(known)}, got {costs!r:.200}")
        return CalibratedService(service_from_dict(d["model"]), d["per_batch_ms"],
                                 d["per_item_ms"], d["jitter_quantiles"],
                                 BatcherCosts(**costs), d.get("metadata", {}))
    raise ValueError(f"kind must be 'affine', 'profile' or 'calibrated', got {kind!r}")


def load_service(path) -> ServiceModel:
    """Read a service model saved with ``save``: a path, or the name of a shipped profile
    (a bare name such as ``"h200_encoder_bfloat16"``; a path with a folder is only a
    path). A missing or unreadable file raises ``ValueError`` naming it."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a file path or a shipped profile's name, got {path!r}")
    p = Path(path)
    if not p.exists():
        shipped = resources.files("batchsim") / "data" / "profiles" / f"{p.stem}.json"
        if p.name != str(path) or p.suffix not in ("", ".json") or not shipped.is_file():
            raise ValueError(f"path {str(path)!r} is neither a file nor a shipped profile "
                             f"(shipped: {shipped_profiles()})")
        return service_from_dict(json.loads(shipped.read_text()))
    if not p.is_file():
        raise ValueError(f"path {str(path)!r} is not a file")
    try:
        return service_from_dict(json.loads(p.read_text()))
    except json.JSONDecodeError as e:
        raise ValueError(f"path {str(path)!r} holds no service model JSON: {e}") from None
    except ValueError as e:
        raise ValueError(f"path {str(path)!r}: {e}") from None


def shipped_profiles() -> list[str]:
    """Names of the measured profiles that ship with batchsim."""
    folder = resources.files("batchsim") / "data" / "profiles"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))
