"""agent.mqtt.client against real Mosquitto brokers: the plain test broker and the TLS site the
Ansible role renders (tests/tls_site.py).

What a wrong factory would get past none of these: TCP_NODELAY missing (paho leaves it off, and
the first test shows it), a Will that is not set or fires on a clean close, a persistent session
that is not one, a connect error that is a traceback or a line per retry, TLS that does not
present the node's certificate, and client ids that another identity can compute.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, List

import paho.mqtt.client as mqtt
import pytest

from agent.mqtt.settings import BrokerSpec
from agent.mqtt import client as mqttc
from foglab.tools.broker import free_port
from tls_site import AgentProc, Client, Site, have_tools, running_site, wait_until

pytestmark = pytest.mark.broker


def _nodelay_of(c: mqtt.Client) -> int:
    return c.socket().getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


class _Watcher:
    """A plain subscriber that records what it receives."""

    def __init__(self, broker: BrokerSpec, topic: str) -> None:
        self.got: List[bytes] = []
        self.c = mqttc.make_client(broker, f"watch-{uuid.uuid4().hex[:8]}")
        self.c.on_message = lambda _c, _u, m: self.got.append(bytes(m.payload))
        mqttc.connect_and_wait(self.c, broker, timeout=5)
        done = threading.Event()
        self.c.on_subscribe = lambda *a: done.set()
        self.c.subscribe(topic, qos=1)
        assert done.wait(5)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def test_connect_sets_tcp_nodelay_on_every_socket(mosquitto: Any) -> None:
    broker = mqttc.broker_from(mosquitto.host, mosquitto.port)
    plain = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"plain-{uuid.uuid4().hex[:8]}")
    plain.connect(mosquitto.host, mosquitto.port)
    try:
        assert _nodelay_of(plain) == 0  # paho's default: what the factory must change
    finally:
        plain.disconnect()
    c = mqttc.make_client(broker, f"nd-{uuid.uuid4().hex[:8]}")
    assert mqttc.connect_and_wait(c, broker, timeout=5, threaded=False) is False
    assert _nodelay_of(c) != 0
    c.reconnect()  # a new socket: set again (on_socket_open), before the CONNECT
    assert _nodelay_of(c) != 0
    c.disconnect()


def test_will_is_delivered_on_an_abrupt_close_and_not_on_a_clean_one(mosquitto: Any) -> None:
    broker = mqttc.broker_from(mosquitto.host, mosquitto.port)
    topic = f"test/will/{uuid.uuid4().hex[:8]}"
    watcher = _Watcher(broker, topic)
    try:
        clean = mqttc.make_client(broker, f"w1-{uuid.uuid4().hex[:8]}", will=mqttc.Will(topic, b"clean", retain=False))
        mqttc.connect_and_wait(clean, broker, timeout=5)
        clean.disconnect()
        clean.loop_stop()
        abrupt = mqttc.make_client(broker, f"w2-{uuid.uuid4().hex[:8]}", will=mqttc.Will(topic, b"gone", retain=False))
        mqttc.connect_and_wait(abrupt, broker, timeout=5)
        abrupt.loop_stop()
        abrupt.socket().close()  # no DISCONNECT: like SIGKILL
        assert wait_until(lambda: watcher.got, 5, 0.05), "no Will after an abrupt close"
        time.sleep(0.3)
        assert watcher.got == [b"gone"], watcher.got
    finally:
        watcher.close()


@pytest.mark.parametrize("mqtt5", [True, False])
def test_a_persistent_session_keeps_what_was_queued_while_away(mosquitto: Any, mqtt5: bool) -> None:
    broker = mqttc.broker_from(mosquitto.host, mosquitto.port)
    session = mqttc.Session(mqtt5=mqtt5, persistent=True, expiry=60)
    cid, topic = f"ps-{uuid.uuid4().hex[:8]}", f"test/ps/{uuid.uuid4().hex[:8]}"
    got: List[bytes] = []
    first = mqttc.make_client(broker, cid, session)
    mqttc.connect_and_wait(first, broker, session, timeout=5, threaded=False)
    first.subscribe(topic, qos=1)
    for _ in range(10):
        first.loop(0.05)
    first.disconnect()
    first.loop(0.05)
    pub = mqttc.make_client(broker, f"pub-{uuid.uuid4().hex[:8]}")
    mqttc.connect_and_wait(pub, broker, timeout=5)
    pub.publish(topic, b"while away", qos=1).wait_for_publish(5)
    pub.disconnect()
    pub.loop_stop()
    again = mqttc.make_client(broker, cid, session)
    again.on_message = lambda _c, _u, m: got.append(bytes(m.payload))
    assert mqttc.connect_and_wait(again, broker, session, timeout=5, threaded=False) is True
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        again.loop(0.05)
    assert got == [b"while away"]
    again.disconnect()
    clean = mqttc.make_client(broker, cid, mqttc.Session(mqtt5=mqtt5))
    assert mqttc.connect_and_wait(clean, broker, mqttc.Session(mqtt5=mqtt5), timeout=5, threaded=False) is False
    clean.disconnect()


def test_connect_failed_on_a_closed_port_is_one_clear_line(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()  # nothing listens there
    broker = mqttc.broker_from("127.0.0.1", port)
    with pytest.raises(mqttc.ConnectFailed) as info:
        mqttc.connect_and_wait(mqttc.make_client(broker, "closed"), broker, timeout=2)
    assert str(info.value) == f"cannot connect to 127.0.0.1:{port}: connection refused"
    assert isinstance(info.value, ConnectionError) and not info.value.refused
    # paho's own retries (connect_async + its thread): one log line per reason, not per attempt
    log = logging.getLogger("test.mqtt.failures")
    caplog.set_level(logging.WARNING, logger=log.name)
    failures = mqttc.FailureLog("127.0.0.1", port, log)
    attempts: List[str] = []
    c = mqttc.make_client(broker, "closed-async", reconnect_delay=(0.05, 0.1))
    mqttc.FailureLog.watch(c, lambda why: (attempts.append(why), failures.failed(why)))
    mqttc.connect(c, broker, blocking=False)
    c.loop_start()
    try:
        assert wait_until(lambda: len(attempts) >= 3, 10, 0.05), attempts
    finally:
        c.loop_stop()
    lines = [r.getMessage() for r in caplog.records if r.name == log.name]
    assert lines == [f"cannot connect to 127.0.0.1:{port}: connection refused (retrying)"], lines
    assert failures.last == "connection refused"
    failures.connected()
    failures.failed("connection refused")  # after a successful connect, the same reason is news again
    assert len([r for r in caplog.records if r.name == log.name]) == 2


# ---- TLS and client ids on the site the role renders ------------------------------------------------

CLUSTER = "mc"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    if not have_tools():
        pytest.skip("openssl or mosquitto missing")
    with running_site(tmp_path_factory.mktemp("mqttc"), CLUSTER, ["n1", "n2"], ["admin"],
                      extra_certs=["intruder"]) as s:
        yield s


def _tls(site: Site, cert: str, ca: str = "fog-ca.crt", secret: Any = None) -> BrokerSpec:
    return BrokerSpec("127.0.0.1", site.port, ca_file=str(site.certs / ca), cert_file=str(site.certs / f"{cert}.crt"),
                      key_file=str(site.certs / f"{cert}.key"), id_secret_file=secret)


def test_tls_connects_with_the_node_certificate_and_names_tls_errors(site: Site) -> None:
    n1 = _tls(site, "n1")
    c = mqttc.make_client(n1, f"tls-{uuid.uuid4().hex[:8]}")
    assert mqttc.connect_and_wait(c, n1, timeout=5) is False
    assert _nodelay_of(c) != 0  # also on a TLS socket
    # the node's ACL applies: it is the certificate's CN the broker sees
    done = threading.Event()
    c.on_publish = lambda *a: done.set()
    c.publish(f"fog/{CLUSTER}/agents/n1/status", b"x", qos=1)
    assert done.wait(5)
    c.disconnect()
    c.loop_stop()
    # a server certificate we do not trust: refused in the handshake, one line naming TLS
    wrong_ca = _tls(site, "n1", ca="foreign-ca.crt")
    with pytest.raises(mqttc.ConnectFailed) as info:
        mqttc.connect_and_wait(mqttc.make_client(wrong_ca, "tls-wrong-ca"), wrong_ca, timeout=5)
    assert str(info.value).startswith(f"cannot connect to 127.0.0.1:{site.port}: TLS error: ")
    assert "certificate" in str(info.value) and "\n" not in str(info.value)  # "self-signed certificate in ..."
    # a client certificate the broker does not trust (another CA): closed before the CONNACK
    foreign = _tls(site, "foreign-n1")
    with pytest.raises(mqttc.ConnectFailed) as info:
        mqttc.connect_and_wait(mqttc.make_client(foreign, "tls-foreign"), foreign, timeout=5, threaded=False)
    assert "before CONNACK" in str(info.value) or "TLS error" in str(info.value), str(info.value)


def test_client_ids_are_bound_to_the_node_secrets(site: Site, tmp_path: Path) -> None:
    secret = tmp_path / "client-id.secret"
    secret.write_text(uuid.uuid4().hex + uuid.uuid4().hex)
    n1, n1_again, n2 = _tls(site, "n1", secret=str(secret)), _tls(site, "n1"), _tls(site, "n2", secret=str(secret))
    agent = mqttc.agent_id(n1, CLUSTER, "n1")
    legacy = f"fog-agent-{CLUSTER}-n1"
    assert agent.startswith(legacy + "-") and len(agent) == len(legacy) + 1 + mqttc.ID_SUFFIX_HEX
    int(agent[-mqttc.ID_SUFFIX_HEX:], 16)
    assert mqttc.agent_id(n1_again, CLUSTER, "n1") == agent  # stable: a restart keeps its session
    # what other identities compute with their own key: not n1's id
    for other in ("n2", "admin", "intruder"):
        assert mqttc.agent_id(_tls(site, other), CLUSTER, "n1") != agent
    assert mqttc.shipper_id(n1, CLUSTER, "n1") not in (agent, f"fog-spill-{CLUSTER}-n1")
    # a worker's id: the same on every node that has the site secret (a re-homed instance takes
    # its session with it), another without it
    assert mqttc.worker_id(n1, CLUSTER, "p.op.0") == mqttc.worker_id(n2, CLUSTER, "p.op.0")
    assert mqttc.worker_id(n1, CLUSTER, "p.op.0").startswith(f"fog-{CLUSTER}-p.op.0-")
    assert mqttc.worker_id(n1_again, CLUSTER, "p.op.0") == f"fog-{CLUSTER}-p.op.0"  # no site secret
    other = tmp_path / "other.secret"
    other.write_text("another site's secret, 32 bytes!")
    assert mqttc.worker_id(_tls(site, "n1", secret=str(other)), CLUSTER, "p.op.0") != mqttc.worker_id(n1, CLUSTER, "p.op.0")
    # no secret at all (a plaintext test broker): the ids of before
    plain = BrokerSpec("127.0.0.1", 1883)
    assert mqttc.agent_id(plain, CLUSTER, "n1") == legacy
    assert mqttc.worker_id(plain, CLUSTER, "p.op.0") == f"fog-{CLUSTER}-p.op.0"


def test_another_identity_cannot_take_an_agents_session_unless_it_has_the_id(site: Site) -> None:
    """The real agent connects as `fog-agent-mc-n1-<12 hex>`. An intruder (a CA-signed certificate)
    that tries the old predictable id or the id its own key gives makes a session of its own:
    the agent stays connected and answers. With the exact id it takes the session over and kicks
    the agent (Mosquitto 2.0 cannot bind an id to a certificate, docs/security.md "Client ids"):
    the unguessable id is what stands between the two."""
    agent = AgentProc(site, "n1")
    admin = Client(site, "admin")
    try:
        expected = mqttc.agent_id(_tls(site, "n1"), CLUSTER, "n1")
        assert wait_until(lambda: f" as {expected} " in site.log.read_text(), 20), agent.text()
        assert admin.connect() == "connected" and admin.subscribe(f"fog/{CLUSTER}/agents/n1/status") == [1]
        assert admin.wait_for(lambda rs: any(p == b"online" for _, p, _, _ in rs), 10)
        for guess in (f"fog-agent-{CLUSTER}-n1", mqttc.agent_id(_tls(site, "intruder"), CLUSTER, "n1")):
            intruder = Client(site, "intruder", client_id=guess)
            assert intruder.connect(clean_start=False, session_expiry=600) == "connected"
            assert not intruder.session_present  # a fresh session: not the agent's
            time.sleep(0.5)
            intruder.close()
        assert f"Client {expected} already connected" not in site.log.read_text()
        assert not admin.got(f"fog/{CLUSTER}/agents/n1/status", b"offline")
        assert "disconnected from broker" not in agent.text()
        # the id itself (as if guessed): the session is taken and the agent kicked (no Will: a
        # take-over is no abrupt end); the agent reconnects and kicks the taker in turn
        thief = Client(site, "intruder", client_id=expected)
        assert thief.connect(clean_start=False, session_expiry=600) == "connected"
        assert thief.session_present
        assert wait_until(lambda: f"Client {expected} already connected" in site.log.read_text(), 5)
        assert wait_until(lambda: "disconnected from broker" in agent.text(), 5), agent.text()
        assert wait_until(thief.disconnected.is_set, 15)
        thief.c.loop_stop()
    finally:
        admin.close()
        assert agent.stop() == 0, agent.text()


def test_an_unusable_client_id_secret_file_is_one_config_error(tmp_path: Path) -> None:
    from agent.config import MqttSection, check_tls
    from agent.schema import ConfigError

    short = tmp_path / "short.secret"
    short.write_text("tooshort\n")
    for path, why in ((tmp_path / "missing.secret", "No such file or directory"), (short, "shorter than 16 bytes")):
        with pytest.raises(ConfigError) as info:
            check_tls(MqttSection(client_id_secret_file=str(path)), str(tmp_path / "agent.toml"))
        assert str(info.value) == (f"agent.toml: [mqtt].client_id_secret_file: expected a readable file of at "
                                   f'least 16 bytes ({why}), got "{path}"')
    good = tmp_path / "good.secret"
    good.write_text("x" * 16)
    check_tls(MqttSection(client_id_secret_file=str(good)), "agent.toml")
