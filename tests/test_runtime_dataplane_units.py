"""Sans-IO parts of the data path: envelope codec, FIFO channels, flow control, routing/batching."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.dataplane.channel import Inbound, Outbound
from agent.dataplane.envelope import Envelope, Kind, MalformedEnvelope, built, data_body_bytes, decode, encode, encode_data
from agent.dataplane.flow import AckTracker, OutLink
from agent.dataplane.routing import Outbox, Router, key_group

# ---- envelope ---------------------------------------------------------------------------------


def test_envelope_round_trips_every_kind() -> None:
    for env in (
        Envelope("a-0", 3, 7, Kind.DATA, [("src-0", 5, {"x": 1}), ("src-1", 0, [1, 2])]),
        Envelope("a-0", 0, 1, Kind.ACK, (2, 42)),
        Envelope("a-0", 0, 2, Kind.PROTO, {"type": "deletion", "sender": "a-0", "stage": 1, "round": 1}),
    ):
        assert decode(encode(env)) == env
    fast = encode_data("a-0", 1, 9, [("s", 1, {"v": 1})])
    assert decode(fast) == Envelope("a-0", 1, 9, Kind.DATA, [("s", 1, {"v": 1})])
    items = [("s", 1, {"v": 1}), ("s", 2, {"v": 2})]
    with_floors = decode(encode_data("a-0", 1, 9, items, {"s": 1}))
    assert with_floors.floors == {"s": 1} and decode(encode(with_floors)) == with_floors
    body = data_body_bytes(with_floors)  # what a sink spills: the body alone
    assert body is not None and body == data_body_bytes(decode(encode_data("a-0", 1, 9, items)))


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xff\xfe",
        b"null",
        b"{}",
        b"[1, \"a\", 0, 1, \"x\", 1]",
        b"[2, \"a\", 0, 1, \"a\", 1]",
        b"[1, \"\", 0, 1, \"a\", 1]",
        b"[1, \"a\", -1, 1, \"a\", 1]",
        b"[1, \"a\", 0, 0, \"a\", 1]",
        b"[1, \"a\", 0, 1, \"a\", -5]",
        b"[1, \"a\", 0, 1, \"a\", [1]]",
        b"[1, \"a\", 0, 1, \"a\", 5]",
        b"[1, \"a\", 0, 1, \"d\", {}]",
        b"[1, \"a\", 0, 1, \"d\", [[\"s\", -1, 1]]]",
        b"[1, \"a\", 0, 1, \"d\", [[\"s\", 1]]]",
        b"[1, \"a\", 0, 1, \"p\", [1]]",
        b"[1, \"a\", true, 1, \"a\", 1]",
        b"[1, \"a\", 0, 1, \"d\", [], {\"s\": -1}]",  # floors: integers >= 0
        b"[1, \"a\", 0, 1, \"d\", [], {\"s\": true}]",
        b"[1, \"a\", 0, 1, \"d\", [], {\"\": 1}]",
        b"[1, \"a\", 0, 1, \"d\", [], [1]]",
        b"[1, \"a\", 0, 1, \"a\", [0, 1], {\"s\": 1}]",  # only data carries floors
        b"[1, \"a\", 0, 1, \"d\", [], {" + b",".join(b'"s%d": 1' % i for i in range(65)) + b"}]",
        b"[" * 100000,
    ],
)
def test_malformed_envelopes_raise_only_malformed(raw: bytes) -> None:
    with pytest.raises(MalformedEnvelope):
        decode(raw)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=200), st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda c: st.lists(c, max_size=6) | st.dictionaries(st.text(max_size=3), c, max_size=4),
    max_leaves=20,
).map(lambda v: json.dumps(v).encode())))
def test_decode_never_raises_anything_else(raw: bytes) -> None:
    try:
        env = decode(raw)
    except MalformedEnvelope:
        return
    assert isinstance(env, Envelope) and env.seq >= 1


# ---- channels ---------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(0, 2**32 - 1), st.floats(0, 1))
def test_inbound_delivers_each_sender_in_order_exactly_once(n: int, seed: int, dup_rate: float) -> None:
    """Any arrival order with any duplicates: every seq delivered once, in sender order."""
    rng = random.Random(seed)
    arrivals = []
    for sender in ("a", "b"):
        for seq in range(1, n + 1):
            env = Envelope(sender, 0, seq, Kind.ACK, seq)
            arrivals.append(env)
            if rng.random() < dup_rate:
                arrivals.append(env)
    rng.shuffle(arrivals)
    inbound = Inbound()
    got = {"a": [], "b": []}
    for env in arrivals:
        for e in inbound.receive(env):
            got[e.sender].append(e.seq)
    assert got == {"a": list(range(1, n + 1)), "b": list(range(1, n + 1))}
    assert inbound.stats.duplicates == len(arrivals) - 2 * n


def test_inbound_epochs_and_snapshot() -> None:
    inbound = Inbound()
    assert [e.seq for e in inbound.receive(Envelope("a", 0, 1, Kind.ACK, 1))] == [1]
    # a new incarnation numbers from 1 again; the old one is stale from then on
    assert [e.seq for e in inbound.receive(Envelope("a", 1, 1, Kind.ACK, 1))] == [1]
    assert inbound.receive(Envelope("a", 0, 2, Kind.ACK, 1)) == []
    assert inbound.stats.stale_epoch == 1
    snap = json.loads(json.dumps(inbound.snapshot()))
    again = Inbound()
    again.restore(snap, resync=False)
    assert again.receive(Envelope("a", 1, 1, Kind.ACK, 1)) == []  # duplicate after restore
    assert [e.seq for e in again.receive(Envelope("a", 1, 2, Kind.ACK, 1))] == [2]
    # resync: a lagging snapshot must not wait forever for seqs the broker will not resend
    lag = Inbound()
    lag.restore({"a": [1, 1]}, resync=True)
    assert [e.seq for e in lag.receive(Envelope("a", 1, 5, Kind.ACK, 1))] == [5]
    assert [e.seq for e in lag.receive(Envelope("a", 1, 6, Kind.ACK, 1))] == [6]


def test_a_restored_inbound_takes_a_new_incarnation_of_its_sender_from_number_1_in_order() -> None:
    """Both ends restarted (a drain moves a source and its keyed successor): the sender's new
    epoch numbers from 1, and its first numbers, sent to the receiver's old node, come again
    after later ones. The restored channel's resync is for the epoch its snapshot knew: taken
    at number 3, numbers 1 and 2 were dropped as duplicates and their records, replayed later,
    were applied behind newer ones."""
    inbound = Inbound()
    inbound.restore({"a": [0, 352]}, resync=True)
    assert inbound.receive(Envelope("a", 1, 3, Kind.DATA, [("s", 3, {})])) == []  # waits for 1 and 2
    assert inbound.take_asks() == ["a"]  # and tells the sender our epoch at once: its marker comes
    assert inbound.receive(Envelope("a", 1, 4, Kind.DATA, [("s", 4, {})])) == []
    assert inbound.take_asks() == []  # once per epoch of the sender
    assert [e.seq for e in inbound.receive(Envelope("a", 1, 1, Kind.DATA, [("s", 1, {})]))] == [1]
    assert [e.seq for e in inbound.receive(Envelope("a", 1, 2, Kind.DATA, [("s", 2, {})]))] == [2, 3, 4]
    assert inbound.stats.duplicates == 0


def test_a_restored_inbound_takes_a_new_incarnation_of_its_sender_from_its_replay_marker() -> None:
    """The new epoch's first numbers never come (published before the receiver's new node
    subscribed): its replay marker starts the channel, since what came before it and was not
    taken follows it again; nothing sent before the marker is taken ahead of that replay."""
    inbound = Inbound()
    inbound.restore({"a": [0, 352]}, resync=True)
    assert inbound.receive(Envelope("a", 1, 8, Kind.DATA, [("s", 8, {})])) == []
    assert inbound.receive(Envelope("a", 1, 10, Kind.DATA, [("s", 1, {})])) == []  # the replay, ahead of its marker
    assert [e.seq for e in inbound.receive(Envelope("a", 1, 9, Kind.DATA, []))] == [9, 10]
    assert inbound.receive(Envelope("a", 1, 8, Kind.DATA, [("s", 8, {})])) == []  # before the marker: dropped
    # a successor's acks (no replay to us, no marker) resync at the first seen, as each covers
    # the earlier ones: its new epoch's number 1 (our replay request) lost holds nothing back
    acks = Inbound()
    acks.restore({"a": [0, 51]}, resync=True)
    assert [e.seq for e in acks.receive(Envelope("a", 1, 2, Kind.ACK, (1, 4)), replays_to_us=False)] == [2]
    assert acks.take_asks() == []
    # an empty batch that carries a watermark is no marker, and a channel that knew the sender's
    # epoch (no restart between) is never taken past a hole by one
    strict = Inbound()
    assert [e.seq for e in strict.receive(Envelope("a", 1, 1, Kind.DATA, [("s", 1, {})]))] == [1]
    assert strict.receive(Envelope("a", 1, 3, Kind.DATA, [])) == []
    assert strict.gaps() == {"a": [1, 2, 3]}

def test_inbound_bounded_reorder_buffer_counts_gap() -> None:
    inbound = Inbound(max_pending=3)
    for s in (3, 4, 5):
        assert inbound.receive(Envelope("a", 0, s, Kind.ACK, 1)) == []
    out = inbound.receive(Envelope("a", 0, 6, Kind.ACK, 1))
    assert [e.seq for e in out] == [3, 4, 5, 6] and inbound.gaps_skipped == 1


def test_outbound_numbers_per_destination() -> None:
    out = Outbound(epoch=2)
    assert [out.take("x"), out.take("x"), out.take("y"), out.take("x")] == [1, 2, 1, 3]
    o2 = Outbound()
    o2.restore(out.snapshot())
    assert o2.take("x") == 4 and o2.epoch == 2


# ---- flow control -----------------------------------------------------------------------------


def test_outlink_credit_and_cumulative_ack() -> None:
    link = OutLink("s", window=3)
    for seq in (1, 2, 3):
        link.sent(seq, b"p", 10, 0.0)
    assert link.credit == 0
    with pytest.raises(RuntimeError):
        link.sent(4, b"p", 10, 0.0)
    assert link.ack(2) == 2 and link.credit == 2
    assert [u.seq for u in link.unacked()] == [3]
    assert link.ack(1) == 0  # old ack: no effect
    # acks are numbered with everything else, so seqs may have gaps (acks/proto in between)
    link.sent(7, b"p", 1, 0.0)
    assert link.ack(6) == 1 and [u.seq for u in link.unacked()] == [7]


def test_outlink_resent_keeps_number_order_and_payload_and_restarts_the_age() -> None:
    """A silent link's resend keeps each batch's number (the receiver's channel drops a copy it
    has): `resent` changes only the send time, so the batch is not resent again at once."""
    link = OutLink("s", window=3)
    for seq in (1, 2, 3):
        link.sent(seq, b"p%d" % seq, records=seq, now=1.0, low=10 + seq)
    link.resent(2, now=9.0)
    assert [(u.seq, u.payload, u.records, u.low) for u in link.unacked()] == [
        (1, b"p1", 1, 11), (2, b"p2", 2, 12), (3, b"p3", 3, 13)]
    assert [u.sent_at for u in link.unacked()] == [1.0, 9.0, 1.0]
    assert link.credit == 0 and link.highest_sent == 3
    assert link.ack(2) == 2 and [u.seq for u in link.unacked()] == [3]
    with pytest.raises(KeyError):
        link.resent(1, now=10.0)  # acked: nothing to resend


def test_ack_tracker_releases_only_fully_forwarded_inputs() -> None:
    t = AckTracker()
    i1 = t.processed("p", 1)
    i2 = t.processed("p", 2)
    i3 = t.processed("q", 1)
    assert t.release(i1) == {}  # output of batch 1 still pending
    assert t.release(i2) == {"p": (0, 1)}
    assert t.release(None) == {"p": (0, 2), "q": (0, 1)}
    assert t.waiting() == 0 and i3 == 3
    # a sender restarted (epoch 1, numbering from 1 again): only its new incarnation is acked
    t.processed("p", 40, epoch=0)
    t.processed("p", 1, epoch=1)
    assert t.release(None) == {"p": (1, 1)}


# ---- routing and batching --------------------------------------------------------------------


def items(n: int, start: int = 0):
    return [("src", start + i, {"k": (start + i) % 7}) for i in range(n)]


def test_outbox_round_robin_batches_respect_size_and_linger() -> None:
    ob = Outbox(Router(["b", "a"]), batch_size=4, linger=0.02)
    ob.add(items(10), 1, now=0.0)
    credit = {"a": 5, "b": 5}
    out = ob.take(0.0, credit.__getitem__)
    assert [(d, len(it)) for d, it, _ in out] == [("a", 4), ("b", 4)]
    assert ob.pending == 2 and ob.take(0.01, credit.__getitem__) == []  # lingering
    out = ob.take(0.03, credit.__getitem__)
    assert [(d, len(it)) for d, it, _ in out] == [("a", 2)]


def test_outbox_no_credit_holds_records_and_skips_slow_successor() -> None:
    ob = Outbox(Router(["a", "b"]), batch_size=2, linger=0.0)
    ob.add(items(8), 1, 0.0)
    out = ob.take(0.0, {"a": 0, "b": 2}.__getitem__)
    assert [d for d, _, _ in out] == ["b", "b"] and ob.pending == 4
    assert ob.take(0.0, {"a": 0, "b": 0}.__getitem__) == [] and ob.pending == 4
    assert ob.lowest_index() == 1


def test_keyed_routing_is_consistent_and_reroutes_on_removal() -> None:
    r1, r2 = Router(["x", "y", "z"], key="k"), Router(["z", "y", "x"], key="k")
    for k in range(50):
        assert r1.by_key({"k": k}) == r2.by_key({"k": k})  # every predecessor agrees
    assert key_group("abc") == key_group("abc")
    ob = Outbox(r1, batch_size=100, linger=1.0)
    ob.add(items(30), 1, 0.0)
    ob.add(items(30, 30), 2, 0.0)
    r1.remove("y")
    ob.reroute(0.0)
    out = ob.take(0.0, lambda d: 10, force=True)
    dests = {d for d, _, _ in out}
    assert "y" not in dests and sum(len(it) for _, it, _ in out) == 60
    seen = [it[1] for _, its, _ in out for it in its if it[2]["k"] == 3]
    assert seen == sorted(seen)  # per-key order kept through the re-route


def test_compact_data_encoding_round_trips_and_falls_back() -> None:
    from agent.operators.taxi import sample

    recs = sample(1, 50)
    batch = [("src-0", i, r) for i, r in enumerate(recs)]
    raw = encode_data("a", 0, 1, batch)
    assert b'"k":' in raw  # keys written once
    assert decode(raw).body == batch
    mixed = batch[:3] + [("src-0", 99, {"other": 1})]
    assert decode(encode_data("a", 0, 2, mixed)).body == mixed  # not one schema: plain list
    odd = [("s", 1, [1, 2]), ("s", 2, "x")]
    assert decode(encode_data("a", 0, 3, odd)).body == odd
    for bad in (b'[1,"a",0,1,"d",{"k":["x"],"r":[["s",1,[1,2]]]}]', b'[1,"a",0,1,"d",{"k":[1],"r":[]}]',
                b'[1,"a",0,1,"d",{"k":["x"],"r":[["s",-1,[1]]]}]', b'[1,"a",0,1,"d",{"k":["x"]}]'):
        with pytest.raises(MalformedEnvelope):
            decode(bad)


def test_decode_without_records_keeps_ids_and_validation() -> None:
    """A sink that reads only ids skips rebuilding the records, never the validation."""
    from agent.operators.taxi import sample

    batch = [("src-0", i, r) for i, r in enumerate(sample(2, 20))]
    raw = encode_data("a", 0, 1, batch)
    lean = decode(raw, records=False)
    assert [(s, q) for s, q, _ in lean.body] == [(s, q) for s, q, _ in batch]
    assert all(r is None for _, _, r in lean.body)
    assert lean.raw == raw  # a spilling sink still gets the bytes as received
    for bad in (b'[1,"a",0,1,"d",{"k":["x"],"r":[["s",1,[1,2]]]}]', b'[1,"a",0,1,"d",{"k":["x"],"r":[["s",-1,[1]]]}]',
                b'[1,"a",0,1,"d",{"k":["x"],"r":[["s",1]]}]', b'[1,"a",0,1,"d",{"k":["x"],"r":[[1,1,[1]]]}]'):
        with pytest.raises(MalformedEnvelope):
            decode(bad, records=False)


def test_lazy_decode_keeps_ids_and_validation_and_writes_its_rows_back_without_dicts() -> None:
    """A map that never reads its records (`identity`) takes a compact body as Rows: the same
    ids, the same refusals, each record rebuilt on demand equal to the dict; encoded again
    (a batch split or joined after it was passed on), Rows give the bytes the dicts give."""
    from agent.dataplane.envelope import LAZY, Row, materialized
    from agent.operators.taxi import sample

    batch = [("src-0", i, r) for i, r in enumerate(sample(3, 20))]
    raw = encode_data("a", 0, 1, batch)
    lazy = decode(raw, LAZY)
    assert [(s, q) for s, q, _ in lazy.body] == [(s, q) for s, q, _ in batch]
    assert all(type(r) is Row for _, _, r in lazy.body) and lazy.raw == raw
    assert materialized(lazy.body) == batch and [r.record() for _, _, r in lazy.body] == [r for _, _, r in batch]
    for a, b in ((0, 7), (7, 20), (0, 1)):  # split
        assert encode_data("m", 0, 2, lazy.body[a:b]) == encode_data("m", 0, 2, batch[a:b])
    joined = decode(raw, LAZY).body[:5] + lazy.body[5:]  # two batches' Rows (equal keys, not one tuple)
    assert decode(encode_data("m", 0, 3, joined)).body == batch
    mixed = lazy.body[:3] + [("src-1", 1, {"other": 1})] + lazy.body[3:4]  # Rows and dicts: plain list
    assert decode(encode_data("m", 0, 4, mixed)).body == batch[:3] + [("src-1", 1, {"other": 1})] + batch[3:4]
    other = encode_data("b", 0, 1, [("src-2", i, {"x": i, "y": -i}) for i in range(2)])
    two = lazy.body[:2] + decode(other, LAZY).body  # two schemas: each Row rebuilt
    assert decode(encode_data("m", 0, 5, two)).body == batch[:2] + [("src-2", i, {"x": i, "y": -i}) for i in range(2)]
    plain = encode_data("a", 0, 1, [("s", 1, [1, 2]), ("s", 2, "x")])  # not compact: as records=True
    assert decode(plain, LAZY).body == decode(plain).body
    for bad in (b'[1,"a",0,1,"d",{"k":["x"],"r":[["s",1,[1,2]]]}]', b'[1,"a",0,1,"d",{"k":["x"],"r":[["s",-1,[1]]]}]',
                b'[1,"a",0,1,"d",{"k":["x"],"r":[["s",1]]}]', b'[1,"a",0,1,"d",{"k":["x"],"r":[[1,1,[1]]]}]',
                b'[1,"a",0,1,"d",{"k":[1],"r":[]}]'):
        with pytest.raises(MalformedEnvelope):
            decode(bad, LAZY)


def _outcome(parse, raw: bytes):
    """What a parser makes of `raw`: its value, or the type of its refusal."""
    try:
        return "ok", repr(parse(raw))
    except (ValueError, RecursionError) as exc:
        return "error", type(exc).__name__


def _stdlib_parse(raw: bytes):
    import agent.dataplane.envelope as env

    saved, env._orjson = env._orjson, None
    try:
        return env._parse(raw)
    finally:
        env._orjson = saved


@pytest.mark.parametrize("raw", [
    b'[1,"a",0,1,"d",{"k":["x"],"r":[["s",1,[1.5e-07]]]}]', b'[NaN, Infinity, -Infinity]', b'[1e400]',
    b'[123456789012345678901234567890]', b'[9223372036854775807]', b'["\\ud800"]', b'["\\ud83d\\ude00"]',
    b'"\xed\xa0\x80"', b'\xef\xbb\xbf[1]', b'[1,]', b'{"a":1,"a":2}', b'[-0.0, 0, 1E5]', b'["a\\u0000b"]',
    b'[' * 450 + b']' * 450, b'[' * 850 + b']' * 850, b'[' * 1100 + b']' * 1100, b'[' + b'[1],' * 600 + b'1]',
    # 19+ digits in a row: in a number (any place its digits can be) or in a string
    b'123456789012345678901234', b' 123456789012345678901234 ', b'[-123456789012345678901234]',
    b'{"a":123456789012345678901234}', b'[1,\t123456789012345678901234\n]', b'[1.1234567890123456789012345]',
    b'[1e1234567890123456789012345]', b'[1E+1234567890123456789012345]', b'[1e-0000000000000000000001]',
    b'[123456789012345678901234.5]', b'[123456789012345678901234e1]', b'{"a":[18446744073709551616]}',
    b'["B2ED69FD2553690263419906438F1BDA", 18446744073709551616]', b'["1234567890123456789012"]',
    b'["x1234567890123456789012y"]', b'["a,1234567890123456789012]"]', b'["e1234567890123456789012e"]',
    b'["1234567890123456789012", 1]', b'[1234567890123456789012"]', b'["a"1234567890123456789012]',
    b'[0123456789012345678901234]', b'[1234567890123456789012345678901234567890123456789012345678901234567890]',
])
def test_fast_codec_parses_exactly_like_the_stdlib(raw: bytes) -> None:
    """With orjson installed, `_parse` takes its fast path only where the result (or the
    refusal) is the stdlib path's: same value, same exception type."""
    pytest.importorskip("orjson")
    from agent.dataplane.envelope import _parse

    assert _outcome(_parse, raw) == _outcome(_stdlib_parse, raw)


def test_fast_codec_takes_long_digit_runs_in_strings_and_never_in_numbers() -> None:
    """A run of 19+ digits sends a parse to the stdlib only where it can be a number: hex ids
    of taxi records hold such runs (one batch in four did before, O25), integers past 64 bits
    are still parsed exactly."""
    pytest.importorskip("orjson")
    import agent.dataplane.envelope as env
    from agent.operators.taxi import TaxiGenerator

    gen = TaxiGenerator(1, "source-0")
    batches = [encode_data("source-0", 0, b + 1, [("source-0", 100 * b + k, gen.record()) for k in range(100)])
               for b in range(40)]
    assert any(raw.translate(env._DIGITS_AND_OPENERS).find(env._LONG_RUN) >= 0 for raw in batches)  # the case exists
    assert not any(env._long_number(raw) for raw in batches)
    assert all(env._fast_parse(raw) is not env._NO and env._parse(raw) == _stdlib_parse(raw) for raw in batches)
    big = 2 ** 64 + 1
    for raw in (json.dumps([big]).encode(), json.dumps({"a": -big}).encode(), json.dumps(["9" * 30, big]).encode()):
        assert env._long_number(raw) and env._fast_parse(raw) is env._NO and repr(env._parse(raw)) == repr(json.loads(raw))
    # a run ends at an opening bracket too (the scan maps those to "["): no number ends so
    assert env._long_number(b"[1234567890123456789012]") and not env._long_number(b"[1234567890123456789012[")


def test_fast_codec_counts_both_kinds_of_bracket_for_its_depth_guard() -> None:
    """The digit scan also counts the brackets that open a level (one pass over the input): a
    value nested past the fast path's depth in objects alone, in lists alone or in both goes to
    the stdlib path, which judges it as it always did; a wide but shallow one stays fast."""
    pytest.importorskip("orjson")
    import agent.dataplane.envelope as env

    d = env._FAST_DEPTH
    for raw in (b'{"a":' * d + b"1" + b"}" * d, b"[" * d + b"]" * d, b'[{"a":' * (d // 2) + b"1" + b"}]" * (d // 2)):
        assert env._fast_parse(raw) is env._NO
        assert _outcome(env._parse, raw) == _outcome(_stdlib_parse, raw)
    wide = b"[" + b",".join([b'{"a":[1]}'] * d) + b"]"
    assert env._fast_parse(wide) == json.loads(wide)


class _Written(str):
    """A number as written in the JSON text (not a string)."""


_BORDER = "0123456789ABCDEFe.,:[]{}-+ \"\\"
_DIGIT_RUNS = st.one_of(st.text(alphabet=_BORDER, max_size=40),
                        st.from_regex(r"\A[0-9A-Fe.,:\[\]{}+\- \"]{0,4}[0-9]{19,25}[0-9A-Fe.,:\[\]{}+\- \"]{0,4}\Z"))
_LONG_NUMBERS = st.one_of(st.integers(-10 ** 40, 10 ** 40), st.floats(allow_nan=False, allow_infinity=False),
                          st.from_regex(r"\A-?[1-9][0-9]{15,30}(\.[0-9]{1,30})?([eE][-+]?[0-9]{1,25})?\Z").map(_Written))


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.recursive(st.one_of(_DIGIT_RUNS, _LONG_NUMBERS, st.booleans()),
                    lambda inner: st.one_of(st.lists(inner, max_size=5),
                                            st.dictionaries(_DIGIT_RUNS, inner, max_size=4)), max_leaves=20),
       st.sampled_from(["", " ", "\n", "\t "]), st.integers(0, 10 ** 6))
def test_fast_codec_parses_digit_runs_in_numbers_and_strings_like_the_stdlib(value, ws: str, cut: int) -> None:
    """Long digit runs anywhere (numbers of 16-31 digits written out, integers past 64 bits,
    runs of 19-25 digits in strings beside every character that can border a number), spaced or
    not, whole or cut short: `_parse` gives the stdlib path's value or its refusal."""
    pytest.importorskip("orjson")
    from agent.dataplane.envelope import _parse

    def text(v):
        if isinstance(v, _Written):
            return str(v)
        if isinstance(v, list):
            return "[" + ws + ("," + ws).join(text(x) for x in v) + ws + "]"
        if isinstance(v, dict):
            return "{" + ",".join(json.dumps(k) + ws + ":" + ws + text(x) for k, x in v.items()) + "}"
        return json.dumps(v)

    raw = text(value).encode()
    raw = raw[:cut % (len(raw) + 1)] if cut % 7 == 0 else raw

    assert _outcome(_parse, raw) == _outcome(_stdlib_parse, raw)


@pytest.mark.parametrize("value", [
    [1, "a", 0, 1, "d", {"k": ["x", "y"], "r": [["s", 1, [1.5e-07, "é"]]]}], [float("nan"), float("inf")],
    [2 ** 70], [{1: 2}], [None, True], [[[[1]]]], {"t": (1, 2)},
])
def test_fast_codec_writes_what_the_stdlib_means(value) -> None:
    """`_fast_dumps` bytes decode (stdlib) to exactly what the stdlib's own bytes decode to:
    NaN stays NaN (orjson would write null), >64-bit integers stay exact."""
    pytest.importorskip("orjson")
    from agent.dataplane.envelope import _dumps, _fast_dumps

    assert repr(json.loads(_fast_dumps(value))) == repr(json.loads(_dumps(value)))


def test_fast_codec_keeps_taxi_batches_byte_identical() -> None:
    pytest.importorskip("orjson")
    import agent.dataplane.envelope as env
    from agent.operators.taxi import sample

    batch = [("src-0", i, r) for i, r in enumerate(sample(4, 100))]
    fast = encode_data("a", 0, 1, batch)
    saved, env._orjson = env._orjson, None
    try:
        slow = encode_data("a", 0, 1, batch)
    finally:
        env._orjson = saved
    assert fast == slow  # the sink spools these bytes verbatim: same with or without orjson
    assert decode(fast).body == batch


def test_outbox_chunks_split_across_batches_keep_order_and_lowest_index() -> None:
    """Keyless records are buffered as one chunk per input (no per-record tuple): batches cut
    across chunks must keep the order and carry the lowest input index they contain."""
    ob = Outbox(Router(["a"]), batch_size=40, linger=0.01)
    chunks = {1: [("s", i, i) for i in range(30)], 2: [("s", i, i) for i in range(30, 80)],
              3: [("s", i, i) for i in range(80, 125)]}
    for index, items in chunks.items():
        ob.add(items, index, 0.0)
    assert ob.pending == 125 and ob.lowest_index() == 1
    out = ob.take(0.0, lambda d: 10)
    assert [(len(b), low) for _, b, low in out] == [(40, 1), (40, 2), (40, 3)]
    assert ob.pending == 5 and ob.lowest_index() == 3
    out += ob.take(0.02, lambda d: 10)  # the rest after the linger
    assert [it[1] for _, b, _ in out for it in b] == list(range(125))
    assert out[-1][2] == 3 and ob.pending == 0 and ob.lowest_index() is None
    assert [it[1] for it in chunks[3]] == list(range(80, 125))  # inputs left as they were


def test_an_envelope_built_for_a_hand_off_is_the_one_the_constructor_gives() -> None:
    """`built` (a chain's in-memory envelopes, no checks) gives an object equal to `Envelope(...)`
    in every field, frozen all the same, and one without bytes (`data_body_bytes` None)."""
    import dataclasses

    body = [("src-0", 1, {"v": 1})]
    for kind, b, floors in ((Kind.DATA, body, {"src-0": 1}), (Kind.DATA, body, None), (Kind.ACK, [0, 3], None)):
        a, e = built("op-0", 2, 7, kind, b, floors), Envelope("op-0", 2, 7, kind, b, floors=floors)
        assert a == e and repr(a) == repr(e) and dataclasses.asdict(a) == dataclasses.asdict(e)
        assert a.raw is None and data_body_bytes(a) is None and encode(a) == encode(e)
        with pytest.raises(dataclasses.FrozenInstanceError):
            a.seq = 8  # type: ignore[misc]
