"""Watermarks that flow with the records (agent.dataplane.watermarks) and their field on the batch
envelope. Sans-IO: a model of sources -> two copies of a stateless stage -> two keyed instances,
with crashes of the middle stage (its channels start over), crashes of the keyed instances and
key groups that move, checks that no record on time at its source is judged late."""

from __future__ import annotations

import json
import random
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Set, Tuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.dataplane.envelope import MalformedEnvelope, Passed, data_body_bytes, decode, encode, encode_data, built, Kind
from agent.dataplane.watermarks import MAX_MARK_MS, Mark, SourceMarks, WatermarkTable, mark_json, parse_mark


# ---- the source's marks ---------------------------------------------------------------------------

def test_source_mark_is_max_event_time_minus_disorder() -> None:
    s = SourceMarks(disorder_ms=50)
    s.start(0.0)
    assert s.mark(0.0) is None  # nothing emitted: receivers wait
    assert s.observe(1000, 1.0)
    assert s.mark(1.0) == Mark(950)
    assert s.observe(960, 1.1)  # out of order but within the disorder
    assert s.mark(1.1) == Mark(950)
    assert not s.observe(940, 1.2)  # older than the mark: late at the source
    assert s.late == 1
    assert s.observe(1200, 1.3) and s.mark(1.3) == Mark(1150)


def test_source_goes_idle_and_comes_back() -> None:
    s = SourceMarks(disorder_ms=300, idle_after=5.0)
    s.start(100.0)
    assert s.mark(104.9) is None
    assert s.mark(105.0) == Mark(-MAX_MARK_MS, True)  # silent since start: holds nothing back
    s.observe(7000, 106.0)
    assert s.mark(110.9) == Mark(6700)
    assert s.mark(111.0) == Mark(7000, True)  # idle: its stragglers had their time
    s.observe(8000, 112.0)
    assert s.mark(112.0) == Mark(7700)
    assert SourceMarks(0).mark(1e9) is None  # no idle_after: never idle


def test_by_channel_the_mark_is_the_least_channel_and_a_silent_channel_goes_idle() -> None:
    s = SourceMarks(disorder_ms=100, idle_after=5.0, by_channel=True)
    s.start(0.0)
    assert s.observe(1000, 1.0, "a") and s.observe(3000, 1.1, "b")
    assert s.mark(1.1) == Mark(900)  # the least channel, less the disorder
    assert s.observe(2950, 1.2, "b")  # within b's disorder
    assert not s.observe(2800, 1.3, "b") and s.late == 1  # late at its channel
    assert not s.observe(500, 1.25, "c")  # a new channel behind the mark of the others: late
    assert s.mark(1.3) == Mark(900)  # ... and it starts at that mark, not at its late record
    for k in range(1, 5):  # b goes on, a and c are silent
        s.observe(3000 + k * 100, 1.3 + k, "b")
    assert s.mark(6.0) == Mark(900)
    assert s.mark(6.3) == Mark(3300)  # a and c silent 5 s while b gave records: idle
    assert s.observe(1100, 6.5, "a") and s.mark(6.5) == Mark(1000)  # back: it holds the mark again


def test_by_channel_a_whole_source_silence_restarts_every_channels_idleness_clock() -> None:
    """The source's input away (a partition): no channel gave a record, none is idle for it; only
    a channel silent for `idle_after` after the source received again is."""
    s = SourceMarks(idle_after=5.0, by_channel=True)
    s.start(0.0)
    s.observe(1000, 1.0, "a")
    s.observe(1000, 1.0, "b")
    s.observe(30000, 23.0, "b")  # 22 s away, then b first
    assert s.mark(23.0) == Mark(1000)  # a is waited for
    s.observe(30500, 25.0, "b")
    assert s.mark(27.9) == Mark(1000)
    s.observe(31000, 28.1, "b")
    assert s.mark(28.1) == Mark(31000)  # a silent 5 s since the source came back: idle


def _overtaken_backlog(by_channel: bool) -> Dict[str, int]:
    """A broker that sends one reading ahead of its backlog (docs/results.md, R23; CHANGELOG.md,
    "One reading ahead of a broker's backlog made the backlog late"): 10 sensors round robin, a
    reading every 20 ms of event time; the source's ingest connection is cut for 22 s; on the
    reconnect the broker sends first what was in flight, then ONE reading published after the
    reconnect (17.6 s of event time ahead), then the 878 readings it queued meanwhile. Through the
    source's marks (agent.instance.marks, `[operator.watermark]` on field "t", ms; by sensor or
    not) into a keyed 5 s tumbling window with lateness 10 s that follows the flowing marks:
    the window's counters and the readings it counted."""
    from types import SimpleNamespace

    from agent.config import WatermarkSection
    from agent.instance.keyed_state import KeyedState
    from agent.instance.marks import Marks
    from agent.operators.builtin import OperatorContext
    from agent.operators.keyed import TumblingWindow

    def reading(rid: int) -> Dict[str, Any]:
        return {"sensor": f"s{(rid - 1) % 10 + 1}", "t": 20 * rid, "rid": rid}

    before, ahead, last = 500, 1379, 1500
    arrivals: List[Tuple[float, int]] = [(20 * rid / 1000.0, rid) for rid in range(1, before + 1)]
    back = 20 * before / 1000.0 + 22.0
    order = [ahead] + list(range(before + 1, ahead)) + list(range(ahead + 1, last + 1))
    arrivals += [(back + k * 0.002, rid) for k, rid in enumerate(order)]
    conf = WatermarkSection(time_field="t", time_unit="ms", channel_field="sensor" if by_channel else None)
    stats = {"late_at_source": 0}
    marks = Marks(conf, True, None, SimpleNamespace(last_index=0), SimpleNamespace(), stats)
    op = TumblingWindow(OperatorContext("p.windows.0", "windows", "n1", "map",
                                        {"time_field": "t", "time_unit": "ms", "size_ms": 5000,
                                         "lateness_ms": 10000, "agg": "sum", "field": "rid"}))
    win = KeyedState(op, "windows", "sensor", 128)
    win.flowing = True
    counted = 0
    for index, k in enumerate(range(0, len(arrivals), 31), start=1):  # the source's polls
        batch = arrivals[k:k + 31]
        now = batch[-1][0]
        items = [("p.source.0", rid, reading(rid)) for _, rid in batch]
        marks.observe(items, index, now)
        out = win.apply("p.source.0", items, index)  # judged against the mark before this batch
        mark = marks.table.inputs[""].noted
        if mark is not None and (win.max_time is None or mark > win.max_time):
            win.max_time = mark
            out += win.fire_due(index)
        counted += sum(rec["count"] for _, _, rec in out)
    counted += sum(acc[0] for g in win.states.values() for wins in g.values() for acc in wins.values())
    return {"late_dropped": win.counts["late_dropped"], "counted": counted, "published": last,
            "late_at_source": stats["late_at_source"]}


def test_a_reading_that_overtakes_the_brokers_backlog_does_not_make_the_backlog_late() -> None:
    """By sensor (`channel_field`), the reading ahead moves only its own sensor's time: the mark
    stays at the least sensor, and the window counts every reading. One channel for all the
    source's readings (the rule before channels) puts the mark 17.6 s ahead and the window drops
    the backlog as late, as in the run."""
    got = _overtaken_backlog(by_channel=True)
    assert got["late_dropped"] == 0 and got["counted"] == got["published"]
    assert got["late_at_source"] == 87  # s9's own queued readings (509-1369): late at their channel only
    old = _overtaken_backlog(by_channel=False)
    # readings 501-878 (378, as in the run) are older than its mark less the lateness; the 26
    # polled with it are judged before the mark of their batch: 352 dropped
    assert old["late_dropped"] == 352 and old["counted"] == old["published"] - 352


def test_by_channel_the_channels_are_bounded_idle_ones_forgotten_first() -> None:
    """Channel values come from the bus: a publisher naming a new sensor per reading must not grow
    the source without bound. At `max_channels`, an idle channel makes room; without one, the
    record is judged against the others' mark and holds nothing back."""
    s = SourceMarks(disorder_ms=100, idle_after=5.0, by_channel=True, max_channels=3)
    s.start(0.0)
    for i, ch in enumerate("abc"):
        assert s.observe(1000 + 100 * i, 1.0, ch)
    assert s.observe(9000, 1.5, "d") and s.untracked == 1  # no room, none idle: on time, not kept
    assert not s.observe(500, 1.6, "e") and s.untracked == 2 and s.late == 1  # behind the others' mark
    assert set(s.channels) == {"a", "b", "c"} and s.mark(1.6) == Mark(900)  # d holds nothing back
    for k in range(8):  # a and b go on; c is silent and goes idle
        s.observe(2000 + k, 2.0 + k, "a")
        s.observe(2100 + k, 2.0 + k, "b")
    assert s.observe(9000, 9.5, "d") and set(s.channels) == {"a", "b", "d"}  # c forgotten for d
    assert s.untracked == 2 and s.mark(9.5) == Mark(2007 - 100)
    for n in range(10000):  # a new channel per record
        s.observe(3000 + n, 10.0 + n / 1000, f"x{n}")
    assert len(s.channels) == 3


def test_a_restarted_source_waits_for_the_channels_its_predecessor_had() -> None:
    """The previous incarnation's channels (its position file) come back: a sensor whose readings
    are still queued holds the mark from the start. Without them the first reading of another
    sensor sets the mark, and the queued readings are late."""
    old = SourceMarks(disorder_ms=100, by_channel=True)
    old.start(0.0)
    old.observe(1000, 1.0, "slow")
    old.observe(5000, 1.0, "fast")
    table = json.loads(json.dumps(old.channel_table()))  # through the file
    assert table == [["slow", 1000], ["fast", 5000]]
    for restored in (True, False):
        new = SourceMarks(disorder_ms=100, by_channel=True)
        new.start(10.0)
        if restored:
            new.restore(table + [["bad"], ["nan", float("nan")], "x"], 10.0)
            assert set(new.channels) == {"slow", "fast"}  # the damaged entries skipped
        new.observe(6000, 10.1, "fast")
        assert new.mark(10.1) == (Mark(900) if restored else Mark(5900))
        assert new.observe(1100, 10.2, "slow") is restored
    limited = SourceMarks(by_channel=True)
    limited.restore([[f"s{i}", 1000 - i] for i in range(10)], 0.0)
    assert limited.channel_table(limit=3) == [["s9", 991], ["s8", 992], ["s7", 993]]  # the most behind


def test_a_source_instance_saves_its_channels_in_its_position() -> None:
    """The position file a sensor source writes (and a move carries) holds its channels; a
    restarted instance given that position judges by them (channel names through JSON: a list
    key comes back as the same dict key)."""
    from types import SimpleNamespace

    from agent.config import WatermarkSection
    from agent.instance.keyed_state import hashable_key
    from agent.instance.marks import Marks

    source = _SourceRun(_timed_pipeline('\nchannel_field = "k"'), heartbeat_period=1.0)
    source.tick_until(5.0)
    assert source.positions[-1]["channels"] == [["k1", 1], ["k0", 2]]
    conf = WatermarkSection(time_field="t", channel_field="k")
    marks = Marks(conf, True, None, SimpleNamespace(last_index=0), SimpleNamespace(), {})
    marks.restore_channels([[["room", 7], 500]], 0.0)
    assert list(marks.source.channels) == [hashable_key(["room", 7])]


@pytest.mark.parametrize("bad", [{"disorder_ms": -1}, {"disorder_ms": float("inf")}, {"idle_after": 0},
                                 {"max_channels": 0}])
def test_source_marks_refuse_bad_settings(bad: Dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SourceMarks(**bad)


# ---- the table ------------------------------------------------------------------------------------

def test_min_over_live_inputs_unknown_holds_idle_excluded() -> None:
    t = WatermarkTable(["a", "b"])
    assert t.current() is None
    t.note("a", 1, Mark(100))
    assert t.current() is None  # b never sent a mark: it holds the instance back
    t.note("b", 2, Mark(70))
    assert t.current() == Mark(70)
    t.note("b", 3, Mark(500, True))  # b idle: left out
    assert t.current() == Mark(100)
    t.note("a", 4, Mark(50, True))  # every input idle: idle, at the largest mark held
    assert t.current() == Mark(500, True)
    t.note("b", 5, Mark(600))
    assert t.current() == Mark(600)


def test_a_restarted_input_cannot_lower_its_channel() -> None:
    t = WatermarkTable(["a"])
    t.note("a", 1, Mark(1000))
    t.note("a", 2, Mark(10))  # its new incarnation starts over
    assert t.current() == Mark(1000)


def test_forwardable_covers_only_acked_inputs() -> None:
    t = WatermarkTable(["a", "b"])
    t.note("a", 1, Mark(100))
    t.note("b", 2, Mark(200))
    t.note("a", 3, Mark(300))
    assert t.current() == Mark(200) and t.forwardable() is None
    t.release(2)  # input 1 acked upstream
    assert t.forwardable() is None  # b: nothing released yet
    t.release(3)
    assert t.forwardable() == Mark(100)
    t.release(None)
    assert t.forwardable() == Mark(200)


def test_a_leaving_input_holds_forwardable_until_released() -> None:
    t = WatermarkTable(["a", "b"])
    t.note("a", 1, Mark(100))
    t.note("b", 2, Mark(900))
    t.release(2)
    t.note("a", 3, Mark(150))
    t.remove_input("a")
    assert t.current() == Mark(900)  # it sends nothing more: out of the judge's minimum
    t.release(3)
    assert t.forwardable() == Mark(100)  # its input 3 may still be replayed
    t.release(None)
    assert t.forwardable() == Mark(900) and "a" not in t.inputs
    t.add_input("c")
    assert t.current() is None and t.forwardable() is None


def test_saved_marks_come_back_and_bad_entries_are_skipped() -> None:
    t = WatermarkTable(["a", "b"])
    t.note("a", 1, Mark(100))
    t.note("b", 2, Mark(200, True))
    saved = json.loads(json.dumps(t.to_json()))
    u = WatermarkTable(["a", "b"])
    u.restore({**saved, "x": "junk", "y": [float("nan"), 0]})
    assert u.current() == Mark(100) and u.forwardable() is None
    assert set(u.inputs) == {"a", "b"}


def test_pending_marks_stay_bounded() -> None:
    from agent.dataplane import watermarks
    t = WatermarkTable(["a"])
    for i in range(watermarks.PENDING_MAX + 50):
        t.note("a", i, Mark(i))
    assert len(t.inputs["a"].pending) <= watermarks.PENDING_MAX
    t.release(watermarks.PENDING_MAX + 50)
    assert t.forwardable() == Mark(watermarks.PENDING_MAX + 49)


# ---- the wire -------------------------------------------------------------------------------------

def test_marks_round_trip_on_data_envelopes() -> None:
    items = [("s", 1, {"x": 1}), ("s", 2, {"x": 2})]
    for floors in (None, {"s": 1}):
        for mark in (Mark(1356998400000.0), Mark(-5.5, True)):
            env = decode(encode_data("a", 0, 3, items, floors, mark))
            assert env.watermark == mark and env.floors == floors and env.records == items
            body = data_body_bytes(env)
            assert body is not None  # the body is found again: a passed-on batch keeps its bytes
            again = decode(encode_data("b", 1, 4, Passed(env.records, body), floors, mark))
            assert again.records == items and again.watermark == mark and again.floors == floors
            assert decode(encode(built("a", 0, 3, Kind.DATA, items, floors, mark))) == env
    plain = decode(encode_data("a", 0, 3, items, {"s": 1}))
    assert plain.watermark is None and plain.floors == {"s": 1}
    assert decode(encode_data("a", 0, 5, [], None, Mark(7))).watermark == Mark(7)  # a mark alone


@pytest.mark.parametrize("mark", [
    "[1e400, 0]", "[NaN, 0]", "[Infinity, 1]", "[1, 2]", "[1, true]", "[true, 0]", "[\"1\", 0]", "[1]",
    "[1, 0, 0]", "null", "{}", "9007199254740993", "[9007199254740994, 0]", "[[1], 0]",
])
def test_malformed_marks_are_refused(mark: str) -> None:
    raw = '[1,"a",0,1,"d",[["s",1,{}]],{},' + mark + ']'
    with pytest.raises(MalformedEnvelope, match="watermark"):
        decode(raw.encode())


def test_parse_mark_reads_what_mark_json_writes() -> None:
    for m in (Mark(0), Mark(-MAX_MARK_MS, True), Mark(MAX_MARK_MS), Mark(12.25)):
        assert parse_mark(json.loads(json.dumps(mark_json(m)))) == m


# ---- the model: sources -> M0, M1 (stateless) -> D0, D1 (keyed, judging lateness) ----------------

Rec = Tuple[Tuple[str, int], str, float]  # (id, key, event time)


class Model:
    """Sources emit batches (their records routed to one of the two M copies, their mark to both);
    each M passes records on to the D that owns their key, with its mark after them; a D judges
    each record it takes first against its table's minimum, then notes the batch's mark. Acks:
    a D acks a batch once processed (its state saved with it), an M acks an input once every
    output of it and of every earlier input was acked; what is not acked is replayed after a
    crash, in order. `unsafe`: M passes on what it received (`current`), not what it acked."""

    def __init__(self, sources: List[List[List[Tuple[str, float, int]]]], disorder: float, unsafe: bool) -> None:
        self.unsafe = unsafe
        self.src_names = [f"S{i}" for i in range(len(sources))]
        self.ms, self.ds = ["M0", "M1"], ["D0", "D1"]
        self.on_time: Dict[Tuple[str, int], bool] = {}
        # source batches: name -> list of (batch number, {M: records}, mark)
        self.src_batches: Dict[str, List[Tuple[int, Dict[str, List[Rec]], Mark]]] = {}
        self.final_marks: List[float] = []
        for name, batches in zip(self.src_names, sources):
            sm, n, out = SourceMarks(disorder), 0, []
            for b, batch in enumerate(batches):
                per: Dict[str, List[Rec]] = {m: [] for m in self.ms}
                for key, t, m in batch:
                    n += 1
                    rid = (name, n)
                    self.on_time[rid] = sm.observe(t, 0.0)
                    per[self.ms[m]].append((rid, key, t))
                mark = sm.mark(0.0)
                if mark is not None:
                    out.append((b, per, mark))
                elif any(per.values()):
                    out.append((b, per, Mark(-MAX_MARK_MS)))  # unreachable: a batch has a record
            self.src_batches[name] = out
            if out:
                self.final_marks.append(out[-1][2].value)
        self.emitted: Dict[str, int] = {s: 0 for s in self.src_names}
        # (source, M) -> batch numbers M has not acked yet (the source's replay buffer)
        self.src_unacked: Dict[Tuple[str, str], List[int]] = {(s, m): [] for s in self.src_names for m in self.ms}
        self.inbox: Dict[Tuple[str, str], Deque[Any]] = {}  # (sender, receiver) -> delivered, unprocessed
        self.routing = {"a": "D0", "b": "D1", "c": "D0"}
        self.sticky: Dict[Tuple[str, int], str] = {}  # id -> the D it went to (written ahead, survives crashes)
        self._epochs = 0
        self.m_state = {m: self._fresh_m() for m in self.ms}
        self.d_table = {d: WatermarkTable(self.ms) for d in self.ds}
        self.d_applied: Dict[str, Set[Tuple[str, int]]] = {d: set() for d in self.ds}
        self.judged: Dict[Tuple[str, int], bool] = {}  # id -> judged late
        self.twice: List[Tuple[str, int]] = []

    def _fresh_m(self) -> Dict[str, Any]:
        return {"table": WatermarkTable(self.src_names), "next": 0, "inputs": {},  # index -> (src, batch)
                "open": {},  # index -> outputs not acked by a D yet
                "outbox": {d: [] for d in self.ds},  # d -> [(index, rec)]
                "unacked": {d: deque() for d in self.ds},  # d -> [(batch id, indices, batch)]
                "sent_mark": {d: None for d in self.ds}, "batch_id": 0, "epoch": self._epochs}

    def q(self, a: str, b: str) -> Deque[Any]:
        return self.inbox.setdefault((a, b), deque())

    # -- steps ------------------------------------------------------------------------------------
    def emit(self, s: str) -> bool:
        i = self.emitted[s]
        if i >= len(self.src_batches[s]):
            return False
        b, per, mark = self.src_batches[s][i]
        self.emitted[s] = i + 1
        for m in self.ms:
            self.src_unacked[(s, m)].append(i)
            self.q(s, m).append((i, per[m], mark))
        return True

    def heartbeat(self, s: str) -> bool:
        """A source's latest mark alone, to every M (sent now and then, never replayed: the next
        one carries it again); a restarted M whose inputs were all acked learns it this way."""
        i = self.emitted[s]
        if i == 0:
            return False
        mark = self.src_batches[s][i - 1][2]
        sent = False
        for m in self.ms:
            if self.m_state[m]["table"].inputs.get(s) is None or self.m_state[m]["table"].inputs[s].noted != mark.value:
                self.q(s, m).append((None, [], mark))
                sent = True
        return sent

    def m_process(self, m: str, s: str) -> bool:
        q = self.q(s, m)
        if not q:
            return False
        i, recs, mark = q.popleft()
        st_ = self.m_state[m]
        index = st_["next"]
        st_["next"] += 1
        st_["inputs"][index] = (s, i)
        st_["open"][index] = 0
        for rec in recs:
            d = self.sticky.get(rec[0]) or self.routing[rec[1]]
            st_["outbox"][d].append((index, rec))
            st_["open"][index] += 1
        st_["table"].note(s, index, mark)
        self._m_ack_inputs(m)
        return True

    def _m_ack_inputs(self, m: str) -> None:
        st_ = self.m_state[m]
        opened = sorted(i for i, n in st_["open"].items() if n > 0)
        low = opened[0] if opened else None
        for index in sorted(st_["inputs"]):
            if low is not None and index >= low:
                break
            s, i = st_["inputs"].pop(index)
            del st_["open"][index]
            if i in self.src_unacked[(s, m)]:
                self.src_unacked[(s, m)].remove(i)
        st_["table"].release(low)

    def m_flush(self, m: str, d: str) -> bool:
        st_ = self.m_state[m]
        table = st_["table"]
        mark = table.current() if self.unsafe else table.forwardable()
        recs = st_["outbox"][d]
        if not recs and (mark is None or mark == st_["sent_mark"][d]):
            return False
        st_["outbox"][d] = []
        for _, rec in recs:
            self.sticky[rec[0]] = d
        st_["batch_id"] += 1
        bid = (m, st_["epoch"], st_["batch_id"])  # the epoch: an ack for a dead incarnation acks nothing
        batch = (bid, [r for _, r in recs], mark)
        st_["unacked"][d].append((bid, [ix for ix, _ in recs], batch))
        self.q(m, d).append(batch)
        st_["sent_mark"][d] = mark
        return True

    def d_process(self, d: str, m: str) -> bool:
        q = self.q(m, d)
        if not q:
            return False
        bid, recs, mark = q.popleft()
        table = self.d_table[d]
        for rid, key, t in recs:
            if rid in self.d_applied[d]:
                continue  # a replay of a record applied here: skipped before any judgement
            if rid in self.judged:
                self.twice.append(rid)
            now = table.current()
            self.judged[rid] = now is not None and not now.idle and t < now.value
            self.d_applied[d].add(rid)
        if mark is not None:
            table.note(m, 0, mark)
        # saved with the batch, then acked to M (this incarnation of M, if it still is the sender)
        st_ = self.m_state[m]
        for k, (b, indices, _) in enumerate(st_["unacked"][d]):
            if b == bid:
                del st_["unacked"][d][k]
                for ix in indices:
                    if ix in st_["open"]:
                        st_["open"][ix] -= 1
                self._m_ack_inputs(m)
                break
        return True

    def crash_m(self, m: str) -> None:
        """M loses its memory: a new incarnation, its marks start over; every source replays what
        M had not acked, in order; what it sent but a D has not taken stays on the way."""
        self._epochs += 1
        self.m_state[m] = self._fresh_m()
        for s in self.src_names:
            q = self.q(s, m)
            q.clear()
            for i in self.src_unacked[(s, m)]:
                _, per, mark = self.src_batches[s][i]
                q.append((i, per[m], mark))

    def crash_d(self, d: str) -> None:
        """D loses what it received but had not processed (its state is saved after every batch);
        each M sends again every batch D did not ack, in order."""
        for m in self.ms:
            q = self.q(m, d)
            q.clear()
            q.extend(batch for _, _, batch in self.m_state[m]["unacked"][d])

    def move(self, key: str, d: str) -> None:
        self.routing[key] = d

    def step(self, action: Tuple[int, int, int]) -> None:
        kind, x, y = action
        if kind == 0:
            self.emit(self.src_names[x % len(self.src_names)])
        elif kind == 1:
            self.m_process(self.ms[x % 2], self.src_names[y % len(self.src_names)])
        elif kind == 2:
            self.m_flush(self.ms[x % 2], self.ds[y % 2])
        elif kind == 3:
            self.d_process(self.ds[x % 2], self.ms[y % 2])
        elif kind == 4:
            self.crash_m(self.ms[x % 2])
        elif kind == 5:
            self.crash_d(self.ds[x % 2])
        elif kind == 7:
            self.heartbeat(self.src_names[x % len(self.src_names)])
        else:
            self.move("abc"[x % 3], self.ds[y % 2])

    def settle(self) -> None:
        progress = True
        while progress:
            progress = False
            for s in self.src_names:
                progress |= self.emit(s)
                if not any(self.q(s, m) for m in self.ms):
                    progress |= self.heartbeat(s)
            for m in self.ms:
                for s in self.src_names:
                    progress |= self.m_process(m, s)
                for d in self.ds:
                    progress |= self.m_flush(m, d)
            for d in self.ds:
                for m in self.ms:
                    progress |= self.d_process(d, m)


def _run(sources: Any, disorder: float, actions: List[Tuple[int, int, int]], unsafe: bool = False) -> Model:
    model = Model(sources, disorder, unsafe)
    for a in actions:
        model.step(a)
    model.settle()
    return model


def _check(model: Model) -> None:
    late = sorted(r for r, was_late in model.judged.items() if was_late and model.on_time[r])
    assert not late, f"on time at their source, judged late: {late}"
    assert set(model.judged) == set(model.on_time), "every record reaches a keyed instance"
    assert not model.twice, f"applied by two keyed instances: {model.twice}"
    least = min(model.final_marks)
    for d in model.ds:  # not vacuous: the marks got through, to the least of the sources' last
        assert model.d_table[d].current() == Mark(least), (d, model.d_table[d].current(), least)


RECORD = st.tuples(st.sampled_from("abc"), st.integers(-40, 100), st.integers(0, 1))
SOURCE = st.lists(st.lists(RECORD, min_size=1, max_size=3), min_size=1, max_size=6)
ACTION = st.tuples(st.integers(0, 7), st.integers(0, 5), st.integers(0, 5))


def _timed(batches: List[List[Tuple[str, int, int]]], step: int) -> List[List[Tuple[str, float, int]]]:
    """Event times drifting forward (`step` ms per record) with jitter: some records come out of
    order within the disorder, some beyond it (late at their source)."""
    out, n = [], 0
    for batch in batches:
        row = []
        for key, jitter, m in batch:
            n += 1
            row.append((key, float(1000 + n * step + jitter), m))
        out.append(row)
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(SOURCE, min_size=1, max_size=3), st.integers(0, 60), st.integers(1, 30),
       st.lists(ACTION, max_size=80))
def test_no_record_on_time_at_its_source_is_judged_late(sources: Any, disorder: int, step: int,
                                                         actions: List[Tuple[int, int, int]]) -> None:
    _check(_run([_timed(b, step) for b in sources], disorder, actions))


def test_seeded_interleavings_with_many_crashes_and_moves() -> None:
    """Also shows the model can fail: the same schedules with the stage passing on what it
    received (`unsafe`) judge records late that were on time at their source."""
    rng = random.Random(37)
    crashes = unsafe_failed = judged_late = 0
    for _ in range(300):
        sources = [_timed([[(rng.choice("abc"), rng.randint(-40, 100), rng.randint(0, 1))
                            for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(3, 12))], rng.randint(1, 30))
                   for _ in range(rng.randint(2, 3))]
        actions = [(rng.choice([0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 4, 5, 6, 7]), rng.randint(0, 5), rng.randint(0, 5))
                   for _ in range(rng.randint(50, 250))]
        crashes += sum(1 for a in actions if a[0] in (4, 5))
        disorder = rng.randint(0, 60)
        model = _run(sources, disorder, actions)
        _check(model)
        judged_late += sum(model.judged.values())  # the records late at their source
        bad = _run(sources, disorder, actions, unsafe=True)
        unsafe_failed += any(late and bad.on_time[r] for r, late in bad.judged.items())
    assert crashes > 500 and judged_late > 100
    assert unsafe_failed > 0


def test_passing_on_what_was_received_judges_a_replayed_record_late() -> None:
    """The rule the table exists for: M0 takes r1 (key b, for D1) and r2 (key a, for D0), sends r2
    to D0 with the mark it received (200), then crashes before r1 left; key b moves to D0; the
    source replays both and r1 (100), on time at its source, reaches D0 behind a mark past it. With
    `forwardable` no mark covers an input before it is acked (M0 sent D0 none), and r1 is on time."""
    sources = [[[("b", 100.0, 0)], [("a", 200.0, 0)]]]
    steps = [(0, 0, 0), (0, 0, 0), (1, 0, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0),  # r2 and 200 to D0
             (1, 1, 0), (1, 1, 0), (2, 1, 0), (3, 0, 1),  # M1's marks (no records) to D0: 200
             (4, 0, 0), (6, 1, 0)]  # M0 crashes, key b moves to D0
    bad = _run(sources, 0, steps, unsafe=True)
    assert bad.judged[("S0", 1)] is True and bad.on_time[("S0", 1)]
    _check(_run(sources, 0, steps))


# ---- the configuration and the instance ------------------------------------------------------------

def _timed_pipeline(extra_source: str = "", extra_op: str = "") -> str:
    from foglab.sim.instance_check import pipeline_text
    text = pipeline_text(keyed=True, event_time=True)
    return text.replace('time_unit = "ms"', 'time_unit = "ms"' + extra_source, 1) + extra_op


def test_the_watermark_table_is_checked_and_belongs_to_the_source() -> None:
    from agent.config import load_pipeline_text
    from agent.schema import ConfigError
    cfg = load_pipeline_text(_timed_pipeline("\ndisorder_ms = 5000\nidle_after = 30\nchannel_field = \"k\""), "p.toml")
    wm = cfg.operators[0].watermark
    assert (wm.time_field, wm.time_unit, wm.disorder_ms, wm.idle_after, wm.channel_field) == \
        ("n", "ms", 5000.0, 30.0, "k")
    with pytest.raises(ConfigError, match=r"channel_field: expected a field name"):
        load_pipeline_text(_timed_pipeline('\nchannel_field = ""'), "p.toml")
    assert all(op.watermark is None for op in cfg.operators[1:])
    with pytest.raises(ConfigError, match=r"p.toml: \[operator\[0\].watermark\].disorder_ms: expected milliseconds"):
        load_pipeline_text(_timed_pipeline('\ndisorder_ms = "5s"'), "p.toml")
    with pytest.raises(ConfigError, match=r"idle_after: expected seconds > 0, got 0"):
        load_pipeline_text(_timed_pipeline("\nidle_after = 0"), "p.toml")
    with pytest.raises(ConfigError, match=r"max_channels: expected an integer"):
        load_pipeline_text(_timed_pipeline("\nmax_channels = 0"), "p.toml")
    with pytest.raises((ConfigError, ValueError), match="belongs to the source"):
        load_pipeline_text(_timed_pipeline(extra_op='\n[operator.watermark]\ntime_field = "n"\n'), "p.toml")


def test_a_mark_alone_moves_a_keyed_instance_and_is_no_replay_marker() -> None:
    """cnt takes a batch of op-0 with a mark, then a mark alone (an empty data batch with a
    watermark: a replay marker has none): its watermark follows, and a record older than it is
    late."""
    from agent.config import load_pipeline_text
    from agent.instance.core import Instance
    from agent.instance.events import EnvelopeReceived, Started, Tick
    from agent.instance.spec import InstanceSpec
    from foglab.sim.instance_check import BROKER, CLUSTER, WALL0
    from foglab.sim.instance_check_keyed import MemoryTrail
    from agent.operators.builtin import OperatorContext
    from agent import topics
    text = _timed_pipeline()
    spec = InstanceSpec("chk.cnt.0", "cnt", "n1", CLUSTER, "chk", text, BROKER, succs=("sink-0",), preds=("op-0",),
                        keeper=True, state_dir="/nonexistent", heartbeat_period=3600.0)
    late: List[int] = []
    op = MemoryTrail(OperatorContext("chk.cnt.0", "cnt", "n1", "map", {"time_field": "n", "time_unit": "ms"}), late)
    inst = Instance(spec, load_pipeline_text(text, "p"), op)
    inst.handle(Started(WALL0), 0.0)
    topic = topics.inbox(CLUSTER, "chk.cnt.0", "n1")

    def take(seq: int, items: Any, mark: Optional[Mark], now: float) -> None:
        inst.handle(EnvelopeReceived(topic, encode_data("op-0", 0, seq, items, None, mark)), now)
        inst.handle(Tick(WALL0 + now), now)

    take(1, [("src", 0, {"k": "k0", "n": 0}), ("src", 5, {"k": "k1", "n": 5})], Mark(4), 0.1)
    assert inst.keyed.watermark == 4.0 and inst.keyed.flowing
    take(2, [], Mark(6), 0.2)  # a mark alone: not a replay marker, not processed as records
    assert inst.keyed.watermark == 6.0
    take(3, [("src", 3, {"k": "k0", "n": 3}), ("src", 7, {"k": "k0", "n": 7})], None, 0.3)
    assert late == [3] and inst.keyed.counts["late_dropped"] == 1
    assert inst.keyed.watermark == 6.0  # a record never raises a flowing watermark
    assert inst.stats["records_in"] == 4


class _SourceRun:
    """A source instance from the pipeline text (records n = 0, 1, 2 of keys k0, k1, k0, one each
    0.5 s) whose publishes the broker takes and acks at once, ticked every 50 ms for 2 s."""

    def __init__(self, text: str, heartbeat_period: float = 3600.0) -> None:
        from agent.config import load_pipeline_text
        from agent.instance.core import Instance
        from agent.instance.events import Started
        from agent.instance.spec import InstanceSpec
        from foglab.sim.instance_check import BROKER, CLUSTER, WALL0, MemorySource

        spec = InstanceSpec("source-0", "source", "n1", CLUSTER, "chk", text, BROKER, succs=("op-0",), preds=(),
                            keeper=True, state_dir="/nonexistent", heartbeat_period=heartbeat_period)
        self.inst = Instance(spec, load_pipeline_text(text, "p"), MemorySource(3, interval=0.5, keys=2))
        self.sent: List[Any] = []
        self.positions: List[Dict[str, Any]] = []  # what it wrote to its position file
        self.mid = 0
        self.now = 0.0
        self._run(self.inst.handle(Started(WALL0), 0.0))
        self.tick_until(2.0)

    def _run(self, cmds: List[Any]) -> None:
        from agent.instance.commands import PersistSource, Publish
        from agent.instance.events import PubAcked, PublishAccepted

        for c in cmds:
            if isinstance(c, PersistSource):
                self.positions.append(c.data)
            if isinstance(c, Publish) and "/inbox/" in c.topic:
                self.mid += 1
                self.sent.append(decode(c.payload))
                self.inst.handle(PublishAccepted(c.token, self.mid), self.now)
                self.inst.handle(PubAcked(self.mid), self.now)

    def tick_until(self, until: float) -> None:
        from agent.instance.events import Tick
        from foglab.sim.instance_check import WALL0

        while self.now < until:
            self.now += 0.05
            self._run(self.inst.handle(Tick(WALL0 + self.now), self.now))

    def data(self) -> List[Any]:
        return [e for e in self.sent if e.records]

    def ack(self, seq: int) -> None:
        """The successor acks every batch up to `seq`."""
        from agent import topics
        from agent.dataplane.envelope import Envelope
        from agent.instance.events import EnvelopeReceived
        from foglab.sim.instance_check import CLUSTER

        ack = Envelope("op-0", 0, 1, Kind.ACK, [0, seq])
        self._run(self.inst.handle(EnvelopeReceived(topics.inbox(CLUSTER, "source-0", "n1"), encode(ack)), self.now))


@pytest.mark.parametrize("channels, expected", [("", Mark(2)), ('\nchannel_field = "k"', Mark(1))])
def test_a_source_instance_with_channel_field_marks_the_least_channel(channels: str, expected: Mark) -> None:
    """The source instance built from the pipeline text: records n = 0, 1, 2 of keys k0, k1, k0.
    One channel, its mark once acked is the newest time (2); with `channel_field = "k"` it is the
    least channel's (k1: 1)."""
    source = _SourceRun(_timed_pipeline(channels))
    sent, data = source.sent, source.data()
    assert [(r[2]["k"], r[2]["n"]) for e in data for r in e.records] == [("k0", 0), ("k1", 1), ("k0", 2)]
    source.ack(data[-1].seq)
    source.tick_until(3.0)
    assert [e.watermark for e in sent if e.watermark is not None] == [expected]


def test_a_source_marks_only_what_its_successor_acked_and_goes_idle() -> None:
    """The source instance: its records' times make its mark, which leaves only once the
    successor acked the poll it came from (never with the batch that carries those records);
    `idle_after` seconds without a record, the mark alone says idle."""
    source = _SourceRun(_timed_pipeline("\nidle_after = 5"))
    sent, data = source.sent, source.data()
    assert [r[2]["n"] for e in data for r in e.records] == [0, 1, 2]
    assert all(e.watermark is None for e in sent), "a mark before any poll was acked"
    source.ack(data[-1].seq)
    source.tick_until(3.0)
    assert [e.watermark for e in sent if e.watermark is not None] == [Mark(2)]  # alone, once
    source.tick_until(7.5)
    assert [e.watermark for e in sent if e.watermark is not None] == [Mark(2), Mark(2, True)]
    assert all(not e.records for e in sent if e.watermark is not None)
