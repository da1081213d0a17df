"""``bench/bench_row_errors.py``: every row's error under one version, and a tally of two."""

import gzip
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bench_row_errors import model_of, row_errors, tally
from test_bench_refit import saved_runs

import batchsim as bs
from batchsim.calibrate import at_speed, refit

ROOT = Path(__file__).resolve().parents[1]


def poisson_saved_runs() -> dict:
    """``saved_runs``, its calibration runs labelled as the Poisson runs they stand for."""
    saved = saved_runs()
    for res in saved["calibration_runs"]:
        res.meta["workload"] = "Poisson(rate_rps=...)"
    return saved


def test_rows_made_by_the_batcher_the_refit_finds_come_out_exact():
    """The "real" rows were simulated with every cost the refit gets back: the median
    row's p50 and p99 errors are nil (``test_bench_refit``)."""
    errors = np.array(row_errors(poisson_saved_runs())["poisson"])
    assert errors.shape == (4, 2)
    assert np.median(np.abs(errors), axis=0) == pytest.approx([0, 0], abs=1e-12)


def test_rows_that_ran_at_other_speeds_come_out_exact_when_told_their_speed():
    """The same rows simulated 20% slower, 10% faster, ...: as they are, the median row
    is off by more than a tenth (a row at 30% load that waits for its batches to fill
    hardly moves); each told the speed its batches ran, the median row is exact. The
    rows are made by the batcher the refit finds (its linger comes from the turns' split,
    not exactly the reaction ``costly_service`` lingers)."""
    saved = poisson_saved_runs()
    truth = refit(saved["service"], saved["calibration_runs"])
    for row, speed in zip(saved["runs"]["poisson"], (1.2, 0.9, 1.1, 0.8), strict=True):
        due_s = row["real"].meta["scheduled_s"]
        row["real"] = bs.simulate(bs.Trace(due_s), row["policy"], at_speed(truth, speed),
                                  seed=row["seed"], sender="loop")
        row["real"].meta["scheduled_s"] = due_s
    raw = np.array(row_errors(saved)["poisson"])
    told = np.array(row_errors(saved, told_speed=True)["poisson"])
    assert np.median(np.abs(raw[:, 0])) > 0.1
    assert np.median(np.abs(told), axis=0) == pytest.approx([0, 0], abs=1e-12)


def test_tracked_rows_run_at_the_speed_of_the_rows_before_them():
    """Every row ran 20% slower than the calibration: the first, simulated at the
    calibration's own speed, is off; each later one, at the median of those before it,
    is exact. Told-the-speed and tracked cannot be asked together."""
    saved = poisson_saved_runs()
    truth = refit(saved["service"], saved["calibration_runs"])
    for row in saved["runs"]["poisson"]:
        due_s = row["real"].meta["scheduled_s"]
        row["real"] = bs.simulate(bs.Trace(due_s), row["policy"], at_speed(truth, 1.2),
                                  seed=row["seed"], sender="loop")
        row["real"].meta["scheduled_s"] = due_s
    tracked = np.abs(np.array(row_errors(saved, tracked=True)["poisson"]))
    assert tracked[0, 0] > 0.01
    assert tracked[1:] == pytest.approx(np.zeros((3, 2)), abs=1e-12)
    with pytest.raises(ValueError, match="exclude each other"):
        row_errors(saved, told_speed=True, tracked=True)


def test_the_tally_counts_rows_and_sets_per_model():
    before = {"grid_mlp": {"a": [[0.1, 0.2], [-0.3, 0.1], [0.05, 0.0]]},
              "grid_cnn": {"a": [[0.1, 0.1]], "b": [[0.2, 0.2]]}}
    after = {"grid_mlp": {"a": [[0.05, 0.3], [0.3, 0.05], [-0.01, 0.0]]},
             "grid_cnn": {"a": [[0.2, 0.1]], "b": [[-0.1, 0.3]]}}
    t = tally(before, after, model_of)
    # MLP: |p50| 0.1 -> 0.05 closer, 0.3 -> 0.3 neither, 0.05 -> 0.01 closer; |p99| one
    # further (0.2 -> 0.3), one closer, one equal; median |p50| 0.1 -> 0.05: it fell.
    assert t["mlp"] == {"p50": [2, 0], "p99": [1, 1], "median_p50": [1, 0, 0]}
    # CNN: set a further at p50 (its median rose), set b closer (fell) and further at p99.
    assert t["cnn"] == {"p50": [1, 1], "p99": [0, 1], "median_p50": [1, 1, 0]}
    assert t["all"] == {"p50": [3, 1], "p99": [1, 2], "median_p50": [2, 1, 0]}
    assert model_of("grid_F_encoder") == "encoder" and model_of("other") == "other"


def test_script_writes_the_rows_then_compares_two_files(tmp_path):
    runs = tmp_path / "grid_mlp.pkl.gz"
    runs.write_bytes(gzip.compress(pickle.dumps(poisson_saved_runs())))
    rows, report = tmp_path / "rows.json", tmp_path / "tally.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "bench/bench_row_errors.py", str(runs), "--out", str(rows)],
                   cwd=ROOT, check=True, capture_output=True, timeout=120, env=env)
    assert list(json.loads(rows.read_text())) == ["grid_mlp"]
    done = subprocess.run([sys.executable, "bench/bench_row_errors.py", "--compare", str(rows),
                           str(rows), "--out", str(report)], cwd=ROOT, check=True,
                          capture_output=True, text=True, timeout=120, env=env)
    assert "rows closer / further p50 0 / 0" in done.stdout
    assert json.loads(report.read_text())["tally"]["mlp"]["median_p50"] == [0, 0, 1]
