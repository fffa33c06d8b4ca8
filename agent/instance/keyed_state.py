"""The keyed state of one instance: per key group, the operator's states, the input position they
reflect, the watermark, the timers and the outputs not yet acked downstream. Sans-IO except
`save`/`load` (a snapshot and its log of changes).

Rules of this file (docs/operators.md, "Keyed state: aggregates and windows per key"):
- Exactly-once updates. Every record id (source instance, number) travels unchanged through the
  stateless operators. Per source, the set of numbers applied (agent.instance.applied: a floor the
  source's claims raise, ranges above it) is the input position the state reflects: a record in
  it is a replay, skipped (`duplicates_skipped`), never applied twice; any other is applied, in
  whatever order it comes (a restarted predecessor can deliver newer records before replayed
  older ones: the highest number applied is not enough, docs/reliability.md).
- Write-ahead outputs. The state, the positions and every output not yet acked by the successors
  are saved together (`save`: one line of what changed appended to a log, or now and then a full
  snapshot written atomically, which starts a new log). The worker acks an input upstream only
  once the state that reflects it is saved (`lowest_unsaved`), so a crash loses nothing the
  predecessors do not still hold: the restarted instance loads snapshot + log, sends the saved
  outputs again (the sink drops the copies by id) and skips every replayed record it had applied.
- Determinism. Lateness is decided record by record in arrival order and timers fire after the
  batch, so the outputs do not depend on how records were batched: a run with crashes emits
  exactly the outputs (same ids, same content) of the fault-free run.
- An output gets the id `(<operator>#<key digest>, n)`: the key's n-th output. Counters survive
  their key's state being forgotten (an id is never reused).
- An operator with `forwards = True` also passes every record it applies on, unchanged and with
  its own id, before its outputs (saved with them, so a crash loses none and the sink drops the
  copies by id): the demo's trips reach the sink through the DEBS query operators. Its
  `forward(record)` may keep some back (the merge stage of query 1 keeps the counts it consumes).
"""

from __future__ import annotations

import base64
import hashlib
import heapq
import json
import logging
from itertools import islice
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Set, Tuple

from agent.dataplane.envelope import Item
from agent.dataplane.keygroups import key_group, record_key
from agent.dataplane.owners import group_runs
from agent.files import append, write_atomic_parts
from agent.instance.applied import Applied, union
from agent.instance.keyed_saves import FORMAT, load_saved
from agent.operators.keyed import KeyedOperator, keyed_config_problems

__all__ = ["KeyedState", "FORMAT", "LOAD_HALF_LIFE", "hashable_key", "output_source", "keyed_state_for"]

log = logging.getLogger("agent.instance.keyed_state")

LOG_MIN = 256 << 10  # bytes of log below which no snapshot is rewritten for its sake
MAX_NOTIFY_LOOPS = 1000  # on_notify calls per key per batch whose notify_at keeps moving forward
# The measured load per key group (`load`: records applied) halves every this many records: a
# half-life counted in records, not seconds (no clock here), ~30 s at 300 records/s.
LOAD_HALF_LIFE = 10_000
_dumps = json.JSONEncoder(separators=(",", ":")).encode  # json.dumps(obj, separators=(",", ":"))
PIECE_OUTPUTS = 64  # outputs encoded together in a snapshot (`text_parts`)
PIECE_SOURCES = 256  # sources' applied numbers encoded together in a snapshot


def hashable_key(key: Any) -> Any:
    """A record's key as a dict key: a JSON scalar as it is, anything else as canonical JSON text."""
    if key is None or isinstance(key, (str, int, float, bool)):
        return key
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def output_source(operator: str, key: Any) -> str:
    """The source part of the ids of `key`'s outputs: the same on every instance and in every run."""
    digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=8).hexdigest()
    return f"{operator}#{digest}"


def keyed_state_for(operator: Any, pipeline: Any, stage: int, replicate: bool) -> Optional["KeyedState"]:
    """The state of the operator at `stage` of `pipeline` when it is a keyed stateful one (None
    for any other), keyed by its predecessor's key; ValueError naming what makes the pipeline
    unfit for it. `replicate`: the agent keeps a standby copy of the saved state on another node
    (agent.node.replicas): inputs are acked upstream only once it holds the save that reflects them."""
    if not isinstance(operator, KeyedOperator):
        return None
    problems = keyed_config_problems(pipeline, stage, operator)
    if problems:
        raise ValueError("; ".join(problems))
    op = pipeline.operators[stage]
    state = KeyedState(operator, op.name, pipeline.operators[stage - 1].key, op.key_groups)
    state.replicated_acks = replicate
    return state


class KeyedState:
    """Drives one `KeyedOperator` over input batches and keeps what it must persist."""

    def __init__(self, op: KeyedOperator, operator: str, key_field: Optional[str], groups: int) -> None:
        self.op = op
        self.operator = operator
        self.key_field = key_field
        self.groups = groups
        self.states: Dict[int, Dict[Any, Any]] = {}  # group -> key -> the operator's state
        self.emitted: Dict[int, Dict[Any, int]] = {}  # group -> key -> outputs so far (ids)
        # group -> the first output number of a key without a counter: a group whose counters were
        # lost with a node starts above any number its dead owner can have used (`floor_groups`)
        self.floors: Dict[int, int] = {}
        self.applied: Dict[str, Applied] = {}  # source instance -> the numbers of it applied
        self.max_time: Optional[float] = None
        # Watermarks that flow (agent.dataplane.watermarks): `max_time` is then the least mark over
        # the inputs, set by the instance, never raised by a record (saved and restored as before).
        self.flowing = False
        self.timers: Dict[Any, float] = {}  # key -> event time its on_notify is due
        # group -> records applied, decayed (LOAD_HALF_LIFE): what a duplication's share balances
        # (agent.dataplane.owners.split_share); not saved: a restarted instance measures afresh
        self.load: Dict[int, float] = {}
        self._load_since_decay = 0
        self.frozen: Set[int] = set()  # groups handed out, kept until installed elsewhere: no timer fires
        self._heap: List[Tuple[float, str, Any]] = []  # (time, key as JSON, key); stale entries skipped
        self.outputs: List[Tuple[int, Item]] = []  # (input index, item): not yet acked downstream
        self._unsaved: Optional[int] = None  # lowest input index applied since the last save
        # Replication off the node (agent.node.replicas): with `replicated_acks`, a save is not
        # enough to ack its inputs upstream; they wait until the standby holds that save:
        # (generation, log length after the save, lowest input index it covered), oldest first.
        self.replicated_acks = False
        self._unreplicated: List[Tuple[int, int, int]] = []
        self._sources: Dict[Any, str] = {}  # key -> output_source(operator, key) (a digest per output is costly)
        self._key_text: Dict[Any, str] = {}  # key -> its JSON text (timers' tie-break)
        # Saving (see `save`): a full snapshot now and then, else one appended line of what changed.
        self._json_states = type(op).snapshot is KeyedOperator.snapshot
        self._gen = 0  # the snapshot's generation: log lines of another one are ignored
        self._full_next = True
        self._base_bytes = 0
        self._log_bytes = 0
        self._dirty_keys: Dict[Tuple[int, Any], None] = {}  # (group, key) changed since the last save
        self._dirty_pos: Dict[str, None] = {}  # sources whose `applied` changed since the last save
        self._out_new: List[Item] = []  # outputs added since the last save
        self._out_dropped = 0  # outputs pruned from the front since the last save
        # The key groups this instance owns, at their versions (agent.instance.moves
        # `reported_groups`, set before each save), saved with the state: its standby copy then says
        # which groups it holds, which a re-home of a node lost before its retained state listed a
        # move reads (agent.node.replicas `ReplicaStore.owned`, agent.node.rehome). None: not keyed
        # by moves (nothing written).
        self.owned: Optional[Dict[int, int]] = None
        self._owned_saved: Optional[Dict[int, int]] = None  # what the files say (a log line when it changes)
        self.counts = {"keyed_applied": 0, "duplicates_skipped": 0, "late_dropped": 0, "late_sent": 0,
                       "no_event_time": 0, "keyed_outputs": 0, "keyed_errors": 0, "state_saves": 0}

    # ---- the watermark ---------------------------------------------------------------------------

    @property
    def watermark(self) -> Optional[float]:
        """`max_time - lateness_ms`: the largest event time taken, or (flowing) the least mark
        over the inputs; None before either."""
        if self.max_time is None:
            return None
        return self.max_time - self.op.lateness_ms

    # ---- input ------------------------------------------------------------------------------------

    def apply(self, sender: str, items: List[Item], index: int,
              floors: Optional[Dict[str, int]] = None, judge_late: bool = True) -> List[Item]:
        """Apply one input batch from `sender` (processed with input index `index`); the outputs.
        `floors`: the batch's claims, per source, of a number below which every record was
        applied already (agent.instance.applied), taken before its records. `judge_late=False`:
        records held while their group moved here (agent.instance.moves), never judged late:
        our watermark went on with our other groups while they waited, which a record arriving
        in its sender's order never sees."""
        op = self.op
        timed = op.uses_event_time
        by_key: Dict[Any, List[Any]] = {}
        sets = self.applied
        if floors:
            for src, floor in floors.items():
                a = sets.get(src)
                if a is None:
                    a = sets[src] = Applied()
                if a.raise_floor(floor):
                    self._dirty_pos[src] = None
        applied = 0
        forwarded: List[Item] = []
        forwards = op.forwards
        # the operator's filter on what it forwards, if it has one (a method call per record otherwise saved)
        fwd_filter = op.forward if forwards and type(op).forward is not KeyedOperator.forward else None
        # the operator's side output for late records, if it has one
        on_late = op.on_late if type(op).on_late is not KeyedOperator.on_late else None
        last_src, a = None, None
        for src, seq, rec in items:
            if src != last_src:
                a = sets.get(src)
                if a is None:
                    a = sets[src] = Applied()
                last_src = src
            if not a.add(seq):  # type: ignore[union-attr]
                self.counts["duplicates_skipped"] += 1
                continue
            self._dirty_pos[src] = None
            applied += 1
            if forwards and (fwd_filter is None or fwd_filter(rec)):
                forwarded.append((src, seq, rec))
            if timed:
                try:
                    t = op.event_time(rec)
                except Exception:  # noqa: BLE001 - the user's event_time: the record is unusable
                    t = None
                if t is None:
                    self.counts["no_event_time"] += 1
                    continue
                wm = self.watermark
                if judge_late and wm is not None and t < wm:
                    self.counts["late_dropped"] += 1
                    if on_late is not None and not forwards:
                        side = on_late(rec)
                        if side is not None:
                            forwarded.append((src, seq, side))
                            self.counts["late_sent"] += 1
                    continue
                if not self.flowing and (self.max_time is None or t > self.max_time):
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
        out: List[Item] = forwarded
        for key, recs in by_key.items():
            self._call_batch(key, recs, out)
        self._load_since_decay += applied
        if self._load_since_decay >= LOAD_HALF_LIFE:
            self._decay_load()
        if timed:
            self._fire(out)
        self.outputs.extend((index, it) for it in out)
        self._out_new.extend(out)
        return out

    def _decay_load(self) -> None:
        self._load_since_decay = 0
        self.load = {g: n / 2 for g, n in self.load.items() if n >= 1.0}  # a group idle for long drops to 0

    def _call_batch(self, key: Any, recs: List[Any], out: List[Item]) -> None:
        g = key_group(key, self.groups)
        self.load[g] = self.load.get(g, 0.0) + len(recs)
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
        n = counters.get(key)
        if n is None:
            n = self.floors.get(g, 0)
        src = self._sources.get(key)
        if src is None:
            src = self._sources[key] = output_source(self.operator, key)
        for value in emitted:
            n += 1
            out.append((src, n, value))
        counters[key] = n
        self.counts["keyed_outputs"] += len(emitted)
        self._dirty_keys[(g, key)] = None

    def _set(self, g: int, key: Any, state: Any) -> None:
        states = self.states.setdefault(g, {})
        if state is None:
            states.pop(key, None)
            if not states:
                del self.states[g]
        else:
            states[key] = state
        self._dirty_keys[(g, key)] = None
        self._arm(key, state)

    def _arm(self, key: Any, state: Any) -> None:
        t = None if state is None else self.op.notify_at(key, state)
        if t is None:
            self.timers.pop(key, None)
            return
        if self.timers.get(key) != t:
            self.timers[key] = t
            text = self._key_text.get(key)
            if text is None:
                text = self._key_text[key] = json.dumps(key)  # the tie-break: (time, key) order
            heapq.heappush(self._heap, (t, text, key))

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

    def fire_due(self, index: int) -> List[Item]:
        """The timers the watermark has already passed, fired now (outputs under input `index`):
        a group taken in (`take_in`) arms its keys' timers, and some may be due here at once; left
        to the next batch, a group installed after the last one never emits them."""
        out: List[Item] = []
        if self.op.uses_event_time:
            self._fire(out)
        if out:
            if self._unsaved is None:
                self._unsaved = index
            self.outputs.extend((index, it) for it in out)
            self._out_new.extend(out)
        return out

    # ---- persistence ------------------------------------------------------------------------------

    @property
    def dirty(self) -> bool:
        return self._unsaved is not None

    def lowest_unsaved(self) -> Optional[int]:
        """The lowest input index applied but not saved yet (or, with `replicated_acks`, saved
        but not yet held by the standby): not to be acked upstream."""
        if self._unreplicated:
            first = self._unreplicated[0][2]
            return first if self._unsaved is None else min(first, self._unsaved)
        return self._unsaved

    def came_in_with(self, index: int) -> None:
        """Records held for a group on its way, just applied under a fresh index, came in with
        input `index`: that input waits for the save that reflects them (and, with
        `replicated_acks`, for the standby's copy of it), not only the fresh index. Released at
        the save alone, it would be acked while the node can still lose the install, and the old
        owner would send the group again without those records (CHANGELOG.md, "A held record's
        input was acked before the standby held the install that applied it")."""
        if self._unsaved is not None and index < self._unsaved:
            self._unsaved = index

    def saved_token(self) -> Tuple[int, int]:
        """What the files hold after the last save: (generation, bytes of its log). Tokens grow
        with every save, so "the standby holds token T" covers every save up to T."""
        return self._gen, self._log_bytes

    def replicated(self, gen: int, log_bytes: int) -> None:
        """The standby holds the saves up to (gen, log_bytes): their inputs may be acked."""
        while self._unreplicated and self._unreplicated[0][:2] <= (gen, log_bytes):
            self._unreplicated.pop(0)

    def hold_until_replicated(self) -> None:
        """A restored state that the standby may not hold (a crash between a save and its
        replication): every input waits until the next save (a full snapshot) is replicated."""
        if self.replicated_acks and self._unsaved is None:
            self._unsaved = 0

    def prune_outputs(self, lowest_pending: Optional[int]) -> None:
        """Forget the outputs every successor acked: those of inputs below `lowest_pending` (the
        lowest input index with outputs still buffered, in flight or unacked; None: none is)."""
        before = len(self.outputs)
        if lowest_pending is None:
            self.outputs = []
        elif self.outputs and self.outputs[0][0] < lowest_pending:
            self.outputs = [(i, it) for i, it in self.outputs if i >= lowest_pending]
        self._out_dropped += before - len(self.outputs)  # a prefix: indices grow along the list

    def _group_json(self, g: int) -> Dict[str, Any]:
        """One group as a JSON value: an operator with the default (JSON) snapshot keeps its states
        as they are ("pairs"); any other as its snapshot's bytes in base64 ("bytes")."""
        states = self.states.get(g, {})
        emitted = [[k, n] for k, n in self.emitted.get(g, {}).items()]
        if type(self.op).snapshot is KeyedOperator.snapshot:
            blob: Dict[str, Any] = {"pairs": [[k, v] for k, v in states.items()], "emitted": emitted}
        else:
            blob = {"bytes": base64.b64encode(self.op.snapshot(states)).decode(), "emitted": emitted}
        if g in self.floors:
            blob["floor"] = self.floors[g]  # travels and is saved with the group's counters
        return blob

    def group_snapshot(self, g: int) -> bytes:
        """One key group as bytes (what a hand-over moves): its states and output counters."""
        return json.dumps(self._group_json(g), separators=(",", ":")).encode()

    def restore_group(self, g: int, data: bytes) -> None:
        self._restore_group(g, json.loads(data))

    def _restore_group(self, g: int, blob: Dict[str, Any]) -> None:
        if "pairs" in blob and type(self.op).restore is KeyedOperator.restore:
            states = {k: v for k, v in blob["pairs"]}  # the default restore, without a JSON round trip
        elif "pairs" in blob:
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
        floor = blob.get("floor")
        if type(floor) is int and 0 <= floor < 2 ** 53:
            self.floors[g] = floor
        if type(self.op).notify_at is not KeyedOperator.notify_at:  # the default arms no timer
            for key, state in self.states.get(g, {}).items():
                self._arm(key, state)

    # ---- hand-over of a key group (agent.instance.handover; docs/operators.md, "Key groups that move")

    def hand_out(self, g: int, forget: bool = True) -> bytes:
        """Group `g` for its new owner, then forgotten here (its outputs not acked yet stay: this
        instance sent them and sends them again if asked). The bytes carry, besides the group's
        states and output counters, every source's applied numbers: a replay of a record applied
        here may reach the new owner, which must skip it. Called once the group's state is final
        (every predecessor's end-of-stream marker applied). `forget=False`: the caller forgets it
        later (`forget_group`), once the bytes are safe elsewhere."""
        blob = self._group_json(g)
        blob["applied"] = {s: a.to_json() for s, a in self.applied.items()}
        if forget:
            self.forget_group(g)
        return json.dumps(blob, separators=(",", ":")).encode()

    def freeze_group(self, g: int) -> None:
        """Group `g` is handed out (its state final, every end-of-stream marker applied) but kept
        until installed elsewhere: its timers are cancelled (its windows fire at the new owner;
        their heap entries are skipped as stale). Its keys get no record here any more."""
        self.frozen.add(g)
        for key in self.states.get(g, {}):
            self.timers.pop(key, None)

    def forget_group(self, g: int) -> None:
        """Group `g` left (its state is in the bytes `hand_out` made): dropped here, and from the
        files at the next save."""
        self.frozen.discard(g)
        self.load.pop(g, None)
        for key in self.states.pop(g, {}):
            self.timers.pop(key, None)  # its heap entry is skipped as stale
            self._dirty_keys[(g, key)] = None
        for key in self.emitted.pop(g, {}):  # the counters travel with the group: an id is never reused
            self._dirty_keys[(g, key)] = None
        if self.floors.pop(g, None) is not None:
            self._full_next = True  # a floor is in the snapshot only

    def take_in(self, g: int, data: bytes) -> None:
        """Install group `g` from `hand_out`'s bytes (untrusted: they came over the bus; size bounded
        by the hand-over's chunks). The applied numbers merge with this instance's."""
        if g in self.states or not 0 <= g < self.groups:
            raise ValueError(f"keyed state of {self.operator}: cannot take in group {g} (held here or out of range)")
        blob = json.loads(data)
        if not isinstance(blob, dict) or not isinstance(blob.get("applied", {}), dict):
            raise ValueError(f"keyed state of {self.operator}: group {g}: not a hand-over")
        for src, aj in blob.pop("applied", {}).items():
            theirs = Applied.from_json(aj)
            mine = self.applied.get(str(src))
            self.applied[str(src)] = theirs if mine is None else union(mine, theirs)
            self._dirty_pos[str(src)] = None
        self._restore_group(g, blob)
        self._dirty_keys.update(dict.fromkeys((g, k) for k in self.states.get(g, {})))
        self._dirty_keys.update(dict.fromkeys((g, k) for k in self.emitted.get(g, {})))
        if g in self.floors:
            self._full_next = True  # a floor is in the snapshot only

    def to_text(self) -> str:
        """The saved form: one JSON document (its cost grows with the state)."""
        return "".join(self.text_parts())

    def text_parts(self) -> Iterator[str]:
        """`to_text()` in pieces, character for character what json.dumps writes for the whole
        document: the applied numbers PIECE_SOURCES sources at a time, the outputs PIECE_OUTPUTS at a
        time, each group alone. `save` writes them one by one, so a
        snapshot holds one piece at a time: encoding the whole document at once took 4-5 times
        its size in transient memory (the encoder's list of small strings, then the text), which
        set the peak resident memory of the demo's keyed workers (docs/results.md, O20)."""
        top: Dict[str, Any] = {"format": FORMAT, "gen": self._gen, "operator": self.operator, "key_groups": self.groups}
        if self.owned is not None:
            top["owned"] = group_runs(self.owned)
        head = _dumps(top)
        yield head[:-1] + ',"applied":{'
        sources = iter(self.applied.items())  # one per output source upstream: thousands after a keyed stage
        sep = ""
        while True:
            piece = {s: a.to_json() for s, a in islice(sources, PIECE_SOURCES)}
            if not piece:
                break
            yield sep + _dumps(piece)[1:-1]
            sep = ","
        yield '},"max_time":' + _dumps(self.max_time) + ',"outputs":['
        outs = self.outputs
        for i in range(0, len(outs), PIECE_OUTPUTS):
            text = _dumps([it for _, it in outs[i:i + PIECE_OUTPUTS]])
            yield ("," if i else "") + text[1:-1]
        yield '],"groups":{'
        sep = ""
        for g in sorted(set(self.states) | set(self.emitted) | set(self.floors)):
            yield f'{sep}"{g}":' + _dumps(self._group_json(g))
            sep = ","
        yield "}}"

    def to_json(self) -> Dict[str, Any]:
        return dict(json.loads(self.to_text()))

    def save(self, path: Path) -> None:
        """Save what changed; afterwards the applied inputs may be acked.

        Two files: `path`, a full snapshot written atomically (write, then rename), and
        `<path>.log`, one line appended per save with the keys, positions and outputs changed
        since the previous line (one write() each: a kill -9 leaves it whole or absent, a power
        cut at worst a torn last line, which `load` ignores). The log is folded into a new
        snapshot once it is larger than the snapshot (or LOG_MIN), so a save costs what changed,
        not the whole state, and the log stays within about twice the state."""
        log_path = path.with_name(path.name + ".log")
        if self._full_next or self._log_bytes > max(LOG_MIN, self._base_bytes):
            self._gen += 1
            size = write_atomic_parts(path, self.text_parts())
            with open(log_path, "w"):
                pass  # lines of the previous generation: folded into the snapshot (ignored if left)
            self._base_bytes, self._log_bytes, self._full_next = size, 0, False
            self._owned_saved = dict(self.owned) if self.owned is not None else None
        else:
            line = (json.dumps(self._delta(), separators=(",", ":")) + "\n").encode()
            append(log_path, line)
            self._log_bytes += len(line)
        self._dirty_keys.clear()
        self._dirty_pos.clear()
        self._out_new = []
        self._out_dropped = 0
        if self.replicated_acks and self._unsaved is not None:
            self._unreplicated.append((self._gen, self._log_bytes, self._unsaved))
        self._unsaved = None
        self.counts["state_saves"] += 1

    def _delta(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"gen": self._gen}
        if self.owned is not None and self.owned != self._owned_saved:
            # second, right after the generation: a standby reads it from the line's start
            # (agent.node.replicas `owned_in_log`) without parsing the rest
            d["owned"] = group_runs(self.owned)
            self._owned_saved = dict(self.owned)
        d.update({"applied": {k: self.applied[k].to_json() for k in self._dirty_pos},
                  "max_time": self.max_time, "out_add": self._out_new, "out_drop": self._out_dropped})
        if self._json_states:
            keys = []
            for g, k in self._dirty_keys:
                states = self.states.get(g, {})
                keys.append([g, k, k in states, states.get(k), self.emitted.get(g, {}).get(k)])
            d["keys"] = keys
        else:  # the operator's own snapshot is per group: the changed groups, whole
            d["groups"] = {str(g): self._group_json(g) for g in sorted({g for g, _ in self._dirty_keys})}
        return d

    def floor_groups(self, groups: Iterable[int], first: int) -> None:
        """Number the outputs of these groups' keys that have no counter from `first` on: their
        counters were lost with a node (a re-homed instance without its state), and starting
        again at 1 gave outputs the ids of outputs the sink had recorded, which it dropped as
        copies. The floors are saved with the groups (a full snapshot next) and move with them."""
        for g in groups:
            self.floors[g] = max(self.floors.get(g, 0), int(first))
        self._full_next = True

    def restore(self, data: Dict[str, Any]) -> List[Item]:
        """Load a saved state; returns the outputs to send again (the caller re-indexes them)."""
        if data.get("format") not in (1, FORMAT):
            raise ValueError(f"keyed state: expected format {FORMAT}, found {data.get('format')!r}")
        if int(data.get("key_groups", -1)) != self.groups:
            raise ValueError(f"keyed state of {self.operator}: saved with {data.get('key_groups')} key groups, "
                             f"the pipeline says {self.groups} (key_groups is fixed for a deployment)")
        self.applied = {str(s): Applied.from_json(a) for s, a in (data.get("applied") or {}).items()}
        if data.get("positions"):
            # Format 1 kept the highest number applied per (predecessor, source): read as "every
            # number up to it applied", the lowest over the predecessors of each source.
            floors: Dict[str, int] = {}
            for pk, v in data["positions"].items():
                src = str(pk).split(" ", 1)[-1]
                floors[src] = min(floors.get(src, int(v) + 1), int(v) + 1)
            for src, f in floors.items():
                self.applied.setdefault(src, Applied()).raise_floor(f)
        mt = data.get("max_time")
        self.max_time = float(mt) if mt is not None else None
        for g, blob in (data.get("groups") or {}).items():
            self._restore_group(int(g), blob)
        self._gen = int(data.get("gen", 0))
        self._full_next = True  # the caller re-indexes the outputs: start a new snapshot
        return [(str(s), int(q), r) for s, q, r in data.get("outputs") or []]

    load = staticmethod(load_saved)

    def stats(self) -> Dict[str, Any]:
        s: Dict[str, Any] = dict(self.counts)
        s.update(keyed_state=True, key_groups_held=len(self.states), keys_held=sum(len(v) for v in self.states.values()),
                 applied_intervals=sum(a.intervals() for a in self.applied.values()),
                 timers=len(self.timers), watermark=self.watermark, unacked_outputs=len(self.outputs))
        s.update(self.op.stats())
        return s
