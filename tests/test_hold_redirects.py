"""A new copy of a keyed operator's predecessor holds every Redirect of a move it joined.

A keyed keeper moves 64 of its 128 key groups while its predecessor makes a copy; the keeper,
which acked the predecessor's Duplication, sends the copy one Redirect per moving group before
the copy's Start names it. Held within a bound of twice its window plus 32 (48), the copy would
refuse the other 16: a hole in that channel, so 5 s later the copy would become a new
incarnation (GAP_TIMEOUT) and its predecessor re-route what it had sent it (CHANGELOG.md, "A new
copy refused its keyed successor's Redirects"). Sans-IO: the instance core alone, fed envelopes
by hand.
"""
from __future__ import annotations

from typing import Any, List

from agent import topics
from agent.config import load_pipeline_text
from agent.dataplane.envelope import Envelope, Kind, encode
from agent.instance.core import Instance
from agent.instance.events import EnvelopeReceived, Started, Tick
from agent.instance.spec import InstanceSpec
from foglab.sim.instance_check import BROKER, CLUSTER, WALL0, MemoryMap

GROUPS = 128  # the default; the keeper hands out half of them in a duplication
TOML = "\n".join([
    '[pipeline]', 'name = "chk"', '', '[scaling]', 'policy = "none"', '',
    '[[operator]]', 'name = "source"', 'kind = "source"', 'function = "agent.operators.taxi:source"', '',
    '[[operator]]', 'name = "op"', 'kind = "map"', 'function = "agent.operators.builtin:validate"', 'key = "k"', '',
    '[[operator]]', 'name = "cnt"', 'kind = "map"', 'function = "agent.operators.keyed:keyed_count"',
    f'key_groups = {GROUPS}', '',
    '[[operator]]', 'name = "sink"', 'kind = "sink"', 'function = "agent.operators.builtin:counting_sink"', '',
])


def idle_copy() -> Instance:
    spec = InstanceSpec("op-x", "op", "n1", CLUSTER, "chk", TOML, BROKER, succs=(), preds=(), keeper=False,
                        active=False, state_dir="/nonexistent", heartbeat_period=3600.0,
                        extra={"creator": "chk.op.0"})
    inst = Instance(spec, load_pipeline_text(TOML, "test pipeline"), MemoryMap(), next_keyed=True)
    inst.handle(Started(WALL0), 0.0)
    return inst


def deliver(inst: Instance, env: Envelope, now: float) -> List[Any]:
    cmds = inst.handle(EnvelopeReceived(topics.inbox(CLUSTER, inst.spec.instance, "n1"), encode(env)), now)
    return cmds + inst.handle(Tick(WALL0 + now), now)


def test_an_idle_copy_holds_a_redirect_per_moving_group_of_its_keyed_successor() -> None:
    inst = idle_copy()
    assert inst.admission.window == 8  # the defaults the demo ran with
    moving = range(1, GROUPS, 2)  # the keeper's half: 64 groups
    for seq, g in enumerate(moving, start=1):
        body = {"type": "redirect", "g": g, "new": "cnt-c", "v": 1}
        deliver(inst, Envelope("chk.cnt.0", 0, seq, Kind.PROTO, body), 0.01 * seq)
    assert inst.stats["held_dropped"] == 0 and inst.stats["refused_senders"] == 0
    assert inst.admission.hold.count == len(moving)


def test_the_hold_stays_bounded_per_sender_past_a_full_move() -> None:
    """The allowance is the successor's group count, not unbounded: an invented flood in a
    plausible name is still refused past it (and the byte bound holds whatever the count)."""
    inst = idle_copy()
    limit = inst.admission.hold.max_per_sender
    for seq in range(1, limit + 11):
        deliver(inst, Envelope("chk.cnt.0", 0, seq, Kind.PROTO, {"type": "eos", "g": seq % GROUPS}), 0.001 * seq)
    assert inst.admission.hold.count == limit and inst.stats["held_dropped"] == 10
