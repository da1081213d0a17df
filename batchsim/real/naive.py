"""The classic polled batcher that tutorials teach, kept as the baseline to beat.

``InferenceBatcher`` is a list of waiting requests plus two questions a serving loop
asks every millisecond or so: ``should_process()`` (is the queue full, or has the
oldest request waited ``max_wait_ms``?) and ``process_batch()`` (``torch.stack`` up to
``max_batch_size`` inputs, run the model once, hand back ``[{"id", "output"}]``). It is
simple and correct, and it pays for its simplicity: a fresh stack per batch, the model
on the serving loop itself, and a poll interval added to every wait.
``batch_inference`` is the offline counterpart: fixed-size batches over a list.
"""

from __future__ import annotations

import time

import torch

from .. import _check
from .runners import checked_output


class InferenceBatcher:
    """Collect requests; process them in batches of up to ``max_batch_size``."""

    def __init__(self, model_fn, max_batch_size: int = 32, max_wait_ms: float = 50.0):
        if not callable(model_fn):
            raise ValueError(f"model_fn must be callable, got {model_fn!r}")
        self.model_fn = model_fn
        self.max_batch_size = _check.positive_int("max_batch_size", max_batch_size)
        self.max_wait_ms = _check.non_negative("max_wait_ms", max_wait_ms, allow_inf=True)
        self.queue: list[tuple] = []  # (request_id, input, time added)

    def __len__(self) -> int:
        return len(self.queue)

    def add_request(self, input, request_id) -> None:
        """Queue one input tensor under ``request_id``."""
        self.queue.append((request_id, input, time.perf_counter()))

    def should_process(self) -> bool:
        """True when the queue is full or its oldest request has waited ``max_wait_ms``."""
        if not self.queue:
            return False
        if len(self.queue) >= self.max_batch_size:
            return True
        return (time.perf_counter() - self.queue[0][2]) * 1000.0 >= self.max_wait_ms

    def process_batch(self) -> list[dict]:
        """Run the model once on up to ``max_batch_size`` of the oldest requests.

        Returns ``[{"id": request_id, "output": tensor}]`` in arrival order; a model
        that does not return one row per input raises ``TypeError`` (the batch is lost,
        as the naive batcher loses it on any error).
        """
        batch = self.queue[:self.max_batch_size]
        del self.queue[:self.max_batch_size]
        if not batch:
            return []
        with torch.no_grad():
            outputs = checked_output(self.model_fn(torch.stack([x for _, x, _ in batch])),
                                     len(batch))
        return [{"id": rid, "output": outputs[i]} for i, (rid, _, _) in enumerate(batch)]


def batch_inference(model_fn, inputs, batch_size: int = 32) -> list:
    """Offline inference in fixed-size batches: one output per input, in order (a model
    that does not return one row per input raises ``TypeError``)."""
    batch_size = _check.positive_int("batch_size", batch_size)
    outputs = []
    with torch.no_grad():
        for i in range(0, len(inputs), batch_size):
            batch = list(inputs[i:i + batch_size])
            outputs.extend(checked_output(model_fn(torch.stack(batch)), len(batch)))
    return outputs
