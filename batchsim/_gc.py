"""Keep Python's cyclic garbage collector out of a timed measurement, as ``timeit`` does.

A full collection walks every object the process holds and stops the interpreter
meanwhile -- the batcher's event loop included. In a process that also holds torch,
pandas, the simulator and earlier runs, one took 60-155 ms on this kit's development
machine, hundreds of times a tiny model's batch, and it falls on whichever measurement
happens to be running when the collector's counters come due (``bench/bench_gc_pause.py``,
``bench/results/README.md``). That stall comes from what the measuring process holds,
not from batching, so the load generator and the profiler turn automatic collection off
while they measure. Serving processes take a similar step (``gc.freeze()`` after
start-up in vLLM and LightLLM). What a measurement leaves in reference cycles is
collected after it.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def collector_paused(pause: bool = True):
    """Turn automatic garbage collection off for the block, then back on.

    Only if it is on: a caller who turned it off keeps it off. ``pause=False`` leaves
    it to Python.
    """
    if not (pause and gc.isenabled()):
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
