"""``bench/bench_refit.py``: a saved calibration against its refit, on the same runs."""

import gzip
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bench_refit import compare_fits
from service_fakes import costly_service

import batchsim as bs
from batchsim.calibrate import refit
from batchsim.service import BatcherCosts, CalibratedService

ROOT = Path(__file__).resolve().parents[1]


def saved_runs() -> dict:
    """A ``--save-runs`` pickle made by the simulator: the "real" batcher has every cost
    (``costly_service`` without a wake-up after idle, so that a fit can be exact, with a
    later turn's cost; its sends take no time, so that every cost a batch carries scales
    with the machine's speed, ``at_speed``), the
    saved calibration knew none of the worker's; six calibration runs and four rows.
    The rows' batcher is the refit of the calibration runs itself: it lingers after a
    turn as long as their turns say (a split midway between the delays either side, not
    exactly the truth's reaction), and its costs are the truth's to rounding (1e-14 ms),
    which a near-tie between a batch's end and a turn would otherwise carry into a row."""
    truth = costly_service(idle_ms=(), wake_ms=(), turn_ms=0.004)
    naive = CalibratedService(truth.model, costs=BatcherCosts(
        react_ms=0.02, release_ms=0.03, timer_resolution_ms=1.0, timer_latency_ms=0.05))

    def real(load, wait_ms, seed):
        scheduled_s = bs.Poisson(load * truth.capacity_rps(8)).arrivals_s(
            1500, np.random.default_rng(seed))
        res = bs.simulate(bs.Trace(scheduled_s), bs.BatchPolicy(8, wait_ms), truth,
                          seed=seed, sender="loop")
        res.meta["scheduled_s"] = scheduled_s
        return res

    loads = ((0.1, 0.0), (0.1, 1.0), (0.4, 0.0), (0.4, 1.0), (0.7, 0.0), (0.7, 1.0))
    rows = ((0.3, 0.0), (0.3, 1.0), (0.8, 0.0), (0.8, 1.0))
    calibration_runs = [real(x, w, k) for k, (x, w) in enumerate(loads)]
    truth = refit(naive, calibration_runs)
    return {"service": naive, "calibration_runs": calibration_runs,
            "runs": {"poisson": [{"policy": bs.BatchPolicy(8, w), "seed": 10 + k,
                                  "real": real(x, w, 10 + k)}
                                 for k, (x, w) in enumerate(rows)]}}


def test_the_refit_finds_the_costs_and_predicts_its_own_runs_exactly():
    report = compare_fits(saved_runs())
    truth = costly_service()
    refitted = report["costs"]["refitted"]
    assert refitted["per_batch_ms"] == pytest.approx(truth.per_batch_ms, rel=1e-9)
    assert refitted["first_arrival_ms"] == pytest.approx(truth.costs.first_arrival_ms,
                                                         rel=1e-9)
    assert report["costs"]["saved"]["first_arrival_ms"] == 0.0
    poisson = report["poisson"]
    # The linger after a sender's turn comes from the calibration runs' turns, midway
    # between the delays either side of the split, near the reaction the truth lingered.
    # The refit is the batcher the rows were made with, to rounding (1e-14 ms in its
    # costs): a row's simulation is its run, unless a comparison on a near-tie falls the
    # other way, a batch's end against the loop's wake-up, so that one turn lingers where
    # the other reacts and the rest of the run shifts by their difference (0.07 us).
    # So the rows' latencies are exact, and their throughput, over a run of about a
    # second, within a millionth.
    assert refitted["linger_ms"] == pytest.approx(truth.costs.react_ms, abs=0.0003)
    for metric, errors in poisson["refitted"]["rows"].items():
        exact = metric.startswith("latency")
        assert np.median(np.abs(errors)) < (1e-12 if exact else 1e-6), metric
    # Without the worker's costs the saved calibration predicts the greedy rows too
    # fast (16% and 38% at p50); the rows that wait up to 1 ms for their batches to fill,
    # whose p50 is mostly that wait, come within 4%.
    p50 = poisson["saved"]["rows"]["latency_ms_p50"]
    assert p50[0] < -0.1 and p50[2] < -0.1
    assert abs(p50[1]) < 0.05 and abs(p50[3]) < 0.05
    assert poisson["closer"]["latency_ms_p50"] == {"refitted_closer": 4, "saved_closer": 0}


def test_script_reads_a_pickle_and_writes_json(tmp_path):
    runs = tmp_path / "runs.pkl.gz"
    runs.write_bytes(gzip.compress(pickle.dumps(saved_runs())))
    out = tmp_path / "refit.json"
    done = subprocess.run([sys.executable, "bench/bench_refit.py", str(runs), "--out",
                           str(out)], cwd=ROOT, check=True, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "refitted" in done.stdout
    assert set(json.loads(out.read_text())) == {"costs", "poisson"}
