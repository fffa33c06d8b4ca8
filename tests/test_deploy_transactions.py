"""Deploy and undeploy as transactions with a durable record (docs/fogctl.md, "Deploy and undeploy").

Real agents (`fog-agent run`, with the contract's fake worker for speed: re-adoption, stops and
placement are the agent's) on a real Mosquitto, restarted as a user would: an undeployed
pipeline must not come back at an agent restart, also after a broker restart without
persistence; a deploy that cannot place every keeper leaves nothing running or published; one
that fails half-way stops what it started; `undeploy --force` stops instances no description
names. Pinning (`fogctl scale`) is tested with real workers, which run the real policy.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import pytest

from agent import topics
from agent.cli.fogctl import main
from agent.fogctl.client import Connection
from agent.fogctl.config import FogctlConfig
from foglab.tools.broker import start_private_broker
from agent.control.records import parse_record
from agent_process import ONLINE_BOUND
from test_runtime_daemon import PIPELINE, AgentProc, fake_worker, wait_until  # noqa: F401  (fixture)

pytestmark = pytest.mark.broker

SETTLE = 2.5  # s after "online": READOPT_SETTLE (1 s) + a fake worker's start + a state period


def fogctl(capsys: Any, broker: Any, cluster: str, *argv: str) -> Tuple[int, Any, str]:
    code = main(["--broker", broker.address, "--cluster", cluster, "--timeout", "5", "--json", *argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def running(capsys: Any, broker: Any, cluster: str) -> Dict[str, List[str]]:
    """What each online agent's supervisor runs, in its own words (rpc ping)."""
    code, doc, err = fogctl(capsys, broker, cluster, "status")
    assert code == 0, err
    out = {}
    with Connection(FogctlConfig(broker=broker.address, cluster=cluster)) as conn:
        for n in doc["nodes"]:
            if n["status"] == "online":
                out[n["node"]] = sorted(conn.rpc(n["node"], {"op": "ping"})["instances"])
    return out


def listed(capsys: Any, broker: Any, cluster: str, n: int) -> bool:
    """Wait until the retained states list `n` instances (what undeploy and deploy read)."""
    def count() -> bool:
        code, doc, _ = fogctl(capsys, broker, cluster, "status")
        return code == 0 and sum(len(x["instances"]) for x in doc["nodes"]) == n
    return wait_until(count, 10)


def specs_on_disk(tmp: Path, nodes: Sequence[str]) -> List[str]:
    return sorted(p.name for n in nodes for p in (tmp / f"state-{n}").glob("*.spec.json"))


def record(broker: Any, cluster: str, name: str) -> Any:
    with Connection(FogctlConfig(broker=broker.address, cluster=cluster)) as conn:
        msgs = conn.snapshot([topics.pipeline(cluster, name)])
    m = msgs.get(topics.pipeline(cluster, name))
    return parse_record(m.payload) if m is not None else None


class Fleet:
    """Agents that can be stopped (SIGTERM: workers drain, specs stay) and started again."""

    def __init__(self, tmp: Path, broker: Any, cluster: str, worker: List[str], nodes: Sequence[str],
                 slots: int = 2) -> None:
        self.tmp, self.broker, self.cluster, self.worker, self.nodes, self.slots = tmp, broker, cluster, worker, nodes, slots
        self.agents: List[AgentProc] = []

    def start(self, capsys: Any) -> None:
        self.agents = [AgentProc(self.tmp, self.broker, n, self.worker, slots=self.slots, cluster=self.cluster,
                                 shutdown_timeout=2.0, port=self.broker.port) for n in self.nodes]

        def online() -> bool:
            code, doc, _ = fogctl(capsys, self.broker, self.cluster, "status")
            return code == 0 and {n["node"]: n["status"] for n in doc["nodes"]} == {n: "online" for n in self.nodes}

        assert wait_until(lambda: online() or any(a.proc.poll() is not None for a in self.agents), ONLINE_BOUND)
        assert online(), [(a.node, a.proc.poll()) for a in self.agents]

    def stop(self) -> None:
        for a in self.agents:
            if a.proc.poll() is None:
                a.proc.send_signal(signal.SIGTERM)
        for a in self.agents:
            try:
                a.proc.wait(timeout=8)
            except subprocess.TimeoutExpired:
                pass
            a.stop()


def write(tmp: Path, text: str, name: str = "p.toml") -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


def test_undeployed_stays_gone_over_agent_and_broker_restarts_and_force_stops_orphans(
        capsys, tmp_path: Path, fake_worker: List[str]) -> None:
    """A broker WITHOUT persistence (as the user's): undeploy, restart broker and agents ->
    nothing comes back. Then the documented choice for "no record at all": a deployed pipeline
    survives a broker restart plus agent restarts (re-adopted), `undeploy` without a
    description points to --force, and --force stops those instances for good."""
    broker = start_private_broker(tmp_path / "broker", persistence=False)
    cluster, nodes = "tx1", ("n1", "n2")
    fleet = Fleet(tmp_path, broker, cluster, fake_worker, nodes)
    try:
        fleet.start(capsys)
        code, doc, err = fogctl(capsys, broker, cluster, "deploy", write(tmp_path, PIPELINE))
        assert code == 0, err
        assert sum(len(v) for v in running(capsys, broker, cluster).values()) == 3
        assert len(specs_on_disk(tmp_path, nodes)) == 3
        gen = record(broker, cluster, "p").generation
        assert record(broker, cluster, "p").state == "deployed" and gen
        assert listed(capsys, broker, cluster, 3)

        code, doc, err = fogctl(capsys, broker, cluster, "undeploy", "p")
        assert code == 0, err
        assert len(doc["stopped"]) == 3
        # The stop's reply comes after the agent deleted the stored spec (no waiting needed).
        assert specs_on_disk(tmp_path, nodes) == []
        assert record(broker, cluster, "p") == parse_record(f"# fog-undeployed: {gen}\n".encode())

        fleet.stop()
        broker.stop()
        broker = fleet.broker = start_private_broker(tmp_path / "broker", port=broker.port, persistence=False)
        assert record(broker, cluster, "p") is None  # the broker lost the tombstone
        fleet.start(capsys)
        time.sleep(SETTLE)
        assert running(capsys, broker, cluster) == {"n1": [], "n2": []}
        assert specs_on_disk(tmp_path, nodes) == []

        # Deployed again (a new generation); then agents and broker restart: no record at all.
        code, doc, err = fogctl(capsys, broker, cluster, "deploy", write(tmp_path, PIPELINE))
        assert code == 0, err
        assert record(broker, cluster, "p").generation not in (None, gen)
        fleet.stop()
        broker.stop()
        broker = fleet.broker = start_private_broker(tmp_path / "broker", port=broker.port, persistence=False)
        fleet.start(capsys)
        assert wait_until(lambda: sum(len(v) for v in running(capsys, broker, cluster).values()) == 3, 10)
        assert listed(capsys, broker, cluster, 3)  # undeploy reads the retained states, which may lag the workers

        code, doc, err = fogctl(capsys, broker, cluster, "undeploy", "p")
        assert code == 1 and "no description" in err and "undeploy --force p" in err, err
        assert sum(len(v) for v in running(capsys, broker, cluster).values()) == 3  # nothing stopped

        assert listed(capsys, broker, cluster, 3)
        code, doc, err = fogctl(capsys, broker, cluster, "undeploy", "--force", "p")
        assert code == 0, err
        assert len(doc["stopped"]) == 3 and doc["forced"] is True
        assert specs_on_disk(tmp_path, nodes) == []
        assert wait_until(lambda: running(capsys, broker, cluster) == {"n1": [], "n2": []}, 10)
        fleet.stop()
        fleet.start(capsys)
        time.sleep(SETTLE)
        assert running(capsys, broker, cluster) == {"n1": [], "n2": []}
    finally:
        fleet.stop()
        broker.stop()


def test_an_agent_away_during_undeploy_forgets_it_from_the_tombstone(
        capsys, mosquitto: Any, tmp_path: Path, fake_worker: List[str]) -> None:
    """n2 is stopped while the pipeline runs (its specs stay, to be re-adopted); the undeploy
    stops n1's instances. When n2 starts again, the retained tombstone makes it forget its
    specs: nothing is re-adopted."""
    cluster, nodes = "tx2", ("n1", "n2")
    fleet = Fleet(tmp_path, mosquitto, cluster, fake_worker, nodes)
    try:
        fleet.start(capsys)
        code, doc, err = fogctl(capsys, mosquitto, cluster, "deploy", write(tmp_path, PIPELINE))
        assert code == 0, err
        on_n2 = [k["instance"] for k in doc["keepers"] if k["node"] == "n2"]
        assert on_n2
        assert listed(capsys, mosquitto, cluster, 3)
        n2 = fleet.agents[1]
        n2.proc.send_signal(signal.SIGTERM)
        n2.proc.wait(timeout=8)
        assert specs_on_disk(tmp_path, ["n2"]) == sorted(f"{i}.spec.json" for i in on_n2)
        code, doc, err = fogctl(capsys, mosquitto, cluster, "undeploy", "p")
        assert code == 0, err
        assert sorted(d["instance"] for d in doc["stopped"]) == sorted(
            k for k in ("p.source.0", "p.work.0", "p.sink.0") if k not in on_n2)
        fleet.agents[1] = AgentProc(tmp_path, mosquitto, "n2", fake_worker, slots=2, cluster=cluster,
                                    shutdown_timeout=2.0)
        assert wait_until(lambda: "n2" in running(capsys, mosquitto, cluster), 20)
        time.sleep(SETTLE)
        assert running(capsys, mosquitto, cluster) == {"n1": [], "n2": []}
        assert specs_on_disk(tmp_path, nodes) == []
    finally:
        fleet.stop()


def test_deploy_on_a_full_fleet_is_refused_and_a_failed_one_rolled_back(
        capsys, mosquitto: Any, tmp_path: Path, fake_worker: List[str]) -> None:
    """4 slots: p (3 keepers) fits, q (3 more) does not: refused before anything is published
    (rc 1). r's source names a function no node admits: its sink and work start, the source is
    refused everywhere, the two are stopped again and r's record is a tombstone (rc 4)."""
    cluster, nodes = "tx3", ("n1", "n2")
    fleet = Fleet(tmp_path, mosquitto, cluster, fake_worker, nodes)
    try:
        fleet.start(capsys)
        code, doc, err = fogctl(capsys, mosquitto, cluster, "deploy", write(tmp_path, PIPELINE))
        assert code == 0, err
        assert listed(capsys, mosquitto, cluster, 3)  # the retained states show the used slots
        q = PIPELINE.replace('name = "p"', 'name = "q"')
        code, doc, err = fogctl(capsys, mosquitto, cluster, "deploy", write(tmp_path, q, "q.toml"))
        assert code == 1, err
        assert "refused" in err and "need 3 free slot(s)" in err and "have 1" in err
        assert "nothing was started or published" in err and len(err.strip().splitlines()) == 1
        assert record(mosquitto, cluster, "q") is None
        assert sorted(i for v in running(capsys, mosquitto, cluster).values() for i in v) == \
            ["p.sink.0", "p.source.0", "p.work.0"]

        code, doc, err = fogctl(capsys, mosquitto, cluster, "undeploy", "p")
        assert code == 0, err
        assert wait_until(lambda: running(capsys, mosquitto, cluster) == {"n1": [], "n2": []}, 10)
        assert listed(capsys, mosquitto, cluster, 0)
        r = PIPELINE.replace('name = "p"', 'name = "r"').replace("agent.operators.taxi:source", "fogtest_nowhere:source")
        code, doc, err = fogctl(capsys, mosquitto, cluster, "deploy", write(tmp_path, r, "r.toml"))
        assert code == 4, err
        assert "rolled back" in err and "cannot start the keeper of 'source'" in err
        assert "stopped: r.work.0@" in err and "r.sink.0@" in err and len(err.strip().splitlines()) == 1
        rec = record(mosquitto, cluster, "r")
        assert rec is not None and rec.state == "undeployed" and rec.generation
        assert wait_until(lambda: running(capsys, mosquitto, cluster) == {"n1": [], "n2": []}, 10)
        assert specs_on_disk(tmp_path, nodes) == []
        code, doc, err = fogctl(capsys, mosquitto, cluster, "pipelines")
        assert code == 0 and [p["pipeline"] for p in doc["pipelines"] if p["deployed"]] == [], doc
    finally:
        fleet.stop()


PIN_PIPELINE = """
[pipeline]
name = "pin"
[scaling]
policy = "decentralized"
capacity = 1000.0
period = 0.5
max_instances = 3
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
params = { seed = 4, profile = "constant", rate = 20.0 }
[[operator]]
name = "in_zone"
function = "agent.operators.builtin:in_zone"
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""


def test_manual_scale_pins_the_count_until_released(capsys, mosquitto: Any, tmp_path: Path) -> None:
    """Real workers, real policy: in_zone gets 20 records/s for a capacity of 1,000, so a copy
    scales itself in at its first decisions (q = 1 - load/(0.7 C) ~ 0.97 per 0.5 s period).
    After `fogctl scale in_zone +1` the copy stays for 8 periods (pinned; `why` says so);
    after `fogctl scale --release in_zone` the policy removes it again."""
    from test_fogctl_agents import Agent

    cluster = "tx4"
    agents = [Agent(tmp_path, mosquitto, cluster, n) for n in ("p1", "p2")]
    try:
        def in_zone() -> List[Dict[str, Any]]:
            code, doc, _ = fogctl(capsys, mosquitto, cluster, "topology", "pin")
            if code != 0 or not doc["pipelines"]:
                return []
            return [i for o in doc["pipelines"][0]["operators"] if o["operator"] == "in_zone"
                    for i in o["instances"] if i["phase"] == "active"]

        assert wait_until(lambda: [n["status"] for n in fogctl(capsys, mosquitto, cluster, "status")[1]["nodes"]]
                          == ["online"] * 2, ONLINE_BOUND)
        code, doc, err = fogctl(capsys, mosquitto, cluster, "deploy", write(tmp_path, PIN_PIPELINE))
        assert code == 0, err
        assert wait_until(lambda: len(in_zone()) == 1, 20)
        code, doc, err = fogctl(capsys, mosquitto, cluster, "scale", "in_zone", "+1", "--wait", "20")
        assert code == 0, err
        assert doc["instances"] == 2 and sorted(doc["pinned"]["nodes"]) == ["p1", "p2"]
        assert doc["pinned"]["seconds"] is None
        t0 = time.monotonic()
        while time.monotonic() - t0 < 4.0:  # 8 policy periods
            got = in_zone()
            assert len(got) == 2, got
            time.sleep(0.3)
        (copy,) = [i["id"] for i in in_zone() if not i["keeper"]]
        code, doc, err = fogctl(capsys, mosquitto, cluster, "why", copy)
        assert code == 0 and doc["pinned"]["operator"] == "in_zone" and doc["pinned"]["until"] is None, doc
        main(["--broker", mosquitto.address, "--cluster", cluster, "why", copy])
        assert "pinned: in_zone's instance count was set by fogctl scale, until released" in capsys.readouterr()[0]

        code, doc, err = fogctl(capsys, mosquitto, cluster, "scale", "--release", "in_zone")
        assert code == 0 and sorted(doc["released"]) == ["p1", "p2"], err
        assert wait_until(lambda: len(in_zone()) == 1, 10), in_zone()
        code, doc, err = fogctl(capsys, mosquitto, cluster, "why", [i["id"] for i in in_zone()][0])
        assert code == 0 and doc["pinned"] is None

        # --for: the pin ends by itself (the agents' clocks), then the policy removes the copy.
        assert listed(capsys, mosquitto, cluster, 3)  # the copy's slot is free again in the states
        code, doc, err = fogctl(capsys, mosquitto, cluster, "scale", "in_zone", "+1", "--for", "2s", "--wait", "20")
        assert code == 0 and doc["pinned"]["seconds"] == 2.0, err
        assert doc["instances"] == 2
        assert wait_until(lambda: len(in_zone()) == 1, 10), in_zone()
    finally:
        for a in agents:
            a.stop()


def test_records_generations_and_durations_pure() -> None:
    """The rules the agents apply (agent.control.records.stale_reason) and fogctl's --for."""
    from agent.config import load_pipeline_text
    from agent.control.rpc_schema import RequestError, parse_duration
    from agent.control.records import PipelineRecord, stale_reason, stamp, tombstone

    text = stamp(PIPELINE, "18c-abc123")
    assert load_pipeline_text(text).pipeline.name == "p"  # the stamp is a TOML comment
    assert parse_record(text.encode()) == PipelineRecord("deployed", "18c-abc123")
    assert parse_record(PIPELINE.encode()) == PipelineRecord("deployed", None)  # before generations
    assert parse_record(tombstone("p", "18c-abc123")) == PipelineRecord("undeployed", "18c-abc123")
    assert parse_record(tombstone("p", None)) == PipelineRecord("undeployed", None)
    assert parse_record(b"") is None
    deployed = PipelineRecord("deployed", "g2")
    assert stale_reason("g2", deployed) is None
    assert "g1" in stale_reason("g1", deployed) and "g2" in stale_reason("g1", deployed)
    assert stale_reason(None, deployed) is None and stale_reason("g1", PipelineRecord("deployed")) is None
    assert "undeployed" in stale_reason("g2", PipelineRecord("undeployed", "g2"))
    assert "undeployed" in stale_reason(None, PipelineRecord("undeployed"))
    assert stale_reason("g1", None) is None  # no record at all: kept (see stale_reason's docstring)
    assert [parse_duration(x) for x in ("90", "90s", "10m", "2h", "1d", "0.5m")] == [90, 90, 600, 7200, 86400, 30]
    for bad in ("", "0", "-5m", "10x", "nan", "inf", "400d"):
        with pytest.raises(RequestError):
            parse_duration(bad)


def test_pins_are_kept_in_the_state_dir(tmp_path: Path) -> None:
    """An agent restart keeps the pins (they are applied to the re-adopted instances); a damaged
    file or a damaged entry is no pin, never an error."""
    from agent.node.requests import PINS_FILE, load_pins as _load_pins, save_pins as _save_pins

    pins = {"taxi/in_zone": {"pipeline": "taxi", "operator": "in_zone", "until": None},
            "/sink": {"pipeline": None, "operator": "sink", "until": 1800000000.5}}
    _save_pins(tmp_path, pins)
    assert _load_pins(tmp_path) == pins
    (tmp_path / PINS_FILE).write_text('{"a": {"operator": 5}, "b": {"operator": "x", "until": "soon"}, '
                                      '"c": {"operator": "y", "pipeline": 7}}')
    assert _load_pins(tmp_path) == {"c": {"pipeline": None, "operator": "y", "until": None}}
    (tmp_path / PINS_FILE).write_text("not json")
    assert _load_pins(tmp_path) == {}
