"""The real half of batchsim: a dynamic batcher serving PyTorch models, measured.

``DynamicBatcher`` serves a model by the same dispatch rule as the simulator;
``InferenceBatcher`` and ``batch_inference`` are the classic baselines; ``make_model``
builds the model zoo; ``run_load`` / ``run_saturated`` drive a batcher and return a
``RunResult``; ``profile_model`` measures a model's ``s(b)`` as a ``ProfileService``, and
``profile_batcher`` measures it as the batcher serves it.
Importing this package imports torch (``import batchsim`` alone does not); it never
imports SimPy.
"""

from .batcher import BatcherClosedError, DynamicBatcher, QueueFullError, RequestExpiredError
from .loadgen import run_load, run_saturated
from .models import InputSpec, make_model
from .naive import InferenceBatcher, batch_inference
from .profiler import profile_batcher, profile_model
from .runners import OutputRowsError

__all__ = [
    "DynamicBatcher", "QueueFullError", "BatcherClosedError", "RequestExpiredError",
    "InferenceBatcher", "batch_inference", "InputSpec", "make_model", "run_load", "run_saturated",
    "profile_model", "profile_batcher", "OutputRowsError",
]
