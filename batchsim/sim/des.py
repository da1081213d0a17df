"""The SimPy engine: the readable reference simulation of the dispatch rule.

Arrivals are a SimPy process; every change that could let a batch go (an arrival, a
worker freeing up, the oldest request's wait running out, the stream closing) asks for
one *decision* at that instant. The decision runs after every other event of the same
instant, so that an arrival at the very instant of a dispatch joins the batch, and it
applies ``batchsim.policy`` -- the same functions the fast engine and the real batcher
call.

SimPy's ``Timeout`` adds a delay to ``now``, which can miss an absolute instant by one
rounding step (``now + (t - now) != t`` in floating point). The engine needs instants
that are exactly ``arrival + max_wait`` or ``dispatch + s(b)``, as the fast engine
computes them, so it schedules events at absolute times (``_At``).

With ``costs`` (a ``BatcherCosts``: the real batcher's own delays) decisions happen only
when the batcher's event loop is awake: ``react`` after every arrival, when a worker is
released (``release`` after its batch finished, plus the batch's draw from the release's
spread) and when the loop's timer fires; the timer is re-armed at every wake-up
(``costs.timer_fire_s``).
"""

from __future__ import annotations

import heapq
import math
from collections import deque

import numpy as np
import simpy
from simpy.events import NORMAL

from .. import policy as rule
from ..result import RunRecorder, RunResult

#: Decisions run after all NORMAL events of their instant.
_DECIDE = NORMAL + 1


class _Env(simpy.Environment):
    """A SimPy environment that can schedule an event at an exact absolute instant."""

    def schedule_at(self, event: simpy.Event, t_s: float, priority: int = NORMAL) -> None:
        heapq.heappush(self._queue, (t_s, priority, next(self._eid), event))


class _At(simpy.Event):
    """An event that fires at the absolute instant ``t_s`` (like Timeout, without rounding)."""

    def __init__(self, env: _Env, t_s: float, priority: int = NORMAL):
        super().__init__(env)
        self._ok = True
        self._value = None
        env.schedule_at(self, t_s, priority)


def run(arrival_s: np.ndarray, policy: rule.BatchPolicy, batch_time_s: np.ndarray,
        jitter: np.ndarray | None, workers: int, costs=None,
        release_dev_s: np.ndarray | None = None) -> RunResult:
    """Simulate the rule on the given arrivals.

    ``batch_time_s[b]`` is the mean service time of a batch of ``b``; the k-th batch
    dispatched takes ``batch_time_s[b] * jitter[k]`` (``jitter`` None: no jitter).
    ``costs``: the batcher's own delays (``service.BatcherCosts``), None for none; the
    k-th batch's release deviates from ``costs.release_s`` by ``release_dev_s[k]``
    (None: by nothing).
    """
    env = _Env()
    rec = RunRecorder(arrival_s, workers)
    queue: deque[int] = deque()          # indices of waiting requests, oldest first
    free = list(range(workers))          # heap of free worker numbers
    last_arrival_s = float(arrival_s[-1])
    state = {"closed": False, "deciding": False, "timer_s": math.nan, "armed": 0}
    max_b = policy.max_batch_size
    release_s = None if costs is None else costs.release_s(np.arange(max_b + 1)).tolist()
    release_dev = (np.zeros(arrival_s.size) if release_dev_s is None else release_dev_s).tolist()
    arrivals_list = arrival_s.tolist()
    last_end = [-math.inf] * workers     # when each worker's previous batch ended

    def arrivals():
        for i, t in enumerate(arrival_s.tolist()):
            yield _At(env, t)
            if costs is not None:   # every arrival wakes the batcher's loop, a moment later
                _At(env, t + costs.react_s).callbacks.append(ask_for_decision)
            if rule.rejects(policy, len(queue)):
                rec.reject(i)
                continue
            queue.append(i)
            # Only a first waiter (start its clock) or a full queue can change the decision.
            if costs is None and free and (len(queue) == 1 or len(queue) >= max_b):
                ask_for_decision()
        state["closed"] = True
        if costs is None:
            ask_for_decision()

    def ask_for_decision(_event=None):
        if not state["deciding"]:
            state["deciding"] = True
            _At(env, env.now, _DECIDE).callbacks.append(decide)

    def decide(_event):
        state["deciding"] = False
        now = env.now
        state["armed"] += 1   # the loop is awake: a timer armed before no longer counts
        while free and queue:
            n_waiting = len(queue)
            oldest_s = arrival_s[queue[0]]
            t = rule.dispatch_time_s(
                policy, now, oldest_s,
                full_arrival_s=arrival_s[queue[max_b - 1]] if n_waiting >= max_b else math.inf,
                close_s=last_arrival_s if state["closed"] else math.inf)
            if t > now:
                if costs is not None:
                    arm(costs.timer_fire_s(now, t))
                elif t != state["timer_s"]:
                    state["timer_s"] = t
                    _At(env, t).callbacks.append(ask_for_decision)
                return
            why = rule.trigger(policy, now, n_waiting, oldest_s)
            stale = []
            while queue and rule.expired(policy, arrival_s[queue[0]], now):
                stale.append(queue.popleft())
            if stale:
                rec.expire(stale, now)
                if not queue:
                    return
            ids = [queue.popleft() for _ in range(rule.batch_size(policy, len(queue)))]
            worker = heapq.heappop(free)
            k = rec.n_batches
            service_s = batch_time_s[len(ids)] * (1.0 if jitter is None else jitter[k])
            if costs is None:
                end_s = free_s = now + service_s
            else:
                end_s = costs.end_s(now, service_s, arrivals_list, now - last_end[worker])
                last_end[worker] = end_s
                free_s = end_s + max(release_s[len(ids)] + release_dev[k], 0.0)
            rec.dispatch(ids, now, end_s, worker, why)
            _At(env, free_s).callbacks.append(lambda _e, w=worker: release(w))

    def arm(fire_s):
        """Wake the loop at ``fire_s`` unless it wakes for something else first."""
        if math.isfinite(fire_s):
            token = state["armed"]
            _At(env, fire_s).callbacks.append(
                lambda _e: token == state["armed"] and ask_for_decision())

    def release(worker):
        heapq.heappush(free, worker)
        ask_for_decision()

    env.process(arrivals())
    env.run()
    return rec.result(engine="simpy")
