"""When the worker's thread takes its batch up while the load generator is behind, how
long it then runs, and how the loop hands the worker its next batch: the real runs of a
``bench_fidelity.py --save-runs`` pickle.

A real run records the instant the worker's thread picked each batch up
(``meta["batch_phases_s"][:, 0]``); the batch was dispatched earlier (``start_s``). On
one CPU the worker's thread and the event loop share the core and the interpreter, so
a batch waits for the loop to let them go: most often the loop's sleep, but a generator
that has fallen behind does not sleep; it sends ``MAX_BURST`` requests, yields (the
loop polls without sleeping) and goes on. The engines have it go on at once, the batch's
end put off by each request it sends meanwhile (``BatcherCosts``). This bench measures,
for each part of the pickle (the calibration's runs, then each arrival set):

* ``pickup_us``: the median time from a batch's dispatch to its pick-up;
* ``yields_waiting``: the load generator's yields after a turn of ``MAX_BURST`` with
  more requests due, made while the batch dispatched before them waited for its worker;
  ``taken_at_yield_share``: the share after which the worker picked that batch up
  within ``TAKEN_US`` of the turn's last send. The worker then keeps the core to the
  batch's end and the generator, behind, waits for it, where the engines have it go on
  at once; ``first_taken_share``: the same over the first such yield after each
  dispatch only;
* ``clean_runs`` and ``run_clean_us``: the batches of the part's largest
  ``max_batch_size`` (where the bursts' error sits) dispatched within
  ``BACK_TO_BACK_US`` of the previous batch's end, into which the loop sent nothing
  after their pick-up, and to which it sent no request between that end and their
  pick-up; the median time from their pick-up to their end. ``disturbed_runs`` and
  ``run_disturbed_us``: the same for those it sent requests to meanwhile. Where the
  second is the longer, the worker's own part of a batch is slower after the loop ran
  its sends on the core (the engines charge a batch for the requests it receives and a
  wake-up by the time its worker went without a batch, nothing for sends between
  batches). Runs that the loop comes into (those past its timer, about 1.1 ms on a 1
  ms grid) are left out, so read it only where the batches are shorter;
* ``chain_turns`` and ``chain_held_share``: the generator's turns of ``MAX_BURST``,
  with more due, made while no batch was in flight and followed by a dispatch before
  its next turn. That is the order of a loop whose generator, behind, had its step
  queued ahead of the worker's report of its batch's end: the turn, then the dispatch.
  The share after which the generator's next turn waited for the end of the batch
  dispatched after it (the worker took the core). The engines decide at a release first
  and send after, so their generator never makes such a turn;
* ``release_quiet_us`` and ``release_behind_us`` (with ``quiet_releases`` and
  ``behind_releases``): after batches of the part's largest ``max_batch_size`` followed
  back to back, nothing sent in between, the median time from a batch's end to the next
  dispatch, split by whether a request of the schedule was due by that end (the
  generator behind) or not. The engines' release is one table by batch size, fitted on
  the calibration's releases, nearly all behind.

The simulator records no pick-up, so the bench reads real runs only. On one CPU (trios
O, N, M and U, ``bench/results/README.md``) the MLP's worker took the waiting batch at
6-7% of such yields in the burst sets and 0.3-0.8% in the Poisson ones; the CNN's and
the encoder's, at one yield a set at most. The MLP's batches of 64 ran 11-35 us longer
disturbed than clean. In the MLP's burst sets of O, N and M the generator's next turn
waited for the next batch's end after 77-80% of its chain turns (1,477-2,010 a set),
against 0-1% in the calibration's runs, and the release after a batch of 64 took 17-21
us quiet against 39-43 us behind; the CNN's and the encoder's releases at 64 did not
split.

Run: ``.venv/bin/python bench/bench_worker_pickup.py RUNS.pkl.gz [--out FILE]``.
"""

from __future__ import annotations

import numpy as np
from bench_fidelity import print_measures, real_runs_by_part, saved_runs_main
from bench_loop_turns import full_turn_yields, median_us, pooled, share, turn_starts

from batchsim.calibrate import _sending_due_s as due_s

#: How soon after a full turn's last send (us) a pick-up counts as taken at the yield:
#: the worker then took the core as the loop let the interpreter go.
TAKEN_US = 20.0
#: How soon after the previous batch's end (us) a batch must be dispatched for its run
#: to count in ``run_clean_us`` / ``run_disturbed_us``: back to back, so that the time
#: its worker went without a batch does not tell the two apart.
BACK_TO_BACK_US = 100.0


def pickup_s(res) -> np.ndarray:
    """When the worker's thread picked each batch up (s)."""
    return np.asarray(res.meta["batch_phases_s"], float)[:, 0]


def yields_taken(res):
    """For each yield of the generator after a turn of ``MAX_BURST`` whose next request
    was due by its last send, made while the batch dispatched last waited for its
    worker: when (s), whether the worker picked it up within ``TAKEN_US``, and whether
    the yield was the first since that dispatch."""
    yield_s, _ = full_turn_yields(res, turn_starts(res))
    k = np.searchsorted(res.start_s, yield_s, "right") - 1
    picked = pickup_s(res)[np.maximum(k, 0)]
    waiting = (k >= 0) & (yield_s < picked)
    taken = (picked - yield_s <= TAKEN_US / 1e6)[waiting]
    k = k[waiting]
    return yield_s[waiting], taken, np.diff(k, prepend=-1) != 0


def full_runs(res, size: int):
    """For each batch of ``size`` requests of ``res`` dispatched within
    ``BACK_TO_BACK_US`` of the previous batch's end and that received no request after
    its pick-up: whether the loop sent a request between that end and its pick-up, and
    its run from the pick-up to its end (s)."""
    picked, a = pickup_s(res), res.arrival_s
    previous_end_s = np.r_[-np.inf, res.end_s[:-1]]
    sent = np.searchsorted(a, picked, "right") - np.searchsorted(a, previous_end_s, "right")
    interrupted = np.searchsorted(a, res.end_s, "left") > np.searchsorted(a, picked, "right")
    kept = ((res.size == size) & np.isfinite(res.end_s) & ~interrupted
            & (res.start_s - previous_end_s <= BACK_TO_BACK_US / 1e6))
    return (sent > 0)[kept], (res.end_s - picked)[kept]


def chain_turns(res):
    """For each of ``full_turn_yields`` made with no batch in flight and followed by a
    dispatch before the generator's next turn: its yield (s), and whether that next turn
    waited for the end of the batch so dispatched."""
    yield_s, next_s = full_turn_yields(res, turn_starts(res))
    k = np.searchsorted(res.start_s, yield_s, "right")      # the next dispatch
    kk = np.minimum(k, res.start_s.size - 1)
    free = (k == 0) | (res.end_s[np.maximum(k - 1, 0)] <= yield_s)
    chain = free & (k < res.start_s.size) & (res.start_s[kk] < next_s)
    return yield_s[chain], (res.end_s[kk] <= next_s)[chain]


def full_releases(res, size: int):
    """For each batch of ``size`` requests whose successor was dispatched within
    ``BACK_TO_BACK_US`` of its end, no request sent in between: whether a request of the
    schedule was due by its end, and the release, from its end to that dispatch (s)."""
    a, end_s, next_s = res.arrival_s, res.end_s[:-1], res.start_s[1:]
    unsent = np.searchsorted(a, end_s, "right")      # the first request not sent by the end
    behind = (unsent < a.size) & (due_s(res)[np.minimum(unsent, a.size - 1)] <= end_s)
    release_s = next_s - end_s
    kept = ((res.size[:-1] == size) & (release_s <= BACK_TO_BACK_US / 1e6)
            & (np.searchsorted(a, next_s, "right") == unsent))
    return behind[kept], release_s[kept]


def pickup_report(runs) -> dict:
    """The measures of the module doc over ``runs``."""
    waits = np.concatenate([pickup_s(r) - r.start_s for r in runs])
    _, taken, first = pooled(yields_taken, runs)
    size = max(r.meta["policy"].max_batch_size for r in runs)
    disturbed, run_s = pooled(lambda r: full_runs(r, size), runs)
    return {"pickup_us": median_us(waits),
            "yields_waiting": int(taken.size),
            "taken_at_yield_share": share(taken),
            "first_taken_share": share(taken[first]),
            "clean_runs": int((~disturbed).sum()),
            "run_clean_us": median_us(run_s[~disturbed]),
            "disturbed_runs": int(disturbed.sum()),
            "run_disturbed_us": median_us(run_s[disturbed]),
            **chain_report(runs), **release_report(runs, size)}


def chain_report(runs) -> dict:
    """``chain_turns`` and ``chain_held_share`` over ``runs``."""
    _, held = pooled(chain_turns, runs)
    return {"chain_turns": int(held.size), "chain_held_share": share(held)}


def release_report(runs, size: int) -> dict:
    """The releases after back-to-back batches of ``size`` over ``runs``, quiet and
    behind."""
    behind, release_s = pooled(lambda r: full_releases(r, size), runs)
    return {"quiet_releases": int((~behind).sum()),
            "release_quiet_us": median_us(release_s[~behind]),
            "behind_releases": int(behind.sum()),
            "release_behind_us": median_us(release_s[behind])}


def analyze(saved: dict) -> dict:
    """Per part of the saved grid, the measures over its real runs."""
    return {name: pickup_report(runs) for name, runs in real_runs_by_part(saved).items()}


def main() -> None:
    saved_runs_main(__doc__, analyze, print_measures)


if __name__ == "__main__":
    main()
