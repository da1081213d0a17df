"""Counting the garbage collections that start while a piece of code runs."""

import gc


def collections_started(run, counted=lambda: True) -> int:
    """How many garbage collections start while ``run()`` runs, where ``counted()`` (asked
    on the thread that collects, as each starts) is true."""
    starts = []

    def seen(phase, info):
        if phase == "start" and counted():
            starts.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        run()
    finally:
        gc.callbacks.remove(seen)
    return len(starts)
