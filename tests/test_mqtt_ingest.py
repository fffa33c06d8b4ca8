"""An `mqtt_source` keeps every reading (agent.operators.taxi.MqttIngestSource): a delivery is
PUBACKed only once a successor acked its record, what is not acked stays in the instance's ingest
session for its next incarnation, and no incarnation reuses a number an earlier one used. The
first tests drive a worker on in-memory wires; the last checks, on a real Mosquitto, the broker
behaviour the source relies on."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, List, Tuple

import paho.mqtt.client as mqtt
from memory_wire import MemoryWire

from agent import topics
from agent.dataplane.envelope import Envelope, Kind, decode, encode
from agent.instance.events import Abort, Control
from agent.instance.shell import Worker
from agent.mqtt.settings import BrokerSpec
from agent.mqtt.transport import Received, Transport
from foglab.tools.dataplane_bench import initial_specs, pipeline_toml

WALL = 1_700_000_000.0  # the wall clock of the first incarnation
SINK_INBOX = topics.inbox("c", "sink-0", "local")
SOURCE_INBOX = topics.inbox("c", "source-0", "local")


def _source(tmp_path: Path, clock: List[float], wall: float, restart: bool = False) -> Tuple[Worker, MemoryWire, MemoryWire]:
    """The source of mqtt_source -> counting_sink on in-memory wires: (worker, its wire, ingest wire)."""
    toml = pipeline_toml("p", [
        {"name": "source", "kind": "source", "function": "agent.operators.taxi:mqtt_source",
         "params": {"topic": "sensors/#"}, "batch_size": 4, "linger_ms": 0},
        {"name": "sink", "kind": "sink", "function": "agent.operators.builtin:counting_sink"},
    ], scaling={"policy": "none"})
    spec = initial_specs(toml, BrokerSpec("127.0.0.1", 1), str(tmp_path / "state"), cluster="c",
                         extra={"sink_dir": str(tmp_path / "sink")})[0]
    wire, ingest = MemoryWire(), MemoryWire()
    w = Worker(dataclasses.replace(spec, restart=restart), out=open(os.devnull, "w"),  # noqa: SIM115
               clock=lambda: clock[0], transport=wire, wall=lambda: wall + clock[0], ingest=ingest)
    w.start()
    return w, wire, ingest


def _deliver(w: Worker, ingest: MemoryWire, clock: List[float], first_mid: int, n: int) -> None:
    ingest.events += [Received("sensors/s1", b'{"v": %d}' % (first_mid + i), first_mid + i, 1) for i in range(n)]
    clock[0] += 0.1
    w.step(clock[0])
    w.step(clock[0])


def _numbers(wire: MemoryWire) -> List[int]:
    return [it[1] for t, p in wire.sent if t == SINK_INBOX for it in decode(p).body if decode(p).kind is Kind.DATA]


def test_a_reading_is_acked_to_the_broker_only_once_a_successor_acked_its_record(tmp_path: Path) -> None:
    clock = [100.0]
    w, wire, ingest = _source(tmp_path, clock, WALL)
    _deliver(w, ingest, clock, 1, 4)
    _deliver(w, ingest, clock, 5, 4)
    assert len(_numbers(wire)) == 8  # sent on: two batches of 4
    assert ingest.acked == []  # none acked downstream yet: the broker keeps all 8
    wire.events.append(Received(SOURCE_INBOX, encode(Envelope("sink-0", 0, 1, Kind.ACK, [w.core.epoch, 1]))))
    clock[0] += 0.1
    w.step(clock[0])
    assert ingest.acked == [(1, 1), (2, 1), (3, 1), (4, 1)]  # the first batch's readings, in order
    wire.events.append(Received(SOURCE_INBOX, encode(Envelope("sink-0", 0, 2, Kind.ACK, [w.core.epoch, 2]))))
    clock[0] += 0.1
    w.step(clock[0])
    assert ingest.acked == [(m, 1) for m in range(1, 9)]


def test_a_new_incarnation_numbers_above_every_number_its_predecessor_used(tmp_path: Path) -> None:
    """A drained, restarted or re-homed source used to start again at 0, and a keyed operator after
    it skipped every new reading as a replay of one it had applied. With its position file (a
    restart, a drain) it numbers above what it reserved; without it (its node lost) above the wall
    clock in microseconds, which is past every number of an incarnation that started earlier."""
    clock = [100.0]
    old, wire, ingest = _source(tmp_path, clock, WALL)
    _deliver(old, ingest, clock, 1, 8)
    used = _numbers(wire)
    assert len(used) == 8 and min(used) >= int((WALL + 100.0) * 1e6)
    old.feed(Abort("killed"), clock[0])  # gone, its lock released as by its process's death
    os.close(old._identity_lock)
    # a restart on the same node, its clock a second later: above the reservation on disk
    saved = json.loads((tmp_path / "sink" / "source-0.source.json").read_text())
    new, wire2, ingest2 = _source(tmp_path, clock, WALL + 1.0, restart=True)
    _deliver(new, ingest2, clock, 1, 4)
    again = _numbers(wire2)
    new.feed(Abort("killed"), clock[0])
    os.close(new._identity_lock)
    # the 8 unacked ones again under their numbers (from the ingest log), then the 4 new ones
    assert again[:8] == used
    fresh = again[8:]
    assert len(fresh) == 4 and min(fresh) > max(used) and min(fresh) >= saved["reserved"]
    # its node lost with its files: a re-homed incarnation, later by the wall clock
    for name in ("source-0.source.json", "source-0.ingest.log"):
        (tmp_path / "sink" / name).unlink()
    lost, wire3, ingest3 = _source(tmp_path, clock, WALL + 2.0, restart=True)
    _deliver(lost, ingest3, clock, 1, 4)
    assert len(_numbers(wire3)) == 4 and min(_numbers(wire3)) > max(again)


def test_a_stopping_source_leaves_its_unsent_readings_unacked_for_the_next_incarnation(tmp_path: Path) -> None:
    clock = [100.0]
    w, wire, ingest = _source(tmp_path, clock, WALL)
    _deliver(w, ingest, clock, 1, 4)
    w.feed(Control({"event": "stop"}), clock[0])
    ingest.events += [Received("sensors/s1", b'{"v": %d}' % m, m, 1) for m in (5, 6)]
    for _ in range(5):
        clock[0] += 0.1
        w.step(clock[0])
    assert len(_numbers(wire)) == 4  # the two delivered during the stop are not sent on
    assert all(mid < 5 for mid, _ in ingest.acked)  # and never acked: the broker sends them again


def test_the_broker_sends_unacked_deliveries_again_in_order_to_the_next_connection(mosquitto: Any) -> None:
    """What the source relies on: with manual acks and a persistent session, deliveries not acked
    when a connection ends (a crash, a drain, a node lost) go, in their order and flagged dup, to
    the next connection with the same client id, followed by what was published meanwhile."""
    broker = BrokerSpec(mosquitto.host, mosquitto.port)
    cid = f"ingest-test-{os.getpid()}"

    def received(t: Transport, n: int) -> List[Received]:
        got: List[Received] = []
        deadline = time.monotonic() + 10
        while len(got) < n and time.monotonic() < deadline:
            t.poll(0.05)
            got += [e for e in t.take_events() if isinstance(e, Received)]
        return got

    first = Transport(cid, broker, manual_ack=True)
    first.connect()
    first.subscribe("ingest-test/#")
    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{cid}-pub")
    pub.connect(mosquitto.host, mosquitto.port)
    pub.loop_start()
    try:
        for i in range(10):
            pub.publish("ingest-test/s1", b"%d" % i, qos=1).wait_for_publish(5)
        got = received(first, 10)
        assert [g.payload for g in got] == [b"%d" % i for i in range(10)]
        for g in got[:4]:
            first.ack(g.mid, g.qos)
        first.poll(0.05)
        first.client.socket().close()  # a crash: no DISCONNECT
        for i in range(10, 12):
            pub.publish("ingest-test/s1", b"%d" % i, qos=1).wait_for_publish(5)
        second = Transport(cid, broker, manual_ack=True)
        assert second.connect()  # the session was kept
        again = received(second, 8)
        assert [g.payload for g in again] == [b"%d" % i for i in range(4, 12)]
        # flagged dup: those in flight to the dead connection, not those published meanwhile (the
        # source tells a redelivery of a logged record from a new reading by this and its digest)
        assert [g.dup for g in again] == [True] * 6 + [False] * 2
        for g in again:
            second.ack(g.mid, g.qos)
        second.poll(0.05)
        second.close(final=True)
    finally:
        pub.loop_stop()
        pub.disconnect()


def test_a_packet_id_is_pubacked_once_per_connection_until_the_broker_uses_it_again() -> None:
    """docs/results.md, R23: after a reconnect the source PUBACKed a delivery it held from the old
    connection, then got the broker's dup of it (sent before our PUBACK arrived) and acked that
    too; Mosquitto 2.0.11 then put the next new reading in flight ahead of the ones it had queued
    for the source while it was away. The transport PUBACKs a packet id once per connection,
    again once the broker delivers that id as a new message, and afresh on a new connection."""
    from types import SimpleNamespace

    t = Transport("ingest-acks", BrokerSpec("127.0.0.1", 1), manual_ack=True)
    sent: List[int] = []
    t.client = SimpleNamespace(ack=lambda mid, qos: sent.append(mid))  # the wire: what paho would send
    flags = SimpleNamespace(session_present=True)
    ok = SimpleNamespace(is_failure=False)

    def deliver(mid: int, dup: bool) -> None:
        t._on_message(None, None, SimpleNamespace(topic="s/1", payload=b"r", mid=mid, qos=1, dup=dup))

    t._on_connect(None, None, flags, ok)
    t.ack(7, 1)  # a delivery of the old connection, acked downstream since the reconnect
    deliver(7, dup=True)  # the broker's copy of it, sent before our PUBACK reached it
    t.ack(7, 1)  # the source acks a dup it acked lately: not on the wire twice
    assert sent == [7] and t.acks_skipped == 1
    deliver(7, dup=False)  # the id used again for a new reading: acked as any
    t.ack(7, 1)
    assert sent == [7, 7]
    t._on_disconnect(None, None, flags, ok)
    t.ack(8, 1)  # no connection: nothing sent (the broker sends it again)
    t._on_connect(None, None, flags, ok)
    deliver(7, dup=True)  # a new connection: whatever it sends again is acked again
    t.ack(7, 1)
    assert sent == [7, 7, 7] and t.acks_skipped == 1


def _ack_all(w: Worker, wire: MemoryWire, clock: List[float], ack_seq: int = 1) -> None:
    """The sink acks every data batch the source sent it (in its ack envelope number `ack_seq`)."""
    seqs = [decode(p).seq for t, p in wire.sent if t == SINK_INBOX and decode(p).kind is Kind.DATA]
    wire.events.append(Received(SOURCE_INBOX, encode(Envelope("sink-0", 0, ack_seq, Kind.ACK,
                                                              [w.core.epoch, max(seqs)]))))
    clock[0] += 0.1
    w.step(clock[0])


def test_after_a_kill_each_reading_keeps_the_one_number_it_had(tmp_path: Path) -> None:
    """kill -9 with readings sent on but not acked by the successor: they are still unacked at the
    broker, which sends them again (dup) to the next incarnation. The restarted source sends its
    logged records again under their numbers (the successor drops what it had by id) and takes the
    redeliveries as those records, not as new readings under new numbers (counted twice
    downstream); a new reading gets a new number above them."""
    clock = [100.0]
    old, wire, ingest = _source(tmp_path, clock, WALL)
    _deliver(old, ingest, clock, 1, 4)
    _deliver(old, ingest, clock, 5, 4)
    first = _numbers(wire)
    assert len(first) == 8
    old.feed(Abort("kill -9"), clock[0])
    os.close(old._identity_lock)
    new, wire2, ingest2 = _source(tmp_path, clock, WALL + 1.0, restart=True)
    ingest2.events += [Received("sensors/s1", b'{"v": %d}' % m, 10 + m, 1, dup=True) for m in range(1, 9)]
    ingest2.events.append(Received("sensors/s1", b'{"v": 99}', 30, 1))  # published meanwhile
    for _ in range(3):
        clock[0] += 0.1
        new.step(clock[0])
    again = _numbers(wire2)
    assert sorted(again[:8]) == first and len(again) == 9 and again[8] > max(first)
    assert ingest2.acked == []
    _ack_all(new, wire2, clock)
    assert sorted(mid for mid, _ in ingest2.acked) == list(range(11, 19)) + [30]


def test_a_torn_last_line_of_the_ingest_log_is_skipped(tmp_path: Path) -> None:
    from agent.instance.ingestlog import IngestLog

    log = IngestLog(tmp_path / "x.ingest.log")
    log.append([[5, "d5", {"v": 5}], [6, "d6", {"v": 6}]], keep_from=0)
    log.close()
    with open(tmp_path / "x.ingest.log", "a") as fh:
        fh.write('[7,"d7",{"v"')  # a crash mid-write: record 7 never left
    assert IngestLog(tmp_path / "x.ingest.log").load() == [[5, "d5", {"v": 5}], [6, "d6", {"v": 6}]]
    again = IngestLog(tmp_path / "x.ingest.log")
    again.compact(keep_from=6)
    assert again.load() == [[6, "d6", {"v": 6}]]


def test_what_the_broker_sends_again_after_a_reconnect_is_not_a_new_reading(tmp_path: Path) -> None:
    """A broker restart, or a partition healed, with the source's process alive: the broker sends
    again, flagged dup and under the same packet ids, every delivery not acked yet. They are the
    readings the source holds, not new ones (a chaos run counted 1-4 readings twice per broker
    restart); one acked just before the drop is acked again, nothing more."""
    clock = [100.0]
    w, wire, ingest = _source(tmp_path, clock, WALL)
    _deliver(w, ingest, clock, 1, 4)
    _deliver(w, ingest, clock, 5, 4)
    wire.events.append(Received(SOURCE_INBOX, encode(Envelope("sink-0", 0, 1, Kind.ACK, [w.core.epoch, 1]))))
    clock[0] += 0.1
    w.step(clock[0])
    assert ingest.acked == [(m, 1) for m in range(1, 5)]
    # the connection drops and comes back: 5-8 (unacked) and 4 (its PUBACK lost) again
    ingest.events += [Received("sensors/s1", b'{"v": %d}' % m, m, 1, dup=True) for m in (4, 5, 6, 7, 8)]
    clock[0] += 0.1
    w.step(clock[0])
    w.step(clock[0])
    assert len(_numbers(wire)) == 8  # no new record
    assert ingest.acked == [(m, 1) for m in range(1, 5)] + [(4, 1)]
    _ack_all(w, wire, clock, ack_seq=2)
    assert sorted(mid for mid, _ in ingest.acked) == [1, 2, 3, 4, 4, 5, 6, 7, 8]
