"""Arrival processes: each turns a seeded generator into sorted arrival times in seconds.

Every workload has ``arrivals_s(n, rng)`` (the first ``n`` arrival instants, sorted,
starting after time 0), ``rate_rps`` (its long-run mean rate) and ``with_rate(rate_rps)``
(the same shape of traffic scaled to another mean rate, used by sweeps over load).

The processes whose rate varies in time (Bursty, Ramp, Diurnal) are drawn by a change of
time: a unit-rate Poisson process of "expected arrivals" ``w_1 < w_2 < ...`` mapped
through the inverse of the cumulative rate ``W(t)``, the expected arrivals by ``t``. It is
exact (no thinning), and a seed gives the same ``w`` at every rate: ``with_rate(f * r)``
multiplies ``W`` by ``f``, so from load to load the arrivals move, they are not drawn anew
(common random numbers, as for Poisson and Gamma).
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from . import _check


class Workload:
    """Base class: subclasses implement ``arrivals_s`` and ``rate_rps``."""

    rate_rps: float

    def arrivals_s(self, n: int, rng: np.random.Generator) -> np.ndarray:
        raise NotImplementedError

    def with_rate(self, rate_rps: float) -> Workload:
        """This workload with every rate scaled so that the mean rate is ``rate_rps``."""
        rate_rps = _check.positive("rate_rps", rate_rps)
        if not 0 < self.rate_rps < math.inf:
            raise ValueError(f"{self!r} has no finite mean rate to scale to rate_rps="
                             f"{rate_rps!r}: its arrivals fall at one instant")
        factor = rate_rps / self.rate_rps
        return self._scaled(factor)

    def _scaled(self, factor: float) -> Workload:
        return replace(self, rate_rps=self.rate_rps * factor)


def _n(n) -> int:
    return _check.positive_int("n_requests", n)


def _validate(workload: Workload, check, *names: str) -> None:
    """Replace each field ``name`` of a frozen workload by ``check(name, value)``."""
    for name in names:
        object.__setattr__(workload, name, check(name, getattr(workload, name)))


@dataclass(frozen=True)
class Poisson(Workload):
    """Poisson arrivals: exponential gaps with mean ``1 / rate_rps``."""

    rate_rps: float

    def __post_init__(self):
        _validate(self, _check.positive, "rate_rps")

    def arrivals_s(self, n, rng):
        return np.cumsum(rng.exponential(1.0 / self.rate_rps, _n(n)))


@dataclass(frozen=True)
class Constant(Workload):
    """Evenly spaced arrivals, one every ``1 / rate_rps`` seconds (the first at ``1 / rate``)."""

    rate_rps: float

    def __post_init__(self):
        _validate(self, _check.positive, "rate_rps")

    def arrivals_s(self, n, rng):
        return np.arange(1, _n(n) + 1) / self.rate_rps


#: The smallest coefficient of variation ``Gamma`` takes: its gaps are then constant to a
#: millionth, and far below it the gamma shape ``1 / cv**2`` overflows (cv under 1e-154).
MIN_CV = 1e-6
#: The largest: at cv 100 (shape 1e-4) already 93% of the gaps are below 1e-300 s, so
#: the requests come in a few clumps at one instant each (and past cv 1e154 the shape
#: ``1 / cv**2`` underflows to 0).
MAX_CV = 100.0


@dataclass(frozen=True)
class Gamma(Workload):
    """Renewal arrivals with gamma gaps: mean ``1 / rate_rps``, coefficient of variation ``cv``.

    ``cv=1`` is Poisson, ``cv<1`` smoother, ``cv>1`` burstier.
    """

    rate_rps: float
    cv: float = 1.0

    def __post_init__(self):
        _validate(self, _check.positive, "rate_rps", "cv")
        if self.cv < MIN_CV:
            raise ValueError(f"cv must be at least {MIN_CV} (evenly spaced arrivals are "
                             f"Constant), got {self.cv!r}")
        if self.cv > MAX_CV:
            raise ValueError(f"cv must be at most {MAX_CV:g} (beyond, nearly every gap is "
                             f"0 in floating point), got {self.cv!r}")

    def arrivals_s(self, n, rng):
        shape = 1.0 / self.cv**2
        return np.cumsum(rng.gamma(shape, 1.0 / (self.rate_rps * shape), _n(n)))


@dataclass(frozen=True)
class Bursty(Workload):
    """Two-state Markov-modulated Poisson process (MMPP): on/off bursts.

    The source alternates between an *on* state (Poisson at ``on_rate_rps``) and an
    *off* state (Poisson at ``off_rate_rps``, possibly 0), staying in each for an
    exponential time with mean ``mean_on_s`` / ``mean_off_s``. It starts in a state
    drawn from the stationary distribution. Each spell costs a draw, arrival or not, so
    ``arrivals_s`` refuses (``ValueError``) a run that would take over
    ``MAX_BURSTY_SPELLS`` of them: spells holding a tiny fraction of an arrival each.
    """

    on_rate_rps: float
    off_rate_rps: float
    mean_on_s: float
    mean_off_s: float

    def __post_init__(self):
        _validate(self, _check.positive, "on_rate_rps")
        _validate(self, _check.non_negative, "off_rate_rps")
        _validate(self, _check.positive, "mean_on_s", "mean_off_s")

    @property
    def _on_share(self) -> float:
        """The long-run fraction of time in the on state."""
        return self.mean_on_s / (self.mean_on_s + self.mean_off_s)

    @property
    def rate_rps(self) -> float:
        share = self._on_share
        return share * self.on_rate_rps + (1 - share) * self.off_rate_rps

    def _scaled(self, factor):
        return replace(self, on_rate_rps=self.on_rate_rps * factor,
                       off_rate_rps=self.off_rate_rps * factor)

    def _check_spells_for(self, n: int) -> None:
        """Refuse spells so short, or rates so low, that ``n`` arrivals would take more
        than ``MAX_BURSTY_SPELLS`` spells to draw (each spell costs the same, arrival or
        not: a cycle holding a millionth of an arrival meant a run that never ended)."""
        per_cycle = self.rate_rps * (self.mean_on_s + self.mean_off_s)   # arrivals a cycle
        spells = 2 * n / per_cycle if per_cycle > 0 else math.inf
        if spells > MAX_BURSTY_SPELLS:
            raise ValueError(
                f"{self!r} expects {per_cycle:.3g} arrivals per on/off cycle "
                f"(on_rate_rps x mean_on_s + off_rate_rps x mean_off_s), so n_requests={n} "
                f"would take about {spells:.3g} spells to draw, over the {MAX_BURSTY_SPELLS:.3g} "
                f"allowed: raise the arrivals per cycle (a longer spell at a rate above 0, "
                f"or a higher rate; with_rate to a low load scales the rates down too). "
                f"Spells far shorter than the gaps between arrivals average out: that is "
                f"Poisson(rate_rps={self.rate_rps:.6g})")

    def arrivals_s(self, n, rng):
        n = _n(n)
        self._check_spells_for(n)
        work = _unit_poisson(n, rng)
        on = rng.random() < self._on_share          # the state of the first spell
        out, done, spells = np.empty(work.size), 0, _SPELLS
        t0_s = w0 = 0.0
        while done < work.size:
            # A block of spells, alternating from the state ``on``: their lengths, rates
            # and the expected arrivals by each one's start. The blocks grow, so that
            # traffic of far less than an arrival a spell still takes few of them.
            state_on = np.arange(spells) % 2 == (0 if on else 1)
            dwell_s = rng.standard_exponential(spells) * np.where(
                state_on, self.mean_on_s, self.mean_off_s)
            rate = np.where(state_on, self.on_rate_rps, self.off_rate_rps)
            start_s = t0_s + np.r_[0.0, np.cumsum(dwell_s)[:-1]]
            start_w = w0 + np.r_[0.0, np.cumsum(rate * dwell_s)[:-1]]
            end_w = start_w[-1] + rate[-1] * dwell_s[-1]
            stop = done + int(np.searchsorted(work[done:], end_w, "right"))
            # Each arrival in this block, in the spell where W reaches it (a spell without
            # arrivals, W flat, is never chosen: its start equals the next one's).
            k = np.searchsorted(start_w, work[done:stop], "left") - 1
            out[done:stop] = start_s[k] + (work[done:stop] - start_w[k]) / rate[k]
            done, t0_s, w0 = stop, start_s[-1] + dwell_s[-1], end_w
            spells = min(2 * spells, _MAX_SPELLS)
        return out


#: ``Diurnal``'s table of its cumulative rate over a period, and the Newton steps from
#: it: the table puts each arrival within a step of it (a 4096th of a period) of its
#: instant, and the steps bring W there to float resolution (the tests check 1e-9).
_TABLE, _NEWTON_STEPS = 4096, 3
#: Spells ``Bursty`` draws in its first block, and at most in one (even numbers, so each
#: block starts in the same state as the first; the draws do not depend on the blocks).
_SPELLS, _MAX_SPELLS = 4096, 1 << 20
#: The most spells ``Bursty`` expects to draw for one run, about ten seconds of drawing
#: (some 40 ns a spell on a laptop core); more is refused rather than left to run.
MAX_BURSTY_SPELLS = 1 << 28


def _unit_poisson(n: int, rng: np.random.Generator) -> np.ndarray:
    """The first ``n`` points of a Poisson process of rate 1: the expected arrivals by
    each arrival of any process, mapped to time by its cumulative rate (module docstring)."""
    return np.cumsum(rng.standard_exponential(n))


@dataclass(frozen=True)
class Ramp(Workload):
    """Poisson arrivals whose rate moves linearly from ``start_rps`` to ``end_rps``.

    The rate changes over ``duration_s`` and then stays at ``end_rps``.
    ``rate_rps`` (the mean used for load scaling) is the mean over the ramp.
    """

    start_rps: float
    end_rps: float
    duration_s: float

    def __post_init__(self):
        _validate(self, _check.positive, "start_rps", "end_rps", "duration_s")

    @property
    def rate_rps(self) -> float:
        return 0.5 * (self.start_rps + self.end_rps)

    def _scaled(self, factor):
        return replace(self, start_rps=self.start_rps * factor, end_rps=self.end_rps * factor)

    def rate_at(self, t_s):
        frac = np.clip(np.asarray(t_s, dtype=float) / self.duration_s, 0.0, 1.0)
        return self.start_rps + (self.end_rps - self.start_rps) * frac

    def arrivals_s(self, n, rng):
        work = _unit_poisson(_n(n), rng)
        top = max(self.start_rps, self.end_rps)
        s, e, d = self.start_rps / top, self.end_rps / top, self.duration_s
        ramp_w = 0.5 * (self.start_rps + self.end_rps) * d   # expected arrivals over the ramp
        # On the ramp W(t) = top (s t + (e - s) t^2 / (2 d)), rates in units of the top
        # one (no overflow squaring them); its root, in the form without cancellation
        # (also for e = s): t = 2 u / (s + sqrt(s^2 + 2 (e - s) u / d)), u = w / top.
        u = np.minimum(work, ramp_w) / top
        t_s = 2 * u / (s + np.sqrt(np.maximum(s * s + 2 * (e - s) * u / d, 0.0)))
        return np.where(work <= ramp_w, t_s, d + (work - ramp_w) / self.end_rps)


@dataclass(frozen=True)
class Diurnal(Workload):
    """Poisson arrivals with a sinusoidal rate: ``rate_rps * (1 + amplitude*sin(2πt/period_s))``.

    A compressed day: traffic swings between ``(1 - amplitude)`` and ``(1 + amplitude)``
    times the mean.
    """

    rate_rps: float
    amplitude: float = 0.5
    period_s: float = 60.0

    def __post_init__(self):
        _validate(self, _check.positive, "rate_rps")
        a = _check.non_negative("amplitude", self.amplitude)
        if a > 1:
            raise ValueError(f"amplitude must be between 0 and 1, got {self.amplitude!r}")
        object.__setattr__(self, "amplitude", a)
        _validate(self, _check.positive, "period_s")

    def rate_at(self, t_s):
        phase = 2 * math.pi * np.asarray(t_s, dtype=float) / self.period_s
        return self.rate_rps * (1 + self.amplitude * np.sin(phase))

    def expected_arrivals(self, t_s):
        """``W(t)``, the expected arrivals by ``t_s``: the rate's integral from 0."""
        t = np.asarray(t_s, dtype=float)
        swing = self.amplitude * self.period_s / (2 * math.pi)
        return self.rate_rps * (t + swing * (1 - np.cos(2 * math.pi * t / self.period_s)))

    def arrivals_s(self, n, rng):
        work = _unit_poisson(_n(n), rng)
        # W grows by rate * period each period: solve W(t) = w within one, from a table
        # of W over it (linear between its points, within a step of the root), then by
        # Newton's steps kept in that step (the rate may touch 0, Newton's step fail).
        per_period = self.rate_rps * self.period_s
        periods = np.floor(work / per_period)
        w = work - periods * per_period
        grid_t = np.linspace(0.0, self.period_s, _TABLE + 1)
        grid_w = self.expected_arrivals(grid_t)
        step = np.clip(np.searchsorted(grid_w, w, "right") - 1, 0, _TABLE - 1)
        lo, hi = grid_t[step], grid_t[step + 1]
        t = np.interp(w, grid_w, grid_t)
        for _ in range(_NEWTON_STEPS):
            with np.errstate(divide="ignore", invalid="ignore"):
                newton = t - (self.expected_arrivals(t) - w) / self.rate_at(t)
            t = np.where(np.isfinite(newton), np.clip(newton, lo, hi), t)
        return periods * self.period_s + t


class Trace(Workload):
    """Arrival times given explicitly (seconds, sorted, finite, non-negative).

    ``arrivals_s(n)`` returns the first ``n`` times (all of them when ``n`` is None);
    the seed is not used. ``Trace.from_csv(path)`` reads one column of times. Its
    ``rate_rps`` is measured from the first arrival to the last (one over the mean gap),
    and ``with_rate`` scales the gaps, the first arrival staying where it is: a trace
    whose clock does not start at 0 (say at 3600 s) keeps its rate and its load.
    """

    def __init__(self, times_s):
        try:
            given = np.asarray(times_s)
        except (TypeError, ValueError):   # a ragged sequence
            given = np.array(None)
        if given.dtype.kind == "M":
            raise ValueError(f"times_s must be seconds or timedeltas, got instants of "
                             f"{given.dtype} (subtract the first: times - times[0])")
        if given.dtype.kind == "m":       # timedeltas (pandas' times less the first): seconds
            given = given / np.timedelta64(1, "s")
        times = _check.float_array(given)
        if times is None or times.ndim != 1:
            raise ValueError(f"times_s must be a one-dimensional sequence of numbers "
                             f"(seconds), got {times_s!r:.80}")
        if times.size == 0:
            raise ValueError("times_s must hold at least one arrival, got an empty trace")
        if not np.all(np.isfinite(times)):
            raise ValueError(f"times_s must be finite, got {times[~np.isfinite(times)][:3]!r}")
        if times[0] < 0:
            raise ValueError(f"times_s must be non-negative, got {times[0]!r}")
        if np.any(np.diff(times) < 0):
            i = int(np.argmax(np.diff(times) < 0))
            raise ValueError(f"times_s must be sorted, got {times[i]!r} before {times[i + 1]!r}")
        times.setflags(write=False)
        self.times_s = times

    def __repr__(self):
        return f"Trace({self.times_s.size} arrivals over {self.times_s[-1]:.6g} s)"

    def __len__(self):
        return self.times_s.size

    @property
    def rate_rps(self) -> float:
        span_s = self.times_s[-1] - self.times_s[0]
        return (self.times_s.size - 1) / span_s if span_s > 0 else math.inf

    def _scaled(self, factor):
        first_s = self.times_s[0]
        return Trace(first_s + (self.times_s - first_s) / factor)

    def arrivals_s(self, n=None, rng=None):
        if n is None:
            return self.times_s.copy()
        n = _n(n)
        if n > self.times_s.size:
            raise ValueError(f"n_requests must be at most the trace length {self.times_s.size}, "
                             f"got {n}")
        return self.times_s[:n].copy()

    @classmethod
    def from_csv(cls, path, column: str | int = 0) -> Trace:
        """Read arrival times in seconds from a CSV column (by header name or index)."""
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"path must be a file path, got {path!r}")
        if isinstance(column, bool) or not isinstance(column, (str, int)):
            raise ValueError(f"column must be a header name or an index, got {column!r}")
        if not Path(path).is_file():
            raise ValueError(f"path {str(path)!r} is not a file")
        try:   # utf-8-sig: a spreadsheet's "CSV UTF-8" starts with a byte-order mark
            with open(Path(path), newline="", encoding="utf-8-sig") as f:
                rows = list(csv.reader(f))
        except UnicodeDecodeError as e:
            raise ValueError(f"path {str(path)!r} is not UTF-8 text: {e}") from None
        if not rows:
            raise ValueError(f"path {str(path)!r} holds no rows")
        header, body = rows[0], rows[1:]
        try:
            float(header[column if isinstance(column, int) else 0])
            body, header = rows, None  # no header row
        except (ValueError, IndexError):
            pass
        if isinstance(column, str):
            if header is None or column not in header:
                raise ValueError(f"column {column!r} not found in {str(path)!r}")
            column = header.index(column)
        if any(r and not -len(r) <= column < len(r) for r in body):
            raise ValueError(f"path {str(path)!r} has rows without a column {column!r}")
        try:
            return cls([float(r[column]) for r in body if r])
        except ValueError as e:
            raise ValueError(f"path {str(path)!r}: column {column!r} is not all numbers "
                             f"({e})") from e
