"""``bench/bench_worker_pickup.py``: when the worker takes its batch up while the load
generator is behind."""

from types import SimpleNamespace

import numpy as np
import pytest
from bench_worker_pickup import (
    BACK_TO_BACK_US,
    TAKEN_US,
    analyze,
    chain_turns,
    full_releases,
    full_runs,
    pickup_report,
    yields_taken,
)

import batchsim as bs

US = 1e-6


def behind_run():
    """264 requests all due at 0, sent 1 us apart in turns of 64, 64, 64, 64 and 8 that
    start at 0, 73, 436, 600 and 800 us (after 1 s). Batch 0 is dispatched 10 us before
    the first turn and picked up 5 us after its last send (the first yield: taken);
    batch 1 is dispatched at 420 us and picked up at 700 us, 201 and 37 us after the
    yields of the third and fourth turns. The second turn's yield comes after batch 0's
    pick-up: no batch waits then. Batches of 64, batch 1 dispatched 20 us after batch 0's
    end; the last turn reaches it after its pick-up."""
    starts_us = [0, 73, 436, 600, 800]
    sizes = [64, 64, 64, 64, 8]
    sent = 1.0 + US * np.concatenate([s + np.arange(n) for s, n in zip(starts_us, sizes,
                                                                        strict=True)])
    start_s = 1.0 + US * np.array([-10.0, 420.0])
    picked_s = 1.0 + US * np.array([68.0, 700.0])
    return SimpleNamespace(arrival_s=sent, start_s=start_s,
                           end_s=1.0 + US * np.array([400.0, 1000.0]), size=np.array([64, 64]),
                           meta={"policy": bs.BatchPolicy(64, 0.0),
                                 "scheduled_s": np.zeros(sent.size),
                                 "turn_sizes": np.array(sizes),
                                 "batch_phases_s": np.c_[picked_s, np.full(2, np.nan),
                                                         picked_s + 300 * US]})


def test_yields_while_a_batch_waits_are_taken_when_the_pickup_follows_at_once():
    assert 5.0 <= TAKEN_US < 37.0
    yield_s, taken, first = yields_taken(behind_run())
    np.testing.assert_allclose(yield_s, 1.0 + US * np.array([63.0, 499.0, 663.0]), rtol=0,
                               atol=1e-9)
    assert taken.tolist() == [True, False, False]
    assert first.tolist() == [True, True, False]


def test_the_report_counts_the_yields_and_the_pickup_delay():
    report = pickup_report([behind_run()])
    assert report["pickup_us"] == pytest.approx((78 + 280) / 2)
    assert report["yields_waiting"] == 3
    assert report["taken_at_yield_share"] == pytest.approx(1 / 3)
    assert report["first_taken_share"] == pytest.approx(1 / 2)
    # Batch 1 is back to back, but the loop sent into its run: no run to split.
    assert (report["clean_runs"], report["disturbed_runs"]) == (0, 0)
    assert np.isnan(report["run_clean_us"]) and np.isnan(report["run_disturbed_us"])
    # Every full turn's yield finds a batch in flight: no chain turn.
    assert report["chain_turns"] == 0 and np.isnan(report["chain_held_share"])
    # Batch 0 ends at 400 us with turn 2 due and not sent; batch 1 follows 20 us later.
    assert (report["quiet_releases"], report["behind_releases"]) == (0, 1)
    assert report["release_behind_us"] == pytest.approx(20.0)


def test_a_run_that_never_fell_behind_has_no_yields_to_share():
    """One request a turn, each due 1 ms after the last: no turn of 64, NaN shares."""
    due = 1e-3 * np.arange(1, 11)
    res = SimpleNamespace(arrival_s=due + 5 * US, start_s=due + 20 * US, end_s=due + 300 * US,
                          size=np.ones(10, int),
                          meta={"policy": bs.BatchPolicy(1, 0.0), "scheduled_s": due,
                                "turn_sizes": np.ones(10, int),
                                "batch_phases_s": np.c_[due + 60 * US, np.full(10, np.nan),
                                                        due + 300 * US]})
    report = pickup_report([res])
    assert report["pickup_us"] == pytest.approx(40.0)
    assert report["yields_waiting"] == 0
    assert np.isnan(report["taken_at_yield_share"]) and np.isnan(report["first_taken_share"])
    assert (report["clean_runs"], report["disturbed_runs"]) == (0, 0)   # 720 us apart


def test_every_part_of_a_saved_grid_is_read():
    res = behind_run()
    report = analyze({"calibration_runs": [res], "runs": {"bursty": [{"real": res}]}})
    assert set(report) == {"calibration_runs", "bursty"}
    assert report["bursty"] == pytest.approx(report["calibration_runs"], nan_ok=True)


def test_back_to_back_runs_split_by_whether_the_loop_sent_before_the_pickup():
    """Batches of 2 (us): b0 is the first (no previous end) and the loop sends into its
    run; b1 starts 30 us after b0's end with nothing sent since, and runs 160 us; b2
    starts 30 us after b1's end, the loop having sent two requests before its pick-up,
    and runs 200 us; b3 starts 160 us after b2's end (not back to back)."""
    sent_us = np.array([0, 1, 50, 51, 420, 421, 790, 791])
    start_us, picked_us = np.array([5, 230, 430, 800]), np.array([10, 240, 440, 805])
    end_us = np.array([200, 400, 640, 1000])
    res = SimpleNamespace(arrival_s=sent_us * US, start_s=start_us * US, end_s=end_us * US,
                          size=np.full(4, 2),
                          meta={"policy": bs.BatchPolicy(2, 0.0), "scheduled_s": sent_us * US,
                                "turn_sizes": np.ones(8, int),
                                "batch_phases_s": np.c_[picked_us * US, np.full(4, np.nan),
                                                        end_us * US]})
    assert BACK_TO_BACK_US < 160 and BACK_TO_BACK_US > 30
    disturbed, run_s = full_runs(res, 2)
    assert disturbed.tolist() == [False, True]
    np.testing.assert_allclose(run_s, [160 * US, 200 * US], rtol=1e-9)
    report = pickup_report([res])
    assert (report["clean_runs"], report["disturbed_runs"]) == (1, 1)
    assert report["run_clean_us"] == pytest.approx(160.0)
    assert report["run_disturbed_us"] == pytest.approx(200.0)
    assert report["yields_waiting"] == 0


def test_a_full_turn_before_a_dispatch_is_held_when_the_next_turn_waits_for_its_end():
    """Turns of 64, 64, 64, 64, 64 and 8, all due before the run, sent 1 us apart from
    -100, 110, 420, 700, 900 and 1000 us; batches dispatched at -50, 190 and 500 us end at
    105, 400 and 800. Batch 0 is in flight at the first turn's yield; the second and third
    turns come with no batch in flight, each followed by a dispatch: the third turn waits
    for batch 1's end, the fourth comes before batch 2's. The fifth comes with no batch in
    flight but no dispatch follows it."""
    starts_us, sizes = [-100, 110, 420, 700, 900, 1000], [64, 64, 64, 64, 64, 8]
    sent = US * np.concatenate([s + np.arange(n) for s, n in zip(starts_us, sizes,
                                                                 strict=True)])
    start_s, end_s = US * np.array([-50.0, 190.0, 500.0]), US * np.array([105.0, 400.0, 800.0])
    res = SimpleNamespace(arrival_s=sent, start_s=start_s, end_s=end_s,
                          size=np.full(3, 64),
                          meta={"policy": bs.BatchPolicy(64, 0.0),
                                "scheduled_s": np.full(sent.size, -1e-3),
                                "turn_sizes": np.array(sizes),
                                "batch_phases_s": np.c_[start_s + 10 * US,
                                                        np.full(3, np.nan), end_s]})
    yield_s, held = chain_turns(res)
    np.testing.assert_allclose(yield_s, US * np.array([173.0, 483.0]), rtol=0, atol=1e-9)
    assert held.tolist() == [True, False]
    report = pickup_report([res])
    assert report["chain_turns"] == 2
    assert report["chain_held_share"] == pytest.approx(0.5)


def test_releases_after_full_batches_split_by_whether_a_request_was_due():
    """Batches of 2 (us): b0 ends at 100 and b1 follows at 120, the next request due at
    150 (quiet); b1 ends at 300 and b2 follows at 340 with a request due at 290 not yet
    sent (behind); b2 ends at 500 and b3 follows at 520, a request sent at 510 in
    between; b4 comes 200 us after b3's end (not back to back)."""
    due_us = np.array([0, 0, 50, 51, 150, 151, 290, 291, 505, 506])
    sent_us = np.array([0, 1, 50, 51, 150, 151, 345, 346, 510, 511])
    start_us, end_us = np.array([5, 120, 340, 520, 900]), np.array([100, 300, 500, 700, 1000])
    res = SimpleNamespace(arrival_s=sent_us * US, start_s=start_us * US, end_s=end_us * US,
                          size=np.full(5, 2),
                          meta={"policy": bs.BatchPolicy(2, 0.0), "scheduled_s": due_us * US,
                                "turn_sizes": np.full(5, 2),
                                "batch_phases_s": np.c_[(start_us + 5) * US,
                                                        np.full(5, np.nan), end_us * US]})
    behind, release_s = full_releases(res, 2)
    assert behind.tolist() == [False, True]
    np.testing.assert_allclose(release_s, [20 * US, 40 * US], rtol=1e-9)
    assert full_releases(res, 4)[0].size == 0       # no batch of 4
    report = pickup_report([res])
    assert (report["quiet_releases"], report["behind_releases"]) == (1, 1)
    assert report["release_quiet_us"] == pytest.approx(20.0)
    assert report["release_behind_us"] == pytest.approx(40.0)
