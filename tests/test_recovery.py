"""Round recovery helpers (agent.instance.recovery), pure: the write-ahead codec, replayed rounds,
resend on silence. The live path (a creator killed mid-round) is in test_reliability."""

from __future__ import annotations

from typing import Optional

import pytest
from memory_wire import MemoryWire

from agent.policy.decentralized import ScalingParams
from agent.protocol.messages import Deletion, DeletionAck, Duplication, DuplicationAck, Start, from_dict
from agent.protocol.scaling import Activate, CreateInstance, Drain, RoutesChanged, ScalingCore, Send, Terminate
from agent.instance.recovery import RoundMemory, decode_outputs, encode_outputs, round_message, silent_pending


def test_queued_outputs_survive_the_disk_in_order() -> None:
    outs = [
        CreateInstance("op-1", "op", 1, "op-0"),
        Send("b-0", Duplication("op-0", 1, 3, ("op-1",))),
        RoutesChanged(("c-0",), ("a-0",)),
        Activate(("c-0", "c-1"), ()),
        Send("op-1", Start("op-0", 1, ("c-0",), ("a-0",))),
        Drain(),
        Terminate("op-0"),
    ]
    import json

    back = decode_outputs(json.loads(json.dumps(encode_outputs(outs))), from_dict)
    assert back == outs


@pytest.mark.parametrize("bad", [{}, [{"effect": "Explode"}], [3], [{"send": "x", "message": {"type": "nope"}}]])
def test_a_damaged_queue_is_an_error_not_a_guess(bad: object) -> None:
    with pytest.raises(Exception):
        decode_outputs(bad, from_dict)


def test_a_replayed_round_is_acked_again_but_applied_once() -> None:
    mem = RoundMemory()
    dup = Duplication("x-0", 1, 4, ("x-9",))
    assert mem.replay_ack(dup, "y-0", 2) is None  # new: apply it
    mem.applied_now(dup)
    again = mem.replay_ack(dup, "y-0", 2)
    assert again == DuplicationAck("y-0", 2, 4)
    older = mem.replay_ack(Deletion("x-0", 1, 3), "y-0", 2)
    assert older == DeletionAck("y-0", 2, 3)
    assert mem.replay_ack(Deletion("x-0", 1, 5), "y-0", 2) is None  # a later round is new
    assert mem.replay_ack(Deletion("z-0", 1, 1), "y-0", 2) is None  # another sender
    assert mem.replays == 2
    assert RoundMemory(dict(mem.applied)).replay_ack(dup, "y-0", 2) is not None  # restored from disk


def test_resend_goes_only_to_silent_pending_neighbours_that_were_sent_the_round() -> None:
    core = ScalingCore.initial("m-0", "m", 1, ScalingParams(), succs=("s-0", "s-1"), preds=("p-0",), keeper=True)
    outs = core.start_duplication(1)
    new = [o.instance_id for o in outs if isinstance(o, CreateInstance)]
    msg = round_message(core)
    assert isinstance(msg, Duplication) and msg.new_instances == tuple(new) and msg.round == core.round
    heard = {"s-0": 0.0, "s-1": 8.0}  # p-0 not sent yet (still queued): never resent
    assert silent_pending(core, heard, now=10.0, after=10.0) == [("s-0", msg)]
    assert silent_pending(core, heard, now=18.0, after=10.0) == [("s-0", msg), ("s-1", msg)]
    idle = ScalingCore.initial("q-0", "m", 1, ScalingParams(), succs=("s-0",), preds=("p-0",), keeper=True)
    assert round_message(idle) is None and silent_pending(idle, {"s-0": 0.0}, 100.0) == []




def test_a_source_resumes_at_its_oldest_unacked_poll_not_its_newest(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The position a source writes for its restart (`resume_from`) must lie at or below every
    record a successor has not acked yet. Each poll of the source is one input index; a source
    has no input, so the indices are its own. Regression: every poll got the same index, so the
    position was the first record of the NEWEST poll and a restart skipped the older unacked
    polls (the records lost when an agent restart stopped the source and its successors at once:
    the broker had them only for the old incarnations, and the source never generated them again)."""
    import os

    from agent import topics
    from foglab.tools.dataplane_bench import initial_specs, pipeline_toml
    from agent.dataplane.envelope import Envelope, Kind, encode
    from agent.mqtt.settings import BrokerSpec
    from agent.mqtt.transport import Received
    from agent.instance.shell import Worker

    toml = pipeline_toml("p", [
        {"name": "source", "kind": "source", "function": "agent.operators.taxi:mqtt_source",
         "params": {"topic": "sensors/#"}, "batch_size": 4, "linger_ms": 0},
        {"name": "sink", "kind": "sink", "function": "agent.operators.builtin:counting_sink"},
    ], scaling={"policy": "none"})
    spec = initial_specs(toml, BrokerSpec("127.0.0.1", 1), str(tmp_path / "state"), cluster="c",
                         extra={"sink_dir": str(tmp_path / "sink")})[0]
    clock = [100.0]
    wire = MemoryWire()
    # wall 0: the source numbers from the wall clock in microseconds, here from 0
    w = Worker(spec, out=open(os.devnull, "w"), clock=lambda: clock[0], transport=wire,  # noqa: SIM115
               wall=lambda: 0.0)
    w.start()

    def poll(n: int) -> None:
        for i in range(n):
            w.core.operator.ingest("sensors/x", b'{"v": %d}' % i)
        clock[0] += 0.1
        w.step(clock[0])
        w.step(clock[0])

    def data_batches() -> list:
        return [p for t, p in wire.sent if t == topics.inbox("c", "sink-0", "local") and b'"d"' in p[:60]]

    poll(4)
    poll(4)
    poll(4)
    assert len(data_batches()) == 3 and w.core.operator.generated == 12
    assert w.core.source_resume_seq() == 0  # nothing acked: everything must be generated again

    def ack(upto: int, seq: int) -> None:
        wire.events.append(Received(topics.inbox("c", "source-0", "local"),
                                    encode(Envelope("sink-0", 0, seq, Kind.ACK, [w.core.epoch, upto]))))
        w.step(clock[0])

    ack(1, 1)
    assert w.core.source_resume_seq() == 4  # the first poll is acked end to end, the second is not
    ack(3, 2)
    assert w.core.source_resume_seq() == 12  # all acked: resume after the last generated record


def _chain(tmp_path, clock: list, wire: "MemoryWire", operator: str, policy: str = "none",  # type: ignore[no-untyped-def]
           restart: bool = False):
    """One worker of source -> work -> sink, on the in-memory wire, its clock in `clock[0]`."""
    import dataclasses
    import os

    from foglab.tools.dataplane_bench import initial_specs, pipeline_toml
    from agent.mqtt.settings import BrokerSpec
    from agent.instance.shell import Worker

    toml = pipeline_toml("p", [
        {"name": "source", "kind": "source", "function": "agent.operators.taxi:mqtt_source",
         "params": {"topic": "sensors/#"}, "batch_size": 4, "linger_ms": 0},
        {"name": "work", "function": "agent.operators.builtin:validate", "batch_size": 4, "linger_ms": 0},
        {"name": "sink", "kind": "sink", "function": "agent.operators.builtin:counting_sink"},
    ], scaling={"policy": policy})
    spec = [s for s in initial_specs(toml, BrokerSpec("127.0.0.1", 1), str(tmp_path / "state"), cluster="c",
                                     extra={"sink_dir": str(tmp_path / "sink")}) if s.operator == operator][0]
    spec = dataclasses.replace(spec, restart=restart)
    # wall 0: a source numbers from the wall clock in microseconds, here from 0
    w = Worker(spec, out=open(os.devnull, "w"), clock=lambda: clock[0], transport=wire,  # noqa: SIM115
               wall=lambda: 0.0)
    w.start()
    return w


def test_a_hole_in_a_senders_numbering_that_stays_open_makes_us_a_new_incarnation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Batch 2 of the source never arrives (the broker lost it, or a fenced copy with our client
    id took it); batch 3 waits behind the hole. A few seconds of reordering are normal; after
    GAP_TIMEOUT the worker takes a new epoch and acks nothing in it to its predecessor, which is
    how a predecessor learns to replay everything unacked, batch 2 included."""
    from agent import topics
    from agent.dataplane.envelope import decode, encode_data
    from agent.operators.taxi import sample
    from agent.mqtt.transport import Received
    from agent.instance.core import GAP_TIMEOUT, SILENCE_CHECK

    clock, wire = [100.0], MemoryWire()
    w = _chain(tmp_path, clock, wire, "work")
    inbox = topics.inbox("c", "work-0", "local")
    recs = sample(1, 12)

    def batch(seq: int) -> Received:
        items = [("source-0", 4 * (seq - 1) + i, recs[4 * (seq - 1) + i]) for i in range(4)]
        return Received(inbox, encode_data("source-0", 0, seq, items))

    def run(seconds: float) -> None:
        end = clock[0] + seconds
        while clock[0] < end:
            clock[0] += 0.25
            w.step(clock[0])

    wire.events += [batch(1), batch(3)]
    run(GAP_TIMEOUT - 2 * SILENCE_CHECK)
    assert w.core.epoch == 0 and w.core.stats.get("gaps_recovered", 0) == 0  # reordering may still close it
    sent_before = len(wire.sent)
    run(3 * SILENCE_CHECK)
    assert w.core.epoch == 1 and w.core.stats["gaps_recovered"] == 1
    to_source = [decode(p) for t, p in wire.sent[sent_before:] if t == topics.inbox("c", "source-0", "local")]
    assert any(e.epoch == 1 and list(e.body) == [0, 0] for e in to_source), to_source  # "replay to me"
    run(3 * GAP_TIMEOUT)
    assert w.core.stats["gaps_recovered"] == 1  # the hole was forgotten with the old channel positions


def _source_sent_two_batches(tmp_path, clock: list, wire: "MemoryWire"):  # type: ignore[no-untyped-def]
    """The source of `_chain` after it sent its first 8 records to work-0 as batches 1 and 2:
    (the worker, work-0's inbox, the two data envelopes)."""
    from agent import topics
    from agent.dataplane.envelope import Kind, decode

    w = _chain(tmp_path, clock, wire, "source")
    for i in range(8):
        w.core.operator.ingest("sensors/x", b'{"v": %d}' % i)
    clock[0] += 0.1
    w.step(clock[0])
    w.step(clock[0])
    to_work = topics.inbox("c", "work-0", "local")
    first = [decode(p) for t, p in wire.sent if t == to_work and decode(p).kind is Kind.DATA]
    assert [e.seq for e in first] == [1, 2]
    return w, to_work, first


def test_batches_a_successor_never_acks_are_replayed_to_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The last batches sent to a successor went missing (nothing comes after them, so it sees
    no hole): after LINK_SILENCE without an ack they are sent again under their own numbers
    (same epoch, same seq); acked ones never. A successor that had them (slow, not lost) drops
    them as duplicates in its channel instead of processing them twice (a second copy of a
    record could reach another sink instance, which cannot drop it); one that lost them gets
    them."""
    from agent import topics
    from agent.dataplane.envelope import Envelope, Kind, decode, encode
    from agent.mqtt.transport import Received
    from agent.dataplane.channel import Inbound
    from agent.instance.outputs import LINK_SILENCE

    clock, wire = [100.0], MemoryWire()
    w, to_work, first = _source_sent_two_batches(tmp_path, clock, wire)
    wire.events.append(Received(topics.inbox("c", "source-0", "local"),
                                encode(Envelope("work-0", 0, 1, Kind.ACK, [w.core.epoch, 1]))))  # batch 1 only
    sent = len(wire.sent)
    end = clock[0] + LINK_SILENCE + 2
    while clock[0] < end:
        clock[0] += 0.5
        w.step(clock[0])
    again = [decode(p) for t, p in wire.sent[sent:] if t == to_work and decode(p).kind.value == "d"]
    assert len(again) == 1 and again[0].body == first[1].body, again
    assert (again[0].epoch, again[0].seq) == (first[1].epoch, first[1].seq) == (w.core.epoch, 2), again
    slow, lost = Inbound(), Inbound()  # the successor's channel from us: it has batch 2, or lost it
    for e in first:
        slow.receive(e)
    lost.receive(first[0])
    assert slow.receive(again[0]) == [] and slow.stats.duplicates == 1  # not processed twice
    assert [e.seq for e in lost.receive(again[0])] == [2]
    # still no ack (a dead successor): the next replay waits twice as long, not another LINK_SILENCE
    sent = len(wire.sent)
    end = clock[0] + 1.5 * LINK_SILENCE
    while clock[0] < end:
        clock[0] += 0.5
        w.step(clock[0])
    assert not [p for t, p in wire.sent[sent:] if t == to_work], "replayed again after only 1.5 x LINK_SILENCE"
    end = clock[0] + LINK_SILENCE
    while clock[0] < end:
        clock[0] += 0.5
        w.step(clock[0])
    assert len([p for t, p in wire.sent[sent:] if t == to_work]) == 1


def _run(worker, clock: list, seconds: float) -> None:  # type: ignore[no-untyped-def]
    """Step `worker` every 0.25 s of its clock `clock[0]` for `seconds`."""
    end = clock[0] + seconds
    while clock[0] < end:
        clock[0] += 0.25
        worker.step(clock[0])


def test_a_predecessor_sends_a_replay_marker_before_its_replay_to_a_restarted_successor(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A successor in a new epoch (restarted) gets an empty data batch first, then every batch it
    had not acked, renumbered after it: the marker tells it where the replay starts."""
    from agent import topics
    from agent.dataplane.envelope import Envelope, Kind, decode, encode
    from agent.mqtt.transport import Received

    clock, wire = [100.0], MemoryWire()
    w, to_work, first = _source_sent_two_batches(tmp_path, clock, wire)
    assert first[0].floors == {"source-0": 0}  # nothing acked yet: the source claims nothing
    sent = len(wire.sent)
    wire.events.append(Received(topics.inbox("c", "source-0", "local"),
                                encode(Envelope("work-0", 1, 1, Kind.ACK, [0, 0]))))  # work-0, restarted
    clock[0] += 0.1
    w.step(clock[0])
    after = [decode(p) for t, p in wire.sent[sent:] if t == to_work]
    assert [(e.seq, len(e.body)) for e in after] == [(3, 0), (4, 4), (5, 4)], after  # marker, then the replay
    assert [e.body for e in after[1:]] == [e.body for e in first]


def test_a_source_claims_its_acked_numbers_and_a_stateless_instance_passes_the_claims_on(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The floors of agent.instance.applied: the source's batches carry the first number it has not
    seen acked end to end (8 once work-0 acked batches 1-2 = records 0-7, taken in one poll: a poll
    counts once all of it is acked); an instance after it puts the
    largest claim it received for a source on every batch with records of that source."""
    from agent import topics
    from agent.dataplane.envelope import Envelope, Kind, decode, encode, encode_data
    from agent.mqtt.transport import Received
    from agent.operators.taxi import sample

    clock, wire = [100.0], MemoryWire()
    src, to_work, first = _source_sent_two_batches(tmp_path / "a", clock, wire)
    wire.events.append(Received(topics.inbox("c", "source-0", "local"),
                                encode(Envelope("work-0", 0, 1, Kind.ACK, [src.core.epoch, 2]))))
    for i in range(8, 12):
        src.core.operator.ingest("sensors/x", b'{"v": %d}' % i)
    _run(src, clock, 0.5)
    later = [decode(p) for t, p in wire.sent if t == to_work and decode(p).kind is Kind.DATA][2:]
    assert later and later[0].floors == {"source-0": 8}, later

    wire2 = MemoryWire()
    work = _chain(tmp_path / "b", clock, wire2, "work")
    recs = sample(1, 8)
    inbox = topics.inbox("c", "work-0", "local")
    wire2.events += [Received(inbox, encode_data("source-0", 0, 1, [("source-0", i, recs[i]) for i in range(4)],
                                                 {"source-0": 2})),
                     Received(inbox, encode_data("source-0", 0, 2, [("source-0", i, recs[i]) for i in range(4, 8)],
                                                 {"source-0": 1}))]  # an older claim, later: still true
    _run(work, clock, 0.5)
    out = [decode(p) for t, p in wire2.sent if t == topics.inbox("c", "sink-0", "local")]
    assert out and all(e.floors == {"source-0": 2} for e in out if e.kind is Kind.DATA), out


def test_a_restarted_instance_takes_a_predecessors_records_in_order_after_its_replay_marker(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """kill -9 of `work` after it processed batches 1-2 of the source (what it forwarded may be
    lost with it), with batches 3-4 still queued for it. Its new incarnation asks for a replay;
    the source sends a marker and batches 1-4 again. Processing the queued 3-4 first would send
    records 8-15 ahead of the replayed 0-7, and a keyed operator after it would close its
    windows without them (CHANGELOG.md, "A keyed operator skipped replayed records that came
    after newer ones"). So what comes
    from the source before its marker is dropped: the records leave in the source's order."""
    import os

    from agent import topics
    from agent.dataplane.envelope import Kind, decode, encode_data
    from agent.mqtt.transport import Received
    from agent.operators.taxi import sample

    clock, wire = [100.0], MemoryWire()
    inbox = topics.inbox("c", "work-0", "local")
    recs = sample(1, 16)

    def batch(seq: int, first: int) -> Received:  # records first .. first+3 of the source
        return Received(inbox, encode_data("source-0", 0, seq, [("source-0", first + i, recs[first + i])
                                                                 for i in range(4)]))

    def run(worker, seconds: float) -> None:  # type: ignore[no-untyped-def]
        _run(worker, clock, seconds)

    w = _chain(tmp_path, clock, wire, "work")
    wire.events += [batch(1, 0), batch(2, 4)]
    run(w, 2.0)  # processed and forwarded; the channel position is on disk
    os.close(w._identity_lock)  # kill -9
    sent = len(wire.sent)
    wire.events += [batch(3, 8), batch(4, 12)]  # queued for it before the source saw its new epoch
    again = _chain(tmp_path, clock, wire, "work", restart=True)
    run(again, 0.5)
    wire.events.append(Received(inbox, encode_data("source-0", 0, 5, [])))  # the source's marker
    wire.events += [batch(6 + k, 4 * k) for k in range(4)]  # its replay: batches 1-4, renumbered
    run(again, 1.0)
    out = [decode(p) for t, p in wire.sent[sent:] if t == topics.inbox("c", "sink-0", "local")]
    seqs = [q for e in out if e.kind is Kind.DATA for _, q, _ in e.body]
    assert seqs == list(range(16)), seqs
    assert again.core.stats["dropped_before_replay"] == 2


def test_a_restarted_instance_asks_again_when_a_predecessors_marker_does_not_come(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The request for a replay was lost (a broker that lost its state): the predecessor keeps
    sending new data, which the restarted instance drops while it waits for the marker. After
    REPLAY_WAIT it asks again as a new incarnation instead of dropping for ever."""
    import os

    from agent import topics
    from agent.dataplane.envelope import Kind, decode, encode_data
    from agent.mqtt.transport import Received
    from agent.operators.taxi import sample
    from agent.instance.core import REPLAY_WAIT

    clock, wire = [100.0], MemoryWire()
    inbox = topics.inbox("c", "work-0", "local")
    recs = sample(1, 8)

    def batch(seq: int, first: int) -> Received:
        return Received(inbox, encode_data("source-0", 0, seq, [("source-0", first + i, recs[first + i])
                                                                 for i in range(4)]))

    w = _chain(tmp_path, clock, wire, "work")
    wire.events.append(batch(1, 0))
    _run(w, clock, 2.0)
    os.close(w._identity_lock)
    again = _chain(tmp_path, clock, wire, "work", restart=True)
    epoch = again.core.epoch
    wire.events.append(batch(2, 4))
    _run(again, clock, REPLAY_WAIT - 2)
    assert again.core.epoch == epoch and again.core.stats["dropped_before_replay"] == 1
    sent = len(wire.sent)
    _run(again, clock, 3)
    assert again.core.epoch == epoch + 1 and again.core.stats["replays_asked_again"] == 1
    asks = [decode(p) for t, p in wire.sent[sent:] if t == topics.inbox("c", "source-0", "local")]
    assert any(e.kind is Kind.ACK and e.epoch == epoch + 1 and list(e.body) == [0, 0] for e in asks), asks


def test_an_instance_restarted_after_its_termination_exits_for_good(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An agent restart re-adopts every instance whose spec it still holds; a copy that the
    protocol had terminated but that was stopped before its final exit is among them. Restored
    in state terminated, it must leave at once and for good (final: the agent forgets it), not
    sit there as an instance that neighbours no longer know and the fleet counts."""
    import json
    import os

    from agent.files import write_atomic
    from agent.protocol.scaling import InstanceState

    clock, wire = [100.0], MemoryWire()
    w = _chain(tmp_path, clock, wire, "work", policy="decentralized")
    assert w.exit_code is None
    w.core.scaling.core.state = InstanceState.TERMINATED
    write_atomic(tmp_path / "state" / "work-0.state.json", json.dumps(w.core.persisted_state()))
    path = tmp_path / "state" / "work-0.state.json"
    assert json.loads(path.read_text())["scaling"]["state"] == "terminated"
    os.close(w._identity_lock)  # the first incarnation is gone: its identity lock goes with it
    again = _chain(tmp_path, clock, wire, "work", policy="decentralized", restart=True)
    assert again.exit_command is not None and again.exit_command.final, again.exit_command


def _creator_and_idle_copy(tmp_path):  # type: ignore[no-untyped-def]
    """source -> work -> sink on in-memory wires, a clock: the keeper work-0 and its idle copy
    work-x (created, never started), both started. Returns (clock, copy, its wire, creator, its wire)."""
    import dataclasses
    import os

    from foglab.tools.dataplane_bench import initial_specs, pipeline_toml
    from agent.mqtt.settings import BrokerSpec
    from agent.instance.shell import Worker

    toml = pipeline_toml("p", [
        {"name": "source", "kind": "source", "function": "agent.operators.taxi:mqtt_source",
         "params": {"topic": "sensors/#"}},
        {"name": "work", "function": "agent.operators.builtin:validate"},
        {"name": "sink", "kind": "sink", "function": "agent.operators.builtin:counting_sink"},
    ], scaling={"policy": "decentralized"})
    keeper = [s for s in initial_specs(toml, BrokerSpec("127.0.0.1", 1), str(tmp_path / "state"), cluster="c",
                                       extra={"sink_dir": str(tmp_path / "sink")}) if s.operator == "work"][0]
    copy_spec = dataclasses.replace(keeper, instance="work-x", keeper=False, active=False, succs=(), preds=(),
                                    extra={**keeper.extra, "creator": "work-0"})
    clock = [100.0]
    copy_wire, keeper_wire = MemoryWire(), MemoryWire()
    copy = Worker(copy_spec, out=open(os.devnull, "w"), clock=lambda: clock[0], transport=copy_wire)  # noqa: SIM115
    copy.start()
    creator = Worker(keeper, out=open(os.devnull, "w"), clock=lambda: clock[0], transport=keeper_wire)  # noqa: SIM115
    creator.start()
    return clock, copy, copy_wire, creator, keeper_wire


def test_an_idle_copy_asks_its_creator_for_start_again_and_only_its_creator_answers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Start is the one protocol message nobody acks: a broker that loses it (killed between two
    autosaves, with the copy's new session) would leave the copy idle for ever, with batches
    routed to it. The copy asks again (an ack of nothing to its creator) after IDLE_PING, then
    at doubling intervals; a creator answers with Start and its current tables, but only for a
    copy it has started (the round is over: Start never goes out before the neighbours acked)."""
    from agent import topics
    from agent.dataplane.envelope import Envelope, Kind, decode, encode
    from agent.mqtt.transport import Received
    from agent.instance.driver import IDLE_PING

    clock, copy, copy_wire, creator, keeper_wire = _creator_and_idle_copy(tmp_path)

    def pings() -> list:
        return [decode(p) for t, p in copy_wire.sent if t == topics.inbox("c", "work-0", "local")]

    def run(seconds: float) -> None:
        end = clock[0] + seconds
        while clock[0] < end:
            clock[0] += 0.5
            copy.step(clock[0])

    run(IDLE_PING - 1)
    assert pings() == []
    run(2)
    assert [(e.kind, list(e.body)) for e in pings()] == [(Kind.ACK, [0, 0])]
    run(IDLE_PING - 2)
    assert len(pings()) == 1  # the next one only after 2 x IDLE_PING
    run(IDLE_PING + 2)
    assert len(pings()) == 2

    to_copy = topics.inbox("c", "work-x", "local")

    def ping_creator(seq: int) -> list:
        before = len(keeper_wire.sent)
        keeper_wire.events.append(Received(topics.inbox("c", "work-0", "local"),
                                           encode(Envelope("work-x", copy.core.epoch, seq, Kind.ACK, [0, 0]))))
        creator.step(clock[0])
        return [decode(p) for t, p in keeper_wire.sent[before:] if t == to_copy]

    probe = ping_creator(1)  # a copy it never started: no Start, a probe (see the adoption test below)
    assert [e.body["type"] for e in probe] == ["probe"]
    creator.core.scaling.idle.started.append("work-x")
    sent = ping_creator(2)
    assert len(sent) == 1 and sent[0].kind is Kind.PROTO and sent[0].body["type"] == "start", sent
    assert sent[0].body["succs"] == ["sink-0"] and sent[0].body["preds"] == ["source-0"]
    copy_wire.events.extend(Received(to_copy, encode(e)) for e in probe + sent)
    copy.step(clock[0])
    assert copy.core.scaling.core.is_active and copy.core.router.succs == ("sink-0",)  # started at last


def test_an_idle_copy_holds_a_rehomed_successors_first_ack_until_its_start(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A re-homed sink, a new incarnation, sends every predecessor of its rebuilt table an empty ack
    in its new epoch, number 1 on its channel, idle copies included. Refused, it would leave a hole
    at 1: every later message of the sink would wait behind it, the copy's Drain would never see its
    acks, and five seconds later the copy would become a new incarnation in its own deletion
    (CHANGELOG.md, "A copy that became a new incarnation in its own deletion stranded its inputs").
    Held until Start like data, it is delivered then, and the sink's next ack follows it in order."""
    from agent import topics
    from agent.dataplane.envelope import Envelope, Kind, decode, encode
    from agent.mqtt.transport import Received

    clock, copy, copy_wire, creator, keeper_wire = _creator_and_idle_copy(tmp_path)
    to_copy, to_creator = topics.inbox("c", "work-x", "local"), topics.inbox("c", "work-0", "local")
    sink_epoch = 7  # the re-homed sink's new epoch
    copy_wire.events.append(Received(to_copy, encode(Envelope("sink-0", sink_epoch, 1, Kind.ACK, [0, 0]))))
    clock[0] += 0.5
    copy.step(clock[0])
    assert copy.core.stats["refused_senders"] == 0 and copy.core.admission.hold.count == 1
    clock[0] += 30
    copy.step(clock[0])  # an idle copy's hold does not expire: its neighbours come with Start
    assert copy.core.admission.hold.count == 1

    creator.core.scaling.idle.started.append("work-x")  # the creator answers the copy's ping with Start
    keeper_wire.events.append(Received(to_creator, encode(Envelope("work-x", copy.core.epoch, 1, Kind.ACK, [0, 0]))))
    creator.step(clock[0])
    copy_wire.events.extend(Received(to_copy, p) for t, p in keeper_wire.sent if t == to_copy)
    clock[0] += 0.5
    copy.step(clock[0])
    assert copy.core.scaling.core.is_active
    copy_wire.events.append(Received(to_copy, encode(Envelope("sink-0", sink_epoch, 2, Kind.ACK, [0, 0]))))
    for _ in range(4):
        clock[0] += 0.5
        copy.step(clock[0])
    assert copy.core.stats["refused_senders"] == 0 and copy.core.admission.hold.count == 0
    assert copy.core.inbound.gaps() == {}, copy.core.inbound.gaps()
    assert copy.core.inbound.epoch_of("sink-0") == sink_epoch
    assert [decode(p).body["type"] for t, p in keeper_wire.sent if t == to_copy] == ["start"]


def test_a_creator_adopts_an_idle_copy_of_its_earlier_incarnation_only_after_it_echoed_a_probe(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A node lost in the middle of a duplication round (re-homing): the creator comes back
    elsewhere from rebuilt tables and knows nothing of the round; its copy, on another node,
    never got its Start while neighbours may already route records to it. The copy's idle ping
    reaches the new incarnation, which probes it; only an echo of that probe (sent while the copy
    is idle) makes it announce the copy again to every neighbour (a Duplication, no spawn) and
    start it once they acked. A wrong echo, or a probe reaching a copy that is active, adopts
    nothing."""

    from agent import topics
    from agent.protocol.messages import DuplicationAck
    from agent.dataplane.envelope import Envelope, Kind, decode, encode
    from agent.mqtt.transport import Received
    from agent.instance.driver import IDLE_PING

    clock, copy, copy_wire, creator, keeper_wire = _creator_and_idle_copy(tmp_path)
    to_copy, to_creator = topics.inbox("c", "work-x", "local"), topics.inbox("c", "work-0", "local")
    seen = {"copy": 0, "creator": 0}

    def carry(wire, worker, topic, key):  # type: ignore[no-untyped-def]
        """Deliver what `wire` published to `topic` since the last call to `worker`; return it."""
        got = [p for t, p in wire.sent if t == topic]
        new, seen[key] = got[seen[key]:], len(got)
        for p in new:
            worker.transport.events.append(Received(topic, p))
        clock[0] += 0.1
        worker.step(clock[0])
        return [decode(p) for p in new]

    clock[0] += IDLE_PING + 0.5
    copy.step(clock[0])
    assert [list(e.body) for e in carry(copy_wire, creator, to_creator, "creator")] == [[0, 0]]  # idle ping
    probe = [decode(p) for t, p in keeper_wire.sent if t == to_copy]
    assert [e.body["type"] for e in probe] == ["probe"], probe
    n = probe[0].body["n"]

    inboxes = {topics.inbox("c", i, "local") for i in ("source-0", "work-0", "work-x", "sink-0")}

    def protos(wire, topic=None):  # type: ignore[no-untyped-def]
        """The protocol messages `wire` published (to `topic`), in order, with their topics."""
        return [(t, e.body) for t, e in ((t, decode(p)) for t, p in wire.sent if t in inboxes)
                if e.kind is Kind.PROTO and (topic is None or t == topic)]

    def echo(seq: int, n_: int) -> None:
        body = {"type": "probe_echo", "sender": "work-x", "n": n_}
        keeper_wire.events.append(Received(to_creator, encode(Envelope("work-x", copy.core.epoch, seq, Kind.PROTO, body))))
        clock[0] += 0.1
        creator.step(clock[0])

    echo(2, n + 1)  # a wrong echo adopts nothing
    assert list(creator.core.scaling.idle.orphans) == [] and creator.core.scaling.core.state.value == "active"
    assert not [b for _, b in protos(keeper_wire) if b["type"] == "duplication"]

    # the copy (idle) echoes the probe; then the creator announces it to both neighbours, spawns nothing
    carry(keeper_wire, copy, to_copy, "copy")
    assert [(b["type"], b["n"]) for _, b in protos(copy_wire, to_creator)] == [("probe_echo", n)]
    echo(3, n)
    dup = [(t, b) for t, b in protos(keeper_wire) if b["type"] == "duplication"]
    assert sorted(t for t, _ in dup) == sorted([topics.inbox("c", "source-0", "local"), topics.inbox("c", "sink-0", "local")]), dup
    assert all(b["new_instances"] == ["work-x"] for _, b in dup), dup
    assert creator.core.scaling.counts["spawns"] == 0 and creator.core.scaling.counts["adopted"] == 1
    rnd = dup[0][1]["round"]
    for seq_, peer, stage in ((1, "source-0", 0), (1, "sink-0", 2)):
        ack = DuplicationAck.trusted(sender=peer, stage=stage, round=rnd)
        keeper_wire.events.append(Received(to_creator, encode(Envelope(peer, 0, seq_, Kind.PROTO, ack.to_dict()))))
    clock[0] += 0.1
    creator.step(clock[0])
    start = [b for _, b in protos(keeper_wire, to_copy) if b["type"] == "start"]
    assert len(start) == 1 and start[0]["succs"] == ["sink-0"] and start[0]["preds"] == ["source-0"], start
    carry(keeper_wire, copy, to_copy, "copy")
    assert copy.core.scaling.core.is_active and copy.core.router.succs == ("sink-0",)

    # once active, the copy echoes no probe: a late ping cannot make the creator adopt it twice
    creator.core.scaling.idle.started.clear()
    keeper_wire.events.append(Received(to_creator, encode(Envelope("work-x", copy.core.epoch, 4, Kind.ACK, [0, 0]))))
    creator.step(clock[0])
    carry(keeper_wire, copy, to_copy, "copy")
    assert len(protos(keeper_wire, to_copy)) == 3  # probe, start, a second probe
    assert len(protos(copy_wire, to_creator)) == 1  # the first echo only
    assert creator.core.scaling.counts["adopted"] == 1

    # hostile probes and echoes: counted as protocol errors, nothing else happens
    errors = creator.core.stats["protocol_errors"]
    bad = [{"type": "probe_echo", "sender": "work-x", "n": v} for v in ("1", True, 0, -3, None, 1.0)]
    bad += [{"type": "probe_echo", "sender": "work-y", "n": n}, {"type": "probe", "n": n}]
    for k, body in enumerate(bad):
        keeper_wire.events.append(Received(to_creator, encode(Envelope("work-x", copy.core.epoch, 5 + k, Kind.PROTO, body))))
    creator.step(clock[0])
    assert creator.core.stats["protocol_errors"] == errors + len(bad)
    assert creator.core.scaling.counts["adopted"] == 1 and list(creator.core.scaling.idle.orphans) == []


def test_a_refused_ack_of_a_sink_is_published_later_and_later_acks_follow(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The sink's ack is refused once (the broker restarting under the write); refused publishes
    wait in order behind each other, and a sink flushes no data: retried only when data is
    flushed, that ack and every later one would wait for ever, its predecessors would run out of
    credit and the last records never reach it (CHANGELOG.md, "A refused publish held back every
    later one for good")."""
    from agent import topics
    from agent.dataplane.envelope import decode, encode_data
    from agent.operators.taxi import sample
    from agent.mqtt.transport import Received

    clock, wire = [100.0], MemoryWire()
    w = _chain(tmp_path, clock, wire, "sink")
    inbox, to_work = topics.inbox("c", "sink-0", "local"), topics.inbox("c", "work-0", "local")
    recs = sample(1, 40)

    def batch(seq: int) -> Received:
        return Received(inbox, encode_data("work-0", 0, seq, [("source-0", 4 * seq + i, recs[4 * seq + i]) for i in range(4)]))

    def acked() -> int:
        return max([decode(p).body[1] for t, p in wire.sent if t == to_work and decode(p).kind.value == "a"] or [0])

    def run(seconds: float) -> None:
        end = clock[0] + seconds
        while clock[0] < end:
            clock[0] += 0.05
            w.step(clock[0])

    wire.refuse = 1
    wire.events += [batch(1), batch(2)]
    run(1.0)
    assert w.core.stats["publish_rejected"] == 1
    wire.events += [batch(s) for s in range(3, 9)]
    run(1.0)
    assert acked() == 8, f"the sink acked only up to {acked()} of 8 batches"
    assert not w.core.outputs.retry


def _active_copy(tmp_path, clock: list, restart: bool = False, extra: Optional[dict] = None):  # type: ignore[no-untyped-def]
    """An active, started copy work-y of source -> work -> sink (creator work-0) on an in-memory
    wire, its clock in `clock[0]`; `extra` adds to its spec's extra. Returns (worker, wire)."""
    import dataclasses
    import os

    from agent.instance.shell import Worker

    _, _, _, keeper, _ = _creator_and_idle_copy(tmp_path)
    spec = dataclasses.replace(keeper.spec, instance="work-y", keeper=False, active=True, preds=("source-0",),
                               succs=("sink-0",), restart=restart,
                               extra={**keeper.spec.extra, "creator": "work-0", **(extra or {})})
    wire = MemoryWire()
    w = Worker(spec, out=open(os.devnull, "w"), clock=lambda: clock[0], transport=wire)  # noqa: SIM115
    w.start()
    return w, wire


def test_a_rehomed_creator_scales_in_only_after_a_late_copy_could_have_pinged_it(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A copy its dead incarnation asked for just before the node was lost may start only after
    the re-home plan was made (the spawn has 30 s), so the plan cannot name it: a re-homed
    creator whose policy scaled in at once left before the copy's first idle ping, and the copy
    stayed idle for ever with nobody to start it (chaos: an idle in_zone copy left over after a
    partition). Re-homed, the policy's scale-ins wait LATE_COPY s; the late copy's ping is
    probed meanwhile. A creator that was not re-homed scales in at its first decision."""
    from agent.dataplane.envelope import Kind, decode
    from agent.instance.adoption import IDLE_PING, LATE_COPY
    from agent.node.spawns import RPC_TIMEOUT
    from agent.policy.decentralized import Action, Decision

    assert LATE_COPY >= RPC_TIMEOUT + IDLE_PING - 1e-9
    for rehomed in (False, True):
        clock = [100.0]
        w, wire = _active_copy(tmp_path / f"s{rehomed}", clock, restart=rehomed,
                               extra={"min_epoch": 1_795_535_791} if rehomed else {})
        sc = w.core.scaling
        monkeypatch.setattr(sc.core, "decide", lambda load, draw: Decision(Action.TERMINATE, 1))
        sc.skip_decisions = 0
        started, left_at = clock[0], None
        while clock[0] < started + LATE_COPY + 3 * sc.period and left_at is None:
            clock[0] += 0.25
            w.step(clock[0])
            if rehomed and clock[0] - started == 10.0:  # the late copy's idle ping: probed at once
                assert sc.idle.on_idle_ping("work-late", clock[0]) is not None
                sc.idle.probes.clear()  # its echo never comes here: only the wait is looked at
            sent = [decode(p) for t, p in wire.sent if "/inbox/" in t]  # envelopes, not events
            if any(e.kind is Kind.PROTO and e.body.get("type") == "deletion" for e in sent):
                left_at = clock[0] - started
        assert left_at is not None, rehomed
        assert (left_at >= LATE_COPY) is rehomed, (rehomed, left_at)


def test_a_departing_copy_drains_data_queued_behind_a_duplicate_deletion_ack(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A partition: the copy's Deletion gets no answer for 10 s and is sent again, so its
    predecessor acks the round twice, then replays batches the copy had not acked. The first ack
    completes the round (Drain: forward everything, then Terminate); the second sits at the head
    of the predecessor's queue. Were protocol messages to wait while outputs are pending, the data
    behind it would never be processed and the Drain never end: a departing copy for ever and the
    records it held lost (CHANGELOG.md, "A departing copy waited for ever behind a repeated
    ack"). While draining, the predecessors have all removed us, so only repeats can come: they
    are handled (a repeat is a counted no-op), and the data behind them drains."""
    from agent import topics
    from agent.dataplane.envelope import Envelope, Kind, decode, encode, encode_data
    from agent.operators.taxi import sample
    from agent.mqtt.transport import Received

    clock = [100.0]
    w, wire = _active_copy(tmp_path, clock)
    inbox = topics.inbox("c", "work-y", "local")
    recs = sample(1, 12)

    def run(seconds: float) -> None:
        end = clock[0] + seconds
        while clock[0] < end and w.exit_code is None:
            clock[0] += 0.05
            w.step(clock[0])

    def data(seq: int, first: int) -> Received:
        return Received(inbox, encode_data("source-0", 0, seq, [("source-0", first + i, recs[first + i]) for i in range(4)]))

    def proto(sender: str, seq: int, rnd: int) -> Received:
        stage = 0 if sender == "source-0" else 2
        return Received(inbox, encode(Envelope(sender, 0, seq, Kind.PROTO, DeletionAck(sender, stage, rnd).to_dict())))

    def sent(kind: Kind, dest: str) -> list:
        return [decode(p) for t, p in wire.sent if t == topics.inbox("c", dest, "local") and decode(p).kind is kind]

    w.core.scaling.force("terminate", 1)
    run(1.0)
    (deletion,) = sent(Kind.PROTO, "source-0")  # two-phase: the predecessors first
    rnd = deletion.body["round"]
    # the predecessor's last batch, its ack, the same ack again (our Deletion was re-sent), a replay
    wire.events += [data(1, 0), proto("source-0", 2, rnd), proto("source-0", 3, rnd), data(4, 4)]
    run(2.0)
    batches = sent(Kind.DATA, "sink-0")
    assert sum(len(e.body) for e in batches) == 8, "the data behind the repeated ack was not drained"
    wire.events.append(Received(inbox, encode(Envelope("sink-0", 0, 1, Kind.ACK, [w.core.epoch, batches[-1].seq]))))
    run(1.0)
    (to_succ,) = sent(Kind.PROTO, "sink-0")  # drained: now the successors
    wire.events.append(proto("sink-0", 2, to_succ.body["round"]))
    run(1.0)
    assert w.exit_code is not None and w.core.scaling.terminated


def test_a_rehomed_copy_numbers_its_rounds_above_any_its_dead_incarnation_used(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A copy re-homed after its node died has lost its state with the node. Numbering its rounds
    from 1 again, its round 1, a Deletion, would look like a repeat to its predecessor, which had
    applied round 1 of the dead incarnation (a duplication): acked, not applied, and the
    predecessor would keep routing records to the copy that left (CHANGELOG.md, "A re-homed
    copy's rounds looked like repeats"). A re-homed instance (`min_epoch`) numbers its rounds
    above anything the dead one can have used, so the neighbour applies them."""
    from agent.dataplane.envelope import Kind, decode

    clock = [100.0]
    memory = RoundMemory()  # the predecessor applied round 1 of the dead incarnation
    memory.applied_now(Duplication("work-y", 1, 1, ("work-z",)))
    for rehomed, applies in ((False, False), (True, True)):
        w, wire = _active_copy(tmp_path / f"s{rehomed}", clock, restart=rehomed,
                               extra={"min_epoch": 1_795_535_791} if rehomed else {})
        w.core.scaling.force("terminate", 1)
        clock[0] += 1.0
        w.step(clock[0])
        (deletion,) = [from_dict(decode(p).body) for _, p in wire.sent if decode(p).kind is Kind.PROTO]
        assert (memory.replay_ack(deletion, "source-0", 0) is None) is applies, (rehomed, deletion)


def test_a_fast_source_writes_its_position_about_once_a_second_and_never_generates_past_it(tmp_path,  # type: ignore[no-untyped-def]
                                                                                             monkeypatch, request) -> None:
    """At 50k records/s a fixed reserve of 2,000 records rewrote source.json 25 times a second
    (14% of the source's CPU). The reserve is now a second of the measured rate: a few writes
    a second. What must not change: at every moment the position on disk reserves at least
    every record generated so far (a kill -9 at any point: the restarted source regenerates up
    to the reservation, so nothing it sent is beyond what it reports), and a restart from the
    last written position regenerates from the first record not acked downstream."""
    import json
    import os

    from agent import files, topics
    from agent.dataplane.envelope import Envelope, Kind, decode, encode
    from agent.instance import shell as worker_mod
    from agent.instance.shell import Worker
    from agent.mqtt.settings import BrokerSpec
    from agent.mqtt.transport import Received
    from agent.operators.admission import ENV_MODULES, node_allow_list
    from foglab.tools.dataplane_bench import initial_specs, pipeline_toml

    written: list = []

    def write(path, text):  # type: ignore[no-untyped-def]
        if path.name.endswith(".source.json"):
            written.append(json.loads(text))
        files.write_atomic(path, text)

    monkeypatch.setattr(worker_mod, "write_atomic", write)
    monkeypatch.setenv(ENV_MODULES, "foglab.operators.bench")  # the lab's source, as a lab node admits it
    node_allow_list.cache_clear()  # read from this environment, and again after it
    request.addfinalizer(node_allow_list.cache_clear)
    toml = pipeline_toml("p", [
        {"name": "source", "kind": "source", "function": "foglab.operators.bench:bench_source", "batch_size": 100,
         "max_inflight_batches": 8, "params": {"profile": "constant", "rate": 30000.0, "record": "tiny"}},
        {"name": "sink", "kind": "sink", "function": "agent.operators.builtin:null_sink"},
    ], scaling={"policy": "none"})
    spec = initial_specs(toml, BrokerSpec("127.0.0.1", 1), str(tmp_path / "state"), cluster="c",
                         extra={"sink_dir": str(tmp_path / "sink")})[0]
    clock, wire = [100.0], MemoryWire()
    w = Worker(spec, out=open(os.devnull, "w"), clock=lambda: clock[0], transport=wire)  # noqa: SIM115
    w.start()
    to_sink, ack_seq, done = topics.inbox("c", "sink-0", "local"), [0], [0]
    for _ in range(800):  # 4 s at 5 ms a turn (at most 2 batches a turn: 40k records/s)
        clock[0] += 0.005
        w.step(clock[0])
        assert written and written[-1]["reserved"] >= w.core.operator.generated  # kill -9 here: nothing beyond
        data = [decode(p) for t, p in wire.sent[done[0]:] if t == to_sink]
        done[0] = len(wire.sent)
        if data:  # the sink acks all it got
            ack_seq[0] += 1
            wire.events.append(Received(topics.inbox("c", "source-0", "local"), encode(
                Envelope("sink-0", 0, ack_seq[0], Kind.ACK, [w.core.epoch, max(e.seq for e in data if e.kind is Kind.DATA)]))))
    generated = w.core.operator.generated
    assert generated > 110_000  # it ran at its rate (no credit stall)
    reservations = len({d["reserved"] for d in written})
    assert reservations <= 4 * 2 + 2, reservations  # ~1 a second (2,000 records each: 60)
    assert written[-1]["reserved"] - generated <= 2 * 30_000  # the catch-up after a crash stays bounded
    assert written[-1]["resume_from"] <= generated


def test_an_empty_ack_from_an_instance_of_another_operator_is_never_probed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A copy re-homed idle (agent.node.rehome) asks its predecessors for replays with an empty
    ack; a predecessor with a link to it, that left it out of its rebuilt successors, took that
    for an idle ping of a copy of its own and probed it (chaos): no echo ever comes
    (a copy echoes only its creator), and the probe held the predecessor's scale-ins for
    PROBE_TTL (`ScalingDriver.adoption_pending`). Only names like our copies are probed."""
    clock, copy, copy_wire, creator, keeper_wire = _creator_and_idle_copy(tmp_path)
    sc = creator.core.scaling
    now = creator.core.now
    assert sc.idle.on_idle_ping("sink-9", now) is None  # not a ping for us
    assert sc.idle.probes == {} and not sc.adoption_pending
    probe = sc.idle.on_idle_ping("work-y", now)  # named like our copies: probed
    assert probe is not None and len(probe) == 1 and list(sc.idle.probes) == ["work-y"]
    assert sc.idle.on_idle_ping("work-y", now) == [] and sc.counts["probes"] == 1  # its probe is on its way
