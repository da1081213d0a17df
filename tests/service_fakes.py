"""Models made for tests: a service model that misbehaves in ways a dashboard must show,
and a "real" model whose cost is known exactly."""

import time

import numpy as np

from batchsim.service import ServiceModel


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
