"""Run a pipeline's operators offline, in one process, on a list of records (docs/operators.md,
"Testing with the harness"; in the spirit of bytewax.testing and Flink's operator test harnesses).

    from agent.testing import KeyedHarness, run_pipeline

    h = KeyedHarness("agent.operators.windows:window", params, key_field="sensor", state_dir=tmp_path)
    h.feed(records[:50]); h.crash(); h.feed(records[50:80]); h.scale_out(); h.feed(records[80:])
    h.scale_in(); h.end()
    assert h.records() == expected

    out = run_pipeline("pipeline.toml", records, state_dir=tmp_path, at={50: ["crash"], 80: ["scale_out"]})

What is real and what is not:
- The keyed operator runs inside the real keyed state (agent.instance.keyed_state.KeyedState):
  its record ids, replays skipped, lateness, timers, output ids, `save` (snapshot and log) and
  `load`/`restore`. Records are routed to the instances by the real key -> group mapping and a real
  group -> owner table (agent.dataplane.routing.Router, agent.dataplane.owners.GroupTable).
- A crash (`crash`) throws the instance away, builds its operator again with `ctx.restart = True`
  and restores the state from the files its last save wrote (`<state_dir>/<instance>.keyed.json`,
  the worker's names); the outputs saved unacked are delivered again and the inputs applied since
  the last save are replayed, as the predecessors and the worker do. `resend` replays some saved
  ones too (an ack lost on its way): skipped as duplicates.
- A scale-out (`scale_out`) plans the copy's share with the real `split_share` (by the measured
  load) and moves each group with `hand_out` / `take_in` (states, output counters, every source's
  applied numbers), then fires what is due at the new owner (`fire_due`); a scale-in
  (`scale_in`) moves all the leaver's groups by `absorb_plan`. Not covered: the protocol that
  carries them (Offer, Redirect, Eos, chunks, held records: agent.instance.moves, checked by
  tests/test_group_moves.py). Here every record sent before a move is applied before it, so no
  record is ever held.
- The watermark is per instance, as in a fleet: an instance that takes groups in fires their
  windows by its own watermark, so with records far out of order a scaled run may judge lateness
  differently from a run on one instance (as a fleet would).
- `end()` is the end of a bounded input: the event-time maximum of every instance set to +inf,
  so every open window fires (Flink's final watermark). A live stream has no end; the runtime
  never does this.

Outputs arrive at a sink that keeps each id once (as counting_sink): a copy sent again must carry
the same record, else `AssertionError` (determinism). `records()` lists them in arrival order.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from agent.dataplane.envelope import Item
from agent.dataplane.owners import GroupTable, absorb_plan, split_share
from agent.dataplane.routing import Router
from agent.instance.keyed_state import KeyedState
from agent.operators.builtin import Operator, OperatorContext, load_operator
from agent.operators.keyed import KeyedOperator, is_keyed

__all__ = ["KeyedHarness", "run_pipeline", "Sink", "as_items"]

Records = Union[Sequence[Any], Sequence[Item]]


def as_items(records: Iterable[Any], source: str = "src", first: int = 0) -> List[Item]:
    """`records` as items `(source, n, record)` numbered from `first` (items are kept as they are)."""
    out: List[Item] = []
    for i, r in enumerate(records):
        if isinstance(r, tuple) and len(r) == 3 and isinstance(r[0], str) and isinstance(r[1], int):
            out.append(r)
        else:
            out.append((source, first + i, r))
    return out


class Sink:
    """Keeps each output id once, in arrival order; a second copy must be the same record."""

    def __init__(self) -> None:
        self.by_id: Dict[Tuple[str, int], Any] = {}
        self.order: List[Tuple[str, int]] = []
        self.duplicates = 0

    def take(self, items: Iterable[Item]) -> None:
        for s, q, r in items:
            k = (s, q)
            if k in self.by_id:
                self.duplicates += 1
                a, b = json.dumps(self.by_id[k], sort_keys=True), json.dumps(r, sort_keys=True)
                assert a == b, f"output {k} sent again with another record: {a} then {b}"
                continue
            self.by_id[k] = r
            self.order.append(k)

    def records(self) -> List[Any]:
        return [self.by_id[k] for k in self.order]


class _Instance:
    def __init__(self, name: str, op: KeyedOperator, ks: KeyedState) -> None:
        self.name, self.op, self.ks = name, op, ks
        self.unsaved: List[Item] = []  # applied since the last save: the predecessor still holds them
        self.saved: List[Item] = []  # applied and saved (acked upstream), for `resend`
        self.batches = 0


def allow_list(allowed: Any) -> Any:
    """`allowed` as the harness takes it: None (this process's allow-list, as a worker's: the
    built-ins and installed entry points), an `AllowList`, or the names of your own operator
    modules, as agent.toml's `[operators] modules` lists them (the built-ins stay allowed)."""
    if allowed is None or not isinstance(allowed, (list, tuple)):
        return allowed
    from agent.operators.admission import AllowList
    from agent.refs import check_module_name

    for m in allowed:
        problem = check_module_name(m)
        if problem is not None:
            raise ValueError(f"allowed: {m!r}: {problem}")
    return AllowList.for_node(allowed)


class KeyedHarness:
    """One keyed operator over one or more instances, driven through the real keyed state.

    `function`: a "module:name" resolved through `allowed` (default: this process's allow-list,
    as a worker does; a list of module names allows those too, as `[operators] modules` does on a
    node), or the operator object itself. `key_field`: the `key` of the operator before
    it. Records are fed in batches of `batch_size` (per instance, in arrival order); each instance
    saves its state every `save_every` batches (the worker: once per turn of its loop)."""

    def __init__(self, function: Any, params: Optional[Mapping[str, Any]] = None, *, key_field: Optional[str],
                 state_dir: Union[str, Path], operator: str = "op", pipeline: str = "p", key_groups: int = 128,
                 batch_size: int = 10, save_every: int = 1, allowed: Any = None,
                 downstream: Sequence[Operator] = ()) -> None:
        self.function, self.params = function, dict(params or {})
        self.key_field, self.operator, self.groups = key_field, operator, key_groups
        self.pipeline = pipeline
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.batch_size, self.save_every, self.allowed = batch_size, save_every, allow_list(allowed)
        self.downstream = list(downstream)  # stateless operators after the keyed one, then the sink
        self.sink = Sink()
        self._index = 0
        self._next_copy = 1
        self._fed: Dict[str, int] = {}  # source -> the number after its last record fed
        first = self._name(0)
        self.table = GroupTable.dealt([first], key_groups)
        self.instances: Dict[str, _Instance] = {first: self._start(first, restart=False)}

    # ---- building ------------------------------------------------------------------------------------

    def _name(self, n: int) -> str:
        return f"{self.pipeline}.{self.operator}.{n}"

    def _build(self, name: str, restart: bool) -> KeyedOperator:
        ctx = OperatorContext(instance=name, operator=self.operator, node="harness", kind="map",
                              params=dict(self.params), state_dir=self.state_dir, sink_dir=self.state_dir, restart=restart)
        if isinstance(self.function, str):
            op = load_operator(self.function, ctx, self.allowed)
        else:
            build = getattr(self.function, "build", None)
            op = build(ctx) if callable(build) else self.function
        if not isinstance(op, KeyedOperator):
            raise ValueError(f"harness: {self.function!r} is not a keyed operator")
        return op

    def _start(self, name: str, restart: bool) -> _Instance:
        op = self._build(name, restart)
        return _Instance(name, op, KeyedState(op, self.operator, self.key_field, self.groups))

    def path(self, name: str) -> Path:
        """Where `name` saves its keyed state (the worker's file name)."""
        return self.state_dir / f"{name}.keyed.json"

    # ---- records -------------------------------------------------------------------------------------

    def _deliver(self, items: List[Item]) -> None:
        for op in self.downstream:
            items = op.process(items)
        self.sink.take(items)

    def _apply(self, inst: _Instance, items: List[Item]) -> None:
        self._index += 1
        # Each delivery its own top-level copy of a record, as the worker's (decoded from the
        # batch's bytes, or a chained predecessor's shallow copy).
        got = [(s, q, dict(r) if isinstance(r, dict) else r) for s, q, r in items]
        out = inst.ks.apply(self._sender(items), got, self._index)
        inst.unsaved.extend(items)
        inst.batches += 1
        self._deliver(list(out))
        if inst.batches % self.save_every == 0:
            self._save(inst)

    @staticmethod
    def _sender(items: List[Item]) -> str:
        return f"pred:{items[0][0]}" if items else "pred"

    def _save(self, inst: _Instance) -> None:
        inst.ks.save(self.path(inst.name))
        inst.saved.extend(inst.unsaved)
        inst.unsaved = []
        inst.ks.prune_outputs(None)  # the sink has them all (it acks at once)

    def feed(self, records: Records, source: str = "src", first: Optional[int] = None) -> None:
        """Apply `records` (or items `(source, n, record)`), numbered on from the last fed record of
        `source` unless `first` is given, in chunks of `batch_size` split by owning instance."""
        if first is None:
            first = self._fed.get(source, 0)
        items = as_items(records, source, first)
        for s, q, _ in items:
            self._fed[s] = max(self._fed.get(s, 0), q + 1)
        router = Router(sorted(self.instances), key=self.key_field, groups=self.groups, table=self.table)
        for i in range(0, len(items), self.batch_size):
            per: Dict[str, List[Item]] = {}
            for it in items[i:i + self.batch_size]:
                per.setdefault(router.by_key(it[2]), []).append(it)
            for name, batch in per.items():
                self._apply(self.instances[name], batch)

    # ---- faults and scaling -----------------------------------------------------------------------------

    def crash(self, name: Optional[str] = None, resend: int = 0) -> None:
        """`name` (default: the first instance) dies and restarts from its saved files: its
        operator built again with `ctx.restart = True`, the saved outputs not acked delivered
        again, the inputs applied since the last save replayed (and the last `resend` saved ones:
        skipped as duplicates)."""
        name = name or sorted(self.instances)[0]
        old = self.instances[name]
        inst = self._start(name, restart=True)
        inst.saved = old.saved
        data = KeyedState.load(self.path(name))
        if data is not None:
            again = inst.ks.restore(data)
            self._index += 1
            inst.ks.outputs = [(self._index, it) for it in again]
            self._deliver(list(again))
        self.instances[name] = inst
        replay = (old.saved[-resend:] if resend else []) + old.unsaved
        for i in range(0, len(replay), self.batch_size):
            self._apply(inst, replay[i:i + self.batch_size])
        self._save(inst)

    def _move(self, g: int, src: _Instance, dst: _Instance) -> None:
        data = src.ks.hand_out(g)
        dst.ks.take_in(g, data)
        self.table.moved(g, dst.name)

    def scale_out(self, creator: Optional[str] = None) -> str:
        """A copy of `creator` (default: the instance holding the most groups) takes about half its
        key groups by measured load (`split_share`), each moved with its state; returns its name."""
        if creator is None:
            creator = max(sorted(self.instances), key=lambda n: len(self.table.groups_of(n)))
        src = self.instances[creator]
        self._save(src)
        name = self._name(self._next_copy)
        self._next_copy += 1
        dst = self.instances[name] = self._start(name, restart=False)
        for g in split_share(self.table.groups_of(creator), src.ks.load):
            self._move(g, src, dst)
        self._index += 1
        self._deliver(list(dst.ks.fire_due(self._index)))
        self._save(src)
        self._save(dst)
        return name

    def scale_in(self, leaver: Optional[str] = None) -> None:
        """`leaver` (default: the newest copy) hands all its groups to the survivors (`absorb_plan`,
        by measured load) and leaves."""
        names = sorted(self.instances)
        if len(names) < 2:
            raise ValueError("harness: scale_in needs two instances")
        leaver = leaver or max(names, key=lambda n: int(n.rsplit(".", 1)[1]))
        src = self.instances[leaver]
        self._save(src)
        load: Dict[int, float] = {}
        for inst in self.instances.values():
            load.update(inst.ks.load)
        plan = absorb_plan(self.table, leaver, [n for n in names if n != leaver], load)
        for g, to in sorted(plan.items()):
            self._move(g, src, self.instances[to])
        del self.instances[leaver]
        for inst in self.instances.values():
            self._index += 1
            self._deliver(list(inst.ks.fire_due(self._index)))
            self._save(inst)

    def end(self) -> None:
        """The end of the input: every instance's event-time maximum set to +inf, so every open
        window fires (see the module docstring). Nothing is saved after it."""
        for inst in self.instances.values():
            if inst.ks.op.uses_event_time:
                inst.ks.max_time = math.inf
                self._index += 1
                self._deliver(list(inst.ks.fire_due(self._index)))

    # ---- results -------------------------------------------------------------------------------------

    def records(self) -> List[Any]:
        return self.sink.records()

    def stats(self) -> Dict[str, Dict[str, Any]]:
        return {n: inst.ks.stats() for n, inst in sorted(self.instances.items())}


def run_pipeline(pipeline: Any, records: Records, *, state_dir: Union[str, Path], at: Optional[Mapping[int, Sequence[str]]] = None,
                 batch_size: int = 10, save_every: int = 1, allowed: Any = None, end: bool = True,
                 source: str = "src") -> KeyedHarness:
    """A pipeline's operators between its source and its sink on `records` (what its source would
    emit): the maps before the keyed operator, the keyed operator in a `KeyedHarness`, the maps
    after it. `pipeline`: a path, a pipeline's TOML text or a PipelineConfig. `at`: before the
    record numbered n (its position in `records`, counted before any filter), actions among "crash", "crash:<instance>", "scale_out", "scale_in".
    `end`: `KeyedHarness.end()` after the last record. Returns the harness (`records()`)."""
    from agent.config import PipelineConfig, load_pipeline, load_pipeline_text

    if isinstance(pipeline, PipelineConfig):
        cfg = pipeline
    elif isinstance(pipeline, Path) or (isinstance(pipeline, str) and "\n" not in pipeline):
        cfg = load_pipeline(pipeline)
    else:
        cfg = load_pipeline_text(pipeline)
    ops = cfg.operators
    allowed = allow_list(allowed)
    built: List[Any] = []
    for o in ops[1:-1]:
        ctx = OperatorContext(instance=f"{cfg.pipeline.name}.{o.name}.0", operator=o.name, node="harness", kind=o.kind,
                              params=dict(o.params), state_dir=Path(state_dir), sink_dir=Path(state_dir))
        built.append(load_operator(o.function, ctx, allowed))
    k = next((i for i, b in enumerate(built) if is_keyed(b)), None)
    if k is None:
        raise ValueError("run_pipeline: the pipeline has no keyed operator (a map alone: call its process())")
    before, after = built[:k], built[k + 1:]
    op = ops[k + 1]
    h = KeyedHarness(op.function, op.params, key_field=ops[k].key, state_dir=state_dir, operator=op.name,
                     pipeline=cfg.pipeline.name, key_groups=op.key_groups, batch_size=batch_size, save_every=save_every,
                     allowed=allowed, downstream=after)
    items = as_items(records, source)
    for m in before:
        kept: List[Item] = []
        for i in range(0, len(items), batch_size):
            kept += m.process(items[i:i + batch_size])
        items = kept
    marks = dict(at or {})
    start = 0
    for c in sorted(marks):
        h.feed([it for it in items if start <= it[1] < c])
        for action in marks[c]:
            what, _, arg = action.partition(":")
            if what == "crash":
                h.crash(arg or None)
            elif what == "scale_out":
                h.scale_out(arg or None)
            elif what == "scale_in":
                h.scale_in(arg or None)
            else:
                raise ValueError(f"run_pipeline: unknown action {action!r}")
        start = c
    h.feed([it for it in items if it[1] >= start])
    if end:
        h.end()
    return h
