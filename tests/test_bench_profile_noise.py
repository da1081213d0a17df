"""``bench/bench_profile_noise.py``: how it scores a profile's shape and level."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bench_profile_noise import summarize

ROOT = Path(__file__).resolve().parents[1]


def test_shape_deviations_are_from_the_median_long_profile_and_ignore_the_level():
    long = np.array([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [2.0, 4.0, 6.0]])  # median: 1, 2, 3
    short = np.array([[3.0, 6.0, 9.0],      # three times slower, same shape
                      [1.0, 2.0, 6.0]])     # the last size bent
    s = summarize(short, long)
    assert s["long"]["shape_dev_max"] == pytest.approx(0.0)
    assert s["long"]["profiles"] == 3 and s["short"]["profiles"] == 2
    # Levels over the reference's mean (2): 1, 1, 2 and 3, 1.5.
    assert s["long"]["level_p5"] == pytest.approx(1.0)
    assert s["short"]["level_p95"] == pytest.approx(1.5 + 0.95 * 1.5)
    # The bent profile's mean is 3: its shape 1/3, 2/3, 2 against 1/2, 1, 3/2.
    bent = np.abs(np.array([1 / 3, 2 / 3, 2]) / np.array([0.5, 1.0, 1.5]) - 1)
    assert s["short"]["shape_dev_max"] == pytest.approx(bent.max())
    assert s["short"]["shape_dev_p50"] == pytest.approx(np.median(np.r_[np.zeros(3), bent]))


def test_quick_run_writes_its_summary(tmp_path):
    out = tmp_path / "noise.json"
    subprocess.run([sys.executable, "bench/bench_profile_noise.py", "--quick", "--out",
                    str(out)], cwd=ROOT, check=True, capture_output=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    report = json.loads(out.read_text())
    assert set(report["summary"]) == {"short", "long"}
    assert report["summary"]["short"]["profiles"] == 20 * report["summary"]["long"]["profiles"]
