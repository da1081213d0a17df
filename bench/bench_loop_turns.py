"""How the load generator's turns meet the batcher's event loop: real runs against the
simulator on the same schedule.

``run_load`` sends on the batcher's own loop: it wakes, sends every request due (at most
``max_burst`` at a time), re-arms its sleep and yields. The instant the next request falls
due decides whether it is sent at once or after a sleep (asyncio's epoll selector rounds a
sleep up to whole milliseconds, or the batch's end wakes the loop first), and so where
the requests land: while a batch runs (each delays it) or between batches. For each part
of a ``bench_fidelity.py --save-runs`` pickle (the calibration's runs, then each arrival
set) this bench prints, for the real runs and for the simulator (``sender="loop"``, the
saved calibration) on the same schedules:

* ``linger_us``: how long the loop stayed awake after a turn sent while a batch ran,
  before it slept: the delay from the turn's last send to the next request's due
  instant that splits those sent without a sleep from those sent after one;
* ``awake_late_us``: the median lateness of the requests that fell due then, sent
  without a sleep;
* ``capped_share``: the share of requests sent in turns of ``max_burst`` or more (the
  real generator had fallen behind: it yields after such a turn and goes on; the
  simulated one sends all that is due in one turn);
* ``between_share``: the share of requests the batcher received while no batch ran
  (after one's end, before the next one's dispatch: they delay no batch);
* ``turns_per_batch``: the turns that brought a batch the requests it received while it
  ran, over the batches that received any;
* ``chain_round_us`` and ``chain_round_batch_end_us``: the median time from the last
  send of a turn of ``max_burst`` to the next turn, with a request already due (the
  generator yielded and goes on), when no batch ended in between and when one did
  (``chain_rounds_batch_end``, how many); NaN where none. On one core, a generator that
  is behind may not get the loop back until the running batch ends;
* ``busy_wake_share``: of the loop's sleeps begun during a batch whose timer fires at
  least ``BUSY_MARGIN_US`` before the batch's end (the fire as the saved calibration's
  timer model reads it, the sleep begun one linger after the turn's last send; how
  many: ``busy_wakes``), the share after which the next turn came before that end;
  ``busy_wake_late_us``, the median time from the fire to that turn. The simulated loop
  always wakes at its timer (the turn comes one reaction after the fire). On one CPU
  kept awake by a spinner at idle priority, the real loop woke before the batch's end
  after 0-71% (median 42%) of such sleeps in the arrival sets of the tiny CNN's and
  encoder's grids of trios O, N and M, a median of 84-112 us after the fire; the others
  lasted past the batch's end. Kept awake by a PM QoS request instead (trios R and R2),
  after 98-100% where a set had over 50 (``bench/results/README.md``).

Turns are the run's own record (``meta["turn_sizes"]``); runs saved before ``run_load``
kept it are split where a request was not yet due when the one before it was sent, and
every ``max_burst`` requests (a generator that fell behind sends turn after turn). On
grid L that split 1.4% more turns than the record and merged none: a request that fell
due during the send before it joined that turn. The bench needs numpy and batchsim (it simulates).

Run: ``.venv/bin/python bench/bench_loop_turns.py RUNS.pkl.gz [--out FILE]``.
"""

from __future__ import annotations

import numpy as np
from bench_fidelity import saved_runs_main

from batchsim.calibrate import _after_turns as after_turns
from batchsim.calibrate import _linger_split_s as linger_split_s
from batchsim.calibrate import _sending_due_s as due_s
from batchsim.calibrate import _turn_firsts as turn_firsts
from batchsim.fidelity import simulate_schedule
from batchsim.sim.fast import MAX_BURST


def turn_starts(res) -> np.ndarray:
    """Index of the first request of each of the load generator's turns."""
    recorded = turn_firsts(res)
    if recorded is not None:
        return recorded
    scheduled_s = res.meta["scheduled_s"]
    runs = np.flatnonzero(np.r_[True, scheduled_s[1:] > res.arrival_s[:-1]])
    # A run of requests each due before the send before it is one turn per max_burst.
    lengths = np.diff(np.r_[runs, scheduled_s.size])
    chunks = -(-lengths // MAX_BURST)
    return np.repeat(runs, chunks) + MAX_BURST * (np.arange(chunks.sum())
                                                   - np.repeat(np.cumsum(chunks) - chunks, chunks))


def full_turn_yields(res, first: np.ndarray):
    """For each turn of ``max_burst`` (``first``: ``turn_starts(res)``) followed by one
    whose first request was already due at its last send (the generator yielded and
    goes on): that last send and the next turn's first (s)."""
    a, due = res.arrival_s, due_s(res)
    last = np.r_[first[1:], a.size] - 1
    full = np.flatnonzero(last[:-1] - first[:-1] + 1 >= MAX_BURST)
    full = full[due[first[full + 1]] <= a[last[full]]]
    return a[last[full]], a[first[full + 1]]


def chain_rounds(res, first: np.ndarray):
    """For each of ``full_turn_yields``: the time to the next turn (s) and whether a
    batch ended in it."""
    t0, t1 = full_turn_yields(res, first)
    k = np.searchsorted(res.end_s, t0, "right")
    ended = (k < res.end_s.size) & (res.end_s[np.minimum(k, res.end_s.size - 1)] < t1)
    return t1 - t0, ended


#: How long before a batch's end (us) the loop's timer must fire for ``busy_wakes`` to
#: count its sleep: the real loop's turn came about 100 us after the modelled fire.
BUSY_MARGIN_US = 200.0


def busy_wakes(res, first: np.ndarray, costs):
    """For each sleep of the loop begun during a batch (after a turn, ``first`` the index
    of each turn's first request, whose next request was not yet due at its last send)
    whose timer fires at least ``BUSY_MARGIN_US`` before the batch's end: whether the
    next turn came before that end, and its time after the fire (s)."""
    a, due = res.arrival_s, due_s(res)
    sleep_s = a[first[1:] - 1] + costs.linger_s
    next_due_s, next_s = due[first[1:]], a[first[1:]]
    k = np.searchsorted(res.start_s, a[first[1:] - 1], "right") - 1
    end_s = res.end_s[np.maximum(k, 0)]
    fire_s = np.array([costs.timer_fire_s(s, d) for s, d in zip(sleep_s, next_due_s,
                                                                 strict=True)])
    kept = ((k >= 0) & (sleep_s < end_s) & (next_due_s > sleep_s)
            & (fire_s + BUSY_MARGIN_US / 1e6 <= end_s))
    return (next_s < end_s)[kept], (next_s - fire_s)[kept]


def turn_report(runs, timer_resolution_ms: float) -> dict:
    """The measures of the module doc over ``runs``."""
    firsts = [turn_starts(r) for r in runs]
    delays, awake, late = pooled(lambda r, first: after_turns(r, first, timer_resolution_ms),
                                 runs, firsts)
    sizes = np.concatenate([np.diff(np.r_[first, r.arrival_s.size])
                            for r, first in zip(runs, firsts, strict=True)])
    between = turns = received = 0
    for r, first in zip(runs, firsts, strict=True):
        a = r.arrival_s
        k = np.searchsorted(r.start_s, a, "right") - 1
        between += int(np.sum((k < 0) | (a >= r.end_s[np.maximum(k, 0)])))
        lo, hi = np.searchsorted(a, r.start_s, "right"), np.searchsorted(a, r.end_s, "left")
        turn_of = np.searchsorted(first, np.arange(a.size), "right") - 1
        got = hi > lo
        turns += int(np.sum(turn_of[hi[got] - 1] - turn_of[lo[got]] + 1))
        received += int(got.sum())
    sent_awake = late[awake & (delays <= linger_split_s(delays, awake))]
    rounds_s, ended = pooled(chain_rounds, runs, firsts)
    return {"linger_us": 1e6 * linger_split_s(delays, awake),
            "awake_late_us": median_us(sent_awake),
            "capped_share": float(sizes[sizes >= MAX_BURST].sum() / sizes.sum()),
            "between_share": between / sum(r.arrival_s.size for r in runs),
            "turns_per_batch": turns / received if received else float("nan"),
            "chain_round_us": median_us(rounds_s[~ended]),
            "chain_round_batch_end_us": median_us(rounds_s[ended]),
            "chain_rounds_batch_end": int(ended.sum())}


def busy_report(runs, costs) -> dict:
    """``busy_wakes``, ``busy_wake_share`` and ``busy_wake_late_us`` over ``runs``."""
    woke, late_s = pooled(lambda r: busy_wakes(r, turn_starts(r), costs), runs)
    return {"busy_wakes": int(woke.size),
            "busy_wake_share": share(woke),
            "busy_wake_late_us": median_us(late_s[woke])}


def pooled(arrays_of, *per_run) -> tuple[np.ndarray, ...]:
    """``arrays_of`` (a tuple of arrays for one run) called on each run (``per_run``: the
    runs, and any further argument per run, as ``map`` takes them), each of its arrays
    concatenated over the runs."""
    return tuple(np.concatenate(v) for v in zip(*map(arrays_of, *per_run), strict=True))


def share(flags: np.ndarray) -> float:
    """The share of True (NaN of none)."""
    return float(flags.mean()) if flags.size else float("nan")


def median_us(x_s: np.ndarray) -> float:
    """The median in microseconds (NaN of none)."""
    return 1e6 * float(np.median(x_s)) if x_s.size else float("nan")


def analyze(saved: dict) -> dict:
    """Per part of the saved grid, the measures for the real runs and the simulated ones."""
    service = saved["service"]
    g = service.costs.timer_resolution_ms
    parts = {"calibration_runs": [(r, r.meta["policy"], r.meta["seed"])
                                  for r in saved["calibration_runs"]]}
    for name, rows in saved["runs"].items():
        parts[name] = [(row["real"], row["policy"], row["seed"]) for row in rows]
    report = {}
    for name, rows in parts.items():
        sims = [simulate_schedule(real, policy, service, seed) for real, policy, seed in rows]
        sides = {"real": [real for real, _, _ in rows], "sim": sims}
        report[name] = {side: {**turn_report(side_runs, g),
                               **busy_report(side_runs, service.costs)}
                        for side, side_runs in sides.items()}
    return report


def print_report(report: dict) -> None:
    for name, sides in report.items():
        print(f"{name}:")
        for key in sides["real"]:
            print(f"   {key:>24}: real {sides['real'][key]:8.3f}   sim {sides['sim'][key]:8.3f}")


def main() -> None:
    saved_runs_main(__doc__, analyze, print_report)


if __name__ == "__main__":
    main()
