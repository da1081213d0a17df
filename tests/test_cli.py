"""The batchsim command: summaries, JSON, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest

from batchsim.cli import main


def test_simulate_prints_a_summary(capsys):
    assert main(["simulate", "--rate", "1000", "-n", "2000", "--max-batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "latency_ms_p99" in out and "throughput_rps" in out


def test_simulate_json_matches_the_library():
    import batchsim as bs

    main_out = subprocess.run(
        [sys.executable, "-m", "batchsim", "simulate", "--rate", "1500", "-n", "3000",
         "--service", "affine:1.0,0.2", "--max-wait-ms", "2", "--seed", "3", "--json",
         "--slo-ms", "5"], capture_output=True, text=True, check=True).stdout
    got = json.loads(main_out)
    want = bs.simulate(bs.Poisson(1500), bs.BatchPolicy(32, 2.0), bs.AffineService(1.0, 0.2),
                       n_requests=3000, seed=3).summary(slo_ms=5)
    assert got["latency_ms_p99"] == pytest.approx(want["latency_ms_p99"])
    assert got["goodput"] == pytest.approx(want["goodput"])


@pytest.mark.parametrize("argv, words", [
    (["simulate", "--rate", "-5"], "argument --rate: must be a positive finite number, got '-5'"),
    (["simulate", "--rate", "nan"], "argument --rate: must be a positive finite number, got 'nan'"),
    (["simulate", "--rate", "100", "--seed", "-1"],
     "argument --seed: must be an integer >= 0, got '-1'"),
    (["simulate", "--rate", "100", "--service", "cubic:1"], "--service"),
    (["simulate", "--rate", "100", "--max-batch-size", "0"], "max_batch_size"),
    (["simulate", "--rate", "100", "--max-batch-size", "x"], "--max-batch-size"),
    (["simulate", "--rate", "100", "--profile", "missing.json"], "missing.json"),
    (["simulate"], "--rate"),
    (["simulate", "--rate", "100", "--profile", "/"], "path '/' is not a file"),
    (["sweep", "--rate", "100", "--plot", "/"], "argument --plot: '/' is a folder"),
    (["sweep", "--rate", "100", "--plot", "grid.pdfz"],   # refused before the sweep runs
     "argument --plot: 'grid.pdfz': the figure's format comes from its suffix, one of"),
    (["recommend", "--rate", "100", "--slo-ms", "5", "--out", "/no/such/folder/x.csv"],
     "folder '/no/such/folder' of '/no/such/folder/x.csv' does not exist"),
    (["profile", "--model", "mlp", "--out", "p.json", "--threads", "-1"],
     "argument --threads: must be an integer >= 1, got '-1'"),
    (["simulate", "--rate", "100", "--cv", "3"],
     "--cv applies to --arrivals gamma, not poisson: got --cv 3.0"),
    (["simulate", "--rate", "100", "--engine", "fastest"], "argument --engine: invalid choice"),
])
def test_bad_arguments_give_one_line_and_exit_2(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        sys.exit(main(argv))
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and err.startswith("batchsim: error:")


def test_a_write_that_fails_after_the_checks_is_one_line_and_exit_1(capsys):
    """``/dev/full`` passes the checks (its folder is writable) and fails when written."""
    assert main(["sweep", "--rate", "100", "-n", "200", "--max-batch-size", "4",
                 "--max-wait-ms", "0", "--no-progress", "--out", "/dev/full"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("batchsim: error:")


def test_jitter_cv_0_takes_a_shipped_profiles_own_spread_away():
    """A shipped profile carries its measured spread; ``--jitter-cv 0`` asks for none."""
    import batchsim as bs
    from batchsim.service import load_service

    def p99(*flags):
        out = subprocess.run(
            [sys.executable, "-m", "batchsim", "simulate", "--rate", "20000", "-n", "3000",
             "--profile", "h200_encoder_bfloat16", "--json", *flags],
            capture_output=True, text=True, check=True).stdout
        return json.loads(out)["latency_ms_p99"]

    profile = load_service("h200_encoder_bfloat16")
    assert profile.jitter_cv > 0
    steady = bs.simulate(bs.Poisson(20000), bs.BatchPolicy(32, 5.0),
                         bs.ProfileService(profile.batch_sizes, profile.times_ms),
                         n_requests=3000).summary()["latency_ms_p99"]
    assert p99("--jitter-cv", "0") == pytest.approx(steady)
    assert p99() != pytest.approx(steady)
