"""Chains on the agent's side: which keepers share a process, checked, grouped, answered (pure).

A chain (docs/runtime.md, "Chaining") is 2 or more consecutive keepers of one pipeline hosted by
one worker process (agent.instance.chain). Its members' ids, upstream first, travel in each
member's `extra["chain"]`: the agent stores the specs (agent.node.hosted) and restarts or
re-adopts the members of one chain together, as one process again. A copy is never chained
(`without_chain`: a scale-out's spec starts from its creator's).

Nothing here does I/O; the daemon and deploy call these.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

from agent.config import load_pipeline_text
from agent.instance.spec import InstanceSpec
from agent.node.placement import NodeView, PlacementRequest

__all__ = ["CHAIN_KEY", "MAX_CHAIN", "chain_of", "chain_problem", "group_chains", "plan_chains",
           "with_chain", "without_chain"]

CHAIN_KEY = "chain"
MAX_CHAIN = 16  # members a chain request may name (a bound on bus input; pipelines are shorter)


def chain_of(spec: InstanceSpec) -> Tuple[str, ...]:
    """The chain `spec` was started in (its members, upstream first), or () when none."""
    ids = spec.extra.get(CHAIN_KEY) if isinstance(spec.extra, dict) else None
    if not isinstance(ids, (list, tuple)) or len(ids) < 2 or spec.instance not in ids:
        return ()
    return tuple(str(i) for i in ids)


def with_chain(specs: Sequence[InstanceSpec]) -> List[InstanceSpec]:
    """The specs with their chain's members in `extra` (a chain of one is no chain)."""
    if len(specs) < 2:
        return [without_chain(s) for s in specs]
    ids = [s.instance for s in specs]
    return [dataclasses.replace(s, extra=dict(s.extra, **{CHAIN_KEY: ids})) for s in specs]


def without_chain(spec: InstanceSpec) -> InstanceSpec:
    if CHAIN_KEY not in spec.extra:
        return spec
    return dataclasses.replace(spec, extra={k: v for k, v in spec.extra.items() if k != CHAIN_KEY})


def chain_problem(specs: Sequence[InstanceSpec]) -> Optional[str]:
    """Why these specs cannot be one chain (None: they can). A chain request comes from the bus,
    so everything the chain process relies on is checked: 2..MAX_CHAIN distinct keepers of one
    pipeline text, of consecutive operators in pipeline order, each the only successor of the
    one before it (equal parallelism: one instance each)."""
    if not 2 <= len(specs) <= MAX_CHAIN:
        return f"a chain has 2 to {MAX_CHAIN} members, found {len(specs)}"
    ids = [s.instance for s in specs]
    if len(set(ids)) != len(ids):
        return "a chain names an instance twice"
    first = specs[0]
    if any(s.pipeline != first.pipeline or s.pipeline_toml != first.pipeline_toml for s in specs):
        return "the members of a chain belong to one pipeline"
    if not all(s.keeper for s in specs):
        return "only keepers are chained (a copy is a process of its own)"
    try:
        names = [op.name for op in load_pipeline_text(first.pipeline_toml, f"pipeline {first.pipeline}").operators]
        stages = [names.index(s.operator) for s in specs]
    except (ValueError, KeyError) as exc:
        return f"the members' operators are not in their pipeline ({str(exc)[:80]})"
    if stages != list(range(stages[0], stages[0] + len(specs))):
        return "the members of a chain are consecutive operators, upstream first"
    for a, b in zip(specs, specs[1:]):
        if tuple(a.succs) != (b.instance,) or tuple(b.preds) != (a.instance,):
            return f"{a.instance} and {b.instance} are not each other's only neighbours"
    return None


def group_chains(specs: Sequence[InstanceSpec]) -> List[List[InstanceSpec]]:
    """Specs to start (restarts, re-adoptions) grouped into processes: the members of one chain
    together, upstream first, as far as they are here; every other spec alone. A member left
    alone runs as a process of its own (without its chain)."""
    groups: Dict[Tuple[str, ...], Dict[str, InstanceSpec]] = {}
    out: List[List[InstanceSpec]] = []
    for s in specs:
        chain = chain_of(s)
        if chain:
            groups.setdefault(chain, {})[s.instance] = s
        else:
            out.append([s])
    for chain, got in groups.items():
        members = [got[i] for i in chain if i in got]
        out.append(with_chain(members))
    return out


def plan_chains(specs: Sequence[InstanceSpec], views: Sequence[NodeView],
                policy: Any) -> List[Tuple[str, List[InstanceSpec]]]:
    """Deploy's groups, sink first: the node the policy ranks first for the most downstream keeper
    not placed yet takes it and as many of its consecutive predecessors as it has free slots (a
    chain holds one slot per member); then the next group. Placement prefers chaining where
    capacity allows. A keeper no node can take ends the plan (the deploy then fails on it as
    before)."""
    out: List[Tuple[str, List[InstanceSpec]]] = []
    views = list(views)
    i = len(specs) - 1
    while i >= 0:
        spec = specs[i]
        ranking = policy(PlacementRequest(spec.operator, None, spec.succs + spec.preds), views)
        if not ranking:
            out.append(("", [spec]))
            i -= 1
            continue
        node = ranking[0]
        free = next((v.free_slots for v in views if v.node == node), 1)
        take = max(1, min(int(free), i + 1))
        group = list(specs[i - take + 1:i + 1])
        out.append((node, group))
        views = [dataclasses.replace(v, free_slots=v.free_slots - take,
                                     instances=v.instances + tuple(s.instance for s in group))
                 if v.node == node else v for v in views]
        i -= take
    return out
