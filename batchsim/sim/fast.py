"""The fast engine: the same runs as the SimPy engine, one batch per loop step.

A discrete-event engine spends its time on events: one per arrival, one per batch end,
one per timer. This engine knows the whole arrival stream in advance, so it jumps from
one batch to the next: the next batch leaves at ``policy.dispatch_time_s(free, oldest,
full, close)``, where ``full`` is the arrival of the ``max_batch_size``-th waiting
request -- a *future* arrival, read off the sorted arrival times -- and ``close`` the
last arrival. The waiting requests at that instant are found by binary search. Each
batch costs a few Python operations; per-request work is done with numpy afterwards.

While nobody is turned away, the waiting requests are a window ``[head, arrivals so
far)`` of the arrival array, so the trigger instants of every possible head come from
one vectorised call of the rule and the loop only adds "not before a worker is free"
(``dispatch_time_s(free, ...) == max(free, dispatch_time_s(-inf, ...))``). When a
``max_queue_size`` is about to turn arrivals away, the engine switches to a loop that
takes arrivals in one batch at a time, rejecting some, and asks the rule batch by batch;
once the queue has drained it switches back. Either way the decisions are the functions
of ``batchsim.policy``.

Ties follow the SimPy engine: at one instant, arrivals are taken in (and checked for
rejection) before a batch is formed, so an arrival at the very instant of a dispatch
joins it; a worker whose batch ends at that instant is free for it.

With the real batcher's own costs (``BatcherCosts``) a batch leaves at the first instant
the batcher's event loop is awake at or after the rule's instant: ``_awake_loop``.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right

import numpy as np

from .. import policy as rule
from ..result import COMPLETED, EXPIRED, REJECTED, RunResult

#: Served requests the full-queue loop keeps at the front of its list before dropping them.
_SERVED_KEPT = 65536
#: Elements per step of a vectorised precompute (see ``_blockwise``).
_BLOCK = 8192
#: The most requests a load generator on the loop sends in one turn before it yields
#: (``run_load``'s ``max_burst``): on one CPU the tiny MLP's bursts sent over half of
#: their requests in such turns.
MAX_BURST = 64
#: How far the event loop's thread must have run ahead of the worker's, in the time the
#: worker waited to run while the loop ran less the worker's own time for its batches
#: (``_sender_loop``), for the worker to take the core at the load generator's yield
#: after a full turn and keep it to its batch's end. Measured on one CPU from the real
#: batches' scheduler counters (``meta["batch_thread_wait_s"]``, two grids of the tiny
#: MLP, ``bench/bench_thread_cpu.py``): a batch after one not kept was kept (the loop
#: waited over half of it) in 88-89% of cases with the loop over 100 us ahead in the
#: bursts and 16-36% on Poisson traffic, against 1.3-2.9% with the loop not ahead.
FAIR_SHARE_LEAD_S = 100e-6


def run(arrival_s: np.ndarray, policy: rule.BatchPolicy, batch_time_s: np.ndarray,
        jitter: np.ndarray | None, workers: int, costs=None, sender=None,
        release_dev_s: np.ndarray | None = None) -> RunResult:
    """Simulate the rule on the given arrivals (same contract as ``des.run``).

    ``sender="loop"`` (with ``costs``): ``arrival_s`` are the instants a load generator
    on the batcher's own event loop is due to send the requests, and each reaches the
    batcher when the loop next wakes for it (``_sender_loop``); the result's arrivals
    are those instants, ``meta["sent_s"]`` the given ones and ``meta["turn_sizes"]``
    how many it sent in each of its turns (as ``run_load`` records them).

    Raises NotImplementedError when a batch's service time vanishes next to its start
    time in floating point (``start + s == start``): the SimPy engine then orders the
    worker's release after the decision of that instant, which this engine does not model;
    and with ``costs`` for several workers, ``max_queue_size`` or ``timeout_ms``.
    """
    if costs is not None:
        loop = _sender_loop if sender == "loop" else _awake_loop
        if release_dev_s is None:
            release_dev_s = np.zeros(arrival_s.size)
        received_s, log, end_s = loop(arrival_s, policy, batch_time_s, jitter, workers, costs,
                                      release_dev_s.tolist())
        res = _assemble(received_s, policy, batch_time_s, jitter, workers, log)
        if sender == "loop":
            res.meta["sent_s"] = arrival_s
            res.meta["turn_sizes"] = np.array(log.turn_sizes, int)
        res.end_s = np.asarray(end_s)        # arrivals during a batch may have delayed it
        res.finish_s = np.where(res.batch_id >= 0, res.end_s[res.batch_id], np.nan)
        return res
    loop = _Loop(arrival_s, policy, batch_time_s, jitter, workers)
    head = 0
    while head < arrival_s.size:
        head = loop.open_queue(head)
        if head < arrival_s.size:
            head = loop.full_queue(head)
    return _assemble(arrival_s, policy, batch_time_s, jitter, workers, loop)


class _Loop:
    """The batch-by-batch loop and what it decided, in compact arrays.

    The two phases (``open_queue``, ``full_queue``) hand over through ``free_at`` (when
    each worker frees), ``now_s`` (the last decision), ``n_batches`` and ``n_rejected``.
    Batches are logged by queue *position*: the index among accepted requests in arrival
    order (the arrival index while nobody has been rejected). ``head`` is a batch's first
    position, ``oldest`` the first waiting position when it was decided (logged only with
    ``timeout_ms``: expired requests leave first), ``size`` its size (logged when heads
    alone do not give it), ``worker`` its worker (logged with several workers).
    """

    def __init__(self, arrival_s, policy, batch_time_s, jitter, workers):
        self.arrival_s, self.policy = arrival_s, policy
        self.bt = batch_time_s.tolist()
        self.jit = None if jitter is None else memoryview(jitter)
        self.free_at = [-math.inf] * workers
        self.now_s = -math.inf
        self.n_batches = self.n_rejected = 0
        self.bounded = policy.max_queue_size is not None
        self.timeout = policy.timeout_ms is not None
        self.sized = self.bounded or self.timeout
        self.start_s, self.head, self.size = array("d"), array("q"), array("q")
        self.worker, self.oldest = array("q"), array("q")
        self.expired = []                # (first position, end position, time)
        self.rejected = []               # (first request index, end index)
        self.turn_sizes = []             # a load generator's turns (``_sender_loop``)
        # Can the queue ever hold max_batch_size, or are arrivals turned away before?
        self.fills = not rule.rejects(policy, policy.max_batch_size - 1)
        self._trigger_s = self._danger_s = None      # made on first use, kept for the run

    def trigger_s(self) -> memoryview:
        """When the batch headed by each arrival would leave if a worker were free (while
        nobody is turned away: the next ``max_batch_size - 1`` arrivals all join)."""
        if self._trigger_s is None:
            a, policy, max_b = self.arrival_s, self.policy, self.policy.max_batch_size
            close_s = a[-1]
            self._trigger_s = memoryview(_blockwise(a.size, lambda i, j: rule.dispatch_time_s(
                policy, -math.inf, a[i:j], _later(a, i, j, max_b - 1) if self.fills else math.inf,
                close_s)))
        return self._trigger_s

    def danger_s(self) -> memoryview:
        """From when a decision about the batch headed by each arrival may turn someone
        away or find the head expired (while nobody is turned away); before it, neither can
        happen, and the loop skips counting the waiting and asking the rule.

        A rejection needs the arrival ``reject_at`` places behind the head to have come;
        an expiry needs more than ``timeout_s`` since the head's arrival: ``now - a > T``
        in floating point implies ``now > a + T`` exactly (``T`` is a double), hence
        ``now >= fl(a + T)``, the double nearest ``a + T`` (none lies between them).
        """
        if self._danger_s is None:
            a, policy = self.arrival_s, self.policy
            if self.timeout:
                danger_s = a + policy.timeout_s
            else:
                danger_s = np.full(a.size, math.inf)
            if self.bounded:
                reject_at = bisect_left(range(policy.max_queue_size + 1), True,
                                        key=lambda n_waiting: rule.rejects(policy, n_waiting))
                m = max(a.size - reject_at, 0)
                np.minimum(danger_s[:m], a[reject_at:], out=danger_s[:m])
            self._danger_s = memoryview(danger_s)
        return self._danger_s

    def open_queue(self, h: int) -> int:
        """Run while nobody is turned away, from an empty queue headed by arrival ``h``.

        Returns the number of arrivals when done, or the head at the last dispatch when
        the next decision would find arrivals rejected (nothing of it logged).
        """
        policy, a, bt, jit = self.policy, memoryview(self.arrival_s), self.bt, self.jit
        n, max_b = len(a), policy.max_batch_size
        trigger_s = self.trigger_s()
        danger_s = self.danger_s() if self.sized else None
        free_at, many = self.free_at, len(self.free_at) > 1
        bounded, timeout, exact = self.bounded, self.timeout, self.sized
        put_start, put_head = self.start_s.append, self.head.append
        put_size, put_oldest, put_worker = (self.size.append, self.oldest.append,
                                            self.worker.append)
        offset = self.n_rejected         # arrival index - queue position
        last_full = n - max_b            # the last head with max_batch_size arrivals after it
        free_s, now_s, k = free_at[0], self.now_s, self.n_batches
        while h < n:
            if many:
                free_s = min(free_at)
                if free_s < now_s:
                    free_s = now_s
            t = trigger_s[h]             # becomes the decision instant:
            if t < free_s:               # not before a worker is free
                t = free_s
            if exact and t >= danger_s[h]:   # someone may be turned away or expire: count
                end = h + max_b              # everyone waiting (a batch's worth first, the
                if end < n and a[end - 1] <= t:       # rest only if needed)
                    count = bisect_right(a, t, end)
                else:
                    count = bisect_right(a, t, h, end if end < n else n)
                if bounded and rule.rejects(policy, count - h - 1):
                    break
                now_s, oldest = t, h
                if timeout and rule.expired(policy, a[h], now_s):
                    h = self._purge(a, h, count, now_s, offset)
                    if h == count:
                        continue
                end = h + rule.batch_size(policy, count - h)
            else:   # the batch: the first min(waiting, max_batch_size), found by a bounded search
                now_s, oldest = t, h
                end = bisect_right(a, t, h, h + max_b if h <= last_full else n)
            if exact:
                put_size(end - h)
                if timeout:
                    put_oldest(oldest - offset)
            if jit is None:
                service_s = bt[end - h]
            else:
                service_s = bt[end - h] * jit[k]
                k += 1
            if many:
                w = 0
                while free_at[w] > now_s:
                    w += 1
                free_at[w] = now_s + service_s
                put_worker(w)
            else:
                free_s = now_s + service_s
            put_start(now_s)
            put_head(h - offset)
            h = end
        if not many:
            free_at[0] = free_s
        self.now_s, self.n_batches = now_s, len(self.start_s)
        return h

    def full_queue(self, h: int) -> int:
        """Run from the last dispatch, head ``h``, taking arrivals in (or turning them
        away) batch by batch, until the queue has drained; returns the next arrival."""
        policy, bt, jit, free_at = self.policy, self.bt, self.jit, self.free_at
        max_b, fills, timeout, many = (policy.max_batch_size, self.fills, self.timeout,
                                       len(free_at) > 1)
        a = memoryview(self.arrival_s)
        n, close_s = len(a), a[-1]
        now_s, k = self.now_s, self.n_batches
        t = bisect_right(a, now_s, h)    # arrivals taken in so far
        queue = a[h:t].tolist()          # arrival times of the waiting, oldest first
        base = h - self.n_rejected       # queue position of queue[0]
        i = 0                            # queue[i] heads the queue
        while i < len(queue) or t < n:
            waiting = len(queue) - i
            if waiting >= max_b:
                oldest_s, full_s = queue[i], queue[i + max_b - 1]
            else:
                oldest_s = queue[i] if waiting else a[t]
                j = t + max_b - 1 - waiting
                full_s = a[j] if fills and j < n else math.inf
            free_s = min(free_at)
            now_s = rule.dispatch_time_s(policy, free_s if free_s > now_s else now_s,
                                         oldest_s, full_s, close_s)
            count = bisect_right(a, now_s, t)
            if count > t:
                let_in = count - t
                if rule.rejects(policy, waiting + let_in - 1):
                    let_in = _admitted(policy, waiting, let_in)
                    self.rejected.append((t + let_in, count))
                    self.n_rejected += count - t - let_in
                queue.extend(a[t:t + let_in].tolist())
                t = count
            oldest = i
            if timeout and rule.expired(policy, queue[i], now_s):
                i = self._purge(queue, i, len(queue), now_s, -base)
                if i == len(queue):
                    break
            b = rule.batch_size(policy, len(queue) - i)
            w = 0
            while free_at[w] > now_s:
                w += 1
            free_at[w] = now_s + (bt[b] if jit is None else bt[b] * jit[k])
            self.start_s.append(now_s)
            self.head.append(base + i)
            self.size.append(b)
            if many:
                self.worker.append(w)
            if timeout:
                self.oldest.append(base + oldest)
            i += b
            k += 1
            if i == len(queue):
                break
            if i > _SERVED_KEPT:         # an overloaded queue may never drain: forget the
                del queue[:i]            # served ones now and then
                base += i
                i = 0
        self.now_s, self.n_batches = now_s, k
        return t

    def _purge(self, queue, h: int, count: int, now_s: float, offset: int) -> int:
        """Drop the expired requests at the head of ``queue[h:count]``; the new head.

        ``offset`` turns indices into ``queue`` into queue positions (by subtraction).
        """
        fresh = bisect_left(queue, True, h, count,
                            key=lambda arrival_s: not rule.expired(self.policy, arrival_s,
                                                                   now_s))
        self.expired.append((h - offset, fresh - offset, now_s))
        return fresh


def _awake_loop(arrival_s, policy, batch_time_s, jitter, workers, costs, release_dev):
    """The batches when decisions wait for the batcher's event loop to be awake: the log
    and the batches' end times (``costs.end_s``: arrivals during a batch delay it).

    The loop wakes ``react`` after every arrival, when the worker is released
    (``release`` after its batch ends, plus the batch's ``release_dev``) and when its
    timer fires. The batch headed by
    ``h`` is due at the rule's instant ``due`` (the worker free, a trigger met) and
    leaves at the first wake-up at or after it: the first arrival's wake-up, the release
    itself if that comes last, or the timer armed at the last wake-up before ``due`` --
    if the head was waiting then -- whichever is first. One worker, nobody turned away.
    """
    if workers > 1 or policy.max_queue_size is not None or policy.timeout_ms is not None:
        raise NotImplementedError("the fast engine applies batcher costs to one worker without "
                                  "max_queue_size or timeout_ms; use engine='simpy'")
    log = _Loop(arrival_s, policy, batch_time_s, jitter, workers)
    a, max_b = arrival_s.tolist(), policy.max_batch_size
    n = len(a)
    trigger_s = log.trigger_s()
    wake = (arrival_s + costs.react_s).tolist()
    release = costs.release_s(np.arange(max_b + 1)).tolist()
    bt, jit = batch_time_s.tolist(), None if jitter is None else jitter.tolist()
    free_s, h, k, ends = -math.inf, 0, 0, []
    while h < n:
        due_s = trigger_s[h]
        if free_s >= due_s:
            t = free_s
        else:
            j = bisect_left(wake, due_s)     # < n: the last arrival's wake-up closes
            t = wake[j]
            armed_s = max(free_s, wake[j - 1]) if j else free_s
            if armed_s >= a[h]:
                t = min(t, costs.timer_fire_s(armed_s,
                                              rule.dispatch_time_s(policy, armed_s, a[h])))
        end = bisect_right(a, t, h, min(h + max_b, n))
        service_s = bt[end - h] if jit is None else bt[end - h] * jit[k]
        ends.append(costs.end_s(t, service_s, a, t - (ends[-1] if ends else -math.inf)))
        free_s = ends[-1] + max(release[end - h] + release_dev[k], 0.0)
        log.start_s.append(t)
        log.head.append(h)
        h, k = end, k + 1
    return arrival_s, log, ends


def _sender_loop(sent_s, policy, batch_time_s, jitter, workers, costs, release_dev):
    """Like ``_awake_loop``, but the requests come from a load generator on the batcher's
    event loop (as ``run_load`` sends them): when each reaches the batcher, the log and
    the batches' end times.

    The generator sleeps on the loop's timer until its next request is due. The loop,
    asleep since ``sleep``, wakes at the first of: its timer (``costs.timer_fire_s``
    from ``sleep`` to the next request's due instant or, with the worker free and
    requests waiting, the rule's instant for the head) and the worker's release
    (``release`` after its batch ends, plus the batch's ``release_dev``; a wake-up after
    the end and before it takes the release in too). Awake at ``t``, it frees the worker
    and decides (a dispatch of ``b`` holds the loop ``costs.hold_s(b)``: the worker
    takes the interpreter to gather its batch); then, if a request is due, the generator
    resumes one step later, ``react``, and sends the requests due one after another,
    ``send_ms`` apart, each as it falls due by then -- they reach the batcher as they
    are sent -- and the decision it asks for comes ``react`` after the last; then the
    loop sleeps. Sends ask for a decision only when the worker is free and the queue was
    empty or they fill it (as ``DynamicBatcher.submit_nowait`` does), or when the last
    one closes the batcher; after any other turn -- most often one while a batch runs --
    the loop sleeps ``linger`` after it (``costs.linger_s``): a request due by then goes
    out in a turn of its own without a sleep, a later one waits for the next wake-up,
    most often the batch's release. A turn sends ``MAX_BURST`` requests at the most, as
    ``run_load`` does; it then yields, the loop decides as after any turn, and the
    generator goes on at once with what is due.
    With ``react`` 0 the generator's step and the decision coincide, so what it
    sends joins the decision, as the rule has a request arriving at a dispatch's instant
    (a limit reached with a jump: with any ``react`` above 0, requests that fell due while
    the loop slept miss the batch its timer fires; calibrations fit 10-20 us).
    Each request that reaches the batcher while a batch runs (before its end) delays it
    by ``arrival_ms``, and the first by ``first_arrival_ms`` more, as in the other engines
    (with ``costs.turn_ms``, a later turn into the batch delays it by ``turn_ms`` and each
    of its requests by ``send_ms`` instead):
    those sent in the turn right after its dispatch too, though they were due before it
    (the loop sends them before the worker can have the interpreter or, on one core, the
    core).
    On one core the kernel shares it between the loop's thread and the worker's by the
    time each has run while the other waited: the loop keeps a lead, which grows by the
    time the worker waited for it around a batch (the hold after its dispatch, and the
    turns that delayed its end) less the batch's own time, and never falls below 0 (a
    thread that sleeps gives up what it ran ahead). A full turn that yields with more due,
    while a batch runs and the lead is over ``FAIR_SHARE_LEAD_S``, gives the worker the
    core to the batch's end: the generator's next turn waits for it, then goes before the
    batch's release (the batch's report was queued after it), and the batch's end moves no
    further; such a batch lowers the lead by its whole time.
    One worker, nobody turned away.
    """
    if workers > 1 or policy.max_queue_size is not None or policy.timeout_ms is not None:
        raise NotImplementedError("a sender on the loop is simulated for one worker without "
                                  "max_queue_size or timeout_ms")
    x, n, max_b = sent_s.tolist(), sent_s.size, policy.max_batch_size
    received = np.empty(n)
    react, release = costs.react_s, costs.release_s(np.arange(max_b + 1)).tolist()
    per_arrival_s, first_arrival_s = costs.arrival_ms / 1000.0, costs.first_arrival_ms / 1000.0
    bt, jit = batch_time_s.tolist(), None if jitter is None else jitter.tolist()
    log = _Loop(received, policy, batch_time_s, jitter, workers)
    ends = []
    sent = h = 0                 # requests sent so far; the first waiting one
    sleep_s, close_s = min(0.0, x[0]), math.inf
    released_s = math.inf        # when the batch in flight releases its worker (none: inf)
    received_by = 0              # the batches started when requests last came mid-batch

    def head_due_s(now_s):
        """The rule's instant for the batch headed by the first waiting request."""
        full_s = received[h + max_b - 1] if sent - h >= max_b else math.inf
        return rule.dispatch_time_s(policy, now_s, received[h], full_s, close_s)

    def decide(now_s):
        """Dispatch the head's batch if the rule says so now; when the loop goes on (a
        dispatch of ``b`` holds it ``costs.hold_s(b)``)."""
        nonlocal h, released_s, own_s, hold_s, kept
        if released_s < math.inf or h == sent or head_due_s(now_s) > now_s:
            return now_s
        b, k = min(sent - h, max_b), len(ends)
        service_s = bt[b] if jit is None else bt[b] * jit[k]
        own_s = service_s + costs.wake_s(now_s - (ends[-1] if k else -math.inf))
        ends.append(now_s + own_s)
        log.start_s.append(now_s)
        log.head.append(h)
        h, released_s = h + b, ends[-1] + max(release[b] + release_dev[k], 0.0)
        hold_s, kept = costs.hold_s(b), False
        return now_s + hold_s

    send_s = costs.send_ms / 1000.0
    resuming = False             # the generator goes on after a turn cut at MAX_BURST
    lead_s = own_s = hold_s = 0.0  # the loop's lead; the batch's own time, its hold
    kept = deferred = report_next = False  # the worker keeps the core; what then follows
    while h < n:
        if deferred:    # the generator's next turn comes at the batch's end, first
            t, sending = max(ends[-1], sleep_s), True
        else:
            due_s = x[sent] if sent < n else math.inf
            if released_s == math.inf and h < sent:
                due_s = min(due_s, head_due_s(-math.inf))
            t = max(min(costs.timer_fire_s(sleep_s, due_s), released_s), sleep_s)
            if report_next:   # the batch's report, queued before that turn, comes next
                t, report_next = max(released_s, sleep_s), False
            if released_s < math.inf and ends[-1] <= t:
                released_s = math.inf
                waited_s = 0.0 if kept else hold_s + ends[-1] - log.start_s[-1] - own_s
                lead_s = max(0.0, lead_s + waited_s - own_s)
            sending = sent < n and x[sent] <= t
            if react or not sending:      # without a step between, what is sent joins (rule 3)
                t = decide(t)
        if sending:
            t += 0.0 if resuming else react
            first, t_first = sent, t
            last = min(n, first + MAX_BURST)
            if send_s:    # one after another, each send_s after the last; those due by then
                while True:
                    received[sent] = t
                    sent += 1
                    if sent == last or x[sent] > t + send_s:
                        break
                    t += send_s
            else:
                sent = bisect_right(x, t, sent, last)
                received[first:sent] = t
            log.turn_sizes.append(sent - first)
            if released_s < math.inf and t_first < ends[-1]:    # they reach it mid-batch
                end_s = ends[-1]
                cost_s = per_arrival_s
                if received_by != len(ends):               # its first ones
                    end_s += first_arrival_s
                    received_by = len(ends)
                elif costs.turn_ms is not None:            # a later turn
                    end_s += costs.turn_ms / 1000.0
                    cost_s = send_s
                for j in range(first, sent):    # each one received before its end delays it
                    if received[j] >= end_s:
                        break
                    end_s += cost_s
                released_s += end_s - ends[-1]
                ends[-1] = end_s
            if sent == n:
                close_s = t       # the generator closes the batcher after its last send
            # The turn asks for a decision (``submit`` with the worker free, to a queue
            # that was empty or that it filled; the close), else the loop lingers. A turn
            # cut at MAX_BURST yields and goes on once the loop has run what was ready.
            if deferred:
                # The turn came after the batch's end: neither moved, the release
                # follows the turn by what it would have followed the end.
                released_s = t + (released_s - ends[-1])
                deferred, report_next = False, True
            asks = sent == n or (released_s == math.inf and (first == h or sent - h >= max_b))
            t += react if asks else costs.linger_s
            t = decide(t)
            resuming = sent - first == MAX_BURST and sent < n and x[sent] <= t
            if (resuming and released_s < math.inf and t < ends[-1] and not kept
                    and lead_s > FAIR_SHARE_LEAD_S):
                kept = deferred = True
        sleep_s = t
    return received, log, ends


def _blockwise(n: int, block) -> np.ndarray:
    """``block(i, j)`` for the elements ``[i, j)`` of an ``n``-array, a few thousand at a
    time: the temporaries stay small (in cache, no fresh pages to fault in)."""
    out = np.empty(n)
    for i in range(0, n, _BLOCK):
        j = min(i + _BLOCK, n)
        out[i:j] = block(i, j)
    return out


def _later(a: np.ndarray, i: int, j: int, k: int) -> np.ndarray:
    """``a[i + k:j + k]``, padded with ``inf`` past the end of ``a``."""
    later = a[i + k:j + k]
    return later if later.size == j - i else np.concatenate(
        (later, np.full(j - i - later.size, math.inf)))


def _admitted(policy, waiting: int, arriving: int) -> int:
    """How many of ``arriving`` requests join a queue of ``waiting`` before it is full."""
    return bisect_left(range(waiting, waiting + arriving), True,
                       key=lambda n_waiting: rule.rejects(policy, n_waiting))


def _runs(first: np.ndarray, length: np.ndarray) -> np.ndarray:
    """The indices ``first[i], ..., first[i] + length[i] - 1`` for every ``i``, in order."""
    return np.arange(length.sum()) + np.repeat(first - (np.cumsum(length) - length), length)


def _assemble(arrival_s, policy, batch_time_s, jitter, workers, log) -> RunResult:
    """Per-request and per-batch arrays from the loop's log, with numpy."""
    n = arrival_s.size
    start_s = np.frombuffer(log.start_s, float)
    head = np.frombuffer(log.head, np.int64)
    # Without rejections and expiries, a batch ends where the next begins.
    size = np.frombuffer(log.size, np.int64) if log.sized else np.diff(head, append=n)
    worker = (np.frombuffer(log.worker, np.int64) if len(log.free_at) > 1
              else np.zeros(start_s.size, np.int64))
    service_s = batch_time_s[size]
    end_s = start_s + (service_s if jitter is None else service_s * jitter[:size.size])
    if np.any(end_s <= start_s):
        k = int(np.argmax(end_s <= start_s))
        raise NotImplementedError(
            f"the fast engine cannot order a batch whose service time vanishes next to its "
            f"start (batch {k} at t={start_s[k]!r} s); use engine='simpy'")

    status = np.full(n, COMPLETED, np.int8)
    if log.rejected:
        first, end = (np.array(col) for col in zip(*log.rejected, strict=True))
        status[_runs(first, end - first)] = REJECTED
        accepted = np.flatnonzero(status != REJECTED)
        queued_s = arrival_s[accepted]
    else:
        accepted, queued_s = None, arrival_s
    oldest = np.frombuffer(log.oldest, np.int64) if log.timeout else head
    # How many waited when each batch was decided: a batch that took fewer than
    # max_batch_size took them all (when nothing expired); count the others.
    n_waiting = size.copy()
    uncounted = (size == policy.max_batch_size) | (oldest != head)
    n_waiting[uncounted] = (np.searchsorted(queued_s, start_s[uncounted], side="right")
                            - oldest[uncounted])
    trigger = rule.trigger(policy, start_s, n_waiting, queued_s[oldest]).astype(np.int8)

    if size.sum() == n:              # everyone served, in arrival order
        dispatch_s, finish_s = np.repeat(start_s, size), np.repeat(end_s, size)
        batch_id = np.repeat(np.arange(size.size), size)
        dequeue_s = dispatch_s.copy()
    else:
        served = _runs(head, size)
        if accepted is not None:
            served = accepted[served]
        dispatch_s, finish_s, dequeue_s = (np.full(n, np.nan) for _ in range(3))
        batch_id = np.full(n, -1, np.int64)
        dispatch_s[served] = dequeue_s[served] = np.repeat(start_s, size)
        finish_s[served] = np.repeat(end_s, size)
        batch_id[served] = np.repeat(np.arange(size.size), size)
        if log.expired:
            first, end, when_s = (np.array(col) for col in zip(*log.expired, strict=True))
            gone = _runs(first, end - first)
            if accepted is not None:
                gone = accepted[gone]
            status[gone] = EXPIRED
            dequeue_s[gone] = np.repeat(when_s, end - first)
        turned_away = status == REJECTED
        dequeue_s[turned_away] = arrival_s[turned_away]
    return RunResult(arrival_s=arrival_s, dispatch_s=dispatch_s, finish_s=finish_s,
                     batch_id=batch_id, status=status, dequeue_s=dequeue_s, start_s=start_s,
                     end_s=end_s, size=size, worker=worker, trigger=trigger, workers=workers,
                     meta={"engine": "fast"})
