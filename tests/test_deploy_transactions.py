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
from agent.runtime.broker import start_private_broker
from agent.runtime.deploy import parse_record
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

        assert wait_until(online, 20), [a.node for a in self.agents]

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
        r = PIPELINE.replace('name = "p"', 'name = "r"').replace("agent.runtime.taxi:source", "fogtest_nowhere:source")
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
