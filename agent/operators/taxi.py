"""Synthetic NYC-taxi records (DEBS 2015 schema), rate profiles, and the two source operators.

The real data set is not available offline, so records are generated from a seed: the same
(seed, source instance) gives the same records in the same order, on any machine. About 2% of the
records carry the defects the DEBS 2015 challenge describes (zero GPS fix, zero trip time or
distance) so that `validate` has something to drop, and some trips leave the 300 x 300 grid so
that `in_zone` filters too.

Rate profiles (`params.profile`): records per second as a function of the time since the source
started; the source generates the integral of the rate, and only while it has flow-control credit
(a slow pipeline slows the source: back pressure, not loss). A backlog older than `max_lag_s`
(default 1 s) is not made up later; it is counted as `deferred` (records never generated, so not
lost).

- constant: `rate`
- steps:    `steps = [[t0, rate0], [t1, rate1], ...]` (rate_i from t_i on)
- sinusoid: `rate` (mean), `amplitude` (fraction of the mean), `period` seconds: a diurnal-like wave
- csv:      `csv = "path"` with lines `t,rate` (step-wise; a header line is allowed)

Source params: `seed`, `profile` and its fields, `max_records` (stop after that many; the worker
then reports the source finished), `max_lag_s`.
"""

from __future__ import annotations

import bisect
import csv
import hashlib
import json
import math
import random
import zlib
from collections import deque
from itertools import repeat
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Deque, Dict, List, Optional, Tuple

from agent.dataplane.envelope import Item
from agent.operators.builtin import OperatorContext, Param
from agent.operators.sources import SourceState

__all__ = [
    "RateProfile",
    "Constant",
    "Steps",
    "Sinusoid",
    "profile_from_params",
    "TaxiGenerator",
    "TaxiSource",
    "MqttIngestSource",
    "source",
    "mqtt_source",
    "FIELDS",
]

FIELDS = (
    "medallion",
    "hack_license",
    "pickup_datetime",
    "dropoff_datetime",
    "trip_time_in_secs",
    "trip_distance",
    "pickup_longitude",
    "pickup_latitude",
    "dropoff_longitude",
    "dropoff_latitude",
    "payment_type",
    "fare_amount",
    "surcharge",
    "mta_tax",
    "tip_amount",
    "tolls_amount",
    "total_amount",
)


# ---- rate profiles --------------------------------------------------------------------------------


class RateProfile:
    def rate(self, t: float) -> float:
        raise NotImplementedError


@dataclass(frozen=True)
class Constant(RateProfile):
    value: float

    def rate(self, t: float) -> float:
        return self.value


@dataclass(frozen=True)
class Steps(RateProfile):
    times: Tuple[float, ...]
    rates: Tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.times or len(self.times) != len(self.rates) or list(self.times) != sorted(self.times):
            raise ValueError("steps: expected [[t, rate], ...] with increasing t")

    def rate(self, t: float) -> float:
        i = bisect.bisect_right(self.times, t) - 1
        return self.rates[i] if i >= 0 else 0.0


@dataclass(frozen=True)
class Sinusoid(RateProfile):
    mean: float
    amplitude: float
    period: float

    def rate(self, t: float) -> float:
        return max(0.0, self.mean * (1.0 + self.amplitude * math.sin(2 * math.pi * t / self.period)))


def _steps_from_csv(path: str) -> Steps:
    times: List[float] = []
    rates: List[float] = []
    with open(path, newline="") as fh:
        for i, row in enumerate(csv.reader(fh)):
            if not row or row[0].strip().startswith("#"):
                continue
            try:
                t, r = float(row[0]), float(row[1])
            except (ValueError, IndexError):
                if i == 0:
                    continue  # header
                raise ValueError(f"{path}:{i + 1}: expected 't,rate', found {row!r}") from None
            times.append(t)
            rates.append(r)
    return Steps(tuple(times), tuple(rates))


def profile_from_params(params: Dict[str, Any]) -> RateProfile:
    kind = params.get("profile", "constant")
    rate = float(params.get("rate", 100.0))
    if kind == "constant":
        return Constant(rate)
    if kind == "steps":
        steps = params.get("steps") or [[0.0, rate]]
        return Steps(tuple(float(t) for t, _ in steps), tuple(float(r) for _, r in steps))
    if kind == "sinusoid":
        return Sinusoid(rate, float(params.get("amplitude", 0.5)), float(params.get("period", 60.0)))
    if kind == "csv":
        return _steps_from_csv(str(params["csv"]))
    raise ValueError(f"source profile {kind!r}: expected constant, steps, sinusoid or csv")


# ---- records ---------------------------------------------------------------------------------------

_EPOCH = datetime(2013, 1, 1)
# Manhattan-ish centre; most trips start within a few km, a few far away (outside the grid).
_CENTRE = (40.75, -73.98)


class TaxiGenerator:
    """Deterministic DEBS 2015 records from (seed, stream name)."""

    def __init__(self, seed: int, stream: str, defect_rate: float = 0.02, outside_rate: float = 0.03) -> None:
        self.rng = random.Random((int(seed) << 32) ^ zlib.crc32(stream.encode()))
        self.defect_rate = defect_rate
        self.outside_rate = outside_rate
        self.medallions = ["%032X" % self.rng.getrandbits(128) for _ in range(500)]
        self.licenses = ["%032X" % self.rng.getrandbits(128) for _ in range(800)]
        self.clock = _EPOCH

    def record(self) -> Dict[str, Any]:
        rng = self.rng
        self.clock += timedelta(seconds=rng.random() * 2)
        trip = rng.randint(60, 3600)
        dist = round(trip / 3600 * rng.uniform(5, 25), 2)
        spread = 3.0 if rng.random() < self.outside_rate else 0.05
        plat = _CENTRE[0] + rng.gauss(0, spread)
        plon = _CENTRE[1] + rng.gauss(0, spread)
        dlat = plat + rng.gauss(0, 0.02)
        dlon = plon + rng.gauss(0, 0.02)
        fare = round(2.5 + dist * 2.5, 2)
        tip = round(fare * rng.choice((0.0, 0.1, 0.15, 0.2)), 2)
        tolls = 5.33 if rng.random() < 0.05 else 0.0
        rec = {
            "medallion": rng.choice(self.medallions),
            "hack_license": rng.choice(self.licenses),
            "pickup_datetime": self.clock.strftime("%Y-%m-%d %H:%M:%S"),
            "dropoff_datetime": (self.clock + timedelta(seconds=trip)).strftime("%Y-%m-%d %H:%M:%S"),
            "trip_time_in_secs": trip,
            "trip_distance": dist,
            "pickup_longitude": round(plon, 6),
            "pickup_latitude": round(plat, 6),
            "dropoff_longitude": round(dlon, 6),
            "dropoff_latitude": round(dlat, 6),
            "payment_type": "CRD" if tip else "CSH",
            "fare_amount": fare,
            "surcharge": 0.5,
            "mta_tax": 0.5,
            "tip_amount": tip,
            "tolls_amount": tolls,
            "total_amount": round(fare + 1.0 + tip + tolls, 2),
        }
        if rng.random() < self.defect_rate:
            defect = rng.randrange(3)
            if defect == 0:
                rec["pickup_longitude"] = rec["pickup_latitude"] = 0.0
            elif defect == 1:
                rec["trip_time_in_secs"] = 0
            else:
                rec["trip_distance"] = 0.0
        return rec


# ---- source operators ---------------------------------------------------------------------------------


class TaxiSource(SourceState):
    """The generator source: `poll(now, budget)` returns the records due by `now` (<= budget).

    Ids are (this instance, 0, 1, 2, ...): with `max_records` the verifier knows exactly which ids
    must reach the sink.
    """

    kind = "source"

    def __init__(self, ctx: OperatorContext, record_factory: Optional[Any] = None) -> None:
        p = ctx.params
        self.instance = ctx.instance
        self.profile = profile_from_params(p)
        self.gen = TaxiGenerator(int(p.get("seed", 1)), ctx.instance)
        self.make = record_factory or self.gen.record
        self.max_records: Optional[int] = int(p["max_records"]) if "max_records" in p else None
        self.max_lag = float(p.get("max_lag_s", 1.0))
        self.generated = 0
        self.deferred = 0.0
        self._due = 0.0
        self._last: Optional[float] = None
        self._start: Optional[float] = None
        self.paused = False
        self._catch_up = 0  # after a crash: regenerate up to here at once (see resume)
        self._elapsed = 0.0  # seconds of the rate profile already played before a restart

    def start(self, now: float) -> None:
        self._start = now - self._elapsed
        self._last = now

    def resume(self, resume_from: int, catch_up_to: int, elapsed: float) -> None:
        """Restart after a crash (called by the worker before `start`). Records are a
        deterministic stream, so the generator is wound forward to `resume_from` (the first record
        not yet acked downstream) and everything up to `catch_up_to` (the position the previous
        incarnation had reserved, never below what it generated) is generated again at once:
        nothing it may have sent is missing, and what did get through is dropped by id at the
        sink. The rate profile continues where it was (`elapsed` seconds in)."""
        for _ in range(resume_from):
            self.make()
        self.generated = resume_from
        self._catch_up = max(resume_from, catch_up_to)
        self._elapsed = max(0.0, elapsed)

    @property
    def finished(self) -> bool:
        return self.max_records is not None and self.generated >= self.max_records

    @property
    def catching_up(self) -> bool:
        """Records a previous incarnation may have sent are still to be sent again (`resume`).
        A pause does not hold them back: they are not new load, and a source paused before it
        sent them would never send them, and they would be lost (CHANGELOG.md, "A source paused
        right after a restart"; docs/reliability.md, "The chaos command")."""
        return self.generated < self._catch_up and not self.finished

    def rate_now(self, now: float) -> float:
        return self.profile.rate(now - (self._start if self._start is not None else now))

    def poll(self, now: float, budget: int) -> List[Item]:
        if self._start is None:
            self.start(now)
        assert self._last is not None and self._start is not None
        dt = max(0.0, now - self._last)
        self._last = now
        if self.catching_up:
            return self._emit(min(budget, self._catch_up - self.generated))
        if self.paused or self.finished:
            return []
        rate = self.profile.rate(now - self._start)
        self._due += rate * dt
        cap = max(rate * self.max_lag, 1.0)
        if self._due > cap:
            self.deferred += self._due - cap
            self._due = cap
        n = min(int(self._due), max(0, budget))
        if self.max_records is not None:
            n = min(n, self.max_records - self.generated)
        if n <= 0:
            return []
        self._due -= n
        return self._emit(n)

    def _emit(self, n: int) -> List[Item]:
        if self.max_records is not None:
            n = min(n, self.max_records - self.generated)
        if n <= 0:
            return []
        first = self.generated
        self.generated += n
        many = getattr(self.make, "many", None)
        # items built by zip in C: one Python call per batch instead of one per record (the
        # source's generation was 8% of a chain of 3's CPU, sampled; docs/measurement.md)
        recs = many(n) if many is not None else [self.make() for _ in range(n)]
        return list(zip(repeat(self.instance, n), range(first, first + n), recs))

    def next_due(self, now: float) -> float:
        """When the next record becomes due (for the worker's poll timeout)."""
        if self.generated < self._catch_up:
            return now
        rate = self.rate_now(now)
        if rate <= 0:
            return now + 0.05
        return now + max(0.0, (1.0 - self._due) / rate)

    def close(self) -> None:
        pass

    def stats(self) -> Dict[str, Any]:
        return {"generated": self.generated, "deferred": int(self.deferred), "finished": self.finished}


RECENT_ACKS = 4096  # deliveries acked lately that a sensor source still knows again (above)


class MqttIngestSource(SourceState):
    """Records from real sensors: the worker subscribes to `params.topic` (a filter) and hands
    each payload here. JSON payloads become records as they are; others become
    {"topic", "payload"} strings.

    Readings cannot be asked for again, so three rules keep every one of them exactly once
    (docs/reliability.md, "Sources and sinks"):
    - Logged before they leave. Each record polled is written, with its number and a digest of
      its delivery, to the source's ingest log (`take_log`; the worker appends and syncs it before
      the record is published). A restarted source sends the logged records its successors had not
      acked again under the same numbers (`replay`): a successor that had them drops the copies.
    - Acked when safe. The worker reads the topic on a connection of its own (a persistent
      session under the instance's identity, manual acks): a delivery is PUBACKed only once a
      successor acked its record (`settled`). What is not acked stays in the broker's session and
      goes to the next incarnation, wherever it runs. The broker sends again, flagged dup, what
      was unacked when a connection dropped: one this process holds or acked lately, or whose
      digest is in the replayed log, is that delivery, not a new reading (`_again`); the others
      were in flight to a dead connection and are new. A stopping source leaves its buffer
      unacked for the next incarnation.
    - Numbers never reused. Each incarnation numbers new records from `number_from`: above every
      number an earlier incarnation reserved (its position file), and at least the wall clock in
      microseconds at its start, which holds when that file is gone with its node (clocks in
      step, as re-homing assumes, and fewer than a million readings a second). A keyed operator
      downstream skips a number it has applied as a replay.
    Past `max_buffer` records (deliveries not acked come no faster than the broker's in-flight
    window, so only a burst gets there) the oldest are dropped, counted (`shed`) and logged by the
    worker (invariant 5: never silently)."""

    kind = "source"

    def __init__(self, ctx: OperatorContext) -> None:
        topic = ctx.params.get("topic")
        if not isinstance(topic, str) or not topic:
            raise ValueError(f"mqtt_source: params.topic must be a topic filter, found {topic!r}")
        self.topic = topic
        self.instance = ctx.instance
        self.max_buffer = int(ctx.params.get("max_buffer", 100000))
        # (number or None for a new reading, record, the delivery's ack token or None, digest)
        self.buffer: Deque[Tuple[Optional[int], Any, Any, str]] = deque()
        self.generated = 0
        self.shed = 0
        self.resent = 0  # logged records sent again after a restart
        self.max_records: Optional[int] = None
        self._unsettled: Deque[List[Any]] = deque()  # [number, token or None]: polled, not acked downstream
        self._dropped: List[Any] = []  # tokens to ack at once (shed, or the redelivery of a settled record)
        self._log: List[List[Any]] = []  # [number, digest, record] polled since the last take_log
        self._replayed: Dict[str, Deque[int]] = {}  # digest -> numbers of replayed records awaiting their redelivery
        # Deliveries of this process not acked yet (token -> digest), and the last ones acked: the
        # broker sends again, flagged dup, what was unacked when a connection dropped (a broker
        # restart, a partition healed): the same delivery, not a new reading.
        self._held: Dict[Any, str] = {}
        self._acked: Deque[Tuple[Any, str]] = deque(maxlen=RECENT_ACKS)

    finished = False

    def start(self, now: float) -> None:
        pass

    def number_from(self, first: int) -> None:
        """Number the next new record `first` or above (an incarnation's start: see the class)."""
        self.generated = max(self.generated, int(first))

    def replay(self, entries: List[Any], resume_from: int) -> None:
        """A restart: the logged records at or above `resume_from` (not acked downstream when the
        position was written) go out again first, under their numbers; the log is our own file,
        only its shape is checked."""
        for e in entries:
            if isinstance(e, list) and len(e) == 3 and type(e[0]) is int and isinstance(e[1], str) and e[0] >= resume_from:
                self.buffer.append((e[0], e[2], None, e[1]))
                self._replayed.setdefault(e[1], deque()).append(e[0])

    @staticmethod
    def digest(topic: str, payload: bytes) -> str:
        return hashlib.blake2b(topic.encode() + b"\0" + payload, digest_size=8).hexdigest()

    def ingest(self, topic: str, payload: bytes, token: Any = None, dup: bool = False) -> None:
        d = self.digest(topic, payload)
        if not dup:
            self._replayed.clear()  # what the broker sends again comes before anything new
        elif token is not None and self._again(d, token):
            return
        if token is not None:
            self._held[token] = d
        try:
            rec = json.loads(payload)
        except ValueError:
            rec = {"topic": topic, "payload": payload.decode("utf-8", "replace")}
        self.buffer.append((None, rec, token, d))
        while len(self.buffer) > self.max_buffer:
            _, _, dropped_token, _ = self.buffer.popleft()
            self.shed += 1
            if dropped_token is not None:
                self._dropped.append(dropped_token)

    def _again(self, digest: str, token: Any) -> bool:
        """A delivery the broker sends again (dup): one this process holds unacked is acked with
        its record; one it acked lately is acked again; one whose record was replayed from the log
        is acked with that record (or at once, if it is acked downstream already). False: a
        delivery we never had (in flight to a dead connection): a new reading."""
        if self._held.get(token) == digest:
            return True
        if (token, digest) in self._acked:
            self._dropped.append(token)
            return True
        numbers = self._replayed.get(digest)
        if not numbers:
            return False
        self._held[token] = digest
        n = numbers.popleft()
        for entry in self._unsettled:
            if entry[0] == n and entry[1] is None:
                entry[1] = token
                return True
        if any(b[0] == n for b in self.buffer):  # replayed, not polled yet
            self.buffer = deque((b[0], b[1], token, b[3]) if b[0] == n else b for b in self.buffer)
            return True
        self._dropped.append(token)  # its record is acked downstream already
        return True

    def poll(self, now: float, budget: int) -> List[Item]:
        n = min(len(self.buffer), max(0, budget))
        out: List[Item] = []
        for _ in range(n):
            seq, rec, token, d = self.buffer.popleft()
            if seq is None:
                seq = self.generated
                self.generated += 1
                self._log.append([seq, d, rec])
            else:
                self.resent += 1
            out.append((self.instance, seq, rec))
            self._unsettled.append([seq, token])
        return out

    def take_log(self) -> List[List[Any]]:
        """The new records polled since the last call, for the ingest log."""
        out, self._log = self._log, []
        return out

    def settled(self, below: int) -> List[Any]:
        """The tokens of the deliveries now safe to ack: records numbered below `below` (the first
        number a successor has not acked), and the deliveries to ack at once."""
        out, self._dropped = self._dropped, []
        unsettled = self._unsettled
        while unsettled and unsettled[0][0] < below:
            token = unsettled.popleft()[1]
            if token is not None:
                out.append(token)
        for token in out:
            digest = self._held.pop(token, None)
            if digest is not None:
                self._acked.append((token, digest))
        return out

    def next_due(self, now: float) -> float:
        return now + (0.0 if self.buffer else 0.05)

    def close(self) -> None:
        pass

    def stats(self) -> Dict[str, Any]:
        return {"generated": self.generated, "shed": self.shed, "buffered": len(self.buffer),
                "unsettled": len(self._unsettled), "resent": self.resent}


class _Factory:
    def __init__(self, cls: Any) -> None:
        self.build = cls


source = _Factory(TaxiSource)
mqtt_source = _Factory(MqttIngestSource)

# What `fog-agent check-config` checks (agent.operators.builtin.check_params; the module
# docstring says what each key means).
PROFILES = ("constant", "steps", "sinusoid", "csv")
SOURCE_PARAMS = {
    "seed": Param("integer"),
    "profile": Param("string", choices=PROFILES),
    "rate": Param("number", min=0),
    "steps": Param("array"),
    "amplitude": Param("number", min=0),
    "period": Param("number", above=0),
    "csv": Param("string", path=True),
    "max_records": Param("integer", min=0),
    "max_lag_s": Param("number", above=0),
}


def check_source_params(params: Dict[str, Any]) -> List[Tuple[str, str, Any]]:
    """The checks across keys: `steps` are [t, rate] pairs with increasing t and rates >= 0, and
    `profile = "csv"` needs a `csv` file that parses as `t,rate` lines."""
    profile = params.get("profile", "constant")
    if "steps" in params:
        steps = params["steps"]
        ok = bool(steps) and all(
            isinstance(s, list) and len(s) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in s)
            and s[1] >= 0 for s in steps)
        if ok:
            times = [s[0] for s in steps]
            ok = times == sorted(times)
        if not ok:
            return [("steps", "expected [[t, rate], ...] with increasing t and rates >= 0", steps)]
    if profile == "csv":
        if "csv" not in params:
            return [("csv", 'missing required key (profile = "csv" reads the rates from this file)', None)]
        try:
            _steps_from_csv(str(params["csv"]))
        except (ValueError, OSError) as exc:
            return [("csv", f"expected a file of 't,rate' lines ({exc})", params["csv"])]
    return []


source.params_schema = SOURCE_PARAMS  # type: ignore[attr-defined]
source.check_params = check_source_params  # type: ignore[attr-defined]
mqtt_source.params_schema = {  # type: ignore[attr-defined]
    "topic": Param("string", required=True),
    "max_buffer": Param("integer", min=1),
}
mqtt_source.check_params = lambda p: (  # type: ignore[attr-defined]
    [("topic", "expected a topic filter", p["topic"])] if not p["topic"] else [])


def sample(seed: int, n: int, stream: str = "sample") -> List[Dict[str, Any]]:
    """n records (tests and docs)."""
    g = TaxiGenerator(seed, stream)
    return [g.record() for _ in range(n)]
