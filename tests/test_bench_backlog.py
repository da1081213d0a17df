"""``bench/bench_backlog.py``: the simulator's service rate in a backlog against the real one."""

import gzip
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bench_backlog import (
    backlog_by_kind,
    compare_backlogs,
    in_backlog,
    kind_table,
    summarize,
)
from service_fakes import costly_service

import batchsim as bs
from batchsim.calibrate import at_speed

ROOT = Path(__file__).resolve().parents[1]


def saved_runs(speeds) -> dict:
    """What ``bench_fidelity.py --save-runs`` pickles, made by the simulator: a
    spread-free calibration and one arrival set of bursts (their queue builds up), whose
    "real" runs are the simulator's at ``speeds`` times the calibration's time, their
    requests sent by a generator on the loop as ``run_load`` sends them."""
    svc = costly_service()
    policy = bs.BatchPolicy(8, 0.5)
    rate_rps = 0.7 * svc.capacity_rps(8)
    bursts = bs.Bursty(4 * rate_rps, 0.25 * rate_rps, 0.02, 0.06)

    def real(speed, seed):
        scheduled_s = bursts.arrivals_s(3000, np.random.default_rng(seed))
        res = bs.simulate(bs.Trace(scheduled_s), policy, at_speed(svc, speed), seed=seed,
                          sender="loop")
        res.meta["scheduled_s"] = scheduled_s
        return res

    return {"service": svc, "calibration_runs": [],
            "runs": {"bursty": [{"policy": policy, "rate_rps": rate_rps, "seed": k,
                                 "real": real(speed, k)} for k, speed in enumerate(speeds)]}}


def test_a_run_at_the_calibrations_speed_is_served_as_fast_as_simulated():
    saved = saved_runs((1.0, 1.1))
    same, slow = compare_backlogs(saved["service"], saved["runs"]["bursty"])
    # At the calibration's own speed the "real" run is its own simulation, exactly.
    assert same["err_service_rps"] == pytest.approx(0.0, abs=1e-12)
    assert same["err_latency_ms_p50"] == pytest.approx(0.0, abs=1e-12)
    assert same["real"] == same["sim"]
    assert same["real"]["time_over_typical"] == pytest.approx(1.0, rel=1e-9)
    assert same["real"]["batches"] >= 50
    # 1.1 times as slow: every batch takes 1.1 times its typical time; the simulator
    # serves the backlog faster and predicts a lower p50.
    assert slow["real"]["time_over_typical"] == pytest.approx(1.1, rel=1e-9)
    assert slow["sim"]["time_over_typical"] == pytest.approx(1.0, rel=1e-9)
    assert slow["err_service_rps"] > 0.02 and slow["err_latency_ms_p50"] < 0


def test_the_kind_table_takes_each_rows_speed_out():
    """Simulated "real" runs, spread-free, at 1 and 1.1 times the calibration's time:
    told its row's speed, every batch takes its typical time, in a backlog or not."""
    saved = saved_runs((1.0, 1.1))
    table = kind_table(saved["service"], saved["runs"]["bursty"])
    np.testing.assert_allclose(table["told_ms"], table["typical_ms"], rtol=1e-9)
    assert 50 <= table["backlog"].sum() < len(table)
    # A kind: max_batch_size / size / requests received / the generator's turns / idle time.
    assert table["kind"].str.count("/").eq(4).all() and table["kind"].str.startswith("8/").all()
    kind = backlog_by_kind(table)
    assert kind["backlog_over_kind"] == pytest.approx(1.0, rel=1e-9)
    assert kind["backlog_told"] == pytest.approx(1.0, rel=1e-9)


def test_a_backlog_of_slow_kinds_is_not_slow_for_its_kinds():
    import pandas as pd

    def batches(kind, n, typical_ms, ratio, backlog):
        return pd.DataFrame({"kind": [kind] * n, "typical_ms": typical_ms,
                             "told_ms": ratio * typical_ms, "backlog": backlog})

    # Outside the backlog: kind a at 1.0x (40 batches of 1 ms), kind b at 1.2x (40 of
    # 2 ms), kind r at 2.0x (10 batches of 1 ms: too few to stand for their kind).
    others = [batches("a", 40, 1.0, 1.0, False), batches("b", 40, 2.0, 1.2, False),
              batches("r", 10, 1.0, 2.0, False)]
    other_told = (40 + 96 + 20) / (40 + 80 + 10)
    table = pd.concat([*others, batches("a", 10, 1.0, 1.0, True),
                       batches("b", 30, 2.0, 1.2, True)])
    kind = backlog_by_kind(table)
    # Slower than the others (mostly of kind b), as fast as the others of its kinds:
    # totals of time, each batch weighted by its typical time.
    assert kind["backlog_told"] == pytest.approx((10 + 72) / 70)
    assert kind["other_told"] == pytest.approx(other_told)
    assert kind["expected_from_kind"] == pytest.approx((10 + 72) / 70)
    assert kind["backlog_over_kind"] == pytest.approx(1.0) and kind["covered"] == 1.0
    # Its kind-a batches 10% slower, and five of kind r (read at the others' overall
    # ratio, not at the 2.0x of the ten r outside it).
    table = pd.concat([*others, batches("a", 10, 1.0, 1.1, True),
                       batches("b", 30, 2.0, 1.2, True), batches("r", 5, 1.0, 3.0, True)])
    kind = backlog_by_kind(table)
    assert kind["backlog_told"] == pytest.approx((11 + 72 + 15) / 75)
    assert kind["expected_from_kind"] == pytest.approx((10 + 72 + 5 * other_told) / 75)
    assert kind["covered"] == pytest.approx(40 / 45)
    assert backlog_by_kind(pd.concat(others)) == {"backlog_batches": 0}


def test_a_backlog_is_two_full_batches_waiting_before_the_last_arrival():
    """Batches of up to 2 from one worker, by hand: waiting at each start is what
    arrived by then (an arrival at the very instant included; rejected arrivals never
    wait) less what earlier batches took."""
    from batchsim.result import RunRecorder

    arrival_s = np.array([0.0] * 4 + [0.5] * 5 + [1.0] * 5)
    rec = RunRecorder(arrival_s, 1)
    rec.reject(3)
    starts = [([0, 1], 0.0), ([2], 0.1), ([4, 5], 0.5), ([6, 7], 0.6), ([8], 0.7),
              ([9, 10], 1.0), ([11, 12], 1.1), ([13], 1.2)]
    for ids, start_s in starts:
        rec.dispatch(ids, start_s, start_s + 0.05, 0, bs.policy.SIZE)
    res = rec.result()
    # Waiting at the starts: 3 (four arrived, one rejected), 1, 5, 3, 1; then 5 at the
    # last arrival, which is not a backlog (the generator has sent everything), 3, 1.
    assert in_backlog(res, np.arange(8)).tolist() == [False, False, True] + [False] * 5
    assert in_backlog(res, [2, 0]).tolist() == [True, False]


def test_summary_takes_medians_and_correlates_the_errors():
    def row(err_rate, err_p50, real_time):
        return {"err_service_rps": err_rate, "err_latency_ms_p50": err_p50,
                "real": {"time_over_typical": real_time}, "sim": {"time_over_typical": 1.0}}

    s = summarize([row(0.1, -0.3, 1.1), row(0.02, -0.05, 1.02), row(0.05, 0.2, 1.2)])
    assert s["rows"] == 3 and s["median_err_service_rps"] == pytest.approx(0.05)
    assert s["median_abs_err_latency_ms_p50"] == pytest.approx(0.2)
    assert s["median_real_time_over_typical"] == pytest.approx(1.1)
    assert s["median_sim_time_over_typical"] == pytest.approx(1.0)
    assert s["corr_service_rps_latency_p50"] == pytest.approx(
        np.corrcoef([0.1, 0.02, 0.05], [-0.3, -0.05, 0.2])[0, 1])
    assert summarize([]) == {"rows": 0}


def test_script_reads_a_pickle_and_writes_json(tmp_path):
    runs = tmp_path / "runs.pkl.gz"
    runs.write_bytes(gzip.compress(pickle.dumps(saved_runs((1.0, 1.1, 0.95)))))
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "bench/bench_backlog.py", str(runs), "--out",
                           str(out)], cwd=ROOT, check=True, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "median over 3 rows" in done.stdout and "backlog by kind" in done.stdout
    report = json.loads(out.read_text())
    assert report["bursty"]["summary"]["rows"] == 3
    assert report["bursty"]["by_kind"]["backlog_over_kind"] == pytest.approx(1.0, rel=1e-9)
    # The slow row's error is the largest: the simulator serves it fastest.
    errors = [r["err_service_rps"] for r in report["bursty"]["rows"]]
    assert errors.index(max(errors)) == 1


def test_script_sets_several_pickles_backlogs_against_their_kinds(tmp_path):
    paths = []
    for name, speeds in (("slow", (1.1, 1.2)), ("fast", (0.9,))):
        paths.append(tmp_path / f"{name}.pkl.gz")
        paths[-1].write_bytes(gzip.compress(pickle.dumps(saved_runs(speeds))))
    out = tmp_path / "kinds.json"

    def bench(*args):
        return subprocess.run([sys.executable, "bench/bench_backlog.py", *map(str, args)],
                              cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})

    assert bench("--kind-only", *paths, "--out", out).returncode == 0
    report = json.loads(out.read_text())
    assert list(report) == ["slow", "fast"] and list(report["fast"]) == ["bursty"]
    for grid in report.values():
        assert grid["bursty"]["backlog_over_kind"] == pytest.approx(1.0, rel=1e-9)
    refused = bench(*paths)
    assert refused.returncode == 2 and "several pickles need --kind-only" in refused.stderr
