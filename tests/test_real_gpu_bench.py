"""The GPU session script's code paths, in its CPU dry-run mode (tiny models, seconds)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import batchsim as bs

ROOT = Path(__file__).resolve().parents[1]


def dry_run(part, out, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "bench/bench_gpu.py", part, "--dry-run",
                           "--out-dir", str(out), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=True).stdout


def test_profiles_part_writes_profiles_and_compares_with_the_reference(tmp_path):
    log = dry_run("profiles", tmp_path)
    prof = bs.load_service(tmp_path / "cpu_tiny-encoder_bfloat16.json")
    assert prof.metadata["model"] == "tiny-encoder" and prof.metadata["dtype"] == "bfloat16"
    compute = json.loads((tmp_path / "cpu_compute_only.json").read_text())
    assert set(compute["s_ms"]) == {f"{m}/{d}" for m in ("mlp", "cnn", "encoder")
                                   for d in ("float32", "bfloat16")}
    assert compute["errors"] == [] and "ref" in log


def test_bench_part_measures_and_stops_at_its_time_budget(tmp_path):
    log = dry_run("bench", tmp_path, "--budget-s", "1")
    report = json.loads((tmp_path / "bench_gpu_cpu.json").read_text())
    assert report["dry_run"] and report["errors"] == []
    (row,) = report["results"]           # the first configuration, then out of time
    assert (row["model"], row["dtype"]) == ("encoder", "bfloat16")
    assert row["offline_peak_rps"] > 0 and row["naive"]["throughput_rps"] > 0
    assert set(row["dynamic"]) == {"2", "4"} and set(row["loads"]) == {"0.3", "0.7"}
    assert report["skipped"] and "saturated throughput" in log
