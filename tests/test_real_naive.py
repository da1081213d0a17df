"""The classic polled batcher and offline batch_inference (the baselines)."""

import time

import pytest
import torch

import batchsim as bs
from batchsim.real import InferenceBatcher, batch_inference
from batchsim.real.loadgen import run_saturated


def double(x):
    return 2 * x


def test_should_process_when_full_or_when_the_oldest_waited_long_enough():
    b = InferenceBatcher(double, max_batch_size=3, max_wait_ms=20.0)
    assert not b.should_process()
    b.add_request(torch.zeros(2), "a")
    assert not b.should_process()
    time.sleep(0.03)
    assert b.should_process()           # the oldest waited 20 ms
    b.add_request(torch.zeros(2), "b")
    b.add_request(torch.zeros(2), "c")
    assert len(b) == 3 and b.should_process()


def test_process_batch_runs_up_to_max_batch_size_in_order():
    b = InferenceBatcher(double, max_batch_size=2, max_wait_ms=0.0)
    for i in range(3):
        b.add_request(torch.full((2,), float(i)), f"r{i}")
    first = b.process_batch()
    assert [r["id"] for r in first] == ["r0", "r1"]
    assert torch.equal(first[1]["output"], torch.full((2,), 2.0))
    assert [r["id"] for r in b.process_batch()] == ["r2"]
    assert b.process_batch() == [] and not b.should_process()


def test_batch_inference_matches_one_at_a_time():
    xs = list(torch.randn(10, 3, generator=torch.Generator().manual_seed(0)))
    outs = batch_inference(double, xs, batch_size=4)
    assert len(outs) == 10
    assert all(torch.equal(o, 2 * x) for o, x in zip(outs, xs, strict=True))


@pytest.mark.parametrize("model", [lambda x: torch.cat([x, x]), lambda x: x[:1]],
                         ids=["too many rows", "too few"])
def test_a_model_without_one_row_per_input_is_an_error_not_a_wrong_answer(model):
    b = InferenceBatcher(model, max_batch_size=3)
    for i in range(3):
        b.add_request(torch.zeros(2), i)
    with pytest.raises(TypeError, match=r"one row per input: got \(\d, 2\) for a batch of 3"):
        b.process_batch()
    with pytest.raises(TypeError, match="one row per input"):
        batch_inference(model, [torch.zeros(2)] * 3, batch_size=3)


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_batch_size"):
        InferenceBatcher(double, max_batch_size=0)
    with pytest.raises(ValueError, match="max_wait_ms"):
        InferenceBatcher(double, max_wait_ms=-1)
    with pytest.raises(ValueError, match="batch_size"):
        batch_inference(double, [torch.zeros(1)], batch_size=2.5)


def test_polled_driver_records_a_run():
    res = run_saturated(InferenceBatcher(double, 8, 2.0), 100, inputs=torch.ones(5, 2))
    s = res.summary()
    assert s["n_completed"] == 100 and res.size.sum() == 100
    assert res.meta["engine"] == "naive" and (res.size <= 8).all()
    assert (res.trigger == bs.policy.SIZE).sum() >= 1
    assert (res.finish_s >= res.dispatch_s).all() and (res.dispatch_s >= res.arrival_s).all()


def test_polled_driver_fails_a_whole_batch_when_the_model_raises():
    def fragile(x):
        if len(x) > 2:
            raise ArithmeticError("boom")
        return x

    res = run_saturated(InferenceBatcher(fragile, 4, 1.0), 12, inputs=torch.ones(3, 2))
    s = res.summary()
    assert s["n_failed"] > 0 and s["n_completed"] + s["n_failed"] == 12


def test_polled_driver_warms_up_on_every_batch_size_before_the_clock():
    """As the DynamicBatcher does: zeros of every size, the largest first, then the run."""
    from batchsim.real import InputSpec

    seen = []

    def noting(x):
        seen.append((len(x), bool(x.any())))
        return x

    noting.input_spec = InputSpec((2,), torch.float32)
    res = run_saturated(InferenceBatcher(noting, 3, 1.0), 6, inputs=torch.ones(6, 2))
    assert seen[:3] == [(3, False), (2, False), (1, False)]
    assert all(nonzero for _, nonzero in seen[3:]) and res.size.sum() == 6
