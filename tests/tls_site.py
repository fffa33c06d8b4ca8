"""A private fog site for the security tests: Mosquitto with the TLS listener, `mosquitto.conf` and
`fog.acl` rendered from the Ansible role `mosquitto` (its templates and defaults; only paths, port,
cluster and the identity lists are set), an openssl CA with a CRL, client certificates whose CN is
the identity, MQTT 5 test clients and real agents.

Shared by tests/test_security_tls_acl.py and tests/test_security_attacks.py, so that both attack
the broker exactly as the role renders it.
"""

from __future__ import annotations

import ast
import contextlib
import getpass
import json
import os
import shutil
import ssl
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import jinja2
import paho.mqtt.client as mqtt
import yaml

from foglab.tools.broker import MOSQUITTO, free_port, wait_port
from agent_process import AgentProcess
from tls_certs import OPENSSL, make_ca, make_cert

ROOT = Path(__file__).resolve().parent.parent
ROLE = ROOT / "ansible/roles/mosquitto"
NOT_AUTHORIZED = 135  # MQTT 5 reason code
OK_CODES = (0, 16)  # success, no matching subscribers


# ---- certificates and the CRL ----------------------------------------------------------------------


def make_crl(d: Path, ca: str, revoked: Sequence[str]) -> Path:
    """Revoke the certificates `<stem>.crt` of `revoked` (signed by `ca`) and write the CA's CRL
    `<ca>-crl.pem` with `openssl ca` -- the way docs/security.md tells an operator to do it."""
    db = d / f"{ca}-ca-db"
    db.mkdir(exist_ok=True)
    (db / "index.txt").touch()
    if not (db / "crlnumber").exists():
        (db / "crlnumber").write_text("01\n")
    cnf = db / "ca.cnf"
    cnf.write_text(f"[ca]\ndefault_ca = site\n[site]\ndatabase = {db}/index.txt\ncrlnumber = {db}/crlnumber\n"
                   "default_md = sha256\ndefault_crl_days = 2\n")
    base = [OPENSSL or "openssl", "ca", "-config", str(cnf), "-keyfile", str(d / f"{ca}-ca.key"),
            "-cert", str(d / f"{ca}-ca.crt")]
    for stem in revoked:
        subprocess.run([*base, "-revoke", str(d / f"{stem}.crt")], check=True, capture_output=True)
    crl = d / f"{ca}-crl.pem"
    subprocess.run([*base, "-gencrl", "-out", str(crl)], check=True, capture_output=True)
    return crl


# ---- the broker the role ships, rendered ---------------------------------------------------------


def render_role(prefix: Path, port: int, groups: Optional[Dict[str, List[str]]] = None,
                **overrides: Any) -> Dict[str, Any]:
    """Render mosquitto.conf and fog.acl from the role's templates with its defaults and `overrides`.

    Ansible's own filters used by these templates (`bool`, `ternary`) are given their documented
    meaning; defaults that refer to other defaults are resolved like Ansible does, lazily, and a
    rendered value that is a list literal becomes a list (Ansible's templating does the same).
    `groups` is the inventory's groups (Ansible's magic variable).
    """
    v = yaml.safe_load((ROLE / "defaults/main.yml").read_text())
    v.update(groups=groups or {}, inventory_hostname="broker", mosquitto_prefix=str(prefix),
             mosquitto_user=getpass.getuser(),  # root here: do not drop to a user who cannot read tmp
             mosquitto_tls_address="127.0.0.1", mosquitto_tls_port=port, mosquitto_persistence=False)
    v.update(overrides)
    env = jinja2.Environment(trim_blocks=True, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["bool"] = lambda x: x if isinstance(x, bool) else str(x).lower() in ("true", "yes", "on", "1")
    env.filters["ternary"] = lambda cond, yes, no: yes if cond else no
    def value(text: str) -> Any:
        if text.startswith("["):
            try:
                return ast.literal_eval(text)
            except (ValueError, SyntaxError):
                pass
        return text

    for _ in range(5):
        v = {k: value(env.from_string(x).render(v)) if isinstance(x, str) and "{{" in x else x for k, x in v.items()}
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
    cluster: str
    proc: subprocess.Popen

    def topic(self, rest: str) -> str:
        return f"fog/{self.cluster}/{rest}"


@contextlib.contextmanager
def running_site(tmp: Path, cluster: str, nodes: Sequence[str], admins: Sequence[str],
                 extra_certs: Iterable[str] = (), revoked: Sequence[str] = (),
                 collectors: Sequence[str] = ()) -> Iterator[Site]:
    """A CA `fog` (+ a `foreign` one), certificates for `nodes`, `admins`, `collectors` and
    `extra_certs` (CN = stem), `revoked` certificates (stem `<cn>-revoked`, revoked in the CRL),
    the broker's `server` certificate, and Mosquitto running the role's rendered config."""
    certs = tmp / "certs"
    certs.mkdir()
    make_ca(certs, "fog")
    make_ca(certs, "foreign")
    make_cert(certs, "fog", "localhost", server=True, stem="server")
    for cn in (*nodes, *admins, *collectors, *extra_certs):
        make_cert(certs, "fog", cn, stem=cn)
    for cn in revoked:
        make_cert(certs, "fog", cn, stem=f"{cn}-revoked")
    make_cert(certs, "foreign", nodes[0], stem=f"foreign-{nodes[0]}")  # the right name, the wrong CA
    crl = make_crl(certs, "fog", [f"{cn}-revoked" for cn in revoked])
    port = free_port()
    v = render_role(tmp / "root", port, mosquitto_cluster=cluster, mosquitto_node_identities=list(nodes),
                    mosquitto_admin_identities=list(admins), mosquitto_collector_identities=list(collectors),
                    mosquitto_tls_crl_src=str(crl))
    conf_dir = Path(v["mosquitto_config_dir"])
    for src, dst in (("fog-ca.crt", "ca.crt"), ("server.crt", "server.crt"), ("server.key", "server.key"),
                     (crl.name, "crl.pem")):
        shutil.copy(certs / src, conf_dir / "certs" / dst)
    log = Path(v["mosquitto_log_dest"].split(" ", 1)[1])
    proc = subprocess.Popen([MOSQUITTO, "-c", str(conf_dir / "mosquitto.conf")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        wait_port("127.0.0.1", port)
    except TimeoutError:
        proc.kill()
        raise RuntimeError("mosquitto did not start with the rendered config: "
                           + (proc.stderr.read().decode() if proc.stderr else "")
                           + (log.read_text() if log.exists() else ""))
    try:
        yield Site(port, certs, conf_dir / "mosquitto.conf", conf_dir / "fog.acl", log, tmp, cluster, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def have_tools() -> bool:
    return bool(OPENSSL) and os.path.exists(MOSQUITTO)


# ---- real agents -----------------------------------------------------------------------------------


def agent_toml(site: Site, node: str, cert: str, extra: str = "", slots: int = 3) -> Path:
    conf = site.tmp / f"{node}-{cert}-{uuid.uuid4().hex[:6]}.toml"
    conf.write_text(
        f'[agent]\nnode = "{node}"\ncluster = "{site.cluster}"\nslots = {slots}\nstate_dir = "{site.tmp}/state-{node}"\n'
        "state_period = 0.5\nheartbeat_period = 0.2\nshutdown_timeout = 3.0\n"
        f'[mqtt]\nhost = "127.0.0.1"\nport = {site.port}\nkeepalive = 5\n'
        f'[mqtt.tls]\nca_file = "{site.certs}/fog-ca.crt"\ncert_file = "{site.certs}/{cert}.crt"\n'
        f'key_file = "{site.certs}/{cert}.key"\n{extra}'
        "[metrics]\nport = 0\n[latency]\nperiod = 0.5\n"
    )
    return conf


class AgentProc(AgentProcess):
    """`python -m agent run` with a node certificate; each start logs to a new file."""

    def __init__(self, site: Site, node: str, cert: Optional[str] = None, conf: Optional[Path] = None) -> None:
        self.node = node
        self.site = site
        super().__init__(conf or agent_toml(site, node, cert or node))

    def start(self) -> None:
        self.log_path = self.site.tmp / f"{self.conf.stem}-{uuid.uuid4().hex[:4]}.log"
        super().start()


# ---- MQTT 5 test clients ---------------------------------------------------------------------------


class Client:
    """A paho MQTT 5 client over TLS that records messages, PUBACK and SUBACK reason codes."""

    def __init__(self, site: Site, cert: Optional[str], username: Optional[str] = None,
                 tls: bool = True, client_id: Optional[str] = None) -> None:
        self.client_id = client_id or f"test-{cert}-{uuid.uuid4().hex[:8]}"
        self.received: List[Tuple[str, bytes, bool, Any]] = []
        self.pubacks: Dict[int, int] = {}
        self.subacks: Dict[int, List[int]] = {}
        self.lock = threading.Lock()
        self.connected = threading.Event()
        self.connect_rc: Any = None
        self.disconnected = threading.Event()
        self.disconnect_rc: Any = None
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=mqtt.MQTTv5)
        if username is not None:
            self.c.username_pw_set(username, "ignored")
        if tls:
            self.c.tls_set(ca_certs=str(site.certs / "fog-ca.crt"),
                           certfile=str(site.certs / f"{cert}.crt") if cert else None,
                           keyfile=str(site.certs / f"{cert}.key") if cert else None)
        self.c.on_connect = self._on_connect
        self.c.on_disconnect = self._on_disconnect
        self.c.on_message = self._on_message
        self.c.on_publish = self._on_publish
        self.c.on_subscribe = self._on_subscribe
        self.site = site

    def _on_connect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any) -> None:
        self.connect_rc = rc
        self.session_present = bool(getattr(flags, "session_present", False))
        self.connected.set()

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any = None) -> None:
        self.disconnect_rc = rc
        self.disconnected.set()

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        with self.lock:
            self.received.append((msg.topic, bytes(msg.payload), bool(msg.retain), msg.properties))

    def _on_publish(self, client: Any, userdata: Any, mid: int, rc: Any, props: Any) -> None:
        with self.lock:
            self.pubacks[mid] = rc.value

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, rcs: Any, props: Any) -> None:
        with self.lock:
            self.subacks[mid] = [r.value for r in rcs]

    def connect(self, timeout: float = 5.0, clean_start: Any = True, session_expiry: int = 0) -> str:
        """'connected', or why not: the TLS error, the CONNACK reason, or a dropped connection."""
        props = None
        if session_expiry:
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = session_expiry
        try:
            self.c.connect("127.0.0.1", self.site.port, keepalive=10, clean_start=clean_start, properties=props)
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

    def publish(self, topic: str, payload: bytes, retain: bool = False, properties: Any = None,
                timeout: float = 5.0) -> int:
        """Publish at QoS 1 and return the PUBACK reason code."""
        info = self.c.publish(topic, payload, qos=1, retain=retain, properties=properties)
        assert info.rc == 0, info.rc
        return self._wait(self.pubacks, info.mid, f"PUBACK for {topic}", timeout)

    def publish_outcome(self, topic: str, payload: bytes, timeout: float = 5.0) -> str:
        """'puback <code>' or 'disconnected' (the broker closed the connection instead)."""
        info = self.c.publish(topic, payload, qos=1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if info.mid in self.pubacks:
                    return f"puback {self.pubacks[info.mid]}"
            if self.disconnected.is_set():
                return "disconnected"
            time.sleep(0.01)
        return "nothing"

    def subscribe(self, topic: str) -> List[int]:
        rc, mid = self.c.subscribe(topic, qos=1)
        assert rc == 0, rc
        return self._wait(self.subacks, mid, f"SUBACK for {topic}", 5.0)

    def _wait(self, table: Dict[int, Any], mid: int, what: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if mid in table:
                    return table[mid]
            time.sleep(0.01)
        raise AssertionError(f"no {what}")

    def topics(self) -> Dict[str, bytes]:
        with self.lock:
            return {t: p for t, p, _, _ in self.received}

    def got(self, topic: str, payload: Optional[bytes] = None) -> bool:
        with self.lock:
            return any(t == topic and (payload is None or p == payload) for t, p, _, _ in self.received)

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


def wait_until(pred: Any, timeout: float, step: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(step)


def json_or_none(payload: bytes) -> Any:
    try:
        return json.loads(payload)
    except ValueError:
        return None


__all__ = ["AgentProc", "Client", "NOT_AUTHORIZED", "OK_CODES", "ROOT", "Site", "agent_toml", "have_tools",
           "json_or_none", "make_crl", "render_role", "running_site", "wait_until"]
