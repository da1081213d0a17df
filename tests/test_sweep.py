"""Sweeps: grid shape, common random numbers, executors (Dask too), progress, bad grids, CLI."""

import importlib
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pandas as pd
import pytest

import batchsim as bs
from batchsim.cli import main

WORKLOAD = bs.Poisson(1500.0)
SERVICE = bs.AffineService(1.9, 0.14)
sweep_module = importlib.import_module("batchsim.sweep")   # bs.sweep is the function


def small(**kwargs):
    args = {"max_batch_size": [1, 8], "max_wait_ms": [0.0, 2.0], "n_requests": 3000,
            "progress": False, **kwargs}
    return bs.sweep(WORKLOAD, SERVICE, **args)


def test_one_row_per_configuration_and_seed_in_grid_order():
    df = small(load=[0.3, 0.6], workers=[1, 2], seeds=[0, 1])
    assert len(df) == 2 * 2 * 2 * 2 * 2
    assert list(df.columns[:6]) == ["max_batch_size", "max_wait_ms", "load", "rate_rps",
                                    "workers", "seed"]
    for column in ("throughput_rps", "latency_ms_p50", "latency_ms_p99", "mean_batch_size",
                   "utilization", "n_completed", "n_rejected", "n_expired"):
        assert column in df.columns
    assert "utilization_per_worker" not in df.columns   # lists stay out of the frame
    first = df.iloc[0]
    assert (first["max_batch_size"], first["max_wait_ms"], first["load"], first["workers"],
            first["seed"]) == (1, 0.0, 0.3, 1, 0)
    keys = ["max_batch_size", "max_wait_ms", "load", "workers", "seed"]
    assert not df.duplicated(keys).any()


def test_rows_are_the_summaries_of_the_same_simulations():
    df = small(seeds=[3], slo_ms=4.0)
    row = df[(df.max_batch_size == 8) & (df.max_wait_ms == 2.0)].iloc[0]
    want = bs.simulate(WORKLOAD, bs.BatchPolicy(8, 2.0), SERVICE, 3000, seed=3).summary(slo_ms=4.0)
    for key in ("latency_ms_p99", "throughput_rps", "mean_batch_size", "goodput"):
        assert row[key] == want[key]


def test_load_is_a_fraction_of_the_largest_batch_capacity():
    df = small(load=[0.5], workers=[1, 3])
    for workers, rate in df.groupby("workers")["rate_rps"].first().items():
        assert rate == pytest.approx(0.5 * SERVICE.capacity_rps(8, workers))
    rates = small(rate_rps=[700.0, 900.0])
    assert sorted(rates["rate_rps"].unique()) == [700.0, 900.0]
    assert "load" not in rates.columns


def test_common_random_numbers_same_seed_same_arrivals():
    # With max_batch_size=1 the wait cannot matter, so two waits with the same seed see
    # the same arrivals and give identical rows; another seed gives other arrivals.
    df = small(max_batch_size=[1], max_wait_ms=[0.0, 5.0], seeds=[0, 1])
    results = ["throughput_rps", "latency_ms_p50", "latency_ms_p99", "latency_ms_max"]
    by_seed = {seed: rows[results].to_numpy() for seed, rows in df.groupby("seed")}
    np.testing.assert_array_equal(by_seed[0][0], by_seed[0][1])
    np.testing.assert_array_equal(by_seed[1][0], by_seed[1][1])
    assert not np.array_equal(by_seed[0][0], by_seed[1][0])


def test_common_random_numbers_across_policies_pair_the_noise():
    # Near saturation the arrival noise dominates each policy's mean latency. With common
    # random numbers it cancels in the paired difference between two policies, whose
    # spread over seeds is then a fraction of one policy's (independent arrivals would
    # make it sqrt(2) times larger instead).
    df = small(max_batch_size=[16], max_wait_ms=[0.5, 2.0], load=[0.9], seeds=range(12))
    wide = df.pivot(index="seed", columns="max_wait_ms", values="latency_ms_mean")
    assert (wide[2.0] - wide[0.5]).std() < 0.5 * min(wide[0.5].std(), wide[2.0].std())


def test_any_executor_gives_the_same_frame():
    with ThreadPoolExecutor(max_workers=2) as pool:
        threaded = small(seeds=[0, 1], executor=pool)
    pd.testing.assert_frame_equal(threaded, small(seeds=[0, 1]))


def test_default_process_pool_gives_the_same_frame(monkeypatch):
    monkeypatch.setattr(sweep_module, "INLINE_MAX_REQUESTS", 0)   # force the pool
    pooled = small(seeds=[0, 1])
    monkeypatch.undo()
    pd.testing.assert_frame_equal(pooled, small(seeds=[0, 1]))


@pytest.mark.timeout(60)
def test_dask_distributed_executor():
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        on_dask = small(seeds=[0, 1], executor=client.get_executor())
    pd.testing.assert_frame_equal(on_dask, small(seeds=[0, 1]))


def test_progress_bar_shows_unless_turned_off(capsys):
    small(progress=True)
    assert "sweep" in capsys.readouterr().err
    small(progress=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("kwargs, name, shown", [
    ({"max_batch_size": []}, "max_batch_size", "[]"),
    ({"max_batch_size": [4, -2]}, "max_batch_size", "-2"),
    ({"max_batch_size": [4, 2.5]}, "max_batch_size", "2.5"),
    ({"max_batch_size": "8"}, "max_batch_size", "'8'"),
    ({"max_wait_ms": []}, "max_wait_ms", "[]"),
    ({"max_wait_ms": [1.0, -1.0]}, "max_wait_ms", "-1.0"),
    ({"max_wait_ms": [math.nan]}, "max_wait_ms", "nan"),
    ({"load": [0.5, 0.0]}, "load", "0.0"),
    ({"load": []}, "load", "[]"),
    ({"workers": [0]}, "workers", "0"),
    ({"seeds": [-1]}, "seeds", "-1"),
    ({"n_requests": 0}, "n_requests", "0"),
    ({"engine": "numba"}, "engine", "'numba'"),
    ({"load": [0.5], "rate_rps": [100.0]}, "load or rate_rps", "100.0"),
    ({"executor": "pool"}, "executor", "'pool'"),
])
def test_bad_grids_name_the_parameter_and_value(kwargs, name, shown):
    with pytest.raises(ValueError, match=name) as err:
        small(**kwargs)
    assert shown in str(err.value)


def test_cli_sweep_writes_csv_and_plot(tmp_path, capsys):
    csv, png = tmp_path / "sweep.csv", tmp_path / "sweep.png"
    code = main(["sweep", "--rate", "1500", "-n", "2000", "--max-batch-size", "4", "16",
                 "--max-wait-ms", "0", "2", "--load", "0.3", "0.7", "--seed", "0", "1",
                 "--slo-ms", "8", "--out", str(csv), "--plot", str(png), "--no-progress"])
    assert code == 0
    df = pd.read_csv(csv)
    assert len(df) == 2 * 2 * 2 * 2 and {"latency_ms_p99", "goodput"} <= set(df.columns)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "latency_ms_p99" in capsys.readouterr().out


def test_cli_sweep_bad_grid_is_one_line(capsys):
    assert main(["sweep", "--rate", "100", "--max-batch-size", "0", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "max_batch_size" in err
