"""A chain of keyed operators run in one process as the runtime runs them, for the DEBS tests: each
stage on one or more instances (`KeyedState`), records routed by their key group to the group's
owner, each instance's outputs on its own FIFO channel, the next stage reading the channels in a
seeded random interleaving (each channel in order), and key groups moving between a stage's
instances as agent.instance.moves moves them: `hand_out` once the group's last record was applied
at the old owner, `take_in` then `fire_due` at the new one (tests/test_debs_edge.py,
tests/test_debs_areas.py)."""

from __future__ import annotations

import random
from typing import Any, Callable, Dict, List

from agent.dataplane.keygroups import key_group, record_key
from agent.instance.keyed_state import KeyedState


class Stage:
    """One keyed operator's instances, the owner of each key group and each instance's channel."""

    def __init__(self, build: Callable[[str], KeyedState], first: str, groups: int = 128) -> None:
        self.build = build
        self.groups = groups
        self.insts: Dict[str, KeyedState] = {first: build(first)}
        self.owner = {g: first for g in range(groups)}
        self.chans: Dict[str, List[List[Any]]] = {first: []}
        self.moved = 0


class Chain:
    """Stages in order; `feed` gives a batch to the first, `pump` moves batches down the chain;
    `out` collects what the last stage emits."""

    def __init__(self, stages: List[Stage], seed: int) -> None:
        self.stages = stages
        self.rng = random.Random(seed)
        self.index = 0
        self.out: List[Any] = []

    def _apply(self, k: int, sender: str, items: List[Any]) -> None:
        """Route one batch into stage `k` (past the last stage: collected)."""
        if k == len(self.stages):
            self.out.extend(items)
            return
        st = self.stages[k]
        key_field = next(iter(st.insts.values())).key_field
        per: Dict[str, List[Any]] = {}
        for it in items:
            per.setdefault(st.owner[key_group(record_key(it[2], key_field), st.groups)], []).append(it)
        for name, part in per.items():
            self.index += 1
            got = st.insts[name].apply(sender, part, self.index)
            if got:
                st.chans[name].append(got)

    def feed(self, sender: str, items: List[Any]) -> None:
        self._apply(0, sender, items)

    def pump(self, some: bool = True, backlog: int = 3) -> None:
        """Deliver batches off random non-empty channels; `some`: stop at random (half the time
        before each batch) once no channel holds more than `backlog` batches (a channel's lag stays
        bounded, as the runtime's credit bounds it), else go on until every channel is empty."""
        while True:
            full = [(k, n) for k, st in enumerate(self.stages) for n, c in st.chans.items() if c]
            if not full:
                return
            if some and all(len(self.stages[k].chans[n]) <= backlog for k, n in full) and self.rng.random() < 0.5:
                return
            k, name = self.rng.choice(full)
            self._apply(k + 1, name, self.stages[k].chans[name].pop(0))

    def results(self, operator: str) -> Dict[str, Any]:
        """Once every channel is delivered: the last stage's outputs ("windows": those whose id is
        `operator`'s) and the ids of the records it forwarded ("forwarded")."""
        self.pump(some=False)
        mine = operator + "#"
        return {"windows": [r for s, _, r in self.out if s.startswith(mine)],
                "forwarded": [(s, q) for s, q, _ in self.out if not s.startswith(mine)]}

    def move(self, k: int, g: int, new: str) -> None:
        st = self.stages[k]
        data = st.insts[st.owner[g]].hand_out(g)
        st.insts[new].take_in(g, data)
        st.owner[g] = new
        st.moved += 1
        self.index += 1
        got = st.insts[new].fire_due(self.index)
        if got:
            st.chans[new].append(got)

    def join(self, k: int, name: str, share_of: str) -> None:
        """A copy of `share_of` in stage `k`: it takes every other group of its creator."""
        st = self.stages[k]
        st.insts[name], st.chans[name] = st.build(name), []
        for g in sorted(g for g, o in st.owner.items() if o == share_of)[::2]:
            self.move(k, g, name)

    def leave(self, k: int, name: str) -> None:
        """`name` leaves stage `k`: its groups go round the others, its channel is delivered."""
        st = self.stages[k]
        rest = sorted(n for n in st.insts if n != name)
        for i, g in enumerate(sorted(g for g, o in st.owner.items() if o == name)):
            self.move(k, g, rest[i % len(rest)])
        while st.chans[name]:
            self._apply(k + 1, name, st.chans[name].pop(0))
        del st.insts[name], st.chans[name]
