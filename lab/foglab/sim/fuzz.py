"""Hostile-input fuzzer for the inbox decoder, the FIFO channel and every protocol core (issue #10).

Rules of this file: sans-IO and seeded. Every input is generated from its own
`random.Random(f"{seed}:{target}:{index}")`, so a failure is reproduced by `replay(target, seed,
index)` without running the inputs before it; the reachable states the cores are fuzzed in are
built once per target from the same seed by driving real rounds (the scaling checker's `System`,
the GME cores' own API), never from hand-written dicts. No clock in the logic: the driver only
times targets for the report, and the optional hang watchdog is a SIGALRM in the caller's thread.

Why: a worker's inbox is an MQTT topic anybody on the broker can publish to, and a peer can be
buggy, restarted or simply late. The property checked, for every target and every input:

- decoders (`envelope.decode`, `messages.from_json`/`from_dict`, `gme_base.message_from_dict`,
  the guarded inbox codec) either return a valid value (which re-encodes to the same bytes or
  round-trips to an equal message) or raise their documented error (`MalformedEnvelope`,
  `RemoteProtocolError`), nothing else;
- `channel.Inbound` never raises and delivers each sender's envelopes in increasing
  (epoch, seq) order, at most once, without gaps unless it counted a skipped gap;
- the cores (`ScalingCore`, `GuardedCore`, `FgmeNode`, `Ra1Node`, `Ra2Node`), each in many
  states reached by real rounds, handle any decoded message from any sender (their own id,
  unknown ids, ids of other stages, departed instances) either by returning well-formed outputs
  or by raising `RemoteProtocolError` with the state left exactly as it was (compared field by
  field, recursively, before and after); anything else is a crash.

A target's `one(rng)` runs one input: it returns True (accepted) or False (rejected with the
expected error) and raises `PropertyViolation` when the property fails; any other exception is a
crash. `run_target` counts these; `run_all` splits a budget over every target.

Why one module: one target per parser of bus input (about thirty), each a few
lines of input generation and its property; they share the runner and the generators.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
import logging
import random
import signal
import threading
import time
import traceback
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Type

from agent.policy.decentralized import Action, ScalingParams
from agent.protocol.errors import RemoteProtocolError
from agent.protocol.gme_base import Entered, GmeMessage, GmeNode, GmeState, message_from_dict
from agent.protocol.gme_base import Send as GmeSend
from agent.protocol.messages import Message, from_dict, from_json
from agent.protocol.scaling import DeletionMode, Effect, InstanceState, ScalingCore, Send
from agent.dataplane.channel import Inbound
from agent.dataplane.envelope import Envelope, Kind, MalformedEnvelope, decode, encode, encode_data

__all__ = [
    "Failure",
    "TargetStats",
    "PropertyViolation",
    "Target",
    "TARGETS",
    "make_target",
    "run_target",
    "run_all",
    "replay",
    "fingerprint",
]

MAX_FAILURES_KEPT = 5  # per target: enough to debug, bounded memory on a broken core


class PropertyViolation(Exception):
    """The input was handled without the expected error, but the property failed (state changed
    on error, an invalid value accepted, an out-of-order delivery...)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class Hang(BaseException):
    """Raised by the watchdog inside a target that did not return in time (BaseException so that
    a core's `except Exception` cannot swallow it)."""


@dataclass
class Failure:
    target: str
    index: int
    kind: str  # "crash", "hang" or a PropertyViolation kind
    error: str
    input: str  # repr of the input, shortened
    trace: str = ""

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class TargetStats:
    target: str
    inputs: int = 0
    accepted: int = 0
    rejected: int = 0  # with the documented error, state unchanged
    crashes: int = 0  # unexpected exception, hang, or property violation
    seconds: float = 0.0  # reporting only
    extra: Dict[str, int] = field(default_factory=dict)
    failures: List[Failure] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.inputs / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> Dict[str, Any]:
        return {
            "target": self.target, "inputs": self.inputs, "accepted": self.accepted,
            "rejected": self.rejected, "crashes": self.crashes, "seconds": round(self.seconds, 3),
            "inputs_per_s": round(self.rate, 1), "extra": dict(self.extra),
            "failures": [f.to_dict() for f in self.failures],
        }


# ---- state comparison -----------------------------------------------------------------------------


def fingerprint(obj: Any, _depth: int = 0) -> Any:
    """A hashable, comparable deep value of `obj` (objects by their fields, recursively).

    Why not `snapshot()`/`key()` alone: they list the fields their authors thought of; a core
    that changes a field outside them on an error would pass. Floats go by `repr` so a NaN
    compares equal to itself.
    """
    if _depth > 50:
        return ("<deep>",)
    d = _depth + 1
    if obj is None or isinstance(obj, (bool, int, str, bytes, enum.Enum)):
        return obj
    if isinstance(obj, float):
        return ("float", repr(obj))
    if isinstance(obj, dict):
        return ("dict", frozenset((fingerprint(k, d), fingerprint(v, d)) for k, v in obj.items()))
    if isinstance(obj, (set, frozenset)):
        return ("set", frozenset(fingerprint(v, d) for v in obj))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(fingerprint(v, d) for v in obj))
    fields = getattr(obj, "__dict__", None)
    if fields is not None:
        return (type(obj).__name__, fingerprint(fields, d))
    slots = getattr(type(obj), "__slots__", None)
    if slots is not None:
        return (type(obj).__name__, tuple(fingerprint(getattr(obj, s, None), d) for s in slots))
    return (type(obj).__name__, repr(obj))


def _short(v: Any, limit: int = 300) -> str:
    try:
        text = repr(v)
    except Exception as exc:  # noqa: BLE001 - a hostile value may not even repr
        text = f"<unrepresentable {type(v).__name__}: {exc!r}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- hostile values ------------------------------------------------------------------------------

_NAN = float("nan")
_INF = float("inf")
# Values of the wrong type (or the right type with a hostile value) for any field.
HOSTILE: Tuple[Any, ...] = (
    None, True, False, 0, -1, 1, 2**31, 2**63, 2**64 + 1, 10**40, -(10**40), 1.5, 0.0, _NAN, _INF, -_INF,
    "", "x", "0", "1", "\x00", "\ud800", "é" * 3, "a" * 300, [], [1], ["a", "a"], [[]], {}, {"a": 1},
    [None], [True], {"type": "start"},
)


def _hostile(rng: random.Random) -> Any:
    return copy.deepcopy(rng.choice(HOSTILE))


def _deep(rng: random.Random) -> Any:
    """A deeply nested value, as deep as `envelope.decode` lets through (it keeps a margin of
    stack frames, so nothing deeper reaches a codec from the wire; deeper documents are tried
    as bytes by `_pathological`)."""
    depth = rng.choice((10, 100, 500, 850))
    v: Any = rng.choice(([], {}, 1))
    for _ in range(depth):
        v = [v] if rng.random() < 0.5 else {"a": v}
    return v


def _mutate_value(rng: random.Random, v: Any) -> Any:
    """One structural mutation somewhere inside a JSON-like value."""
    if isinstance(v, dict) and v and rng.random() < 0.8:
        v = dict(v)
        k = rng.choice(sorted(v, key=str))
        r = rng.random()
        if r < 0.15:
            del v[k]
        elif r < 0.25:
            v[rng.choice(("extra", "type", "sender", "kind", "", "1"))] = _hostile(rng)
        elif r < 0.6:
            v[k] = _hostile(rng)
        else:
            v[k] = _mutate_value(rng, v[k])
        return v
    if isinstance(v, (list, tuple)) and v and rng.random() < 0.8:
        v = list(v)
        i = rng.randrange(len(v))
        r = rng.random()
        if r < 0.15:
            del v[i]
        elif r < 0.25:
            v.insert(i, _hostile(rng))
        elif r < 0.35:
            v.append(v[i])  # shared, never mutated in place (every mutation copies its path)
        elif r < 0.65:
            v[i] = _hostile(rng)
        else:
            v[i] = _mutate_value(rng, v[i])
        return v
    if isinstance(v, int) and not isinstance(v, bool) and rng.random() < 0.5:
        return v + rng.choice((-1, 1, 2**64, -(2**64)))
    return _deep(rng) if rng.random() < 0.05 else _hostile(rng)


def _mutate_bytes(rng: random.Random, raw: bytes) -> bytes:
    b = bytearray(raw)
    for _ in range(rng.choice((1, 1, 2, 3, 8))):
        r = rng.random()
        i = rng.randrange(len(b) + 1)
        if r < 0.35 and b:
            i = min(i, len(b) - 1)
            b[i] ^= 1 << rng.randrange(8)
        elif r < 0.6:
            b[i:i] = bytes([rng.choice((0x00, 0x22, 0x5B, 0x5D, 0x7B, 0x7D, 0x2C, 0x80, 0xFF, 0xC3, 0x30, 0x2D))])
        elif r < 0.8 and b:
            del b[min(i, len(b) - 1)]
        else:
            j = rng.randrange(len(b) + 1)
            b[i:i] = bytes(b[j:j + rng.randrange(1, 16)])
    return bytes(b)


def _dumps(v: Any) -> bytes:
    """JSON with raw non-ASCII (and lone surrogates passed through as bytes, i.e. invalid UTF-8).
    A value too deep for the encoder becomes a too-deep document: still an input worth trying."""
    try:
        return json.dumps(v, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
    except RecursionError:
        return b"[" * 5000 + b"]" * 5000


def _pathological(rng: random.Random) -> bytes:
    """Inputs a generic mutator rarely builds: huge numbers, deep nesting, invalid UTF-8."""
    r = rng.randrange(8)
    if r == 0:
        return b"[1,\"a\",0," + b"9" * rng.choice((20, 4300, 5000)) + b",\"a\",[0,1]]"
    if r == 1:
        depth = rng.choice((500, 990, 1000, 5000, 100_000))
        return b"[1,\"a\",0,1,\"d\"," + b"[" * depth + b"]" * depth + b"]"
    if r == 2:
        return b"[1,\"\xff\xfe\",0,1,\"a\",[0,1]]"
    if r == 3:
        return b"[1,\"a\",NaN,1,\"a\",[Infinity,-Infinity]]"
    if r == 4:
        return b"[1,\"a\",0,1,\"p\",{\"type\":\"start\",\"sender\":\"\\ud800\",\"stage\":1e400}]"
    if r == 5:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
    if r == 6:
        return b"\xef\xbb\xbf[1,\"a\",0,1,\"a\",[0,1]]"  # a BOM
    return b"[1,\"a\",0,1,\"d\",{\"k\":[\"x\",\"x\"],\"r\":[[\"s\",1,[1,2]]]}]"


# ---- targets ---------------------------------------------------------------------------------------


class Target:
    """One fuzz target. `prepare(seed)` builds its corpus and states; `one(rng)` runs one input."""

    name: str = "?"
    last_input: Any = None

    def prepare(self, seed: int) -> None:
        pass

    def one(self, rng: random.Random) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def extra(self) -> Dict[str, int]:
        return {}


def _is_uint(v: Any, low: int = 0) -> bool:
    return type(v) is int and v >= low


class EnvelopeTarget(Target):
    """`envelope.decode` on random bytes, byte-mutated and field-mutated valid envelopes."""

    name = "envelope"

    def __init__(self, decoder: Callable[[Any], Envelope] = decode) -> None:
        self.decoder = decoder
        self.corpus: List[bytes] = []
        self.values: List[Any] = []

    def prepare(self, seed: int) -> None:
        rng = random.Random(f"{seed}:envelope:corpus")
        recs = [
            {"medallion": f"m{i}", "fare": 1.5 * i, "pax": i, "ok": True, "tip": None} for i in range(4)
        ]
        self.corpus = [
            encode_data("src-0", 0, 1, [("src-0", i, r) for i, r in enumerate(recs)]),  # compact form
            encode_data("src-0", 2, 7, [("src-0", 0, 1), ("src-1", 5, "text"), ("s", 9, [1, {"a": 2}])]),
            encode_data("v-1", 0, 3, []),
            encode_data("v-1", 0, 4, [("src-0", 3, {"a": 1}), ("src-0", 4, {"a": 2})], {"src-0": 3, "src-1": 0}),
            encode(Envelope("v-1", 1, 2, Kind.ACK, [0, 5])),
            encode(Envelope("s1i0", 0, 4, Kind.PROTO, {"type": "duplication", "sender": "s1i0", "stage": 1,
                                                       "round": 2, "new_instances": ["op1-ab"]})),
            encode(Envelope("s1i0", 0, 5, Kind.PROTO, {"type": "lock", "sender": "s1i0", "boundary": 0,
                                                       "inner": {"kind": "req", "sender": "s1i0", "clock": 3,
                                                                 "epoch": 1}})),
        ]
        self.values = [json.loads(c) for c in self.corpus]
        rng.shuffle(self.corpus)

    def _input(self, rng: random.Random) -> Any:
        r = rng.random()
        if r < 0.08:
            return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 80)))
        if r < 0.4:
            return _mutate_bytes(rng, rng.choice(self.corpus))
        if r < 0.9:
            v = rng.choice(self.values)
            for _ in range(rng.choice((1, 1, 2, 3))):
                v = _mutate_value(rng, v)
            raw = _dumps(v)
            return _mutate_bytes(rng, raw) if rng.random() < 0.1 else raw
        if r < 0.95:
            return _pathological(rng)
        return rng.choice((_dumps(rng.choice(self.values)).decode("utf-8", "replace"), bytearray(rng.choice(self.corpus))))

    def one(self, rng: random.Random) -> bool:
        raw = self.last_input = self._input(rng)
        try:
            env = self.decoder(raw)
        except MalformedEnvelope:
            return False
        _check_envelope(env)
        return True


def _check_envelope(env: Envelope) -> None:
    """What `decode` promises about an envelope it returns (the worker relies on each of these)."""
    if not isinstance(env, Envelope):
        raise PropertyViolation("invalid_accepted", f"decode returned {type(env).__name__}")
    if type(env.sender) is not str or not env.sender:
        raise PropertyViolation("invalid_accepted", f"sender {env.sender!r}")
    if not _is_uint(env.epoch) or not _is_uint(env.seq, 1):
        raise PropertyViolation("invalid_accepted", f"epoch/seq {env.epoch!r}/{env.seq!r}")
    if env.kind is Kind.DATA:
        if type(env.body) is not list:
            raise PropertyViolation("invalid_accepted", f"data body {type(env.body).__name__}")
        for it in env.body:
            if type(it) is not tuple or len(it) != 3 or type(it[0]) is not str or not _is_uint(it[1]):
                raise PropertyViolation("invalid_accepted", f"data item {_short(it)}")
    elif env.kind is Kind.ACK:
        if type(env.body) is not tuple or len(env.body) != 2 or not all(_is_uint(x) for x in env.body):
            raise PropertyViolation("invalid_accepted", f"ack body {_short(env.body)}")
    elif env.kind is Kind.PROTO:
        if type(env.body) is not dict:
            raise PropertyViolation("invalid_accepted", f"proto body {type(env.body).__name__}")
    else:
        raise PropertyViolation("invalid_accepted", f"kind {env.kind!r}")
    # What we accepted must be something we can send on again (a data batch is re-encoded by
    # every operator that forwards it): encode -> decode -> encode is stable.
    raw = encode(env)
    again = decode(raw)
    if encode(again) != raw:
        raise PropertyViolation("unstable_reencode", f"{_short(raw)}")


class ChannelTarget(Target):
    """`channel.Inbound` fed arbitrary (epoch, seq) orders from a few senders, with duplicates,
    stale epochs, gaps, a small reorder bound, and snapshot/restore in the middle."""

    name = "channel"

    def __init__(self) -> None:
        self.counts = {"envelopes": 0, "delivered": 0, "dropped": 0, "gaps_skipped": 0}

    def extra(self) -> Dict[str, int]:
        return dict(self.counts)

    def _script(self, rng: random.Random) -> Tuple[bool, List[Tuple[str, int, int]]]:
        """(clean, script): a clean script holds every seq 1..k of one epoch per sender."""
        senders = ["a", "b", "c"][: rng.randint(1, 3)]
        clean = rng.random() < 0.4
        out: List[Tuple[str, int, int]] = []
        if clean:
            # clean: each sender sends 1..k in one epoch, the broker permutes and duplicates
            for s in senders:
                k = rng.randint(1, 25)
                out += [(s, 0, q) for q in range(1, k + 1)]
                out += [(s, 0, rng.randint(1, k)) for _ in range(rng.randint(0, 5))]
            rng.shuffle(out)
        else:
            for _ in range(rng.randint(1, 60)):
                out.append((rng.choice(senders), rng.choice((0, 0, 0, 1, 1, 2, 7)), rng.choice((1, 1, 2, 3, 4, 5, 6, 9, 40))))
        return clean, out

    def one(self, rng: random.Random) -> bool:
        clean, script = self._script(rng)
        max_pending = rng.choice((2, 5, 10_000))
        clean = clean and max_pending == 10_000
        self.last_input = (max_pending, script)
        inbound = Inbound(max_pending=max_pending)
        last: Dict[str, Tuple[int, int]] = {}
        seen = set()
        delivered = 0
        restored_at = rng.randrange(len(script) + 1) if rng.random() < 0.2 else -1
        since_restore: Optional[set] = None  # senders delivered since a restore (None: no restore)
        for i, (s, e, q) in enumerate(script):
            if i == restored_at:
                # a restarted worker: snapshot through JSON, restore with resync (first seq seen)
                snap = json.loads(json.dumps(inbound.snapshot()))
                inbound = Inbound(max_pending=max_pending)
                inbound.restore(snap, resync=True)
                since_restore = set()
            gaps = inbound.gaps_skipped
            out = inbound.receive(Envelope(s, e, q, Kind.ACK, (0, 0)))
            skipped = inbound.gaps_skipped != gaps
            self.counts["envelopes"] += 1
            for o in out:
                key = (o.sender, o.epoch, o.seq)
                if key in seen:
                    raise PropertyViolation("duplicate_delivery", f"{key} delivered twice")
                seen.add(key)
                prev = last.get(o.sender)
                if prev is not None and (o.epoch, o.seq) <= prev:
                    raise PropertyViolation("reordered_delivery", f"{key} after {prev}")
                resynced = since_restore is not None and o.sender not in since_restore
                if not (skipped or resynced):
                    if prev is not None and o.epoch == prev[0] and o.seq != prev[1] + 1:
                        raise PropertyViolation("gap_delivery", f"{key} after {prev} without a counted gap")
                    if (prev is None or o.epoch != prev[0]) and o.seq != 1:
                        raise PropertyViolation("gap_delivery", f"{key} first of its epoch without a counted gap")
                if since_restore is not None:
                    since_restore.add(o.sender)
                last[o.sender] = (o.epoch, o.seq)
            delivered += len(out)
        self.counts["delivered"] += delivered
        self.counts["dropped"] += len(script) - delivered - inbound.waiting_total()
        self.counts["gaps_skipped"] += inbound.gaps_skipped
        if clean and restored_at < 0:
            want = {(s, 0, q) for s, _, q in script}
            if seen != want or inbound.waiting_total():
                raise PropertyViolation("lost_delivery", f"delivered {len(seen)} of {len(want)} distinct envelopes")
        return True


class ScalingCodecTarget(Target):
    """`messages.from_json` / `from_dict` on mutated real messages, random bytes, non-JSON objects."""

    name = "scaling_codec"

    def prepare(self, seed: int) -> None:
        self.corpus = [m.to_dict() for m in _scaling_corpus(seed)]

    def _input(self, rng: random.Random) -> Tuple[str, Any]:
        r = rng.random()
        if r < 0.05:
            return "json", bytes(rng.randrange(256) for _ in range(rng.randrange(0, 60)))
        d = rng.choice(self.corpus)
        if r < 0.15:
            return "dict", d
        for _ in range(rng.choice((1, 1, 2, 3))):
            d = _mutate_value(rng, d)
        if r < 0.55:
            raw = _dumps(d)
            return "json", _mutate_bytes(rng, raw) if rng.random() < 0.2 else raw
        if r < 0.6:
            return "dict", rng.choice((object(), {1, 2}, (1, 2), b"{}", 3.5, None, [d]))
        return "dict", d

    def one(self, rng: random.Random) -> bool:
        how, v = self.last_input = self._input(rng)
        try:
            m = from_json(v) if how == "json" else from_dict(v)
        except RemoteProtocolError:
            return False
        _check_scaling_message(m)
        return True


def _check_scaling_message(m: Any) -> None:
    if not isinstance(m, Message):
        raise PropertyViolation("invalid_accepted", f"decoded a {type(m).__name__}")
    try:
        again = from_dict(json.loads(m.to_json()))
        type(m)(**{f.name: getattr(m, f.name) for f in dataclasses.fields(m)})  # constructor checks
    except RemoteProtocolError as exc:
        raise PropertyViolation("invalid_accepted", f"{m!r} does not round-trip: {exc}") from None
    if again != m:
        raise PropertyViolation("invalid_accepted", f"{m!r} round-trips to {again!r}")


# -- reachable states of the scaling cores ----------------------------------------------------------


def _scaling_runs(seed: int, core_cls: Type[ScalingCore], guarded: bool) -> Tuple[List[ScalingCore], List[Message], List[str]]:
    """Drive small pipelines through random rounds (the checker's moves) and keep a copy of every
    distinct core state reached, every message sent, and every instance id seen."""
    from foglab.sim.checker import Plan, build_pipeline

    rng = random.Random(f"{seed}:scaling-runs:{core_cls.__name__}")
    states: Dict[Any, ScalingCore] = {}
    msgs: List[Message] = []
    ids: set = set()
    shapes = ((2, 2, 2), (1, 2, 1), (2, 3), (1, 1, 1, 1), (3, 1, 2))
    for run in range(24):
        sizes = shapes[run % len(shapes)]
        mode = DeletionMode.PAPER if (run % 4 == 3 and not guarded) else DeletionMode.TWO_PHASE
        sysm = build_pipeline(sizes, (), core_cls=core_cls, deletion_mode=mode)
        sysm.cow = False
        budget = rng.randint(2, 6)
        for _step in range(400):
            if budget and (rng.random() < 0.2 or not sysm.moves(frozenset())):
                active = sorted(i for i, c in sysm.cores.items() if c.state is InstanceState.ACTIVE)
                if active:
                    iid = rng.choice(active)
                    core = sysm.cores[iid]
                    act = Action.DUPLICATE if core.keeper or rng.random() < 0.5 else Action.TERMINATE
                    sysm.plans = sysm.plans | {Plan(iid, act, rng.choice((1, 1, 2)))}
                    budget -= 1
            moves = sysm.moves(frozenset())
            if not moves:
                if budget:
                    continue  # nothing in flight: start the next planned round
                break
            if sysm.apply(rng.choice(moves)):
                break  # a violation of the checker's own properties: not this fuzzer's business
            for iid in sysm.touched:
                c = sysm.cores[iid]
                k = c.key()
                if k not in states:
                    states[k] = c.clone()
            for q in sysm.channels.values():
                msgs.extend(q[-1:])
        ids.update(sysm.cores)
    ordered = [states[k] for k in sorted(states, key=repr)]
    return ordered, msgs[:2000], sorted(ids)


def _scaling_corpus(seed: int) -> List[Message]:
    _, msgs, _ = _scaling_runs(seed, ScalingCore, False)
    seen: Dict[str, Message] = {}
    for m in msgs:
        if isinstance(m, Message):
            seen.setdefault(m.to_json(), m)
    return [seen[k] for k in sorted(seen)]


def _pick(rng: random.Random, *pools: Sequence[Any]) -> Any:
    pool = [p for p in pools if p]
    return rng.choice(rng.choice(pool))


class _CoreTarget(Target):
    """Shared driver of the core targets: clone a reachable state, feed it 1-3 hostile messages,
    compare the whole state before and after every rejected one."""

    def __init__(self) -> None:
        self.states: List[Any] = []
        self.counts = {"codec_rejected": 0, "core_rejected": 0}

    def extra(self) -> Dict[str, int]:
        return dict(self.counts)

    def clone(self, state: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def message(self, rng: random.Random, core: Any) -> Any:
        """A decoded message (or raise RemoteProtocolError from the codec)."""
        raise NotImplementedError  # pragma: no cover

    def receive(self, core: Any, msg: Any) -> List[Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def check_outputs(self, core: Any, msg: Any, outs: Any) -> None:
        pass

    def one(self, rng: random.Random) -> bool:
        core = self.clone(rng.choice(self.states))
        trail: List[Any] = []
        self.last_input = (core, trail)
        accepted = False
        for _ in range(rng.choice((1, 1, 2, 3))):
            try:
                msg = self.message(rng, core)
            except RemoteProtocolError:
                self.counts["codec_rejected"] += 1
                continue
            trail.append(msg)
            before = fingerprint(core)
            try:
                outs = self.receive(core, msg)
            except RemoteProtocolError as exc:
                self.counts["core_rejected"] += 1
                if fingerprint(core) != before:
                    raise PropertyViolation("state_changed_on_error", f"{type(core).__name__} after {msg!r}: {exc}") from None
                continue
            self.check_outputs(core, msg, outs)
            accepted = True
        return accepted


_SCALING_KINDS = ("duplication", "duplication_ack", "start", "deletion", "deletion_ack", "data")


class ScalingCoreTarget(_CoreTarget):
    """`ScalingCore.handle` (or a subclass) in states reached by real rounds."""

    name = "scaling_core"
    guarded = False

    def __init__(self, core_cls: Type[ScalingCore] = ScalingCore) -> None:
        super().__init__()
        self.core_cls = core_cls
        self.params = ScalingParams()

    def prepare(self, seed: int) -> None:
        self.states, msgs, self.ids = _scaling_runs(seed, self.core_cls, self.guarded)
        self.msgs = [m.to_dict() for m in msgs if isinstance(m, Message)]
        self.ids = self.ids + ["unknown-9", "s9i9"]

    def clone(self, state: Any) -> Any:
        return state.clone()

    def _senders(self, core: ScalingCore) -> List[Any]:
        return [core.instance_id, core.creator or "", *sorted(core.succs), *sorted(core.preds),
                *sorted(core.pending), *core.new_siblings]

    def message(self, rng: random.Random, core: Any) -> Any:
        r = rng.random()
        if r < 0.25 and self.msgs:
            d = dict(rng.choice(self.msgs))  # a real message, re-aimed at this core
            if rng.random() < 0.7:
                d["sender"] = _pick(rng, self._senders(core), self.ids)
            if "round" in d and rng.random() < 0.5:
                d["round"] = core.round + rng.choice((-1, 0, 0, 1))
            if rng.random() < 0.5:
                d["stage"] = core.stage + rng.choice((-1, 1))
        else:
            d = self._random_dict(rng, core)
        if rng.random() < 0.1:
            d = _mutate_value(rng, d)
        return from_dict(d)

    def _random_dict(self, rng: random.Random, core: ScalingCore) -> Dict[str, Any]:
        kind = rng.choice(_SCALING_KINDS)
        sender = _pick(rng, self._senders(core), self.ids)
        stage = core.stage + rng.choice((-1, 1, -1, 1, 0, 2, -2))
        if rng.random() < 0.03:
            stage = rng.choice((-1, 2**64))
        d: Dict[str, Any] = {"type": kind, "sender": sender, "stage": stage}
        if kind in ("duplication", "duplication_ack", "deletion", "deletion_ack"):
            d["round"] = max(0, core.round + rng.choice((-1, 0, 0, 0, 1, 2))) if rng.random() < 0.95 else 2**64
        if kind == "duplication":
            pool = self.ids + [core.instance_id, "new-1", "new-2"]
            d["new_instances"] = rng.sample(pool, rng.randint(1, 3))
        elif kind == "start":
            d["succs"] = rng.sample(self.ids, rng.randint(0, 3))
            d["preds"] = rng.sample(self.ids, rng.randint(0, 3))
        elif kind == "data":
            d["seq"], d["count"] = rng.randint(0, 9), rng.randint(0, 9)
        return d

    def receive(self, core: Any, msg: Any) -> List[Any]:
        return core.handle(msg)

    def check_outputs(self, core: Any, msg: Any, outs: Any) -> None:
        if not isinstance(outs, list):
            raise PropertyViolation("bad_output", f"handle returned {type(outs).__name__}")
        for o in outs:
            if isinstance(o, Send):
                m = o.message
                if not isinstance(o.dest, str) or not o.dest or o.dest == core.instance_id:
                    raise PropertyViolation("bad_output", f"send to {o.dest!r} after {msg!r}")
                if isinstance(m, Message):
                    _check_scaling_message(m)
                elif not self.guarded:
                    raise PropertyViolation("bad_output", f"sends a {type(m).__name__} after {msg!r}")
            elif not isinstance(o, Effect):
                raise PropertyViolation("bad_output", f"output {o!r} after {msg!r}")
        # what a worker persists after a message must restore to the same state
        snap = json.loads(json.dumps(core.snapshot()))
        back = type(core).restore(snap, self.params)
        if back.key() != core.key():
            raise PropertyViolation("snapshot_mismatch", f"{core!r} restores as {back!r} after {msg!r}")


class GuardedTarget(ScalingCoreTarget):
    """`GuardedCore.handle` with scaling messages and 2-FGME lock messages of any boundary."""

    name = "guarded"
    guarded = True

    def __init__(self, core_cls: Optional[Type[ScalingCore]] = None) -> None:
        from agent.protocol.guarded import GuardedCore

        super().__init__(core_cls or GuardedCore)

    def _senders(self, core: Any) -> List[Any]:
        gone = [k for n in core.locks.values() for k in sorted(n.gone)]
        return super()._senders(core) + gone

    def message(self, rng: random.Random, core: Any) -> Any:
        if rng.random() < 0.5:
            return super().message(rng, core)
        from agent.protocol.guarded import LockMessage

        sender = _pick(rng, self._senders(core), self.ids)
        boundary = core.stage + rng.choice((-1, 0, -1, 0, 1, -2))
        node = core.locks.get(boundary) or next(iter(core.locks.values()))
        inner = _gme_dict(rng, "gme_fgme", node, sender)
        d: Dict[str, Any] = {"type": "lock", "sender": sender, "boundary": boundary, "inner": inner}
        if rng.random() < 0.1:
            d = _mutate_value(rng, d)
        decoder = getattr(LockMessage, "from_dict", None)
        if decoder is not None:
            return decoder(d)
        if not isinstance(sender, str) or not sender or type(boundary) is not int:  # pragma: no cover
            raise RemoteProtocolError("lock message: bad sender or boundary")
        return LockMessage(sender, boundary, message_from_dict(inner, "gme_fgme"))  # pragma: no cover


# -- GME cores -------------------------------------------------------------------------------------

_GME_FIELDS: Dict[str, Dict[str, Tuple[str, ...]]] = {
    "gme_fgme": {"req": ("clock", "epoch"), "ack": ("renew", "end", "epoch"), "end": ("clock",)},
    "gme_ra1": {"req": ("forum", "sn"), "ack": ("sn",)},
    "gme_ra2": {"req": ("forum", "sn", "k", "vf"), "ack": ("k", "vf"), "start": ("k", "vf")},
}


def _gme_dict(rng: random.Random, module: str, node: Any, sender: Any) -> Dict[str, Any]:
    """A message dict of `module`'s kinds with plausible, boundary and hostile field values."""
    kind = rng.choice(sorted(_GME_FIELDS[module]))
    d: Dict[str, Any] = {"kind": kind, "sender": sender}
    n = len(getattr(node, "groups", {})) or 2
    near = [getattr(node, a, 0) for a in ("lc", "epoch", "clock", "entries")]
    near = [v for v in near if type(v) is int]
    sn = getattr(node, "sn", None)
    if type(sn) is int:
        near.append(sn)
    vsn = getattr(node, "vsn", None)
    if vsn:
        near.extend(vsn)
    for f in _GME_FIELDS[module][kind]:
        r = rng.random()
        if f in ("renew", "end"):
            d[f] = rng.random() < 0.3 if r < 0.95 else _hostile(rng)
        elif f == "vf":
            length = n if rng.random() < 0.8 else rng.choice((0, n - 1, n + 1, n + 5))
            d[f] = [max(0, rng.choice(near or [0]) + rng.choice((-1, 0, 1))) for _ in range(length)]
            if rng.random() < 0.05:
                d[f] = _mutate_value(rng, d[f])
        elif f == "forum":
            d[f] = rng.choice((0, 1, 0, 1, 2, -1)) if r < 0.95 else _hostile(rng)
        else:
            base = rng.choice(near or [0])
            d[f] = max(0, base + rng.choice((-1, 0, 1, 1, 2))) if r < 0.9 else rng.choice((0, 2**64, 10**30)) if r < 0.95 else _hostile(rng)
    if rng.random() < 0.05:
        d = _mutate_value(rng, d)
    return d


def _gme_runs(seed: int, algorithm: str) -> Tuple[List[GmeNode], List[Tuple[str, Dict[str, Any]]]]:
    """Drive small GME systems through random schedules (requests, exits, FIFO deliveries) and
    keep a copy of every distinct node state reached and every message sent."""
    from foglab.sim.gme_check import make_nodes

    module = {"2fgme": "gme_fgme", "ra1": "gme_ra1", "ra2": "gme_ra2"}[algorithm]
    rng = random.Random(f"{seed}:gme-runs:{algorithm}")
    states: Dict[Any, GmeNode] = {}
    msgs: List[Tuple[str, Dict[str, Any]]] = []
    for run, sizes in enumerate(((2, 2), (3, 2), (1, 3), (2, 2), (3, 3), (1, 1))):
        nodes = make_nodes(algorithm, sizes)
        left = [rng.randint(1, 3) for _ in nodes]
        chan: Dict[Tuple[int, int], List[GmeMessage]] = {}
        for _step in range(600):
            ev: List[Tuple[str, int, int]] = []
            for nd in nodes:
                if nd.state is GmeState.IDLE and left[nd.id] > 0:
                    ev.append(("request", nd.id, -1))
                elif nd.state is GmeState.IN_CS:
                    ev.append(("exit", nd.id, -1))
            ev += [("deliver", a, b) for (a, b), q in sorted(chan.items()) if q]
            if not ev:
                break
            kind, a, b = rng.choice(ev)
            if kind == "request":
                left[a] -= 1
                src, outs = a, nodes[a].request()
            elif kind == "exit":
                src, outs = a, nodes[a].exit()
            else:
                src, outs = b, nodes[b].receive(chan[(a, b)].pop(0))
            for o in outs:
                if isinstance(o, GmeSend):
                    chan.setdefault((src, o.to), []).append(o.message)
                    msgs.append((module, o.message.to_dict()))
            nd = nodes[src]
            k = (run, nd.id, nd.snapshot())
            if k not in states:
                states[k] = copy.deepcopy(nd)
    ordered = [states[k] for k in sorted(states, key=repr)]
    return ordered, msgs[:3000]


class GmeCodecTarget(Target):
    """`gme_base.message_from_dict` for the three algorithms on mutated real messages."""

    name = "gme_codec"

    def prepare(self, seed: int) -> None:
        self.corpus: List[Tuple[str, Dict[str, Any]]] = []
        for alg in ("2fgme", "ra1", "ra2"):
            self.corpus += _gme_runs(seed, alg)[1][:500]

    def one(self, rng: random.Random) -> bool:
        module, d = rng.choice(self.corpus)
        if rng.random() < 0.2:
            module = rng.choice(sorted(_GME_FIELDS))
        v: Any = d
        for _ in range(rng.choice((0, 1, 1, 2, 3))):
            v = _mutate_value(rng, v)
        if rng.random() < 0.05:
            v = rng.choice((None, [], "req", 1, {1, 2}, b"{}"))
        self.last_input = (module, v)
        try:
            m = message_from_dict(v, module)
        except RemoteProtocolError:
            return False
        _check_gme_message(m, module)
        return True


def _check_gme_message(m: Any, module: str) -> None:
    """A decoded GME message has the field types its cores compare and add (ints, not bools or
    floats; bools; tuples of ints) and round-trips."""
    if not isinstance(m, GmeMessage):
        raise PropertyViolation("invalid_accepted", f"decoded a {type(m).__name__}")
    hints = typing.get_type_hints(type(m))
    for f in dataclasses.fields(m):
        v = getattr(m, f.name)
        want = hints.get(f.name)
        if f.name == "sender":
            ok = (type(v) is int) or (type(v) is str and bool(v))
        elif want is bool:
            ok = type(v) is bool
        elif want is int:
            ok = type(v) is int
        else:  # Tuple[int, ...]
            ok = type(v) is tuple and all(type(x) is int for x in v)
        if not ok:
            raise PropertyViolation("invalid_accepted", f"{m!r}: field {f.name} = {v!r}")
    if message_from_dict(json.loads(json.dumps(m.to_dict())), module) != m:
        raise PropertyViolation("invalid_accepted", f"{m!r} does not round-trip")


class GmeNodeTarget(_CoreTarget):
    """`receive` of a 2-FGME, RA1 or RA2 node in states reached by real schedules."""

    def __init__(self, algorithm: str, node_cls: Optional[type] = None) -> None:
        super().__init__()
        self.algorithm = algorithm
        self.name = {"2fgme": "fgme", "ra1": "ra1", "ra2": "ra2"}[algorithm]
        self.module = {"2fgme": "gme_fgme", "ra1": "gme_ra1", "ra2": "gme_ra2"}[algorithm]
        self.node_cls = node_cls

    def prepare(self, seed: int) -> None:
        states, msgs = _gme_runs(seed, self.algorithm)
        if self.node_cls is not None:
            for s in states:
                s.__class__ = self.node_cls
        self.states = states
        self.msgs = [d for _, d in msgs]

    def clone(self, state: Any) -> Any:
        return copy.deepcopy(state)

    def message(self, rng: random.Random, core: Any) -> Any:
        ids = sorted(core.groups)
        senders = [core.id, *ids, len(ids), len(ids) + 7, -1]
        module = self.module if rng.random() < 0.8 else rng.choice(sorted(_GME_FIELDS))
        if rng.random() < 0.3 and self.msgs and module == self.module:
            d = dict(rng.choice(self.msgs))
            if rng.random() < 0.7:
                d["sender"] = rng.choice(senders)
        else:
            d = _gme_dict(rng, module, core, rng.choice(senders) if rng.random() < 0.97 else _hostile(rng))
        return message_from_dict(d, module)

    def receive(self, core: Any, msg: Any) -> List[Any]:
        return core.receive(msg)

    def check_outputs(self, core: Any, msg: Any, outs: Any) -> None:
        if not isinstance(outs, list):
            raise PropertyViolation("bad_output", f"receive returned {type(outs).__name__}")
        for o in outs:
            if isinstance(o, GmeSend):
                if o.to not in core.groups or o.to == core.id:
                    raise PropertyViolation("bad_output", f"node {core.id} sends to {o.to!r} after {msg!r}")
                _check_gme_message(o.message, self.module)
            elif isinstance(o, Entered):
                if core.state is not GmeState.IN_CS:
                    raise PropertyViolation("bad_output", f"Entered in state {core.state} after {msg!r}")
            else:
                raise PropertyViolation("bad_output", f"output {o!r} after {msg!r}")


# ---- bus input of the agent and fogctl (issue #20, docs/security.md) ------------------------------
#
# Every payload an agent or fogctl reads from a topic it does not own: rpc requests and replies,
# node states, hosted and re-homed records, latency records and probes, events and decision
# histories, and the snapshot fogctl renders. The property: a parser returns a value of its
# documented shape or raises its documented error (a ValueError: wire.BusInputError, EventError);
# the latency core, refusing a probe, keeps its state; fogctl's views render any snapshot.


def _bus_input(rng: random.Random, corpus: Sequence[Any]) -> Any:
    """Bytes for a bus parser: mutated real payloads, deep and huge documents, random bytes."""
    r = rng.random()
    if r < 0.05:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 80)))
    if r < 0.1:
        return _pathological(rng)
    if r < 0.13:
        depth = rng.choice((33, 1000, 100_000))
        return rng.choice((b"[", b'{"a":')) * depth
    if r < 0.15:
        return b'{"op":"ping","x":"' + b"a" * rng.choice((300_000, 1_000_000)) + b'"}'
    v = rng.choice(corpus)
    if r < 0.25:
        return _dumps(v)
    for _ in range(rng.choice((1, 1, 2, 3))):
        v = _mutate_value(rng, v)
    raw = _dumps(v)
    return _mutate_bytes(rng, raw) if rng.random() < 0.15 else raw


def _bus_corpus_spec() -> Dict[str, Any]:
    return {"instance": "taxi.in_zone.0", "operator": "in_zone", "pipeline": "taxi",
            "pipeline_toml": "[pipeline]\nname = \"taxi\"\n", "succs": ["taxi.sink.0"],
            "preds": ["taxi.source.0"], "keeper": True, "active": True, "restart": False,
            "extra": {"capacity": 500.0}}


def _state_doc(node: str, i: int) -> Dict[str, Any]:
    return {"v": 1, "node": node, "ts": 1.7e9 + i, "cpu": 12.5, "memory": 40.0, "temperature": 51.0,
            "slots": 4, "free_slots": 3 - i % 2, "capacity": 500.0,
            "instances": [{"id": f"taxi.in_zone.{i}", "operator": "in_zone", "keeper": i == 0, "status": "active",
                           "load": 100.0, "capacity": 500.0, "pid": 4242, "phase": "active",
                           "lock": {"state": "idle", "boundaries": [{"boundary": "a|b", "state": "in"}]},
                           "stats": {"state": "active", "decisions": [
                               {"at": 1.7e9, "kind": "scale_out", "load": 420.0, "capacity": 500.0,
                                "new": ["in_zone-n1-1"]}]}}]}


class BusParserTarget(Target):
    """One parser of bus input: accepted values are checked by `check`, the documented error is
    a rejection, anything else a crash."""

    def __init__(self, name: str, parse: Callable[[Any], Any], corpus: Callable[[], List[Any]],
                 errors: Tuple[Type[BaseException], ...] = (ValueError,),
                 check: Optional[Callable[[Any], None]] = None) -> None:
        self.name = name
        self.parse = parse
        self._corpus = corpus
        self.corpus: List[Any] = []
        self.errors = errors
        self.check = check

    def prepare(self, seed: int) -> None:
        self.corpus = self._corpus()

    def one(self, rng: random.Random) -> bool:
        raw = self.last_input = _bus_input(rng, self.corpus)
        try:
            value = self.parse(raw)
        except self.errors:
            return False
        if self.check is not None:
            self.check(value)
        return True


def _rpc_request_corpus() -> List[Any]:
    return [{"op": "ping"}, {"op": "stop", "instance": "taxi.sink.0"},
            {"op": "set", "instance": "taxi.sink.0", "fields": {"service_time_ms": 5.0}},
            {"op": "spawn", "spec": _bus_corpus_spec(), "cause": "spawn", "from": "n1"},
            {"v": 1, "op": "scale", "operator": "in_zone", "delta": 2, "pipeline": "taxi"},
            {"v": 1, "op": "scale", "operator": "in_zone", "delta": -1, "pipeline": None, "instances": ["in_zone-3"]},
            {"v": 1, "op": "drain", "node": "n2"}, {"v": 1, "op": "undrain", "node": "n2"}]


def _check_rpc_request(body: Any) -> None:
    from agent.node import rpc

    if not isinstance(body, dict) or body.get("op") not in rpc.OPS:
        raise PropertyViolation("invalid_accepted", f"request {_short(body, 80)}")
    if body["op"] == "set" and (not isinstance(body.get("fields"), dict) or "event" in body["fields"]):
        raise PropertyViolation("invalid_accepted", "a set whose fields collide with the control line")
    if body["op"] in ("scale", "drain", "undrain"):
        from agent.control.rpc_schema import RequestError, parse_request

        try:  # what the daemon does next with it: RequestError (a ValueError) or a request
            parse_request(body)
        except RequestError:
            pass


def _check_reply(body: Any) -> None:
    if not isinstance(body, dict) or not isinstance(body.get("ok"), bool):
        raise PropertyViolation("invalid_accepted", f"reply {_short(body, 80)}")


def _parse_peer_state(raw: Any) -> Any:
    """What the daemon and `fog-agent deploy` do with a neighbour's retained state."""
    from agent.node import nodestate

    doc = nodestate.parse_node_state(raw)
    return doc, nodestate.node_view(doc)


def _check_peer_state(value: Any) -> None:
    doc, view = value
    if not isinstance(view.slots, int) or not isinstance(view.free_slots, int) or not isinstance(doc["node"], str):
        raise PropertyViolation("invalid_accepted", f"state {_short(doc, 80)}")


def _check_hosted(value: Any) -> None:
    if not isinstance(value, list) or not all(isinstance(s, dict) and isinstance(s.get("instance"), str) for s in value):
        raise PropertyViolation("invalid_accepted", f"hosted {_short(value, 80)}")


def _check_rehomed(value: Any) -> None:
    if not isinstance(value, dict) or not all(isinstance(k, str) and type(v) is float for k, v in value.items()):
        raise PropertyViolation("invalid_accepted", f"re-homed {_short(value, 80)}")


def _parse_latency_record(raw: Any) -> Any:
    """The agent's and fogctl's readers of a retained latency record: lenient, they never raise;
    an unusable record reads as 'unmeasured' (a rejection here)."""
    from agent.control.fleet import parse_latency as fogctl_latency
    from agent.node import nodestate

    rtt = nodestate.parse_latency(raw)
    measured, emulated = fogctl_latency(raw)
    for m in (rtt, measured, emulated):
        if not all(isinstance(k, str) and type(v) is float for k, v in m.items()):
            raise PropertyViolation("invalid_accepted", f"latency {_short(m, 80)}")
    if not rtt and not measured and not emulated:
        raise ValueError("unmeasured")
    return rtt


def _event_corpus() -> List[Any]:
    from agent import events

    ev = events.decision(ts=1.7e9, node="n1", instance="taxi.in_zone.0", operator="in_zone", pipeline="taxi",
                         load=420.0, capacity=500.0, probability=0.3, draw=0.1, action="duplicate", count=1)
    base = {"v": 1, "ts": 1.7e9, "node": "n1", "instance": "taxi.in_zone.0", "operator": "in_zone",
            "pipeline": "taxi", "type": "scale_out",
            "reason": {"load": 420.0, "capacity": 500.0, "ratio": 0.84, "probability": 0.3, "draw": 0.1,
                       "action": "duplicate", "count": 1}, "detail": {"new": ["in_zone-n1-1"]}}
    out: List[Any] = [base, dict(base, type="spawned", reason=None, detail={"cause": "deploy"}), [base, base]]
    out.append(ev.to_dict())
    return out


def _parse_event_or_history(raw: Any) -> Any:
    from agent import events

    if raw.lstrip()[:1] == b"[":
        return events.parse_history(raw)
    return events.parse(raw)


def _check_events(value: Any) -> None:
    from agent import events

    for e in value if isinstance(value, list) else [value]:
        if not isinstance(e, events.Event) or not isinstance(e.node, str) or not e.node:
            raise PropertyViolation("invalid_accepted", f"event {_short(e, 80)}")
        e.to_json()  # what fogctl watch prints must encode and render
        from agent.fogctl.views import event_line

        event_line(e)


class LatencyProbeTarget(Target):
    """`LatencyCore.on_message` on pings and pongs with hostile payloads and senders: it answers
    (a pong to the topic's sender only) or raises ValueError with the core's state unchanged."""

    name = "latency_probe"

    def prepare(self, seed: int) -> None:
        from agent.measure.latency import LatencyCore

        self.cluster = "c"
        self.core = LatencyCore("b", self.cluster, period=1.0)
        self.core.set_neighbours(["a", "c1"])
        self.pings = self.core.poll(100.0)  # outstanding probes of b: real pongs are accepted
        self.corpus = [json.loads(p) for _, p in self.pings] + [{"o": "a", "t": "b", "n": 7, "s": 99.5}]
        self.base = copy.deepcopy(self.core)

    def one(self, rng: random.Random) -> bool:
        from agent import topics

        core = copy.deepcopy(self.base)
        if rng.random() < 0.2:  # a well-formed probe, on a consistent or a forged topic
            probe = dict(rng.choice(self.corpus))
            kind = rng.choice(("ping", "pong"))
            sender = str(probe["t"] if kind == "pong" else probe["o"]) if rng.random() < 0.7 else "mallory"
            if kind == "ping" and sender != "mallory":
                probe["t"] = "b"
            raw = json.dumps(probe).encode()
        else:
            sender = rng.choice(("a", "b", "c1", "mallory"))
            kind = rng.choice(("ping", "pong"))
            raw = _bus_input(rng, self.corpus)
        topic = (topics.latency_ping if kind == "ping" else topics.latency_pong)(self.cluster, "b", sender)
        self.last_input = (topic, raw)
        before = fingerprint(core)
        try:
            out = core.on_message(topic, raw, 100.05)
        except ValueError:
            if fingerprint(core) != before:
                raise PropertyViolation("state_changed_on_error", f"latency core after {_short(raw, 80)}") from None
            return False
        for t, _ in out:
            if t != topics.latency_pong(self.cluster, sender, "b"):
                raise PropertyViolation("reply_misdirected", f"pong to {t} for a ping from {sender}")
        return True


def _fogctl_views(raw: Any) -> Any:
    """fogctl's views of a snapshot where one node's retained state (or latency, status,
    pipeline) is hostile: they must render; a node whose state is unreadable shows its error."""
    from agent.fogctl import views
    from agent.control.fleet import Fleet, state_decisions

    msgs = {"fog/c/agents/n1/state": json.dumps(_state_doc("n1", 0)).encode(),
            "fog/c/agents/n1/status": b"online", "fog/c/agents/n2/status": b"online",
            "fog/c/pipelines/taxi": b'[pipeline]\nname = "taxi"\n[[operators]]\nname = "in_zone"\n'}
    slot = int.from_bytes(raw[:1] or b"\0", "big") % 4
    key = ("fog/c/agents/n2/state", "fog/c/latency/n2", "fog/c/agents/n2/status", "fog/c/pipelines/p2")[slot]
    msgs[key] = raw
    fleet = Fleet.from_messages("c", msgs)
    texts = [views.status(fleet, 1.7e9 + 5)[1], views.topology(fleet)[1], views.latency(fleet)[1],
             views.locks(fleet)[1], views.pipelines(fleet)[1]]
    for t in texts:
        if not isinstance(t, str):
            raise PropertyViolation("invalid_accepted", f"a view rendered {type(t).__name__}")
        json.dumps([views.status(fleet, 1.7e9)[0]], default=str)
    for e in state_decisions("c", "fog/c/agents/n2/state", raw):
        views.event_line(e)
    n2 = fleet.node("n2")
    if slot == 0 and (n2 is None or n2.error):
        raise ValueError("unreadable state shown as an error row")
    if slot == 1 and "n2" not in fleet.latency and "n2" not in fleet.emulated:
        raise ValueError("unreadable latency shown as unmeasured")
    if slot == 2 and (n2 is None or n2.status == "unknown"):
        raise ValueError("unreadable status shown as unknown")
    return texts


def _fogctl_corpus() -> List[Any]:
    return [_state_doc("n2", 1), {"node": "n2", "rtt_ms": {"n1": 1.5}, "emulated_ms": {"n1": 1.0}},
            {"status": "online"}, _state_doc("n2", 2)]


class DaemonTarget(Target):
    """The agent daemon's own message handling (`Agent._on_message`, without its safety net):
    any payload on any of its topics from any sender is handled without an exception; a message
    it counts as bad leaves its fleet knowledge exactly as it was; everything it publishes goes
    to the sender's reply namespace or pong topic, never to a topic a payload names. The agent
    never connects (its publishes are recorded) and has no free slot, so no worker starts."""

    name = "daemon"

    class _Recorder:
        def __init__(self) -> None:
            self.published: List[Tuple[str, Any]] = []

        def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, properties: Any = None) -> Any:
            self.published.append((topic, payload))
            return type("Info", (), {"rc": 0, "mid": 1})()

    def prepare(self, seed: int) -> None:
        import tempfile
        from pathlib import Path

        from agent.config import load_agent_config
        from agent.node.daemon import Agent

        self._dir = tempfile.TemporaryDirectory(prefix="fuzz-daemon-")
        conf = Path(self._dir.name) / "agent.toml"
        conf.write_text(f'[agent]\nnode = "me"\ncluster = "c"\nslots = 2\nstate_dir = "{self._dir.name}/state"\n'
                        '[mqtt]\nhost = "127.0.0.1"\nport = 1\n[metrics]\nport = 0\n')
        agent = Agent(load_agent_config(conf), warm_worker=False)
        agent.core.free_slots = lambda: 0  # type: ignore[method-assign]  # refuse, never start a worker
        agent.supervisor.start = None  # type: ignore[assignment]  # ... and prove it: calling it is a crash
        agent.bus.connected = True
        agent.bus.client = self._Recorder()
        # Connected, its retained records in (the sync marker came back): peer requests are handled
        # at once, not held. Held, they were answered by a later input that echoed the marker,
        # which the reply check then blamed on that input (found at 100k inputs: "reply_misdirected").
        agent.bus.retained_in = True
        agent.bus.marker = b"fog-sync-fuzz"
        spec = _bus_corpus_spec()
        self.corpus = _rpc_request_corpus() + [_state_doc("n2", 1), [spec], {"taxi.in_zone.0": 1.7e9},
                                               {"node": "n2", "rtt_ms": {"me": 1.0}}]
        for topic, doc in ((topics_mod().agent_state("c", "n2"), _state_doc("n2", 1)),
                           (topics_mod().agent_hosted("c", "n2"), [spec]),
                           (topics_mod().agent_status("c", "n2"), "online")):
            raw = doc.encode() if isinstance(doc, str) else json.dumps(doc).encode()
            # the fleet it knows before the hostile input: a neighbour n2
            agent.core._on_message(type("M", (), {"topic": topic, "payload": raw, "retain": True, "properties": None})(),
                                   0.0)
        self.core = agent.core  # what the inputs reach: the node's decisions
        self.base = self._knowledge()
        self.base_counters = dict(agent.core.counters)

    def _knowledge(self) -> Any:
        a = self.core
        return fingerprint((a.view.fleet, a.view.online, a.view.hosted_by_node, a.view.rehomed_by_node, a.view.latency, a.view.deployed,
                            a.drain.draining, a.rehoming.offline_since, a.view.reserved, sorted(a.spawns.calls)))

    def _restore(self) -> None:
        a, (fleet, online, hosted, rehomed, latency, deployed) = self.core, self._saved
        a.view.fleet, a.view.online, a.view.hosted_by_node, a.view.rehomed_by_node = copy.deepcopy(fleet), dict(online), \
            copy.deepcopy(hosted), copy.deepcopy(rehomed)
        a.view.latency, a.view.deployed, a.drain.draining = copy.deepcopy(latency), set(deployed), False
        a.rehoming.offline_since.clear()
        a.view.reserved.clear()
        a.requests.held.clear()
        a.bus.retained_in = True
        a.counters.clear()
        a.counters.update(self.base_counters)
        a.bus.client.published.clear()

    def one(self, rng: random.Random) -> bool:
        t = topics_mod()
        a = self.core
        if not hasattr(self, "_saved"):
            self._saved = (copy.deepcopy(a.view.fleet), dict(a.view.online), copy.deepcopy(a.view.hosted_by_node),
                           copy.deepcopy(a.view.rehomed_by_node), copy.deepcopy(a.view.latency), set(a.view.deployed))
        self._restore()
        sender = rng.choice(("adm", "n2", "n3", "me"))
        build = rng.choice((
            lambda: t.agent_rpc("c", "me", sender), lambda: t.agent_peer("c", "me", sender),
            lambda: t.replies("c", "me", sender), lambda: t.agent_state("c", sender),
            lambda: t.agent_hosted("c", sender), lambda: t.agent_rehomed("c", sender),
            lambda: t.agent_status("c", sender), lambda: t.latency("c", sender),
            lambda: t.latency_ping("c", "me", sender), lambda: t.latency_pong("c", "me", sender),
            lambda: t.pipeline("c", sender)))
        topic = build()
        raw = _bus_input(rng, self.corpus)
        retain = rng.random() < 0.2
        props = type("P", (), {"CorrelationData": rng.choice((b"k", None, b"\xff" * 3)),
                               "ResponseTopic": "fog/c/agents/n2/status"})()
        msg = type("M", (), {"topic": topic, "payload": raw, "retain": retain, "properties": props})()
        self.last_input = (topic, retain, raw)
        before = self._knowledge()
        logging.disable(logging.CRITICAL)  # its one line per refused message: not for the bench's output
        try:
            a._on_message(msg, 1.0)
        finally:
            logging.disable(logging.NOTSET)
        for out, _ in a.bus.client.published:
            if out not in (t.replies("c", sender, "me"), t.latency_pong("c", sender, "me")):
                raise PropertyViolation("reply_misdirected", f"{out} for a message from {sender} on {topic}")
        refused = a.counters["bad_messages"] + a.counters["retained_ignored"] + a.counters["peer_refused"] \
            > sum(self.base_counters[k] for k in ("bad_messages", "retained_ignored", "peer_refused"))
        if refused and self._knowledge() != before:
            raise PropertyViolation("state_changed_on_error", f"after a refused message on {topic}")
        return not refused


def topics_mod() -> Any:
    from agent import topics

    return topics


BUS_TARGETS: Tuple[str, ...] = (
    "rpc_request", "rpc_reply", "node_state", "hosted", "rehomed", "latency_record", "latency_probe",
    "events", "fogctl_views", "daemon",
)


def _bus_target(name: str) -> Target:
    from agent.node import rehome
    from agent.node import rpc

    if name == "latency_probe":
        return LatencyProbeTarget()
    if name == "daemon":
        return DaemonTarget()
    table: Dict[str, Tuple[Callable[[Any], Any], Callable[[], List[Any]], Optional[Callable[[Any], None]]]] = {
        "rpc_request": (rpc.decode_request, _rpc_request_corpus, _check_rpc_request),
        "rpc_reply": (rpc.decode_reply, lambda: [{"ok": True, "instance": "i", "node": "n1"},
                                                 {"ok": False, "error": "no free slot"},
                                                 {"v": 1, "ok": True, "result": {"instances": ["a"]}}], _check_reply),
        "node_state": (_parse_peer_state, lambda: [_state_doc("n1", 0), _state_doc("n2", 1)], _check_peer_state),
        "hosted": (rehome.decode_hosted, lambda: [[_bus_corpus_spec()], [], [_bus_corpus_spec(), _bus_corpus_spec()]],
                   _check_hosted),
        "rehomed": (rehome.decode_rehomed, lambda: [{"taxi.in_zone.0": 1.7e9, "in_zone-n1-2": 1.7e9 + 1}, {}],
                    _check_rehomed),
        "latency_record": (_parse_latency_record, lambda: [{"node": "n1", "ts": 1.0, "rtt_ms": {"n2": 1.5},
                                                            "emulated_ms": {"n2": 1.0}}, {"n2": 3.0}], None),
        "events": (_parse_event_or_history, _event_corpus, _check_events),
        "fogctl_views": (_fogctl_views, _fogctl_corpus, None),
    }
    parse, corpus, check = table[name]
    return BusParserTarget(name, parse, corpus, (ValueError,), check)


# ---- registry and drivers --------------------------------------------------------------------------

TARGETS: Tuple[str, ...] = (
    "envelope", "channel", "scaling_codec", "scaling_core", "gme_codec", "fgme", "ra1", "ra2", "guarded",
) + BUS_TARGETS


def make_target(name: str) -> Target:
    factories: Dict[str, Callable[[], Target]] = {
        "envelope": EnvelopeTarget,
        "channel": ChannelTarget,
        "scaling_codec": ScalingCodecTarget,
        "scaling_core": ScalingCoreTarget,
        "gme_codec": GmeCodecTarget,
        "fgme": lambda: GmeNodeTarget("2fgme"),
        "ra1": lambda: GmeNodeTarget("ra1"),
        "ra2": lambda: GmeNodeTarget("ra2"),
        "guarded": GuardedTarget,
    }
    if name in BUS_TARGETS:
        return _bus_target(name)
    if name not in factories:
        raise ValueError(f"unknown fuzz target {name!r}; expected one of {list(TARGETS)}")
    return factories[name]()


def _input_rng(seed: int, name: str, index: int) -> random.Random:
    return random.Random(f"{seed}:{name}:{index}")


class _Watchdog:
    """SIGALRM after `seconds` raises `Hang` in the fuzzed code (main thread only; else a no-op)."""

    def __init__(self, seconds: Optional[float]) -> None:
        self.seconds = seconds if seconds and threading.current_thread() is threading.main_thread() else None
        self._old: Any = None

    def __enter__(self) -> "_Watchdog":
        if self.seconds:
            self._old = signal.signal(signal.SIGALRM, self._fire)
        return self

    @staticmethod
    def _fire(signum: int, frame: Any) -> None:  # noqa: ARG004
        raise Hang("input did not return in time")

    def arm(self) -> None:
        if self.seconds:
            signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def disarm(self) -> None:
        if self.seconds:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def __exit__(self, *exc: Any) -> None:
        if self.seconds:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._old)


def run_target(
    target: Target,
    inputs: int,
    seed: int = 0,
    *,
    start: int = 0,
    hang_seconds: Optional[float] = None,
    progress: Optional[Callable[[TargetStats], None]] = None,
    progress_every: int = 5000,
) -> TargetStats:
    """Run inputs `start .. start+inputs-1` of `target` (prepared here from `seed`)."""
    stats = TargetStats(target.name)
    t0 = time.perf_counter()
    target.prepare(seed)
    with _Watchdog(hang_seconds) as dog:
        for index in range(start, start + inputs):
            rng = _input_rng(seed, target.name, index)
            target.last_input = None
            kind, err, tb = "", "", ""
            try:
                # armed inside the try: on a loaded machine the alarm can fire before the
                # first line of the target runs, and must then count as this input's hang
                dog.arm()
                try:
                    ok = target.one(rng)
                finally:
                    dog.disarm()
                if ok:
                    stats.accepted += 1
                else:
                    stats.rejected += 1
            except PropertyViolation as exc:
                kind, err = exc.kind, exc.detail
            except Hang as exc:
                kind, err = "hang", str(exc)
            except Exception as exc:  # noqa: BLE001 - this is what we are looking for
                kind, err, tb = "crash", f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=8)
            stats.inputs += 1
            if kind:
                stats.crashes += 1
                if len(stats.failures) < MAX_FAILURES_KEPT:
                    stats.failures.append(Failure(target.name, index, kind, err[:500],
                                                  _short(target.last_input, 600), tb))
            if progress is not None and stats.inputs % progress_every == 0:
                stats.seconds = time.perf_counter() - t0
                progress(stats)
    stats.seconds = time.perf_counter() - t0
    stats.extra = target.extra()
    return stats


def run_all(
    inputs: int = 100_000,
    seed: int = 0,
    *,
    targets: Sequence[str] = TARGETS,
    hang_seconds: Optional[float] = None,
    progress: Optional[Callable[[TargetStats], None]] = None,
) -> List[TargetStats]:
    """Split `inputs` evenly over `targets` (the first ones take the remainder)."""
    per, rest = divmod(inputs, len(targets))
    out = []
    for i, name in enumerate(targets):
        n = per + (1 if i < rest else 0)
        out.append(run_target(make_target(name), n, seed, hang_seconds=hang_seconds, progress=progress))
    return out


def replay(name: str, seed: int, index: int) -> Any:
    """Re-run one input (from a Failure's target/index) and let its exception propagate."""
    target = make_target(name)
    target.prepare(seed)
    return target.one(_input_rng(seed, name, index))


def iter_failures(results: Sequence[TargetStats]) -> Iterator[Failure]:
    for r in results:
        yield from r.failures

