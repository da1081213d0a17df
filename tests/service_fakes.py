"""Models made for tests: a service model that misbehaves in ways a dashboard must show,
a calibrated one with every cost, and a "real" model whose cost is known exactly."""

import time

import numpy as np

import batchsim as bs
from batchsim.service import BatcherCosts, CalibratedService, ServiceModel


class MeasuredUpTo8(ServiceModel):
    """A service model that, like a measured table, knows nothing past batch size 8."""

    jitter_cv = 0.0

    def mean_ms(self, batch_size):
        b = np.asarray(batch_size, dtype=float)
        if b.max() > 8:
            raise ValueError(f"batch_size must be at most 8 for this profile, got {b.max():g}")
        return 1.0 + 0.5 * b


def sleeping_model(base_ms: float, per_item_ms: float, name: str = "sleeping_model"):
    """A model function, called ``name``, that sleeps ``base_ms`` a batch plus
    ``per_item_ms`` a request and returns its input: a known cost that releases the GIL,
    as a GPU model does."""
    import torch

    from batchsim.real import InputSpec

    def model(x):
        time.sleep((base_ms + per_item_ms * len(x)) / 1000)
        return x

    model.__name__ = model.__qualname__ = name
    model.input_spec = InputSpec((4,), torch.float32)
    return model


def costly_service(jitter_quantiles=(), **costs) -> CalibratedService:
    """A calibrated service with every cost a batch's worker time has (``costs``
    override the batcher's)."""
    return CalibratedService(
        bs.ProfileService((1, 8), (0.5, 1.2)), per_batch_ms=0.1, per_item_ms=0.01,
        jitter_quantiles=jitter_quantiles,
        costs=BatcherCosts(**{"react_ms": 0.02, "release_ms": 0.03,
                              "release_per_item_ms": 0.001, "timer_resolution_ms": 1.0,
                              "timer_latency_ms": 0.05, "arrival_ms": 0.005,
                              "idle_ms": (0.01, 1.0), "wake_ms": (0.0, 0.05),
                              "first_arrival_ms": 0.02, **costs}))
