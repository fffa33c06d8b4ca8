"""The key-group hand-over's messages on the wire: their bodies as protocol envelopes, and the
decoding of an untrusted body (docs/operators.md, "Key groups that move"; docs/security.md).

Rules of this file: pure functions, no state, no I/O. Everything from the bus is hostile: `decode`
checks every field and bounds every size before anything is built. Body:

    {"type": "redirect", "g": group, "new": instance, "v": version}     owner -> each predecessor
    {"type": "eos", "g": group}                                         predecessor -> owner
    {"type": "offer", "g": group, "v": version}                         leaver -> survivor
    {"type": "state_chunk", "g": group, "i": index, "n": total, "data": base64, "v": version,
     "e": epoch}                                                        old -> new owner
    {"type": "installed", "g": group}                                   new -> old owner
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any, Dict, Tuple

from agent.instance.handover import MAX_CHUNK, Eos, Installed, Offer, Redirect, StateChunk

__all__ = ["HANDOVER_TYPES", "MAX_CHUNKS", "MAX_NAME", "encode", "decode", "body_size", "int_field"]

HANDOVER_TYPES = frozenset({"redirect", "eos", "offer", "state_chunk", "installed"})
MAX_CHUNKS = 256  # chunks of one group's state: 150 MB at MAX_CHUNK (a hostile total is refused)
MAX_NAME = 200  # an instance name in a Redirect


def encode(msg: Any) -> Dict[str, Any]:
    """A hand-over message as a protocol envelope's body."""
    if isinstance(msg, Redirect):
        return {"type": "redirect", "g": msg.group, "new": msg.new, "v": msg.version}
    if isinstance(msg, Eos):
        return {"type": "eos", "g": msg.group}
    if isinstance(msg, Offer):
        return {"type": "offer", "g": msg.group, "v": getattr(msg, "version", -1)}
    if isinstance(msg, StateChunk):
        return {"type": "state_chunk", "g": msg.group, "i": msg.index, "n": msg.total,
                "data": base64.b64encode(msg.data).decode()}
    if isinstance(msg, Installed):
        return {"type": "installed", "g": msg.group}
    raise TypeError(f"not a hand-over message: {msg!r:.80}")


def int_field(body: Dict[str, Any], name: str, lo: int, hi: int) -> int:
    """`body[name]`, an integer in lo..hi-1; ValueError naming the field otherwise."""
    v = body.get(name)
    if type(v) is not int or not lo <= v < hi:
        raise ValueError(f"{body.get('type')}: '{name}' must be an integer in {lo}..{hi - 1}")
    return v


def decode(sender: str, body: Any, groups: int) -> Tuple[Any, int]:
    """(message, version) from an untrusted body; ValueError naming the field otherwise. The
    version is the Offer's or the chunk's move (-1 for the others, and for a chunk without one)."""
    if not isinstance(body, dict):
        raise ValueError("hand-over message: expected an object")
    kind = body.get("type")
    g = int_field(body, "g", 0, groups)
    if kind == "redirect":
        new = body.get("new")
        if not isinstance(new, str) or not 0 < len(new) <= MAX_NAME:
            raise ValueError(f"redirect: 'new' must be an instance name of 1..{MAX_NAME} characters")
        return Redirect(g, new, int_field(body, "v", -1, 2 ** 53)), -1
    if kind == "eos":
        return Eos(g, sender), -1
    if kind == "offer":
        return Offer(g), int_field(body, "v", -1, 2 ** 53)
    if kind == "state_chunk":
        n = int_field(body, "n", 1, MAX_CHUNKS + 1)
        i = int_field(body, "i", 0, n)
        data = body.get("data")
        if not isinstance(data, str) or len(data) > (MAX_CHUNK + 2) // 3 * 4:
            raise ValueError(f"state_chunk: 'data' must be base64 of at most {MAX_CHUNK} bytes")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("state_chunk: 'data' is not base64") from None
        return StateChunk(g, i, n, raw), (int_field(body, "v", -1, 2 ** 53) if "v" in body else -1)
    if kind == "installed":
        return Installed(g), -1
    raise ValueError(f"not a hand-over message type: {str(kind)[:40]!r}")


def body_size(body: Dict[str, Any]) -> int:
    """Bytes of a hand-over message's body on the wire (its envelope adds ~40). A chunk's base64
    needs no escaping: its length is added, not encoded again (a pass over 100s of kB)."""
    data = body.get("data")
    if isinstance(data, str) and data.isascii() and data.isprintable() and '"' not in data and "\\" not in data:
        return len(json.dumps(dict(body, data=""), separators=(",", ":"))) + len(data)
    return len(json.dumps(body, separators=(",", ":")))
