"""The profiler, its CLI command and the shipped CPU profiles."""

import gc
import json
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from collector import collections_started

import batchsim as bs
from batchsim.cli import main
from batchsim.real import InputSpec, make_model, profile_batcher, profile_model
from batchsim.real.profiler import device_slug, profile_filename


@pytest.fixture(autouse=True)
def one_cpu_thread():
    """Timings on a shared 2-core machine: keep OpenMP threads from fighting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_profile_of_a_tiny_model():
    model = make_model("mlp", size="tiny")
    prof = profile_model(model, [16, 1, 4], repeats=5)
    assert isinstance(prof, bs.ProfileService) and prof.batch_sizes == (1, 4, 16)
    meta = prof.metadata
    assert (np.asarray(meta["p90_ms"]) >= np.asarray(prof.times_ms)).all()
    assert meta["model"] == "tiny-mlp" and meta["dtype"] == "float32"
    assert meta["torch"] == torch.__version__ and meta["end_to_end"] and meta["repeats"] == 5
    for key in ("batcher_overhead_ms", "release_ms", "staging_ms"):
        assert set(meta[key]) == {"1", "16"} and all(map(np.isfinite, meta[key].values()))
    assert all(v > 0 for v in meta["staging_ms"].values())
    assert prof.jitter_cv >= 0 and all(t > 0 for t in prof.times_ms)


def test_profile_saves_and_loads(tmp_path):
    prof = profile_model(make_model("cnn", size="tiny"), [1, 2], repeats=3, overhead=False)
    prof.save(tmp_path / "p.json")
    assert bs.load_service(tmp_path / "p.json") == prof
    assert not {"batcher_overhead_ms", "release_ms", "staging_ms"} & set(prof.metadata)


def test_profile_through_the_batcher_times_full_batches_on_its_worker():
    """A model that sleeps 2 ms + 0.25 ms a request: through the batcher, each size's
    ``s(b)`` is that and the batcher's own work around it (handing over, stacking,
    splitting: sub-millisecond), never less (``time.sleep`` never returns early)."""
    from service_fakes import sleeping_model

    prof = profile_batcher(sleeping_model(2.0, 0.25), [1, 8, 4], repeats=6)
    assert prof.batch_sizes == (1, 4, 8)
    over = np.asarray(prof.times_ms) - (2.0 + 0.25 * np.array([1, 4, 8]))
    assert (over >= 0).all() and (over < 1.0).all(), over
    meta = prof.metadata
    assert meta["through"] == "batcher" and meta["repeats"] == 6
    assert (np.asarray(meta["p90_ms"]) >= np.asarray(prof.times_ms)).all()
    with pytest.raises(ValueError, match="repeats"):
        profile_batcher(sleeping_model(2.0, 0.25), [1], repeats=0)


def test_profile_through_the_batcher_passes_again_until_its_minimum_duration():
    """A pass serves 5 batches of each of two sizes, 2.25-3 ms each, in tens of
    milliseconds: 0.3 s takes several passes, each adding 3 timed batches a size."""
    import time

    from service_fakes import sleeping_model

    t0 = time.perf_counter()
    prof = profile_batcher(sleeping_model(2.0, 0.25), [1, 4], repeats=3, min_duration_s=0.3)
    assert time.perf_counter() - t0 >= 0.3
    timed = prof.metadata["repeats"]
    assert timed > 3 and timed % 3 == 0, timed
    with pytest.raises(ValueError, match="min_duration_s must be"):
        profile_batcher(sleeping_model(2.0, 0.25), [1], min_duration_s=-0.1)


def test_profile_through_the_batcher_lets_each_output_go_when_its_batch_ends():
    """Outputs kept to the end of the profile would make every batch allocate anew (on
    CUDA: pin a new output buffer, slow). Here the model counts, at each call, how many
    earlier outputs are still alive: the last batch's may be (its futures' callbacks can
    run after the next batch starts, and the worker still holds it), older ones not."""
    import weakref

    spec = InputSpec((4,), torch.float32)
    earlier, alive = [], []

    def model(x):
        alive.append(sum(ref() is not None for ref in earlier))
        out = 2 * x
        earlier.append(weakref.ref(out))
        return out

    profile_batcher(model, [8], repeats=10, input_spec=spec)
    assert len(alive) >= 12 and max(alive) <= 2, alive


def test_profile_runs_the_model_off_the_callers_thread_and_raises_its_errors():
    """Like the batcher's workers, the profile never runs the model on the caller's
    thread (BLAS threads left on it slowed a later batcher 2-3x); the model's own error
    reaches the caller."""
    spec = InputSpec((5,), torch.float32)
    ran_on = set()

    def model(x):
        ran_on.add(threading.get_ident())
        return 2 * x

    profile_model(model, [1, 4], repeats=3, input_spec=spec)
    assert ran_on and threading.get_ident() not in ran_on

    def broken(x):
        raise RuntimeError("no kernel for layer 3")

    with pytest.raises(RuntimeError, match="no kernel for layer 3"):
        profile_model(broken, [1], repeats=2, overhead=False, input_spec=spec)


def test_a_profile_takes_one_size_as_a_number():
    prof = profile_model(lambda x: 2 * x, 4, repeats=2, overhead=False,
                         input_spec=InputSpec((5,), torch.float32))
    assert prof.batch_sizes == (4,)


@pytest.mark.parametrize("through", ["model", "batcher"])
@pytest.mark.parametrize("broken", [lambda x: None, lambda x: x[:1]], ids=["None", "one row"])
def test_a_model_without_a_row_per_input_is_refused_not_timed(broken, through):
    """A batcher splits such a batch down to single requests (or fails them all): timed,
    that would be a profile of the error path."""
    spec = InputSpec((5,), torch.float32)
    with pytest.raises(TypeError, match="model_fn must return a tensor with one row per input"):
        if through == "model":
            profile_model(broken, [1, 4], repeats=2, overhead=False, input_spec=spec)
        else:
            profile_batcher(broken, [1, 4], repeats=2, input_spec=spec)


def test_a_profile_through_the_batcher_refuses_a_model_that_fails_there():
    """Rows right when run alone, an error inside the batcher: the error, not a profile."""
    spec = InputSpec((5,), torch.float32)
    calls = []

    def fails_when_served(x):
        calls.append(len(x))
        if len(calls) > 2:  # the two untimed checks pass
            raise RuntimeError("out of workspace")
        return 2 * x

    with pytest.raises(ValueError, match="the model failed while served in batches of 1: "
                                         "RuntimeError: out of workspace"):
        profile_batcher(fails_when_served, [1, 4], repeats=2, input_spec=spec)


def test_a_slow_start_of_the_profile_falls_on_every_size_alike():
    """A model slow for its first timed calls (a thread's first runs, a neighbour's
    burst) -- here 3 ms instead of 0.5 ms for as many calls as one size's repeats. Timed
    size after size, that would be the first size's whole profile; timed in rounds, each
    size gets a third of it, and the medians stay those of the fast calls."""
    import time

    spec = InputSpec((3,), torch.float32)
    sizes, repeats, warmup = [1, 2, 4], 9, 1
    calls = []

    def model(x):
        calls.append(x.shape[0])
        slow = warmup * len(sizes) <= len(calls) - 1 < warmup * len(sizes) + repeats
        time.sleep(0.003 if slow else 0.0005)
        return x

    prof = profile_model(model, sizes, repeats=repeats, warmup=warmup, input_spec=spec,
                         overhead=False)
    assert max(prof.times_ms) < 2.0, prof.times_ms
    assert len(calls) == (warmup + 2 * repeats) * len(sizes)  # a batch before each timed one


def test_a_minimum_duration_times_more_rounds_than_repeats():
    """Rounds of two sizes, each size run twice (untimed, then timed) sleeping 1 ms:
    a round takes at least 4 ms, so 0.2 s holds at most 50 rounds, and more than 3
    unless each sleep overshoots by 15 ms."""
    import time

    spec = InputSpec((3,), torch.float32)
    calls = []

    def model(x):
        calls.append(x.shape[0])
        time.sleep(0.001)
        return x

    t0 = time.perf_counter()
    prof = profile_model(model, [1, 2], repeats=3, warmup=0, input_spec=spec,
                         overhead=False, min_duration_s=0.2)
    assert time.perf_counter() - t0 >= 0.2
    rounds = prof.metadata["repeats"]
    assert 3 < rounds <= 50
    assert len(calls) == 2 * 2 * rounds
    short = profile_model(model, [1, 2], repeats=3, warmup=0, input_spec=spec,
                          overhead=False)
    assert short.metadata["repeats"] == 3


def hoarding(x):
    """Allocates 2000 lists a call: past the collector's first threshold (700) each time."""
    assert len([[i] for i in range(2000)]) == 2000
    return x + 1


hoarding.input_spec = InputSpec((3,), torch.float32)


@pytest.mark.parametrize("profile", [
    lambda: profile_model(hoarding, [1, 4], repeats=5, overhead=False),
    lambda: profile_batcher(hoarding, [1, 4], repeats=5),
])
def test_no_garbage_collection_runs_while_the_profile_measures(profile):
    x = hoarding.input_spec.random(4)
    assert collections_started(lambda: [hoarding(x) for _ in range(20)]) > 0
    gc.collect()  # the counters start at zero: setting up cannot bring one due
    assert collections_started(profile) == 0
    assert gc.isenabled()


def test_plain_callable_needs_an_input_spec():
    with pytest.raises(ValueError, match="input_spec must be an InputSpec"):
        profile_model(lambda x: x, [1])
    prof = profile_model(lambda x: 2 * x, [1, 8], repeats=3, overhead=False,
                         input_spec=InputSpec((5,), torch.float32))
    assert prof.metadata["model"] == "function"


@pytest.mark.parametrize("kwargs, match", [
    ({"batch_sizes": []}, "batch_sizes must not be empty"),
    ({"batch_sizes": [0, 4]}, "batch_sizes must be an integer"),
    ({"repeats": 0}, "repeats"),
    ({"min_duration_s": -1.0}, "min_duration_s must be"),
    ({"batch_sizes": 4.5}, "batch_sizes must be an integer >= 1, got 4.5"),
    ({"warmup": 2.7}, "warmup must be an integer >= 0, got 2.7"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        profile_model(make_model("mlp", size="tiny"), **{"batch_sizes": [1], **kwargs})


def test_file_names_say_device_model_and_dtype():
    assert device_slug("cpu") == "cpu"
    assert profile_filename("cpu", "tiny-mlp", torch.bfloat16) == "cpu_tiny-mlp_bfloat16.json"


@pytest.mark.parametrize("through", [[], ["--through-batcher"]])
def test_cli_profile_writes_a_loadable_profile(tmp_path, capsys, through):
    out = tmp_path / "enc.json"
    code = main(["profile", "--model", "encoder", "--size", "tiny", "--batch-sizes", "1,4",
                 "--repeats", "3", "--threads", "1", "--out", str(out), *through])
    assert code == 0 and "tiny-encoder" in capsys.readouterr().out
    prof = bs.load_service(out)
    assert prof.batch_sizes == (1, 4)
    assert prof.metadata["through"] == ("batcher" if through else "model")


def test_cli_profile_refuses_bad_batch_sizes(tmp_path, capsys):
    code = main(["profile", "--model", "mlp", "--batch-sizes", "1,x", "--out",
                 str(tmp_path / "x.json")])
    assert code == 2 and "--batch-sizes" in capsys.readouterr().err
    code = main(["profile", "--model", "mlp", "--through-batcher", "--compute-only", "--out",
                 str(tmp_path / "x.json")])
    assert code == 2 and "cannot be --compute-only" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["cpu_tiny-mlp_float32", "cpu_tiny-cnn_float32",
                                  "cpu_tiny-encoder_float32"])
def test_shipped_cpu_profiles(name):
    prof = bs.load_service(name)
    model = name.split("_")[1]
    assert prof.metadata["model"] == model and prof.metadata["end_to_end"]
    assert prof.batch_sizes == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert prof.metadata["torch"].startswith("2.")
    assert name in bs.shipped_profiles()


def test_real_never_imports_simpy_and_batchsim_never_imports_torch():
    code = ("import sys, batchsim; assert 'torch' not in sys.modules; "
            "import batchsim.real, batchsim.real.loadgen, batchsim.real.profiler; "
            "print(sorted(m for m in ('simpy', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert json.loads(out.replace("'", '"')) == []
