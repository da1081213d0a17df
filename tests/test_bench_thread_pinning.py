"""``bench/bench_thread_pinning.py``: batcher after batcher, threads placed by the OS or pinned."""

import gzip
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from bench_thread_pinning import arm_summary, instance_speeds

ROOT = Path(__file__).resolve().parents[1]


def test_a_batchers_speed_is_its_batches_against_the_median_of_their_size():
    """Two batchers of each arm; the second pinned one's batches take 1.5x as long, size
    for size, and half of its time is on the device."""
    rows = []
    for arm, instance, slow in (("os", 0, 1.0), ("os", 1, 1.0), ("pinned", 0, 1.0),
                                ("pinned", 1, 1.5)):
        for size, us in ((4, 100.0), (8, 160.0), (8, 160.0)):
            rows.append({"arm": arm, "instance": instance, "size": size,
                         "worker_us": slow * us, "cpu_us": slow * us / 2,
                         "device_us": slow * us / 2})
    per = instance_speeds(pd.DataFrame(rows))
    per["p50_ms"] = [1.0, 1.0, 1.0, 2.0]
    speeds = per.set_index(["arm", "instance"])["speed"]
    assert speeds.to_dict() == {("os", 0): 1.0, ("os", 1): 1.0, ("pinned", 0): 1.0,
                                ("pinned", 1): 1.5}
    s = arm_summary(per)
    assert s["os"]["sd_log_speed"] == 0.0 and s["os"]["batchers"] == 2
    assert s["pinned"]["sd_log_speed"] == pytest.approx(np.std(np.log([1.0, 1.5]), ddof=1))
    assert s["pinned"]["median_cpu_us"] == pytest.approx(np.median([80, 120]))
    assert s["pinned"]["sd_log_p50_ms"] == pytest.approx(np.std(np.log([1.0, 2.0]), ddof=1))
    per["device_us"] = 0.0   # the CPU: a batch ends as it is launched
    assert np.isnan(arm_summary(per)["os"]["sd_log_device_us"])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_quick_run_starts_batchers_of_both_arms_at_every_configuration(tmp_path):
    out = tmp_path / "pinning.json"
    subprocess.run([sys.executable, "bench/bench_thread_pinning.py", "--quick", "--model",
                    "mlp", "--out", str(out)], cwd=ROOT, check=True, capture_output=True,
                   timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    report = json.loads(out.read_text())
    cpus = sorted(os.sched_getaffinity(0))
    assert report["loop_cpu"] == cpus[0] and report["thread_cpus"] == (cpus[1:] or cpus)
    assert set(report["configs"]) == {"b8_w1_load0.2", "b32_w0_load0.5"}
    for config in report["configs"].values():
        assert {arm: s["batchers"] for arm, s in config["summary"].items()} == {
            "os": 2, "pinned": 2}
        assert all(i["batches"] > 0 and i["speed"] > 0 for i in config["instances"])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs to pin to, and Linux")
def test_settle_machine_pin_threads_puts_the_loop_first_and_keeps_the_rest_for_threads():
    """``--pin-threads`` (a bench that offers it): the caller's thread on the first CPU
    of ``--cpu``, the others in ``args.thread_cpus`` for its batchers; one CPU is
    refused, naming the flag."""
    cpus = sorted(os.sched_getaffinity(0))
    script = (
        "import argparse, os, sys\n"
        "sys.path.insert(0, 'bench')\n"
        "from bench_fidelity import add_machine_args, settle_machine\n"
        "p = argparse.ArgumentParser(); add_machine_args(p, pin_threads=True)\n"
        "args = p.parse_args(sys.argv[1:]); settle_machine(args)\n"
        "print('loop', sorted(os.sched_getaffinity(0)), 'threads', args.thread_cpus)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cpu_list = ",".join(map(str, cpus))
    done = subprocess.run([sys.executable, "-c", script, "--cpu", cpu_list, "--pin-threads"],
                          cwd=ROOT, check=True, capture_output=True, text=True, timeout=120,
                          env=env)
    assert f"loop [{cpus[0]}] threads {tuple(cpus[1:])}" in done.stdout
    unpinned = subprocess.run([sys.executable, "-c", script, "--cpu", cpu_list], cwd=ROOT,
                              check=True, capture_output=True, text=True, timeout=120, env=env)
    assert f"loop {cpus} threads None" in unpinned.stdout
    refused = subprocess.run([sys.executable, "-c", script, "--cpu", str(cpus[0]),
                              "--pin-threads"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120, env=env)
    assert refused.returncode != 0
    assert "--pin-threads needs two or more CPUs in --cpu" in refused.stderr


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs to pin to, and Linux")
def test_bench_fidelity_pin_threads_pins_every_batcher_it_serves(tmp_path):
    """``bench_fidelity.py --cpu A,B --pin-threads``: the calibration's batchers and every
    row's have their worker on B (through the template batcher's ``thread_cpus``)."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    subprocess.run([sys.executable, "bench/bench_fidelity.py", "--quick", "--duration-s",
                    "0.02", "--workloads", "poisson", "--out", str(tmp_path / "f.json"),
                    "--save-runs", str(tmp_path / "runs.pkl.gz"), "--cpu",
                    ",".join(map(str, cpus)), "--pin-threads", "--no-keep-awake"],
                   cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                   capture_output=True, timeout=300)
    saved = pickle.loads(gzip.decompress((tmp_path / "runs.pkl.gz").read_bytes()))
    served = [*saved["calibration_runs"], *(run["real"] for run in saved["runs"]["poisson"])]
    assert len(served) > 12
    assert all(res.meta["thread_cpus"] == {"worker-0": cpus[1]} for res in served)
