"""Which node hosts which instance, as this agent computes it and tells its workers (the
control line "hosts"; docs/security.md, "Data channels"), and where this node moved instances to.

Rules of this file: no I/O, no clock, no reference to the daemon. The daemon passes its workers
and its fleet view to `sync`, sends the tables it returns, says which were delivered, and keeps
the proven bindings and the "moved" statements in its state directory (`saved`,
`moved_to`); agent.node.hostmap decides the bindings themselves.

Why the "moved" statements: where this node moved an instance (a hand-over, a re-home) is
stated in its retained state record, which only it may write, so that no other node can take
the instance's binding while it moves; a statement is the only proof of a re-homed binding, so
the daemon keeps them over a restart (a re-homer that forgot one would leave its instance's new
node unproven for good).
"""

from __future__ import annotations

from typing import Any, Container, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from agent.node.hostmap import MAX_MOVED, HostMap, moved_of

# (pipeline, pid) of each local worker, by instance
Workers = Mapping[str, Tuple[str, int]]


def generation_of(spec: Mapping[str, Any]) -> str:
    """The deploy generation a hosted record's spec names (bus input: "" unless a string)."""
    extra = spec.get("extra")
    gen = extra.get("generation") if isinstance(extra, dict) else None
    return gen[:64] if isinstance(gen, str) else ""


class HostSync:
    def __init__(self, me: str, moved_to: Optional[Dict[str, str]] = None,
                 bindings: Optional[Dict[str, Any]] = None) -> None:
        self.me = me
        self.hostmap = HostMap(me)
        self.hostmap.restore(bindings)
        self.saved = self.hostmap.saved()  # the bindings last kept on disk
        self.moved_to: Dict[str, str] = dict(moved_to or {})  # where we moved instances, newest last
        self.near: Set[str] = set()  # nodes hosting instances of our pipelines
        self.dirty = True  # a record, a status or a statement changed: compute the bindings again
        self._sent: Dict[str, Tuple[int, Dict[str, Any]]] = {}  # instance -> (pid, table sent)
        self._local: Set[str] = set()

    def moved_statements(self, running: Container[str]) -> Dict[str, str]:
        """Our "moved" statements, without those of instances we moved away that run here again."""
        return {i: n for i, n in self.moved_to.items() if n == self.me or i not in running}

    def stated_move(self, instance: str, node: Any) -> bool:
        """We moved `instance` to `node` (its createNode() reply); True when there is a statement
        to keep and publish (a node name)."""
        if not isinstance(node, str):
            return False
        self.moved_to.pop(instance, None)
        self.moved_to[instance] = node
        while len(self.moved_to) > MAX_MOVED:
            del self.moved_to[next(iter(self.moved_to))]
        self.dirty = True
        return True

    def not_started(self, instance: str) -> None:
        """The worker of `instance` exited here before it was ready (its start failed): it never
        ran here, so its binding starts over (agent.node.hostmap, `forget`)."""
        self.hostmap.forget(instance)
        self.dirty = True

    def sync(self, workers: Workers, hosted_by_node: Mapping[str, Sequence[Mapping[str, Any]]],
             fleet: Mapping[str, Mapping[str, Any]], online: Mapping[str, bool],
             rehomed_by_node: Mapping[str, Mapping[str, float]]) -> Tuple[bool, List[Tuple[str, int, Dict[str, Any]]]]:
        """Recompute the bindings when a record, a status or our own set of workers changed;
        returns (whether they were recomputed: keep them, `bindings_to_keep`; (instance, pid,
        table) for each worker whose pipeline's table differs from what that process got last:
        a restarted worker is a new process)."""
        if set(workers) != self._local:
            self._local = set(workers)
            self.dirty = True
        recomputed = self.dirty
        if self.dirty:
            self.dirty = False
            claims = {n: [(s["instance"], s["pipeline"], generation_of(s)) for s in specs]
                      for n, specs in hosted_by_node.items()}
            moved = {n: moved_of(doc) for n, doc in fleet.items() if n != self.me}
            moved[self.me] = self.moved_statements(workers)
            self.hostmap.update({i: p for i, (p, _) in workers.items()}, claims, online, rehomed_by_node, moved)
            self.near = self.hostmap.nodes_of({p for p, _ in workers.values()})
        elif all(self._sent.get(i, (None,))[0] == pid for i, (_, pid) in workers.items()):
            return False, []
        for inst in [i for i in self._sent if i not in workers]:
            del self._sent[inst]
        tables: Dict[str, Dict[str, Any]] = {}
        out = []
        for inst, (pipeline, pid) in workers.items():
            table = tables.get(pipeline)
            if table is None:
                table = tables[pipeline] = self.hostmap.table(pipeline)
            sent = self._sent.get(inst)
            if sent is None or sent[0] != pid or sent[1] != table:
                out.append((inst, pid, table))
        return recomputed, out

    def delivered(self, instance: str, pid: int, table: Dict[str, Any]) -> None:
        self._sent[instance] = (pid, table)

    def bindings_to_keep(self) -> Optional[Dict[str, Any]]:
        """The proven bindings when they changed since they were last kept (`kept`), else None."""
        saved = self.hostmap.saved()
        return saved if saved != self.saved else None

    def kept(self, saved: Dict[str, Any]) -> None:
        self.saved = saved


__all__ = ["HostSync", "Workers", "generation_of"]
