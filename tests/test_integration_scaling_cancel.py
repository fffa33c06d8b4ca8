"""ScalingCore.cancel_duplication: a round whose createNode() failed is withdrawn without a trace.

Why: the worker used to retry the spawn every second while holding back its protocol messages
(stalling neighbours). Cancel must restore the pre-round state, send nothing, leave the instance
able to scale again, and with some copies already created continue the round with those only.
"""

from __future__ import annotations

import pytest

from agent.policy.decentralized import Action, Decision, ScalingParams
from agent.protocol.errors import LocalProtocolError
from agent.protocol.messages import Duplication, DuplicationAck, Start
from agent.protocol.scaling import CreateInstance, InstanceState, ScalingCore, Send

PARAMS = ScalingParams(capacity=100.0)


def core() -> ScalingCore:
    return ScalingCore.initial("w-0", "w", 1, PARAMS, succs=("s-0", "s-1"), preds=("p-0",), keeper=True)


def without_round(snap: dict) -> dict:
    d = dict(snap)
    d.pop("round")
    return d


@pytest.mark.parametrize("copies", [1, 3])
def test_cancel_with_nothing_created_restores_state_and_sends_nothing(copies: int) -> None:
    c = core()
    before = c.snapshot()
    outs = c.start_round(Decision(Action.DUPLICATE, copies))
    assert sum(isinstance(o, CreateInstance) for o in outs) == copies
    assert c.state is InstanceState.DUPLICATING
    back = c.cancel_duplication(created=())
    assert back == []  # nothing to send: no peer ever heard of the round
    after = c.snapshot()
    assert without_round(after) == without_round(before)
    assert after["round"] >= before["round"]  # never reused (a timed-out create may still start)
    # an ack for the cancelled round is now a protocol error (nobody waits for it)
    with pytest.raises(Exception):
        c.handle(DuplicationAck.trusted(sender="s-0", stage=2, round=after["round"]))
    # and the instance can scale again, with fresh ids
    outs2 = c.start_round(Decision(Action.DUPLICATE, 1))
    new_ids = {o.instance_id for o in outs2 if isinstance(o, CreateInstance)}
    old_ids = {o.instance_id for o in outs if isinstance(o, CreateInstance)}
    assert new_ids and not (new_ids & old_ids)


def test_cancel_keeps_the_copies_already_created() -> None:
    c = core()
    outs = c.start_round(Decision(Action.DUPLICATE, 3))
    ids = [o.instance_id for o in outs if isinstance(o, CreateInstance)]
    back = c.cancel_duplication(created=ids[:1])
    # exactly one announcement per neighbour, naming only the created copy: 2(|succs|+|preds|)+1
    assert all(isinstance(o, Send) and isinstance(o.message, Duplication) for o in back)
    assert sorted(o.dest for o in back) == ["p-0", "s-0", "s-1"]
    assert all(o.message.new_instances == (ids[0],) for o in back)
    rnd = back[0].message.round
    done = []
    for peer, stage in (("s-0", 2), ("s-1", 2), ("p-0", 0)):
        done = c.handle(DuplicationAck.trusted(sender=peer, stage=stage, round=rnd))
    assert [o.dest for o in done] == [ids[0]] and isinstance(done[0].message, Start)
    assert c.state is InstanceState.ACTIVE


def test_cancel_is_refused_outside_a_duplication_and_for_foreign_ids() -> None:
    c = core()
    with pytest.raises(LocalProtocolError):
        c.cancel_duplication()
    c.start_round(Decision(Action.DUPLICATE, 1))
    snap = c.snapshot()
    with pytest.raises(LocalProtocolError):
        c.cancel_duplication(created=("w-someone-else",))
    assert c.snapshot() == snap  # state unchanged on error
