"""batchsim.theory: known values, internal consistency, and the simulator against it.

Statistical tolerance. Each simulation check runs several seeds, drops a warm-up (the
first 5% of requests start in an empty system) and the last 1% (a finite run flushes
its final partial batch), and splits each run's remaining requests into 25 consecutive
blocks. The block means (100 per check) are nearly independent because a block spans
thousands of requests, far longer than the queue's memory at these loads, so their
spread gives the standard error of the overall mean (batch means). A check passes when
``|sim - theory| < 4 SE``: a correct simulator fails it with probability ~6e-5 (two-sided
normal tail at 4 sigma), so the ~12 checks here false-alarm about once in a thousand runs.
"""

import math

import numpy as np
import pytest

import batchsim as bs
from batchsim import theory

SEEDS = range(4)
N_BLOCKS = 25
Z = 4.0
AFFINE = bs.AffineService(base_ms=2.0, per_item_ms=0.5)
V100 = bs.AffineService(base_ms=1.8874, per_item_ms=0.1438)   # Inoue (2021), Sec. 3.3 fit


def block_means(values: np.ndarray) -> np.ndarray:
    """Means of ``N_BLOCKS`` consecutive blocks after dropping warm-up and tail."""
    n = values.size
    kept = values[n // 20: n - n // 100]
    return np.array([b.mean() for b in np.array_split(kept, N_BLOCKS)])


def simulated(rate_rps, policy, service, n_requests, workers=1):
    """(mean, SE) of request latency and of batch size, pooled over ``SEEDS``."""
    lat, size = [], []
    for seed in SEEDS:
        res = bs.simulate(bs.Poisson(rate_rps), policy, service, n_requests=n_requests,
                          seed=seed, workers=workers)
        assert (res.status == bs.COMPLETED).all()
        lat.append(block_means(res.latency_s))
        size.append(block_means(res.size.astype(float)))
    lat, size = np.concatenate(lat), np.concatenate(size)
    return ((lat.mean(), lat.std(ddof=1) / math.sqrt(lat.size)),
            (size.mean(), size.std(ddof=1) / math.sqrt(size.size)))


def assert_close(sim, exact, what):
    mean, se = sim
    assert abs(mean - exact) < Z * se, (
        f"{what}: simulated {mean:.6g} +- {se:.2g}, theory {exact:.6g}, "
        f"z = {(mean - exact) / se:+.2f}")


# -- the simulator against exact theory ---------------------------------------------

@pytest.mark.parametrize("service, load", [
    (AFFINE, 0.5),                                        # M/D/1
    (AFFINE, 0.8),
    (bs.AffineService(2.0, 0.5, jitter_cv=0.6), 0.7),     # M/G/1, lognormal service
])
def test_sim_no_batching_matches_pollaczek_khinchine(service, load):
    rate = load * theory.max_stable_rate_rps(service, 1)
    exact = theory.no_batching(rate, service)
    (lat, _) = simulated(rate, bs.BatchPolicy(1, 0.0), service, 80_000)
    assert_close(lat, exact.latency_s, "latency_s")


PROFILE = bs.ProfileService([1, 2, 4, 8, 16], [1.0, 1.1, 1.3, 1.9, 3.2])


@pytest.mark.parametrize("service, b, load", [
    (AFFINE, 8, 0.4),
    (AFFINE, 8, 0.8),
    (PROFILE, 16, 0.6),
])
def test_sim_greedy_batching_matches_the_exact_chain(service, b, load):
    rate = load * theory.max_stable_rate_rps(service, b)
    exact = theory.greedy_batching(rate, service, b)
    lat, size = simulated(rate, bs.BatchPolicy(b, 0.0), service, 80_000)
    assert_close(lat, exact.latency_s, "latency_s")
    assert_close(size, exact.mean_batch_size, "mean_batch_size")


@pytest.mark.parametrize("load", [0.3, 0.8])
def test_sim_unbounded_greedy_matches_the_chain_and_meets_inoues_bound(load):
    rate = load * theory.max_stable_rate_rps(V100, None)
    exact = theory.greedy_batching(rate, V100, None)
    lat, size = simulated(rate, bs.BatchPolicy(100_000, 0.0), V100, 80_000)
    assert_close(lat, exact.latency_s, "latency_s")
    assert_close(size, exact.mean_batch_size, "mean_batch_size")
    assert lat[0] < theory.inoue_bound_s(rate, V100) + Z * lat[1]


@pytest.mark.parametrize("b, load", [(4, 0.5), (16, 0.8), (128, 0.9)])
def test_sim_fixed_size_batching_matches_the_bulk_queue(b, load):
    rate = load * theory.max_stable_rate_rps(AFFINE, b)
    exact = theory.fixed_size_batching(rate, AFFINE, b)
    lat, size = simulated(rate, bs.BatchPolicy(b, math.inf), AFFINE, 80_000)
    assert_close(lat, exact.latency_s, "latency_s")
    assert size[0] == pytest.approx(b, abs=1e-12)   # only the dropped flush is partial


@pytest.mark.parametrize("b, wait_ms, rate", [(8, 4.0, 1000.0), (32, 10.0, 1500.0)])
def test_sim_size_or_timeout_with_ample_workers_matches_the_exact_sums(b, wait_ms, rate):
    service = bs.AffineService(2.0, 0.5, jitter_cv=0.3)
    exact = theory.timeout_batching_ample_workers(rate, service, b, wait_ms)
    # 64 workers: at most a handful of batches are ever in service at once.
    lat, size = simulated(rate, bs.BatchPolicy(b, wait_ms), service, 60_000, workers=64)
    assert_close(lat, exact.latency_s, "latency_s")
    assert_close(size, exact.mean_batch_size, "mean_batch_size")


# -- theory on its own ----------------------------------------------------------------

def test_md1_and_mm1_by_hand():
    svc = bs.AffineService(1.5, 0.5)                # s(1) = 2 ms; rate 250/s: rho = 0.5
    p = theory.no_batching(250.0, svc)
    assert p.wait_s == pytest.approx(0.5 * 0.002 / (2 * 0.5))     # rho s / (2 (1 - rho))
    assert p.latency_s == pytest.approx(0.003)
    # Lognormal with CV 1 has the exponential's first two moments: M/M/1, 1 / (mu - lambda).
    mm1 = theory.no_batching(250.0, bs.AffineService(1.5, 0.5, jitter_cv=1.0))
    assert mm1.latency_s == pytest.approx(1 / (500.0 - 250.0))


@pytest.mark.parametrize("load", [0.1, 0.5, 0.9])
def test_batch_of_one_chains_equal_md1(load):
    rate = load / AFFINE.mean_s(1)
    md1 = theory.no_batching(rate, AFFINE)
    for p in (theory.greedy_batching(rate, AFFINE, 1), theory.fixed_size_batching(rate, AFFINE, 1)):
        assert p.latency_s == pytest.approx(md1.latency_s, rel=1e-9)
        assert p.wait_s == pytest.approx(md1.wait_s, rel=1e-8)
        assert p.mean_batch_size == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("load", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_unbounded_greedy_agrees_with_inoue(load):
    """The chain's latency obeys Inoue's exact relation to E[B], and the bound holds."""
    rate = load * theory.max_stable_rate_rps(V100, None)
    exact = theory.greedy_batching(rate, V100, None)
    assert theory.greedy_batching(rate, V100, 10**6).latency_s == pytest.approx(
        exact.latency_s, rel=1e-12)
    a, c = V100.base_ms / 1000, V100.per_item_ms / 1000

    def latency_given_mean_batch(eb):   # Inoue's eq. 36 with the E[B^2] moment relation
        return a + c + rate * (1 + 2 * rate * c) * (2 * a * c + c**2 + a**2 / eb) / (
            2 * (1 - (rate * c) ** 2))

    assert exact.latency_s == pytest.approx(latency_given_mean_batch(exact.mean_batch_size),
                                            rel=1e-9)
    bound = theory.inoue_bound_s(rate, V100)
    # The bound is the same expression at E[B]'s lower bounds 1 and lambda a / (1 - lambda c).
    assert bound == pytest.approx(min(latency_given_mean_batch(1.0),
                                      latency_given_mean_batch(rate * a / (1 - rate * c))))
    assert exact.latency_s <= bound * (1 + 1e-9)
    # Tight once the worker is rarely idle: phi1 differs from the exact value only through
    # p0 = P(A = 0) <= exp(-lambda s(1)) in E[B] = (lambda a + p0) / (1 - lambda c), so
    # phi1 - E[W] <= K (1 - lambda c) p0 / (lambda a)^2 with K the coefficient of 1 / E[B].
    k = rate * (1 + 2 * rate * c) * a**2 / (2 * (1 - (rate * c) ** 2))
    p0_max = math.exp(-rate * (a + c))
    assert bound - exact.latency_s <= k * (1 - rate * c) * p0_max / (rate * a) ** 2 + 1e-12


def test_greedy_batch_size_grows_with_load_and_latency_lies_between_limits():
    cap = theory.max_stable_rate_rps(AFFINE, 16)
    preds = [theory.greedy_batching(f * cap, AFFINE, 16) for f in (0.2, 0.5, 0.8)]
    assert [p.mean_batch_size for p in preds] == sorted(p.mean_batch_size for p in preds)
    for p in preds:
        assert AFFINE.mean_s(1) < p.latency_s
        assert 0 < p.wait_s < p.latency_s


def test_fixed_size_at_low_load_is_waiting_for_the_batch_to_fill():
    """Almost never queued behind a busy worker: ample-workers W = inf, (b - 1) / (2 lambda)."""
    b, rate = 8, 1.0
    fixed = theory.fixed_size_batching(rate, AFFINE, b)
    ample = theory.timeout_batching_ample_workers(rate, AFFINE, b, math.inf)
    assert ample.wait_s == pytest.approx((b - 1) / (2 * rate))
    assert ample.latency_s == pytest.approx((b - 1) / (2 * rate) + AFFINE.mean_s(b))
    assert fixed.latency_s == pytest.approx(ample.latency_s, rel=1e-4)
    assert fixed.mean_batch_size == pytest.approx(b)


@pytest.mark.parametrize("b, load", [(512, 0.3), (1024, 0.3), (4096, 0.8), (8192, 0.5),
                                     (40_000, 0.14)])
def test_large_batches_below_capacity_are_solved_not_refused(b, load):
    """A batch of ``b`` takes ``b / lambda`` to fill, 1 / load times a batch's service:
    with ``b`` in the thousands it fills after the worker frees (4096 at load 0.8: the
    fill would have to come 12.8 standard deviations early), so fixed-size batching is
    the ample-workers wait for the batch to fill. (The chain used to refuse these: the
    rounding of the Poisson law's terms, up to ~1e-12, sat on its top state.)"""
    service = bs.AffineService(1.9, 0.14)
    rate = load * theory.max_stable_rate_rps(service, b)
    fixed = theory.fixed_size_batching(rate, service, b)
    ample = theory.timeout_batching_ample_workers(rate, service, b, math.inf)
    assert fixed.latency_s == pytest.approx(ample.latency_s, rel=1e-9)


def test_unbounded_greedy_with_a_constant_batch_time_by_hand():
    """``s(k) = s`` for any k: batches of ``lambda s`` (plus P(none arrived), here
    e^-300), and a request waits half a batch time on average before its own."""
    s_ms, rate = 10.0, 30_000.0
    p = theory.greedy_batching(rate, bs.AffineService(s_ms, 0.0), None)
    assert p.mean_batch_size == pytest.approx(rate * s_ms / 1000, rel=1e-9)
    assert p.latency_s == pytest.approx(1.5 * s_ms / 1000, rel=1e-9)


def test_size_or_timeout_limits_and_monotonicity():
    s1 = float(AFFINE.mean_s(1))
    zero = theory.timeout_batching_ample_workers(500.0, AFFINE, 8, 0.0)
    assert (zero.latency_s, zero.wait_s, zero.mean_batch_size) == pytest.approx((s1, 0, 1))
    one = theory.timeout_batching_ample_workers(500.0, AFFINE, 1, 7.0)
    assert (one.latency_s, one.mean_batch_size) == pytest.approx((s1, 1))
    # b = 2: the batch waits for min(Exp(lambda), W): E = (1 - e^{-lambda W}) / lambda,
    # shared by the first request only; E[N] = 2 - e^{-lambda W}.
    rate, w = 400.0, 0.003
    p = theory.timeout_batching_ample_workers(rate, AFFINE, 2, w * 1000)
    en = 2 - math.exp(-rate * w)
    assert p.mean_batch_size == pytest.approx(en)
    assert p.wait_s == pytest.approx((1 - math.exp(-rate * w)) / rate / en)
    sizes = [theory.timeout_batching_ample_workers(rate, AFFINE, 16, w).mean_batch_size
             for w in (0.5, 2.0, 8.0, 1e6)]
    assert sizes == sorted(sizes) and sizes[-1] == pytest.approx(16)


def test_size_or_timeout_with_a_cap_that_never_binds_is_the_uncapped_sum():
    """``M ~ Poisson(mu)``, ``mu = lambda W``, far below the cap: ``E[N] = 1 + mu`` and the
    total wait ``E[M (M + 1) / 2] / lambda``, so the wait per request is ``(mu^2 + 2 mu) /
    (2 lambda (1 + mu))``. A cap of a billion must give that, not run out of memory."""
    rate, wait_ms = 2000.0, 5.0
    mu = rate * wait_ms / 1000
    for b in (1000, 10**9):
        p = theory.timeout_batching_ample_workers(rate, AFFINE, b, wait_ms)
        assert p.mean_batch_size == pytest.approx(1 + mu, rel=1e-12)
        assert p.wait_s == pytest.approx((mu**2 + 2 * mu) / (2 * rate * (1 + mu)), rel=1e-12)


def test_size_or_timeout_with_a_window_far_longer_than_a_batch_fills_every_batch():
    """``lambda W`` of 1e11 and ``b = 32``: every batch fills long before the window ends,
    so the wait is ``(b - 1) / (2 lambda)``, worked out on the cap's 32 terms (a law over
    the window's reach would need 1e11)."""
    p = theory.timeout_batching_ample_workers(1e10, AFFINE, 32, 1e4)
    assert p.mean_batch_size == 32 and p.wait_s == pytest.approx(31 / 2e10, rel=1e-12)


@pytest.mark.parametrize("rate", [1e-3, 1e-9, 1e-13])
def test_size_or_timeout_at_a_vanishing_rate_waits_out_the_window(rate):
    """With ``mu = lambda W`` tiny the batch nearly always waits the whole window alone:
    ``E[N] = 1 + mu + O(mu^2)`` and the wait ``W (1 - mu / 2) + O(mu^2)``, never above ``W``
    (``1 - cumsum`` of the law made it 5.55 ms at 1e-13 rps, above W = 5 ms)."""
    p = theory.timeout_batching_ample_workers(rate, AFFINE, 8, 5.0)
    mu = rate * 0.005
    assert p.wait_s == pytest.approx(0.005 * (1 - mu / 2), rel=1e-9)
    assert p.wait_s <= 0.005
    assert p.mean_batch_size == pytest.approx(1 + mu, rel=1e-12)


def test_theory_refuses_a_service_with_the_batchers_costs():
    """The event loop's delays (here a release of 0.5 ms after each batch) change when
    batches start; the exact results know only s(b), so they refuse rather than return a
    number the simulator would not (theory said 5.4 ms where it simulated 10.3 ms)."""
    with pytest.raises(ValueError, match="service.costs must be all zero") as err:
        theory.no_batching(100.0, bs.CalibratedService(AFFINE, costs=bs.BatcherCosts(
            release_ms=0.5)))
    assert "release_ms=0.5" in str(err.value)
    plain = bs.CalibratedService(AFFINE, per_batch_ms=0.1)
    assert theory.no_batching(100.0, plain) == theory.no_batching(
        100.0, bs.AffineService(2.1, 0.5))


def test_predict_picks_the_case():
    rate = 300.0
    assert theory.predict(rate, bs.BatchPolicy(1, 5.0), AFFINE) == theory.no_batching(rate, AFFINE)
    assert theory.predict(rate, bs.BatchPolicy(8, 0.0), AFFINE) == theory.greedy_batching(
        rate, AFFINE, 8)
    assert theory.predict(rate, bs.BatchPolicy(8, math.inf), AFFINE) == (
        theory.fixed_size_batching(rate, AFFINE, 8))


def test_stability_bound():
    assert theory.max_stable_rate_rps(AFFINE, 8) == pytest.approx(8 / 0.006)
    assert theory.max_stable_rate_rps(AFFINE, 8, workers=3) == pytest.approx(
        AFFINE.capacity_rps(8, workers=3))
    assert theory.max_stable_rate_rps(AFFINE, None) == pytest.approx(1000 / 0.5)
    assert theory.max_stable_rate_rps(bs.AffineService(2.0, 0.0), None) == math.inf
    cap = 8 / 0.006
    assert theory.stable(0.99 * cap, AFFINE, 8)
    assert not theory.stable(cap, AFFINE, 8)
    assert theory.stable(1.5 * cap, AFFINE, 8, workers=2)


# -- bad input ------------------------------------------------------------------------

JITTERY = bs.AffineService(2.0, 0.5, jitter_cv=0.2)


@pytest.mark.parametrize("call, name, value", [
    (lambda: theory.no_batching(-1.0, AFFINE), "rate_rps", "-1.0"),
    (lambda: theory.no_batching(math.nan, AFFINE), "rate_rps", "nan"),
    (lambda: theory.no_batching(400.0, AFFINE), "rate_rps", "400.0"),         # rho = 1
    (lambda: theory.greedy_batching(2000.0, AFFINE, 8), "rate_rps", "2000.0"),
    (lambda: theory.greedy_batching(100.0, AFFINE, 0), "max_batch_size", "0"),
    (lambda: theory.greedy_batching(100.0, JITTERY, 8), "jitter_cv", "0.2"),
    (lambda: theory.greedy_batching(100.0, PROFILE, None), "max_batch_size", "None"),
    (lambda: theory.greedy_batching(100.0, "fast", 8), "service", "'fast'"),
    (lambda: theory.fixed_size_batching(100.0, AFFINE, 2.5), "batch_size", "2.5"),
    (lambda: theory.fixed_size_batching(5000.0, AFFINE, 4), "rate_rps", "5000.0"),
    (lambda: theory.inoue_bound_s(100.0, bs.AffineService(2.0, 0.5, jitter_cv=0.5)),
     "jitter_cv", "0.5"),
    (lambda: theory.inoue_bound_s(100.0, PROFILE), "service", "ProfileService"),
    (lambda: theory.inoue_bound_s(2000.0, AFFINE), "rate_rps", "2000.0"),
    (lambda: theory.timeout_batching_ample_workers(100.0, AFFINE, 8, -1.0), "max_wait_ms",
     "-1.0"),
    (lambda: theory.timeout_batching_ample_workers(0.0, AFFINE, 8, 1.0), "rate_rps", "0.0"),
    (lambda: theory.predict(100.0, bs.BatchPolicy(8, 2.0), AFFINE), "max_wait_ms", "2.0"),
    (lambda: theory.predict(100.0, bs.BatchPolicy(8, 0.0, max_queue_size=5), AFFINE),
     "max_queue_size", "max_queue_size=5"),
    (lambda: theory.predict(100.0, (8, 0.0), AFFINE), "policy", "(8, 0.0)"),
    (lambda: theory.stable(100.0, AFFINE, 8, workers=0), "workers", "0"),
])
def test_bad_input_names_the_parameter_and_value(call, name, value):
    with pytest.raises(ValueError, match=name) as err:
        call()
    assert value in str(err.value)


def test_the_uncapped_stability_bound_scales_with_workers():
    """With no cap on the batch, each worker tends to ``1 / per_item`` requests a second."""
    assert theory.max_stable_rate_rps(AFFINE, None, workers=3) == pytest.approx(3 * 1000 / 0.5)
    assert theory.stable(1.5 * 1000 / 0.5, AFFINE, None, workers=2)
    assert not theory.stable(1.5 * 1000 / 0.5, AFFINE, None)


@pytest.mark.parametrize("wait_ms", [1e-9, 0.5, 1.0, 2.0, 1e9])
def test_predict_refuses_a_finite_positive_max_wait(wait_ms):
    """Only max_wait_ms = 0 (greedy) and inf (fixed size) have an exact one-worker result;
    any wait between them, however short or long, is refused rather than approximated."""
    with pytest.raises(ValueError, match="max_wait_ms must be 0 or inf") as err:
        theory.predict(100.0, bs.BatchPolicy(8, wait_ms), AFFINE)
    assert repr(float(wait_ms)) in str(err.value)
