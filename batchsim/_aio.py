"""Run a coroutine from synchronous code, inside Jupyter's running event loop or not."""

from __future__ import annotations

import asyncio
import concurrent.futures


def run_to_completion(make_coro):
    """Run ``make_coro()`` to completion and return its result.

    With no event loop running here, on this thread (``asyncio.run``); inside one (a
    Jupyter cell), on a helper thread with a loop of its own, since a running loop cannot
    be re-entered.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make_coro())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, make_coro()).result()
