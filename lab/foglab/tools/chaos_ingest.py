"""`fog-agent chaos --pipeline mqtt-ingest`: readings from an outside publisher, every one checked.

The other chaos pipelines regenerate their input from a seed; a sensor's readings cannot be
regenerated, so here the chaos process itself is the sensor fleet: a plain paho client with a
client id of its own publishes readings `{"sensor": "s<k>", "t": <event time, ms>, "v": <value>,
"rid": <reading id>}` at a steady rate, QoS 1, to `chaos-sensors/<sensor>`, and remembers every
one. The pipeline is `mqtt_source` (keyed by sensor) -> a keyed tumbling event-time window that
counts the readings of each sensor and window and sums their rids -> `counting_sink` (spilled, so
that the verdict reads what each window held). Since the publisher knows every reading, the verdict
(`ingest_verdict`, no I/O) recomputes each (sensor, window) from the published readings and
compares: the same count and the same sum of rids is exact; a window with more is a reading
counted twice (the extra sum is its rid when one reading is), with fewer a reading lost.

When the load ends the publisher stops, waits for the broker's PUBACK of everything it published,
and publishes one closing reading per sensor (not among the checked readings) far enough ahead in
event time that the watermark, the least over the sensors, passes the end of every window of the
run: every window is then expected at the sink (the closing readings' own windows stay open and
are not checked).

The contract it checks (docs/operators.md, the `mqtt_source` paragraph): exactly once through a
drain (kill-agent: the workers drain), a kill -9 of the source's worker (its ingest log), a broker
restart and a stall; at least once for the readings in flight when the source's node, and its
ingest log with it, is lost (kill-node, or a partition of its node long enough for a re-homing;
kill-broker, which also forgets what reached the broker since its last autosave). `attribute_twice` owes each reading counted twice to the fault
it was in flight at, and says whether that fault allows it (`duplicates_allowed`: which do).
"""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

__all__ = ["INGEST_PIPELINE", "INGEST_TOPIC", "CLOSER", "WINDOW_MS", "LATENESS_MS", "Publisher", "IngestVerdict",
           "ingest_verdict", "expected_window_count", "emitted_windows", "spooled_records", "duplicates_allowed",
           "attribute_twice"]

INGEST_TOPIC = "chaos-sensors"  # readings go to chaos-sensors/<sensor>
CLOSER = "CLOSER"  # a sensor the verdict does not check (its readings and windows left out)
WINDOW_MS = 5000
# The window's lateness: each sensor's readings arrive in publish order through the source's
# ingest session, except those delivered again after a crash (at most the broker's in-flight
# window, 100 readings: 2 s at 50 readings/s). 10 s covers them with room; a reading later than
# that is dropped by the window (late_dropped) and shows here as a reading lost. Not in order
# across sensors: a broker resuming the source's session after a cut can send a reading published
# after the reconnect ahead of those it queued meanwhile (R23: mosquitto 2.0.11, one reading 17.6 s
# ahead of 878), so the watermark flows from the source by sensor ([operator.watermark]
# channel_field): the least sensor's time, not the newest reading's.
LATENESS_MS = 10000

INGEST_PIPELINE = f"""\
# fog-agent chaos --pipeline mqtt-ingest: mqtt_source (readings of an outside publisher) -> window -> sink
[pipeline]
name = "chaos"
coordination = "ack"

[scaling]
policy = "none"

[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:mqtt_source"
key = "sensor"
[operator.params]
topic = "{INGEST_TOPIC}/+"
[operator.watermark]
time_field = "t"
time_unit = "ms"
channel_field = "sensor"

[[operator]]
name = "windows"
function = "agent.operators.keyed:tumbling_window"
[operator.params]
time_field = "t"
time_unit = "ms"
size_ms = {WINDOW_MS}
lateness_ms = {LATENESS_MS}
agg = "sum"
field = "rid"

[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""

# (rid, sensor, event time in ms)
Reading = Tuple[int, str, int]


class Publisher:
    """The sensors: a paho client of its own (QoS 1, persistent session, reconnecting on its own)
    publishing `rate` readings a second, round the `sensors`, from a thread. paho keeps what it
    could not send while the broker is away and sends it, in order, once it is back; everything
    handed to paho is in `readings` (the verdict's input), `acked` counts the broker's PUBACKs."""

    def __init__(self, host: str, port: int, seed: int, rate: float = 50.0, sensors: int = 10,
                 client_id: Optional[str] = None) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.rate = float(rate)
        self.sensors = [f"s{k}" for k in range(1, int(sensors) + 1)]
        self.rng = random.Random(seed)
        self.readings: List[Reading] = []
        self._lock = threading.Lock()
        self._unacked: Dict[int, int] = {}  # mid -> rid
        self._early: set = set()  # mids acked before publish() registered them
        self._acked = 0
        self._rid = itertools.count(1)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.last_t = 0
        self.disconnects = 0
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id or f"chaos-sensors-{seed}",
                        protocol=mqtt.MQTTv311, clean_session=False)
        c.max_inflight_messages_set(100)
        c.max_queued_messages_set(0)  # unbounded: nothing is dropped while the broker is away
        c.reconnect_delay_set(0.2, 2)
        c.on_publish = self._on_publish
        c.on_disconnect = self._on_disconnect
        self.client = c
        c.connect(host, port, keepalive=10)
        c.loop_start()

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason: Any = None, props: Any = None) -> None:
        with self._lock:
            if self._unacked.pop(mid, None) is not None:
                self._acked += 1
            else:  # acked before publish() returned its mid
                self._early.add(mid)

    def _on_disconnect(self, *args: Any) -> None:
        self.disconnects += 1

    @property
    def published(self) -> int:
        with self._lock:
            return len(self.readings)

    @property
    def acked(self) -> int:
        with self._lock:
            return self._acked

    def publish(self, sensor: str, t_ms: int, checked: bool = True) -> Reading:
        rid = next(self._rid)
        body = json.dumps({"sensor": sensor, "t": t_ms, "v": round(self.rng.uniform(15.0, 30.0), 2), "rid": rid})
        # not under our lock: paho may call on_publish holding its own, which would wait for ours
        info = self.client.publish(f"{INGEST_TOPIC}/{sensor}", body, qos=1)
        reading = (rid, sensor, t_ms)
        with self._lock:
            if info.mid in self._early:
                self._early.discard(info.mid)
                self._acked += 1
            else:
                self._unacked[info.mid] = rid
            if checked and sensor != CLOSER:
                self.readings.append(reading)
        self.last_t = max(self.last_t, t_ms)
        return reading

    def start(self) -> None:
        def loop() -> None:
            period = 1.0 / self.rate
            nxt = time.monotonic()
            k = 0
            while not self._stop.is_set():
                now = time.monotonic()
                if now < nxt:
                    self._stop.wait(nxt - now)
                    continue
                # event time: the wall clock in ms, never going back (one sensor fleet, one clock)
                self.publish(self.sensors[k % len(self.sensors)], max(self.last_t, int(time.time() * 1000)))
                k += 1
                nxt += period
                if nxt < now - 1.0:  # a stall of this process: not made up in a burst
                    nxt = now

        self._thread = threading.Thread(target=loop, name="chaos-sensors", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def wait_acked(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._unacked:
                    return True
            time.sleep(0.1)
        with self._lock:
            return not self._unacked

    def unacked(self) -> List[int]:
        with self._lock:
            return sorted(self._unacked.values())

    def close_windows(self) -> int:
        """Publish the closing readings, one per sensor (the watermark is the least over the
        sensors of their newest event time, minus the lateness): their event time puts it past
        the end of every window holding a reading. They are not checked (their own windows stay
        open). Returns their event time."""
        last_end = (self.last_t // WINDOW_MS + 1) * WINDOW_MS
        t = last_end + LATENESS_MS
        for sensor in self.sensors:
            self.publish(sensor, t, checked=False)
        return t

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


# ---- the verdict (no I/O) ---------------------------------------------------------------------


@dataclass(frozen=True)
class IngestVerdict:
    published: int  # readings published (the closing one aside)
    windows_expected: int  # (sensor, window) pairs holding at least one published reading
    windows_emitted: int  # window rows at the sink (the closing sensor's aside)
    exact: int  # emitted once, with the published count and sum of rids
    missing: int  # expected, never emitted
    extra: int  # emitted and not expected, or emitted more than once (each copy past the first)
    different: int  # emitted once with another count or sum
    readings_lost: int  # published readings no window counted (in missing windows or short ones)
    readings_counted_twice: int  # readings counted more than once (windows with more than published)
    mixed: int = 0  # windows with the published count but another sum: one lost, another counted twice
    samples: Tuple[str, ...] = ()  # up to 8 differences, one line each
    twice_rids: Tuple[int, ...] = ()  # the readings counted twice that a window names (one extra in it)

    @property
    def ok(self) -> bool:
        """Every window exactly as published: nothing lost, nothing counted twice."""
        return self.exact == self.windows_expected and not (self.missing or self.extra or self.different)

    @property
    def at_least_once(self) -> bool:
        """No reading lost and no window of its own invented (readings counted twice aside)."""
        return not (self.missing or self.readings_lost or self.extra or self.mixed)


def ingest_verdict(published: Iterable[Reading], emitted: Iterable[Dict[str, Any]],
                   window_ms: int = WINDOW_MS) -> IngestVerdict:
    """Each published reading against the windows at the sink. `published`: (rid, sensor, t ms);
    `emitted`: the window rows `{"key", "start", "end", "count", "sum"}` (sum: of the rids).
    Per (sensor, window start): the rows emitted once with the published count and rid sum are
    exact; a window with more readings than published counts the excess as readings counted twice
    (one of them: its rid is the extra sum), with fewer as readings lost; a row for a window that
    holds no published reading, or a second row for one that does, is extra."""
    want: Dict[Tuple[str, int], List[int]] = defaultdict(lambda: [0, 0])
    n = 0
    rids: Dict[int, Reading] = {}
    for rid, sensor, t in published:
        if sensor == CLOSER:
            continue
        n += 1
        rids[rid] = (rid, sensor, t)
        w = want[(sensor, (int(t) // window_ms) * window_ms)]
        w[0] += 1
        w[1] += int(rid)
    got: Dict[Tuple[str, int], List[Dict[str, Any]]] = defaultdict(list)
    rows = 0
    for row in emitted:
        if not isinstance(row, dict) or row.get("key") == CLOSER:
            continue
        rows += 1
        got[(str(row.get("key")), int(row.get("start", -1)))].append(row)
    exact = missing = extra = different = lost = twice = mixed = 0
    samples: List[str] = []

    named: List[int] = []

    def note(line: str) -> None:
        if len(samples) < 8:
            samples.append(line)

    for key in sorted(set(want) | set(got)):
        exp = want.get(key)
        rows_k = got.get(key, [])
        if exp is None:
            extra += len(rows_k)
            note(f"extra {key[0]} window {key[1]}: {len(rows_k)} row(s), no reading published in it")
            continue
        if not rows_k:
            missing += 1
            lost += exp[0]
            note(f"missing {key[0]} window {key[1]}: {exp[0]} readings")
            continue
        if len(rows_k) > 1:
            extra += len(rows_k) - 1
            note(f"extra {key[0]} window {key[1]}: emitted {len(rows_k)} times")
        row = rows_k[0]
        count, total = int(row.get("count", 0)), float(row.get("sum", 0.0))
        if count == exp[0] and total == float(exp[1]):
            exact += 1
            continue
        different += 1
        if count > exp[0]:
            twice += count - exp[0]
            excess = total - exp[1]
            who = ""
            if count - exp[0] == 1 and excess == int(excess) and int(excess) in rids \
                    and rids[int(excess)][1] == key[0]:
                named.append(int(excess))
                who = f" (rid {int(excess)})"
            note(f"twice {key[0]} window {key[1]}: count {count}, published {exp[0]}; sum {total:g}, "
                 f"published {exp[1]}{who}")
        elif count < exp[0]:
            lost += exp[0] - count
            note(f"lost {key[0]} window {key[1]}: count {count}, published {exp[0]}; sum {total:g}, "
                 f"published {exp[1]}")
        else:
            mixed += 1
            note(f"other {key[0]} window {key[1]}: count {count} as published, sum {total:g}, published {exp[1]}")
    return IngestVerdict(published=n, windows_expected=len(want), windows_emitted=rows, exact=exact,
                         missing=missing, extra=extra, different=different, readings_lost=lost,
                         readings_counted_twice=twice, mixed=mixed, samples=tuple(samples),
                         twice_rids=tuple(sorted(named)))


def expected_window_count(published: Iterable[Reading], window_ms: int = WINDOW_MS) -> int:
    """(sensor, window) pairs holding a published reading: the windows the sink should get."""
    return len({(sensor, int(t) // window_ms) for _, sensor, t in list(published) if sensor != CLOSER})


# ---- reading the sink ----------------------------------------------------------------------------


def spooled_records(spool_dirs: Iterable[Path]) -> Dict[Tuple[str, int], Any]:
    """What sinks spilled into spool files never shipped: a sink killed with its node (kill-node)
    leaves its open file in that node's spool, and the node's restarted agent does not ship it (the
    sink runs elsewhere by then). Same lines as the landed files (foglab.tools.verify.add_spilled)."""
    from foglab.tools.verify import add_spilled

    out: Dict[Tuple[str, int], Any] = {}
    for d in spool_dirs:
        for path in sorted(Path(d).glob("*/*/*.jsonl")):
            add_spilled(path.read_bytes().splitlines(), out)
    return out


def emitted_windows(sink_dir: Path, landing: Path,
                    spool_dirs: Iterable[Path] = ()) -> Tuple[List[Dict[str, Any]], Dict[str, int]]:
    """The window rows at the sink: ids from the sinks' id files (each once), contents from what
    the sinks spilled and their shippers landed, else from spool files left unshipped
    (`spooled_records`). Also: ids recorded by more than one sink instance (`dup_ids`), ids whose
    content came from a spool file (`from_spool`) and ids whose content was found nowhere (`unread`)."""
    from agent.operators.builtin import read_sink_ids
    from foglab.tools.verify import landed_records

    received, dup = read_sink_ids(sink_dir)
    ids = {(s, q) for s, qs in received.items() for q in qs}
    contents = landed_records(landing)
    spooled = {i: r for i, r in spooled_records(spool_dirs).items() if i in ids and i not in contents}
    contents.update(spooled)
    rows = [contents[i] for i in sorted(ids) if i in contents]
    return rows, {"ids": len(ids), "dup_ids": dup, "from_spool": len(spooled), "unread": len(ids - set(contents))}


def _allows_duplicates(f: Dict[str, Any], src: set) -> bool:
    """A partition ends the source's incarnation only when it was re-homed meanwhile (its original
    is fenced at the heal); healed before, the same incarnation reconnects with its session and
    must lose and duplicate nothing, so a reading counted twice there fails the run."""
    kind, target = f.get("kind"), str(f.get("target"))
    detail = f.get("detail") or {}
    hosted = set(detail.get("instances") or ())
    return kind == "kill-broker" or (
        kind == "kill-node" and bool(hosted & src)) or (
        kind == "partition" and bool(set(detail.get("active_elsewhere_at_heal") or ()) & src))


def _fault_line(f: Dict[str, Any]) -> str:
    return f"{f.get('kind')} {f.get('target')} at {f.get('t')} s"


def duplicates_allowed(faults: Sequence[Dict[str, Any]], source_instances: Sequence[str]) -> List[str]:
    """The faults of a run after which readings may be counted twice (docs/operators.md: at least
    once for the readings in flight when a source's node and its ingest log are lost): the loss of
    the node hosting it (kill-node), a cut of it long enough
    for the source to be re-homed (partition: the original is fenced at the heal), and kill-broker
    (the broker forgets acks received since its last autosave). One line per fault, empty: exactly
    once."""
    src = set(source_instances)
    return [_fault_line(f) for f in faults if _allows_duplicates(f, src)]


def attribute_twice(twice_rids: Sequence[int], unnamed: int, published_ms: Dict[int, int],
                    faults: Sequence[Dict[str, Any]], t0_wall: float, source_instances: Sequence[str],
                    slack_s: float = 1.0) -> Dict[str, Any]:
    """Which fault each reading counted twice is owed to, and whether that fault allows it. A
    reading delivered twice was in flight when a fault hit: published before it (`slack_s` for
    the clocks' rounding) and owed to the first fault injected from then on (fault times `t` are
    seconds after `t0_wall`; `published_ms` the readings' event times, the publisher's wall clock).
    Readings no window names (`unnamed`: two extra in one window) are allowed if any fault is.
    Returns {"allowed", "not_allowed", "by_fault": {fault: [rids]}, "fault_allows": {fault: bool},
    "unattributed": [rids]}."""
    src = set(source_instances)
    ordered = sorted(faults, key=lambda f: float(f.get("t", 0)))
    by_fault: Dict[str, List[int]] = {}
    verdicts: Dict[str, bool] = {}  # fault -> whether it allows its readings counted twice
    unattributed: List[int] = []
    allowed = not_allowed = 0
    for rid in twice_rids:
        p = published_ms.get(rid)
        owner = None if p is None else next(
            (f for f in ordered if t0_wall + float(f.get("t", 0)) + slack_s >= p / 1000.0), None)
        if owner is None:
            unattributed.append(rid)
            not_allowed += 1
            continue
        by_fault.setdefault(_fault_line(owner), []).append(rid)
        verdicts[_fault_line(owner)] = _allows_duplicates(owner, src)
        if verdicts[_fault_line(owner)]:
            allowed += 1
        else:
            not_allowed += 1
    if unnamed:
        if any(_allows_duplicates(f, src) for f in faults):
            allowed += unnamed
        else:
            not_allowed += unnamed
    return {"allowed": allowed, "not_allowed": not_allowed, "by_fault": by_fault, "fault_allows": verdicts,
            "unattributed": unattributed}
