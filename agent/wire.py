"""Parsing JSON that arrived from the bus: bounded in size and nesting BEFORE it is parsed.

Everything on the bus is hostile until its sender is proven (docs/security.md). The stdlib parser
recurses: a 100k-deep `[[[[...` raises RecursionError from deep inside it, and any handler that
lets that escape ends the process that read it. So the payload's size is checked first, then its
bracket nesting is measured by a linear scan that skips string contents, and only input within
both bounds reaches `json.loads`. Every failure is one `BusInputError` (a ValueError) whose text
says what was wrong, so callers count, log one line and go on.

Data envelopes have their own, faster guarded parser (agent.dataplane.envelope); this one is for
control traffic: rpc requests and replies, node state, hosted records, latency pings, locks,
events and fogctl's views.
"""

from __future__ import annotations

import json
from typing import Any, Tuple, Type, Union

# The broker refuses larger packets (`max_packet_size` in the mosquitto role); the agent checks
# again so that a broker without that setting cannot make it parse a 100 MB payload.
MAX_CONTROL_BYTES = 256 * 1024
# Deepest nesting any of our control payloads has is 4 (a state document's instance stats).
MAX_DEPTH = 32

_OPEN, _CLOSE, _QUOTE, _ESCAPE = frozenset(b"[{"), frozenset(b"]}"), 0x22, 0x5C


class BusInputError(ValueError):
    """A payload from the bus that is too large, too deep, not UTF-8 JSON or of the wrong type."""


def nesting(raw: bytes, limit: int = MAX_DEPTH) -> int:
    """Bracket depth of `raw` (strings skipped), stopping as soon as it exceeds `limit`.

    Cheap when the payload holds few brackets: the count of opening brackets bounds the depth."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return 0
    depth = deepest = 0
    in_string = escaped = False
    for c in raw:
        if in_string:
            if escaped:
                escaped = False
            elif c == _ESCAPE:
                escaped = True
            elif c == _QUOTE:
                in_string = False
        elif c == _QUOTE:
            in_string = True
        elif c in _OPEN:
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif c in _CLOSE:
            depth -= 1
    return deepest


def loads(
    payload: Union[bytes, bytearray, memoryview, str, None],
    *,
    what: str = "payload",
    max_bytes: int = MAX_CONTROL_BYTES,
    max_depth: int = MAX_DEPTH,
    expect: Union[Type[Any], Tuple[Type[Any], ...], None] = None,
) -> Any:
    """`json.loads` for bus input: size, then depth, then strict UTF-8 JSON, then the top type.

    Raises `BusInputError` naming `what` and the defect; never RecursionError or MemoryError
    from a hostile payload."""
    if payload is None:
        raise BusInputError(f"{what}: empty")
    raw = payload.encode("utf-8", "surrogatepass") if isinstance(payload, str) else bytes(payload)
    if len(raw) > max_bytes:
        raise BusInputError(f"{what}: {len(raw)} bytes, more than the {max_bytes} allowed")
    if nesting(raw, max_depth) > max_depth:
        raise BusInputError(f"{what}: nested deeper than {max_depth}")
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BusInputError(f"{what}: not UTF-8 JSON ({str(exc)[:80]})") from None
    if expect is not None and not isinstance(value, expect):
        names = "/".join(t.__name__ for t in (expect if isinstance(expect, tuple) else (expect,)))
        raise BusInputError(f"{what}: expected a JSON {_json_name(names)}, found {type(value).__name__}")
    return value


def _json_name(names: str) -> str:
    return names.replace("dict", "object").replace("list", "array").replace("str", "string")
