"""``bench/bench_gpu_clocks.py``: a saved fidelity run set beside a log of the GPU's clocks."""

import gzip
import json
import os
import pickle
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from bench_gpu_clocks import MAX_GAP_S, analyze, read_clocks
from test_bench_batch_residuals import SPEEDS, saved_runs

ROOT = Path(__file__).resolve().parents[1]

#: The calibration's SM clock; each row of the arrival set ran at it over its speed.
TOP_MHZ = 1980.0
#: Wall-clock start of the first run, and the seconds between two runs' starts.
T0_S, APART_S = 1.8e9, 100.0


def timed_saved_runs() -> dict:
    """``saved_runs`` (rows at ``SPEEDS``) with each run's wall-clock start, the
    calibration's two runs first, then the rows, ``APART_S`` apart."""
    saved = saved_runs()
    runs = saved["calibration_runs"] + [run["real"] for run in saved["runs"]["poisson"]]
    for k, res in enumerate(runs):
        res.meta["started_unix_s"] = T0_S + k * APART_S
    return saved


def write_log(path, saved, skip_last_row=False) -> None:
    """A log as ``sample`` writes it, a reading every 50 ms over each run: the
    calibration's at ``TOP_MHZ``, each row's at ``TOP_MHZ`` over its speed (a slower row
    ran at a lower clock). Power reads "[N/A]"; the last line is cut short, as when the
    sampler is stopped."""
    runs = [(res, TOP_MHZ) for res in saved["calibration_runs"]]
    runs += [(run["real"], TOP_MHZ / speed)
             for run, speed in zip(saved["runs"]["poisson"], SPEEDS, strict=True)]
    if skip_last_row:
        runs = runs[:-1]
    lines = []
    for res, mhz in runs:
        for t in res.meta["started_unix_s"] + np.arange(-0.2, res.end_s.max() + 0.2, 0.05):
            stamp = datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
            lines.append(f"{stamp}, {mhz:.1f}, 2619, [N/A], 41, 37")
    lines.append(lines[-1][:15])
    Path(path).write_text("\n".join(lines) + "\n")


def test_each_batch_gets_the_clock_its_run_ran_at(tmp_path):
    saved = timed_saved_runs()
    write_log(tmp_path / "clocks.csv", saved)
    clocks = read_clocks(tmp_path / "clocks.csv")
    assert clocks["power.draw"].isna().all() and (clocks["clocks.mem"] == 2619).all()
    assert np.all(np.diff(clocks["unix_s"]) > 0)
    report = analyze(saved, clocks)
    cal = report["calibration_runs"]
    assert cal["clocked"] == cal["batches"] > 0
    assert cal["sm_mhz_median"] == TOP_MHZ and cal["below_top_share"] == 0.0
    assert cal["median_ratio"] == pytest.approx(1.0, rel=1e-9)
    poisson = report["poisson"]
    rows = poisson["rows"]
    expected_mhz = TOP_MHZ / np.array(SPEEDS)
    np.testing.assert_allclose(rows["sm_mhz_median"], expected_mhz, atol=0.05)
    np.testing.assert_allclose(rows["median_ratio"], SPEEDS, rtol=1e-9)
    assert rows["corr_sm_ratio"] == pytest.approx(np.corrcoef(expected_mhz, SPEEDS)[0, 1],
                                                  abs=1e-4)
    assert rows["corr_sm_ratio"] < -0.9
    by_mhz = poisson["ratio_by_sm_mhz"]
    # 1650, 1980, 2200 MHz alone in their bins; 1800 and 1886 (speeds 1.1, 1.05) share one.
    assert by_mhz["1600-1699"]["median_ratio"] == pytest.approx(1.2, rel=1e-9)
    assert by_mhz["1900-1999"]["median_ratio"] == pytest.approx(1.0, rel=1e-9)
    assert by_mhz["2200-2299"]["median_ratio"] == pytest.approx(0.9, rel=1e-9)
    assert 1.05 - 1e-9 <= by_mhz["1800-1899"]["median_ratio"] <= 1.1 + 1e-9
    assert sum(c["batches"] for c in by_mhz.values()) == poisson["clocked"]


def test_a_gap_in_the_log_leaves_those_batches_without_a_clock(tmp_path):
    saved = timed_saved_runs()
    write_log(tmp_path / "clocks.csv", saved, skip_last_row=True)
    assert APART_S / 2 > MAX_GAP_S   # the last row is far from every reading
    poisson = analyze(saved, read_clocks(tmp_path / "clocks.csv"))["poisson"]
    last = saved["runs"]["poisson"][-1]["real"]
    assert poisson["batches"] - poisson["clocked"] == last.n_batches - 2  # two warm ones
    assert np.isnan(poisson["rows"]["sm_mhz_median"][-1])
    assert np.isfinite(poisson["rows"]["corr_sm_ratio"])  # over the other four rows


def test_runs_without_a_wall_clock_start_and_empty_logs_are_refused(tmp_path):
    saved = timed_saved_runs()
    write_log(tmp_path / "clocks.csv", saved)
    clocks = read_clocks(tmp_path / "clocks.csv")
    del saved["runs"]["poisson"][1]["real"].meta["started_unix_s"]
    with pytest.raises(ValueError, match=r"runs \[1\] .*started_unix_s"):
        analyze(saved, clocks)
    (tmp_path / "empty.csv").write_text("Failed to initialize NVML: Driver Not Loaded\n")
    with pytest.raises(ValueError, match="no readings in .*empty.csv"):
        read_clocks(tmp_path / "empty.csv")


def test_script_writes_json_and_sample_needs_nvidia_smi(tmp_path):
    saved = timed_saved_runs()
    write_log(tmp_path / "clocks.csv", saved)
    (tmp_path / "runs.pkl.gz").write_bytes(gzip.compress(pickle.dumps(saved)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "bench/bench_gpu_clocks.py", str(tmp_path /
                           "runs.pkl.gz"), str(tmp_path / "clocks.csv"), "--out", str(out)],
                          cwd=ROOT, check=True, capture_output=True, text=True, timeout=120,
                          env=env)
    assert "correlation of a row's median clock with its median ratio" in done.stdout
    assert set(json.loads(out.read_text())) == {"calibration_runs", "poisson"}
    no_smi = subprocess.run([sys.executable, "bench/bench_gpu_clocks.py", "sample",
                             str(tmp_path / "log.csv")], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, env={**env, "PATH": str(tmp_path)})
    assert no_smi.returncode != 0 and "nvidia-smi is not on PATH" in no_smi.stderr
