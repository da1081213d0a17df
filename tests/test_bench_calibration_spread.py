"""``bench/bench_calibration_spread.py``: how it scores calibrations that disagree."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_calibration_spread import GRID, summarize

ROOT = Path(__file__).resolve().parents[1]


def test_spreads_are_largest_over_smallest_per_configuration_and_size():
    cals = [{"times_ms": [1.0, 2.0], "predictions": {"a": (1.0, 10.0), "b": (2.0, 20.0)}},
            {"times_ms": [1.5, 2.0], "predictions": {"a": (1.2, 10.0), "b": (2.0, 30.0)}},
            {"times_ms": [1.2, 2.2], "predictions": {"a": (1.1, 12.0), "b": (3.0, 20.0)}}]
    s = summarize({1.0: cals})[1.0]
    assert s["calibrations"] == 3
    # p50: a spreads 1.2 / 1.0, b 3.0 / 2.0; p99: a 12 / 10, b 30 / 20.
    assert s["median_p50_spread"] == pytest.approx((0.2 + 0.5) / 2)
    assert s["max_p50_spread"] == pytest.approx(0.5)
    assert s["median_p99_spread"] == pytest.approx((0.2 + 0.5) / 2)
    # p50 CVs: a (1.0, 1.2, 1.1): 0.1 / 1.1; b (2, 2, 3): sqrt(1/3) / (7/3).
    assert s["median_p50_cv"] == pytest.approx((0.1 / 1.1 + (1 / 3) ** 0.5 / (7 / 3)) / 2)
    assert s["s_b_spread"] == pytest.approx([0.5, 0.1])


@pytest.mark.parametrize("varied", ["profile_s", "duration_s"])
def test_quick_run_interleaves_the_lengths_and_writes_every_calibration(tmp_path, varied):
    out = tmp_path / "spread.json"
    subprocess.run([sys.executable, "bench/bench_calibration_spread.py", "--quick",
                    "--calibrations", "2", f"--{varied.replace('_', '-')}", "0.05,0.1",
                    "--out", str(out)],
                   cwd=ROOT, check=True, capture_output=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    report = json.loads(out.read_text())
    assert report["varied"] == varied
    assert set(report["summary"]) == set(report["calibrations"]) == {"0.05", "0.1"}
    n_configs = len(GRID["max_batch_size"]) * len(GRID["max_wait_ms"]) * len(GRID["load"])
    for cals in report["calibrations"].values():
        assert len(cals) == 2
        assert all(len(c["predictions"]) == n_configs for c in cals)
        assert all(p50 <= p99 for c in cals for p50, p99 in c["predictions"].values())
