"""The agent daemon, its supervisor, placement, node state and rpc.

Workers here are a small fake program that speaks the control contract of `agent.instance.spec`
(ready / heartbeat / spawn / exit; spawned / stop) and logs what it saw to a file, so that the
daemon's own promises are tested apart from the data path: "spawned" only after the new worker's
"ready" (invariant 2), stop escalation, no orphan process, Last Will, retained state.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
from agent.node.loopevents import WorkerEof, WorkerLine
from agent_process import ONLINE_BOUND
from pipelines import with_work

from agent.node import nodestate

from agent.node import rpc
from agent.node.deploy import RpcClient
from agent.node.placement import NodeView, PlacementRequest, free_slots_then_latency, local_only, spread
from agent.instance.spec import InstanceSpec
from agent.mqtt.settings import BrokerSpec
from agent.node.supervisor import Supervisor
from agent.node.workers import WorkerStatus

ROOT = Path(__file__).resolve().parent.parent

FAKE_WORKER = r'''
import json, os, signal, sys, threading, time
spec = json.loads(sys.stdin.readline())
fake = spec.get("extra", {}).get("fake", {})
logf = spec.get("extra", {}).get("fake_log")
def log(event, **kw):
    if logf:
        with open(logf, "a") as f:
            f.write(json.dumps({"t": time.time(), "instance": spec["instance"], "event": event,
                                "pid": os.getpid(), **kw}) + "\n")
def out(event, **kw):
    sys.stdout.write(json.dumps({"event": event, **kw}) + "\n"); sys.stdout.flush()
if fake.get("ignore_term"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
stop = threading.Event()
def reader():
    for line in sys.stdin:
        msg = json.loads(line)
        log(msg["event"], msg=msg)
        if msg["event"] == "stop" and not fake.get("ignore_stop"):
            stop.set()
    log("stdin_eof")
    stop.set()
threading.Thread(target=reader, daemon=True).start()
log("started", spec=spec)
time.sleep(fake.get("ready_delay", 0.0))
log("ready")
out("ready")
for i, req in enumerate(fake.get("spawn", [])):
    time.sleep(req.get("after", 0.1))
    out("spawn", request=f"r{i}", spec=req["spec"])
    log("spawn_sent", request=f"r{i}")
hb = 0
while not stop.wait(0.2):
    if not fake.get("no_heartbeat"):
        hb += 1
        out("heartbeat", stats={"load": 1.5, "capacity": 100.0, "hb": hb})
if fake.get("crash_on_stop"):
    os._exit(3)
out("exit", code=0, reason="stopped")
log("exit")
sys.exit(0)
'''

PIPELINE = with_work("agent.operators.builtin:identity")


@pytest.fixture
def fake_worker(tmp_path: Path) -> List[str]:
    path = tmp_path / "fake_worker.py"
    path.write_text(FAKE_WORKER)
    return [sys.executable, str(path)]


def read_log(path: Path) -> List[Dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is not a running orphan but check /proc to be strict
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def wait_until(pred: Any, timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())


# ---- placement (pure) -------------------------------------------------------------------------


def test_placement_prefers_a_local_free_slot_over_a_roomier_remote() -> None:
    fleet = [NodeView("n1", 4, 1), NodeView("n2", 8, 8)]
    assert free_slots_then_latency(PlacementRequest("op", local="n1"), fleet) == ["n1", "n2"]


def test_placement_never_offers_a_full_or_offline_node() -> None:
    fleet = [NodeView("n1", 4, 0), NodeView("n2", 4, 2, online=False), NodeView("n3", 4, 1)]
    assert free_slots_then_latency(PlacementRequest("op", local="n1"), fleet) == ["n3"]
    assert spread(PlacementRequest("op"), fleet) == ["n3"]
    assert local_only(PlacementRequest("op", local="n1"), fleet) == []


def test_placement_ranks_remote_nodes_by_latency_to_the_neighbours() -> None:
    # neighbour instance "a" runs on n4 (full); n2 is 50 ms from n4, n3 is 5 ms from it.
    fleet = [
        NodeView("n1", 2, 0, instances=("self",)),
        NodeView("n2", 4, 4, latency_ms={"n4": 50.0}),
        NodeView("n3", 4, 1, latency_ms={"n4": 5.0}),
        NodeView("n4", 1, 0, instances=("a",)),
    ]
    req = PlacementRequest("op", local="n1", neighbours=("a",))
    assert free_slots_then_latency(req, fleet) == ["n3", "n2"]
    # without measurements the roomiest node wins, deterministically
    unmeasured = [NodeView("n2", 4, 2), NodeView("n3", 4, 3), NodeView("n5", 4, 3)]
    assert free_slots_then_latency(PlacementRequest("op", local="n1"), unmeasured) == ["n3", "n5", "n2"]


def test_node_state_round_trip_and_free_slots() -> None:
    infos = [nodestate.InstanceInfo("b", "op", False, "active", 3.0, 10.0),
             nodestate.InstanceInfo("a", "op", True, "starting")]
    doc = nodestate.build_node_state("n1", 3, infos, nodestate.MachineSample(12.345, 50.0, 47.25), now=100.0)
    parsed = nodestate.parse_node_state(nodestate.encode_state(doc))
    assert parsed["free_slots"] == 1 and parsed["slots"] == 3
    assert [i["id"] for i in parsed["instances"]] == ["a", "b"]
    assert parsed["temperature"] == 47.2 or parsed["temperature"] == 47.3
    view = nodestate.node_view(parsed)
    assert view.instances == ("a", "b") and view.free_slots == 1
    for bad in (b"", b"[]", b'{"node": "n1"}', b"\xff"):
        with pytest.raises(ValueError):
            nodestate.parse_node_state(bad)


def test_latency_reader_is_lenient() -> None:
    assert nodestate.parse_latency(b'{"n2": 3.5, "n3": {"rtt_ms": 7}}') == {"n2": 3.5, "n3": 7.0}
    assert nodestate.parse_latency(b'{"rtt_ms": {"n2": 1}}') == {"n2": 1.0}
    assert nodestate.parse_latency(b"garbage") == {}


def test_a_request_names_a_known_op_and_a_spawn_carries_its_spec() -> None:
    with pytest.raises(ValueError):
        rpc.decode_request(b'{"op": "spawn"}')
    assert rpc.decode_request(b'{"op": "ping"}') == {"op": "ping"}


# ---- supervisor with fake workers (no broker) -------------------------------------------------


def make_spec(instance: str, tmp_path: Path, **fake: Any) -> InstanceSpec:
    return InstanceSpec(
        instance=instance, operator="work", node="n1", cluster="t", pipeline="p", pipeline_toml=PIPELINE,
        broker=BrokerSpec("127.0.0.1", 1), extra={"fake": fake, "fake_log": str(tmp_path / "fake.log")},
    )


class Loop:
    """A minimal stand-in for the daemon loop: feeds reader-thread events to the supervisor."""

    def __init__(self, **kw: Any) -> None:
        import queue

        self.q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self.sup = Supervisor(emit=self.q.put, **kw)
        self.msgs: List[Dict[str, Any]] = []
        self.reaped: List[Any] = []

    def pump(self, duration: float) -> None:
        import queue

        deadline = time.monotonic() + duration
        while time.monotonic() < deadline:
            try:
                ev = self.q.get(timeout=0.05)
                if isinstance(ev, WorkerLine):
                    msg = self.sup.handle_line(ev.instance, ev.line, time.monotonic())
                    if msg:
                        self.msgs.append(msg)
                elif isinstance(ev, WorkerEof):
                    self.sup.handle_eof(ev.instance)
            except queue.Empty:
                pass
            self.reaped.extend(self.sup.poll(time.monotonic()))

    def pump_until(self, pred: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.pump(0.1)
            if pred():
                return True
        return False


def test_supervisor_start_ready_heartbeat_stop(tmp_path: Path, fake_worker: List[str]) -> None:
    loop = Loop(command=fake_worker, heartbeat_timeout=2.0, term_after=2.0, kill_after=4.0)
    w = loop.sup.start(make_spec("w1", tmp_path, ready_delay=0.3), time.monotonic())
    assert w.status is WorkerStatus.STARTING
    assert loop.pump_until(lambda: w.status is WorkerStatus.ACTIVE and w.stats.get("hb", 0) >= 2, 10)
    assert w.stats["load"] == 1.5
    loop.sup.stop("w1", time.monotonic())
    assert loop.pump_until(lambda: loop.reaped, 5)
    r = loop.reaped[0]
    assert r.returncode == 0 and r.clean and not r.crashed
    assert r.worker.term_sent_at is None  # it drained on "stop", no signal needed
    assert not pid_alive(r.worker.pid)


@pytest.mark.parametrize("forked", [False, True], ids=["cold", "forked"])
def test_supervisor_escalates_to_sigterm_then_sigkill(tmp_path: Path, fake_worker: List[str], forked: bool) -> None:
    # forked: the signals go through the fork server, which signals its unreaped child
    loop = (served_loop if forked else Loop)(command=fake_worker, term_after=0.5, kill_after=1.5)
    deaf = loop.sup.start(make_spec("deaf", tmp_path, ignore_stop=True), time.monotonic())
    stubborn = loop.sup.start(make_spec("stubborn", tmp_path, ignore_stop=True, ignore_term=True), time.monotonic())
    assert loop.pump_until(lambda: deaf.status is WorkerStatus.ACTIVE and stubborn.status is WorkerStatus.ACTIVE, 10)
    t0 = time.monotonic()
    loop.sup.stop_all(t0)
    assert loop.pump_until(lambda: len(loop.reaped) == 2, 8)
    took = time.monotonic() - t0
    by = {r.worker.instance: r for r in loop.reaped}
    assert by["deaf"].returncode == -signal.SIGTERM
    assert by["stubborn"].returncode == -signal.SIGKILL
    assert by["stubborn"].worker.term_sent_at is not None and by["stubborn"].worker.kill_sent_at is not None
    assert 1.4 <= took < 4.0  # the kill came at kill_after, not before, not much later
    assert not by["deaf"].crashed  # asked to stop: not a restart candidate
    loop.sup.close_warm()


def test_supervisor_kills_a_worker_that_stops_heartbeating(tmp_path: Path, fake_worker: List[str]) -> None:
    loop = Loop(command=fake_worker, heartbeat_timeout=2.0, unhealthy_after=0.5)
    w = loop.sup.start(make_spec("hung", tmp_path, no_heartbeat=True), time.monotonic())
    assert loop.pump_until(lambda: w.status is WorkerStatus.ACTIVE, 10)
    assert loop.sup.healthy(time.monotonic())
    # overdue: unhealthy (the systemd watchdog pauses) before it is declared hung and killed
    assert loop.pump_until(lambda: not loop.sup.healthy(time.monotonic()), 3)
    assert not loop.reaped and time.monotonic() - w.last_heartbeat < 2.0
    assert loop.pump_until(lambda: loop.reaped, 8)
    assert loop.reaped[0].returncode == -signal.SIGKILL
    assert "heartbeat" in (loop.reaped[0].worker.killed_for or "")
    assert loop.reaped[0].crashed and w.status is WorkerStatus.ACTIVE


def test_supervisor_counts_junk_on_stdout(tmp_path: Path) -> None:
    script = tmp_path / "junk.py"
    script.write_text("import sys\nsys.stdin.readline()\nprint('hello')\nprint('{\"event\": \"ready\"}', flush=True)\n"
                      "import time\ntime.sleep(30)\n")
    loop = Loop(command=[sys.executable, str(script)])
    w = loop.sup.start(make_spec("junk", tmp_path), time.monotonic())
    assert loop.pump_until(lambda: w.status is WorkerStatus.ACTIVE, 10)
    assert w.bad_lines == 1
    loop.sup.kill("junk", time.monotonic(), "test over")
    assert loop.pump_until(lambda: loop.reaped, 5)


# ---- the daemon on the real broker --------------------------------------------------------------


class AgentProc:
    def __init__(self, tmp_path: Path, broker: Any, node: str, fake_worker: List[str], slots: int = 2,
                 cluster: str = "t", shutdown_timeout: float = 3.0, env: Optional[Dict[str, str]] = None,
                 port: Optional[int] = None, extra_toml: str = "") -> None:
        self.node = node
        self.conf = tmp_path / f"{node}.toml"
        self.conf.write_text(
            f'[agent]\nnode = "{node}"\ncluster = "{cluster}"\nslots = {slots}\nstate_dir = "{tmp_path}/state-{node}"\n'
            f"state_period = 0.5\nheartbeat_period = 0.2\nshutdown_timeout = {shutdown_timeout}\n"
            f'[mqtt]\nhost = "{broker.host}"\nport = {port or broker.port}\n[metrics]\nport = 0\n' + extra_toml
        )
        self.log = open(tmp_path / f"{node}.log", "w")
        e = dict(os.environ)
        e["PYTHONPATH"] = str(ROOT)
        e.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "--config", str(self.conf),
             "--worker-command", json.dumps(fake_worker)],
            stdout=self.log, stderr=subprocess.STDOUT, env=e, cwd=str(ROOT),
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def wait_agents_up(agents: List[AgentProc], watcher: "Watcher") -> None:
    """Until every agent has published its retained state. Waits on that event, not on a fixed
    time: two agents starting at once took over 15 s at load ~20 (a python start and the
    imports, shared cores); fails at once when an agent process exits, and after 90 s (a hang)."""
    nodes = {a.node for a in agents}
    deadline = time.monotonic() + 90.0
    while not nodes <= set(watcher.snapshot("state")):
        dead = [(a.node, a.proc.returncode) for a in agents if a.proc.poll() is not None]
        assert not dead, f"agent exited before publishing its state: {dead}"
        assert time.monotonic() < deadline, f"no state from {sorted(nodes - set(watcher.snapshot('state')))} in 90 s"
        time.sleep(0.1)


class Watcher:
    """A test MQTT client collecting retained state/status and events."""

    def __init__(self, broker: Any, cluster: str = "t") -> None:
        self.client = RpcClient(broker.host, broker.port, cluster).connect()
        self.cluster = cluster

    def deployed(self, name: str, text: str) -> None:
        """The pipeline record an admin's deploy leaves: a peer spawn (a createNode placed on
        another node) is accepted for a deployed pipeline only (docs/security.md)."""
        from agent import topics

        self.client.publish(topics.pipeline(self.cluster, name), text.encode(), qos=1, retain=True)

    def snapshot(self, kind: str) -> Dict[str, Any]:
        from agent import topics

        f = topics.all_agents_state(self.cluster) if kind == "state" else topics.all_agents_status(self.cluster)
        raw = self.client.snapshot(f, settle=0.3)
        out = {}
        for topic, payload in raw.items():
            node = topics.parse(self.cluster, topic).node
            out[node] = json.loads(payload) if kind == "state" and payload else payload
        return out

    def close(self) -> None:
        self.client.close()


@pytest.mark.broker
def test_agent_status_state_spawn_and_clean_sigterm(tmp_path: Path, mosquitto: Any, fake_worker: List[str]) -> None:
    """Deploy keepers through two agents (retained state shows them); SIGTERM stops all in the bound."""
    from agent.node.deploy import deploy

    cluster = "t1"
    fake_log = tmp_path / "fake.log"
    agents = [AgentProc(tmp_path, mosquitto, n, fake_worker, slots=2, cluster=cluster) for n in ("n1", "n2")]
    watcher = Watcher(mosquitto, cluster)
    try:
        assert wait_until(lambda: watcher.snapshot("status") == {"n1": b"online", "n2": b"online"}, ONLINE_BOUND)
        extra = {"fake_log": str(fake_log), "fake": {}}
        placed = deploy(PIPELINE, mosquitto.host, mosquitto.port, cluster, extra=extra, timeout=15)
        assert [d.operator for d in placed] == ["source", "work", "sink"]
        assert len({d.node for d in placed}) == 2  # spread over both agents (3 keepers, 2 slots each)
        assert wait_until(lambda: sum(len(s["instances"]) for s in watcher.snapshot("state").values()) == 3, 5)
        # the snapshot is now exact (sync marker): wait for the state that carries the heartbeat loads
        assert wait_until(lambda: all(i.get("load") is not None for s in watcher.snapshot("state").values()
                                      for i in s["instances"]), 10)
        state = watcher.snapshot("state")
        assert sorted(s["free_slots"] for s in state.values()) == [0, 1]
        for d in placed:
            inst = [i for i in state[d.node]["instances"] if i["id"] == d.instance]
            assert len(inst) == 1 and inst[0]["keeper"] and inst[0]["operator"] == d.operator
            assert inst[0]["status"] == "active" and inst[0]["load"] == 1.5
        # the pipeline is published retained, and a second deploy is refused
        from agent import topics
        assert watcher.client.snapshot(topics.pipeline(cluster, "p"), settle=0.3)
        with pytest.raises(Exception, match="already deployed"):
            deploy(PIPELINE, mosquitto.host, mosquitto.port, cluster, extra=extra, timeout=15)
    finally:
        watcher.close()
        for a in agents:
            if a.proc.poll() is None:
                a.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        for a in agents:
            try:
                a.proc.wait(timeout=3.0 + 3.0 + 2.0)
            except subprocess.TimeoutExpired:
                pass
        took = time.monotonic() - t0
        codes = [a.proc.returncode for a in agents]
        for a in agents:
            a.stop()
    assert codes == [0, 0], codes
    assert took < 3.0 + 3.0  # shutdown_timeout + SHUTDOWN_SLACK
    pids = {e["pid"] for e in read_log(fake_log)}
    assert pids and not any(pid_alive(p) for p in pids)
    exits = [e for e in read_log(fake_log) if e["event"] == "exit"]
    # every worker got "stop" and drained (none needed a signal); the whole log says who did not
    assert len(exits) == len(pids), [(e["pid"], e["instance"], e["event"]) for e in read_log(fake_log)]


@pytest.mark.broker
def test_spawned_only_after_ready_local_then_remote(tmp_path: Path, mosquitto: Any, fake_worker: List[str]) -> None:
    cluster = "t2"
    fake_log = tmp_path / "fake.log"
    agents = [AgentProc(tmp_path, mosquitto, n, fake_worker, slots=2, cluster=cluster) for n in ("a1", "a2")]
    watcher = Watcher(mosquitto, cluster)
    try:
        wait_agents_up(agents, watcher)
        child = {"operator": "work", "extra": {"fake_log": str(fake_log), "fake": {"ready_delay": 0.6}}}
        spawner = {"instance": "p.work.0", "operator": "work", "pipeline": "p", "pipeline_toml": PIPELINE,
                   "extra": {"fake_log": str(fake_log),
                             "fake": {"spawn": [{"after": 0.1, "spec": child}] * 4}}}
        watcher.deployed("p", PIPELINE)  # its copies go to a2 too
        assert watcher.client.call("a1", {"op": "spawn", "spec": spawner}, timeout=10)["ok"]
        assert wait_until(lambda: sum(1 for e in read_log(fake_log) if e["event"] == "spawned") == 4, 20)
        events = read_log(fake_log)
        ready_at = {e["instance"]: e["t"] for e in events if e["event"] == "ready"}
        # in the order of the requests (r0..r3), not of the answers: each answer waits for its
        # worker's "ready", and a local worker can start slower than a remote one under load
        all_replies = sorted((e for e in events if e["event"] == "spawned"), key=lambda e: e["msg"]["request"])
        replies = [r for r in all_replies if r["msg"]["ok"]]
        refused = [r["msg"] for r in all_replies if not r["msg"]["ok"]]
        # 4 slots: the spawner and 3 children fit, the 4th child is refused with a reason
        assert len(replies) == 3 and len(refused) == 1 and "slot" in refused[0]["error"], all_replies
        answers = [r["msg"] for r in all_replies]
        assert refused[0]["request"] == "r3", answers
        nodes = [r["msg"]["node"] for r in replies]
        assert nodes == ["a1", "a2", "a2"], answers  # the local slot to the first request, then remote
        for r in replies:
            new = r["msg"]["instance"]
            assert new in ready_at, f"{new} announced but never ready"
            assert r["t"] >= ready_at[new], "spawned sent before the new instance subscribed (invariant 2)"
        # the child inherits the requester's pipeline and gets the placing agent's node
        starts = {e["instance"]: e["spec"] for e in events if e["event"] == "started"}
        for r in replies:
            s = starts[r["msg"]["instance"]]
            assert s["node"] == r["msg"]["node"] and s["pipeline"] == "p" and not s["keeper"]
    finally:
        watcher.close()
        for a in agents:
            a.proc.send_signal(signal.SIGTERM)
        for a in agents:
            a.proc.wait(timeout=10)
            a.stop()
    pids = {e["pid"] for e in read_log(fake_log)}
    assert len(pids) == 4 and not any(pid_alive(p) for p in pids)


@pytest.mark.broker
def test_sigkilled_agent_leaves_offline_will_and_no_orphans(tmp_path: Path, mosquitto: Any, fake_worker: List[str]) -> None:
    cluster = "t3"
    fake_log = tmp_path / "fake.log"
    agent = AgentProc(tmp_path, mosquitto, "k1", fake_worker, slots=2, cluster=cluster)
    watcher = Watcher(mosquitto, cluster)
    try:
        assert wait_until(lambda: watcher.snapshot("status").get("k1") == b"online", ONLINE_BOUND)
        spec = {"instance": "p.work.0", "operator": "work", "pipeline": "p", "pipeline_toml": PIPELINE,
                "extra": {"fake_log": str(fake_log), "fake": {}}}
        assert watcher.client.call("k1", {"op": "spawn", "spec": spec}, timeout=10)["ok"]
        pids = {e["pid"] for e in read_log(fake_log)}
        assert len(pids) == 1
        agent.proc.kill()
        agent.proc.wait()
        # keepalive 10 s: the broker publishes the Will within 1.5 keepalives
        assert wait_until(lambda: watcher.snapshot("status").get("k1") == b"offline", 20)
        assert wait_until(lambda: not any(pid_alive(p) for p in pids), 5), "worker outlived its agent"
    finally:
        watcher.close()
        agent.stop()


@pytest.mark.broker
def test_sd_notify_ready_and_watchdog(tmp_path: Path, mosquitto: Any, fake_worker: List[str]) -> None:
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(0.5)
    agent = AgentProc(tmp_path, mosquitto, "s1", fake_worker, cluster="t4",
                      env={"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "1000000"})
    got: List[str] = []
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not (any("READY=1" in g for g in got) and
                                                  sum("WATCHDOG=1" in g for g in got) >= 2):
            try:
                got.append(sock.recv(4096).decode())
            except socket.timeout:
                pass
        assert any("READY=1" in g for g in got), got
        assert sum("WATCHDOG=1" in g for g in got) >= 2, got
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.proc.wait(timeout=8) == 0
        try:
            while True:
                got.append(sock.recv(4096).decode())
        except socket.timeout:
            pass
        assert any("STOPPING=1" in g for g in got), got
    finally:
        sock.close()
        agent.stop()


@pytest.mark.broker
def test_placement_prefers_the_lower_latency_node_once_measured(tmp_path: Path, mosquitto: Any, fake_worker: List[str]) -> None:
    """b1 is full; b3 has more free slots but sits behind an 80 ms link: the new sibling of an
    instance on b1 goes to b2 (measured RTT to b1 is lower), not to the roomier b3."""
    from agent import topics
    from foglab.tools.delayproxy import DelayProxy

    cluster = "t5"
    fake_log = tmp_path / "fake.log"
    proxy = DelayProxy((mosquitto.host, mosquitto.port), rtt_ms=80).start()
    lat = "[latency]\nperiod = 0.5\n"
    agents = [AgentProc(tmp_path, mosquitto, "b1", fake_worker, slots=1, cluster=cluster, extra_toml=lat),
              AgentProc(tmp_path, mosquitto, "b2", fake_worker, slots=1, cluster=cluster, extra_toml=lat),
              AgentProc(tmp_path, mosquitto, "b3", fake_worker, slots=3, cluster=cluster, extra_toml=lat,
                        port=proxy.port)]
    watcher = Watcher(mosquitto, cluster)

    def rows() -> Dict[str, Dict[str, float]]:
        raw = watcher.client.snapshot(topics.all_latency(cluster), settle=0.2)
        return {topics.parse(cluster, t).node: json.loads(p).get("rtt_ms", {}) for t, p in raw.items() if p}

    try:
        def measured() -> bool:
            r = rows()
            return (r.get("b1", {}).get("b3", 0) > 60 and 0 < r.get("b1", {}).get("b2", 999) < 40
                    and 0 < r.get("b2", {}).get("b1", 999) < 40 and r.get("b3", {}).get("b1", 0) > 60)
        assert wait_until(measured, 20), rows()
        child = {"operator": "work", "preds": ["p.work.0"], "extra": {"fake_log": str(fake_log), "fake": {}}}
        spawner = {"instance": "p.work.0", "operator": "work", "pipeline": "p", "pipeline_toml": PIPELINE,
                   "extra": {"fake_log": str(fake_log), "fake": {"spawn": [{"after": 0.5, "spec": child}]}}}
        watcher.deployed("p", PIPELINE)  # its copy goes to another node
        assert watcher.client.call("b1", {"op": "spawn", "spec": spawner}, timeout=10)["ok"]
        assert wait_until(lambda: any(e["event"] == "spawned" for e in read_log(fake_log)), 20)
        reply = next(e["msg"] for e in read_log(fake_log) if e["event"] == "spawned")
        assert reply["ok"] and reply["node"] == "b2", reply
    finally:
        watcher.close()
        for a in agents:
            a.proc.send_signal(signal.SIGTERM)
        for a in agents:
            a.proc.wait(timeout=10)
            a.stop()
        proxy.stop()


def test_keeper_specs_chain_the_pipeline_and_are_keepers() -> None:
    from agent.config import load_pipeline_text
    from agent.node.deploy import keeper_specs

    specs = keeper_specs(load_pipeline_text(PIPELINE), PIPELINE, "c", BrokerSpec("h", 1), {"sink_dir": "/x"})
    assert [s.instance for s in specs] == ["p.source.0", "p.work.0", "p.sink.0"]
    assert [s.succs for s in specs] == [("p.work.0",), ("p.sink.0",), ()]
    assert [s.preds for s in specs] == [(), ("p.source.0",), ("p.work.0",)]
    assert all(s.keeper and s.active and s.extra == {"sink_dir": "/x"} and s.pipeline_toml == PIPELINE for s in specs)


def test_a_request_cannot_override_node_local_fields(tmp_path: Path) -> None:
    """A spawn request from another node names the instance and its routes; the broker, node,
    state_dir and heartbeat are always the hosting agent's own."""
    from agent.config import load_agent_config
    from agent.node.daemon import Agent

    conf = tmp_path / "a.toml"
    conf.write_text(f'[agent]\nnode = "me"\ncluster = "c"\nstate_dir = "{tmp_path}"\nheartbeat_period = 0.3\n'
                    '[mqtt]\nhost = "10.0.0.1"\nport = 1884\n')
    agent = Agent(load_agent_config(conf))
    hostile = {"instance": "p.work.7", "operator": "work", "pipeline": "p", "pipeline_toml": PIPELINE,
               "node": "elsewhere", "cluster": "other", "state_dir": "/etc", "heartbeat_period": 99.0,
               "broker": {"host": "evil", "port": 1}, "succs": ["p.sink.0"], "keeper": True}
    spec = agent.core.gate.spec_from(agent.wall(), hostile, template=None)
    assert (spec.node, spec.cluster, spec.state_dir, spec.heartbeat_period) == ("me", "c", str(tmp_path), 0.3)
    assert (spec.broker.host, spec.broker.port) == ("10.0.0.1", 1884)
    assert spec.instance == "p.work.7" and spec.succs == ("p.sink.0",)
    # a worker's request without an id gets a fresh one, never its requester's identity
    template = agent.core.gate.spec_from(agent.wall(), hostile, template=None)
    child = agent.core.gate.spec_from(agent.wall(), {"operator": "work"}, template=template)
    assert child.instance != template.instance and not child.keeper and child.pipeline == "p"
    for bad in ({"operator": "work", "instance": "a/b"}, {"instance": "x"}):
        with pytest.raises(ValueError):
            agent.core.gate.spec_from(agent.wall(), bad, template=None)


HANDOVER_PIPELINE = with_work("agent.operators.builtin:in_zone")


def test_a_handed_over_keeper_keeps_its_identity_state_and_a_higher_epoch(tmp_path: Path) -> None:
    """The drain hand-over (`HandOvers.start`): the spawn rpc that carries a migrating keeper
    keeps `restart`, `keeper` and the shipped state; the worker on the new node restores that
    state (epoch + 1) unless a newer incarnation's file is already there; copies and the hosted
    record never inherit the shipped state. No broker needed: the worker is only constructed."""
    from agent.config import load_agent_config
    from agent.node.daemon import Agent
    from agent.node.gate import without_handover
    from agent.instance.spec import request_spec
    from agent.instance.shell import Worker
    from memory_wire import MemoryWire

    conf = tmp_path / "a.toml"
    conf.write_text(f'[agent]\nnode = "me"\ncluster = "c"\nstate_dir = "{tmp_path}/state"\n'
                    f'sink_dirs = ["{tmp_path}/sink"]\n'
                    '[mqtt]\nhost = "127.0.0.1"\nport = 1\npassword = "secret"\nusername = "u"\n')
    agent = Agent(load_agent_config(conf))
    shipped = {"epoch": 4, "inbound": {}}
    old = InstanceSpec("p.work.0", "work", "gone", "c", "p", HANDOVER_PIPELINE, BrokerSpec("h", 1, password="pw"),
                       succs=("p.sink.0",), preds=("p.source.0",), keeper=True, restart=True,
                       extra={"sink_dir": str(tmp_path / "sink"), "handover_state": shipped})
    body = request_spec(old)
    assert "broker" not in body and "pw" not in json.dumps(body)  # no broker password travels
    spec = agent.core.gate.spec_from(agent.wall(), body, template=None)
    assert (spec.instance, spec.keeper, spec.restart, spec.node) == ("p.work.0", True, True, "me")
    assert spec.extra["handover_state"] == shipped
    child = agent.core.gate.spec_from(agent.wall(), {"operator": "work"}, template=spec)
    assert "handover_state" not in child.extra and not child.restart and not child.keeper
    assert "handover_state" not in without_handover(spec).extra and without_handover(spec).extra["sink_dir"]

    state = Path(spec.state_dir) / "p.work.0.state.json"
    found = []

    def epoch(s: InstanceSpec) -> int:
        w = Worker(s, out=open(os.devnull, "w"), transport=MemoryWire())  # type: ignore[arg-type]
        found.append(json.loads(state.read_text())["epoch"])  # what the worker will restore
        w.start()  # the epoch is taken at start, from the state the worker found
        os.close(w._identity_lock)  # the next construction takes the identity's lock again
        return w.core.epoch

    assert not state.exists()
    assert epoch(spec) == 5  # the shipped state's epoch + 1
    assert found[-1] == 4  # written to our state dir, then loaded
    state.write_text(json.dumps({"epoch": 9, "inbound": {}}))  # a later incarnation here wins
    assert epoch(spec) == 10
    state.write_text(json.dumps({"epoch": 1, "inbound": {}}))  # an older leftover does not
    assert epoch(spec) == 5
    big = dict(spec.extra, min_epoch=1_800_000_000)  # a re-home's floor still holds
    assert epoch(dataclasses.replace(spec, extra=big)) == 1_800_000_000


class _FakeProc:
    """A worker process that never exits and records the signals sent to it."""
    pid = 999_999

    def __init__(self) -> None:
        self.signals: List[int] = []

    def poll(self) -> Optional[int]:
        return None

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)


def test_fencing_spares_an_instance_placed_here_since_the_connect_and_never_restarts_a_fenced_one(
        tmp_path: Path) -> None:
    """An agent that has just connected receives a keeper handed over from a draining node while
    that node's retained state still lists it. Were the first reconcile to kill it as "re-homed
    elsewhere" and then restart it as crashed, while the draining node placed it on a third node,
    one identity would run in two processes. Fencing is for workers that ran while this node was
    away (started before the connect), and a fenced worker is gone from here for good."""
    import signal as _signal

    from agent.config import load_agent_config
    from agent.node.daemon import Agent
    from agent.node.workers import Reaped, Worker

    conf = tmp_path / "a.toml"
    conf.write_text(f'[agent]\nnode = "me"\ncluster = "c"\nstate_dir = "{tmp_path}"\n[mqtt]\nhost = "h"\nport = 1\n')
    agent = Agent(load_agent_config(conf), warm_worker=False)
    started: List[str] = []
    agent.supervisor.start = lambda spec, now: started.append(spec.instance)  # type: ignore[assignment]

    def worker(inst: str, at: float) -> Worker:
        spec = InstanceSpec(inst, "work", "me", "c", "p", PIPELINE, BrokerSpec("h", 1), keeper=True)
        w = Worker(spec=spec, proc=_FakeProc(), started_at=at)  # type: ignore[arg-type]
        agent.supervisor.workers[inst] = w
        return w

    old, new = worker("p.work.0", 5.0), worker("p.sink.0", 15.0)
    agent.core.fencing.connected_at, agent.core.fencing.readopted = 10.0, True
    agent.core.view.online = {"n2": True}
    agent.core.view.fleet = {"n2": {"instances": [{"id": "p.work.0"}, {"id": "p.sink.0"}]}}  # n2 lists both
    agent.core.reconciler.reconcile(20.0, agent.wall())
    assert old.proc.signals == [_signal.SIGKILL] and old.killed_for == "re-homed elsewhere"
    assert new.proc.signals == [] and new.killed_for is None  # placed here after the connect
    del agent.supervisor.workers["p.work.0"]  # what poll() does when it reaps it
    agent.core._on_reaped(Reaped(old, -9), 21.0)
    assert started == [] and agent.core.counters["restarts"] == 0  # fenced: not restarted as a crash


def test_when_two_nodes_fence_at_once_the_copy_of_the_latest_rehome_stays(tmp_path: Path) -> None:
    """Two copies of one identity run on n1 and n2 (two placements of one re-home); a broker kill
    makes both agents reconnect, each sees the other list the instance, and were each to stop its
    own, the identity would run nowhere (CHANGELOG.md, "Two nodes ran, then both fenced, one
    copy"). The copy whose spec carries the epoch floor
    of the latest re-home (the re-homing agent's retained record, one clock) stays on both
    sides' reading; the other stands down. Without a re-home record, fencing is as before."""
    from agent.config import load_agent_config
    from agent.node.daemon import Agent
    from agent.node.workers import Worker

    def agent_running(node: str, floors: Dict[str, Optional[int]]) -> Any:
        conf = tmp_path / f"{node}.toml"
        conf.write_text(f'[agent]\nnode = "{node}"\ncluster = "c"\nstate_dir = "{tmp_path}/{node}"\n'
                        '[mqtt]\nhost = "h"\nport = 1\n')
        agent = Agent(load_agent_config(conf), warm_worker=False)
        for inst, floor in floors.items():
            extra = {} if floor is None else {"min_epoch": floor}
            spec = InstanceSpec(inst, "work", node, "c", "p", PIPELINE, BrokerSpec("h", 1), extra=extra)
            agent.supervisor.workers[inst] = Worker(spec=spec, proc=_FakeProc(), started_at=5.0)  # type: ignore[arg-type]
        other = "n2" if node == "n1" else "n1"
        agent.core.fencing.connected_at, agent.core.fencing.readopted = 10.0, True
        agent.core.view.online = {other: True, "n3": True}
        agent.core.view.fleet = {other: {"instances": [{"id": i} for i in floors]}}
        # n3 re-homed both: work-a twice (the second placement at 1000), work-b once (at 990)
        agent.core.view.rehomed_by_node = {"n3": {"work-a": 1000.4, "work-b": 990.7}}
        return agent

    n1 = agent_running("n1", {"work-a": 1000, "work-b": 990, "work-c": None})
    n2 = agent_running("n2", {"work-a": 995, "work-b": 900, "work-c": None})
    n1.core.reconciler.reconcile(20.0, n1.wall())
    n2.core.reconciler.reconcile(20.0, n2.wall())
    stopped = {(a.node, i) for a in (n1, n2) for i, w in a.supervisor.workers.items() if w.proc.signals}
    assert stopped == {("n2", "work-a"), ("n2", "work-b"), ("n1", "work-c"), ("n2", "work-c")}


def test_a_keeper_stopped_for_a_drain_moves_with_its_state_or_restarts_here(tmp_path: Path) -> None:
    """The sending half of the drain hand-over (`_on_reaped` -> `HandOvers.start`): the keeper's spec
    goes to createNode() with restart = true, the keeper flag and the state file it wrote; a
    ready reply from another node makes this node forget it (hosted spec and state file); when
    no node can take it (here: the draining node is the only one), it restarts HERE with the
    same identity and its local state, so nothing stalls."""
    from agent.config import load_agent_config
    from agent.node import hosted
    from agent.node.daemon import Agent
    from agent.node.workers import Reaped, Worker

    conf = tmp_path / "a.toml"
    conf.write_text(f'[agent]\nnode = "me"\ncluster = "c"\nstate_dir = "{tmp_path}/state"\n[mqtt]\nhost = "h"\nport = 1\n')
    agent = Agent(load_agent_config(conf), warm_worker=False)
    started: List[InstanceSpec] = []
    agent.supervisor.start = lambda spec, now: started.append(spec)  # type: ignore[assignment]
    agent.core.drain.draining = True
    state_dir = tmp_path / "state"
    spec = InstanceSpec("p.work.0", "work", "me", "c", "p", PIPELINE, BrokerSpec("h", 1), keeper=True,
                        state_dir=str(state_dir), extra={"sink_dir": str(tmp_path / "sink")})

    def stopped_keeper() -> Worker:
        hosted.remember(state_dir, spec)
        (state_dir / "p.work.0.state.json").write_text(json.dumps({"epoch": 3, "inbound": {}}))
        proc = subprocess.Popen([sys.executable, "-c", "pass"])  # an exited worker process
        proc.wait()
        w = Worker(spec=spec, proc=proc, started_at=1.0, stop_sent_at=2.0,
                   exit_event={"event": "exit", "code": 0, "final": False})
        agent.core.drain.handing_over.add("p.work.0")
        return w

    asked: List[Any] = []
    real_create = agent.core.creating.create
    agent.core.creating.create = lambda s, reply, cause, now, **kw: asked.append((s, reply, cause))  # type: ignore[assignment]
    agent.core._on_reaped(Reaped(stopped_keeper(), 0), 3.0)
    [(moved, reply, cause)] = asked
    assert cause == "handover" and moved.instance == "p.work.0" and moved.restart and moved.keeper
    assert moved.extra["handover_state"] == {"epoch": 3, "inbound": {}} and "min_epoch" not in moved.extra
    reply({"ok": True, "instance": "p.work.0", "node": "n3"})
    assert not (state_dir / "p.work.0.state.json").exists() and hosted.hosted(state_dir) == []
    assert started == []

    agent.core.creating.create = real_create  # type: ignore[assignment]
    agent.core._on_reaped(Reaped(stopped_keeper(), 0), 4.0)  # no other node: placement has nowhere to go
    [again] = started
    assert again.instance == "p.work.0" and again.restart and again.keeper and "handover_state" not in again.extra
    assert (state_dir / "p.work.0.state.json").exists() and [s.instance for s in hosted.hosted(state_dir)] == ["p.work.0"]


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def served_loop(**kw: Any) -> Loop:
    """A supervisor whose fork server has done its imports (it says "ready" first)."""
    loop = Loop(warm=True, **kw)
    loop.sup.prewarm(time.monotonic())
    assert loop.sup.warm_pid is not None and pid_alive(loop.sup.warm_pid)
    assert loop.pump_until(lambda: loop.sup.warm_ready, 15)
    return loop


def test_every_start_of_a_burst_is_forked_from_the_one_pre_imported_server(tmp_path: Path,
                                                                             fake_worker: List[str]) -> None:
    # The demo's slow spawns: a round of three copies took the one pre-started spare, and the
    # other two got processes that had only begun their imports (8-16 s at load 15-20). Now
    # every start of the burst is a fork of the server, which stays for the next one.
    loop = served_loop(command=fake_worker)
    server = loop.sup.warm_pid
    burst = [loop.sup.start(make_spec(f"w{i}", tmp_path), time.monotonic()) for i in range(3)]
    assert [parent_pid(w.pid) for w in burst] == [server] * 3
    assert all(w.warm_age is not None for w in burst)  # the "spawned" event says warm
    assert loop.sup.warm_pid == server and loop.sup.warm_used == 3  # never consumed
    assert loop.pump_until(lambda: all(w.status is WorkerStatus.ACTIVE for w in burst), 10)
    # The exit statuses come through the server (it reaps its children): a drained worker's 0,
    # a killed one's -SIGKILL, as Popen's returncode.
    loop.sup.stop("w0", time.monotonic())
    loop.sup.kill("w1", time.monotonic(), "test")
    assert loop.pump_until(lambda: len(loop.reaped) == 2, 10)
    by = {r.worker.instance: r for r in loop.reaped}
    assert by["w0"].returncode == 0 and by["w0"].clean
    assert by["w1"].returncode == -signal.SIGKILL and by["w1"].crashed
    assert not pid_alive(by["w0"].worker.pid) and not pid_alive(by["w1"].worker.pid)
    # Shutdown: no more forks, but the server stays while a worker it forked drains (it reports
    # that worker's exit), and goes with the last one.
    loop.sup.close_warm()
    cold = loop.sup.start(make_spec("w3", tmp_path), time.monotonic())
    assert cold.warm_age is None and parent_pid(cold.pid) == os.getpid()
    loop.pump(0.3)
    assert pid_alive(server)
    loop.sup.stop_all(time.monotonic())
    assert loop.pump_until(lambda: len(loop.reaped) == 4, 10) and all(r.clean for r in loop.reaped[2:])
    assert wait_until(lambda: not pid_alive(server), 5) and loop.sup.warm_pid is None
    loop.sup.poll(time.monotonic())
    assert loop.sup.warm_pid is None  # not restarted after close_warm (shutdown)


def test_a_start_never_waits_for_the_servers_imports(tmp_path: Path, fake_worker: List[str]) -> None:
    loop = Loop(command=fake_worker, warm=True)
    loop.sup.prewarm(time.monotonic())
    early = loop.sup.start(make_spec("early", tmp_path), time.monotonic())  # the server is still starting
    assert early.warm_age is None and parent_pid(early.pid) == os.getpid()  # a cold start, at once
    assert loop.pump_until(lambda: loop.sup.warm_ready and early.status is WorkerStatus.ACTIVE, 15)
    later = loop.sup.start(make_spec("later", tmp_path), time.monotonic())
    assert parent_pid(later.pid) == loop.sup.warm_pid
    loop.sup.stop_all(time.monotonic())
    assert loop.pump_until(lambda: len(loop.reaped) == 2, 10) and all(r.clean for r in loop.reaped)
    loop.sup.close_warm()


def test_workers_outlive_a_killed_fork_server_and_still_exit_with_their_own_code(tmp_path: Path,
                                                                                 fake_worker: List[str]) -> None:
    loop = served_loop(command=fake_worker)
    server = loop.sup.warm_pid
    w = loop.sup.start(make_spec("w1", tmp_path), time.monotonic())
    assert loop.pump_until(lambda: w.status is WorkerStatus.ACTIVE, 10)
    os.kill(server, signal.SIGKILL)
    assert loop.pump_until(lambda: loop.sup.warm_pid != server, 5)  # dropped (a new one after 5 s)
    loop.pump(0.5)
    assert pid_alive(w.pid) and not loop.reaped and w.stats.get("hb")  # it runs on, supervised
    loop.sup.stop("w1", time.monotonic())
    assert loop.pump_until(lambda: loop.reaped, 10)
    assert loop.reaped[0].returncode == 0 and loop.reaped[0].clean  # its "exit" line's code
    loop.sup.close_warm()


def test_a_spawn_whose_worker_never_became_ready_is_not_restarted_here(tmp_path: Path) -> None:
    """docs/design.md invariant 7. On a loaded node a keeper's worker was killed as "not ready
    20 s after start"; the spawn was answered as failed and the deployer placed the keeper on
    another node, while this node restarted its own incarnation as a crash: one identity on two
    nodes, whose clients took the session from each other for the rest of the run (seen in a
    chaos run). The failed incarnation is forgotten here and the spawn goes on elsewhere, and so
    is its binding to this node, made while it started (agent.node.hostmap, `forget`): kept, the
    next node's listing bound it there unproven, and our workers refused its first epoch."""
    from agent.config import load_agent_config
    from agent.node import hosted
    from agent.node import spawns
    from agent.node.daemon import Agent
    from agent.node.workers import Reaped, Worker

    conf = tmp_path / "a.toml"
    conf.write_text(f'[agent]\nnode = "me"\ncluster = "c"\nstate_dir = "{tmp_path}"\n[mqtt]\nhost = "h"\nport = 1\n')
    agent = Agent(load_agent_config(conf), warm_worker=False)
    started: List[str] = []
    agent.supervisor.start = lambda spec, now: started.append(spec.instance)  # type: ignore[assignment]
    spec = InstanceSpec("p.work.0", "work", "me", "c", "p", PIPELINE, BrokerSpec("h", 1), keeper=True)
    hosted.remember(tmp_path, spec)
    replies: List[Dict[str, Any]] = []
    (start,) = agent.core.spawns.handle(spawns.SpawnRequest(spec, replies.append, "deploy", "adm"), 1.0)
    assert agent.core.spawns.handle(spawns.LocalStart(start.job, None), 1.0) == []  # started, not ready yet

    class Proc:
        pid = 999_998

        def poll(self) -> Optional[int]:
            return -9

    w = Worker(spec=spec, proc=Proc(), started_at=1.0)  # type: ignore[arg-type]
    agent.core.hosts.sync({spec.instance: ("p", Proc.pid)}, {}, {}, {}, {})  # starting here: bound here
    assert agent.core.hosts.hostmap.bound(spec.instance) == "me"
    w.killed_for = "not ready 20.0s after start"
    agent.core._on_reaped(Reaped(w, -9), 25.0)
    assert replies and replies[0]["ok"] is False and "exited before ready" in replies[0]["error"]
    assert started == [] and agent.core.counters["restarts"] == 0 and not agent.core.restarts.delayed
    assert spec.instance not in {s.instance for s in hosted.hosted(tmp_path)}
    assert agent.core.hosts.hostmap.bound(spec.instance) is None


@pytest.mark.broker
def test_a_worker_that_announced_its_final_exit_and_needed_sigterm_left_by_scale_in(tmp_path: Path) -> None:
    """A copy that drained, had its departure acked and said so in its "exit" line, then hung in
    its disconnect (the broker away) until the supervisor's SIGTERM, left by scale-in: its
    "terminated" event says so (with the signal's code) and it is not restarted. A worker that
    died without a word is a crash and is restarted."""
    import signal as _signal

    from agent.config import load_agent_config
    from agent.node.daemon import Agent
    from agent.node.workers import Reaped, Worker

    conf = tmp_path / "a.toml"
    conf.write_text(f'[agent]\nnode = "me"\ncluster = "c"\nstate_dir = "{tmp_path}"\n[mqtt]\nhost = "h"\nport = 1\n')
    agent = Agent(load_agent_config(conf), warm_worker=False)
    started: List[str] = []
    agent.supervisor.start = lambda spec, now: started.append(spec.instance)  # type: ignore[assignment]
    seen: List[Any] = []
    agent.core._event = lambda etype, instance, *a, **detail: seen.append((etype, instance, detail))  # type: ignore[assignment]

    def worker(inst: str) -> Worker:
        spec = InstanceSpec(inst, "work", "me", "c", "p", PIPELINE, BrokerSpec("h", 1), keeper=False)
        return Worker(spec=spec, proc=_FakeProc(), started_at=1.0)  # type: ignore[arg-type]

    left, died = worker("work-me-1"), worker("work-me-2")
    left.exit_event, left.stop_sent_at = {"event": "exit", "final": True, "code": 0}, 5.0
    agent.core._on_reaped(Reaped(left, -_signal.SIGTERM), 10.0)
    agent.core._on_reaped(Reaped(died, -9), 11.0)
    causes = {inst: d["cause"] for etype, inst, d in seen if etype == "terminated"}
    assert causes == {"work-me-1": "scale_in", "work-me-2": "crash"}, seen
    assert started == ["work-me-2"]  # only the crashed one comes back


def test_bench_spawn_starts_every_worker_of_a_burst_forked_then_cold(tmp_path: Path) -> None:
    """`fog-agent bench spawn`'s figures are per start, for each mode (no timing is asserted:
    the numbers are the benchmark's, docs/runtime.md "Pre-started workers")."""
    from foglab.tools.demo import bench_spawn

    out = bench_spawn(burst=2, rounds=1, workdir=tmp_path)
    for mode in ("forked", "cold"):
        r = out[mode]
        assert r["start_to_ready_s"]["n"] == 2 and len(r["each"]) == 2 and all(v > 0 for v in r["each"])
    assert out["forked"]["forked_starts"] == 2 and out["cold"]["forked_starts"] == 0  # what each mode measured
    assert set(out["cold_over_forked"]) == {"median", "max"}
