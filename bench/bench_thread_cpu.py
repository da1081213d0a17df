"""How the event loop's thread and the worker's shared the CPU, batch by batch: the
threads' CPU times each real batch records, in the runs of a ``bench_fidelity.py
--save-runs`` pickle.

On one CPU the loop runs inside a batch's wall time (it receives requests; the load
generator, on the same loop, sends them), so the calibration's ``s(b)``, fitted on wall
times, holds the loop's work inside the worker's. The kernel's fair share between the
two threads turns on the CPU time each has had (``probe_thread_vruntime.py``: the worker
takes the core at the generator's yield when the loop has run ahead of it), which wall
times do not tell. A batch records (``meta["batch_thread_cpu_s"]``) the loop's CPU time
at its dispatch and when the loop took it back, and the worker's then (read from
``/proc``: exact on one CPU). A batch's worker CPU time is the worker's figure at its
return less the one at the previous batch's return (the first batch has none). For each
part of the pickle (the calibration's runs, then each arrival set):

* ``worker_share``: the median over batches of the worker's CPU time over the batch's
  wall time from pick-up to end. At 1 or more the loop took none of the batch's time
  from the worker (its CPU time also holds taking the batch up and handing it back);
* ``worker_cpu_us`` and ``worker_wall_us``: over the full batches of the part's largest
  ``max_batch_size``, the worker's median CPU time, and wall time from pick-up to end;
* ``cycles``, ``loop_cycle_us``, ``worker_cycle_us`` and ``loop_lead_us``: over cycles of
  full batches of that size back to back (each dispatched within ``BACK_TO_BACK_US`` of the
  previous one's end), the loop's median CPU time from a dispatch to the next, the worker's
  CPU time for the batch, and the median of the loop's less the worker's: how far the loop
  gains on the worker a cycle in CPU time, where both want the core;
* ``loop_per_cycle_us`` and ``loop_per_request_us``: the loop's CPU time from a dispatch to
  the next fitted over every cycle of the part as a time per cycle plus one per request
  the batcher received in it (least squares).

Where the runs recorded them too (``meta["batch_thread_wait_s"]``), the threads' times
waited to run, runnable while the other had the CPU (Linux's ``run_delay``): the loop's
at a batch's dispatch and return, the worker's at its return. A batch is *held* when the
loop waited over half its time from dispatch to return: the worker kept the core while
the loop had work (the load generator's next turn: ``probe_thread_vruntime.py``'s chain).

* ``held_share``: the share of batches held;
* ``worker_wait_us``: the worker's median wait from one batch's return to the next (the
  loop ran while the worker could have: most often the loop's turn after a dispatch);
* ``worker_wait_held_us`` and ``loop_wait_held_us``: over the held batches, the worker's
  median wait and the loop's from dispatch to return;
* ``held_after_lead``: the share of batches held, of those whose previous batch was not,
  by the loop's lead before them (``lead=0``, ``lead<=100us``, ``lead>100us``: the
  simulator's ``FAIR_SHARE_LEAD_S``) and their counts (``n_...``). The lead starts at 0
  and after each batch grows by the worker's wait less its CPU time, never below 0: the
  time the loop ran while the worker waited, less what the worker ran itself, as the
  scheduler's fair share counts it between two threads on one CPU. The simulator's
  sender on the loop keeps the same lead.

These are NaN for runs saved before the batcher recorded the waits.

Runs saved before the batcher recorded CPU times (the trios to U and the thread-clock
trial's) are refused. Run: ``.venv/bin/python bench/bench_thread_cpu.py RUNS.pkl.gz [--out
FILE]``.
"""

from __future__ import annotations

import numpy as np
from bench_fidelity import print_measures, real_runs_by_part, saved_runs_main
from bench_loop_turns import median_us, pooled, share
from bench_worker_pickup import BACK_TO_BACK_US

from batchsim.sim.fast import FAIR_SHARE_LEAD_S


def thread_cpu_s(res) -> np.ndarray:
    """The batches' CPU times (s): the loop's at dispatch and when it took the batch
    back, the worker's then (one row per batch)."""
    cpu_s = np.asarray(res.meta.get("batch_thread_cpu_s", ()), float)
    if cpu_s.ndim != 2 or cpu_s.shape[1] != 3:
        raise ValueError("res: a run without meta['batch_thread_cpu_s'] as the batcher "
                         "records it now (loop at dispatch, loop and worker at return)")
    return cpu_s


def batch_cpu(res):
    """Per batch but the first: the worker's CPU time from the previous batch's return to
    this one's, and this one's wall time from pick-up to end (s)."""
    worker_s = thread_cpu_s(res)[:, 2]
    picked_s = np.asarray(res.meta["batch_phases_s"], float)[:, 0]
    return np.diff(worker_s), (res.end_s - picked_s)[1:]


def batch_waits(res):
    """Per batch but the first: the worker's time waited to run from the previous batch's
    return to this one's, the loop's from this one's dispatch to its return, and whether
    the batch was held (s; empty for a run without the record)."""
    wait_s = np.asarray(res.meta.get("batch_thread_wait_s", np.empty((0, 3))), float)
    loop_s = (wait_s[:, 1] - wait_s[:, 0])[1:]
    held = loop_s > 0.5 * (res.end_s - res.start_s)[1:len(wait_s)]
    return np.diff(wait_s[:, 2]), loop_s, held


def lead_before_s(worker_wait_s: np.ndarray, worker_cpu_s: np.ndarray) -> np.ndarray:
    """The loop's lead over the worker before each batch (s), from each batch's worker
    wait and CPU time: 0 before the first, then grown by the wait less the CPU time,
    never below 0."""
    lead_s = np.zeros(worker_wait_s.size)
    for k in range(1, lead_s.size):
        lead_s[k] = max(0.0, lead_s[k - 1] + worker_wait_s[k - 1] - worker_cpu_s[k - 1])
    return lead_s


def held_after_lead(res):
    """Per batch after one not held: the loop's lead before it (s) and whether it was held."""
    worker_wait_s, _, held = batch_waits(res)
    worker_cpu_s = np.diff(thread_cpu_s(res)[:, 2])[:worker_wait_s.size]
    after_free = np.r_[False, ~held[:-1]] if held.size else held
    return lead_before_s(worker_wait_s, worker_cpu_s)[after_free], held[after_free]


def cycles(res, size: int):
    """Per batch but the first and the last: whether it and the next are batches of
    ``size`` back to back; the loop's CPU time from its dispatch to the next; the
    worker's CPU time for it; the requests received from its dispatch to the next."""
    loop_sent, _, worker_s = thread_cpu_s(res).T
    full = res.size == size
    back_to_back = res.start_s[1:] - res.end_s[:-1] <= BACK_TO_BACK_US / 1e6
    received = np.diff(np.searchsorted(res.arrival_s, res.start_s))
    return ((full[:-1] & full[1:] & back_to_back)[1:], np.diff(loop_sent)[1:],
            np.diff(worker_s)[:-1], received[1:])


def loop_fit(loop_s: np.ndarray, received: np.ndarray) -> tuple[float, float]:
    """The loop's CPU time a cycle as ``a + c * received`` by least squares: (a, c) in s."""
    if loop_s.size < 2 or np.ptp(received) == 0:
        return float("nan"), float("nan")
    c, a = np.polyfit(received, loop_s, 1)
    return float(a), float(c)


def cpu_report(runs) -> dict:
    """The measures of the module doc over ``runs``."""
    size = max(r.meta["policy"].max_batch_size for r in runs)  # only its runs fill it
    worker_s, wall_s, full = pooled(lambda r: (*batch_cpu(r), r.size[1:] == size), runs)
    kept, loop_s, worker_cycle_s, received = pooled(lambda r: cycles(r, size), runs)
    a_s, c_s = loop_fit(loop_s, received)
    worker_wait_s, loop_wait_s, held = pooled(batch_waits, runs)
    lead_s, held_next = pooled(held_after_lead, runs)
    over = f"{1e6 * FAIR_SHARE_LEAD_S:g}us"
    bins = {"lead=0": lead_s == 0, f"lead<={over}": (lead_s > 0) & (lead_s <= FAIR_SHARE_LEAD_S),
            f"lead>{over}": lead_s > FAIR_SHARE_LEAD_S}
    return {"batches": int(worker_s.size),
            "worker_share": float(np.median(worker_s / wall_s)) if worker_s.size else np.nan,
            "worker_cpu_us": median_us(worker_s[full]),
            "worker_wall_us": median_us(wall_s[full]),
            "cycles": int(kept.sum()),
            "loop_cycle_us": median_us(loop_s[kept]),
            "worker_cycle_us": median_us(worker_cycle_s[kept]),
            "loop_lead_us": median_us(loop_s[kept] - worker_cycle_s[kept]),
            "loop_per_cycle_us": 1e6 * a_s, "loop_per_request_us": 1e6 * c_s,
            "held_share": share(held),
            "worker_wait_us": median_us(worker_wait_s),
            "worker_wait_held_us": median_us(worker_wait_s[held]),
            "loop_wait_held_us": median_us(loop_wait_s[held]),
            **{f"held_after_{name}": share(held_next[b]) for name, b in bins.items()},
            **{f"n_after_{name}": int(b.sum()) for name, b in bins.items()}}


def analyze(saved: dict) -> dict:
    """Per part of the saved grid, the measures over its real runs."""
    return {name: cpu_report(runs) for name, runs in real_runs_by_part(saved).items()}


def main() -> None:
    saved_runs_main(__doc__, analyze, print_measures)


if __name__ == "__main__":
    main()
