"""Exact mean latency for the special cases the simulator must reproduce.

Arrivals are Poisson with rate ``rate_rps`` (lambda); ``s(k)`` is the mean service time
of a batch of ``k`` (``service.mean_s(k)``); latency runs from arrival to the end of the
request's batch. Every function returns a :class:`Prediction` (mean latency, mean wait,
mean batch size), except :func:`inoue_bound_s`, which is a bound.

=========================================  ===========================================
policy (and workers)                        result
=========================================  ===========================================
``max_batch_size=1``, one worker            :func:`no_batching` (M/G/1, Pollaczek-Khinchine)
``max_wait_ms=0``, one worker               :func:`greedy_batching` (exact chain)
``max_wait_ms=0``, unbounded, affine s      :func:`greedy_batching` with ``None``;
                                            closed-form bound :func:`inoue_bound_s`
``max_wait_ms=inf``, one worker             :func:`fixed_size_batching` (bulk queue)
any ``max_wait_ms``, ample workers          :func:`timeout_batching_ample_workers`
=========================================  ===========================================

:func:`predict` picks the right one for a one-worker policy; :func:`stable` and
:func:`max_stable_rate_rps` give the capacity ``workers * b / s(b)``.

**One chain for the one-worker batch queues.** Greedy batching (take up to ``b`` as soon
as one waits) and fixed-size batching (wait for ``b``) are the two ends of Neuts'
*general bulk-service rule* ``(a, b)``: a free worker starts a batch once ``a`` requests
wait and takes ``min(queue, b)`` of them (Neuts, "A general class of bulk queues with
Poisson input", Ann. Math. Statist. 38, 1967; Bailey, J. R. Stat. Soc. B 16, 1954, for
``a = b``). Greedy is ``a = 1``, fixed-size ``a = b``. Let ``Q_n >= a`` be the number
waiting when batch ``n`` starts; it takes ``k = min(Q_n, b)``, leaves ``R = Q_n - k``,
and serves for ``s(k)`` while ``A ~ Poisson(lambda s(k))`` arrive. If ``R + A >= a`` the
next batch starts at once; otherwise the worker idles until ``a`` wait. So

    Q_{n+1} = max(R_n + A_n, a),

a Markov chain (M/G/1 type, the embedded chain at batch starts). Its stationary law
``pi`` is solved numerically on ``a..N`` (overflow lumped into ``N``), doubling ``N``
until the mass above the middle of the range is below ``1e-12``. Mean latency then
follows by renewal-reward: take one cycle from a batch start to the next. The
number in the system integrated over the cycle is the total time that jobs spend in it
then; with ``s = s(k)`` and ``m = R + A``,

    E[area | Q = q] = q s + lambda s^2 / 2 + E[ sum_{j=m}^{a-1} j / lambda ; m < a ]

(``q`` requests present throughout the service, arrivals add ``lambda s^2 / 2`` on
average, and while idling the queue climbs from ``m`` to ``a`` one exponential gap of
mean ``1 / lambda`` at a time). Each cycle completes ``k`` requests, so by
renewal-reward and Little's law ``E[latency] = E_pi[area] / E_pi[k]``, and the mean wait
subtracts the request-weighted service time ``E_pi[k s(k)] / E_pi[k]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import _check
from .policy import BatchPolicy
from .service import AffineService, BatcherCosts, CalibratedService, ServiceModel

#: The truncated chain must leave less than this mass in the upper half of its states.
TAIL_MASS = 1e-12
#: The largest truncated state space tried (a dense solve of this size takes seconds).
MAX_STATES = 4096


@dataclass(frozen=True)
class Prediction:
    """Exact means: latency and wait per request, batch size per batch.

    ``latency_s`` runs from arrival to finish, ``wait_s`` from arrival to dispatch (both
    seconds); ``mean_batch_size`` averages over batches, as ``RunResult.summary`` does.
    """

    latency_s: float
    wait_s: float
    mean_batch_size: float


# -- the stability bound --------------------------------------------------------------

def max_stable_rate_rps(service: ServiceModel, max_batch_size: int | None,
                        workers: int = 1) -> float:
    """The saturation throughput ``workers * b / s(b)``: every worker busy with full batches.

    Once the queue is long every batch the rule forms is full, so this is the most it can
    serve; with Poisson arrivals the one-worker chains of this module are positive
    recurrent exactly when ``rate_rps`` is below it (drift ``lambda s(b) - b < 0`` of
    ``Q`` once ``Q > b``; Foster's criterion). ``None`` (no cap) needs an affine
    service: the limit of ``b / s(b)`` is ``1 / per_item``.
    """
    _check_service(service)
    w = _check.positive_int("workers", workers)
    if max_batch_size is None:
        if not isinstance(service, AffineService):
            raise ValueError(f"max_batch_size=None (no cap) needs an AffineService, "
                             f"got {service!r}")
        return math.inf if service.per_item_ms == 0 else w * 1000.0 / service.per_item_ms
    b = _check.positive_int("max_batch_size", max_batch_size)
    return w * b / float(service.mean_s(b))


def stable(rate_rps: float, service: ServiceModel, max_batch_size: int | None,
           workers: int = 1) -> bool:
    """Whether ``rate_rps`` is below :func:`max_stable_rate_rps`."""
    rate = _check.positive("rate_rps", rate_rps)
    return rate < max_stable_rate_rps(service, max_batch_size, workers)


def _require_stable(rate: float, service: ServiceModel, b: int | None) -> None:
    limit = max_stable_rate_rps(service, b)
    if not rate < limit:
        raise ValueError(f"rate_rps must be below {limit:.6g} rps, the capacity of one worker "
                         f"with max_batch_size={b}, got {rate!r}")


# -- case 1: no batching ------------------------------------------------------------

def no_batching(rate_rps: float, service: ServiceModel) -> Prediction:
    """``max_batch_size=1``, one worker: the M/G/1 queue, Pollaczek-Khinchine.

    ``S = s(1) J`` with jitter ``J`` of mean 1 and CV ``c`` (``service.jitter_cv``), so
    ``E[S] = s(1)`` and ``E[S^2] = s(1)^2 (1 + c^2)``. An arrival (Poisson arrivals see
    time averages) waits for the residual service in progress, mean ``lambda E[S^2] / 2``,
    plus the work of the ``lambda W_q`` requests queued ahead (Little), so ``W_q =
    lambda E[S^2] / 2 + rho W_q``: the Pollaczek-Khinchine mean wait
    ``W_q = lambda E[S^2] / (2 (1 - rho))``, ``rho = lambda s(1)`` (Kleinrock, *Queueing
    Systems* I, 1975, ch. 5); latency ``= W_q + s(1)``. ``c = 0`` is M/D/1,
    ``W_q = rho s / (2 (1 - rho))``.
    """
    rate = _check.positive("rate_rps", rate_rps)
    _check_service(service)
    _require_stable(rate, service, 1)
    s1 = float(service.mean_s(1))
    wait = rate * s1**2 * (1.0 + service.jitter_cv**2) / (2.0 * (1.0 - rate * s1))
    return Prediction(latency_s=wait + s1, wait_s=wait, mean_batch_size=1.0)


# -- cases 2-4: the bulk-service chain ----------------------------------------------

def greedy_batching(rate_rps: float, service: ServiceModel,
                    max_batch_size: int | None) -> Prediction:
    """``max_wait_ms=0``, one worker, deterministic ``s(k)``: exact, by the chain above.

    A free worker takes ``min(queue, b)`` at once; a worker that frees to an empty queue
    serves the next arrival alone, at its arrival (rule ``(a, b) = (1, b)``).

    ``max_batch_size=None`` is Inoue's unbounded model (take everything waiting), which
    needs an ``AffineService``: the chain is then on batch sizes,
    ``B' = A + 1{A = 0}``, ``A ~ Poisson(lambda s(B))`` (Inoue 2021, eqs. 3-5 of
    arXiv:1912.06322v3), truncated like the others. For ``s(k) = a + c k`` the result
    equals Inoue's exact expression (eq. 36)
    ``E[W] = a + c + (1 + 2 lambda c)(E[B^2] - E[B]) / (2 lambda E[B])``: the same
    renewal-reward area, rewritten with ``lambda^2 E[S^2] = E[B^2] - E[B]``.
    :func:`inoue_bound_s` is its closed-form upper bound.
    """
    rate = _check.positive("rate_rps", rate_rps)
    _check_service(service, deterministic=True)
    b = None if max_batch_size is None else _check.positive_int("max_batch_size",
                                                                 max_batch_size)
    _require_stable(rate, service, b)
    return _bulk_chain(rate, service, threshold=1, max_batch_size=b)


def fixed_size_batching(rate_rps: float, service: ServiceModel, batch_size: int) -> Prediction:
    """``max_wait_ms=inf``, one worker, deterministic ``s(b)``: the M/D^(b,b)/1 bulk queue.

    A batch leaves only when the worker is free and ``b`` wait; a worker that frees with
    ``>= b`` waiting takes ``b`` at once (Bailey 1954; Neuts 1967, rule ``(b, b)``).
    Solved by the chain above: ``Q' = max(Q - b + A, b)``, ``A ~ Poisson(lambda s(b))``,
    with the idle-time area ``sum_{j=m}^{b-1} j / lambda`` while the next batch fills.
    """
    rate = _check.positive("rate_rps", rate_rps)
    _check_service(service, deterministic=True)
    b = _check.positive_int("batch_size", batch_size)
    _require_stable(rate, service, b)
    return _bulk_chain(rate, service, threshold=b, max_batch_size=b)


def _bulk_chain(rate: float, service: ServiceModel, threshold: int,
                max_batch_size: int | None) -> Prediction:
    """Solve the ``(a, b)`` chain (module docstring); ``None``: no cap (the top state)."""
    a = threshold
    n_top = 64
    while True:
        q = np.arange(a, a + n_top)
        b = q[-1] if max_batch_size is None else max_batch_size
        pi, area, k, ks = _chain_terms(rate, service, q, a, b)
        if np.abs(pi[q.size // 2:]).sum() < TAIL_MASS:
            jobs = pi @ k
            latency, service_part = pi @ area / jobs, pi @ ks / jobs
            return Prediction(latency_s=float(latency), wait_s=float(latency - service_part),
                              mean_batch_size=float(jobs))
        if q.size >= MAX_STATES:
            raise ValueError(f"rate_rps={rate!r} needs more than {q.size} states of the exact "
                             f"chain ({q.size} leave tail mass above {TAIL_MASS:g}): the "
                             f"queue runs too long, too close to capacity or with batches "
                             f"of thousands; simulate it instead")
        n_top *= 2


def _chain_terms(rate, service, q, a, b):
    """Stationary law on states ``q`` and per-state area, batch size, ``k s(k)``."""
    n = q.size
    k = np.minimum(q, b)
    rest = q - k
    s = np.asarray(service.mean_s(k), float)
    mean = rate * s                                          # arrivals during each batch
    tail = _poisson_reach(mean)
    log_fact = _log_factorials(max(q[-1] + 1, tail.max()))
    trans = np.zeros((n, n))
    idle_area = np.zeros(n)
    for i in range(n):
        room = q[-1] - rest[i]                               # next queue rest + A <= q[-1]
        arrivals = np.arange(max(room, tail[i]) + 1)
        pmf = np.exp(arrivals * math.log(mean[i]) - mean[i] - log_fact[arrivals])
        pmf /= pmf.sum()          # the whole law, so its terms' rounding cancels out
        # The overflow past the top state, summed itself (not 1 - the rest, which is
        # rounding when the overflow is tiny), lumped at the top.
        overflow, pmf = pmf[room + 1:].sum(), pmf[:room + 1]
        nxt = rest[i] + arrivals[:room + 1]
        trans[i] = np.bincount(np.maximum(nxt, a) - a, weights=pmf, minlength=n)
        trans[i, -1] += overflow
        short = nxt < a
        idle_area[i] = pmf[short] @ (a * (a - 1) - nxt[short] * (nxt[short] - 1)) / (2 * rate)
    system = trans.T - np.eye(n)
    system[-1] = 1.0
    rhs = np.zeros(n)
    rhs[-1] = 1.0
    pi = np.linalg.solve(system, rhs)
    area = q * s + rate * s**2 / 2 + idle_area
    return pi, area, k, k * s


def _poisson_reach(mean):
    """How far a Poisson law of ``mean`` (a number or an array) reaches: beyond this
    count its mass is below 1e-120 (40 standard deviations, and 40 more for small means)."""
    return np.ceil(mean + 40 * np.sqrt(mean) + 40).astype(int)


def _log_factorials(n: int) -> np.ndarray:
    """``log(m!)`` for ``m = 0..n`` (for Poisson pmfs ``exp(m log mu - mu - log m!)``),
    each to machine precision (a running sum of logs drifts by ~1e-11 over thousands)."""
    return np.array([math.lgamma(m + 1) for m in range(n + 1)])


def inoue_bound_s(rate_rps: float, service: AffineService) -> float:
    """Inoue's closed-form upper bound on the mean latency of unbounded greedy batching.

    Y. Inoue, "Queueing analysis of GPU-based inference servers with dynamic batching: a
    closed-form characterization", Performance Evaluation 147 (2021) 102183,
    arXiv:1912.06322, Theorem 2: for ``s(k) = tau0 + alpha k`` (here ``base``, ``per_item``)
    and ``lambda alpha < 1``, ``E[W] <= min(phi0, phi1)`` with

        phi0 = (alpha + tau0) / (2 (1 - lambda alpha))
               * (1 + 2 lambda tau0 + (1 - lambda tau0) / (1 + lambda alpha))     (eq. 41)
        phi1 = (3/2) tau0 / (1 - lambda alpha)
               + (alpha / 2) (lambda alpha + 2) / (1 - lambda^2 alpha^2)         (eq. 42)

    Derivation (checked here, not taken on trust): with ``p0 = P(A = 0)`` the stationary
    chain ``B' = A + 1{A=0}`` gives ``E[B] = (lambda tau0 + p0) / (1 - lambda alpha)`` and
    ``E[B^2](1 - lambda^2 alpha^2) = E[B](1 + 2 lambda^2 alpha tau0) + lambda^2 tau0^2``, so
    the exact latency (see :func:`greedy_batching`) is

        E[W] = alpha + tau0 + lambda (1 + 2 lambda alpha)
               (2 alpha tau0 + alpha^2 + tau0^2 / E[B]) / (2 (1 - lambda^2 alpha^2)),

    decreasing in ``E[B]``. ``E[B] >= 1`` gives ``phi0``; ``p0 >= 0``, i.e.
    ``E[B] >= lambda tau0 / (1 - lambda alpha)``, gives ``phi1``. It is a bound, not
    the exact value; it is tight when the worker is almost never idle (``p0 ~ 0``).
    """
    rate = _check.positive("rate_rps", rate_rps)
    if not isinstance(service, AffineService):
        raise ValueError(f"service must be an AffineService (Inoue's linear s(b)), "
                         f"got {service!r}")
    _check_service(service, deterministic=True)  # the bound assumes deterministic s(b)
    _require_stable(rate, service, None)
    tau0, alpha = service.base_ms / 1000.0, service.per_item_ms / 1000.0
    la = rate * alpha
    phi0 = (alpha + tau0) / (2 * (1 - la)) * (1 + 2 * rate * tau0 + (1 - rate * tau0) / (1 + la))
    phi1 = 1.5 * tau0 / (1 - la) + (alpha / 2) * (la + 2) / (1 - la**2)
    return min(phi0, phi1)


# -- case 5: size-or-timeout with ample workers ---------------------------------------

def timeout_batching_ample_workers(rate_rps: float, service: ServiceModel,
                                   max_batch_size: int, max_wait_ms: float) -> Prediction:
    """Any ``max_wait_ms``, with so many workers that one is always free: exact sums.

    Batches are then independent: the first arrival opens one, which leaves at its
    ``b``-th request or ``W`` after the first, whichever is first. With ``M ~
    Poisson(lambda W)`` arrivals in the window, the batch holds ``N = 1 + min(M, b - 1)``,
    so ``E[N] = 1 + sum_{j=1}^{b-1} P(M >= j)``. The total wait of its requests is the
    integral of the number waiting while the batch is open; it is open at ``t`` with
    ``1 + K`` waiting iff ``K = K(t) ~ Poisson(lambda t)`` is ``<= b - 2`` and ``t < W``, and
    ``int_0^W P(K(t) = i) dt = P(M >= i + 1) / lambda`` (the Erlang-Poisson relation), so

        E[total wait] = (1 / lambda) sum_{j=1}^{b-1} j P(M >= j).

    Per request (renewal-reward over batches): wait ``= E[total wait] / E[N]``, latency
    ``= wait + E[N s(N)] / E[N]`` (a request lands in a batch of size ``n`` with
    probability ``n P(N = n) / E[N]``). Jitter of mean 1 does not change the means.
    ``W = 0`` gives batches of one and latency ``s(1)``; ``W = inf`` waits
    ``(b - 1) / (2 lambda)``.
    """
    rate = _check.positive("rate_rps", rate_rps)
    _check_service(service)
    b = _check.positive_int("max_batch_size", max_batch_size)
    wait_s = _check.non_negative("max_wait_ms", max_wait_ms, allow_inf=True) / 1000.0
    if math.isinf(wait_s):                                  # every batch holds b
        wait = (b - 1) / (2.0 * rate)
        return Prediction(latency_s=wait + float(service.mean_s(b)), wait_s=wait,
                          mean_batch_size=float(b))
    pmf, tail = _poisson_law(rate * wait_s, b - 1)            # m = 0..k, k <= b - 1
    k = pmf.size - 1
    j = np.arange(1, k + 1)
    at_least = tail[1:]                                     # P(M >= j), j = 1..k; beyond, 0
    # P(N = n) = P(M = n - 1) below the cap and P(M >= b - 1) at it (nothing, if k < b - 1).
    sizes = np.arange(1, k + 2) if k < b - 1 else np.arange(1, b + 1)
    size_pmf = pmf if k < b - 1 else np.r_[pmf[:-1], tail[-1]]
    mean_size = 1.0 + at_least.sum()
    wait = (j @ at_least) / rate / mean_size
    service_part = size_pmf @ (sizes * np.asarray(service.mean_s(sizes), float)) / mean_size
    return Prediction(latency_s=float(wait + service_part), wait_s=float(wait),
                      mean_batch_size=float(mean_size))


def _poisson_law(mean: float, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``P(M = m)`` and ``P(M >= m)`` for ``M ~ Poisson(mean)``, ``m = 0..k``: ``k = n``,
    or less where beyond ``k`` both are below 1e-120 (taken as 0), so that the cost
    follows the smaller of ``n`` and the law's reach, not the larger.

    Each tail is accurate relative to itself: summed from the far end where it may be
    tiny (``1 - cumsum`` would be all rounding), from 0 where every tail up to ``n`` is
    at least about a half (``n <= mean``).
    """
    def law(last: int) -> np.ndarray:
        m = np.arange(last + 1)
        if mean == 0:
            return (m == 0).astype(float)
        return np.exp(m * math.log(mean) - mean - _log_factorials(last))

    if n <= mean:
        pmf = law(n)
        return pmf, 1.0 - np.r_[0.0, np.cumsum(pmf)[:-1]]
    top = int(_poisson_reach(mean))
    pmf = law(top)
    pmf /= pmf.sum()              # the whole law, so its terms' rounding cancels out
    tail = np.cumsum(pmf[::-1])[::-1]
    k = min(n, top)
    return pmf[:k + 1], tail[:k + 1]


# -- dispatch on a policy -------------------------------------------------------------

def predict(rate_rps: float, policy: BatchPolicy, service: ServiceModel) -> Prediction:
    """The exact one-worker result for ``policy``: no, greedy or fixed-size batching.

    For ``0 < max_wait_ms < inf`` with one worker there is no exact result here (use the
    simulator); with ample workers see :func:`timeout_batching_ample_workers`.
    """
    if not isinstance(policy, BatchPolicy):
        raise ValueError(f"policy must be a BatchPolicy, got {policy!r}")
    if policy.max_queue_size is not None or policy.timeout_ms is not None:
        raise ValueError(f"policy must have no max_queue_size and no timeout_ms for an "
                         f"exact result, got {policy!r}")
    b = policy.max_batch_size
    if b == 1:
        return no_batching(rate_rps, service)
    if policy.max_wait_ms == 0:
        return greedy_batching(rate_rps, service, b)
    if math.isinf(policy.max_wait_ms):
        return fixed_size_batching(rate_rps, service, b)
    raise ValueError(f"max_wait_ms must be 0 or inf for an exact one-worker result, "
                     f"got {policy.max_wait_ms!r}")


def _check_service(service, deterministic: bool = False) -> None:
    if not isinstance(service, ServiceModel):
        raise ValueError(f"service must be a service model (AffineService, ProfileService), "
                         f"got {service!r}")
    if isinstance(service, CalibratedService) and service.costs != BatcherCosts():
        # The event loop's delays change when batches start and how long workers stay
        # busy; these results know only s(b).
        raise ValueError(f"service.costs must be all zero for an exact result (it knows only "
                         f"s(b); simulate the batcher's costs instead), got {service.costs!r}")
    if deterministic and service.jitter_cv != 0:
        raise ValueError(f"service.jitter_cv must be 0 for this exact result (deterministic "
                         f"s(b)), got {service.jitter_cv!r}")
