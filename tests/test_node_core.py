"""The node's sans-IO core (agent.node.core.NodeCore), built on fakes of its ports and driven by
its typed events: no broker, no process, no thread. Each test walks one decision the daemon used
to make only with a broker: an admin's createNode() from the request to the answer, the order of
what a new session publishes, the shutdown, a worker's crash and its restart."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest

from agent import topics
from agent.config import load_agent_config
from agent.instance.spec import InstanceSpec
from agent.mqtt.settings import BrokerSpec
from agent.node import nodestate
from agent.node.core import NodeCore, SessionUp, Stopping, Tick, WorkerExited, WorkerSaid
from agent.node.loopevents import MqttMessage
from agent.node.placement import DEFAULT_POLICY, get_policy
from agent.node.report import Report
from agent.node.workers import Reaped, Worker, WorkerStatus
from agent.operators.admission import AllowList
from pipelines import with_work


class FakeBus:
    """The MQTT session as the core sees it (agent.node.core.BusPort): what it was asked, in order."""

    client_id = "fog-agent-c-me"
    broker = BrokerSpec("127.0.0.1", 1883)

    def __init__(self) -> None:
        self.connected = self.retained_in = True
        self.last_puback = 0.0
        self.out: List[Tuple[str, Any]] = []  # ("publish", (topic, payload, retain, correlation)) | ("online", None)

    def publish(self, topic: str, payload: bytes, retain: bool = False, qos: int = 1,
                correlation: Optional[bytes] = None) -> int:
        self.out.append(("publish", (topic, payload, retain, correlation)))
        return len(self.out)

    def online(self) -> None:
        self.out.append(("online", None))

    def marked(self, payload: bytes) -> bool:
        return payload == b"marker"

    def published(self, topic: str) -> List[bytes]:
        return [p[1] for kind, p in self.out if kind == "publish" and p[0] == topic]


class FakeWorkers:
    """The worker table (agent.node.workers.WorkerTable): workers are records, commands a list."""

    def __init__(self) -> None:
        self.workers: Dict[str, Worker] = {}
        self.commands: List[Tuple[Any, ...]] = []

    def start(self, spec: InstanceSpec, now: float) -> Worker:
        w = self.workers[spec.instance] = Worker(spec, SimpleNamespace(pid=1000 + len(self.commands)), now)
        self.commands.append(("start", spec.instance))
        return w

    def start_chain(self, specs: Sequence[InstanceSpec], now: float) -> List[Worker]:
        return [self.start(s, now) for s in specs]

    def send(self, target: str, event: str, /, **fields: Any) -> bool:
        self.commands.append(("send", target, event))
        return target in self.workers

    def stop(self, instance: str, now: float) -> None:
        self.commands.append(("stop", instance))

    def kill(self, instance: str, now: float, reason: str) -> None:
        self.commands.append(("kill", instance))

    def get(self, instance: str) -> Optional[Worker]:
        return self.workers.get(instance)

    def __len__(self) -> int:
        return len(self.workers)

    def __contains__(self, instance: object) -> bool:
        return instance in self.workers

    def pids(self) -> List[int]:  # the report's (agent.node.report), not the core's
        return [w.pid for w in self.workers.values()]


def _core(tmp_path: Path) -> Tuple[NodeCore, FakeBus, FakeWorkers]:
    conf = tmp_path / "a.toml"
    conf.write_text(f'[agent]\nnode = "me"\ncluster = "c"\nslots = 2\nstate_dir = "{tmp_path}/state"\n'
                    '[mqtt]\nhost = "127.0.0.1"\nport = 1883\n[metrics]\nport = 0\n')
    cfg = load_agent_config(conf)
    bus, workers = FakeBus(), FakeWorkers()
    wall = lambda: 1_700_000_000.0  # noqa: E731
    report = Report(cfg, workers, lambda pids: nodestate.MachineSample(cpu=10.0, memory=20.0), wall)
    core = NodeCore(cfg, get_policy(DEFAULT_POLICY), workers, bus, report, None, None,
                    AllowList.for_node(cfg.operators.modules), lambda: 0.0, wall)
    return core, bus, workers


def _message(topic: str, body: Dict[str, Any], correlation: bytes = b"k-1") -> MqttMessage:
    return MqttMessage(SimpleNamespace(topic=topic, payload=json.dumps(body).encode(), retain=False,
                                       properties=SimpleNamespace(CorrelationData=correlation)))


SPEC = {"instance": "p.work.0", "operator": "work", "pipeline": "p",
        "pipeline_toml": with_work("agent.operators.builtin:in_zone"), "succs": ["p.sink.0"],
        "preds": ["p.source.0"], "keeper": True}


def test_an_admins_spawn_starts_a_worker_and_is_answered_only_once_it_is_ready(tmp_path: Path) -> None:
    core, bus, workers = _core(tmp_path)
    reply_topic = topics.replies("c", "adm", "me")
    core.handle(_message(topics.agent_rpc("c", "me", "adm"), {"op": "spawn", "spec": SPEC}), 1.0)
    assert workers.commands == [("start", "p.work.0")]
    assert bus.published(reply_topic) == [], "answered before the worker subscribed to its inbox"
    workers.workers["p.work.0"].status = WorkerStatus.ACTIVE  # what the supervisor does with its "ready" line
    core.handle(WorkerSaid("p.work.0", {"event": "ready"}, 1_700_000_001.0), 2.0)
    (answer,) = bus.published(reply_topic)
    assert json.loads(answer) == {"ok": True, "instance": "p.work.0", "node": "me"}
    # the answer echoes the request's correlation, and our hosted record (the receivers' binding)
    # went out before it (docs/design.md invariant 2)
    kinds = [(p[0], p[3]) for kind, p in bus.out if kind == "publish"]
    assert kinds.index((topics.agent_hosted("c", "me"), None)) < kinds.index((reply_topic, b"k-1"))
    assert [s.instance for s in core.stored.specs()] == ["p.work.0"]


def test_a_new_session_publishes_the_state_before_saying_online(tmp_path: Path) -> None:
    core, bus, _ = _core(tmp_path)
    core.handle(SessionUp(session_present=False), 0.0)
    state = topics.agent_state("c", "me")
    assert bus.out[0][0] == "publish" and bus.out[0][1][0] == state and bus.out[0][1][2] is True
    assert bus.out[1] == ("online", None)
    assert json.loads(bus.published(state)[0])["free_slots"] == 2


def test_after_the_shutdown_began_a_spawn_is_refused_and_nothing_starts(tmp_path: Path) -> None:
    core, bus, workers = _core(tmp_path)
    core.handle(Stopping("signal SIGTERM"), 0.0)
    core.handle(_message(topics.agent_rpc("c", "me", "adm"), {"op": "spawn", "spec": SPEC}), 1.0)
    (answer,) = bus.published(topics.replies("c", "adm", "me"))
    assert json.loads(answer)["ok"] is False and "shutting down" in json.loads(answer)["error"]
    assert workers.commands == [] and core.stopping


def test_a_worker_that_keeps_crashing_is_restarted_at_once_three_times_then_after_a_backoff(tmp_path: Path) -> None:
    core, bus, workers = _core(tmp_path)
    core.handle(_message(topics.agent_rpc("c", "me", "adm"), {"op": "spawn", "spec": SPEC}), 1.0)
    workers.workers["p.work.0"].status = WorkerStatus.ACTIVE
    core.handle(WorkerSaid("p.work.0", {"event": "ready"}, 1_700_000_001.0), 2.0)  # createNode() done
    starts = lambda: workers.commands.count(("start", "p.work.0"))  # noqa: E731
    for crash, t in enumerate((3.0, 4.0, 5.0, 6.0)):
        w = workers.workers.pop("p.work.0")  # the supervisor reaped it: died unasked, said no "exit"
        core.handle(WorkerExited(Reaped(w, -9)), t)
        assert starts() == (crash + 2 if crash < 3 else 4), crash
    assert "p.work.0" not in workers.workers and core.counters["restarts"] == 3
    core.handle(Tick(), 6.2)
    assert starts() == 4, "restarted before its backoff"
    core.handle(Tick(), 6.0 + 31.0)
    assert starts() == 5 and core.counters["restarts"] == 4


@pytest.mark.parametrize("payload", [b"", b"{", b"[1]", b'{"op": "spawn"}', b'{"op": "spawn", "spec": 3}'])
def test_a_malformed_request_is_answered_counted_and_changes_nothing(tmp_path: Path, payload: bytes) -> None:
    core, bus, workers = _core(tmp_path)
    msg = SimpleNamespace(topic=topics.agent_rpc("c", "me", "adm"), payload=payload, retain=False,
                          properties=SimpleNamespace(CorrelationData=b"k"))
    core.handle(MqttMessage(msg), 1.0)
    (answer,) = bus.published(topics.replies("c", "adm", "me"))
    assert json.loads(answer)["ok"] is False and workers.commands == []
    assert core.counters["bad_messages"] + core.counters["rpc_requests"] >= 1
