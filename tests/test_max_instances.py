"""[scaling] max_instances at runtime (agent/node/bounds.py, docs/scaling.md "max_instances
and min_instances").

Found by the live metrics test (tests/test_user_path.py): in_zone with max_instances = 2 had 3
instances. The decentralized decision never reads max_instances (each instance decides alone,
from its own load, and may create several copies in one round), so before the bound in the
agent's createNode() nothing stopped an operator from passing it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from agent.policy.decentralized import Action, ScalingParams, decide
from agent.node import bounds
from agent.instance.spec import InstanceSpec
from agent.mqtt.settings import BrokerSpec

PIPELINE = """
[pipeline]
name = "hot"
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
[[operator]]
name = "in_zone"
function = "agent.operators.builtin:in_zone"
[operator.scaling]
policy = "decentralized"
capacity = 20.0
max_instances = 2
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""


def test_one_decision_alone_overshoots_max_instances() -> None:
    """The overshoot at its root: the live test's numbers (60 records/s on one instance of
    capacity 20, r = 0.7) make ONE decision create 3 or 4 copies, whatever max_instances says."""
    params = ScalingParams(capacity=20.0)
    copies = {decide(params, 60.0, is_keeper=True, draw=d).count for d in (0.0, 0.5, 0.99)}
    assert decide(params, 60.0, is_keeper=True, draw=0.5).action is Action.DUPLICATE
    assert min(copies) >= 3  # 1 + 3 = 4 instances > max_instances = 2


def test_count_covers_every_phase_every_online_node_and_copies_in_flight() -> None:
    local = [("hot.in_zone.0", "hot", "in_zone"), ("hot.in_zone.a", "hot", "in_zone"),
             ("hot.sink.0", "hot", "sink"), ("cold.in_zone.0", "cold", "in_zone")]
    fleet: Dict[str, Any] = {
        "me": {"instances": [{"id": "stale.own", "operator": "in_zone", "pipeline": "hot"}]},  # own: supervisor counts
        "n2": {"instances": [{"id": "hot.in_zone.b", "operator": "in_zone", "pipeline": "hot", "status": "terminating"},
                             {"id": "old.agent", "operator": "in_zone"},  # no pipeline: counted
                             {"id": "hot.in_zone.x", "operator": "in_zone", "pipeline": "other"}, "junk"]},
        "n3": {"instances": [{"id": "hot.in_zone.c", "operator": "in_zone", "pipeline": "hot"}]},  # offline
    }
    got = bounds.operator_instances("hot", "in_zone", "me", local, fleet, {"n3": False},
                                    placing=[("hot.in_zone.d", "hot", "in_zone"), ("hot.in_zone.b", "hot", "in_zone")])
    assert got == {"hot.in_zone.0", "hot.in_zone.a", "hot.in_zone.b", "old.agent", "hot.in_zone.d"}


def test_refusal_at_the_bound_but_never_for_an_existing_instance() -> None:
    assert bounds.refusal("op", "new", 2, {"a"}) is None
    why = bounds.refusal("op", "new", 2, {"a", "b"})
    assert why is not None and "max_instances = 2" in why and "2 instances" in why
    assert bounds.refusal("op", "b", 2, {"a", "b"}) is None  # a restarted creator asks again


class _Proc:
    pid = 999_999
    stdin = None

    def poll(self) -> Optional[int]:
        return None


def _agent(tmp_path: Path) -> Tuple[Any, List[Tuple[str, Dict[str, Any]]], List[str]]:
    """A real daemon object (not run) whose supervisor registers a started worker without a
    process (as tests/test_runtime_daemon.py does) and records the replies to its workers."""
    from agent.config import load_agent_config
    from agent.node.daemon import Agent
    from agent.node.workers import Worker, WorkerStatus

    conf = tmp_path / "a.toml"
    conf.write_text(f'[agent]\nnode = "me"\ncluster = "c"\nstate_dir = "{tmp_path}"\nslots = 16\n'
                    '[mqtt]\nhost = "h"\nport = 1\n')
    agent = Agent(load_agent_config(conf), warm_worker=False)
    replies: List[Tuple[str, Dict[str, Any]]] = []
    started: List[str] = []

    def start(spec: InstanceSpec, now: float) -> None:
        started.append(spec.instance)
        agent.supervisor.workers[spec.instance] = Worker(spec=spec, proc=_Proc(), started_at=now)  # type: ignore[arg-type]

    agent.supervisor.start = start  # type: ignore[assignment]
    agent.supervisor.send = lambda target, event, **f: replies.append((target, f)) or True  # type: ignore[assignment]
    keeper = InstanceSpec("hot.in_zone.0", "in_zone", "me", "c", "hot", PIPELINE, BrokerSpec("h", 1), keeper=True)
    agent.supervisor.workers[keeper.instance] = Worker(spec=keeper, proc=_Proc(), started_at=0.0,  # type: ignore[arg-type]
                                                       status=WorkerStatus.ACTIVE)
    return agent, replies, started


def _spawn(agent: Any, requester: str, instance: str, request: str) -> None:
    template = agent.supervisor.workers[requester].spec
    spec = json.loads(template.to_json())
    spec.update(instance=instance, keeper=False, active=False, succs=[], preds=[])
    agent.core.worker_lines.spawn(requester, {"request": request, "spec": spec}, 1.0, agent.wall())


def test_the_agent_refuses_copies_past_max_instances(tmp_path: Path) -> None:
    """One round of 3 copies by the keeper (the decision above), then a sibling deciding on its
    own: exactly one copy is created, every other request is refused with the reason, and the
    operator never has more than max_instances = 2 instances, starting ones included."""
    agent, replies, started = _agent(tmp_path)
    for k, inst in enumerate(("hot.in_zone.a", "hot.in_zone.b", "hot.in_zone.c")):
        _spawn(agent, "hot.in_zone.0", inst, f"r{k}")
    assert started == ["hot.in_zone.a"]
    _spawn(agent, "hot.in_zone.a", "hot.in_zone.a1", "s0")  # the copy decides alone, too
    assert started == ["hot.in_zone.a"]
    refused = [f for _, f in replies if not f.get("ok")]
    assert len(refused) == 3 and all("max_instances = 2" in f["error"] for f in refused), replies
    assert sum(1 for w in agent.supervisor.workers.values() if w.spec.operator == "in_zone") == 2
    assert agent.core.counters["spawn_refused_max"] == 3
    # Another node's copy counts too: after a scale-in here, the slot it took is not free.
    del agent.supervisor.workers["hot.in_zone.a"]
    agent.core.view.fleet = {"n2": {"node": "n2", "instances": [{"id": "hot.in_zone.z", "operator": "in_zone",
                                                        "pipeline": "hot", "status": "active"}]}}
    _spawn(agent, "hot.in_zone.0", "hot.in_zone.e", "r9")
    assert started == ["hot.in_zone.a"] and not replies[-1][1]["ok"]
    agent.core.view.fleet = {}
    _spawn(agent, "hot.in_zone.0", "hot.in_zone.f", "r10")  # below the bound again: created
    assert started == ["hot.in_zone.a", "hot.in_zone.f"]


def test_a_copy_placed_on_another_node_counts_until_that_node_publishes_its_state(tmp_path: Path) -> None:
    """Between the remote node's "ready" reply and its next retained state, the copy is in no
    view but this agent's own record of what it placed."""
    agent, replies, started = _agent(tmp_path)
    from types import SimpleNamespace

    from agent import topics
    from agent.node import nodestate

    agent.core.view.placed["hot.in_zone.r"] = ("n2", ("hot.in_zone.r", "hot", "in_zone"))
    _spawn(agent, "hot.in_zone.0", "hot.in_zone.a", "r0")
    assert started == [] and "max_instances" in replies[-1][1]["error"]

    def state(*ids: str) -> None:  # n2's retained state arrives (published after its reply)
        doc = nodestate.build_node_state("n2", 4, [nodestate.InstanceInfo(i, "in_zone", False, "active") for i in ids],
                                         nodestate.MachineSample(1.0, 1.0), 1.0)
        for item in doc["instances"]:
            item["pipeline"] = "hot"
        agent.core._on_message(SimpleNamespace(topic=topics.agent_state("c", "n2"), payload=nodestate.encode_state(doc),
                                          retain=True), 2.0)

    state("hot.in_zone.r")  # now in n2's state: counted from there, once
    assert agent.core.view.placed == {}
    _spawn(agent, "hot.in_zone.0", "hot.in_zone.b", "r1")
    assert started == [] and "has 2 instances" in replies[-1][1]["error"]
    state()  # it left n2: room again
    _spawn(agent, "hot.in_zone.0", "hot.in_zone.c", "r2")
    assert started == ["hot.in_zone.c"], replies


def test_check_config_says_what_the_bounds_guarantee(tmp_path: Path, capsys: Any) -> None:
    """check-config (the user-visible text): max_instances is exact through one agent only, and
    min_instances is not enforced; a pipeline without such settings gets no such warning."""
    from agent.cli.main import main

    pipe = tmp_path / "p.toml"
    pipe.write_text(PIPELINE.replace("max_instances = 2", "max_instances = 2\nmin_instances = 2"))
    assert main(["check-config", str(pipe)]) == 0
    err = capsys.readouterr().err
    assert "warning:" in err and "max_instances = 2 bounds every instance" in err and "one state period" in err
    assert "min_instances = 2 is not enforced" in err
    pipe.write_text(PIPELINE.replace("max_instances = 2\n", ""))
    assert main(["check-config", str(pipe)]) == 0
    assert "max_instances" not in capsys.readouterr().err


def test_fogctl_scale_refuses_past_max_instances_before_asking_an_agent() -> None:
    """A forced scale-out takes the agents' path, so they would refuse the extra copies; fogctl
    says it first, counting as the agents do (every phase, online nodes)."""
    import pytest

    from agent.control.fleet import Fleet
    from agent.control.rpc_schema import RequestError, ScaleRequest, check_scale

    def fleet(pipeline_text: str) -> Fleet:
        insts = [{"id": "hot.in_zone.0", "operator": "in_zone", "pipeline": "hot", "keeper": True, "status": "active"}]
        return Fleet.from_messages("c", {
            "fog/c/agents/n1/status": b"online",
            "fog/c/agents/n1/state": json.dumps({"slots": 6, "instances": insts}).encode(),
            "fog/c/pipelines/hot": pipeline_text.encode(),
        })

    assert check_scale(fleet(PIPELINE), ScaleRequest("in_zone", 1)) == [("n1", ScaleRequest("in_zone", 1))]
    with pytest.raises(RequestError, match="would make 3 instances, its max_instances is 2"):
        check_scale(fleet(PIPELINE), ScaleRequest("in_zone", 2))
    # unknown bound (no or a malformed retained pipeline): only the slots are checked here
    assert check_scale(fleet("[[operator]"), ScaleRequest("in_zone", 2))
