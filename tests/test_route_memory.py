"""Where each record went (agent.dataplane.sticky) and the outbox's pinned records: a record sent
again takes the same path (docs/design.md invariant 8). Pure: no broker, no clock."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.dataplane.routing import Outbox, Router
from agent.dataplane import sticky
from agent.dataplane.sticky import RouteMemory


def recs(src: str, *seqs: int):  # type: ignore[no-untyped-def]
    return [(src, s, {"v": s}) for s in seqs]


def test_a_record_sent_before_is_pinned_to_its_successor_while_that_one_is_in_the_table() -> None:
    mem = RouteMemory()
    mem.sent("sink-a", recs("src", 1, 2, 3), bound=1)
    mem.sent("sink-b", recs("src", 4, 5) + recs("other", 1), bound=2)
    items = recs("src", 2, 5, 9) + recs("other", 1)
    free, pinned, gone = mem.split(items, ("sink-a", "sink-b"))
    assert [(it[0], it[1]) for it in free] == [("src", 9)] and gone == []
    assert {d: [(it[0], it[1]) for it in r] for d, r in pinned.items()} == {
        "sink-a": [("src", 2)], "sink-b": [("src", 5), ("other", 1)]}
    # sink-b left the table (it drained what it had, so it recorded them): its records are
    # returned apart, to go nowhere (another sink instance would record them twice)
    free, pinned, gone = mem.split(items, ("sink-a", "sink-c"))
    assert [(it[0], it[1]) for it in free] == [("src", 9)]
    assert [(it[0], it[1]) for it in gone] == [("src", 5), ("other", 1)]
    assert list(pinned) == ["sink-a"]
    fresh = recs("src", 10, 11)
    assert mem.split(fresh, ("sink-a",)) == (fresh, {}, [])  # nothing sent before: the list itself


def test_records_are_remembered_until_acked_upstream_then_retain_seconds_persisted_for_grace() -> None:
    mem = RouteMemory(retain=30.0, grace=5.0)
    mem.sent("a", recs("src", 1, 2), bound=1)
    mem.sent("b", recs("src", 3), bound=2)
    mem.released(0, now=100.0)  # nothing acked yet
    assert len(mem.snapshot(100.0)) == 2
    mem.released(1, now=101.0)  # input 1 acked upstream: batch 1 is past its replays soon
    assert mem.dest_of("src", 1) == "a" and len(mem.snapshot(105.9)) == 2
    assert mem.snapshot(106.0) == [["b", {"src": [3, 1]}]]  # past the grace: not persisted
    mem.released(1, now=130.9)
    assert mem.dest_of("src", 1) == "a"  # still in memory: an upstream crash may send it again
    mem.released(1, now=131.0)
    assert mem.dest_of("src", 1) is None and mem.dest_of("src", 3) == "b" and len(mem) == 1
    mem.released(2, now=131.0)
    mem.released(2, now=161.0)
    assert len(mem) == 0 and mem.split(recs("src", 3), ("b",))[1] == {}


def test_a_record_sent_again_is_forgotten_only_with_its_last_send() -> None:
    mem = RouteMemory(retain=10.0)
    mem.sent("a", recs("src", 1), bound=1)
    mem.released(1, now=0.0)
    mem.sent("a", recs("src", 1), bound=2)  # replayed, sent to the same successor again
    mem.released(1, now=10.0)  # the first send expires
    assert mem.dest_of("src", 1) == "a"


def test_the_memory_survives_a_restart_through_its_files_and_a_damaged_one_is_refused(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    mem = RouteMemory()
    mem.sent("a", recs("src", 1, 2, 3, 7), bound=1)
    snap, log = mem.take_save(0.0)  # the first save writes a snapshot
    assert log == "" and json.loads(snap) == [["a", {"src": [1, 3, 3, 1]}]]  # 1-3, then 7 = 4 + 3
    mem.sent("b", recs("src", 4) + recs("s2", 0), bound=1)
    snap2, log2 = mem.take_save(0.0)
    assert snap2 is None and json.loads(log2) == [["b", {"src": [4, 1], "s2": [0, 1]}]]
    back = RouteMemory.load(snap, log2 + '[["c",{"src":[5', now=50.0)  # a torn last line: skipped
    assert [back.dest_of("src", s) for s in (1, 2, 3, 4, 5, 7)] == ["a", "a", "a", "b", None, "a"]
    assert back.dest_of("s2", 0) == "b"
    back.released(0, now=79.9)
    assert back.dest_of("src", 1) == "a"  # restored = acked at the restart, kept RETAIN more
    back.released(0, now=80.0)
    assert len(back) == 0
    assert len(RouteMemory.load(None, None, 0.0)) == 0
    for bad in ('{"a": 1}', '[["a"]]', '[[1, {}]]', '[["a", {"src": [1]}]]', '[["a", {"src": [1, -1]}]]',
                '[["a", {"src": ["x", 1]}]]', "[[["):
        with pytest.raises(ValueError, match="route memory"):
            RouteMemory.load(bad, "", 0.0)
    with pytest.raises(ValueError, match="route memory"):  # damaged in the middle: not a torn write
        RouteMemory.load(snap, "[[[\n" + log2, 0.0)
    monkeypatch.setattr(sticky, "MAX_RESTORED", 2)  # what a file may bring back is bounded (in ranges)
    assert len(RouteMemory.load('[["a", {"src": [0, 1000, 5, 1]}]]', "", 0.0)) == 1001
    with pytest.raises(ValueError, match="more than 2 id ranges"):
        RouteMemory.load('[["a", {"src": [0, 1, 1, 1, 1, 1]}]]', "", 0.0)
    monkeypatch.setattr(sticky, "MAX_RESTORED", 10)
    monkeypatch.setattr(sticky, "MAX_RUNS", 2)  # past the cap the newest batches are kept
    back = RouteMemory.load('[["a", {"src": [0, 1]}], ["b", {"src": [1, 1]}]]', '[["c", {"src": [2, 1]}]]\n', 0.0)
    assert [back.dest_of("src", s) for s in range(3)] == [None, "b", "c"] and back.runs() == 2


def test_the_log_is_replaced_by_a_snapshot_once_it_outgrows_it() -> None:
    mem = RouteMemory(grace=5.0)
    mem.take_save(0.0)
    sizes, snapshots = 0, 0
    for k in range(3000):
        mem.sent("a", recs("src", *range(100 * k, 100 * k + 100, 3)), bound=k + 1)
        mem.released(k, now=float(k))  # everything but the last batch acked upstream at once
        snap, log = mem.take_save(float(k))
        if snap is not None:
            snapshots += 1
            # the snapshot holds the batches still needed: unacked, or acked < 5 s ago
            assert len(json.loads(snap)) == 6
        sizes += len(log)
    assert 1 <= snapshots and sizes < 3000 * 200  # the log costs what was sent: ~140 B a batch


def test_past_max_runs_the_oldest_acked_records_go_first_never_unacked_ones() -> None:
    mem = RouteMemory(retain=1000.0, max_runs=1)
    mem.sent("a", recs("src", 1, 2), bound=1)
    mem.sent("a", recs("src", 3, 4), bound=2)
    mem.released(0, now=0.0)
    assert len(mem) == 4  # nothing acked upstream: all needed after a crash
    mem.released(1, now=0.0)
    assert len(mem) == 2 and mem.dest_of("src", 3) == "a" and mem.dest_of("src", 1) is None


def test_pinned_records_wait_for_their_successor_and_go_back_to_round_robin_when_it_leaves() -> None:
    router = Router(("a", "b"))
    box = Outbox(router, batch_size=2, linger=0.0)
    box.add_to("b", recs("src", 1, 2, 3), index=1, now=0.0)
    box.add(recs("src", 4), index=2, now=0.0)
    credit = {"a": 5, "b": 1}
    out = box.take(0.0, lambda d: credit[d])
    assert [(d, [it[1] for it in items]) for d, items, _ in out] == [("b", [1, 2]), ("a", [4])]
    assert box.pending == 1 and box.lowest_index() == 1
    router.remove("b")
    assert box.reroute(0.0) == 1  # record 3 is free again: it may go to a
    assert box.lowest_index() == 1 and box.pending == 1
    out = box.take(0.0, lambda d: 5, force=True)
    assert [(d, [it[1] for it in items], low) for d, items, low in out] == [("a", [3], 1)]
    assert box.pending == 0 and box.lowest_index() is None


@pytest.mark.parametrize("seed,retain,replays,steps,every",
                         [(s, 3.0, 0.3, 400, 20) for s in range(5)] + [(7, 40.0, 0.02, 4000, 400)])
def test_the_id_ranges_answer_as_one_entry_per_record_would(seed: int, retain: float, replays: float, steps: int,
                                                            every: int) -> None:
    """The memory holds id ranges per batch (`_Spans`), split when an id is sent again; checked
    against the plain model it replaced (record id -> the batch that sent it last, forgotten with
    that batch) over random sends: new consecutive batches, a filter's sparse ones, replays of
    older ids in any order, two sources; acks upstream and expiry in between. The long run, with
    few replays as in production, keeps a hundred ranges and more per source, so that the
    forgotten front is cut off many times."""
    import random

    rng = random.Random(seed)
    mem = RouteMemory(retain=retain, grace=1.0, max_runs=10**9)
    cuts, heads = 0, {}  # the front cut off: a head of 64 or more back to a smaller one
    owner = {}  # (src, seq) -> batch number: the model
    batches = []  # [dest, bound, ids, released_at]
    held = 0  # batches before this one are acked upstream
    top = {"s": 0, "t": 0}
    now, bound = 0.0, 0
    for step in range(steps):
        src = rng.choice("sstt")
        kind = rng.random()
        if kind < (1 - replays) * 5 / 7:  # new consecutive ids
            ids = list(range(top[src], top[src] + rng.randint(1, 30)))
        elif kind < 1 - replays:  # a filter's output: sparse new ids
            ids = sorted(rng.sample(range(top[src], top[src] + 40), rng.randint(1, 10)))
        else:  # a replay: older ids again, maybe shuffled, maybe mixed with the other source
            if top[src] == 0:
                continue
            a = rng.randrange(top[src])
            ids = list(range(a, min(top[src], a + rng.randint(1, 25))))
            if rng.random() < 0.5:
                rng.shuffle(ids)
        top[src] = max(top[src], max(ids) + 1)
        items = [(src, i, None) for i in ids]
        if rng.random() < replays * 2 / 3 and top["t" if src == "s" else "s"]:
            other = "t" if src == "s" else "s"
            extra = rng.randrange(top[other])
            items.append((other, extra, None))
        bound += rng.randint(0, 1)
        dest = rng.choice(("a", "b", "c"))
        mem.sent(dest, items, bound)
        batches.append([dest, bound, items, None])
        for it in items:
            owner[(it[0], it[1])] = len(batches) - 1
        now += rng.random() * 0.5
        upto = bound - rng.randint(0, 2)
        mem.released(upto, now)
        while held < len(batches) and batches[held][1] <= upto:
            batches[held][3] = now
            held += 1
        for k, b in enumerate(batches[:held]):  # the model's expiry: RETAIN after the ack
            if b[3] is not None and now - b[3] >= retain:
                for it in b[2]:
                    if owner.get((it[0], it[1])) == k:
                        del owner[(it[0], it[1])]
                b[3] = None
                b[2] = []
        for src, sp in mem._where.items():
            cuts += heads.get(src, 0) >= 64 and sp.head < heads[src] and len(sp) > 0
            heads[src] = sp.head
        if step % every and step != steps - 1:
            continue
        for src in "st":
            for seq in range(top[src] + 2):
                k = owner.get((src, seq))
                assert mem.dest_of(src, seq) == (batches[k][0] if k is not None else None), (step, src, seq)
    assert len(mem) == sum(len(b[2]) for b in batches)
    assert retain < 10 or cuts >= 3, (cuts, "the long run must cut the forgotten front off")


def _runs_of(ids) -> list:  # type: ignore[no-untyped-def]
    """The plain model of one source's runs: its distinct ids sorted, as [gap, length, ...]."""
    out: list = []
    end = 0
    for s in sorted(set(ids)):
        if out and s == end:
            out[-1] += 1
        else:
            out += [s - end, 1]
        end = s + 1
    return out


@given(st.lists(st.tuples(st.sampled_from("stu"), st.integers(0, 60)), min_size=1, max_size=80),
       st.booleans())
@settings(max_examples=400, deadline=None)
def test_the_fast_paths_remember_the_runs_the_plain_model_says(pairs, consecutive) -> None:  # type: ignore[no-untyped-def]
    """`sent` has fast paths (one source; consecutive ascending ids; consecutive in any order or
    with duplicates: one run) and a general one (several sources, gaps): for any batch, what is
    remembered, saved and looked up must be what the plain model says. `consecutive` turns the
    drawn batch into the common shape (one source, a block of ids) shuffled or not by the draw."""
    if consecutive:
        lo = pairs[0][1]
        pairs = [("s", lo + i) for i in range(len(pairs))]
        if len(pairs) > 2 and pairs[0][1] % 3 == 0:  # some of them unordered, some with a duplicate
            pairs = pairs[1:] + pairs[:1] + ([pairs[1]] if pairs[0][1] % 2 else [])
    mem = RouteMemory()
    mem.sent("a", [(src, seq, None) for src, seq in pairs], bound=1)
    want = {}
    for src, seq in pairs:
        want.setdefault(src, []).append(seq)
    snap, _ = mem.take_save(0.0)
    assert json.loads(snap) == [["a", {src: _runs_of(ids) for src, ids in want.items()}]]
    assert len(mem) == len(pairs) and mem.runs() == sum(len(_runs_of(ids)) // 2 for ids in want.values())
    for src in "stu":
        for seq in range(-1, 130):
            assert mem.dest_of(src, seq) == ("a" if seq in want.get(src, ()) else None), (src, seq)
