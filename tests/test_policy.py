"""BatchPolicy validation and the dispatch-rule functions."""

import math

import pytest

import batchsim as bs
from batchsim import policy as rule


@pytest.mark.parametrize("kwargs, name", [
    ({"max_batch_size": 0, "max_wait_ms": 1.0}, "max_batch_size"),
    ({"max_batch_size": 2.5, "max_wait_ms": 1.0}, "max_batch_size"),
    ({"max_batch_size": True, "max_wait_ms": 1.0}, "max_batch_size"),
    ({"max_batch_size": 4, "max_wait_ms": -1.0}, "max_wait_ms"),
    ({"max_batch_size": 4, "max_wait_ms": math.nan}, "max_wait_ms"),
    ({"max_batch_size": 4, "max_wait_ms": "5"}, "max_wait_ms"),
    ({"max_batch_size": 4, "max_wait_ms": 1.0, "max_queue_size": 0}, "max_queue_size"),
    ({"max_batch_size": 4, "max_wait_ms": 1.0, "timeout_ms": -2.0}, "timeout_ms"),
    ({"max_batch_size": 4, "max_wait_ms": 1.0, "timeout_ms": math.inf}, "timeout_ms"),
])
def test_bad_policy_names_the_parameter_and_value(kwargs, name):
    with pytest.raises(ValueError, match=name) as err:
        bs.BatchPolicy(**kwargs)
    assert repr(kwargs[name]) in str(err.value)


@pytest.mark.parametrize("queue_size", [1, 7])
def test_an_infinite_wait_needs_a_queue_that_can_hold_a_full_batch(queue_size):
    # Neither the size trigger nor the timer could fire: every request would wait for close.
    with pytest.raises(ValueError, match=f"max_queue_size={queue_size} is below "
                                         f"max_batch_size=8 with max_wait_ms=inf"):
        bs.BatchPolicy(8, math.inf, max_queue_size=queue_size)
    assert bs.BatchPolicy(8, math.inf, max_queue_size=8).max_queue_size == 8
    assert bs.BatchPolicy(8, 1000.0, max_queue_size=7).max_queue_size == 7


def test_policy_is_frozen_and_converts_units():
    p = bs.BatchPolicy(8, 2.5, timeout_ms=10)
    assert p.max_wait_s == 0.0025 and p.timeout_s == 0.01
    assert bs.BatchPolicy(8, math.inf).max_wait_s == math.inf
    assert bs.BatchPolicy(8, 0).timeout_s == math.inf
    with pytest.raises(AttributeError):
        p.max_batch_size = 3


def test_dispatch_time_takes_the_earliest_trigger_but_not_before_a_free_worker():
    p = bs.BatchPolicy(4, 5.0)
    # Timeout trigger: the oldest arrived at 1.0 s, waits 5 ms.
    assert rule.dispatch_time_s(p, 0.0, 1.0) == 1.0 + 0.005
    # The size trigger comes first.
    assert rule.dispatch_time_s(p, 0.0, 1.0, full_arrival_s=1.002) == 1.002
    # The stream closed: flush at once.
    assert rule.dispatch_time_s(p, 0.0, 1.0, close_s=1.001) == 1.001
    # No free worker until 2 s: nothing leaves before then.
    assert rule.dispatch_time_s(p, 2.0, 1.0, full_arrival_s=1.002) == 2.0


def test_greedy_and_fixed_size_special_cases():
    greedy, fixed = bs.BatchPolicy(4, 0.0), bs.BatchPolicy(4, math.inf)
    assert rule.dispatch_time_s(greedy, 0.5, 1.0) == 1.0
    assert rule.dispatch_time_s(fixed, 0.5, 1.0) == math.inf
    assert rule.dispatch_time_s(fixed, 0.5, 1.0, full_arrival_s=1.3) == 1.3


def test_trigger_batch_size_rejection_and_expiry():
    p = bs.BatchPolicy(4, 5.0, max_queue_size=6, timeout_ms=10.0)
    assert rule.trigger(p, 1.0, 4, 0.999) == rule.SIZE
    assert rule.trigger(p, 1.005, 2, 1.0) == rule.TIMEOUT
    assert rule.trigger(p, 1.001, 2, 1.0) == rule.FLUSH
    assert [rule.batch_size(p, n) for n in (1, 4, 9)] == [1, 4, 4]
    assert not rule.rejects(p, 5) and rule.rejects(p, 6)
    assert not rule.rejects(bs.BatchPolicy(4, 5.0), 10**9)
    quarter = bs.BatchPolicy(4, 5.0, timeout_ms=250.0)  # binary-exact instants
    assert not rule.expired(quarter, 1.0, 1.25) and rule.expired(quarter, 1.0, 1.2501)


def test_a_wait_past_the_largest_float_is_refused_by_name():
    """An int too large for a float raised a bare OverflowError (a traceback in the CLI)."""
    with pytest.raises(ValueError, match="max_wait_ms must be a number a float can hold, "
                                         "got 1000000000"):
        bs.BatchPolicy(4, 10**400)
