"""``bench/bench_keep_awake.py``: how it reads the machine's speed from timed batches."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bench_keep_awake import WINDOW_S, speed_spread

from batchsim.cpus import can_keep_awake

ROOT = Path(__file__).resolve().parents[1]


def test_speed_spread_reads_each_whole_window_against_the_overall_median():
    # Three whole windows at 100, 100 and 130 us, then a partial one (dropped) at 500 us.
    whole = [np.linspace(w * WINDOW_S, (w + 0.99) * WINDOW_S, 10) for w in range(3)]
    starts = np.r_[np.concatenate(whole), 3 * WINDOW_S + 0.1]
    took = np.r_[np.full(20, 100e-6), np.full(10, 130e-6), 500e-6]
    s = speed_spread(np.array([starts, took]))
    assert s["batches"] == 31 and s["windows"] == 3
    assert s["median_us"] == pytest.approx(100.0)
    assert s["mean_us"] == pytest.approx(1e6 * took.mean())
    assert s["window_sd"] == pytest.approx(np.std([1.0, 1.0, 1.3]))
    assert s["window_p90"] == pytest.approx(np.percentile([1.0, 1.0, 1.3], 90))


@pytest.mark.skipif(not can_keep_awake(), reason="keeping a CPU awake needs root on Linux")
def test_quick_run_times_both_conditions_and_writes_the_ratios(tmp_path):
    out = tmp_path / "awake.json"
    cpu = max(os.sched_getaffinity(0))
    subprocess.run([sys.executable, "bench/bench_keep_awake.py", "--quick", "--model", "mlp",
                    "--cpu", str(cpu), "--out", str(out)], cwd=ROOT, check=True,
                   capture_output=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    report = json.loads(out.read_text())
    (spreads,) = report["rounds"]
    for cond in ("idle", "awake"):
        assert spreads[cond]["windows"] >= 2 and spreads[cond]["median_us"] > 0
    assert report["median_ratios"]["median_us"] == pytest.approx(
        spreads["awake"]["median_us"] / spreads["idle"]["median_us"])


def test_it_refuses_to_run_without_a_cpu_or_kept_awake_throughout():
    for argv in ([], ["--cpu", "0", "--keep-awake"]):
        run = subprocess.run([sys.executable, "bench/bench_keep_awake.py", *argv], cwd=ROOT,
                             capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert run.returncode != 0 and "give --cpu" in run.stderr
