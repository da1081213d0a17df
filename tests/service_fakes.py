"""Service models made for tests: they misbehave in ways a dashboard must show, not hide."""

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
