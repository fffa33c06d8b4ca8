"""AckHold, the ledger of a spilling sink's upstream acks (no broker, no disk, no clock).

Mode `landed`: a call is released only once every spool file touched at or before it has landed,
in registration order, whatever order the files land in. Mode `written`: every call at once.
A model (the longest prefix of calls whose files all landed) checks random interleavings.
"""

from __future__ import annotations

from typing import List, Set

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.spill.ackhold import ACK_MODES, AckHold

A, B, C = "batches+n1+2026-12-06+0000000001", "batches+n1+2026-12-06+0000000002", "records+n1+2026-12-06+0000000003"


def test_written_releases_every_call_at_once_and_holds_nothing() -> None:
    hold = AckHold("written")
    hold.wrote([A])
    hold.wrote([A], calls=3)
    hold.wrote([])
    assert hold.take() == 5
    assert hold.held == 0 and hold.unlanded() == [] and hold.held_since() is None
    assert hold.take() == 0


def test_landed_never_releases_a_call_before_its_file_landed() -> None:
    hold = AckHold("landed")
    hold.wrote([A], now=10.0)
    hold.wrote([A], now=11.0, calls=2)
    assert hold.take() == 0
    assert hold.held == 3 and hold.held_since() == 10.0 and hold.waits_on() == [A]
    hold.landed(B)  # another file: nothing of ours
    assert hold.take() == 0
    hold.landed(A)
    assert hold.take() == 3
    assert hold.held == 0 and hold.unlanded() == [] and hold.held_since() is None


def test_a_file_landing_out_of_order_releases_nothing_until_the_earlier_one_landed() -> None:
    hold = AckHold("landed")
    hold.wrote([A], now=1.0)
    hold.wrote([B], now=2.0)
    hold.wrote([B], now=3.0)
    hold.landed(B)
    assert hold.take() == 0
    assert hold.waits_on() == [A]
    hold.landed(A)
    assert hold.take() == 3


def test_calls_are_released_in_order_file_by_file() -> None:
    hold = AckHold("landed")
    hold.wrote([A], now=1.0)
    hold.wrote([B], now=2.0, calls=2)
    hold.wrote([C], now=3.0)
    hold.landed(A)
    assert hold.take() == 1
    assert hold.held_since() == 2.0 and hold.waits_on() == [B]
    hold.landed(B)
    assert hold.take() == 2
    assert hold.waits_on() == [C]
    hold.landed(C)
    assert hold.take() == 1


def test_a_call_of_duplicates_only_waits_for_every_file_written_before_it() -> None:
    # Its ids were dropped as copies of ids recorded earlier: they may be in any earlier file.
    hold = AckHold("landed")
    hold.wrote([A])
    hold.wrote([B])
    hold.landed(A)
    assert hold.take() == 1
    hold.wrote([])
    assert hold.take() == 0
    hold.landed(B)
    assert hold.take() == 2


def test_a_call_with_no_line_and_nothing_unlanded_is_released_at_once() -> None:
    hold = AckHold("landed")
    hold.wrote([])
    assert hold.take() == 1
    hold.wrote([A])
    hold.landed(A)
    hold.wrote([])
    assert hold.take() == 2


def test_a_call_writing_to_two_files_waits_for_both() -> None:
    hold = AckHold("landed")
    hold.wrote([A, C])
    hold.landed(C)
    assert hold.take() == 0
    hold.landed(A)
    assert hold.take() == 1


def test_a_restart_holds_its_first_calls_until_the_files_left_by_the_previous_incarnation_landed() -> None:
    # Replays of records spooled before the crash are dropped as duplicates: acked only once the
    # file holding the first copy landed.
    hold = AckHold("landed", unlanded=[A, B])
    assert hold.take() == 0 and hold.held == 0
    hold.wrote([])
    hold.wrote([C])
    hold.landed(A)
    assert hold.take() == 0
    hold.landed(B)
    assert hold.take() == 1  # the call of duplicates; the next one waits for C
    hold.landed(C)
    assert hold.take() == 1


def test_a_restart_re_reads_nothing_it_should_not() -> None:
    # Nothing left on disk: the restarted sink owes nothing and waits for nothing; a landed report
    # for a file of the previous incarnation (already released) is ignored, never counted as ours.
    hold = AckHold("landed", unlanded=[])
    hold.landed(A)
    assert hold.stats["unknown_landed"] == 1 and hold.stats["files_landed"] == 0
    hold.wrote([])
    assert hold.take() == 1
    hold.wrote([B])
    hold.landed(A)  # again, unknown: must not release B's call
    assert hold.take() == 0
    hold.landed(B)
    hold.landed(B)  # a second report of the same file changes nothing
    assert hold.take() == 1
    assert hold.stats == {"calls": 2, "released": 2, "files": 1, "files_landed": 1, "unknown_landed": 3}


def test_an_unknown_mode_or_no_call_is_refused_naming_what_is_expected() -> None:
    with pytest.raises(ValueError, match="written, landed"):
        AckHold("shipped")
    with pytest.raises(ValueError, match="at least 1"):
        AckHold("landed").wrote([A], calls=0)
    assert ACK_MODES == ("written", "landed")


FILES = [f"batches+n1+2026-12-06+{i:010d}" for i in range(6)]


@st.composite
def histories(draw: st.DrawFn) -> List[tuple]:
    """Calls writing to files in open order (a file is closed for good once the next one opened),
    interleaved with landings of closed files in any order, repeats included."""
    steps: List[tuple] = []
    current = 0
    for _ in range(draw(st.integers(1, 40))):
        what = draw(st.sampled_from(["call", "dup", "next", "land"]))
        if what == "call":
            steps.append(("wrote", [FILES[current]], draw(st.integers(1, 3))))
        elif what == "dup":
            steps.append(("wrote", [], 1))
        elif what == "next" and current + 1 < len(FILES):
            current += 1
        elif what == "land" and current > 0:
            steps.append(("landed", FILES[draw(st.integers(0, current - 1))]))
    steps += [("landed", f) for f in draw(st.permutations(FILES))]
    return steps


@settings(max_examples=300, deadline=None)
@given(histories())
def test_released_calls_are_exactly_the_longest_prefix_whose_files_all_landed(steps: List[tuple]) -> None:
    hold = AckHold("landed")
    calls: List[Set[str]] = []  # per call: every file touched at or before it (model)
    touched: Set[str] = set()
    landed: Set[str] = set()
    released = 0
    for step in steps:
        if step[0] == "wrote":
            hold.wrote(step[1], calls=step[2])
            touched |= set(step[1])
            calls += [set(touched)] * step[2]
        else:
            hold.landed(step[1])
            landed.add(step[1])
        released += hold.take()
        expect = 0
        while expect < len(calls) and calls[expect] <= landed:
            expect += 1
        assert released == expect
        assert hold.held == len(calls) - released
    assert released == len(calls)


def test_oldest_is_the_first_file_mentioned_and_not_landed() -> None:
    hold = AckHold("landed", unlanded=[B])
    hold.wrote([C])
    hold.wrote([A])
    assert hold.oldest() == B and hold.unlanded() == [B, C, A]
    hold.landed(C)
    assert hold.oldest() == B and hold.unlanded() == [B, A]
    hold.landed(B)
    assert hold.oldest() == A
    hold.landed(A)
    assert hold.oldest() is None and hold.take() == 2
