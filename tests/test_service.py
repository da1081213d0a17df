"""Service models: s(b), jitter, capacity, JSON round trips."""

import json
import math
import re

import numpy as np
import pytest

import batchsim as bs
from batchsim.service import service_from_dict


def test_affine_mean_and_capacity():
    s = bs.AffineService(base_ms=2.0, per_item_ms=0.5)
    np.testing.assert_allclose(s.mean_ms([1, 4, 8]), [2.5, 4.0, 6.0])
    assert s.mean_s(4) == pytest.approx(0.004)
    assert s.capacity_rps(8) == pytest.approx(8 / 0.006)
    assert s.capacity_rps(8, workers=3) == pytest.approx(3 * 8 / 0.006)


def test_profile_interpolates_and_extrapolates_linearly():
    p = bs.ProfileService([1, 4, 8], [1.0, 1.0, 3.0])
    np.testing.assert_allclose(p.mean_ms([1, 2, 4, 6, 8, 10, 16]), [1, 1, 1, 2, 3, 4, 7])
    # Below the smallest measured size the first segment is extended.
    q = bs.ProfileService([2, 4], [2.0, 3.0])
    assert q.mean_ms(1) == pytest.approx(1.5)


@pytest.mark.parametrize("cv", [0.1, 0.5, 1.0])
def test_jitter_has_mean_one_and_the_requested_cv(cv):
    f = bs.AffineService(1.0, 0.1, jitter_cv=cv).jitter_factors(np.random.default_rng(0), 200_000)
    se_mean = cv / math.sqrt(f.size)
    assert abs(f.mean() - 1) < 5 * se_mean
    assert abs(f.std() / f.mean() - cv) < 0.05 * cv
    assert np.all(f > 0)


def test_no_jitter_draws_nothing():
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    assert bs.AffineService(1.0, 0.1).jitter_factors(rng, 10) is None
    assert rng.bit_generator.state == state


def test_json_round_trip_keeps_metadata(tmp_path):
    p = bs.ProfileService([1, 8, 32], [0.5, 0.6, 1.2], jitter_cv=0.05,
                          metadata={"device": "cpu", "model": "mlp", "dtype": "float32",
                                    "torch": "2.13.0", "date": "2026-11-26"})
    p.save(tmp_path / "p.json")
    q = bs.load_service(tmp_path / "p.json")
    assert q == p and q.metadata["device"] == "cpu"
    a = bs.AffineService(1.9, 0.14, 0.2)
    a.save(tmp_path / "a.json")
    assert bs.load_service(tmp_path / "a.json") == a


@pytest.mark.parametrize("make, name", [
    (lambda: bs.AffineService(-1.0, 0.1), "base_ms"),
    (lambda: bs.AffineService(1.0, math.nan), "per_item_ms"),
    (lambda: bs.AffineService(0.0, 0.0), "base_ms"),
    (lambda: bs.AffineService(1.0, 0.1, jitter_cv=-0.1), "jitter_cv"),
    (lambda: bs.ProfileService([], []), "batch_sizes"),
    (lambda: bs.ProfileService([1, 1], [1.0, 2.0]), "batch_sizes"),
    (lambda: bs.ProfileService([0, 2], [1.0, 2.0]), "batch_sizes"),
    (lambda: bs.ProfileService([1, 2], [1.0]), "times_ms"),
    (lambda: bs.ProfileService([1, 2], [1.0, -2.0]), "times_ms"),
    (lambda: bs.ProfileService([1], None), "times_ms must be a sequence of numbers, got None"),
    (lambda: bs.ProfileService([1, 2], ["1", "2"]), "times_ms must be a sequence of numbers"),
    (lambda: bs.ProfileService([1, 2], [True, True]), "times_ms must be a sequence of numbers"),
    (lambda: bs.ProfileService([True, 2], [1.0, 2.0]), "batch_sizes must be an integer >= 1, "
                                                       "got True"),
    (lambda: bs.AffineService(1.0, 0.1).capacity_rps(0), "max_batch_size"),
    (lambda: bs.load_service("no-such-profile"), "path"),
    (lambda: service_from_dict({"kind": "affine", "base_ms": 1.0}),
     "a service model of kind 'affine' needs the key 'per_item_ms', got keys"),
    (lambda: service_from_dict([1, 2]), "a service model is a dict with a 'kind'"),
])
def test_bad_service_raises_naming_the_parameter(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_load_service_names_a_path_it_cannot_read(tmp_path):
    """A path with a folder is only a path: no shipped profile of the same name stands
    in for a missing file; a folder or a file of something else is refused by name."""
    shipped = bs.shipped_profiles()[0]
    with pytest.raises(ValueError, match="neither a file nor a shipped profile"):
        bs.load_service(tmp_path / "missing" / f"{shipped}.json")
    assert bs.load_service(f"{shipped}.json") == bs.load_service(shipped)
    with pytest.raises(ValueError, match=f"path {str(tmp_path)!r} is not a file"):
        bs.load_service(tmp_path)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="notes.txt' holds no service model JSON"):
        bs.load_service(tmp_path / "notes.txt")
    for bad in (None, 5):
        with pytest.raises(ValueError, match=f"path must be a file path or a shipped "
                                             f"profile's name, got {bad}"):
            bs.load_service(bad)


AFFINE = {"kind": "affine", "base_ms": 1.0, "per_item_ms": 0.1}


@pytest.mark.parametrize("saved, says", [
    ({"kind": "calibrated", "model": AFFINE, "per_batch_ms": 0, "per_item_ms": 0,
      "jitter_quantiles": [], "costs": {"bogus": 1}}, "costs must be a dict of ["),
    ({"kind": "calibrated", "model": AFFINE, "per_batch_ms": 0, "per_item_ms": 0,
      "jitter_quantiles": None, "costs": {}}, "jitter_quantiles must be"),
    ({"kind": "profile", "batch_sizes": [1, 2], "times_ms": [1, 2], "metadata": [1]},
     "metadata must be a dict, got [1]"),
])
def test_a_malformed_saved_model_is_refused_naming_the_file_and_the_key(saved, says,
                                                                       tmp_path):
    (tmp_path / "m.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=re.escape(f"path {str(tmp_path / 'm.json')!r}: ")
                       + ".*" + re.escape(says)):
        bs.load_service(tmp_path / "m.json")


def test_shipped_profiles_load():
    for name in bs.shipped_profiles():
        s = bs.load_service(name)
        assert s.metadata.get("device") and s.metadata.get("model")
        assert np.all(s.mean_ms(np.arange(1, 65)) > 0)


def test_a_one_point_profile_may_be_given_as_numbers():
    assert bs.ProfileService(8, 2.0) == bs.ProfileService((8,), (2.0,))


def test_jitter_second_moment_is_one_plus_cv_squared():
    """Lognormal ``f = exp(N(-s2/2, s2))``, ``s2 = log(1 + cv^2)``, has ``E[f^k] =
    exp(k (k - 1) s2 / 2)``: ``E[f^2] = 1 + cv^2`` and ``E[f^4] = (1 + cv^2)^6``, so the
    mean of ``n`` squares has SE ``sqrt(((1 + cv^2)^6 - (1 + cv^2)^2) / n)`` (0.0015 at
    cv=0.5, n=1e6). Checked within 5 SE; cv^2 taken 8% too large (E[f^2] off by 0.02) is 13 SE."""
    cv, n = 0.5, 1_000_000
    f = bs.AffineService(1.0, 0.1, jitter_cv=cv).jitter_factors(np.random.default_rng(1), n)
    m2 = 1 + cv**2
    se = math.sqrt((m2**6 - m2**2) / n)
    assert abs(np.mean(f**2) - m2) < 5 * se


def test_a_profile_extrapolated_below_zero_keeps_a_positive_floor():
    """Extending the first segment of [2, 4] -> [1, 3] ms down to b=1 gives 0 ms; the
    model floors it at a thousandth of its smallest time (1 us), and a run with it works."""
    p = bs.ProfileService([2, 4], [1.0, 3.0])
    assert p.mean_ms(1) == pytest.approx(1e-3)
    np.testing.assert_allclose(p.mean_ms([0, 1, 2, 3]), [1e-3, 1e-3, 1.0, 2.0])
    res = bs.simulate(bs.Trace([0.0, 0.5, 1.0]), bs.BatchPolicy(1, 0.0), p)
    assert res.summary()["n_completed"] == 3
    np.testing.assert_allclose(res.end_s - res.start_s, 1e-6, rtol=1e-6)
