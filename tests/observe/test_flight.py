"""The collective flight recorder: records, the ring, listeners, steps (stratagem/observe/flight.py)."""

from __future__ import annotations

import threading

import pytest

from stratagem.observe import flight


def test_a_record_is_in_flight_until_it_ends() -> None:
    seq = flight.begin("test all_reduce", 1024, "worker 0, worker 1")
    mine = [r for r in flight.in_flight() if r.seq == seq]
    assert [(r.kind, r.nbytes, r.peers, r.end_monotonic) for r in mine] == \
        [("test all_reduce", 1024, "worker 0, worker 1", None)]
    assert mine[0].thread == threading.get_ident() and mine[0].end_wall is None
    flight.end(seq)
    assert seq not in [r.seq for r in flight.in_flight()]
    last = flight.last_completed()
    assert last.seq == seq and last.end_monotonic >= last.start_monotonic
    assert last.end_wall == pytest.approx(last.start_wall + (last.end_monotonic - last.start_monotonic))


def test_sequence_numbers_grow_and_records_come_oldest_first() -> None:
    with flight.record("first") as first:
        pass
    with flight.record("second") as second:
        pass
    assert second == first + 1
    kept = [r.seq for r in flight.records()]
    assert kept == sorted(kept) and kept[-2:] == [first, second]


def test_the_ring_keeps_the_last_records_only() -> None:
    first = flight.begin("old and open")   # never ended: overwritten, no longer in flight
    for _ in range(flight.CAPACITY):
        flight.end(flight.begin("filler"))
    kept = flight.records()
    assert len(kept) == flight.CAPACITY and kept[0].seq > first
    assert first not in [r.seq for r in flight.in_flight()]


def test_a_record_ends_when_its_block_raises() -> None:
    with pytest.raises(RuntimeError), flight.record("failing") as seq:
        raise RuntimeError("the collective failed")
    assert flight.last_completed().seq == seq


def test_last_completed_is_the_highest_sequence_number_ended() -> None:
    early, late = flight.begin("early"), flight.begin("late")
    flight.end(late)
    flight.end(early)   # (async packs end out of order)
    assert flight.last_completed().seq == late


def test_listeners_see_each_start_and_end_until_removed() -> None:
    seen: list[flight.Record] = []
    remove = flight.add_listener(seen.append)
    with flight.record("heard", 8, "2 replicas") as seq:
        pass
    remove()
    remove()   # (twice is harmless)
    with flight.record("not heard"):
        pass
    assert [(r.seq, r.kind, r.end_monotonic is None) for r in seen] == [(seq, "heard", True), (seq, "heard", False)]


def test_steps_and_progress() -> None:
    before_step, before = flight.step(), flight.progress()
    flight.note_step()
    with flight.record("in the step") as seq:
        pass
    assert flight.step() == before_step + 1
    assert flight.progress() == before + 2
    assert [r.step for r in flight.records() if r.seq == seq] == [before_step + 1]
    with flight.record("rpc renew_lease"):   # housekeeping calls are no progress
        pass
    assert flight.progress() == before + 2


def test_threads_record_side_by_side() -> None:
    def work() -> None:
        for _ in range(200):
            with flight.record("threaded"):
                pass
    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    threaded = [r for r in flight.records() if r.kind == "threaded"]
    assert len(threaded) == 800 and len({r.seq for r in threaded}) == 800
    assert all(r.end_monotonic is not None for r in threaded)
