"""The lab's operators: the demo's DEBS 2015 query 1 (`foglab.operators.debs`) and query 2
(`foglab.operators.debs_areas`) at the edge, and the benchmarks' source (`foglab.operators.bench`),
written against the node's operator API
(agent.operators). Not in the node's wheel or .deb. A node admits them where fog-agent-lab is
installed, through the entry points it registers in the group `fog_agent.operators`
(lab/pyproject.toml), or where its agent.toml lists `MODULES` in `[operators] modules` (the demo's
fleets do: they also run from a checkout, where no entry point is installed)."""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["MODULES", "lab_allow_list"]

MODULES = ("foglab.operators.debs", "foglab.operators.debs_areas", "foglab.operators.bench")


@functools.lru_cache(maxsize=1)
def lab_allow_list() -> Any:
    """What the lab's own processes (the verifier, the demo's tables) may import to build a
    pipeline's operators: the node's allow-list plus `MODULES`."""
    from agent.operators.admission import AllowList

    return AllowList.for_node(modules=MODULES)
