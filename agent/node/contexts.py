"""The sibling context of each local instance of a Gesscale policy (n, rank, ND_max, the
predecessors' back pressure), and what placement reads of an operator's policy and siblings.

Why a part of its own: the context is computed from the same fleet view placement reads
(`placement.instance_context`; docs/measurement.md, "Policies in the daemon"), and the policy of
an operator from its pipeline text, which is parsed once per text (`PolicyContexts`, bounded):
the daemon sends what `contexts` returns on the beat of its retained state. A "decentralized"
instance needs none: the paper's policy is per instance.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from agent.config import load_pipeline_text
from agent.instance.spec import InstanceSpec
from agent.node.placement import instance_context
from agent.policy.live import LIVE_POLICIES

CACHE_MAX = 256  # pipeline texts x operators whose policy is kept


def siblings(spec: InstanceSpec, local: Mapping[str, InstanceSpec], elsewhere: Sequence[str]) -> Tuple[str, ...]:
    """Ids of the operator's other instances (this pipeline): ours (`local`, by instance), then
    those of the fleet view (`elsewhere`); placement's ND_max."""
    out = [i for i, s in local.items()
           if s.pipeline == spec.pipeline and s.operator == spec.operator and i != spec.instance]
    return tuple(out + list(elsewhere))


class PolicyContexts:
    """The operators' policies, by pipeline text, and the contexts of the instances that take one."""

    def __init__(self) -> None:
        self._cache: Dict[Tuple[str, str], Tuple[str, Optional[str]]] = {}

    def operator_policy(self, spec: InstanceSpec) -> Tuple[str, Optional[str]]:
        """(the operator's [scaling] policy, its predecessor's name or "" / None for a source);
        ("", None) when the pipeline does not load (the worker says why)."""
        key = (spec.pipeline_toml, spec.operator)
        if key not in self._cache:
            try:
                cfg = load_pipeline_text(spec.pipeline_toml)
                idx = cfg.index(spec.operator)
                pred = None if cfg.operators[idx].kind == "source" else (cfg.operators[idx - 1].name if idx > 0 else "")
                self._cache[key] = (cfg.scaling_for(spec.operator).policy, pred)
            except Exception:
                self._cache[key] = ("", None)
            if len(self._cache) > CACHE_MAX:
                self._cache.pop(next(iter(self._cache)))
        return self._cache[key]

    def needs(self, spec: InstanceSpec) -> Optional[str]:
        """For an instance of a Gesscale policy, its predecessor operator's name ("" for none);
        None when the instance takes no context (decentralized, none, a source)."""
        policy, pred = self.operator_policy(spec)
        return pred if policy in LIVE_POLICIES else None

    def contexts(self, docs: Mapping[str, Any], latency: Mapping[str, Any],
                 active: Iterable[Tuple[str, InstanceSpec]]) -> List[Tuple[str, Dict[str, Any]]]:
        """(instance, its context) for each of the `active` (instance, spec) that takes one, from
        the node states `docs` and the latency rows."""
        out = []
        for instance, spec in active:
            need = self.needs(spec)
            if need is not None:
                out.append((instance, instance_context(docs, latency, spec.pipeline, spec.operator, need, instance)))
        return out
