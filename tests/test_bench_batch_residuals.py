"""``bench/bench_batch_residuals.py``: a saved fidelity run taken apart, batch by batch."""

import gzip
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bench_batch_residuals import analyze, label_bins, phase_spread
from service_fakes import costly_service

import batchsim as bs
from batchsim.calibrate import at_speed

ROOT = Path(__file__).resolve().parents[1]

#: The speeds the rows of the constructed arrival set are simulated at, in row order.
SPEEDS = (1.0, 1.2, 0.9, 1.1, 1.05)


def saved_runs() -> dict:
    """What ``bench_fidelity.py --save-runs`` pickles, made by the simulator: a
    spread-free calibration (``costly_service``), its runs at its own speed and one
    arrival set whose rows ran at ``SPEEDS``; the second calibration is 1.25 times as
    slow."""
    svc = costly_service()
    policy = bs.BatchPolicy(8, 0.5)
    rate_rps = 0.6 * svc.capacity_rps(8)

    def run(speed, seed):
        return bs.simulate(bs.Poisson(rate_rps), policy, at_speed(svc, speed),
                           n_requests=1500, seed=seed)

    return {"service": svc, "recalibration": at_speed(svc, 1.25),
            "calibration_runs": [run(1.0, 0), run(1.0, 1)],
            "runs": {"poisson": [{"policy": policy, "rate_rps": rate_rps, "seed": k,
                                  "real": run(speed, k)} for k, speed in enumerate(SPEEDS)]}}


def test_every_group_reads_the_speed_its_rows_ran_at():
    saved = saved_runs()
    report = analyze(saved)
    for column, groups in report["calibration_runs"].items():
        if column != "size_by_idle":
            for cell in groups.values():
                assert cell["median_ratio"] == pytest.approx(1.0, rel=1e-9)
    # Rows at their own speeds, each the same in every cell of size x idle time: no
    # pattern in the calibration's runs, and in the set only the mix of rows per cell.
    assert report["calibration_runs"]["size_by_idle"]["max_abs_log"] == pytest.approx(
        0.0, abs=1e-9)
    assert report["calibration_runs"]["size_by_idle"]["cells"] >= 3
    poisson = report["poisson"]
    # Simulated runs do not say when a worker picked its batch up.
    assert all(np.isnan([c["median_pickup_ms"], c["after_pickup_share"]]).all()
               for c in poisson["received_bin"].values())
    assert set(poisson["trigger"]) == {"size", "timeout"}
    assert sum(c["batches"] for c in poisson["size_bin"].values()) == sum(
        run["real"].n_batches - 2 for run in saved["runs"]["poisson"])
    assert poisson["phase_spread"] == {}   # nor when it launched each batch
    speeds = poisson["row_speeds"]
    np.testing.assert_allclose(speeds["median_ratio"], SPEEDS, rtol=1e-9)
    assert speeds["lag1_corr"] == pytest.approx(np.corrcoef(SPEEDS[:-1], SPEEDS[1:])[0, 1])
    assert speeds["halves_corr"] == pytest.approx(1.0)
    assert speeds["half_diff_sd"] == pytest.approx(0.0, abs=1e-12)
    assert speeds["sd"] == pytest.approx(np.std(SPEEDS, ddof=1))
    # Against a calibration 1.25 times as slow, every row reads 1.25 times as fast.
    again = analyze(saved, recalibration=True)["poisson"]["row_speeds"]
    np.testing.assert_allclose(again["median_ratio"], np.array(SPEEDS) / 1.25, rtol=1e-9)


def test_runs_with_the_generators_turns_group_by_requests_and_turns():
    """A sender on the loop records its turns: every batch falls in one group of
    requests received x turns, each reading the calibration's own speed."""
    svc = costly_service()
    policy = bs.BatchPolicy(8, 0.0)
    runs = [bs.simulate(bs.Poisson(0.8 * svc.capacity_rps(8)), policy, svc,
                        n_requests=1500, seed=k, sender="loop") for k in range(2)]
    saved = {"service": svc, "calibration_runs": runs, "runs": {}}
    cells = analyze(saved)["calibration_runs"]["received_turns"]
    assert sum(c["batches"] for c in cells.values()) == sum(r.n_batches - 2 for r in runs)
    assert "0 in 0 turns" in cells and any(k.endswith("in 2 turns") for k in cells)
    for cell in cells.values():
        assert cell["median_ratio"] == pytest.approx(1.0, rel=1e-9)
    assert "received_turns" not in analyze(saved_runs())["poisson"]


def test_size_by_idle_reads_how_far_cells_stray_from_the_median():
    """Three cells of size x idle time with known ratios (and one too small to read):
    each cell's |log| off the whole table's median, weighted by its batches."""
    import pandas as pd
    from bench_batch_residuals import size_by_idle

    cells = [("1", "a", 1.2, 30), ("1", "b", 1.0, 50), ("32-63", "a", 0.8, 20),
             ("32-63", "b", 5.0, 19)]
    table = pd.DataFrame([(s, i, r) for s, i, r, n in cells for _ in range(n)],
                         columns=["size_bin", "idle_bin", "ratio"])
    got = size_by_idle(table, min_batches=20)
    assert got["cells"] == 3
    off = np.abs(np.log([1.2, 1.0, 0.8]))          # the table's median ratio is 1.0
    assert got["mean_abs_log"] == pytest.approx(np.average(off, weights=[30, 50, 20]))
    assert got["max_abs_log"] == pytest.approx(np.log(1.25))
    assert np.isnan(size_by_idle(table, min_batches=100)["mean_abs_log"])


def test_phase_spread_says_which_part_of_a_batch_moves_from_row_to_row():
    """Two rows of one size: the second's batches take 100 us longer from dispatch to
    launch, the same from launch to the end; a third row of too few batches is left out."""
    import pandas as pd

    table = pd.DataFrame({"row": [0] * 20 + [1] * 20 + [2] * 5, "size_bin": "8-15",
                          "launch_ms": [0.1] * 20 + [0.2] * 20 + [0.9] * 5,
                          "worker_ms": [0.2] * 20 + [0.3] * 20 + [1.0] * 5})
    table["ratio"] = table["worker_ms"] / 0.25
    got = phase_spread(table, min_batches=20)
    assert got["cells"] == 2
    assert got["sd_log_launch"] == pytest.approx(np.std(np.log([0.1, 0.2]), ddof=1))
    assert got["sd_log_ratio"] == pytest.approx(np.std(np.log([0.2, 0.3]), ddof=1))
    assert got["sd_log_device"] == pytest.approx(0.0, abs=1e-12)
    assert got["launch_share"] == pytest.approx(np.median([0.5, 2 / 3]))
    assert phase_spread(table.assign(launch_ms=np.nan)) == {}


def test_bins_are_named_by_their_ends_in_order():
    bins = label_bins([0, 1, 3, 4, 15, 16, 64, 500], (0, 1, 2, 4, 16, 64))
    assert list(bins) == ["0", "1", "2-3", "4-15", "4-15", "16-63", "64+", "64+"]
    assert list(bins.categories) == ["0", "1", "2-3", "4-15", "16-63", "64+"]


def test_script_reads_a_pickle_and_writes_json(tmp_path):
    runs = tmp_path / "runs.pkl.gz"
    runs.write_bytes(gzip.compress(pickle.dumps(saved_runs())))
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "bench/bench_batch_residuals.py", str(runs),
                           "--out", str(out)], cwd=ROOT, check=True, capture_output=True,
                          text=True, timeout=120, env=env)
    assert "consecutive rows' correlation" in done.stdout
    assert "size x idle: cells off the part's median by" in done.stdout
    assert set(json.loads(out.read_text())) == {"calibration_runs", "poisson"}
    saved = saved_runs()
    del saved["recalibration"]
    runs.write_bytes(gzip.compress(pickle.dumps(saved)))
    refused = subprocess.run([sys.executable, "bench/bench_batch_residuals.py", str(runs),
                              "--recalibration"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120, env=env)
    assert refused.returncode != 0 and "has no second calibration" in refused.stderr


def test_class_use_counts_each_size_class_in_its_own_run():
    saved = saved_runs()
    report = analyze(saved)["calibration_runs"]["class_use"]
    # Classes are powers of two (ceil log2 of the size), counted afresh in every run from
    # its first batch; the first two batches warm the worker up and are left out.
    uses = {"1": 0, "2": 0, "3+": 0}
    for res in saved["calibration_runs"]:
        seen = {}
        for k, c in enumerate(np.ceil(np.log2(res.size))):
            seen[c] = seen.get(c, 0) + 1
            if k >= 2:
                uses[str(seen[c]) if seen[c] < 3 else "3+"] += 1
    assert {use: cell["batches"] for use, cell in report.items()} == uses
    assert uses["1"] >= 2 and uses["2"] >= 2
    # A spread-free calibration's own runs: no batch holds its worker twice its time.
    assert all(cell["over_2x_share"] == 0 for cell in report.values())


def test_pinned_allocations_are_reported_where_the_runs_counted_them():
    saved = saved_runs()
    report = analyze(saved)
    assert report["calibration_runs"]["pinned_allocs"] == {}  # simulated: not counted
    for k, run in enumerate(saved["runs"]["poisson"]):
        run["real"].meta["pinned_host_allocs"] = k % 2
    assert analyze(saved)["poisson"]["pinned_allocs"] == {"per_run": [0, 1, 0, 1, 0],
                                                          "total": 2}
