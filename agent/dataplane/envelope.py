"""The wire format of an instance inbox: every message is one numbered envelope.

Why one envelope for data, acks and protocol messages: docs/design.md invariant 1 (FIFO channel) needs
a `deletion_ack` to be handled after every data batch its sender sent before it. MQTT orders
messages only per topic and publisher and may redeliver after a reconnect, so the receiver orders
by our own number instead: `seq` counts every envelope a sender sent to one destination (all
kinds share the counter), and `epoch` is the sender's incarnation (bumped when a crashed worker
is restarted with the same identity, so its numbering can start over without looking like a
stream of duplicates).

Encoding (JSON, inspectable with mosquitto_sub; measured in `bench dataplane`):

    [1, sender, epoch, seq, kind, body]

    kind "d" (data):  body = [[source_instance, source_seq, record], ...]  (record id end to end)
                      or, when all records are dicts with the same keys (see encode_data),
                      {"k": [keys], "r": [[source_instance, source_seq, [values]], ...]};
                      optionally a 7th element, the floors {source_instance: n}: every record
                      of that source numbered below n has been acked end to end (applied by
                      every operator downstream, or filtered before it; agent.instance.applied);
                      optionally an 8th, the sender's watermark `[ms, idle]` after this batch's
                      records (the 7th is then the floors or {}; agent.dataplane.watermarks).
                      An empty body is a replay marker (agent.instance.replays).
    kind "a" (ack):   body = [epoch, seq]: every data envelope the receiver got from the data
                      sender's incarnation `epoch` up to `seq` is processed AND forwarded AND acked
                      by the next hop in turn (cumulative; the flow-control credit comes back with
                      it). The epoch keeps an ack meant for a crashed incarnation from releasing
                      its successor's batches.
    kind "p" (proto): body = a scaling protocol message as a dict (agent.protocol.messages)

Decoding never trusts the bytes: anything malformed raises `MalformedEnvelope`, which the worker
counts, logs once per sender and skips (invariant 5: nothing dropped silently).
"""

from __future__ import annotations

import json
import re
import reprlib
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional, Tuple, Union

from agent.dataplane.watermarks import Mark, mark_json, parse_mark

__all__ = [
    "VERSION",
    "Kind",
    "RecordId",
    "Item",
    "Envelope",
    "MalformedEnvelope",
    "encode",
    "decode",
    "encode_data",
    "data_body_bytes",
    "Passed",
    "Row",
    "LAZY",
    "built",
]

VERSION = 1

RecordId = Tuple[str, int]
# One record on the data path: (source instance, source sequence, record). The record itself is a
# JSON value (dict for the taxi schema); the id travels next to it, never inside it, so operators
# cannot lose or forge it.
Item = Tuple[str, int, Any]


class Kind(Enum):
    DATA = "d"
    ACK = "a"
    PROTO = "p"


_KINDS = {k.value: k for k in Kind}


class MalformedEnvelope(ValueError):
    """The bytes on an inbox are not a valid envelope; says what was expected and found."""


@dataclass(frozen=True)
class Envelope:
    sender: str
    epoch: int
    seq: int
    kind: Kind
    body: Any
    # The bytes a data envelope was decoded from (a sink may spill the batch as received,
    # without re-encoding it: see `data_body_bytes`); None for envelopes built in memory.
    raw: Optional[bytes] = field(default=None, compare=False, repr=False)
    floors: Optional[Dict[str, int]] = None  # data only: see the module docstring
    watermark: Optional[Mark] = None  # data only: the sender's mark after these records

    def __post_init__(self) -> None:
        if not isinstance(self.sender, str) or not self.sender:
            raise ValueError(f"sender: expected a non-empty string, found {self.sender!r}")
        if _bad_int(self.epoch, 0) or _bad_int(self.seq, 1):
            raise ValueError(f"epoch/seq: expected integers >= 0/>= 1, found {self.epoch!r}/{self.seq!r}")

    @property
    def records(self) -> List[Item]:
        """The items of a data envelope (validated by `decode`)."""
        return self.body  # type: ignore[no-any-return]


def built(sender: str, epoch: int, seq: int, kind: Kind, body: Any,
          floors: Optional[Dict[str, int]] = None, watermark: Optional[Mark] = None) -> Envelope:
    """An envelope the instance builds itself for a chained hand-off (its own id, epoch and
    next number: valid by construction): the same object `Envelope(...)` gives, without the
    checks and the frozen dataclass's per-field `object.__setattr__` (7 of them), which were
    ~7% of a chain's CPU (sampled; docs/measurement.md). Never for anything decoded."""
    env = object.__new__(Envelope)
    env.__dict__.update(sender=sender, epoch=epoch, seq=seq, kind=kind, body=body, raw=None, floors=floors,
                        watermark=watermark)
    return env


def _bad_int(v: Any, low: int) -> bool:
    return isinstance(v, bool) or not isinstance(v, int) or v < low


_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, check_circular=False).encode
_loads = json.loads


# Hostile input (docs/hostile-input.md). Stack frames that decoding keeps free: JSON nested so
# deep that it only just parses cannot be encoded again a few frames deeper (a worker forwarding
# a record re-encodes it: RecursionError, the worker dies). Parsing that many frames deeper than
# the caller rejects such input here instead. Costs ~5 us, so only for inputs long enough to
# nest that deep (a nesting level takes 2 bytes).
DEPTH_MARGIN = 100
_DEEP_ENOUGH = 2 * (1000 - 2 * DEPTH_MARGIN)
# A \uD800-\uDFFF escape can decode to a lone surrogate, which no UTF-8 encoder accepts: an
# envelope naming such a sender could never be answered (encode -> UnicodeEncodeError).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")

# Optional fast codec (`pip install orjson`): the same JSON, 4-7x faster here on a batch of 100
# taxi records (encode 0.69 -> 0.09 ms, parse 0.48 -> 0.11 ms; byte-identical output for them).
# It is used only where it gives exactly what the stdlib gives; everywhere else the stdlib path
# runs as before (see `_fast_parse` and `_fast_dumps`), so behaviour never depends on it.
try:
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None
_NO = object()
# Deepest nesting the fast path accepts (well inside what the guarded stdlib path accepts, ~850).
_FAST_DEPTH = _DEEP_ENOUGH // 4
# orjson parses integers beyond 64 bits as floats (silently); the stdlib keeps them exact. So
# input with a run of 19+ digits takes the stdlib path. Found by mapping every digit to "0",
# every opening bracket to "[" and everything else to " " (0.06 ms on a 22 kB batch; a regex
# took 0.65 ms, more than the parse): one pass gives the digit runs and the bracket count
# (the depth guard below), which took two more passes over the input (O50).
_DIGITS_AND_OPENERS = bytes(0x30 if 0x30 <= c <= 0x39 else 0x5B if c in b"[{" else 0x20 for c in range(256))
_LONG_RUN = b"0" * 19
# Such a run is part of a number only if the bytes around it can border a number's digits
# (grammar: `-? int (. digits)? ([eE] [+-]? digits)?`, between structural characters or JSON
# whitespace). A run with anything else before or after it (a letter, a quote) lies in a string,
# whose value orjson gives exactly: a hex id such as "B2ED69FD2553690263419906438F1BDA" holds
# 19 digits in a row, and one taxi batch in four sent the whole parse to the stdlib (O25).
_BEFORE_NUMBER_DIGITS = frozenset(b"-+.eE[,: \t\n\r")
_AFTER_NUMBER_DIGITS = frozenset(b".eE,]} \t\n\r")
_ORJSON_OPTS = _orjson.OPT_PASSTHROUGH_SUBCLASS | _orjson.OPT_PASSTHROUGH_DATETIME | _orjson.OPT_PASSTHROUGH_DATACLASS if _orjson else 0


def _fast_parse(raw: Union[bytes, bytearray]) -> Any:
    """orjson.loads when its result is certainly the stdlib's, else `_NO` (caller falls back).

    Equal by construction: orjson accepts strict JSON only (no NaN/Infinity, no lone surrogate,
    strict UTF-8, no BOM), on which both agree; long digit runs (a possible >64-bit integer)
    and inputs with enough brackets to nest past the stdlib path's depth guard go to the stdlib
    path; anything orjson rejects goes there too and gets the stdlib's verdict."""
    digits = raw.translate(_DIGITS_AND_OPENERS)
    if digits.find(_LONG_RUN) >= 0 and _long_number(raw, digits):
        return _NO
    try:
        msg = _orjson.loads(raw)
    except _orjson.JSONDecodeError:
        return _NO
    if digits.count(b"[") >= _FAST_DEPTH and not _shallow(msg, _FAST_DEPTH):
        return _NO
    return msg


def _long_number(raw: Union[bytes, bytearray], digits: Optional[bytes] = None) -> bool:
    """Can `raw` hold a number with a run of 19+ digits? True for every such run bordered as a
    number's digits can be (`_BEFORE_NUMBER_DIGITS`, `_AFTER_NUMBER_DIGITS`, or the text's
    ends); False only when every long run has a neighbour no number's digit can have, i.e. it is
    inside a string (or the text is not JSON, which orjson refuses and the stdlib judges).
    `digits`: `raw.translate(_DIGITS_AND_OPENERS)`, if the caller has it."""
    if digits is None:
        digits = raw.translate(_DIGITS_AND_OPENERS)
    i = digits.find(_LONG_RUN)
    while i >= 0:  # i starts a maximal run: the search resumes past the end of the last one
        end = min(x for x in (digits.find(b" ", i), digits.find(b"[", i), len(digits)) if x >= 0)
        if (i == 0 or raw[i - 1] in _BEFORE_NUMBER_DIGITS) and (end == len(digits) or raw[end] in _AFTER_NUMBER_DIGITS):
            return True
        i = digits.find(_LONG_RUN, end)
    return False


def _shallow(obj: Any, limit: int) -> bool:
    """Nesting depth of parsed JSON below `limit` (iterative: no recursion to guard)."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if d >= limit:
            return False
        if type(o) is list:
            stack.extend((x, d + 1) for x in o if type(x) is list or type(x) is dict)
        elif type(o) is dict:
            stack.extend((x, d + 1) for x in o.values() if type(x) is list or type(x) is dict)
    return True


def _fast_dumps(obj: Any) -> bytes:
    """orjson.dumps when its bytes mean exactly what the stdlib would write, else the stdlib.

    orjson writes NaN and +-Infinity as null (the stdlib writes the tokens NaN/Infinity, which
    our decoder reads back as floats): any null in its output falls back, so a NaN is never
    turned into None. It refuses what the stdlib refuses or converts (non-str keys, >64-bit
    integers, subclasses, datetimes, dataclasses, nesting past 254): fallback as well."""
    if _orjson is not None:
        try:
            out = _orjson.dumps(obj, option=_ORJSON_OPTS)
        except (TypeError, _orjson.JSONEncodeError):
            pass
        else:
            if out.find(b"null") < 0:
                return out
    return _dumps(obj).encode()


def _loads_margin(raw: Any, n: int = DEPTH_MARGIN) -> Any:
    return _loads_margin(raw, n - 1) if n else _loads(raw)


def _parse(raw: Union[bytes, bytearray, str]) -> Any:
    """json.loads with the hostile-input guards above; raises ValueError or RecursionError."""
    if isinstance(raw, str):
        text = raw
        raw.encode()  # a literal lone surrogate: UnicodeEncodeError (a ValueError)
    else:
        if _orjson is not None:
            msg = _fast_parse(raw)
            if msg is not _NO:
                return msg
        # Strict UTF-8 (json.loads on bytes would pass surrogates and accept UTF-16/32).
        text = raw.decode()
    msg = _loads_margin(text) if len(text) >= _DEEP_ENOUGH else _loads(text)
    if _SURROGATE_ESCAPE.search(text) is not None:
        _dumps(msg).encode()  # a proper pair is fine; a lone surrogate: UnicodeEncodeError
    return msg


def encode(env: Envelope) -> bytes:
    if env.kind is Kind.DATA and env.watermark is not None:
        return _fast_dumps([VERSION, env.sender, env.epoch, env.seq, env.kind.value, env.body, env.floors or {},
                            mark_json(env.watermark)])
    if env.floors and env.kind is Kind.DATA:
        return _fast_dumps([VERSION, env.sender, env.epoch, env.seq, env.kind.value, env.body, env.floors])
    return _fast_dumps([VERSION, env.sender, env.epoch, env.seq, env.kind.value, env.body])


LAZY = "lazy"  # decode(raw, LAZY): the records of a compact body as `Row`s

MAX_FLOORS = 64  # floors one data envelope may carry (hostile input: bounded before use)


class Passed(list):  # type: ignore[type-arg]
    """The items of a received data batch that an operator passed on whole and unchanged
    (agent.operators.builtin.passes_records), with the JSON text of the body they arrived in
    (`data_body_bytes`). `encode_data` writes that text again instead of encoding the items: the
    same records and ids (the receiver decodes them exactly as we did); a taxi batch's decode,
    process and encode x0.68-0.70 (docs/measurement.md, "Cheap cuts of the data plane"). The outbox hands a chunk
    to `encode_data` as this very list only when the chunk is one whole batch; split or joined,
    it becomes a plain list and is encoded as usual."""

    __slots__ = ("body",)

    def __init__(self, items: List[Item], body: bytes) -> None:
        super().__init__(items)
        self.body = body


class Row:
    """A record of a compact batch not rebuilt into its dict: its keys (shared by the batch) and
    its values, as parsed (`decode(raw, LAZY)`, for an operator that never reads its records).
    Only the instance and the codec see one: `encode_data` writes it back into the compact body
    without building the dict, `record()` builds it where a record is needed (a chained
    successor that reads records)."""

    __slots__ = ("keys", "vals")

    def __init__(self, keys: Tuple[str, ...], vals: List[Any]) -> None:
        self.keys, self.vals = keys, vals

    def record(self) -> Dict[str, Any]:
        return dict(zip(self.keys, self.vals))


def materialized(items: List[Item]) -> List[Item]:
    """`items` with every `Row` rebuilt into its dict (the list itself when it holds none)."""
    if not any(type(it[2]) is Row for it in items):
        return items
    return [(s, q, r.record()) if type(r) is Row else (s, q, r) for s, q, r in items]


def encode_data(sender: str, epoch: int, seq: int, items: List[Item],
                floors: Optional[Dict[str, int]] = None, watermark: Optional[Mark] = None) -> bytes:
    """Fast path for data batches: no Envelope object, items as built by the data path.

    When every record is a dict with the same keys in the same order (the taxi schema), the keys
    are written once: body `{"k": [keys], "r": [[source, seq, [values]], ...]}`. Measured here on
    100 taxi records: encode 4.0 -> 2.1 ms, decode 2.5 -> 1.3 ms (values rebuilt into dicts), and
    48 -> 21 kB on the wire. Anything else is sent as the plain list of items.
    """
    if type(items) is Passed:
        return b"".join((_fast_dumps([VERSION, sender, epoch, seq, "d"])[:-1], b",", items.body,
                         _tail(floors, watermark, _fast_dumps)))
    if watermark is not None:
        return _fast_dumps([VERSION, sender, epoch, seq, "d", _compact(items), floors or {}, mark_json(watermark)])
    if floors:
        return _fast_dumps([VERSION, sender, epoch, seq, "d", _compact(items), floors])
    return _fast_dumps([VERSION, sender, epoch, seq, "d", _compact(items)])


def _tail(floors: Optional[Dict[str, int]], watermark: Optional[Mark], dumps: Any) -> bytes:
    """What follows a data body: the floors and the watermark, when there are any."""
    if watermark is not None:
        return b"," + dumps(floors or {}) + b"," + dumps(mark_json(watermark)) + b"]"
    return b"]" if not floors else b"," + dumps(floors) + b"]"


def _compact(items: List[Item]) -> Any:
    if len(items) < 2:
        return materialized(items)
    first = items[0][2]
    if type(first) is Row:  # a batch passed on lazily, then split or joined: no dicts needed
        keys = first.keys
        if all(type(r) is Row and r.keys == keys for _, _, r in items):
            return {"k": keys, "r": [[s, q, r.vals] for s, q, r in items]}
        items = materialized(items)
        first = items[0][2]
    if type(first) is not dict or not first:
        return materialized(items)
    keys = tuple(first)
    rows = []
    append = rows.append
    for src, rseq, rec in items:
        if type(rec) is not dict or tuple(rec) != keys:
            return materialized(items)
        append([src, rseq, list(rec.values())])
    return {"k": keys, "r": rows}


def decode(raw: Union[bytes, bytearray, str], records: Any = True) -> Envelope:
    """Parse and validate one envelope; raise `MalformedEnvelope` on any defect.

    `records=False` (a sink that only reads record ids, e.g. `counting_sink` without spill):
    a compact data body is validated exactly as usual but its records are not rebuilt into
    dicts; each item is `(source, seq, None)`. Rebuilding is a third of such a sink's CPU per
    batch of taxi records (measured ~0.3 of 0.8 ms). `records=LAZY` (a map that never reads
    its records and passes them on: `identity`): each record of a compact body is a `Row`,
    which `encode_data` writes back without a dict (an eighth to a sixth of such a map's CPU per
    taxi batch, O41)."""
    try:
        msg = _parse(raw)
    except (ValueError, TypeError, RecursionError) as exc:
        raise MalformedEnvelope(f"envelope: not valid JSON ({str(exc)[:80]})") from None
    floors: Optional[Dict[str, int]] = None
    watermark: Optional[Mark] = None
    if isinstance(msg, list) and len(msg) == 8 and msg[4] == "d":
        try:
            watermark = parse_mark(msg.pop())
        except ValueError as exc:
            raise MalformedEnvelope(f"data envelope: {exc}") from None
    if isinstance(msg, list) and len(msg) == 7 and msg[4] == "d":
        floors = _floors(msg.pop()) or None
    if not isinstance(msg, list) or len(msg) != 6:
        raise MalformedEnvelope(f"envelope: expected a 6-element JSON array, found {_short(msg)}")
    version, sender, epoch, seq, kind, body = msg
    if version != VERSION:
        raise MalformedEnvelope(f"envelope: expected version {VERSION}, found {_short(version)}")
    if not isinstance(sender, str) or not sender:
        raise MalformedEnvelope(f"envelope: expected a sender id, found {_short(sender)}")
    if _bad_int(epoch, 0) or _bad_int(seq, 1):
        raise MalformedEnvelope(f"envelope from {sender}: bad epoch/seq {_short(epoch)}/{_short(seq)}")
    k = _KINDS.get(kind) if isinstance(kind, str) else None
    if k is None:
        raise MalformedEnvelope(f"envelope from {sender}: unknown kind {_short(kind)}, expected d, a or p")
    if k is Kind.DATA:
        if type(body) is dict:
            return Envelope(sender, epoch, seq, k, _expand(sender, body, records),
                            bytes(raw) if isinstance(raw, (bytes, bytearray)) else None, floors, watermark)
        if not isinstance(body, list):
            raise MalformedEnvelope(f"data from {sender}: expected a list of records, found {_short(body)}")
        items: List[Item] = []
        append = items.append
        for it in body:
            # inlined checks (this loop runs once per record): [str, int >= 0 (not bool), any]
            if type(it) is not list or len(it) != 3:
                raise MalformedEnvelope(f"data from {sender}: expected [source, seq, record], found {_short(it)}")
            src, rseq, rec = it
            if type(src) is not str or type(rseq) is not int or rseq < 0:
                raise MalformedEnvelope(f"data from {sender}: expected [source, seq, record], found {_short(it)}")
            append((src, rseq, rec))
        return Envelope(sender, epoch, seq, k, items, bytes(raw) if isinstance(raw, (bytes, bytearray)) else None,
                        floors, watermark)
    elif k is Kind.ACK:
        if type(body) is not list or len(body) != 2 or _bad_int(body[0], 0) or _bad_int(body[1], 0):
            raise MalformedEnvelope(f"ack from {sender}: expected [epoch, seq], found {_short(body)}")
        body = (body[0], body[1])
    elif not isinstance(body, dict):
        raise MalformedEnvelope(f"protocol message from {sender}: expected an object, found {_short(body)}")
    return Envelope(sender, epoch, seq, k, body)


def _floors(value: Any) -> Dict[str, int]:
    """A data envelope's floors, checked: at most MAX_FLOORS, source names to integers >= 0."""
    if type(value) is not dict or len(value) > MAX_FLOORS or not all(
            type(k) is str and k and type(v) is int and v >= 0 for k, v in value.items()):
        raise MalformedEnvelope(f"data envelope: expected floors {{source: integer >= 0}} (at most {MAX_FLOORS}), "
                                f"found {_short(value)}")
    return value


def _expand(sender: str, body: Dict[str, Any], records: Any = True) -> List[Item]:
    """The compact data body back into items with dict records (validated); with
    `records=False`, items without their records (`None`), with `LAZY` as `Row`s, validated
    all the same."""
    keys, rows = body.get("k"), body.get("r")
    if (
        len(body) != 2
        or type(keys) is not list
        or type(rows) is not list
        or not all(type(x) is str for x in keys)
    ):
        raise MalformedEnvelope(f"data from {sender}: expected {{k: [keys], r: [rows]}}, found {_short(body)}")
    n = len(keys)
    lazy = tuple(keys) if records is LAZY else None  # shared by the batch's Rows
    items: List[Item] = []
    append = items.append
    for row in rows:
        if type(row) is not list or len(row) != 3:
            raise MalformedEnvelope(f"data from {sender}: expected [source, seq, [values]], found {_short(row)}")
        src, rseq, vals = row
        if type(src) is not str or type(rseq) is not int or rseq < 0 or type(vals) is not list or len(vals) != n:
            raise MalformedEnvelope(f"data from {sender}: expected [source, seq, [values]], found {_short(row)}")
        append((src, rseq, Row(lazy, vals) if lazy else dict(zip(keys, vals)) if records else None))
    return items


def data_body_bytes(env: Envelope) -> Optional[bytes]:
    """The JSON text of a data envelope's body, sliced out of the bytes it arrived as (no
    re-encoding), or None when the bytes are not exactly what `encode_data` writes."""
    raw = env.raw
    if raw is None:  # built in memory (a chained hand-off): checked first, it is the common case there
        return None
    tail = _tail(env.floors, env.watermark, lambda v: _dumps(v).encode())
    if not raw.endswith(tail):
        return None
    head = _dumps([VERSION, env.sender, env.epoch, env.seq, "d"])[:-1].encode() + b","
    if not raw.startswith(head):
        return None
    return raw[len(head):-len(tail)]


_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother = 4, 40, 40


def _short(v: Any) -> str:
    # reprlib: bounded depth, so a deeply nested hostile value cannot raise RecursionError here
    text = _repr.repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
