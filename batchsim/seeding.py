"""One seed, independent streams: arrivals and service jitter each get their own child.

Both engines (and the real load generator) draw arrival times from the first child and
service-time jitter from the second, so the same seed gives the same run everywhere,
request for request.
"""

from __future__ import annotations

import numbers

import numpy as np


def streams(seed) -> tuple[np.random.Generator, np.random.Generator]:
    """``(arrival_rng, service_rng)`` for ``seed`` (an int >= 0 or a ``SeedSequence``).

    The two children are the ones a fresh ``SeedSequence`` of ``seed`` would spawn first,
    made without spawning: a ``SeedSequence`` passed in is left as it was, so passing it
    again gives the same run (``spawn`` would move it on to new children each time).
    They are its first two children whether or not it has spawned them already: to give
    runs seeds of their own, pass each run one of ``root.spawn(n)``, not ``root`` beside
    children of it used elsewhere.
    """
    if not isinstance(seed, np.random.SeedSequence) and (
            isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0):
        raise ValueError(f"seed must be an integer >= 0 or a SeedSequence, got {seed!r}")
    ss = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
    arrival_ss, service_ss = (
        np.random.SeedSequence(ss.entropy, spawn_key=(*ss.spawn_key, i), pool_size=ss.pool_size)
        for i in (0, 1))
    return np.random.default_rng(arrival_ss), np.random.default_rng(service_ss)
