"""The runtime's bound on how many instances of one operator exist ([scaling] max_instances).

Why the daemon enforces it, not the policy: in the paper's protocol (docs/scaling.md) every
instance decides alone from its own load and knows its neighbours, never its siblings, so no
instance can tell how many copies of its operator exist; and one decision may create several
copies at once (deviation 4). Under `coordination = "fgme"` the siblings share one lock group, so
they still duplicate concurrently (docs/gme.md, "Lock-guarded scaling"). The one place every
copy passes through is createNode(), i.e. the `spawn` a worker sends its agent: the agent
refuses a copy that would take the operator past max_instances, and the creator cancels that
copy like any failed createNode() (docs/scaling.md, deviation 8): its neighbours never hear of it.

What is counted: every instance that exists as far as this agent knows (starting, active or
terminating: a terminating instance still holds its process and its slot), on this node from
its supervisor, on the other online nodes from their retained state, plus the copies this
agent is placing on other nodes right now. On one agent the count is exact (one event loop
handles the spawns one after the other), so the bound is hard. Across agents it is as good as
the retained states are fresh: two agents placing copies of the same operator within one state
period may together exceed it (docs/scaling.md, "max_instances and min_instances").

Rules of this file: no I/O, no clock (like agent.node.placement).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Set, Tuple

# (instance id, pipeline, operator) of an instance this agent knows of
Known = Tuple[str, str, str]


def operator_instances(pipeline: str, operator: str, me: str, local: Iterable[Known],
                       fleet: Mapping[str, Mapping[str, Any]], online: Mapping[str, bool],
                       placing: Iterable[Known] = ()) -> Set[str]:
    """Ids of the instances of `operator` in `pipeline` that exist as far as agent `me` knows:
    its own (`local`, every phase), those in the retained state of the other online nodes
    (`fleet`: node -> state document; an entry without a pipeline counts: an older agent's
    state, better counted than missed) and the copies being placed elsewhere (`placing`)."""
    out = {i for i, p, o in list(local) + list(placing) if p == pipeline and o == operator}
    for node, doc in fleet.items():
        if node == me or not online.get(node, True) or not isinstance(doc, Mapping):
            continue
        for item in doc.get("instances", []) or []:
            if (isinstance(item, Mapping) and item.get("operator") == operator
                    and item.get("pipeline", pipeline) == pipeline and isinstance(item.get("id"), str)):
                out.add(item["id"])
    return out


def refusal(operator: str, instance: str, max_instances: int, existing: Set[str]) -> Optional[str]:
    """Why a new copy `instance` may not be created (None: it may). An instance that exists
    already is never refused: its creator is performing its queued createNode() again after a
    restart (agent.instance.recovery), and the daemon answers with the existing instance."""
    if instance in existing or len(existing) < max_instances:
        return None
    return (f"max_instances reached: operator {operator!r} has {len(existing)} instances "
            f"(max_instances = {max_instances})")
