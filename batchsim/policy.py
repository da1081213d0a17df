"""The batching policy and the one dispatch rule that every engine shares.

The rule (see DESIGN.md): waiting requests form one FIFO queue. A batch leaves at the
earliest instant ``t`` at which a worker is free, the queue is non-empty, and

* the queue holds ``max_batch_size`` requests (size trigger), or
* ``t >= arrival(oldest) + max_wait`` (timeout trigger), or
* the arrival stream is closed (flush).

The batch is the first ``min(len(queue), max_batch_size)`` waiting requests; requests
that have waited longer than ``timeout_ms`` when the batch is formed are dropped from
the queue as expired first; an arrival that finds ``max_queue_size`` requests waiting
is rejected. An arrival at the very instant of a dispatch joins it if there is room.

Two conventions make the rule exact where events coincide, and every engine follows
them: (1) at one instant, arrivals are handled before the dispatch decision, so an
arrival is checked against ``max_queue_size`` with the queue as it stood (it can be
rejected even though a batch leaving at that same instant would have had room for it);
(2) expiry is checked only when a batch is formed, so a request that has outstayed
``timeout_ms`` still counts as waiting (towards the size trigger and the queue bound)
until then; a batch whose size trigger fired may then leave smaller, or not at all.

The SimPy engine, the fast engine and the real asyncio batcher all decide with the
functions below, so the rule lives in exactly one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import _check

#: Why a batch left: the queue reached max_batch_size, the oldest request waited
#: max_wait_ms, or the stream was closed and a partial batch was flushed.
SIZE, TIMEOUT, FLUSH = 0, 1, 2
TRIGGER_NAMES = ("size", "timeout", "flush")


@dataclass(frozen=True)
class BatchPolicy:
    """When to close a batch: ``max_batch_size`` requests or ``max_wait_ms`` of waiting.

    ``max_wait_ms=0`` is greedy batching, ``max_wait_ms=inf`` fixed-size batching and
    ``max_batch_size=1`` no batching. ``max_queue_size`` bounds the waiting queue
    (arrivals beyond it are rejected); with ``max_wait_ms=inf`` it must hold a full batch.
    ``timeout_ms`` drops requests that waited longer than that before their batch was
    formed; ``timeout_ms=0`` keeps only a request dispatched at the instant it arrives
    (in a simulation, one that finds a worker free and a trigger met; the real batcher
    takes microseconds to dispatch, so there it keeps practically none).
    """

    max_batch_size: int
    max_wait_ms: float
    max_queue_size: int | None = None
    timeout_ms: float | None = None

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "max_batch_size", _check.positive_int("max_batch_size", self.max_batch_size))
        set_(self, "max_wait_ms",
             _check.non_negative("max_wait_ms", self.max_wait_ms, allow_inf=True))
        if self.max_queue_size is not None:
            set_(self, "max_queue_size",
                 _check.positive_int("max_queue_size", self.max_queue_size))
        if self.timeout_ms is not None:
            set_(self, "timeout_ms", _check.non_negative("timeout_ms", self.timeout_ms))
        if (math.isinf(self.max_wait_ms) and self.max_queue_size is not None
                and self.max_queue_size < self.max_batch_size):
            # Neither trigger could ever fire: every request would wait for the stream's close.
            raise ValueError(
                f"max_queue_size={self.max_queue_size} is below max_batch_size="
                f"{self.max_batch_size} with max_wait_ms=inf: the queue can never hold a full "
                f"batch and no timer closes one, so no batch would leave before the stream "
                f"closes; make max_queue_size at least {self.max_batch_size} or max_wait_ms "
                f"finite")

    @property
    def max_wait_s(self) -> float:
        return self.max_wait_ms / 1000.0

    @property
    def timeout_s(self) -> float:
        return math.inf if self.timeout_ms is None else self.timeout_ms / 1000.0


def dispatch_time_s(policy: BatchPolicy, free_s: float, oldest_arrival_s: float,
                    full_arrival_s: float = math.inf, close_s: float = math.inf) -> float:
    """The instant the next batch leaves, by the rule, if nothing else changes.

    ``free_s``: when a worker is (or becomes) free; ``oldest_arrival_s``: arrival of the
    oldest waiting request; ``full_arrival_s``: arrival of the request that makes the
    queue ``max_batch_size`` long (``inf`` while it is shorter); ``close_s``: when the
    stream closes (``inf`` while open). An engine that knows the future (the fast
    engine) passes future instants; an online one (SimPy, the real batcher) passes what
    it knows now and dispatches when the answer is ``<= now``. Works elementwise on
    numpy arrays too (the fast engine asks for every possible head of the queue at once).
    """
    least, most = ((np.minimum, np.maximum) if isinstance(oldest_arrival_s, np.ndarray)
                   else (min, max))
    trigger_s = least(least(full_arrival_s, oldest_arrival_s + policy.max_wait_s), close_s)
    return most(free_s, trigger_s)


def trigger(policy: BatchPolicy, now_s: float, n_waiting: int, oldest_arrival_s: float) -> int:
    """Which trigger let a batch formed at ``now_s`` go: SIZE, TIMEOUT, else FLUSH.

    Works elementwise on numpy arrays too (the fast engine labels all its batches at once).
    """
    full = n_waiting >= policy.max_batch_size
    late = now_s >= oldest_arrival_s + policy.max_wait_s
    return _pick(full, SIZE, _pick(late, TIMEOUT, FLUSH))


def _pick(cond, if_true, if_false):
    """``if_true if cond else if_false``, elementwise when ``cond`` is a numpy array."""
    if isinstance(cond, np.ndarray):
        return np.where(cond, if_true, if_false)
    return if_true if cond else if_false


def batch_size(policy: BatchPolicy, n_waiting: int) -> int:
    """How many waiting requests the next batch takes."""
    return min(n_waiting, policy.max_batch_size)


def rejects(policy: BatchPolicy, n_waiting: int) -> bool:
    """Whether an arrival that finds ``n_waiting`` requests waiting is turned away."""
    return policy.max_queue_size is not None and n_waiting >= policy.max_queue_size


def expired(policy: BatchPolicy, arrival_s, now_s):
    """Whether a request that arrived at ``arrival_s`` has waited too long at ``now_s``.

    Works elementwise on numpy arrays. Strictly longer than ``timeout_ms`` expires.
    """
    return (now_s - arrival_s) > policy.timeout_s
