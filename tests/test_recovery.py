"""Round recovery helpers (agent.runtime.recovery), pure: the write-ahead codec, replayed rounds,
resend on silence. The live path (a creator killed mid-round) is in test_reliability."""

from __future__ import annotations

import pytest

from agent.policy.decentralized import ScalingParams
from agent.protocol.messages import Deletion, DeletionAck, Duplication, DuplicationAck, Start, from_dict
from agent.protocol.scaling import Activate, CreateInstance, Drain, RoutesChanged, ScalingCore, Send, Terminate
from agent.runtime.recovery import RoundMemory, decode_outputs, encode_outputs, round_message, silent_pending


def test_queued_outputs_survive_the_disk_in_order() -> None:
    outs = [
        CreateInstance("op-1", "op", 1, "op-0"),
        Send("b-0", Duplication("op-0", 1, 3, ("op-1",))),
        RoutesChanged(("c-0",), ("a-0",)),
        Activate(("c-0", "c-1"), ()),
        Send("op-1", Start("op-0", 1, ("c-0",), ("a-0",))),
        Drain(),
        Terminate("op-0"),
    ]
    import json

    back = decode_outputs(json.loads(json.dumps(encode_outputs(outs))), from_dict)
    assert back == outs


@pytest.mark.parametrize("bad", [{}, [{"effect": "Explode"}], [3], [{"send": "x", "message": {"type": "nope"}}]])
def test_a_damaged_queue_is_an_error_not_a_guess(bad: object) -> None:
    with pytest.raises(Exception):
        decode_outputs(bad, from_dict)


def test_a_replayed_round_is_acked_again_but_applied_once() -> None:
    mem = RoundMemory()
    dup = Duplication("x-0", 1, 4, ("x-9",))
    assert mem.replay_ack(dup, "y-0", 2) is None  # new: apply it
    mem.applied_now(dup)
    again = mem.replay_ack(dup, "y-0", 2)
    assert again == DuplicationAck("y-0", 2, 4)
    older = mem.replay_ack(Deletion("x-0", 1, 3), "y-0", 2)
    assert older == DeletionAck("y-0", 2, 3)
    assert mem.replay_ack(Deletion("x-0", 1, 5), "y-0", 2) is None  # a later round is new
    assert mem.replay_ack(Deletion("z-0", 1, 1), "y-0", 2) is None  # another sender
    assert mem.replays == 2
    assert RoundMemory(dict(mem.applied)).replay_ack(dup, "y-0", 2) is not None  # restored from disk


def test_resend_goes_only_to_silent_pending_neighbours_that_were_sent_the_round() -> None:
    core = ScalingCore.initial("m-0", "m", 1, ScalingParams(), succs=("s-0", "s-1"), preds=("p-0",), keeper=True)
    outs = core.start_duplication(1)
    new = [o.instance_id for o in outs if isinstance(o, CreateInstance)]
    msg = round_message(core)
    assert isinstance(msg, Duplication) and msg.new_instances == tuple(new) and msg.round == core.round
    heard = {"s-0": 0.0, "s-1": 8.0}  # p-0 not sent yet (still queued): never resent
    assert silent_pending(core, heard, now=10.0, after=10.0) == [("s-0", msg)]
    assert silent_pending(core, heard, now=18.0, after=10.0) == [("s-0", msg), ("s-1", msg)]
    idle = ScalingCore.initial("q-0", "m", 1, ScalingParams(), succs=("s-0",), preds=("p-0",), keeper=True)
    assert round_message(idle) is None and silent_pending(idle, {"s-0": 0.0}, 100.0) == []
