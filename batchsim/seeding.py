"""One seed, independent streams: arrivals and service jitter each get their own child.

Both engines (and the real load generator) draw arrival times from the first child and
service-time jitter from the second, so the same seed gives the same run everywhere,
request for request.
"""

from __future__ import annotations

import numbers

import numpy as np


def streams(seed) -> tuple[np.random.Generator, np.random.Generator]:
    """``(arrival_rng, service_rng)`` for ``seed`` (an int >= 0 or a ``SeedSequence``)."""
    if not isinstance(seed, np.random.SeedSequence) and (
            isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0):
        raise ValueError(f"seed must be an integer >= 0 or a SeedSequence, got {seed!r}")
    ss = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
    arrival_ss, service_ss = ss.spawn(2)
    return np.random.default_rng(arrival_ss), np.random.default_rng(service_ss)
