"""``bench/bench_tracked_level.py``: how far each tracking rule's level is from a row's own."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bench_tracked_level import (
    compare_rules,
    level_errors,
    speeds_in_run_order,
)

ROOT = Path(__file__).resolve().parents[1]


def results_file(*sets) -> dict:
    """A ``bench_fidelity.py`` results file whose arrival sets' rows ran at ``sets``."""
    return {"workloads": {f"set{k}": {"rows": [{"worker_time_ratio": s} for s in speeds]}
                          for k, speeds in enumerate(sets)}}


def test_speeds_come_in_run_order_across_the_arrival_sets():
    assert speeds_in_run_order(results_file([1.0, 1.1], [0.9])) == [1.0, 1.1, 0.9]
    assert speeds_in_run_order({"workloads": {"poisson": {"rows": [{"load": 0.2}]}}}) == []


def test_each_rule_levels_a_row_at_the_median_of_the_rows_it_keeps():
    speeds = [1.0, 1.2, 1.2, 1.2, 0.8]
    log = np.log
    assert level_errors(speeds, 0) == pytest.approx(np.abs(log(speeds)))
    assert level_errors(speeds, 1) == pytest.approx([0, log(1.2), 0, 0, log(1.2 / 0.8)])
    assert level_errors(speeds, None) == pytest.approx(
        [0, log(1.2), log(1.2 / 1.1), 0, log(1.2 / 0.8)])
    # The last two: the median of (1.2, 1.2) for the fourth and the fifth.
    assert level_errors(speeds, 2) == pytest.approx(
        [0, log(1.2), log(1.2 / 1.1), 0, log(1.2 / 0.8)])


def test_a_machine_that_steps_to_another_speed_is_followed_sooner_by_fewer_rows():
    """Ten rows at 1.0, then ten at 1.2: the median of all the rows before stays at 1.0
    through the ten slow rows; the last row alone misses only the first of them."""
    grids = {"step": [1.0] * 10 + [1.2] * 10, "flat": [1.0] * 20}
    report = compare_rules(grids)
    assert report["all before"]["grid_medians"]["step"] == pytest.approx(np.log(1.2) / 2)
    assert report["last 1"]["grid_medians"]["step"] == 0.0
    assert report["last 1"]["grids_closer_than_all_before"] == 1  # the flat grid ties
    assert report["calibration"]["grid_medians"]["flat"] == 0.0


def test_script_reads_results_files_and_skips_those_without_speeds(tmp_path):
    with_speeds, without = tmp_path / "a.json", tmp_path / "b.json"
    with_speeds.write_text(json.dumps(results_file([1.0, 1.1, 1.05, 0.95])))
    without.write_text(json.dumps({"workloads": {"poisson": {"rows": [{"load": 0.2}]}}}))
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "bench/bench_tracked_level.py", str(with_speeds),
                          str(without), "--out", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    assert "1 grids, 4 rows" in run.stdout
    report = json.loads(out.read_text())
    assert report["grids"] == 1 and set(report["rules"]) >= {"all before", "last 5"}
    refused = subprocess.run([sys.executable, "bench/bench_tracked_level.py", str(without)],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "worker_time_ratio" in refused.stderr
