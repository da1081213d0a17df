"""recommend(): known answers, tie-breaks, plain reasons when nothing fits, CLI."""

import math

import pandas as pd
import pytest

import batchsim as bs
from batchsim.cli import main

# One request every millisecond; every batch takes 10 ms whatever its size. By hand:
# * max_batch_size=1 serves at most 100 requests/s per worker: over capacity.
# * Greedy (max_wait 0), max_batch_size=16: a request that arrives just after a batch
#   left waits for the next worker to free (<= 10 ms), then 10 ms of service: <= 20 ms.
# * Fixed size 16 (max_wait inf): the first of a batch waits for 15 more (15 ms), then
#   10 ms of service: 25 ms.
TRAFFIC = bs.Constant(1000.0)
FLAT = bs.AffineService(base_ms=10.0, per_item_ms=0.0)
GRID = {"max_batch_size": (1, 16), "max_wait_ms": (0.0, math.inf), "n_requests": 5000,
        "progress": False}


def test_only_one_feasible_point_is_chosen():
    rec = bs.recommend(TRAFFIC, FLAT, slo_ms=22, workers=(1,), **GRID)
    assert rec.met and rec.workers == 1
    assert rec.policy == bs.BatchPolicy(16, 0.0)
    assert 10.0 <= rec.latency_ms <= 20.0 + 1e-6
    assert rec.throughput_rps == pytest.approx(1000.0, rel=0.01)
    assert len(rec.evidence) == 4 and rec.evidence["meets_slo"].sum() == 1
    assert len(rec.runner_ups) == 0
    fixed = rec.evidence[rec.evidence["max_wait_ms"] == math.inf]
    assert fixed.loc[fixed["max_batch_size"] == 16, "latency_ms_p99"].iloc[0] == pytest.approx(
        25.0, abs=0.01)
    assert "max_batch_size=16" in str(rec) and "max_wait_ms=0" in str(rec)


def test_fewest_workers_win():
    rec = bs.recommend(TRAFFIC, FLAT, slo_ms=22, workers=(2, 1), **GRID)
    assert (rec.policy, rec.workers) == (bs.BatchPolicy(16, 0.0), 1)
    runner = rec.runner_ups.iloc[0]
    assert (runner["max_batch_size"], runner["max_wait_ms"], runner["workers"]) == (16, 0.0, 2)


def test_a_run_that_drains_a_little_later_does_not_cost_a_worker():
    """Short runs: one worker's last batches end a little later than two workers' (its
    throughput over the run comes out about 1% lower), yet it serves every request within
    the SLO; it wins."""
    rec = bs.recommend(bs.Poisson(960.0), bs.AffineService(1.0, 1.0), slo_ms=500,
                       workers=(1, 2), max_batch_size=(64,), max_wait_ms=(0.0,),
                       n_requests=2000, progress=False)
    assert rec.workers == 1 and rec.evidence["meets_slo"].all()


def test_lowest_latency_breaks_the_remaining_tie():
    rec = bs.recommend(TRAFFIC, FLAT, slo_ms=30, workers=(1,), **GRID)
    assert rec.policy == bs.BatchPolicy(16, 0.0)          # 20 ms beats 25 ms
    assert rec.runner_ups["max_wait_ms"].tolist() == [math.inf]


def test_over_capacity_is_said_plainly():
    rec = bs.recommend(TRAFFIC, FLAT, slo_ms=50, workers=(1, 2),
                       **{**GRID, "max_batch_size": (1, 2)})
    assert not rec.met and rec.policy is None and rec.workers is None
    assert "over capacity" in rec.reason and "400 requests/s" in rec.reason
    assert not rec.evidence["meets_slo"].any()


def test_slo_below_one_batch_service_time_is_said_plainly():
    rec = bs.recommend(TRAFFIC, FLAT, slo_ms=5, workers=(1,), **GRID)
    assert not rec.met and "service time of one batch" in rec.reason and "10 ms" in rec.reason


def test_otherwise_the_closest_configuration_is_named():
    rec = bs.recommend(TRAFFIC, FLAT, slo_ms=15, workers=(1,), **GRID)
    assert not rec.met
    assert "max_batch_size=16, max_wait_ms=0" in rec.reason and "> 15 ms" in rec.reason


def test_default_grid_on_a_realistic_case_meets_a_loose_slo_and_not_a_tight_one():
    workload, service = bs.Poisson(2000.0), bs.AffineService(1.9, 0.14)
    loose = bs.recommend(workload, service, slo_ms=20, n_requests=20_000, progress=False)
    assert loose.met and loose.latency_ms <= 20 and loose.workers == 1
    assert set(loose.evidence["workers"]) == {1, 2, 4}
    tight = bs.recommend(workload, service, slo_ms=2.5, n_requests=20_000, progress=False)
    assert not tight.met and "lowest p99 latency" in tight.reason


@pytest.mark.parametrize("kwargs, name", [
    ({"slo_ms": -1.0}, "slo_ms"),
    ({"slo_ms": 10.0, "percentile": 97}, "percentile"),
    ({"slo_ms": 10.0, "workers": []}, "workers"),
    ({"slo_ms": 10.0, "n_runner_ups": -1}, "n_runner_ups"),
])
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        bs.recommend(TRAFFIC, FLAT, **{**GRID, **kwargs})


def test_cli_recommend(tmp_path, capsys):
    out = tmp_path / "evidence.csv"
    argv = ["recommend", "--rate", "1000", "--arrivals", "constant", "--service",
            "affine:10,0", "--workers", "1", "2", "-n", "5000", "--max-batch-size", "1", "16",
            "--max-wait-ms", "0", "inf", "--no-progress"]
    assert main(argv + ["--slo-ms", "22", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "max_batch_size=16, max_wait_ms=0 with 1 worker" in text and "runner-ups" in text
    assert len(pd.read_csv(out)) == 8
    assert main(argv + ["--slo-ms", "5"]) == 1
    assert "service time of one batch" in capsys.readouterr().out
