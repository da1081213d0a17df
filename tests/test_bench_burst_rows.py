"""``bench/bench_burst_rows.py``: the rows at the largest max_batch_size, real beside
simulated, told each row's speed."""

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from bench_burst_rows import (
    analyze,
    big_releases_us,
    full_turn_share,
    p50_from_schedule_s,
)
from test_bench_row_errors import poisson_saved_runs

import batchsim as bs
from batchsim.calibrate import refit


def bursty_saved_runs(longer_release_ms: float = 0.0) -> dict:
    """``poisson_saved_runs``'s calibration, and two rows of bursts whose queues build up,
    their "real" runs made by the batcher the refit finds with its release
    ``longer_release_ms`` longer at every size."""
    saved = poisson_saved_runs()
    truth = refit(saved["service"], saved["calibration_runs"])
    truth = replace(truth, costs=replace(truth.costs, release_table_ms=tuple(
        t + longer_release_ms for t in truth.costs.release_table_ms)))
    rate_rps = 0.7 * truth.capacity_rps(8)
    bursts = bs.Bursty(4 * rate_rps, 0.25 * rate_rps, 0.02, 0.06)
    rows = []
    for seed, wait_ms in enumerate((0.0, 0.5)):
        due_s = bursts.arrivals_s(3000, np.random.default_rng(seed))
        policy = bs.BatchPolicy(8, wait_ms)
        real = bs.simulate(bs.Trace(due_s), policy, truth, seed=seed, sender="loop")
        real.meta["scheduled_s"] = due_s
        rows.append({"policy": policy, "rate_rps": rate_rps, "seed": seed, "real": real})
    return {**saved, "runs": {"bursty": rows}}


def test_rows_made_by_the_refitted_batcher_match_it_in_every_column():
    """The "real" rows were simulated by the batcher the refit finds: told their speed,
    their p50 is exact, their releases and full turns are the simulation's own, and
    their queues make the p50 grow with a slower machine."""
    saved = bursty_saved_runs()
    report = analyze(saved, "bursty")
    assert report["max_batch_size"] == 8 and len(report["rows"]) == 2
    for row in report["rows"]:
        assert row["p50_err"] == pytest.approx(0, abs=1e-9)
        assert row["p50_err_from_schedule"] == pytest.approx(0, abs=1e-9)
        real_us, sim_us = row["release_us"]
        assert real_us == pytest.approx(sim_us, rel=1e-9)
        assert row["full_turn_share"][0] == pytest.approx(row["full_turn_share"][1])
        assert row["elasticity"] > 0.5
        assert row["speed_equivalent"] == pytest.approx(0, abs=1e-9)
    service = refit(saved["service"], saved["calibration_runs"])
    assert report["release_table_us"] == pytest.approx(1e6 * service.costs.release_s(8))


def test_a_longer_real_release_shows_beside_a_faster_simulation():
    """Rows made by a batcher whose releases last 40 us longer than the refit's: the
    bench reads the real releases about 40 us longer than the simulated ones, and the
    simulation, told the speed, predicts their p50 low."""
    for row in analyze(bursty_saved_runs(0.04), "bursty")["rows"]:
        real_us, sim_us = row["release_us"]
        assert real_us - sim_us == pytest.approx(40, abs=10)
        assert row["p50_err"] < -0.02
        assert row["p50_err_from_schedule"] < -0.02


def test_big_releases_are_the_gaps_after_big_batches_whose_successor_was_due():
    """Five batches of 8, 8, 2, 8 and 8: the next one is due when the first and the
    fourth end, not when the second ends (its successor arrives later) and the third is
    small, so only the gaps after the first and the fourth count."""
    res = bs.simulate(bs.Trace(np.r_[np.zeros(16), 0.0021, 0.0021, np.full(16, 0.0042)]),
                      bs.BatchPolicy(8, 0.0), bs.AffineService(1.0, 0.0))
    assert res.size.tolist() == [8, 8, 2, 8, 8]
    expected = 1e6 * (res.start_s[[1, 4]] - res.end_s[[0, 3]])
    np.testing.assert_allclose(big_releases_us(res, 8), expected)


def test_the_full_turn_share_counts_the_requests_sent_in_turns_of_max_burst():
    """Turns of 64, 3, 64 and 1 requests: 128 of the 132 went out in full turns."""
    run = SimpleNamespace(meta={"turn_sizes": np.array([64, 3, 64, 1])})
    assert full_turn_share(run) == pytest.approx(128 / 132)


def test_the_p50_from_the_schedule_counts_the_generators_lateness():
    """Three requests due at 0, 1 and 2 ms, sent 0.5 ms late and finished 1 ms after
    they were sent: 1.5 ms from the schedule each (1 ms from the receipt)."""
    due_s = np.array([0.0, 1.0, 2.0]) * 1e-3
    res = SimpleNamespace(meta={"scheduled_s": due_s}, arrival_s=due_s + 0.5e-3,
                          finish_s=due_s + 1.5e-3)
    assert p50_from_schedule_s(res) == pytest.approx(1.5e-3)
