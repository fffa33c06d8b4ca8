"""The keyed state of one instance: per key group, the operator's states, the input position they
reflect, the watermark, the timers and the outputs not yet acked downstream. Sans-IO except
`save`/`load` (one file, written atomically).

Rules of this file (docs/operators.md, "Keyed state: aggregates and windows per key"):
- Exactly-once updates. Every record id (source instance, number) travels unchanged through the
  stateless operators, and on one predecessor's channel the numbers of one source only grow
  (FIFO channels, in-order processing, in-order replays). So per (predecessor, source) the highest
  number applied is the input position the state reflects: a record at or below it is a replay,
  skipped (`duplicates_skipped`), never applied twice.
- Write-ahead outputs. The state, the positions and every output not yet acked by the successors
  are persisted in ONE atomic write (`save`). The worker acks an input upstream only once the state
  that reflects it is saved (`lowest_unsaved`), so a crash loses nothing the predecessors do not
  still hold: the restarted instance restores the file, sends the saved outputs again (the sink
  drops the copies by id) and skips every replayed record it had applied.
- Determinism. Lateness is decided record by record in arrival order and timers fire after the
  batch, so the outputs do not depend on how records were batched: a run with crashes emits
  exactly the outputs (same ids, same content) of the fault-free run.
- An output gets the id `(<operator>#<key digest>, n)`: the key's n-th output. Counters survive
  their key's state being forgotten (an id is never reused).
"""

from __future__ import annotations

import base64
import hashlib
import heapq
import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from agent.dataplane.envelope import Item
from agent.dataplane.keygroups import key_group, record_key
from agent.files import write_atomic
from agent.operators.keyed import KeyedOperator

__all__ = ["KeyedState", "FORMAT", "hashable_key", "output_source"]

log = logging.getLogger("agent.instance.keyed_state")

FORMAT = 1
MAX_NOTIFY_LOOPS = 1000  # on_notify calls per key per batch whose notify_at keeps moving forward


def hashable_key(key: Any) -> Any:
    """A record's key as a dict key: a JSON scalar as it is, anything else as canonical JSON text."""
    if key is None or isinstance(key, (str, int, float, bool)):
        return key
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def output_source(operator: str, key: Any) -> str:
    """The source part of the ids of `key`'s outputs: the same on every instance and in every run."""
    digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=8).hexdigest()
    return f"{operator}#{digest}"


class KeyedState:
    """Drives one `KeyedOperator` over input batches and keeps what it must persist."""

    def __init__(self, op: KeyedOperator, operator: str, key_field: Optional[str], groups: int) -> None:
        self.op = op
        self.operator = operator
        self.key_field = key_field
        self.groups = groups
        self.states: Dict[int, Dict[Any, Any]] = {}  # group -> key -> the operator's state
        self.emitted: Dict[int, Dict[Any, int]] = {}  # group -> key -> outputs so far (ids)
        self.positions: Dict[str, int] = {}  # "<predecessor> <source>" -> highest number applied
        self.max_time: Optional[float] = None
        self.timers: Dict[Any, float] = {}  # key -> event time its on_notify is due
        self._heap: List[Tuple[float, str, Any]] = []  # (time, key as JSON, key); stale entries skipped
        self.outputs: List[Tuple[int, Item]] = []  # (input index, item): not yet acked downstream
        self._unsaved: Optional[int] = None  # lowest input index applied since the last save
        self._sources: Dict[Any, str] = {}  # key -> output_source(operator, key) (a digest per output is costly)
        self.counts = {"keyed_applied": 0, "duplicates_skipped": 0, "late_dropped": 0, "no_event_time": 0,
                       "keyed_outputs": 0, "keyed_errors": 0, "state_saves": 0}

    # ---- the watermark ---------------------------------------------------------------------------

    @property
    def watermark(self) -> Optional[float]:
        if self.max_time is None:
            return None
        return self.max_time - self.op.lateness_ms

    # ---- input ------------------------------------------------------------------------------------

    def apply(self, sender: str, items: List[Item], index: int) -> List[Item]:
        """Apply one input batch from `sender` (processed with input index `index`); the outputs."""
        op = self.op
        timed = op.uses_event_time
        by_key: Dict[Any, List[Any]] = {}
        positions = self.positions
        applied = 0
        for src, seq, rec in items:
            pk = f"{sender} {src}"
            if seq <= positions.get(pk, -1):
                self.counts["duplicates_skipped"] += 1
                continue
            positions[pk] = seq
            applied += 1
            if timed:
                try:
                    t = op.event_time(rec)
                except Exception:  # noqa: BLE001 - the user's event_time: the record is unusable
                    t = None
                if t is None:
                    self.counts["no_event_time"] += 1
                    continue
                wm = self.watermark
                if wm is not None and t < wm:
                    self.counts["late_dropped"] += 1
                    continue
                if self.max_time is None or t > self.max_time:
                    self.max_time = t
            key = hashable_key(record_key(rec, self.key_field))
            lst = by_key.get(key)
            if lst is None:
                lst = by_key[key] = []
            lst.append(rec)
        if not applied:
            return []
        if self._unsaved is None:
            self._unsaved = index
        self.counts["keyed_applied"] += applied
        out: List[Item] = []
        for key, recs in by_key.items():
            self._call_batch(key, recs, out)
        if timed:
            self._fire(out)
        self.outputs.extend((index, it) for it in out)
        return out

    def _call_batch(self, key: Any, recs: List[Any], out: List[Item]) -> None:
        g = key_group(key, self.groups)
        states = self.states.setdefault(g, {})
        state = states.get(key)
        try:
            emitted, state = self.op.on_batch(key, recs, state)
            self._emit(g, key, list(emitted), out)
        except Exception:  # noqa: BLE001 - isolate the record(s) the user function fails on
            for rec in recs:
                try:
                    emitted, state = self.op.on_batch(key, [rec], state)
                    self._emit(g, key, list(emitted), out)
                except Exception as exc:  # noqa: BLE001
                    self.counts["keyed_errors"] += 1
                    if self.counts["keyed_errors"] <= 5:
                        log.warning("%s: on_batch failed for key %r: %r", self.operator, key, exc)
        self._set(g, key, state)

    def _emit(self, g: int, key: Any, emitted: List[Any], out: List[Item]) -> None:
        if not emitted:
            return
        counters = self.emitted.setdefault(g, {})
        n = counters.get(key, 0)
        src = self._sources.get(key)
        if src is None:
            src = self._sources[key] = output_source(self.operator, key)
        for value in emitted:
            n += 1
            out.append((src, n, value))
        counters[key] = n
        self.counts["keyed_outputs"] += len(emitted)

    def _set(self, g: int, key: Any, state: Any) -> None:
        states = self.states.setdefault(g, {})
        if state is None:
            states.pop(key, None)
            if not states:
                del self.states[g]
        else:
            states[key] = state
        self._arm(key, state)

    def _arm(self, key: Any, state: Any) -> None:
        t = None if state is None else self.op.notify_at(key, state)
        if t is None:
            self.timers.pop(key, None)
            return
        if self.timers.get(key) != t:
            self.timers[key] = t
            heapq.heappush(self._heap, (t, json.dumps(key), key))

    def _fire(self, out: List[Item]) -> None:
        """Every timer the watermark has reached, in (time, key) order. A key whose on_notify keeps
        asking for a time already reached is called at most MAX_NOTIFY_LOOPS times per batch."""
        wm = self.watermark
        heap = self._heap
        fired: Dict[Any, int] = {}
        later: List[Tuple[float, str, Any]] = []
        while heap and wm is not None and heap[0][0] <= wm:
            entry = heapq.heappop(heap)
            t, _, key = entry
            if self.timers.get(key) != t:
                continue  # re-armed or cancelled since
            n = fired.get(key, 0)
            if n >= MAX_NOTIFY_LOOPS:
                later.append(entry)
                continue
            fired[key] = n + 1
            del self.timers[key]
            g = key_group(key, self.groups)
            state = self.states.get(g, {}).get(key)
            try:
                emitted, state = self.op.on_notify(key, state, wm)
                self._emit(g, key, list(emitted), out)
            except Exception as exc:  # noqa: BLE001
                fired[key] = MAX_NOTIFY_LOOPS  # its timer stays armed: tried again after the next batch
                self.counts["keyed_errors"] += 1
                if self.counts["keyed_errors"] <= 5:
                    log.warning("%s: on_notify failed for key %r: %r", self.operator, key, exc)
            self._set(g, key, state)
        for entry in later:
            heapq.heappush(heap, entry)

    # ---- persistence ------------------------------------------------------------------------------

    @property
    def dirty(self) -> bool:
        return self._unsaved is not None

    def lowest_unsaved(self) -> Optional[int]:
        """The lowest input index applied but not saved yet: not to be acked upstream."""
        return self._unsaved

    def prune_outputs(self, lowest_pending: Optional[int]) -> None:
        """Forget the outputs every successor acked: those of inputs below `lowest_pending` (the
        lowest input index with outputs still buffered, in flight or unacked; None: none is)."""
        if lowest_pending is None:
            self.outputs = []
        elif self.outputs and self.outputs[0][0] < lowest_pending:
            self.outputs = [(i, it) for i, it in self.outputs if i >= lowest_pending]

    def _group_json(self, g: int) -> Dict[str, Any]:
        """One group as a JSON value: an operator with the default (JSON) snapshot keeps its states
        as they are ("pairs"); any other as its snapshot's bytes in base64 ("bytes")."""
        states = self.states.get(g, {})
        emitted = [[k, n] for k, n in self.emitted.get(g, {}).items()]
        if type(self.op).snapshot is KeyedOperator.snapshot:
            return {"pairs": [[k, v] for k, v in states.items()], "emitted": emitted}
        return {"bytes": base64.b64encode(self.op.snapshot(states)).decode(), "emitted": emitted}

    def group_snapshot(self, g: int) -> bytes:
        """One key group as bytes (what a hand-over moves): its states and output counters."""
        return json.dumps(self._group_json(g), separators=(",", ":")).encode()

    def restore_group(self, g: int, data: bytes) -> None:
        self._restore_group(g, json.loads(data))

    def _restore_group(self, g: int, blob: Dict[str, Any]) -> None:
        if "pairs" in blob:
            states = self.op.restore(json.dumps(blob["pairs"]).encode())
        else:
            states = self.op.restore(base64.b64decode(blob["bytes"]))
        if states:
            self.states[g] = {hashable_key(k): s for k, s in states.items()}
        else:
            self.states.pop(g, None)
        counters = {hashable_key(k): int(n) for k, n in blob.get("emitted") or []}
        if counters:
            self.emitted[g] = counters
        for key, state in self.states.get(g, {}).items():
            self._arm(key, state)

    def to_text(self) -> str:
        """The saved form: one JSON document (encoded whole: its cost grows with the state)."""
        return json.dumps({"format": FORMAT, "operator": self.operator, "key_groups": self.groups,
                           "positions": self.positions, "max_time": self.max_time,
                           "outputs": [it for _, it in self.outputs],
                           "groups": {str(g): self._group_json(g) for g in sorted(set(self.states) | set(self.emitted))}},
                          separators=(",", ":"))

    def to_json(self) -> Dict[str, Any]:
        return dict(json.loads(self.to_text()))

    def save(self, path: Path) -> None:
        """Write everything in one atomic step; afterwards the applied inputs may be acked."""
        write_atomic(path, self.to_text())
        self._unsaved = None
        self.counts["state_saves"] += 1

    def restore(self, data: Dict[str, Any]) -> List[Item]:
        """Load a saved state; returns the outputs to send again (the caller re-indexes them)."""
        if data.get("format") != FORMAT:
            raise ValueError(f"keyed state: expected format {FORMAT}, found {data.get('format')!r}")
        if int(data.get("key_groups", -1)) != self.groups:
            raise ValueError(f"keyed state of {self.operator}: saved with {data.get('key_groups')} key groups, "
                             f"the pipeline says {self.groups} (key_groups is fixed for a deployment)")
        self.positions = {str(k): int(v) for k, v in (data.get("positions") or {}).items()}
        mt = data.get("max_time")
        self.max_time = float(mt) if mt is not None else None
        for g, blob in (data.get("groups") or {}).items():
            self._restore_group(int(g), blob)
        return [(str(s), int(q), r) for s, q, r in data.get("outputs") or []]

    @staticmethod
    def load(path: Path) -> Optional[Dict[str, Any]]:
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        return dict(json.loads(text))

    def stats(self) -> Dict[str, Any]:
        s: Dict[str, Any] = dict(self.counts)
        s.update(keyed_state=True, key_groups_held=len(self.states), keys_held=sum(len(v) for v in self.states.values()),
                 timers=len(self.timers), watermark=self.watermark, unacked_outputs=len(self.outputs))
        s.update(self.op.stats())
        return s
