"""Arrival processes: shape, rate, seeding and validation."""

import math

import numpy as np
import pytest

import batchsim as bs


def rng(seed=0):
    return np.random.default_rng(seed)


def gaps(times):
    return np.diff(np.r_[0.0, times])


def check_sorted_positive(times, n):
    assert times.shape == (n,)
    assert np.all(np.diff(times) >= 0) and times[0] >= 0 and np.all(np.isfinite(times))


@pytest.mark.parametrize("workload", [
    bs.Poisson(1000.0), bs.Constant(1000.0), bs.Gamma(1000.0, cv=2.0), bs.Gamma(1000.0, 0.5),
    bs.Bursty(on_rate_rps=3000.0, off_rate_rps=0.0, mean_on_s=0.05, mean_off_s=0.1),
    bs.Diurnal(1000.0, 0.5, period_s=5.0),
])
def test_mean_rate_matches_within_statistical_error(workload):
    n, window_s, k = 130_000, 5.0, 20
    times = workload.arrivals_s(n, rng(1))
    check_sorted_positive(times, n)
    # Count the arrivals in k = 20 consecutive 5 s windows covering the first 100 s. A
    # window is one whole Diurnal period (its swing integrates out) and spans ~30 of
    # Bursty's on/off cycles (0.15 s; its correlation time 1 / (1/0.05 + 1/0.1) = 33 ms),
    # so window counts are nearly independent with the process's own count variance:
    # their spread gives the SE of the mean rate (batch means). 6 SE, plus one arrival
    # over the span for the window edges (Constant's counts barely vary).
    span_s = k * window_s
    assert times[-1] > span_s   # 130k arrivals at 1000/s outlast 100 s by > 8 count SDs
    counts = np.bincount((times[times < span_s] / window_s).astype(int), minlength=k)
    se = counts.std(ddof=1) / math.sqrt(k) / window_s
    assert abs(counts.sum() / span_s - workload.rate_rps) < 6 * se + 1 / span_s


def test_poisson_gaps_are_exponential():
    g = gaps(bs.Poisson(200.0).arrivals_s(100_000, rng()))
    # Mean 1/rate and CV 1, each within 5 standard errors.
    assert abs(g.mean() - 0.005) < 5 * 0.005 / math.sqrt(g.size)
    assert abs(g.std() / g.mean() - 1.0) < 5 * math.sqrt(2.0 / g.size) * 1.5


def test_gamma_gap_cv():
    g = gaps(bs.Gamma(100.0, cv=0.5).arrivals_s(100_000, rng()))
    assert abs(g.std() / g.mean() - 0.5) < 0.01


def test_constant_is_exact():
    times = bs.Constant(4.0).arrivals_s(5, rng())
    np.testing.assert_array_equal(times, [0.25, 0.5, 0.75, 1.0, 1.25])


def test_ramp_rate_rises():
    w = bs.Ramp(100.0, 1000.0, duration_s=20.0)
    times = w.arrivals_s(20_000, rng())
    early = np.sum(times < 2.0) / 2.0
    late = np.sum((times > 18.0) & (times < 20.0)) / 2.0
    # Expected mean counts, the rate's integral over the window over its 2 s: 145/s early
    # (290 arrivals; it had said 190/s, the rate at 2 s, and passed by 0.9 of its
    # tolerance) and 955/s late. Poisson counts, each checked within 6 SD.
    assert abs(early - 145.0) < 6 * math.sqrt(145 * 2) / 2
    assert abs(late - 955.0) < 6 * math.sqrt(955 * 2) / 2


def test_bursty_is_overdispersed():
    w = bs.Bursty(on_rate_rps=5000.0, off_rate_rps=100.0, mean_on_s=0.02, mean_off_s=0.08)
    times = w.arrivals_s(50_000, rng())
    counts = np.bincount((times / 0.01).astype(int))
    assert counts.var() / counts.mean() > 5  # Poisson would give 1


def test_same_seed_same_arrivals_and_different_seed_differs():
    w = bs.Bursty(2000.0, 10.0, 0.01, 0.02)
    np.testing.assert_array_equal(w.arrivals_s(1000, rng(3)), w.arrivals_s(1000, rng(3)))
    assert not np.array_equal(w.arrivals_s(1000, rng(3)), w.arrivals_s(1000, rng(4)))


@pytest.mark.parametrize("workload", [
    bs.Poisson(100.0), bs.Gamma(100.0, 2.0), bs.Bursty(300.0, 30.0, 1.0, 2.0),
    bs.Ramp(50.0, 150.0, 10.0), bs.Diurnal(100.0), bs.Trace([0.1, 0.2, 0.4]),
])
def test_with_rate_rescales_the_mean_rate(workload):
    assert math.isclose(workload.with_rate(250.0).rate_rps, 250.0)
    assert type(workload.with_rate(250.0)) is type(workload)


@pytest.mark.parametrize("make, name", [
    (lambda: bs.Poisson(-1.0), "rate_rps"),
    (lambda: bs.Poisson(math.nan), "rate_rps"),
    (lambda: bs.Poisson(math.inf), "rate_rps"),
    (lambda: bs.Constant(0), "rate_rps"),
    (lambda: bs.Gamma(10.0, cv=0), "cv"),
    (lambda: bs.Gamma(10.0, cv=1e-200), "cv must be at least 1e-06"),
    (lambda: bs.Gamma(10.0, cv=1e200), "cv must be at most 100"),
    (lambda: bs.Bursty(10.0, -1.0, 1.0, 1.0), "off_rate_rps"),
    (lambda: bs.Bursty(10.0, 1.0, 0.0, 1.0), "mean_on_s"),
    (lambda: bs.Ramp(10.0, 0.0, 1.0), "end_rps"),
    (lambda: bs.Diurnal(10.0, amplitude=1.5), "amplitude"),
    (lambda: bs.Trace([]), "times_s"),
    (lambda: bs.Trace([0.2, 0.1]), "times_s"),
    (lambda: bs.Trace([-0.1, 0.1]), "times_s"),
    (lambda: bs.Trace([0.1, math.nan]), "times_s"),
    (lambda: bs.Trace(["a"]), "times_s must be a one-dimensional sequence of numbers"),
    (lambda: bs.Trace({0: 0.1}), "times_s must be a one-dimensional sequence of numbers"),
    (lambda: bs.Trace(None), "times_s must be a one-dimensional sequence of numbers"),
    (lambda: bs.Trace("0.5"), "times_s must be a one-dimensional sequence of numbers"),
    (lambda: bs.Trace(["0.1", "0.2"]), "times_s must be a one-dimensional sequence of numbers"),
    (lambda: bs.Trace.from_csv(123), "path must be a file path, got 123"),
    (lambda: bs.Trace([True, True]), "times_s must be a one-dimensional sequence of numbers"),
    (lambda: bs.Trace([0.1 + 1j]), "times_s must be a one-dimensional sequence of numbers"),
    (lambda: bs.Trace(np.array(["2024-01-01T00:00:00.001"], "datetime64[ms]")),
     r"times_s must be seconds or timedeltas, got instants of datetime64\[ms\] "
     r"\(subtract the first"),
    (lambda: bs.Trace([[0.1, 0.2], [0.3, 0.4]]), "one-dimensional"),
    (lambda: bs.Poisson(10.0).arrivals_s(0, rng()), "n_requests"),
    (lambda: bs.Trace([0.1, 0.2]).arrivals_s(3), "n_requests"),
    (lambda: bs.Trace([0.5, 0.5]).with_rate(100.0), "no finite mean rate to scale to rate_rps"),
])
def test_bad_workloads_raise_naming_the_parameter(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_a_trace_whose_clock_starts_late_keeps_its_rate_and_first_arrival():
    """Rate over the trace's own span: 3600 s of idle before it is not traffic."""
    gaps_s = np.full(100, 0.01)
    early = bs.Trace(np.cumsum(gaps_s))
    late = bs.Trace(3600.0 + np.cumsum(gaps_s))
    assert math.isclose(early.rate_rps, 100.0) and math.isclose(late.rate_rps, 100.0)
    faster = late.with_rate(200.0)
    assert faster.times_s[0] == late.times_s[0]
    np.testing.assert_allclose(np.diff(faster.times_s), 0.005)


def test_trace_keeps_times_and_reads_csv(tmp_path):
    t = bs.Trace([0.0, 0.1, 0.1, 0.35])
    np.testing.assert_array_equal(t.arrivals_s(None), [0.0, 0.1, 0.1, 0.35])
    np.testing.assert_array_equal(t.arrivals_s(2), [0.0, 0.1])
    with_header = tmp_path / "h.csv"
    with_header.write_text("id,arrival_s\n1,0.5\n2,0.75\n")
    np.testing.assert_array_equal(bs.Trace.from_csv(with_header, "arrival_s").times_s, [0.5, 0.75])
    bare = tmp_path / "b.csv"
    bare.write_text("0.1\n0.2\n")
    np.testing.assert_array_equal(bs.Trace.from_csv(bare).times_s, [0.1, 0.2])
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_s\n0.1\nsoon\n")
    with pytest.raises(ValueError, match="not all numbers"):
        bs.Trace.from_csv(bad)
    with pytest.raises(ValueError, match="column 'x'"):
        bs.Trace.from_csv(with_header, "x")
    with pytest.raises(ValueError, match="has rows without a column 5"):
        bs.Trace.from_csv(with_header, 5)
    with pytest.raises(ValueError, match="column must be a header name or an index, got 1.0"):
        bs.Trace.from_csv(with_header, 1.0)
    with pytest.raises(ValueError, match=f"path {str(tmp_path / 'no.csv')!r} is not a file"):
        bs.Trace.from_csv(tmp_path / "no.csv")


def test_a_trace_of_timedeltas_is_in_seconds_whatever_their_unit():
    """numpy's timedeltas (and pandas' times less the first) were read as their raw
    counts: 1 ms as 1 s."""
    np.testing.assert_array_equal(bs.Trace(np.array([0, 1, 250], "timedelta64[ms]")).times_s,
                                  [0.0, 0.001, 0.25])
    np.testing.assert_array_equal(bs.Trace(np.array([3, 1500], "timedelta64[us]")).times_s,
                                  [3e-6, 1.5e-3])


def test_a_csv_saved_with_a_byte_order_mark_loses_no_arrival(tmp_path):
    """A spreadsheet's "CSV UTF-8" starts with a byte-order mark: the first time, unread
    as a number, was taken for a header and lost, and a header's first name not found."""
    bare = tmp_path / "bare.csv"
    bare.write_bytes(b"\xef\xbb\xbf0.1\n0.2\n0.3\n")
    np.testing.assert_array_equal(bs.Trace.from_csv(bare).times_s, [0.1, 0.2, 0.3])
    named = tmp_path / "named.csv"
    named.write_bytes(b"\xef\xbb\xbft\n0.1\n0.2\n")
    np.testing.assert_array_equal(bs.Trace.from_csv(named, "t").times_s, [0.1, 0.2])
    latin = tmp_path / "latin.csv"
    latin.write_bytes(b"t\xe9\n0.1\n")
    with pytest.raises(ValueError, match=f"path {str(latin)!r} is not UTF-8 text"):
        bs.Trace.from_csv(latin)


def test_ramp_mean_rate_is_the_mean_over_the_ramp():
    """``rate_rps`` of a ramp is its mean rate while it ramps: (100 + 1000) / 2, and the
    arrivals over the 20 s ramp are a Poisson count of mean 550 * 20 = 11000 (6 SD)."""
    w = bs.Ramp(100.0, 1000.0, duration_s=20.0)
    assert w.rate_rps == 550.0
    times = w.arrivals_s(15_000, rng(2))
    assert times[-1] > 20.0
    assert abs(np.sum(times < 20.0) - 11_000) < 6 * math.sqrt(11_000)


def test_diurnal_rate_rises_first():
    """The rate is ``rate * (1 + a sin(2 pi t / period))``: above the mean for the first
    half period, where the expected count is ``rate * (period / 2 + a period / pi)``
    (1000 * (5 + 5 / pi) = 6592 here; starting at the mean on a cosine, it would be
    5000). A Poisson count: within 6 SD."""
    w = bs.Diurnal(1000.0, amplitude=0.5, period_s=10.0)
    times = w.arrivals_s(8_000, rng(3))
    assert times[-1] > 5.0
    expected = 1000.0 * (5.0 + 0.5 * 10.0 / math.pi)
    assert abs(np.sum(times < 5.0) - expected) < 6 * math.sqrt(expected)


def test_diurnal_keeps_the_mean_rate_over_whole_periods():
    """Over 40 whole periods the Diurnal count is Poisson with mean rate * 40 s = 4e5:
    within 6 SD, a relative 6 / sqrt(4e5) = 0.95%."""
    w = bs.Diurnal(10_000.0, amplitude=0.8, period_s=1.0)
    times = w.arrivals_s(420_000, rng(4))
    assert times[-1] > 40.0   # 20_000 = 31 SD beyond the mean count at 40 s
    expected = 10_000.0 * 40.0
    assert abs(np.sum(times < 40.0) - expected) < 6 * math.sqrt(expected)


def test_bursty_starts_in_a_state_drawn_from_the_stationary_law():
    """With mean dwell 0.1 s on and 0.3 s off the source is on a quarter of the time, so
    a quarter of independent runs start on. On at 1e4/s (off: silent), a run that starts
    on has its first arrival within 1 ms with probability ~1 - 1e-3 and one that starts
    off with probability < 1 - exp(-1 ms / 0.3 s) = 0.33%: the share of runs whose first
    arrival is under 1 ms is 0.25 within 0.003. Binomial over 1000 runs: SE
    sqrt(0.25 * 0.75 / 1000) = 0.014, checked within 5 SE."""
    w = bs.Bursty(on_rate_rps=1e4, off_rate_rps=0.0, mean_on_s=0.1, mean_off_s=0.3)
    runs, g = 1000, rng(5)
    share = np.mean([w.arrivals_s(1, g)[0] < 1e-3 for _ in range(runs)])
    assert abs(share - 0.25) < 5 * math.sqrt(0.25 * 0.75 / runs)


@pytest.mark.parametrize("w, says", [
    (bs.Bursty(1e-300, 0.0, 1.0, 1.0), "expects 1e-300 arrivals per on/off cycle"),
    (bs.Bursty(2000.0, 0.0, 1e-9, 1e-9), "n_requests=1000000 would take about 1e+12 spells"),
    (bs.Bursty(1e-300, 1e-300, 1e-300, 1e-300), "expects 0 arrivals per on/off cycle"),
], ids=repr)
def test_bursty_refuses_spells_it_could_not_draw_in_time(w, says):
    """Each spell costs a draw, arrival or not: spells holding a millionth of an arrival
    (or rates that underflow) are refused at once, naming the parameters, instead of a
    run that never ends (the first case looped for ever)."""
    with pytest.raises(ValueError, match="raise the arrivals per cycle") as e:
        w.arrivals_s(1_000_000, rng())
    assert says in str(e.value)


def test_bursty_short_spells_within_the_bound_are_drawn():
    """A hundredth of an arrival per cycle: 1,000 arrivals take some 200,000 spells, well
    within the bound, and come at the mean rate (Poisson in effect). Over 1,000 gaps the
    mean gap's standard error is 1/sqrt(1000) of it (3.2%), checked within 5 SE; the same
    spells for 10^8 arrivals (2 x 10^10 spells) are refused."""
    w = bs.Bursty(2000.0, 0.0, 5e-6, 5e-6)
    times = w.arrivals_s(1000, rng(3))
    check_sorted_positive(times, 1000)
    assert abs(times[-1] / 1000 * w.rate_rps - 1) < 5 / math.sqrt(1000)
    with pytest.raises(ValueError, match="n_requests=100000000"):
        w.arrivals_s(100_000_000, rng(3))


@pytest.mark.parametrize("w", [bs.Bursty(3000.0, 50.0, 0.05, 0.1), bs.Ramp(100.0, 1000.0, 2.0),
                               bs.Diurnal(1000.0, 0.9, period_s=0.5)], ids=repr)
def test_at_a_higher_rate_the_same_arrivals_come_earlier(w):
    """Common random numbers across loads: with the same seed, twice the rate moves
    every arrival earlier (independent draws would put some later)."""
    slow = w.arrivals_s(5000, rng(8))
    fast = w.with_rate(2 * w.rate_rps).arrivals_s(5000, rng(8))
    assert np.all(fast <= slow) and np.all(fast > 0)


def ramp_expected_arrivals(w, t_s):
    """The ramp's cumulative rate: quadratic over the ramp, then linear at ``end_rps``."""
    on = np.minimum(t_s, w.duration_s)
    ramp = w.start_rps * on + (w.end_rps - w.start_rps) * on**2 / (2 * w.duration_s)
    return ramp + w.end_rps * (t_s - on)


@pytest.mark.parametrize("w, expected_arrivals", [
    (bs.Diurnal(1000.0, amplitude=1.0, period_s=0.3), None),     # the rate touches 0
    (bs.Ramp(100.0, 1000.0, 2.0), ramp_expected_arrivals),
    (bs.Ramp(1000.0, 10.0, 2.0), ramp_expected_arrivals),        # falling, then slow
    (bs.Ramp(500.0, 500.0 * (1 + 1e-12), 2.0), ramp_expected_arrivals),   # nearly flat
    (bs.Ramp(1e155, 2e155, 1.0), ramp_expected_arrivals),        # squares would overflow
], ids=repr)
def test_arrivals_are_the_cumulative_rate_inverted_at_unit_poisson_points(w,
                                                                          expected_arrivals):
    """The change of time: W(t_k) is the k-th point of a unit-rate Poisson process (the
    seed's standard exponentials, summed), to float resolution; and at twice the rate
    W is twice as steep at the same points."""
    def cumulative(workload, t_s):
        return (workload.expected_arrivals(t_s) if expected_arrivals is None
                else expected_arrivals(workload, t_s))

    work = np.cumsum(rng(9).standard_exponential(4000))
    for factor in (1.0, 2.0):
        scaled = w.with_rate(factor * w.rate_rps)
        times = scaled.arrivals_s(4000, rng(9))
        np.testing.assert_allclose(cumulative(scaled, times), work, rtol=1e-9, atol=1e-9)
