"""batchsim: see why an inference server should wait a few milliseconds to fill a batch.

``import batchsim as bs`` is light: it loads numpy only. SimPy loads when a SimPy-engine
simulation runs, pandas when a sweep does, and torch when the real batcher
(``batchsim.real``) is used.
"""

from __future__ import annotations

import os

from . import theory
from .plan import Recommendation, recommend
from .policy import BatchPolicy
from .result import COMPLETED, EXPIRED, FAILED, REJECTED, RunResult
from .service import (
    AffineService,
    BatcherCosts,
    CalibratedService,
    ProfileService,
    load_service,
    shipped_profiles,
)
from .sim import simulate
from .sweep import sweep
from .workload import Bursty, Constant, Diurnal, Gamma, Poisson, Ramp, Trace, Workload

__version__ = "0.1.0"


def quick() -> bool:
    """True in quick mode (``BATCHSIM_QUICK=1`` or ``CI`` set): notebooks shrink their sizes."""
    flag = os.environ.get("BATCHSIM_QUICK", "")
    return flag not in ("", "0") or bool(os.environ.get("CI"))


def __getattr__(name):
    """``calibrate`` (the module, callable as its function) and ``compare`` load on first use."""
    if name in ("calibrate", "compare"):
        import importlib

        module = importlib.import_module(".calibrate", __name__)
        return module if name == "calibrate" else module.compare
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BatchPolicy", "RunResult", "COMPLETED", "REJECTED", "EXPIRED", "FAILED",
    "AffineService", "ProfileService", "load_service", "shipped_profiles",
    "CalibratedService", "BatcherCosts", "calibrate", "compare",
    "simulate", "Workload", "Poisson", "Constant", "Gamma", "Bursty", "Ramp", "Diurnal",
    "Trace", "quick", "theory", "sweep", "recommend", "Recommendation",
]
