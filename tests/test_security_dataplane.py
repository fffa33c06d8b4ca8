"""Forged inbox envelopes (issue #20, item 3; docs/security.md, "Data channels").

The broker's ACL lets node identities write inboxes; the sender, epoch and numbers inside an
envelope are claims. These tests forge what a hostile node can write, and check that a receiver
refuses it before it touches any state, bounds what it keeps for senders it does not know yet,
and still delivers every real record exactly once:

- unit tests of the acceptance rule (`agent.dataplane.inbound`) and of the worker's use of it,
  in process on an in-memory wire;
- real workers on a real Mosquitto, the forgeries published with a paho client.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Set

import pytest
from memory_wire import MemoryWire

from agent import topics
from agent.dataplane.inbound import (
    MAX_CLOCK_AHEAD,
    MAX_EPOCH_STEP,
    MAX_SEQ,
    RESYNC_AHEAD,
    HoldBuffer,
    LogLimiter,
    numbering_fault,
    seq_ahead,
)
from agent.dataplane.envelope import Envelope, Kind, decode, encode, encode_data
from agent.dataplane.flow import OutLink
from agent.mqtt.transport import Received

WALL = 1_795_000_000.0  # a wall clock (seconds) for the pure tests


# ---- the acceptance rule -------------------------------------------------------------------------


def test_an_epoch_far_ahead_of_the_known_one_and_of_the_wall_clock_is_refused() -> None:
    pos = (3, 10, False)  # epoch 3, next seq 10
    assert numbering_fault(pos, False, 3, 10, WALL, 8) is None
    assert numbering_fault(pos, False, 4, 1, WALL, 8) is None  # a restart: +1, numbering from 1
    assert numbering_fault(pos, False, 3 + MAX_EPOCH_STEP, 1, WALL, 8) is None  # many restarts
    assert numbering_fault(pos, False, 2, 99, WALL, 8) is None  # older: the channel drops it, unchanged
    assert numbering_fault(pos, False, 2 ** 53, 1, WALL, 8) == "epoch"  # the hostile test's epoch
    assert numbering_fault(pos, False, 4 + MAX_EPOCH_STEP, 1, 0.0, 8) == "epoch"  # a clock at 0
    # re-homed or handed over without state: min_epoch = the re-homing agent's wall clock
    assert numbering_fault(pos, False, int(WALL), 1, WALL, 8) is None
    assert numbering_fault(pos, False, int(WALL + MAX_CLOCK_AHEAD), 1, WALL, 8) is None
    assert numbering_fault(pos, False, int(WALL + MAX_CLOCK_AHEAD) + 1, 1, WALL, 8) == "epoch"
    # a first envelope from a sender (no channel yet) is held to the same bound
    assert numbering_fault(None, False, 2 ** 53, 1, WALL, 8) == "epoch"
    assert numbering_fault(None, True, 2 ** 53, 1, WALL, 8) == "epoch"
    assert numbering_fault(None, False, 7, 1, WALL, 8) is None


def test_a_sequence_number_far_beyond_the_window_is_refused() -> None:
    ahead = seq_ahead(8)
    assert ahead >= 8 * 4  # a window of data, its acks and protocol messages, with margin
    pos = (0, 100, False)
    assert numbering_fault(pos, False, 0, 100, WALL, 8) is None
    assert numbering_fault(pos, False, 0, 100 + ahead, WALL, 8) is None  # reordered: waits for the gap
    assert numbering_fault(pos, False, 0, 101 + ahead, WALL, 8) == "seq"
    assert numbering_fault(pos, False, 0, 10 ** 9, WALL, 8) == "seq"
    assert numbering_fault(pos, False, 0, 5, WALL, 8) is None  # a duplicate: dropped by the channel
    assert numbering_fault(pos, False, 1, 2 + ahead, WALL, 8) == "seq"  # a new epoch numbers from 1
    assert numbering_fault(None, False, 0, 1 + ahead, WALL, 8) is None
    assert numbering_fault(None, False, 0, 2 + ahead, WALL, 8) == "seq"
    assert seq_ahead(64) > seq_ahead(8)
    # restarted from a snapshot that may lag: a wider bound, still a bound
    assert numbering_fault((0, 100, True), False, 0, 100 + RESYNC_AHEAD, WALL, 8) is None
    assert numbering_fault((0, 100, True), False, 0, 101 + RESYNC_AHEAD, WALL, 8) == "seq"
    # no position survived at all: any first number, below MAX_SEQ
    assert numbering_fault(None, True, 0, 10 ** 9, WALL, 8) is None
    assert numbering_fault(None, True, 0, MAX_SEQ + 1, WALL, 8) == "seq"
    assert numbering_fault(None, True, 0, 2 ** 53, WALL, 8) == "seq"


def test_an_ack_above_what_was_sent_is_not_plausible() -> None:
    link = OutLink("s", 4)
    assert not link.plausible_ack(1)
    for seq in (1, 2, 4):
        link.sent(seq, b"x", 1, 0.0)
    assert link.plausible_ack(4) and not link.plausible_ack(5)
    link.renumber({1: (9, b"x")}, 0.0)
    assert link.plausible_ack(9)
    link.restart_numbering()
    assert not link.plausible_ack(1)


def test_the_hold_buffer_is_bounded_by_senders_envelopes_and_bytes() -> None:
    h = HoldBuffer(max_senders=2, max_per_sender=3, max_bytes=100)
    assert h.add("a", "a1", 10, 0.0) and h.add("a", "a2", 10, 0.0) and h.add("a", "a3", 10, 0.0)
    assert not h.add("a", "a4", 10, 0.0)  # per sender
    assert h.add("b", "b1", 60, 1.0)
    assert not h.add("c", "c1", 1, 1.0)  # senders
    assert not h.add("b", "b2", 20, 1.0)  # bytes (90 + 20 > 100)
    assert h.count == 4 and h.size == 90 and h.senders() == ["a", "b"]
    assert h.first("a") == "a1"
    h.pop_first("a")
    assert h.first("a") == "a2" and h.count == 3 and h.size == 80
    assert h.expire(60.5, 60.0) == [("a", 2)]  # held since 0.0
    assert "a" not in h and "b" in h and h.count == 1 and h.size == 60
    assert h.expire(61.0, 60.0) == [("b", 1)] and not h and h.size == 0


def test_the_hold_buffer_orders_a_senders_stream_stably_and_keeps_its_bounds() -> None:
    h = HoldBuffer(max_senders=2, max_per_sender=8, max_bytes=100)
    for seq, tag in ((2, "a"), (3, "a"), (1, "a"), (2, "b"), (1, "b")):
        assert h.add("s", (seq, tag), 10, 0.0)
    h.order("s", lambda item: item[0])
    assert h.items("s") == [(1, "a"), (1, "b"), (2, "a"), (2, "b"), (3, "a")]  # equal keys: arrival order
    assert h.count == 5 and h.size == 50
    h.order("absent", lambda item: item)  # nothing held: nothing to do


def test_the_log_limiter_writes_once_per_sender_per_minute_and_a_bounded_number_in_all() -> None:
    lim = LogLimiter(period=60.0, burst=3, max_keys=4)
    assert lim.allow("a", 0.0) and not lim.allow("a", 59.0) and lim.allow("a", 60.0)
    assert lim.allow("b", 60.0) and lim.allow("c", 60.0)
    assert not lim.allow("d", 61.0)  # three lines in this minute already
    assert lim.take_suppressed() == 2 and lim.take_suppressed() == 0
    for i in range(1000):
        lim.allow(f"x{i}", 200.0 + i)
    assert len(lim._last) <= 4  # noqa: SLF001 - the key table stays bounded


# ---- the worker's use of it, on an in-memory wire -----------------------------------------------




def _worker(tmp_path: Path, operator: str, clock: List[float], **changes: Any):  # type: ignore[no-untyped-def]
    """One worker of source -> work -> sink (decentralized scaling core, policy none)."""
    from foglab.tools.dataplane_bench import initial_specs, pipeline_toml
    from agent.mqtt.settings import BrokerSpec
    from agent.instance.shell import Worker

    toml = pipeline_toml("p", [
        {"name": "source", "kind": "source", "function": "agent.operators.taxi:mqtt_source",
         "params": {"topic": "sensors/#"}, "batch_size": 4, "linger_ms": 0},
        {"name": "work", "function": "agent.operators.builtin:validate", "batch_size": 4, "linger_ms": 0},
        {"name": "sink", "kind": "sink", "function": "agent.operators.builtin:counting_sink"},
    ], scaling={"policy": "none"})
    spec = [s for s in initial_specs(toml, BrokerSpec("127.0.0.1", 1), str(tmp_path / "state"), cluster="c",
                                     extra={"sink_dir": str(tmp_path / "sink")}) if s.operator == operator][0]
    spec = dataclasses.replace(spec, **changes)
    wire = MemoryWire()
    w = Worker(spec, out=open(os.devnull, "w"), clock=lambda: clock[0], transport=wire)  # noqa: SIM115
    w.start()
    return w, wire


def _run(w, clock: List[float], seconds: float, step: float = 0.05) -> None:  # type: ignore[no-untyped-def]
    end = clock[0] + seconds
    while clock[0] < end:
        clock[0] += step
        w.step(clock[0])


def _records(first: int, n: int) -> list:
    from agent.operators.taxi import sample

    return [("source-0", first + i, r) for i, r in enumerate(sample(first + 1, n))]


def test_a_sink_refuses_forged_epochs_numbers_and_senders_and_keeps_recording_real_batches(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from agent.operators.builtin import read_sink_ids
    from agent.instance.admission import HOLD_TTL

    clock = [100.0]
    w, wire = _worker(tmp_path, "sink", clock)
    inbox = topics.inbox("c", "sink-0", "local")
    state = tmp_path / "state" / "sink-0.state.json"

    def deliver(payload: bytes) -> None:
        wire.events.append(Received(inbox, payload))

    deliver(encode_data("work-0", 2 ** 53, 1, _records(0, 4)))  # a real predecessor's name, epoch 2**53
    deliver(encode_data("work-0", 0, 10 ** 9, _records(0, 4)))  # far beyond the window
    deliver(encode_data("ghost-1", 0, 1, _records(0, 8)))  # an invented sender: the next ids
    deliver(encode_data("work-f00d", 0, 1, _records(0, 8)))  # invented, named like a predecessor's copy
    _run(w, clock, 1.0)
    assert w.core.stats["refused_epochs"] == 1 and w.core.stats["refused_seqs"] == 1
    assert w.core.stats["refused_senders"] == 1  # no operator's instance has that name: refused at once
    assert w.core.admission.hold.count == 1 and ("work-f00d", "local") in w.core.admission.hold  # might be announced yet: held, bounded
    assert w.core.operator.stats()["recorded"] == 0
    saved = json.loads(state.read_text())
    assert saved["inbound"] == {} and "9007199254740992" not in state.read_text()

    for seq in (1, 2):  # the real batches, ids 0..7
        deliver(encode_data("work-0", 0, seq, _records(4 * (seq - 1), 4)))
    _run(w, clock, 1.0)
    assert w.core.operator.stats()["recorded"] == 8 and w.core.operator.stats()["duplicates_dropped"] == 0
    assert w.core.stats["duplicate_envelopes"] == 0
    saved = json.loads(state.read_text())
    assert saved["inbound"] == {"work-0": [0, 3]}
    _run(w, clock, HOLD_TTL + 1.0, step=0.5)
    assert w.core.admission.hold.count == 0 and w.core.stats["refused_senders"] == 2  # never announced: refused
    assert w.core.operator.stats()["duplicates_dropped"] == 0 and w.core.operator.stats()["recorded"] == 8
    w.core.operator.close()
    ids, dup = read_sink_ids(tmp_path / "sink")
    assert ids == {"source-0": set(range(8))} and dup == 0


def test_thirty_thousand_acks_from_invented_senders_leave_no_trace(tmp_path) -> None:  # type: ignore[no-untyped-def]
    clock = [100.0]
    w, wire = _worker(tmp_path, "work", clock)
    inbox = topics.inbox("c", "work-0", "local")
    state = tmp_path / "state" / "work-0.state.json"
    wire.events.append(Received(inbox, encode_data("source-0", 0, 1, _records(0, 4))))
    _run(w, clock, 0.5)
    size = len(state.read_text())
    for i in range(30_000):
        wire.events.append(Received(inbox, encode(Envelope(f"ghost-{i}", 0, 1, Kind.ACK, [0, i]))))
    # invented names shaped like our copies' ("work-<digest>"): at most MAX_PROBES probed
    for i in range(100):
        wire.events.append(Received(inbox, encode(Envelope(f"work-{i:012x}", 0, 1, Kind.ACK, [0, 0]))))
    _run(w, clock, 1.0)
    from agent.instance.driver import MAX_PROBES, PROBE_TTL

    assert w.core.stats["refused_senders"] == 30_000 + 100 - MAX_PROBES
    assert w.core.inbound.senders() <= 1 + MAX_PROBES and len(w.core.queues) <= 1 + MAX_PROBES
    assert w.core.admission.refusals.suppressed + 20 >= w.core.stats["refused_senders"] - 1  # noqa: SLF001 - few log lines
    _run(w, clock, PROBE_TTL + 2.0, step=0.5)
    assert w.core.inbound.senders() == 1 and set(w.core.queues) <= {"source-0"}  # unanswered probes forgotten
    assert len(w.core.outputs.outbound._next) <= 2  # noqa: SLF001 - sink-0, source-0
    assert len(state.read_text()) <= size + 50, state.read_text()
    assert "ghost" not in state.read_text() and "work-0000" not in state.read_text()


def test_a_forged_ack_beyond_what_was_sent_cannot_release_the_replay_buffer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    clock = [100.0]
    w, wire = _worker(tmp_path, "work", clock)
    inbox = topics.inbox("c", "work-0", "local")
    wire.events.append(Received(inbox, encode_data("source-0", 0, 1, _records(0, 4))))
    _run(w, clock, 0.5)
    link = w.core.outputs.links["sink-0"]
    assert link.inflight == 1
    wire.events.append(Received(inbox, encode(Envelope("sink-0", 0, 1, Kind.ACK, [w.core.epoch, 10 ** 6]))))
    _run(w, clock, 0.2)
    assert w.core.stats["refused_seqs"] == 1 and link.inflight == 1 and link.acked_upto == 0
    wire.events.append(Received(inbox, encode(Envelope("sink-0", 0, 1, Kind.ACK, [w.core.epoch, link.highest_sent]))))
    _run(w, clock, 0.2)
    assert link.inflight == 0  # the real ack (the refused one did not take its number) still works


def test_an_idle_copy_holds_its_predecessors_batches_until_its_start_then_processes_them(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A new copy learns its predecessors with its Start, but they route to it as soon as they
    acked its creator's Duplication: their batches wait in the hold, not in the channel tables,
    and are processed once the Start names them. A sender the Start does not name stays held;
    a name no predecessor can have is refused at once."""
    from agent.protocol.messages import Start

    clock = [100.0]
    w, wire = _worker(tmp_path, "work", clock, instance="work-x", keeper=False, active=False, succs=(), preds=(),
                      extra={"sink_dir": str(tmp_path / "sink"), "creator": "work-0"})
    inbox = topics.inbox("c", "work-x", "local")
    for seq in (1, 2):
        wire.events.append(Received(inbox, encode_data("source-0", 0, seq, _records(4 * (seq - 1), 4))))
    wire.events.append(Received(inbox, encode_data("ghost-2", 0, 1, _records(0, 4))))
    wire.events.append(Received(inbox, encode_data("source-zz", 0, 1, _records(0, 4))))
    _run(w, clock, 0.5)
    assert w.core.admission.hold.count == 3 and w.core.inbound.senders() == 0 and w.core.stats["records_in"] == 0
    assert w.core.stats["refused_senders"] == 1  # ghost-2: no neighbour's instance has that name
    start = Start("work-0", 1, ("sink-0",), ("source-0",))
    wire.events.append(Received(inbox, encode(Envelope("work-0", 0, 1, Kind.PROTO, start.to_dict()))))
    _run(w, clock, 0.5)
    assert w.core.scaling.core.is_active
    assert w.core.stats["records_in"] == 8 and w.core.admission.hold.count == 1 and ("source-zz", "local") in w.core.admission.hold
    assert w.core.stats["held_released"] == 2
    out = [decode(p) for t, p in wire.sent if t == topics.inbox("c", "sink-0", "local")]
    assert sum(len(e.body) for e in out if e.kind is Kind.DATA) == 8
    assert w.core.inbound.senders() == 2  # work-0 (its Start) and source-0


def test_data_claimed_by_a_known_sender_that_is_no_predecessor_is_never_processed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The successor's name is known (it acks us), but a data batch under that name is not one
    a real successor can send (nor one a predecessor's instance can be named): refused at once;
    its records never reach the operator."""
    from agent.instance.admission import HOLD_TTL

    clock = [100.0]
    w, wire = _worker(tmp_path, "work", clock)
    inbox = topics.inbox("c", "work-0", "local")
    wire.events.append(Received(inbox, encode_data("source-0", 0, 1, _records(0, 4))))
    _run(w, clock, 0.5)
    wire.events.append(Received(inbox, encode(Envelope("sink-0", 0, 1, Kind.ACK, [w.core.epoch, 1]))))
    wire.events.append(Received(inbox, encode_data("sink-0", 0, 2, _records(100, 4))))
    _run(w, clock, 0.5)
    assert w.core.outputs.links["sink-0"].inflight == 0  # its ack is fine
    assert w.core.stats["records_in"] == 4 and w.core.admission.hold.count == 0 and w.core.stats["refused_senders"] == 1
    _run(w, clock, HOLD_TTL + 1.0, step=0.5)
    assert w.core.stats["records_in"] == 4 and w.core.stats["refused_senders"] == 1


def test_a_departed_neighbours_resent_deletion_is_still_answered(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Recovery mechanism 2 (agent.instance.recovery): a predecessor that left resends its Deletion
    when our ack got lost. It is in no table any more, but our channel with it and our round
    memory know it: the resend is admitted and acked again, not held or refused."""
    from agent.protocol.messages import Deletion

    clock = [100.0]
    w, wire = _worker(tmp_path, "work", clock)
    inbox, to_source = topics.inbox("c", "work-0", "local"), topics.inbox("c", "source-0", "local")
    deletion = Deletion("source-0", 0, 1).to_dict()
    wire.events.append(Received(inbox, encode(Envelope("source-0", 0, 1, Kind.PROTO, deletion))))
    _run(w, clock, 0.5)
    assert "source-0" not in w.core.scaling.core.preds
    wire.events.append(Received(inbox, encode(Envelope("source-0", 0, 2, Kind.PROTO, deletion))))
    _run(w, clock, 0.5)
    acks = [decode(p).body for t, p in wire.sent if t == to_source and decode(p).kind is Kind.PROTO]
    assert [a["type"] for a in acks] == ["deletion_ack", "deletion_ack"], acks
    assert w.core.admission.hold.count == 0 and w.core.stats["refused_senders"] == 0


def test_an_idle_copy_keeps_a_neighbours_duplication_for_its_start_and_acks_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A neighbour of the creator may announce its own copy to ours before our Start (it learned
    of us from the creator's Duplication, or sends its round again after a loss): taken at once
    as Algorithm 5 takes it in an idle instance (kept for the Start) and acked, so that
    neighbour's round completes. Held until our Start instead (as it once was), two such rounds
    could wait for each other's idle copies for ever (docs/reliability.md, "Checking whole
    instances"); the Start then routes to the announced copy too."""
    from agent.protocol.messages import Duplication, Start

    clock = [100.0]
    w, wire = _worker(tmp_path, "work", clock, instance="work-x", keeper=False, active=False, succs=(), preds=(),
                      extra={"sink_dir": str(tmp_path / "sink"), "creator": "work-0"})
    inbox, to_sink = topics.inbox("c", "work-x", "local"), topics.inbox("c", "sink-0", "local")
    dup = Duplication("sink-0", 2, 1, ("sink-z",)).to_dict()
    wire.events.append(Received(inbox, encode(Envelope("sink-0", 0, 1, Kind.PROTO, dup))))
    _run(w, clock, 0.5)
    acks = [decode(p).body for t, p in wire.sent if t == to_sink and decode(p).kind is Kind.PROTO]
    assert w.core.admission.hold.count == 0 and [(a["type"], a["round"]) for a in acks] == [("duplication_ack", 1)], acks
    assert w.core.router.succs == () and w.core.scaling.core.succs_to_add == {"sink-z"}  # idle: no route yet
    start = Start("work-0", 1, ("sink-0",), ("source-0",))
    wire.events.append(Received(inbox, encode(Envelope("work-0", 0, 1, Kind.PROTO, start.to_dict()))))
    _run(w, clock, 0.5)
    assert w.core.admission.hold.count == 0 and w.core.router.succs == ("sink-0", "sink-z")
    acks = [decode(p).body for t, p in wire.sent if t == to_sink and decode(p).kind is Kind.PROTO]
    assert [(a["type"], a["round"]) for a in acks] == [("duplication_ack", 1)], acks  # once


# ---- real workers on a real broker ------------------------------------------------------------------


def _expected_ids(seed: int, instance: str, n: int) -> Set[int]:
    from agent.operators.builtin import in_zone, validate
    from agent.operators.taxi import TaxiGenerator

    gen = TaxiGenerator(seed, instance)
    out = set()
    for i in range(n):
        rec = validate(gen.record(), {})
        if rec is not None:
            rec = in_zone(rec, {})
        if rec is not None:
            out.add(i)
    return out


def _wait(pred, timeout: float, what) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what() if callable(what) else what}")


@pytest.mark.broker
@pytest.mark.timeout(120)
def test_forged_inbox_messages_on_a_real_broker_stall_nothing_and_leave_no_state(mosquitto, tmp_path: Path) -> None:
    """The hostile test of issue #20 against real workers: before the source starts, a hostile
    client writes to the sink's inbox a batch from its real predecessor with epoch 2**53, one
    numbered far beyond the window, a batch from an invented sender carrying the source's next
    record ids (real and filtered ones), and 30k acks from invented senders; and to in_zone's
    inbox an ack from the sink far above anything sent. Every real record must still reach the
    sink exactly once; nothing forged may reach a state file."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    from foglab.tools.dataplane_bench import LocalRunner, initial_specs, pipeline_toml
    from agent_process import ONLINE_BOUND
    from agent.operators.builtin import read_sink_ids
    from agent.mqtt.settings import BrokerSpec

    n, cluster = 3000, "forged"
    toml = pipeline_toml("taxi", [
        {"name": "source", "kind": "source", "function": "agent.operators.taxi:source", "batch_size": 50,
         "params": {"seed": 3, "profile": "constant", "rate": 1500.0, "max_records": n}},
        {"name": "validate", "function": "agent.operators.builtin:validate", "batch_size": 50},
        {"name": "in_zone", "function": "agent.operators.builtin:in_zone", "batch_size": 50},
        {"name": "sink", "kind": "sink", "function": "agent.operators.builtin:counting_sink", "batch_size": 50},
    ], scaling={"policy": "none"})
    specs = initial_specs(toml, BrokerSpec(mosquitto.host, mosquitto.port), str(tmp_path / "state"),
                          cluster=cluster, extra={"sink_dir": str(tmp_path / "sink"), "seed": 11})
    runner = LocalRunner(tmp_path, ready_timeout=ONLINE_BOUND)
    try:
        procs: Dict[str, Any] = {}
        for s in reversed(specs[1:]):  # sink, in_zone, validate: the source only after the forgeries
            procs[s.operator] = runner.start(s)

        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="hostile-node")
        c.connect(mosquitto.host, mosquitto.port)
        c.loop_start()
        to_sink = topics.inbox_at(cluster, "local", "sink-0", "local")  # LocalRunner: per-node inboxes
        want = _expected_ids(3, "source-0", n)
        ids = list(range(100))  # the source's next 100 record ids, kept and filtered ones
        assert set(ids) - want and set(ids) & want
        fake = [("source-0", i, None) for i in ids]
        forged = [
            encode_data("in_zone-0", 2 ** 53, 1, fake),
            encode_data("in_zone-0", 0, 10 ** 9, fake),
            encode_data("intruder-7", 0, 1, fake),  # refused at once
            encode_data("in_zone-f00d", 0, 1, fake),  # named like a copy of the predecessor: held
        ]
        for p in forged:
            c.publish(to_sink, p, qos=1).wait_for_publish(5)
        c.publish(topics.inbox_at(cluster, "local", "in_zone-0", "local"), encode(Envelope("sink-0", 0, 1, Kind.ACK, [0, 10 ** 6])),
                  qos=1).wait_for_publish(5)
        _wait(lambda: procs["sink"].stats.get("refused_seqs") == 1 and procs["sink"].stats.get("held") == 1
              and procs["in_zone"].stats.get("refused_seqs") == 1, 10, "the forgeries to be refused or held")
        sent = 0
        for chunk in range(15):  # 30k acks from invented senders, in chunks the broker queue takes
            for i in range(2000):
                info = c.publish(to_sink, encode(Envelope(f"ghost-{sent}", 0, 1, Kind.ACK, [0, sent])), qos=1)
                sent += 1
            info.wait_for_publish(10)
            _wait(lambda: procs["sink"].stats.get("refused_senders", 0) >= sent + 1, 20,
                  lambda: f"the acks to be refused ({sent}): {procs['sink'].stats}")
        c.loop_stop()
        c.disconnect()

        sink = procs["sink"].stats
        assert sink["refused_epochs"] == 1 and sink["refused_seqs"] == 1 and sink["refused_senders"] == 30_001
        assert sink["inbound_senders"] == 0 and sink.get("recorded") == 0
        state = tmp_path / "state" / "sink-0.state.json"
        assert len(state.read_bytes()) < 1000, state.read_text()

        procs["source"] = runner.start(specs[0])
        _wait(lambda: procs["source"].stats.get("generated") == n, 30, "the source to finish")
        _wait(lambda: procs["sink"].stats.get("recorded") == len(want), 30, "the sink to record every real record")
        time.sleep(0.6)  # one more heartbeat and state write
        sink = procs["sink"].stats
        assert sink["duplicates_dropped"] == 0, "a real record was dropped as a duplicate of a forged one"
        assert sink["inbound_senders"] == 1 and sink["held"] == 1  # in_zone-0; in_zone-f00d still held (HOLD_TTL)
        text = state.read_text()
        assert json.loads(text)["inbound"].keys() == {"in_zone-0"}
        assert "9007199254740992" not in text and "ghost" not in text and "intruder" not in text, text
        assert "f00d" not in text, text
        assert len(text) < 1000, text
        assert json.loads(text)["inbound"]["in_zone-0"][0] == 0  # the real epoch, not 2**53
        codes = runner.stop_all()
        assert set(codes.values()) == {0}, codes
    finally:
        runner.stop_all(timeout=10)
    got, dup = read_sink_ids(tmp_path / "sink")
    assert dup == 0 and got.get("source-0", set()) == want, (len(got.get("source-0", ())), len(want))
