"""A small fidelity grid: the calibrated simulator predicts the real batcher.

The model sleeps (the GIL released, like a GPU model) 1 ms a batch and 0.1 ms a request,
so the batcher's own sub-millisecond costs and the event loop's 1 ms timer grid matter,
as they do for real models. Real runs on a shared machine are noisy; the bounds are:

* the paired batch-means standard error of the difference: the run is cut into ten
  consecutive blocks, each statistic compared block by block (simulator and batcher saw
  the same arrivals, so what the arrivals do cancels out); four standard errors;
* plus a model allowance: 30% for p50 latency, 15% for the mean batch size. This is the
  scale of the simulator's error that ``bench/bench_fidelity.py`` measures on a loaded
  two-core machine, where the real batcher differs from itself by about as much; the
  test catches a simulator that is wrong in kind (a missing timer grid shifts p50 by a
  millisecond: far more), not one that is a few percent off.

Throughput must agree within 2%: both runs serve the same open-loop arrivals.
"""

import gzip
import json
import os
import pickle
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from service_fakes import sleeping_model

import batchsim as bs
from batchsim.calibrate import METRICS, at_speed, batch_residuals, refit, worker_time_ratio
from batchsim.fidelity import checked_grid, fidelity, fidelity_summary, run_pair

BLOCKS = 10


sleepy = sleeping_model(1.0, 0.1)


@pytest.fixture(scope="module")
def service():
    return bs.calibrate(sleepy, 8, n_requests=360, duration_s=0.0, repeats=8,
                        timer_probes=60, seed=0)


def per_request(res, what):
    """Per request: its latency (ms) or the size of the batch it rode in."""
    if what == "latency":
        return 1e3 * res.latency_s
    return res.size[res.batch_id].astype(float)


def paired_blocks(real, sim, what, stat):
    """Relative difference of ``stat`` over the whole run and its batch-means SE."""
    r, s = per_request(real, what), per_request(sim, what)
    idx = np.array_split(np.arange(real.n_requests), BLOCKS)
    d = np.array([stat(s[i]) - stat(r[i]) for i in idx])
    whole = stat(r)
    return (stat(s) - whole) / whole, d.std(ddof=1) / np.sqrt(BLOCKS) / whole


def test_throughput_agrees_over_a_grid(service):
    runs = []
    grid = fidelity(sleepy, service, max_batch_size=(8,), max_wait_ms=(0.0, 2.0),
                    load=(0.3, 0.6), n_requests=500, seed=1, runs=runs)
    assert len(grid) == 4
    # Each row's real run is kept, in row order, for taking the row apart later.
    assert [r["policy"].max_wait_ms for r in runs] == list(grid["max_wait_ms"])
    assert [r["real"].summary()["throughput_rps"] for r in runs] == pytest.approx(
        list(grid["real_throughput_rps"]))
    assert all(r["again"] is None for r in runs)
    # Each row says how late the simulated generator was and whether the real one fell
    # further behind (by over a timer tick at p99).
    assert (grid["sim_lateness_ms_p99"] >= 0).all()
    assert grid["harness_behind"].dtype == bool
    assert (grid["err_throughput_rps"].abs() <= 0.02).all(), grid["err_throughput_rps"]
    # The model the calibration measured, at about the calibration's speed (a shared
    # machine drifts by up to a fifth within a minute: bench_profile_noise.py).
    assert grid["worker_time_ratio"].between(0.8, 1.25).all(), grid["worker_time_ratio"]
    assert np.isfinite(grid["speed_err_latency_ms_p50"]).all()
    # Batch by batch, the real batcher says when its worker picked each batch up. The
    # model sleeps with the GIL released, so the loop received requests while it ran.
    table = batch_residuals(service, runs[-1]["real"])
    assert table["pickup_ms"].between(0, table["worker_ms"]).all()
    # On the CPU a thread per worker reports a batch launched as it ends.
    assert (table["pickup_ms"] <= table["launch_ms"]).all()
    assert (table["launch_ms"] <= table["worker_ms"]).all()
    assert (table["worker_ms"] - table["launch_ms"]).median() < 0.05
    assert (table["received_after_pickup"] <= table["received"]).all()
    assert table["received_after_pickup"].sum() > 0
    # The real load generator recorded its turns: each brought a batch at least one request.
    assert table["turns"].notna().all() and (table["turns"] <= table["received"]).all()
    assert ((table["turns"] > 0) == (table["received"] > 0)).all()


@pytest.mark.parametrize("max_wait_ms, load", [(0.0, 0.3), (2.0, 0.3), (2.0, 0.6)])
def test_p50_latency_and_batch_sizes_within_noise_and_allowance(service, max_wait_ms, load):
    policy = bs.BatchPolicy(8, max_wait_ms)
    rate = load * service.capacity_rps(8)
    real, sim = run_pair(sleepy, service, policy, bs.Poisson(rate), 500, seed=2)
    # The simulator replayed the load generator's schedule through the loop model: its
    # requests reached the batcher no earlier than they were due, like the real ones.
    np.testing.assert_array_equal(sim.meta["sent_s"], real.meta["scheduled_s"])
    assert (sim.arrival_s >= sim.meta["sent_s"]).all()
    err, se = paired_blocks(real, sim, "latency", np.median)
    assert abs(err) <= 0.30 + 4 * se, (err, se)
    err, se = paired_blocks(real, sim, "batch size", np.mean)
    assert abs(err) <= 0.15 + 4 * se, (err, se)


def test_told_the_speed_of_a_slower_machine_the_simulator_predicts_it(service):
    """The "machine" runs the calibrated model at half speed (it sleeps twice as long):
    the calibrated simulator predicts the fast one, but the run's own batches say how
    slow they were, and told that, it predicts the slow one within the file's bounds.
    The ratio: (2 n + x) / (n + x), n = 1.4 to 1.8 ms of sleep at the batch sizes seen,
    x the sleep's overshoot and the batcher's costs (under half a millisecond)."""
    slower = sleeping_model(2.0, 0.2, name="sleepy")
    policy = bs.BatchPolicy(8, 0.0)
    real, untold = run_pair(slower, service, policy, bs.Poisson(
        0.3 * service.capacity_rps(8)), 500, seed=5)
    ratio = worker_time_ratio(service, real)
    assert 1.6 < ratio < 2.1, ratio
    told = bs.simulate(bs.Trace(real.meta["scheduled_s"]), policy, at_speed(service, ratio),
                       seed=5, sender="loop")
    err, se = paired_blocks(real, untold, "latency", np.median)
    assert err < -0.30 - 4 * se, (err, se)
    err, se = paired_blocks(real, told, "latency", np.median)
    assert abs(err) <= 0.30 + 4 * se, (err, se)


def test_calibration_beats_the_model_alone_where_timers_matter(service):
    """With max_wait_ms=0.5 the event loop's timer grid adds up to a millisecond to a
    wait of half of one; the model's s(b) alone (what a simulator without calibration
    would use) misses it."""
    policy = bs.BatchPolicy(8, 0.5)
    rate = 0.3 * service.capacity_rps(8)
    real, calibrated = run_pair(sleepy, service, policy, bs.Poisson(rate), 500, seed=3)
    alone = bs.simulate(bs.Trace(real.arrival_s), policy, service.model, seed=3)
    p50 = [r.summary()["latency_ms_p50"] for r in (real, calibrated, alone)]
    assert abs(p50[1] - p50[0]) < abs(p50[2] - p50[0]), p50


ROOT = Path(__file__).resolve().parents[1]


def test_bench_fidelity_saves_the_service_and_each_rows_real_run(tmp_path):
    """``bench_fidelity.py --save-runs``: what a GPU run brings back to be taken apart
    (the calibrations' own runs too);
    ``--recalibrate``: every row simulated with a second calibration too;
    ``--probe-speed``: each row's machine speed against the start's."""
    subprocess.run([sys.executable, "bench/bench_fidelity.py", "--quick", "--duration-s",
                    "0.02", "--workloads", "poisson", "--out", str(tmp_path / "f.json"),
                    "--save-runs", str(tmp_path / "runs.pkl.gz"), "--recalibrate",
                    "--probe-speed", "--pipeline"],
                   cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                   capture_output=True, timeout=300)
    saved = pickle.loads(gzip.decompress((tmp_path / "runs.pkl.gz").read_bytes()))
    report = json.loads((tmp_path / "f.json").read_text())
    rows = report["workloads"]["poisson"]["rows"]
    runs = saved["runs"]["poisson"]
    assert isinstance(saved["service"], bs.CalibratedService) and len(runs) == len(rows) == 12
    # Both calibrations' runs, to refit them elsewhere.
    assert (saved["recalibration"].per_batch_ms
            == pytest.approx(report["recalibration"]["per_batch_ms"]))
    for key, service in (("calibration_runs", saved["service"]),
                         ("recalibration_runs", saved["recalibration"])):
        assert ([str(r.meta["policy"]) for r in saved[key]]
                == service.metadata["calibration_policies"])
    # --pipeline: the calibration and every row through the pipeline of threads, whose
    # stager stages each batch (on the CPU a thread per worker is the default).
    assert report["pipeline"] is True
    for res in [*saved["calibration_runs"], *(run["real"] for run in runs)]:
        assert np.isfinite(res.meta["batch_phases_s"][:, 1]).all()
    for run, row in zip(runs, rows, strict=True):
        assert set(run) == {"policy", "rate_rps", "seed", "real"}
        assert run["policy"].max_batch_size == row["max_batch_size"]
        assert run["real"].summary()["throughput_rps"] == pytest.approx(
            row["real_throughput_rps"])
        assert np.isfinite(row["recal_err_latency_ms_p50"]) and row["speed_ratio"] > 0
    assert report["recalibration"]["kind"] == "calibrated"
    # Fitted again on its own runs, each calibration is itself: the fit is deterministic.
    # (Runs this short measure capacity roughly; the check may warn, as it did when made.)
    for key, service in (("calibration_runs", saved["service"]),
                         ("recalibration_runs", saved["recalibration"])):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "the calibrated model serves", RuntimeWarning)
            assert refit(service, saved[key]) == service
    summary = report["workloads"]["poisson"]["summary"]
    assert np.isfinite(summary["median_abs_recalibrated_latency_ms_p50"])
    assert np.isfinite(summary["median_abs_between_calibrations_latency_ms_p50"])
    assert np.isfinite(summary["speed_corr_err_latency_ms_p50"])


def test_resimulate_with_the_grids_own_calibration_gives_back_each_rows_errors(service):
    """``resimulate`` simulates as the grid did: with the same calibration, the same
    errors, and the two calibrations' predictions 0 apart."""
    from batchsim.fidelity import resimulate

    runs = []
    df = fidelity(sleepy, service, max_batch_size=(8,), max_wait_ms=(0.0, 1.0), load=(0.5,),
                  n_requests=300, seed=4, runs=runs)
    resimulate(df, runs, service)
    for metric in ("latency_ms_p50", "latency_ms_p99", "throughput_rps"):
        assert df[f"recal_err_{metric}"].tolist() == df[f"err_{metric}"].tolist()
        assert fidelity_summary(df)[f"median_abs_between_calibrations_{metric}"] == 0.0


def test_the_speed_probe_measures_what_the_batcher_serves_now():
    """The sleeping model takes 1 + 0.1 * 8 = 1.8 ms a full batch of 8: a batcher serves
    at most 8 / 1.8 ms = 4444 requests/s (a sleep never ends early), a little less for
    its own costs and the sleep's overshoot (tens of µs a batch)."""
    from batchsim.fidelity import _speed_probe

    rps = _speed_probe(sleepy, 8, None)
    assert 0.7 * 8 / 1.8e-3 < rps <= 8 / 1.8e-3


def test_each_row_gets_its_probe_over_the_probe_made_at_the_start(service, monkeypatch):
    """The probes run first for every max_batch_size, then one right before each row."""
    import batchsim.fidelity as fid

    probed = []
    speeds = iter([1000.0, 2000.0,                        # at the start: b=4, then b=8
                   900.0, 1100.0, 2400.0, 1800.0])        # before each row, in row order

    def fake_probe(model, max_batch_size, device):
        probed.append(max_batch_size)
        return next(speeds)

    monkeypatch.setattr(fid, "_speed_probe", fake_probe)
    df = fidelity(sleepy, service, max_batch_size=(4, 8), max_wait_ms=(0.0, 1.0), load=(0.3,),
                  n_requests=200, seed=5, probe_speed=True)
    assert probed == [4, 8, 4, 4, 8, 8]
    assert df["speed_ratio"].tolist() == pytest.approx([0.9, 1.1, 1.2, 0.9])
    summary = fidelity_summary(df)
    assert summary["speed_ratio_p5"] == pytest.approx(np.percentile([0.9, 1.1, 1.2, 0.9], 5))
    assert summary["speed_ratio_p95"] == pytest.approx(np.percentile([0.9, 1.1, 1.2, 0.9], 95))
    assert summary["speed_corr_err_latency_ms_p50"] == pytest.approx(
        np.corrcoef(df["speed_ratio"], df["err_latency_ms_p50"])[0, 1])
    # Without the probe: no column, no summary of it.
    assert not any(k.startswith("speed") for k in fidelity_summary(
        df.drop(columns="speed_ratio")))


def test_each_row_is_also_simulated_at_the_speed_the_rows_before_it_ran(service):
    """``speed_history``: each row simulated at the median ratio of the last
    ``TRACKED_RUNS`` runs before it (those given, then the grid's own), and the list
    extended with each row's."""
    import batchsim.fidelity as fid

    assert fid.TRACKED_RUNS == 5
    history = [1.3, 0.9, 1.1, 1.5, 0.7, 1.2]
    runs = []
    df = fidelity(sleepy, service, max_batch_size=(8,), max_wait_ms=(0.0, 1.0), load=(0.5,),
                  n_requests=300, seed=7, runs=runs, speed_history=history)
    first, second = df["worker_time_ratio"].tolist()
    assert history == [1.3, 0.9, 1.1, 1.5, 0.7, 1.2, first, second]
    # The 1.3 is no longer kept: the median of all six would be 1.15.
    assert df["tracked_ratio"].tolist() == pytest.approx([1.1, np.median([1.1, 1.5, 0.7, 1.2,
                                                                           first])])
    for run, row in zip(runs, df.to_dict("records"), strict=True):
        tracked = fid.simulate_schedule(run["real"], run["policy"],
                                        at_speed(service, row["tracked_ratio"]), run["seed"])
        assert row["tracked_err_latency_ms_p99"] == pytest.approx(
            bs.compare(run["real"], tracked).table["rel_error"]["latency_ms_p99"])
    assert fidelity_summary(df)["median_abs_tracked_latency_ms_p50"] == pytest.approx(
        df["tracked_err_latency_ms_p50"].abs().median())


def test_a_grid_given_a_batcher_serves_every_run_as_that_batcher_does(service, monkeypatch):
    """The pipeline of threads on the CPU (not its default): each row's run, its repeat
    and the speed probes go through one-worker batchers like the one given."""
    import batchsim.fidelity as fid
    from batchsim.real import DynamicBatcher, run_saturated

    template = DynamicBatcher(sleepy, bs.BatchPolicy(8, 1.0), workers=2, pipeline=True)
    probed = []

    def probe_runs(batcher, n):
        probed.append((batcher.workers, batcher.pipeline))
        return run_saturated(batcher, n)

    monkeypatch.setattr("batchsim.real.run_saturated", probe_runs)
    runs = []
    fidelity(template, service, max_batch_size=(8,), max_wait_ms=(1.0,), load=(0.5,),
             n_requests=200, seed=9, repeat=True, runs=runs, probe_speed=True)
    assert probed == [(1, True), (1, True)]      # at the start, and before the row
    for res in (runs[0]["real"], runs[0]["again"]):
        assert res.workers == 1 and np.isfinite(res.meta["batch_phases_s"][:, 1]).all()
    # Given the model, the CPU's default: a thread per worker, which stages in its run.
    plain, _ = fid.run_pair(sleepy, service, bs.BatchPolicy(8, 1.0), bs.Poisson(2000.0), 100,
                            seed=9)
    assert np.isnan(plain.meta["batch_phases_s"][:, 1]).all()


def test_the_tracked_speed_is_the_median_of_the_runs_it_keeps():
    from batchsim.fidelity import tracked_ratio

    assert tracked_ratio([1.3, 0.9, 1.1, 1.0], kept=2) == pytest.approx(1.05)
    assert tracked_ratio([1.3, 0.9, 1.1, 1.0], kept=None) == pytest.approx(1.05)
    assert tracked_ratio([1.3, 0.9, 1.1, 1.0], kept=3) == pytest.approx(1.0)
    assert tracked_ratio([], kept=3) == 1.0
    for kept in (0, -1, 2.5):
        with pytest.raises(ValueError, match=f"kept.*{kept}"):
            tracked_ratio([1.0], kept=kept)


def test_with_no_runs_before_it_a_row_is_tracked_at_the_calibrations_own_speed(service):

    df = fidelity(sleepy, service, max_batch_size=(8,), max_wait_ms=(1.0,), load=(0.5,),
                  n_requests=300, seed=8, speed_history=[])
    assert df["tracked_ratio"].tolist() == [1.0]
    for metric in METRICS:
        assert df[f"tracked_err_{metric}"].tolist() == df[f"err_{metric}"].tolist()
    plain = fidelity(sleepy, service, max_batch_size=(8,), max_wait_ms=(1.0,), load=(0.5,),
                     n_requests=300, seed=8)
    assert not any(c.startswith("tracked") for c in plain.columns)


def test_fidelity_summary_counts_rows_where_the_harness_fell_behind_and_sets_them_apart():
    import pandas as pd

    rows = []
    for k, (p50, p99, behind) in enumerate([(0.02, 0.1, False), (-0.04, 0.3, False),
                                             (0.06, -0.2, False), (1.5, 2.0, True)]):
        row = {"max_batch_size": 4, "max_wait_ms": 0.0, "load": 0.1 * k, "rate_rps": 100.0,
               "harness_behind": behind, "err_latency_ms_p50": p50,
               "err_latency_ms_p99": p99}
        row.update({f"err_{m}": 0.01 for m in ("latency_ms_p95", "latency_ms_mean",
                                               "throughput_rps", "mean_batch_size")})
        row["recal_err_latency_ms_p50"] = -0.01 * (k + 1)   # another calibration
        row["speed_err_latency_ms_p50"] = 0.5 * p50          # told the row's speed
        row["share_err_latency_ms_p50"] = -0.01 * k          # the share under the real p50
        row["worker_time_ratio"] = 1.0 + 0.1 * k
        rows.append(row)
    out = fidelity_summary(pd.DataFrame(rows))
    assert out["configurations"] == 4 and out["harness_behind"] == 1
    assert out["median_abs_recalibrated_latency_ms_p50"] == pytest.approx(0.025)
    # (1 - 0.01 (k + 1)) / (1 + p50) - 1 by row: 0.99 / 1.02, 0.98 / 0.96, 0.97 / 1.06 and
    # 0.96 / 2.5, less 1; the median of their sizes lies between the second and third
    assert out["median_abs_between_calibrations_latency_ms_p50"] == pytest.approx(
        (1 - 0.99 / 1.02 + 1 - 0.97 / 1.06) / 2)
    assert out["median_abs_err_latency_ms_p50"] == pytest.approx(0.05)   # all four rows
    assert out["median_abs_kept_latency_ms_p50"] == pytest.approx(0.04)  # the three kept
    assert out["median_abs_kept_latency_ms_p99"] == pytest.approx(0.2)
    assert out["worst"]["err_latency_ms_p99"] == 2.0
    assert out["median_abs_at_speed_latency_ms_p50"] == pytest.approx(0.025)
    assert out["median_abs_share_latency_ms_p50"] == pytest.approx(0.015)
    assert out["worker_time_ratio_p5"] == pytest.approx(1.0 + 0.3 * 0.05)
    assert out["worker_time_ratio_p95"] == pytest.approx(1.0 + 0.3 * 0.95)


def test_a_single_value_is_a_grid_of_one_as_in_sweep():
    policies, loads = checked_grid(16, 1.0, 0.5)
    assert policies == [bs.BatchPolicy(16, 1.0)] and loads == [0.5]
    policies, loads = checked_grid([4, 16], np.array([0.0, 1.0]), (0.2,))
    assert [(p.max_batch_size, p.max_wait_ms) for p in policies] == [
        (4, 0.0), (4, 1.0), (16, 0.0), (16, 1.0)]


def _never_served(x):
    raise AssertionError("fidelity served a request before checking its arguments")


_never_served.input_spec = sleepy.input_spec


@pytest.mark.parametrize("kwargs, match", [
    ({"max_batch_size": (4.7,)}, "max_batch_size must be an integer >= 1, got 4.7"),
    ({"max_batch_size": (True,)}, "max_batch_size must be an integer >= 1, got True"),
    ({"max_wait_ms": (-1.0,)}, "max_wait_ms must be"),
    ({"load": ()}, "load must hold at least one value, got []"),
    ({"load": (0.5, -0.5)}, "load must be a positive finite number, got -0.5"),
    ({"n_requests": 0}, "n_requests must be an integer >= 1, got 0"),
    ({"duration_s": float("inf")}, "duration_s must be a positive finite number, got inf"),
    ({"seed": -1}, "seed must be an integer >= 0"),
    ({"service": bs.AffineService(1.0, 0.1)}, "service must be a CalibratedService"),
])
def test_fidelity_checks_its_arguments_before_anything_runs(service, kwargs, match):
    args = {"service": service, "max_batch_size": (4,), "max_wait_ms": (0.0,),
            "load": (0.5,), **kwargs}
    with pytest.raises(ValueError, match=re.escape(match)):
        fidelity(_never_served, **args)
