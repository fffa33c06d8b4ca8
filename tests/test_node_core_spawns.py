"""agent.node.spawns on its own: where a createNode() goes, who hears of it and when, decided on a
given time line without a daemon, a broker or a worker. A requester is a plain string here."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytest

from agent.instance.spec import InstanceSpec
from agent.mqtt.settings import BrokerSpec
from agent.node.spawns import (
    RPC_TIMEOUT, Answer, AskPeer, Asked, BadReply, ChainStarted, CreateNode, Exited, Expire, Failed, LocalStart,
    PeerReply, Placed, Ready, Shutdown, SpawnCommand, SpawnRequest, Spawns, StageKeyed, Staged, StartLocal, TimedOut,
    candidates, starts_beyond_slots,
)


def spec(instance: str = "p.work.1", **extra: Any) -> InstanceSpec:
    return InstanceSpec(instance, "work", "me", "c", "p", "", BrokerSpec("h", 1), extra=extra)


def answers(cmds: List[SpawnCommand]) -> List[Any]:
    return [(c.reply, dict(c.result)) for c in cmds if isinstance(c, Answer)]


def create(s: Spawns, sp: InstanceSpec, ranking: List[str], now: float = 0.0, reply: str = "r1",
           cause: str = "spawn", online: Optional[Dict[str, bool]] = None, here: Optional[str] = None,
           elsewhere: Optional[str] = None) -> List[SpawnCommand]:
    return s.handle(CreateNode(sp, reply, cause, tuple(ranking), online or {}, here, elsewhere), now)


def test_a_rehome_tries_its_standby_first_when_it_is_us_or_online() -> None:
    rehome = spec(standby="n3")
    assert candidates(["n1", "n2", "n3"], rehome, "rehome", "me", {"n3": True}) == ["n3", "n1", "n2"]
    assert candidates(["n1", "n2"], rehome, "rehome", "me", {"n3": True}) == ["n3", "n1", "n2"]  # no slot: first anyway
    assert candidates(["n1", "n3"], rehome, "rehome", "me", {"n3": False}) == ["n1", "n3"]  # offline: as ranked
    assert candidates(["n1", "n3"], rehome, "spawn", "me", {"n3": True}) == ["n1", "n3"]  # only a re-home
    assert candidates(["n1"], spec(standby="me"), "rehome", "me", {}) == ["me", "n1"]
    assert candidates(["n1"], spec(), "rehome", "me", {"n1": True}) == ["n1"]  # no standby


def test_the_core_walks_the_standby_first_and_our_copy_starts_beyond_the_slots() -> None:
    s = Spawns("me", "c")
    (ask,) = create(s, spec(standby="n3"), ["n1", "n3"], cause="rehome", online={"n3": True})
    assert isinstance(ask, AskPeer) and ask.node == "n3"
    (start,) = create(Spawns("me", "c"), spec(standby="me"), ["n1"], cause="rehome")
    assert isinstance(start, StartLocal) and start.cause == "rehome"
    held = spec(standby="me")
    assert starts_beyond_slots(held, "rehome", "me", draining=False, has_copy=True)
    assert not starts_beyond_slots(held, "rehome", "me", draining=False, has_copy=False)
    assert not starts_beyond_slots(held, "rehome", "me", draining=True, has_copy=True)
    assert not starts_beyond_slots(held, "spawn", "me", draining=False, has_copy=True)
    assert not starts_beyond_slots(spec(standby="n3"), "rehome", "me", draining=False, has_copy=True)


def test_a_candidate_that_fails_moves_the_walk_to_the_next_until_one_takes_it() -> None:
    s = Spawns("me", "agent-me")
    sp = spec()
    (start,) = create(s, sp, ["me", "n2", "n3", "n4"])
    assert isinstance(start, StartLocal) and start.spec == sp
    (ask2,) = s.handle(LocalStart(start.job, "no free slot on me"), 1.0)
    assert isinstance(ask2, AskPeer) and ask2.node == "n2" and ask2.body["op"] == "spawn"
    assert ask2.body["spec"]["instance"] == sp.instance and ask2.body["from"] == "me"
    assert s.handle(Asked(ask2.job, None), 1.0) == [] and s.placing() == [(sp.instance, "p", "work")]
    (ask3,) = s.handle(PeerReply(ask2.correlation, "n2", {"ok": False, "error": "full"}), 2.0)
    assert isinstance(ask3, AskPeer) and ask3.node == "n3" and ask3.correlation != ask2.correlation
    (ask4,) = s.handle(Asked(ask3.job, "request to n3 not queued"), 2.0)  # never queued: next
    assert isinstance(ask4, AskPeer) and ask4.node == "n4"
    s.handle(Asked(ask4.job, None), 2.0)
    done = s.handle(PeerReply(ask4.correlation, "n4", {"ok": True, "instance": sp.instance, "node": "n4"}), 3.0)
    assert done == [Placed("n4", sp), Answer("r1", {"ok": True, "instance": sp.instance, "node": "n4"})]
    assert s.calls == {} and s.placing() == []


def test_when_no_candidate_is_left_the_createnode_fails_with_the_last_error() -> None:
    s = Spawns("me", "c")
    sp = spec()
    (ask,) = create(s, sp, ["n2"])
    s.handle(Asked(ask.job, None), 0.0)
    out = s.handle(PeerReply(ask.correlation, "n2", {"ok": False, "error": "no free slot on n2"}), 1.0)
    assert out == [Failed(sp, "n2: no free slot on n2", ("n2",)),
                   Answer("r1", {"ok": False, "error": "n2: no free slot on n2"})]
    assert create(s, spec("p.work.2"), []) == [
        Failed(spec("p.work.2"), "no node has a free slot", ()),
        Answer("r1", {"ok": False, "error": "no node has a free slot"})]


def test_a_reply_counts_only_from_the_node_asked_and_a_bad_one_moves_on() -> None:
    s = Spawns("me", "c")
    (ask,) = create(s, spec(), ["n2", "n3"])
    s.handle(Asked(ask.job, None), 0.0)
    assert s.handle(PeerReply(ask.correlation, "n3", {"ok": True}), 1.0) == []  # n3 guessed it
    assert s.handle(PeerReply("other", "n2", {"ok": True}), 1.0) == []
    out = s.handle(PeerReply(ask.correlation, "n2", bad="reply without a boolean 'ok'"), 1.0)
    assert out[0] == BadReply("n2", "reply without a boolean 'ok'")
    assert isinstance(out[1], AskPeer) and out[1].node == "n3" and len(out) == 2


def test_a_requester_asking_again_while_the_instance_starts_hears_at_its_ready_with_the_first() -> None:
    s = Spawns("me", "c")
    sp = spec()
    (start,) = create(s, sp, ["me"], reply="creator")
    assert s.handle(LocalStart(start.job, None), 0.0) == [] and s.cause_of(sp.instance) == "spawn"
    assert create(s, sp, ["me"], reply="creator-again", here="starting") == []
    assert s.handle(SpawnRequest(sp, "admin", "rpc", "adm", here="starting"), 1.0) == []
    ok = {"ok": True, "instance": sp.instance, "node": "me"}
    assert answers(s.handle(Ready(sp.instance), 2.0)) == [("creator", ok), ("creator-again", ok), ("admin", ok)]
    assert s.cause_of(sp.instance) is None and s.handle(Ready(sp.instance), 3.0) == []  # once


def test_an_instance_that_exists_is_answered_with_itself_never_started_twice() -> None:
    s = Spawns("me", "c")
    sp = spec()
    assert create(s, sp, ["me"], here="active") == [Answer("r1", {"ok": True, "instance": sp.instance, "node": "me"})]
    assert create(s, sp, ["me"], here="terminating") == [
        Answer("r1", {"ok": False, "error": f"instance {sp.instance} is terminating on me"})]
    assert create(s, sp, ["me"], elsewhere="n2") == [Answer("r1", {"ok": True, "instance": sp.instance, "node": "n2"})]


def test_a_spawn_that_times_out_fails_without_asking_another_node_for_the_same_identity() -> None:
    """docs/design.md invariant 7: n2 may have started it, its answer held by a partition."""
    s = Spawns("me", "c")
    sp = spec()
    (ask,) = create(s, sp, ["n2", "n3", "me"], now=100.0)
    s.handle(Asked(ask.job, None), 100.0)
    assert s.handle(Expire(), 100.0 + RPC_TIMEOUT - 0.001) == []
    out = s.handle(Expire(), 100.0 + RPC_TIMEOUT)
    assert out == [TimedOut(sp, "n2"), Answer("r1", {"ok": False, "error": f"no reply from n2 within "
                                                  f"{RPC_TIMEOUT:.0f}s (it may still start {sp.instance})"})]
    assert s.calls == {} and s.handle(Expire(), 1e9) == []
    late = s.handle(PeerReply(ask.correlation, "n2", {"ok": True, "instance": sp.instance, "node": "n2"}), 200.0)
    assert late == []  # the job is over: no second answer


def test_a_worker_that_exits_before_ready_moves_the_walk_on() -> None:
    s = Spawns("me", "c")
    sp = spec()
    (start,) = create(s, sp, ["me", "n2"])
    s.handle(LocalStart(start.job, None), 0.0)
    (ask,) = s.handle(Exited(sp.instance, "not ready 20.0s after start"), 20.0)
    assert isinstance(ask, AskPeer) and ask.node == "n2" and s.cause_of(sp.instance) is None
    assert s.handle(Exited(sp.instance, "again"), 21.0) == []


def test_a_spawn_placed_here_starts_here_or_is_refused_never_forwarded() -> None:
    s = Spawns("me", "c")
    sp = spec(standby="n3")
    (start,) = s.handle(SpawnRequest(sp, "n1", "rehome", "n1"), 0.0)
    assert isinstance(start, StartLocal)
    assert s.handle(LocalStart(start.job, "no free slot on me"), 0.0) == [
        Failed(sp, "no free slot on me", ("me",)), Answer("n1", {"ok": False, "error": "no free slot on me"})]


def test_a_handover_stages_its_keyed_state_before_the_start_and_a_refused_state_refuses_the_spawn() -> None:
    s = Spawns("me", "c")
    sp = spec(handover_keyed={"chunks": 2})
    (stage,) = s.handle(SpawnRequest(sp, "n1", "handover", "n1"), 0.0)
    assert stage == StageKeyed(stage.job, sp, "n1")
    (start,) = s.handle(Staged(stage.job, None), 0.0)
    assert isinstance(start, StartLocal) and start.job == stage.job
    (stage2,) = s.handle(SpawnRequest(spec("p.work.2", handover_keyed={}), "n1", "handover", "n1"), 0.0)
    assert s.handle(Staged(stage2.job, "keyed state of p.work.2: bad digest"), 0.0) == [
        Answer("n1", {"ok": False, "error": "keyed state of p.work.2: bad digest"})]  # refused, not a placement


def test_a_chain_is_answered_once_when_every_member_is_ready() -> None:
    s = Spawns("me", "c")
    members = [spec("p.a.0"), spec("p.b.0"), spec("p.c.0")]
    assert s.handle(ChainStarted(members, "deployer", "deploy"), 0.0) == []
    assert s.cause_of("p.b.0") == "deploy"
    assert s.handle(Ready("p.c.0"), 1.0) == [] and s.handle(Ready("p.a.0"), 1.0) == []
    assert answers(s.handle(Ready("p.b.0"), 2.0)) == [
        ("deployer", {"ok": True, "instance": "p.c.0", "node": "me", "members": ["p.a.0", "p.b.0", "p.c.0"]})]


def test_a_chain_fails_with_its_first_member_that_fails_and_only_once() -> None:
    s = Spawns("me", "c")
    s.handle(ChainStarted([spec("p.a.0"), spec("p.b.0")], "deployer", "deploy"), 0.0)
    s.handle(Ready("p.a.0"), 1.0)
    out = s.handle(Exited("p.b.0", "exit status 1"), 2.0)
    assert isinstance(out[0], Failed) and answers(out) == [
        ("deployer", {"ok": False, "error": "chain member p.b.0: worker exited before ready (exit status 1)"})]
    assert s.handle(Shutdown(), 3.0) == []  # nothing left to answer


def test_a_shutdown_answers_every_start_not_ready_yet() -> None:
    s = Spawns("me", "c")
    (start,) = create(s, spec(), ["me"])
    s.handle(LocalStart(start.job, None), 0.0)
    s.handle(ChainStarted([spec("p.a.0"), spec("p.b.0")], "deployer", "deploy"), 0.0)
    out = s.handle(Shutdown(), 1.0)
    assert answers(out) == [("r1", {"ok": False, "error": "agent me is shutting down"}),
                            ("deployer", {"ok": False, "error": "chain member p.a.0: agent me is shutting down"})]
    assert s.awaiting == {}


def test_an_unknown_event_or_an_outcome_of_no_command_is_refused() -> None:
    s = Spawns("me", "c")
    with pytest.raises(TypeError, match="not a spawn event"):
        s.handle(object(), 0.0)  # type: ignore[arg-type]
    with pytest.raises(LookupError, match="LocalStart|StartLocal"):
        s.handle(LocalStart(99, None), 0.0)
    (ask,) = create(s, spec(), ["n2"])
    s.handle(Asked(ask.job, None), 0.0)
    with pytest.raises(LookupError):
        s.handle(Asked(ask.job, None), 0.0)  # its outcome came already


def test_the_daemon_has_a_handler_for_every_request_op() -> None:
    from agent.node import rpc
    from agent.node.gate import PEER_OPS
    from agent.node.requests import PEER_ONLY_OPS, Requests

    assert set(Requests.OPS) == set(rpc.OPS) and PEER_ONLY_OPS < set(PEER_OPS)
