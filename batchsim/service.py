"""Service-time models ``s(b)``: how long one batch of ``b`` requests keeps a worker busy.

``AffineService`` is ``base + per_item * b``; ``ProfileService`` interpolates a measured
table (piecewise linear, extrapolated linearly past the largest measured size). Both
can add multiplicative lognormal jitter with mean 1 and a given coefficient of
variation. Profiles save to and load from JSON with their provenance (device, model,
dtype, torch version, date); measured ones ship in ``batchsim/data/profiles/``.
"""

from __future__ import annotations

import json
import math
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
        sizes = [_check.positive_int("batch_sizes", b)
                 for b in np.asarray(self.batch_sizes).tolist()]
        times = [_check.positive("times_ms", t)
                 for t in np.asarray(self.times_ms, float).tolist()]
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
        object.__setattr__(self, "metadata", dict(self.metadata))

    def __eq__(self, other):
        return (isinstance(other, ProfileService) and self.to_dict() == other.to_dict())

    def __hash__(self):
        return hash((self.batch_sizes, self.times_ms, self.jitter_cv))

    def mean_ms(self, batch_size):
        b = np.asarray(batch_size, dtype=float)
        sizes, times = np.asarray(self.batch_sizes, float), np.asarray(self.times_ms, float)
        if sizes.size == 1:
            return np.full_like(b, times[0])
        inside = np.interp(b, sizes, times)
        lo_slope = (times[1] - times[0]) / (sizes[1] - sizes[0])
        hi_slope = (times[-1] - times[-2]) / (sizes[-1] - sizes[-2])
        below = times[0] + lo_slope * (b - sizes[0])
        above = times[-1] + hi_slope * (b - sizes[-1])
        out = np.where(b < sizes[0], below, np.where(b > sizes[-1], above, inside))
        return np.maximum(out, min(times) * 1e-3)

    def to_dict(self) -> dict:
        return {"kind": "profile", "batch_sizes": list(self.batch_sizes),
                "times_ms": list(self.times_ms), "jitter_cv": self.jitter_cv,
                "metadata": self.metadata}


def service_from_dict(d: dict) -> ServiceModel:
    """Rebuild a service model from ``to_dict()`` output."""
    kind = d.get("kind")
    if kind == "affine":
        return AffineService(d["base_ms"], d["per_item_ms"], d.get("jitter_cv", 0.0))
    if kind == "profile":
        return ProfileService(d["batch_sizes"], d["times_ms"], d.get("jitter_cv", 0.0),
                              d.get("metadata", {}))
    raise ValueError(f"kind must be 'affine' or 'profile', got {kind!r}")


def load_service(path) -> ServiceModel:
    """Read a service model saved with ``save`` (a path, or the name of a shipped profile)."""
    p = Path(path)
    if not p.exists():
        shipped = resources.files("batchsim") / "data" / "profiles" / f"{Path(path).stem}.json"
        if not shipped.is_file():
            raise ValueError(f"path {str(path)!r} is neither a file nor a shipped profile "
                             f"(shipped: {shipped_profiles()})")
        return service_from_dict(json.loads(shipped.read_text()))
    return service_from_dict(json.loads(p.read_text()))


def shipped_profiles() -> list[str]:
    """Names of the measured profiles that ship with batchsim."""
    folder = resources.files("batchsim") / "data" / "profiles"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))
