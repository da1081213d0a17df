"""``simulate()``: run the dispatch rule on a workload with a service model.

Engines: ``"simpy"`` (the readable discrete-event reference, ``des.py``), ``"fast"``
(the same runs, request for request, one loop step per batch: ``fast.py``) and
``"auto"``, the default: fast, unless the run needs something only SimPy does exactly
(fast raises NotImplementedError naming it). SimPy is imported only when a SimPy run
happens, so ``import batchsim`` stays light.
"""

from __future__ import annotations

import numpy as np

from .. import _check
from ..policy import BatchPolicy
from ..result import RunResult
from ..seeding import streams
from ..service import ServiceModel
from ..workload import Trace, Workload

ENGINES = ("auto", "fast", "simpy")


def simulate(workload: Workload, policy: BatchPolicy, service: ServiceModel,
             n_requests: int | None = None, workers: int = 1, seed=0,
             engine: str = "auto", sender: str | None = None) -> RunResult:
    """Simulate ``n_requests`` arrivals of ``workload`` served under ``policy``.

    ``seed`` (an int >= 0 or a ``numpy.random.SeedSequence``) fixes the arrivals and
    the service jitter, each from its own child stream: the same seed gives the same
    run on every engine. ``n_requests`` may be left out for a ``Trace`` (all of it).
    ``engine``: ``"auto"`` (fast where it can, else SimPy), ``"fast"`` or ``"simpy"``.

    ``sender``: ``None``, requests reach the batcher at the workload's instants;
    ``"loop"``, with a calibrated service (``CalibratedService``, whose costs model the
    batcher's event loop): the instants are when a load generator on the batcher's own
    event loop -- as ``batchsim.real.run_load`` -- is due to send them, and each reaches
    the batcher only when the loop wakes for it (its millisecond timer grid, or a
    batch's release). The result's ``arrival_s`` are when they reached it, as the real
    batcher records them; ``meta["sent_s"]`` the workload's instants. The fast engine
    simulates it, for one worker without ``max_queue_size`` or ``timeout_ms``.
    """
    if not isinstance(workload, Workload):
        raise ValueError(f"workload must be a batchsim workload (Poisson, Trace, ...), "
                         f"got {workload!r}")
    if not isinstance(policy, BatchPolicy):
        raise ValueError(f"policy must be a BatchPolicy, got {policy!r}")
    if not isinstance(service, ServiceModel):
        raise ValueError(f"service must be a service model (AffineService, ProfileService), "
                         f"got {service!r}")
    if n_requests is None and not isinstance(workload, Trace):
        raise ValueError(f"n_requests is required for a {type(workload).__name__} workload, "
                         f"got None")
    workers = _check.positive_int("workers", workers)
    _check.one_of("engine", engine, ENGINES)
    if sender not in (None, "loop"):
        raise ValueError(f"sender must be None or 'loop', got {sender!r}")
    costs = getattr(service, "costs", None)   # a calibrated batcher's own delays
    if sender is not None:
        if costs is None:
            raise ValueError(f"sender='loop' needs a calibrated service (the batcher's event "
                             f"loop costs), got {service!r}")
        if engine == "simpy":
            raise ValueError("sender='loop' is simulated by the fast engine: use "
                             "engine='auto' or 'fast', got engine='simpy'")

    arrival_rng, service_rng = streams(seed)
    arrival_s = np.ascontiguousarray(workload.arrivals_s(n_requests, arrival_rng), dtype=float)
    # Mean time per batch size, up to the largest batch this run can form (a policy
    # whose max_batch_size means "no cap" must not cost a table that large).
    largest = min(policy.max_batch_size, arrival_s.size)
    batch_time_s = np.asarray(service.mean_s(np.arange(largest + 1)), float)
    jitter = service.jitter_factors(service_rng, arrival_s.size)
    release_dev_s = (None if costs is None
                     else costs.release_deviations_s(service_rng, arrival_s.size))

    res = None
    if engine != "simpy":
        from . import fast

        try:
            res = fast.run(arrival_s, policy, batch_time_s, jitter, workers, costs, sender,
                           release_dev_s)
        except NotImplementedError as e:
            if sender is not None:
                raise ValueError(f"sender='loop' with workers={workers} and {policy!r}: {e}") \
                    from None
            if engine == "fast":
                raise
    if res is None:
        from . import des

        res = des.run(arrival_s, policy, batch_time_s, jitter, workers, costs, release_dev_s)
    res.meta.update(workload=repr(workload), policy=policy, service=service, seed=seed)
    return res
