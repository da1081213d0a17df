"""Hypothesis strategies shared by the simulator tests: random workloads, policies and
service models that exercise every feature of the rule (ties included)."""

import math

import numpy as np
from hypothesis import strategies as st

import batchsim as bs

workloads = st.one_of(
    st.builds(bs.Poisson, st.floats(50, 8000)),
    st.builds(bs.Constant, st.sampled_from([100.0, 250.0, 1000.0, 4000.0])),  # ties
    st.builds(bs.Gamma, st.floats(50, 8000), st.floats(0.2, 3.0)),
    st.builds(bs.Bursty, st.floats(500, 20000), st.floats(0, 500), st.floats(0.001, 0.05),
              st.floats(0.001, 0.05)),
    st.lists(st.integers(0, 40), min_size=1, max_size=80).map(   # duplicate times
        lambda xs: bs.Trace(np.sort(np.array(xs)) * 0.5e-3)),
)


def policies_of(max_batch_size, max_wait_ms, max_queue_size, timeout_ms):
    """BatchPolicies with fields drawn from these strategies (the last two may also be
    None), less those BatchPolicy refuses: an infinite wait with a queue bound below the
    batch size, which no trigger would ever empty."""
    fields = st.tuples(max_batch_size, max_wait_ms, st.one_of(st.none(), max_queue_size),
                       st.one_of(st.none(), timeout_ms))
    return fields.filter(lambda f: not (math.isinf(f[1]) and f[2] is not None and f[2] < f[0])
                         ).map(lambda f: bs.BatchPolicy(*f))


policies = policies_of(st.integers(1, 20),
                       st.sampled_from([0.0, 0.5, 1.0, 2.5, 7.0, math.inf]),
                       st.integers(1, 40), st.sampled_from([0.0, 1.0, 4.0, 20.0]))
services = st.builds(bs.AffineService, st.floats(0.05, 3.0), st.floats(0.0, 0.5),
                     st.sampled_from([0.0, 0.0, 0.5]))
