"""Which node hosts which instance, as this agent knows it: the binding a receiver checks the
writer of an inbox message against (docs/security.md, "Data channels"). Sans-IO.

Why the agent computes it from the hosted records rather than having the protocol carry it: the
retained `agents/<n>/hosted` record is written only by node n (the broker's ACL), lists every
instance n hosts from the moment it is ready (before anybody is told about it: invariant 2),
and changes on every way an instance arrives or leaves (deploy, createNode, restart, re-home,
hand-over, termination). Carrying the node in the protocol's messages would need every one of
those paths (and the sans-IO scaling core) to learn about nodes; the records already say it.

The rule, per instance (`HostMap.update`):
- an instance running under this agent is ours: bound to this node;
- otherwise the nodes whose hosted record lists it are its *claimers*. The binding is sticky: it
  stays with the node it names while that node still lists the instance and is online, and
  moves only to another claimer, when its node stops listing it (a hand-over: the old node
  forgets it once the new incarnation is ready) or goes offline while an online node lists it
  (a re-home). With no other claimer it stays where it was (a terminated instance's last
  messages still arrive; a node whose agent restarts still has draining workers). So a node
  that merely lists an instance another live node hosts does not get its binding.
- Who says where an instance went (`moved`, issue #20 item 3): the node that moved it names the
  new node in its own retained state record (`"moved": {instance: node}`), which only it may
  write: on a hand-over the old node, on a re-home the re-homing agent (the lowest-named online
  node, `rehome.responsible`). When the bound node stops listing an instance and names where it
  went, the binding goes there and nowhere else (waiting until that node lists it); a hostile
  node listing the instance too gets nothing. Without a statement (an agent of before, a
  statement not arrived yet) the binding moves only when exactly one online node lists the
  instance; with several it stays (a hostile node can then delay a move, not take it). An
  instance with no binding yet still goes to one of its claimers (docs/security.md, "What this
  does not prove").
- The other claimers are `pending` (diagnostics: a move in progress, or a node listing an
  instance it does not host). The worker accepts an envelope only from the bound node; one
  from any other node waits (briefly, bounded) for the binding to name it, then is refused.
- One exception: the nodes the instance was bound to before (`former`, at most 4) while they
  are offline. An offline node cannot write; what it wrote while it hosted the instance may
  still wait in the broker, e.g. in the session a re-homed receiver inherits from its dead
  incarnation. Accepted as before the node check (the channel drops what a newer epoch made
  stale); refused, they would come back only through replays.

- A binding belongs to one deploy of the instance's pipeline. Instance ids repeat across deploys
  of a pipeline under the same name, and so would a namesake's binding history: a validate copy
  that ran here in one deploy and on another node in the next was bound there *unproven* (moved
  without a word), so the new copy's first epoch was held and refused, and the pipeline stalled
  (`fog-agent testbed pipeline --rate 800` twice on one fleet). When every claimer lists the
  instance under another deploy generation than the one it was bound in (the hosted records
  carry it), the instance starts over as one this agent never saw; never while a claimer still
  lists it under the old deploy.

- An instance whose start under this agent failed (its worker exited before it was ready: the
  spawn goes on to the next node, a failed hand-over goes back to the node it came from) never
  ran here: it starts over too (`forget`, told by the daemon). Kept bound here, it was the
  binding the next node's listing moved it from, without a statement: bound there *unproven*,
  so our workers held its first epoch and refused it (a keeper's copy placed here while this
  node was cut off the broker).

- A binding outlives the agent's restart (`saved` / `restore`, the daemon keeps it in its state
  directory): the proven bindings to other nodes come back as the bindings the rule starts from.
  Without them an agent that restarted saw every claimer of a never-moved instance as equal, and
  a node that listed an instance it does not host (a stolen node key) kept it bound to nobody at
  that agent for as long as it listed it. A brand-new agent (or one whose disk was lost) still
  starts with none (docs/security.md, "What a compromised node can still do").

Bounded: at most `max_entries` instances, those no record lists any more forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Mapping, Optional, Set, Tuple

__all__ = ["HostMap", "MAX_ENTRIES", "MAX_FORMER", "MAX_MOVED", "MAX_NAME", "moved_of"]

MAX_ENTRIES = 4096
MAX_FORMER = 4
MAX_MOVED = 256  # statements one node keeps in its state record ("moved"), the newest
MAX_NAME = 256  # an instance, node, pipeline or generation name in a saved binding


def moved_of(doc: Any) -> Dict[str, str]:
    """The "moved" statements of a node's state record (bus input): {instance: node}, strings
    only, at most MAX_MOVED entries; anything else is ignored."""
    moved = doc.get("moved") if isinstance(doc, dict) else None
    if not isinstance(moved, dict):
        return {}
    out = {i: n for i, n in moved.items() if isinstance(i, str) and isinstance(n, str)}
    return dict(list(out.items())[:MAX_MOVED])


class HostMap:
    def __init__(self, node: str, max_entries: int = MAX_ENTRIES) -> None:
        self.node = node
        self.max_entries = max_entries
        # instance -> (bound node, pipeline or "" when unknown); insertion order = age
        self._bound: "OrderedDict[str, Tuple[str, str]]" = OrderedDict()
        self._pending: Dict[str, Tuple[str, ...]] = {}
        self._former: Dict[str, List[str]] = {}  # instance -> nodes it was bound to before, newest first
        self._online: Dict[str, bool] = {}
        self._listed: Set[str] = set()
        # Bindings taken without a statement from who moved the instance (one claimer, no word):
        # a statement naming another listing node moves them, and the workers do not let their
        # sender start a new epoch until the binding is proven (the table's "unproven").
        self._unproven: Set[str] = set()
        self._generation: Dict[str, str] = {}  # instance -> the deploy its binding was made in

    def update(
        self,
        local: Mapping[str, str],
        hosted: Mapping[str, Iterable[Tuple[str, ...]]],
        online: Mapping[str, bool],
        rehomed: Optional[Mapping[str, Mapping[str, float]]] = None,
        moved: Optional[Mapping[str, Mapping[str, str]]] = None,
    ) -> None:
        """Recompute from what the agent knows now.

        local: {instance: pipeline} running (or starting) under this agent;
        hosted: {node: [(instance, pipeline[, deploy generation])]} from every node's retained
        hosted record (ours too);
        online: {node: up} from the retained status records (this node counts as online);
        rehomed: {node: {instance: when}} from the retained re-homed records: no proof of a
        binding at all. A node's own entry is a claim (it once broke the tie between several
        claimers of an unbound instance, and a hostile node with a later entry won); another
        node's entry says the instance was re-homed once, not where to (it once proved the only
        online claimer of a dead node's instance, whatever re-home it came from): only a `moved`
        statement naming the claimer proves it;
        moved: {node: {instance: node it moved it to}} from the retained state records, each
        entry stated by the node that moved the instance (see the module docstring)."""
        claims: Dict[str, List[str]] = {}
        pipelines: Dict[str, str] = {}
        generations: Dict[str, Dict[str, str]] = {}  # instance -> {node: the deploy it lists it under}
        for node, entries in hosted.items():
            for inst, pipeline, *rest in entries:
                claims.setdefault(inst, []).append(node)
                pipelines.setdefault(inst, pipeline)
                if rest and rest[0]:
                    generations.setdefault(inst, {})[node] = str(rest[0])
        del rehomed  # accepted for the callers; proves nothing (see above)
        moved = moved or {}

        def up(n: str) -> bool:
            return n == self.node or bool(online.get(n))

        rehomer = min([n for n in online if up(n)] + [self.node])

        def rehomer_without(node: str) -> str:
            # who re-homed an instance of `node` while `node` was offline: the lowest online node
            # other than it (`rehome.responsible`), as long as the others stayed as they are
            rest = [n for n in {*online, self.node} if n != node and up(n)]
            return min(rest) if rest else rehomer

        pending: Dict[str, Tuple[str, ...]] = {}
        for inst in sorted(set(claims) | set(local)):
            nodes = sorted(set(claims.get(inst, ())))
            pipeline = local.get(inst) or pipelines.get(inst, "")
            listed_under = generations.get(inst, {})
            was = self._generation.get(inst)
            if was and nodes and len(listed_under) == len(nodes) and was not in listed_under.values():
                self.forget(inst)  # a namesake of another deploy
            cur = self._bound.get(inst, (None, ""))[0]
            proven = inst not in self._unproven
            override = None
            if inst not in local and cur is not None and not proven:
                # The word came after the move (the re-homer states once the new node answered),
                # from the node it was bound to before, the re-homer, or else any other node.
                said = self._said(inst, moved, rehomer)
                named = [n for n in nodes if _vouched(inst, n, moved, rehomer)]
                if said == cur or (said is None and cur in named):
                    proven = True
                elif said is not None and said in nodes:
                    override = said
                elif said is None and len(named) == 1:
                    override = named[0]
            if inst in local:
                new: Optional[str] = self.node
                proven = True
            elif override is not None:
                new, proven = override, True  # taken without a word; who moved it says where now
            elif cur is not None and cur in nodes and (up(cur) or not any(up(n) for n in nodes)):
                new = cur  # still listed, and online (or nobody online lists it)
            elif cur is not None:
                live = [n for n in nodes if up(n)] or nodes
                others = [n for n in live if n != cur] or live
                # who may say where it went: its node while online (a hand-over), else the re-homer
                said = moved.get(cur if up(cur) else rehomer, {}).get(inst)
                if not others:
                    new = cur  # listed by nobody any more: keep the last binding
                elif said is not None and said != cur and (said in others or up(said)):
                    new = said if said in others else cur  # there, once it lists it; nowhere else
                    proven = proven if new == cur else True
                elif len(others) > 1:
                    new = cur  # moved without a word from who moved it, several claim it: none of them
                else:
                    # One claimer and no word from who moved it (not arrived yet): bound, but
                    # unproven until a statement names it. Another node's re-homed record proves
                    # nothing here: it says the instance was re-homed once, not where to, and an
                    # earlier re-home's entry made the only online claimer of a dead node's
                    # instance its proven holder (docs/security.md, "Data channels", What is left (2)).
                    # The re-homer is the lowest online node: once the instance's old node is
                    # back online that is often the old node itself, and the node that re-homed
                    # it in its absence would no longer vouch for where it put it (a node that
                    # came back bound it to itself from its own stale record first, then to the
                    # re-homed copy unproven for good, and its new workers refused that copy's
                    # envelopes: chaos --pipeline stateful-scaling, seed 1). So the lowest online
                    # node besides the old one vouches too: it re-homed it.
                    new, proven = others[0], (_vouched(inst, others[0], moved, rehomer)
                                              or _vouched(inst, others[0], moved, rehomer_without(cur)))
            else:
                # No binding yet (this agent just started, or never saw the instance): a claim
                # proves nothing, so several claimers bind only the one a statement names.
                live = [n for n in nodes if up(n)] or nodes
                if len(live) == 1:
                    # contested by an offline lister: unproven, unless a statement names it
                    new, proven = live[0], len(nodes) == 1 or _vouched(inst, live[0], moved, rehomer)
                else:
                    named = {n for n in live if _vouched(inst, n, moved, rehomer)}
                    new, proven = (named.pop(), True) if len(named) == 1 else (None, True)
            if new is None:
                pending[inst] = tuple(nodes)
                continue
            if cur is not None and cur != new:
                self._former[inst] = [cur] + [n for n in self._former.get(inst, []) if n not in (cur, new)][:MAX_FORMER - 1]
            elif new in self._former.get(inst, ()):
                self._former[inst].remove(new)
            if self._bound.get(inst, (None, ""))[0] != new:
                self._bound.pop(inst, None)
            self._bound[inst] = (new, pipeline)
            if listed_under.get(new):
                self._generation[inst] = listed_under[new]
            (self._unproven.discard if proven else self._unproven.add)(inst)
            rest = tuple(n for n in nodes if n != new)
            if rest:
                pending[inst] = rest
        self._pending = pending
        self._online = {n: up(n) for n in {*online, self.node}}
        self._listed = set(claims) | set(local)
        if len(self._bound) > self.max_entries:
            for inst in [i for i in self._bound if i not in self._listed]:
                if len(self._bound) <= self.max_entries:
                    break
                del self._bound[inst]
            while len(self._bound) > self.max_entries:
                self._bound.popitem(last=False)
            self._former = {i: ns for i, ns in self._former.items() if i in self._bound}
        self._unproven &= set(self._bound)
        self._generation = {i: g for i, g in self._generation.items() if i in self._bound}

    def saved(self) -> Dict[str, Any]:
        """What the agent keeps over its restart: the proven bindings to other nodes, oldest
        first. Not our own instances (bound here while they run here; after a restart the agent
        starts them again or another node took them, which the rule then follows), not unproven
        ones (nothing an unproven sender gained is kept)."""
        return {"v": 1, "bound": [[i, n, p, self._generation.get(i, "")] for i, (n, p) in self._bound.items()
                                  if n != self.node and i not in self._unproven]}

    def restore(self, doc: Any) -> int:
        """Start from the bindings `saved` returned before the restart (the agent's own file; a
        malformed entry is skipped). Returns how many were taken."""
        entries = doc.get("bound") if isinstance(doc, dict) and doc.get("v") == 1 else None
        if not isinstance(entries, list):
            return 0
        taken = 0
        for e in entries[-self.max_entries:]:
            if (isinstance(e, list) and len(e) == 4 and all(isinstance(x, str) and len(x) <= MAX_NAME for x in e)
                    and e[0] and e[1] and e[1] != self.node):
                inst, node, pipeline, generation = e
                self._bound.pop(inst, None)
                self._bound[inst] = (node, pipeline)
                if generation:
                    self._generation[inst] = generation
                taken += 1
        return taken

    def forget(self, inst: str) -> None:
        """`inst` starts over as an instance this agent never saw: its binding, former nodes,
        proof and deploy are forgotten."""
        self._bound.pop(inst, None)
        self._former.pop(inst, None)
        self._unproven.discard(inst)
        self._generation.pop(inst, None)

    def _said(self, inst: str, moved: Mapping[str, Mapping[str, str]], rehomer: str) -> Optional[str]:
        """Where the node `inst` was bound to before, else the re-homer, says it moved `inst`."""
        for who in (*self._former.get(inst, [])[:1], rehomer):
            said = moved.get(who, {}).get(inst)
            if said is not None:
                return said
        return None

    def proven(self, instance: str) -> bool:
        """Is the binding of `instance` proven (see `_unproven`)? True when it has none."""
        return instance not in self._unproven

    def bound(self, instance: str) -> Optional[str]:
        entry = self._bound.get(instance)
        return entry[0] if entry is not None else None

    def pending(self, instance: str) -> Tuple[str, ...]:
        return self._pending.get(instance, ())

    def former_offline(self, instance: str) -> List[str]:
        """The nodes `instance` was bound to before that are offline now."""
        return [n for n in self._former.get(instance, ()) if not self._online.get(n, False)]

    def nodes_of(self, pipelines: Set[str]) -> Set[str]:
        """The nodes bound to an instance of one of `pipelines`: where the neighbours of this
        node's instances run (its near peers for the latency probes)."""
        return {n for n, p in self._bound.values() if p in pipelines}

    def table(self, pipeline: str) -> Dict[str, Dict[str, Any]]:
        """What a worker of `pipeline` needs (the control line "hosts"): {"bound": {instance:
        node}, "former": {instance: [offline nodes it was bound to before]}} for the instances of
        that pipeline (and those whose pipeline is unknown)."""
        bound = {i: n for i, (n, p) in self._bound.items() if p in (pipeline, "")}
        former = {i: f for i in bound if (f := self.former_offline(i))}
        unproven = sorted(i for i in bound if i in self._unproven)
        return {"bound": bound, "former": former, **({"unproven": unproven} if unproven else {})}


def _vouched(inst: str, node: str, moved: Mapping[str, Mapping[str, str]], rehomer: str) -> bool:
    """Does a node's own statement say `inst` moved to `node`? Only another node's, or the
    re-homer's (it may re-home onto itself): a node cannot vouch for its own claim."""
    return any(m.get(inst) == node and (who != node or who == rehomer) for who, m in moved.items())
