"""Security with real processes: a private Mosquitto with the TLS listener and the ACL that the
Ansible role `mosquitto` ships (both rendered from ansible/roles/mosquitto/templates with the
role's defaults; only paths, port, cluster and the admin user are set), client certificates whose
CN is the node name (`require_certificate` + `use_identity_as_username`, no anonymous access).

What it shows:
- real agents (`python -m agent run`) with their node certificate connect and publish their
  retained status and state; their workers (same certificate) run a deployed pipeline; latency
  probes between the two agents get through; fogctl with the admin certificate reads and steers;
- with node n1's certificate (MQTT 5, QoS 1): its own and the shared topics are accepted, n2's
  topics are refused with PUBACK reason code 135 and never reach a subscriber, a retained forgery
  does not replace n2's status, n2's rpc topic cannot be subscribed to, and claiming another user
  name changes nothing (the certificate's CN is the identity);
- a client without a certificate, with a certificate of a foreign CA, or without TLS is refused;
- TLS mistakes in the agent's own configuration are one line, never a traceback.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import jinja2
import paho.mqtt.client as mqtt
import pytest
import yaml
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent import topics
from agent.cli.fogctl import main as fogctl_main
from agent.runtime.broker import MOSQUITTO, free_port, wait_port
from tls_certs import OPENSSL, make_ca, make_cert

from pipelines import taxi_in_zone  # noqa: E402

pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parent.parent
ROLE = ROOT / "ansible/roles/mosquitto"
CLUSTER = "sec"
ADMIN = "admin"
NOT_AUTHORIZED = 135  # MQTT 5 reason code
OK_CODES = (0, 16)  # success, no matching subscribers

PIPELINE = taxi_in_zone("taxi", seed=1, rate=50.0)


# ---- the broker the role ships, rendered ---------------------------------------------------------


def render_role(prefix: Path, port: int) -> Dict[str, Any]:
    """Render mosquitto.conf and fog.acl from the role's templates with its defaults.

    Ansible's own filters used by these templates (`bool`, `ternary`) are given their documented
    meaning; defaults that refer to other defaults are resolved like Ansible does, lazily.
    """
    v = yaml.safe_load((ROLE / "defaults/main.yml").read_text())
    v.update(
        inventory_hostname="broker",
        mosquitto_prefix=str(prefix),
        mosquitto_user=getpass.getuser(),  # root here: do not drop to a user who cannot read tmp
        mosquitto_listener_enabled=False,  # TLS only
        mosquitto_tls_enabled=True,
        mosquitto_tls_address="127.0.0.1",
        mosquitto_tls_port=port,
        mosquitto_cluster=CLUSTER,
        mosquitto_admin_users=[ADMIN],
        mosquitto_persistence=False,
    )
    env = jinja2.Environment(trim_blocks=True, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["bool"] = lambda x: x if isinstance(x, bool) else str(x).lower() in ("true", "yes", "on", "1")
    env.filters["ternary"] = lambda cond, yes, no: yes if cond else no
    for _ in range(5):
        v = {k: env.from_string(x).render(v) if isinstance(x, str) and "{{" in x else x for k, x in v.items()}
    conf_dir = Path(v["mosquitto_config_dir"])
    (conf_dir / "certs").mkdir(parents=True, exist_ok=True)
    Path(v["mosquitto_log_dest"].split(" ", 1)[1]).parent.mkdir(parents=True, exist_ok=True)
    for name in ("mosquitto.conf", "fog.acl"):
        text = env.from_string((ROLE / "templates" / f"{name}.j2").read_text()).render(v)
        (conf_dir / name).write_text(text)
    return v


@dataclass
class Site:
    port: int
    certs: Path
    conf: Path
    acl: Path
    log: Path
    tmp: Path

    def tls(self, name: str, ca: str = "fog") -> Dict[str, str]:
        """ca/cert/key paths of a client certificate made by `site` (`name` = its file stem)."""
        return {"ca_certs": str(self.certs / "fog-ca.crt"), "certfile": str(self.certs / f"{name}.crt"),
                "keyfile": str(self.certs / f"{name}.key")}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    if not OPENSSL or not os.path.exists(MOSQUITTO):
        pytest.skip("openssl or mosquitto missing")
    tmp = tmp_path_factory.mktemp("sec")
    certs = tmp / "certs"
    certs.mkdir()
    make_ca(certs, "fog")
    make_ca(certs, "foreign")
    make_cert(certs, "fog", "localhost", server=True, stem="server")
    for cn in ("n1", "n2", ADMIN):
        make_cert(certs, "fog", cn, stem=cn)
    make_cert(certs, "foreign", "n1", stem="foreign-n1")  # the right name, the wrong CA
    port = free_port()
    v = render_role(tmp / "root", port)
    conf_dir = Path(v["mosquitto_config_dir"])
    for src, dst in (("fog-ca.crt", "ca.crt"), ("server.crt", "server.crt"), ("server.key", "server.key")):
        shutil.copy(certs / src, conf_dir / "certs" / dst)
    log = Path(v["mosquitto_log_dest"].split(" ", 1)[1])
    proc = subprocess.Popen([MOSQUITTO, "-c", str(conf_dir / "mosquitto.conf")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        wait_port("127.0.0.1", port)
    except TimeoutError:
        proc.kill()
        pytest.fail("mosquitto did not start with the rendered config: "
                    + (proc.stderr.read().decode() if proc.stderr else "") + (log.read_text() if log.exists() else ""))
    try:
        yield Site(port, certs, conf_dir / "mosquitto.conf", conf_dir / "fog.acl", log, tmp)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- real agents -----------------------------------------------------------------------------------


def agent_toml(site: Site, node: str, cert: str, extra: str = "") -> Path:
    conf = site.tmp / f"{node}-{cert}-{uuid.uuid4().hex[:6]}.toml"
    conf.write_text(
        f'[agent]\nnode = "{node}"\ncluster = "{CLUSTER}"\nslots = 3\nstate_dir = "{site.tmp}/state-{node}"\n'
        "state_period = 0.5\nheartbeat_period = 0.2\nshutdown_timeout = 3.0\n"
        f'[mqtt]\nhost = "127.0.0.1"\nport = {site.port}\nkeepalive = 5\n'
        f'[mqtt.tls]\nca_file = "{site.certs}/fog-ca.crt"\ncert_file = "{site.certs}/{cert}.crt"\n'
        f'key_file = "{site.certs}/{cert}.key"\n{extra}'
        "[metrics]\nport = 0\n[latency]\nperiod = 0.5\n"
    )
    return conf


class AgentProc:
    def __init__(self, site: Site, node: str, cert: Optional[str] = None, conf: Optional[Path] = None) -> None:
        self.node = node
        self.conf = conf or agent_toml(site, node, cert or node)
        self.log_path = site.tmp / f"{self.conf.stem}.log"
        self.log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, "-m", "agent", "run", "--config", str(self.conf)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))

    def text(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return int(self.proc.returncode)


@pytest.fixture(scope="module")
def agents(site: Site) -> Iterator[Dict[str, AgentProc]]:
    procs = {n: AgentProc(site, n) for n in ("n1", "n2")}
    try:
        yield procs
    finally:
        for p in procs.values():
            p.stop()


# ---- MQTT 5 test clients ---------------------------------------------------------------------------


class Client:
    """A paho MQTT 5 client over TLS that records messages, PUBACK and SUBACK reason codes."""

    def __init__(self, site: Site, cert: Optional[str], ca: str = "fog", username: Optional[str] = None,
                 tls: bool = True, client_id: Optional[str] = None) -> None:
        self.client_id = client_id or f"test-{cert}-{uuid.uuid4().hex[:8]}"
        self.received: List[Tuple[str, bytes, bool, Any]] = []
        self.pubacks: Dict[int, int] = {}
        self.subacks: Dict[int, List[int]] = {}
        self.lock = threading.Lock()
        self.connected = threading.Event()
        self.connect_rc: Any = None
        self.disconnected = threading.Event()
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=mqtt.MQTTv5)
        if username is not None:
            self.c.username_pw_set(username, "ignored")
        if tls:
            self.c.tls_set(ca_certs=str(site.certs / "fog-ca.crt"),
                           certfile=str(site.certs / f"{cert}.crt") if cert else None,
                           keyfile=str(site.certs / f"{cert}.key") if cert else None)
        self.c.on_connect = self._on_connect
        self.c.on_disconnect = lambda *a: self.disconnected.set()
        self.c.on_message = self._on_message
        self.c.on_publish = self._on_publish
        self.c.on_subscribe = self._on_subscribe
        self.site = site

    def _on_connect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any) -> None:
        self.connect_rc = rc
        self.connected.set()

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        with self.lock:
            self.received.append((msg.topic, bytes(msg.payload), bool(msg.retain), msg.properties))

    def _on_publish(self, client: Any, userdata: Any, mid: int, rc: Any, props: Any) -> None:
        with self.lock:
            self.pubacks[mid] = rc.value

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, rcs: Any, props: Any) -> None:
        with self.lock:
            self.subacks[mid] = [r.value for r in rcs]

    def connect(self, timeout: float = 5.0) -> str:
        """'connected', or why not: the TLS error, the CONNACK reason, or a dropped connection."""
        try:
            self.c.connect("127.0.0.1", self.site.port, keepalive=10)
        except (OSError, ssl.SSLError) as exc:
            return f"connect raised {type(exc).__name__}: {exc}"
        self.c.loop_start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.connected.is_set():
                return "connected" if not self.connect_rc.is_failure else f"CONNACK {self.connect_rc}"
            if self.disconnected.is_set():
                return "disconnected before CONNACK"
            time.sleep(0.02)
        return "no CONNACK"

    def publish(self, topic: str, payload: bytes, retain: bool = False, properties: Any = None) -> int:
        """Publish at QoS 1 and return the PUBACK reason code."""
        info = self.c.publish(topic, payload, qos=1, retain=retain, properties=properties)
        assert info.rc == 0, info.rc
        return self._wait(self.pubacks, info.mid, f"PUBACK for {topic}")

    def subscribe(self, topic: str) -> List[int]:
        rc, mid = self.c.subscribe(topic, qos=1)
        assert rc == 0, rc
        return self._wait(self.subacks, mid, f"SUBACK for {topic}")

    def _wait(self, table: Dict[int, Any], mid: int, what: str) -> Any:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with self.lock:
                if mid in table:
                    return table[mid]
            time.sleep(0.01)
        raise AssertionError(f"no {what}")

    def topics(self) -> Dict[str, bytes]:
        with self.lock:
            return {t: p for t, p, _, _ in self.received}

    def wait_for(self, pred: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                snapshot = list(self.received)
            if pred(snapshot):
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


@pytest.fixture()
def admin(site: Site) -> Iterator[Client]:
    c = Client(site, ADMIN)
    assert c.connect() == "connected"
    try:
        yield c
    finally:
        c.close()


def fogctl(capsys: Any, site: Site, *argv: str, cert: str = ADMIN) -> Tuple[int, str, str]:
    code = fogctl_main(["--broker", f"127.0.0.1:{site.port}", "--cluster", CLUSTER, "--timeout", "10",
                        "--cafile", str(site.certs / "fog-ca.crt"), "--cert", str(site.certs / f"{cert}.crt"),
                        "--key", str(site.certs / f"{cert}.key"), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def wait_until(pred: Any, timeout: float, step: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(step)


# ---- the tests -----------------------------------------------------------------------------------


def test_rendered_broker_is_tls_only_with_certificates_and_no_anonymous(site: Site) -> None:
    conf = site.conf.read_text().splitlines()
    for line in ("allow_anonymous false", "require_certificate true", "use_identity_as_username true",
                 f"listener {site.port} 127.0.0.1", f"acl_file {site.acl}"):
        assert line in conf, line
    assert sum(line.startswith("listener ") for line in conf) == 1  # no plain listener
    assert "password_file" not in site.conf.read_text()  # certificates are the only credential here


def test_agents_with_node_certificates_publish_status_and_state(site: Site, agents: Dict[str, AgentProc],
                                                                admin: Client) -> None:
    assert admin.subscribe(topics.all_agents_status(CLUSTER)) == [1]
    assert admin.subscribe(topics.all_agents_state(CLUSTER)) == [1]

    def up(msgs: List[Any]) -> bool:
        got = {t: p for t, p, _, _ in msgs}
        return all(got.get(topics.agent_status(CLUSTER, n)) == b"online" and topics.agent_state(CLUSTER, n) in got
                   for n in ("n1", "n2"))

    assert admin.wait_for(up, 30), (admin.topics(), agents["n1"].text()[-2000:])
    got = admin.topics()
    for n in ("n1", "n2"):
        assert json.loads(got[topics.agent_state(CLUSTER, n)])["node"] == n
    assert "Traceback" not in agents["n1"].text()


def test_node_writes_own_and_shared_topics_but_not_another_nodes(site: Site, agents: Dict[str, AgentProc],
                                                                 admin: Client) -> None:
    assert admin.subscribe("fog/#") == [1]
    assert admin.wait_for(lambda m: any(t == topics.agent_status(CLUSTER, "n2") and p == b"online" for t, p, _, _ in m), 30)
    n1 = Client(site, "n1")
    # The certificate's CN is the identity: claiming to be the admin in the CONNECT changes nothing.
    n1_claiming_admin = Client(site, "n1", username=ADMIN)
    try:
        assert n1.connect() == "connected" and n1_claiming_admin.connect() == "connected"
        own = [topics.agent_state(CLUSTER, "n1") + "/probe", topics.spill(CLUSTER, "n1") + "/probe",
               topics.latency(CLUSTER, "n1") + "/probe"]
        shared = [topics.inbox(CLUSTER, "taxi.sink.7"), topics.events(CLUSTER), topics.locks(CLUSTER),
                  f"fog/{CLUSTER}/replies/fogctl-0123456789ab", f"fog/{CLUSTER}/rpc-reply/fog-agent-{CLUSTER}-n2",
                  f"fog/{CLUSTER}/decisions/taxi.sink.7"]
        foreign = [topics.agent_status(CLUSTER, "n2"), topics.agent_state(CLUSTER, "n2"),
                   topics.agent_state(CLUSTER, "n2") + "/probe", topics.latency(CLUSTER, "n2"),
                   topics.spill(CLUSTER, "n2") + "/f1", topics.pipeline(CLUSTER, "taxi"),
                   "fog/othercluster/events"]
        allowed_codes = {t: n1.publish(t, b"probe") for t in own + shared}
        denied_codes = {t: n1.publish(t, b"forged", retain=True) for t in foreign}
        spoof_codes = {t: n1_claiming_admin.publish(t, b"forged", retain=True) for t in foreign[:3]}
        # A positive control last: once it arrived, everything published before it was routed.
        assert n1.publish(topics.events(CLUSTER), b"marker") in OK_CODES
        assert admin.wait_for(lambda m: (topics.events(CLUSTER), b"marker") in {(t, p) for t, p, _, _ in m}, 5)
        with admin.lock:
            delivered = [(t, p) for t, p, _, _ in admin.received]
        assert all(code in OK_CODES for code in allowed_codes.values()), allowed_codes
        assert all(code == NOT_AUTHORIZED for code in denied_codes.values()), denied_codes
        assert all(code == NOT_AUTHORIZED for code in spoof_codes.values()), spoof_codes
        assert set(own + shared) <= {t for t, p in delivered if p == b"probe"}
        assert not [t for t, p in delivered if p == b"forged"], "a refused publish reached a subscriber"

        # n1 cannot read another node's spawn requests nor another client's rpc replies. Mosquitto
        # 2.0 grants the SUBACK and checks read access per message, so: nothing is delivered.
        private = [topics.agent_rpc(CLUSTER, "n2"), f"fog/{CLUSTER}/rpc-reply/fog-agent-{CLUSTER}-n2"]
        for t in private + [topics.events(CLUSTER)]:
            n1.subscribe(t)
        for t in private:
            assert admin.publish(t, b'{"op": "ping"}') in OK_CODES
        assert admin.publish(topics.events(CLUSTER), b"marker-2") in OK_CODES
        assert n1.wait_for(lambda m: (topics.events(CLUSTER), b"marker-2") in {(t, p) for t, p, _, _ in m}, 5)
        assert not set(private) & set(n1.topics()), n1.topics()
        assert n1.subscribe(topics.all_agents_status(CLUSTER)) == [1]
        # ... and the retained forgery did not replace n2's status: a new subscriber sees "online".
        assert n1.wait_for(lambda m: any(t == topics.agent_status(CLUSTER, "n2") and r for t, _, r, _ in m), 5)
        with n1.lock:
            retained_n2 = [p for t, p, r, _ in n1.received if t == topics.agent_status(CLUSTER, "n2") and r]
        assert retained_n2 == [b"online"], retained_n2
    finally:
        n1.close()
        n1_claiming_admin.close()


def test_node_calls_another_agent_over_rpc_and_gets_the_reply(site: Site, agents: Dict[str, AgentProc]) -> None:
    """MQTT 5 request/response across nodes under the ACL: n1 writes n2's rpc topic, the agent n2
    answers on n1's rpc-reply/<client id> topic (its own pattern %c)."""
    n1 = Client(site, "n1")
    try:
        assert n1.connect() == "connected"
        reply_topic = f"fog/{CLUSTER}/rpc-reply/{n1.client_id}"
        assert n1.subscribe(reply_topic) == [1]
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = reply_topic
        props.CorrelationData = b"c-1"

        def replied(msgs: List[Any]) -> bool:
            return any(t == reply_topic and getattr(pr, "CorrelationData", None) == b"c-1" for t, _, _, pr in msgs)

        deadline = time.monotonic() + 20  # the agent may still be starting: ask again until it answers
        while time.monotonic() < deadline and not replied(n1.received):
            assert n1.publish(topics.agent_rpc(CLUSTER, "n2"), b'{"op": "ping"}', properties=props) in OK_CODES
            n1.wait_for(replied, 2)
        assert replied(n1.received), agents["n2"].text()[-2000:]
        body = json.loads(next(p for t, p, _, _ in n1.received if t == reply_topic))
        assert body["ok"] is True and body["node"] == "n2"
    finally:
        n1.close()


def test_anonymous_foreign_and_plain_clients_are_refused(site: Site) -> None:
    outcomes = {
        "n1 certificate (control)": Client(site, "n1"),
        "no client certificate": Client(site, None),
        "certificate of a foreign CA, CN=n1": Client(site, "foreign-n1"),
        "no TLS at all": Client(site, None, tls=False),
    }
    try:
        got = {name: c.connect() for name, c in outcomes.items()}
    finally:
        for c in outcomes.values():
            c.close()
    assert got["n1 certificate (control)"] == "connected", got
    for name, outcome in got.items():
        if name != "n1 certificate (control)":
            assert outcome != "connected", f"{name}: {outcome}"


def test_fogctl_with_admin_certificate_reads_and_steers_the_fleet(capsys: Any, site: Site,
                                                                  agents: Dict[str, AgentProc]) -> None:
    def status() -> Dict[str, Any]:
        code, out, err = fogctl(capsys, site, "--json", "status")
        assert code == 0, err
        return {n["node"]: n for n in json.loads(out)["nodes"]}

    assert wait_until(lambda: all(status().get(n, {}).get("status") == "online" for n in ("n1", "n2")), 30)
    assert status()["n1"]["status"] == "online"

    # deploy: agents answer fogctl's requests (replies/<client>), workers run with the node's certificate
    pipe = site.tmp / "taxi.toml"
    pipe.write_text(PIPELINE)
    code, out, err = fogctl(capsys, site, "deploy", str(pipe), "--keeper-timeout", "20")
    assert code == 0, err + agents["n1"].text()[-2000:]
    keepers = {"taxi.source.0", "taxi.in_zone.0", "taxi.sink.0"}

    running = wait_until(lambda: keepers <= {i for n in status().values() for i in n.get("instances", [])}, 20)
    assert running, status()

    def sink_records() -> int:  # from the agents' retained state, as the admin reads it
        c = Client(site, ADMIN)
        try:
            assert c.connect() == "connected"
            c.subscribe(topics.all_agents_state(CLUSTER))
            c.wait_for(lambda m: len({t for t, _, _, _ in m}) >= 2, 3)
            docs = [json.loads(p) for p in c.topics().values() if p]
        finally:
            c.close()
        return sum(int(i.get("stats", {}).get("records_in", 0)) for d in docs for i in d.get("instances", [])
                   if i.get("id") == "taxi.sink.0")

    assert wait_until(lambda: sink_records() > 0, 20), status()  # records went through the inboxes

    # latency probes: n1 pings n2 on latency/n2/ping, n2 answers on latency/n1/pong
    code, out, err = fogctl(capsys, site, "--json", "latency")
    assert code == 0, err
    assert wait_until(lambda: "n2" in json.dumps(json.loads(fogctl(capsys, site, "--json", "latency")[1])), 15)

    code, out, err = fogctl(capsys, site, "undeploy", "taxi")
    assert code == 0, err
    for a in agents.values():
        assert "Traceback" not in a.text(), a.text()[-3000:]


def test_fogctl_without_client_certificate_is_one_line(capsys: Any, site: Site) -> None:
    code = fogctl_main(["--broker", f"127.0.0.1:{site.port}", "--cluster", CLUSTER, "--timeout", "3",
                        "--cafile", str(site.certs / "fog-ca.crt"), "status"])
    err = capsys.readouterr().err
    assert code in (1, 3) and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_agent_tls_mistakes_are_one_line(site: Site) -> None:
    # An unreadable key: a configuration error, exit 78 (systemd does not restart it), one line.
    conf = agent_toml(site, "n3", "n1").read_text().replace(f"{site.certs}/n1.key", f"{site.certs}/missing.key")
    bad = site.tmp / "bad-key.toml"
    bad.write_text(conf)
    r = subprocess.run([sys.executable, "-m", "agent", "run", "--config", str(bad)], capture_output=True, text=True,
                       timeout=30, cwd=str(ROOT), env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 78, r.stderr
    assert "missing.key" in r.stderr and "Traceback" not in r.stderr, r.stderr

    # A certificate the broker does not trust: the agent keeps retrying, and says why once.
    foreign = AgentProc(site, "n3", conf=agent_toml(site, "n3", "foreign-n1"))
    try:
        assert wait_until(lambda: "TLS error" in foreign.text(), 15), foreign.text()
        time.sleep(2.5)  # several reconnect attempts (1 s backoff)
        text = foreign.text()
    finally:
        code = foreign.stop()
    assert code == 0, text
    assert "Traceback" not in text, text
    problems = [line.split(" msg=", 1)[1] for line in text.splitlines() if "cannot connect to" in line]
    assert any("TLS error" in p for p in problems), text
    assert len(problems) == len(set(problems)), text  # each reason once, not once per retry
