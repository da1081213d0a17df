"""The GPU session script's code paths, in its CPU dry-run mode (tiny models, seconds)."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from bench_gpu import VARIANTS

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


def test_session_script_runs_the_bench_within_its_budget_and_skips_the_profiles(tmp_path):
    env = {**os.environ, "BATCHSIM_GPU_DRY": "1", "OUT": str(tmp_path), "BUDGET_S": "1",
           "PYTHON": sys.executable}
    env.pop("BATCHSIM_GPU_PROFILES", None)
    log = subprocess.run(["bash", "bench/gpu_session.sh"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "bench exit 0" in log and "profiles exit" not in log
    assert "saturated throughput" in log and (tmp_path / "bench.log").exists()
    assert not list(tmp_path.glob("*compute_only.json"))
    report = json.loads((tmp_path / "bench_gpu_cpu.json").read_text())
    assert report["dry_run"] and report["errors"] == [] and report["warmup_frac"] > 0
    (row,) = report["results"]           # the first configuration, then out of time
    assert report["skipped"] and (row["model"], row["dtype"]) == ("encoder", "bfloat16")
    assert row["offline_peak_rps"] > 0 and row["naive"]["throughput_rps"] > 0
    assert set(row["dynamic"]) == {v[0] for v in VARIANTS} and row["best"] in row["dynamic"]
    pipe = row["dynamic"][VARIANTS[0][0]]
    assert pipe["n_failed"] == 0 and set(pipe["phases_ms"]) == {
        "pickup", "stage", "launch", "finish", "release"}
    assert set(row["loads"]) == {"0.3", "0.7"}
    assert row["loads"]["0.3"]["dynamic"]["variant"] == row["best"]


def test_bench_runs_only_the_configurations_named(tmp_path):
    dry_run("bench", tmp_path, "--only", "mlp/8")
    report = json.loads((tmp_path / "bench_gpu_cpu.json").read_text())
    assert [(r["model"], r["max_batch_size"]) for r in report["results"]] == [("mlp", 8)]


def unpacked(archive: Path, folder: Path) -> Path:
    """The ``parts`` folder of a ``BATCHSIM_GPU_PACK=1`` archive, extracted."""
    with tarfile.open(archive) as packed:
        packed.extractall(folder, filter="data")
    return folder / "parts"


def test_session_script_skips_the_bench_and_measures_placements_packed(tmp_path):
    """``BATCHSIM_GPU_PACK=1``: the parts write under a temporary folder, packed into one
    ``$OUT/all.tar.gz`` (a device machine may hand back only a few files), which is all
    ``$OUT`` holds. Placements of
    the threads, and batcher after batcher with them pinned or not
    (``BATCHSIM_GPU_PINNING=1``), or with one worker through the pipeline or a thread
    (``BATCHSIM_GPU_ONE_WORKER=1``)."""
    env = {**os.environ, "BATCHSIM_GPU_DRY": "1", "OUT": str(tmp_path), "PYTHON": sys.executable,
           "BATCHSIM_GPU_BENCH": "0", "BATCHSIM_GPU_PLACEMENT": "1", "BATCHSIM_GPU_PACK": "1",
           "BATCHSIM_GPU_PINNING": "1", "BATCHSIM_GPU_ONE_WORKER": "1"}
    log = subprocess.run(["bash", "bench/gpu_session.sh"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "bench exit" not in log and "placement exit 0" in log
    assert "thread_pinning mlp exit 0" in log and "one_worker mlp exit 0" in log
    assert sorted(p.name for p in tmp_path.iterdir()) == ["all.tar.gz"]
    parts = unpacked(tmp_path / "all.tar.gz", tmp_path / "unpacked")
    assert {"placement.log", "placement_gpu_cpu.json", "thread_pinning_mlp.json",
            "one_worker_mlp.json"} <= {p.name for p in parts.iterdir()}
    pinning = json.loads((parts / "thread_pinning_mlp.json").read_text())
    assert set(pinning["configs"]) == {"b8_w1_load0.2", "b32_w0_load0.5"}
    one_worker = json.loads((parts / "one_worker_mlp.json").read_text())
    assert one_worker["model"] == "standin-mlp" and {
        arm: s["batchers"] for arm, s in one_worker["configs"]["b8_w1_load0.2"]["summary"].items()
    } == {"pipeline": 2, "thread": 2}
    assert not (parts / "bench_gpu_cpu.json").exists()
    report = json.loads((parts / "placement_gpu_cpu.json").read_text())
    placements = {"all CPUs", "1 CPU", "2 CPUs", "4 CPUs", "all, switch 0.5 ms"}
    for row in report["results"]:
        assert row["offline_peak_rps"] > 0
        assert set(row["rps"]) == {v[0] for v in VARIANTS[:2]}
        for rps in row["rps"].values():
            assert set(rps) == placements and all(r > 0 for r in rps.values())


def test_session_script_measures_fidelity_and_takes_the_batches_apart_packed(tmp_path):
    """``BATCHSIM_GPU_FIDELITY=1`` (the CPU dry run takes the path CUDA takes): per model,
    and with ``BATCHSIM_GPU_PAIR=1`` the CNN once more, the fidelity grid with both
    calibrations, their batches against the calibration's prediction and their backlogs
    against the simulator's, in the one archive a device machine hands back; the pickled
    runs beside it (an archive that holds them all outgrows what a machine hands back)."""
    env = {**os.environ, "BATCHSIM_GPU_DRY": "1", "OUT": str(tmp_path), "PYTHON": sys.executable,
           "BATCHSIM_GPU_BENCH": "0", "BATCHSIM_GPU_FIDELITY": "1", "BATCHSIM_GPU_PACK": "1",
           "BATCHSIM_GPU_PAIR": "1"}
    log = subprocess.run(["bash", "bench/gpu_session.sh"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600, check=True).stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "all.tar.gz", "fidelity_cnn_os_placed_runs.pkl.gz", "fidelity_cnn_runs.pkl.gz",
        "fidelity_encoder_runs.pkl.gz"]
    parts = unpacked(tmp_path / "all.tar.gz", tmp_path / "unpacked")
    names = {f"parts/{p.name}" for p in parts.iterdir()}
    for model in ("encoder", "cnn", "cnn_os_placed"):
        assert f"fidelity {model} exit 0" in log and f"batch residuals {model} exit 0" in log
        assert f"backlog {model} exit 0" in log
        assert {f"parts/fidelity_{model}_float32.json",
                f"parts/batch_residuals_{model}_float32.json",
                f"parts/backlog_{model}_float32.json"} <= names
        backlogs = json.loads((parts / f"backlog_{model}_float32.json").read_text())
        assert set(backlogs) == {"poisson", "poisson-seed2", "bursty"}
        report = json.loads((parts / f"batch_residuals_{model}_float32.json").read_text())
        assert set(report) == {"calibration_runs", "poisson", "poisson-seed2", "bursty"}
        assert report["poisson"]["row_speeds"]["rows"] == 12


def test_session_script_exits_1_when_a_part_failed(tmp_path):
    """A part that fails is said in the log and in the script's exit code (the others
    still run): here every part, with a Python that fails at once."""
    env = {**os.environ, "BATCHSIM_GPU_DRY": "1", "OUT": str(tmp_path), "PYTHON": "false"}
    done = subprocess.run(["bash", "bench/gpu_session.sh"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "bench exit 1" in done.stdout
