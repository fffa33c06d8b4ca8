"""The one way every process of the project makes its paho client (docs/runtime.md, "MQTT layer").

What it settles once for all callers: paho's callback API 2, the MQTT version and the session
(`Session`: clean or persistent, MQTT 5 session expiry), user name and password, TLS (CA,
certificate, key, insecure), paho's in-flight and queue limits, the Last Will, paho's reconnect
back-off, TCP_NODELAY on every socket paho opens, one-line connect errors (`ConnectFailed`,
`FailureLog`) and the client ids of the agent, its workers and its shipper (`agent_id`,
`worker_id`, `shipper_id`: bound to the node's secrets, docs/security.md "Client ids").

What it leaves to the caller: the threading model and the callbacks. It never starts a thread
unless asked (`connect_and_wait(threaded=True)` calls paho's `loop_start`); a worker's Transport
runs paho's loop in its one owner thread, the daemon and the tools in paho's network thread.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import select
import socket
import ssl
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Set, Tuple

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.mqtt.settings import BrokerSpec

__all__ = [
    "BrokerSpec",
    "ConnectFailed",
    "FailureLog",
    "Session",
    "Will",
    "agent_id",
    "broker_from",
    "client_id",
    "connect",
    "connect_and_wait",
    "connect_error",
    "loop_once",
    "make_client",
    "node_secret",
    "nodelay",
    "paho_error",
    "publish_taken",
    "shipper_id",
    "site_secret",
    "worker_id",
    "ingest_id",
]

ID_SUFFIX_HEX = 12  # hex digits of the HMAC appended to a client id (48 bits)
_ID_DOMAIN = b"fog-client-id\0"  # domain separation: the key material is also a TLS key or password


class ConnectFailed(ConnectionError):
    """No MQTT connection: names the broker's host:port and the reason in one line (no traceback).
    A ConnectionError, so callers that catch OSError around a connect keep catching it."""

    def __init__(self, host: str, port: int, reason: str, refused: bool = False) -> None:
        super().__init__(f"cannot connect to {host}:{port}: {reason}")
        self.host, self.port, self.reason = host, port, reason
        self.refused = refused  # the broker answered: a CONNACK with a failure (not authorized, ...)

    def __str__(self) -> str:
        return f"cannot connect to {self.host}:{self.port}: {self.reason}"


@dataclass(frozen=True)
class Will:
    """The Last Will the broker publishes when the connection ends without a DISCONNECT."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True


@dataclass(frozen=True)
class Session:
    """MQTT version and session kind.

    mqtt5: MQTT 5 (the agent, its workers, rpc, fogctl) or 3.1.1 (the collector, the shipper, the
    latency probe, the GME bench, which predate it). persistent: the broker keeps subscriptions
    and queues messages while the client is away (MQTT 5: clean_start false and `expiry` seconds;
    3.1.1: clean_session false). Not persistent, MQTT 5: paho's default (clean start on the first
    connect, no session expiry)."""

    mqtt5: bool = True
    persistent: bool = False
    expiry: int = 3600


CLEAN = Session()
CLEAN_311 = Session(mqtt5=False)


# ---- client ids bound to identities ----------------------------------------------------------------


def _key(material: bytes) -> bytes:
    return hashlib.sha256(_ID_DOMAIN + material).digest()


def node_secret(broker: BrokerSpec) -> Optional[bytes]:
    """The HMAC key of the ids of a node's own clients (agent, shipper): a digest of the node's TLS
    private key (`key_file`, else a `cert_file` that holds the key too), else of its MQTT password;
    None without either (a plaintext test broker: the ids stay as they were). Only that node holds
    it, so no other identity can compute these ids. Why not a digest of the certificate: the
    certificate is no secret."""
    path = broker.key_file or broker.cert_file
    if path:
        try:
            return _key(Path(path).read_bytes())
        except OSError:
            return None  # check_tls reported it; paho's tls_set will say so too
    if broker.password:
        return _key(broker.password.encode())
    return None


def site_secret(broker: BrokerSpec) -> Optional[bytes]:
    """The HMAC key of the workers' ids: the site secret file every node of the site has
    (`[mqtt] client_id_secret_file`). A worker's id must be the same on every node: a re-homed or
    handed-over instance takes its MQTT session over from the node it left (docs/reliability.md).
    None when not configured (the ids stay as they were)."""
    if not broker.id_secret_file:
        return None
    try:
        data = Path(broker.id_secret_file).read_bytes().strip()
    except OSError:
        return None
    return _key(data) if data else None


def client_id(base: str, secret: Optional[bytes]) -> str:
    """`base` with `-<12 hex of HMAC-SHA256(secret, base)>`: stable as long as the secret is (a
    restart keeps its persistent session), and not computable without the secret. No secret:
    `base` itself."""
    if not secret:
        return base
    return f"{base}-{hmac.new(secret, base.encode(), hashlib.sha256).hexdigest()[:ID_SUFFIX_HEX]}"


def agent_id(broker: BrokerSpec, cluster: str, node: str) -> str:
    return client_id(f"fog-agent-{cluster}-{node}", node_secret(broker))


def shipper_id(broker: BrokerSpec, cluster: str, node: str) -> str:
    return client_id(f"fog-spill-{cluster}-{node}", node_secret(broker))


def worker_id(broker: BrokerSpec, cluster: str, instance: str) -> str:
    return client_id(f"fog-{cluster}-{instance}", site_secret(broker))


def ingest_id(broker: BrokerSpec, cluster: str, instance: str) -> str:
    """The id of an `mqtt_source`'s second connection, the one that reads its sensors' topic. Like
    the worker's own, the same on every node, so its persistent session (the readings not acked
    yet, and those published meanwhile) follows the instance when it moves."""
    return client_id(f"fog-{cluster}-{instance}-ingest", site_secret(broker))


# ---- settings -----------------------------------------------------------------------------------------


def broker_from(host: str, port: int, tls: Any = None, username: Optional[str] = None,
                password: Optional[str] = None, keepalive: int = 10,
                id_secret_file: Optional[str] = None) -> BrokerSpec:
    """Broker settings from a host, a port and an `[mqtt.tls]` section (agent.config.TlsSection:
    ca_file, cert_file, key_file, insecure) or None."""
    return BrokerSpec(
        host=host, port=port, keepalive=keepalive, username=username, password=password,
        ca_file=getattr(tls, "ca_file", None), cert_file=getattr(tls, "cert_file", None),
        key_file=getattr(tls, "key_file", None), tls_insecure=bool(getattr(tls, "insecure", False)),
        id_secret_file=id_secret_file,
    )


def nodelay(client: Any, userdata: Any = None, sock: Any = None) -> None:
    """Disable Nagle's algorithm on paho's socket (paho 2.2 does not); installed as every client's
    `on_socket_open`, so it holds from the CONNECT on, after every reconnect.

    Measured: with Nagle on both ends (Mosquitto's `set_tcp_nodelay` defaults to false too), a
    small ack or PUBACK waits for the peer's delayed ACK, ~40 ms per hop, and a credit window of
    8 batches then caps a pipeline at ~70 batches/s. Set it on the broker as well.
    """
    sock = sock if sock is not None else client.socket()
    if sock is None:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):  # a unix socket, or a wrapper without setsockopt
        pass


def make_client(broker: BrokerSpec, client_id: str, session: Session = CLEAN, *, will: Optional[Will] = None,
                max_inflight: Optional[int] = None, max_queued: Optional[int] = None,
                reconnect_delay: Optional[Tuple[float, float]] = None, manual_ack: bool = False) -> mqtt.Client:
    """A paho client with these settings, not connected (`connect`, `connect_and_wait`).

    TLS files are loaded here: a bad one raises ssl.SSLError/OSError now (callers that read a
    config file check them first, agent.config.check_tls, to name the file and key).
    manual_ack: paho PUBACKs a delivery only when told (`client.ack`), not when the callback
    returns (an `mqtt_source`'s readings: acked once they are safe downstream)."""
    if session.mqtt5:
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5,
                        manual_ack=manual_ack)
    else:
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=not session.persistent,
                        manual_ack=manual_ack)
    if broker.username:
        c.username_pw_set(broker.username, broker.password)
    if broker.ca_file or broker.cert_file:
        c.tls_set(ca_certs=broker.ca_file, certfile=broker.cert_file, keyfile=broker.key_file)
        if broker.tls_insecure:
            c.tls_insecure_set(True)
    if max_inflight is not None:
        c.max_inflight_messages_set(max_inflight)
    if max_queued is not None:
        c.max_queued_messages_set(max_queued)
    if reconnect_delay is not None:
        c.reconnect_delay_set(min_delay=reconnect_delay[0], max_delay=reconnect_delay[1])
    if will is not None:
        c.will_set(will.topic, will.payload, qos=will.qos, retain=will.retain)
    c.on_socket_open = nodelay
    return c


def _connect_args(broker: BrokerSpec, session: Session) -> Dict[str, Any]:
    args: Dict[str, Any] = {"keepalive": broker.keepalive}
    if session.mqtt5 and session.persistent:
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = session.expiry
        args.update(clean_start=False, properties=props)
    return args


def connect(client: mqtt.Client, broker: BrokerSpec, session: Session = CLEAN, blocking: bool = True) -> None:
    """Open the connection. blocking: TCP and TLS now, a failure is ConnectFailed; else paho
    connects (and retries with its back-off) from its loop."""
    args = _connect_args(broker, session)
    if not blocking:
        client.connect_async(broker.host, broker.port, **args)
        return
    try:
        client.connect(broker.host, broker.port, **args)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise ConnectFailed(broker.host, broker.port, connect_error(exc)) from None


def publish_taken(rc: int, qos: int) -> bool:
    """Did paho take a message `publish` was handed (it sends it now or after the reconnect)?

    For QoS > 0 only MQTT_ERR_QUEUE_SIZE means it did not: once taken, paho keeps the message
    whatever its first socket write returned (MQTT_ERR_NO_CONN while the connection is down,
    MQTT_ERR_CONN_LOST when the broker goes away during the write) and sends it after the
    reconnect. A caller that takes NO_CONN for "not sent" and sends again, or sends elsewhere,
    has it delivered twice. For QoS 0 anything but SUCCESS/NO_CONN is a rejection."""
    if rc == mqtt.MQTT_ERR_QUEUE_SIZE:
        return False
    return qos > 0 or rc in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN)


def loop_once(client: mqtt.Client, timeout: float) -> int:
    """One turn of paho's network loop for a client driven by its caller's thread (a worker's
    Transport, a bench's clients): paho's `loop()` without its wake-up socket pair.

    Why: `loop()` creates a socket pair on first use so that another thread's publish can wake
    its select, and from then on every publish writes a byte into it (a send syscall per
    message) and every turn selects on it and reads it. A client used by one thread needs none
    of that: paho writes a publish at once when called outside a callback (`_packet_queue`), and
    what a callback queued (PUBACKs) is written below after the read. Without `loop()` ever
    being called, paho never makes the pair. Otherwise the same steps: read if readable (or if
    a TLS socket holds decrypted bytes), write what is waiting, keepalive (`loop_misc`)."""
    sock = client.socket()
    if sock is None:
        return mqtt.MQTT_ERR_NO_CONN
    pending = sock.pending() if hasattr(sock, "pending") else 0
    try:
        readable, _, _ = select.select([sock], [sock] if client.want_write() else [], [], 0.0 if pending else timeout)
    except (TypeError, ValueError, OSError):  # closed under us: paho's loop() says the same
        return mqtt.MQTT_ERR_CONN_LOST
    if readable or pending:
        rc = client.loop_read()
        if rc or client.socket() is None:
            return rc or mqtt.MQTT_ERR_CONN_LOST
    if client.want_write():
        rc = client.loop_write()
        if rc:
            return rc
    return client.loop_misc()


def connect_and_wait(client: mqtt.Client, broker: BrokerSpec, session: Session = CLEAN, timeout: float = 10.0,
                     threaded: bool = True) -> bool:
    """Connect and wait for the CONNACK; returns whether the broker kept our session.

    threaded: start paho's network thread (loop_start) and wait in the caller; else run paho's
    loop in the calling thread (`loop_once`: a worker's owner thread, a bench's select loop). The caller's
    `on_connect`, `on_disconnect` and `on_log` (set before) still run. No connection, a refused
    CONNACK, a connection closed before the CONNACK (a broker that rejects our certificate: the
    reason is paho's TLS error line) or no CONNACK within `timeout` is ConnectFailed (and the
    network thread, if started here, is stopped)."""
    got = threading.Event()
    lost = threading.Event()
    result: Dict[str, Any] = {}
    theirs = client.on_connect, client.on_disconnect, client.on_log

    def on_connect(c: Any, userdata: Any, flags: Any, rc: Any, props: Any = None) -> None:
        if not got.is_set():
            result["rc"], result["present"] = rc, bool(getattr(flags, "session_present", False))
            got.set()
        if theirs[0] is not None:
            theirs[0](c, userdata, flags, rc, props)

    def on_disconnect(c: Any, userdata: Any, flags: Any, rc: Any, props: Any = None) -> None:
        result.setdefault("lost", str(rc))
        lost.set()
        if theirs[1] is not None:
            theirs[1](c, userdata, flags, rc, props)

    def on_log(c: Any, userdata: Any, level: int, buf: str) -> None:
        if level == mqtt.MQTT_LOG_ERR:
            result["error"] = paho_error(buf)
        if theirs[2] is not None:
            theirs[2](c, userdata, level, buf)

    client.on_connect, client.on_disconnect, client.on_log = on_connect, on_disconnect, on_log
    try:
        connect(client, broker, session)
        deadline = time.monotonic() + timeout
        if threaded:
            client.loop_start()
            while not got.wait(0.02) and not lost.is_set() and time.monotonic() < deadline:
                pass
        else:
            while not got.is_set() and not lost.is_set() and time.monotonic() < deadline:
                if loop_once(client, 0.05) != mqtt.MQTT_ERR_SUCCESS and not got.is_set():
                    result.setdefault("lost", "connection lost")
                    lost.set()
        if not got.is_set():
            if lost.is_set():
                why = result.get("error") or result["lost"]
                raise ConnectFailed(broker.host, broker.port, f"connection closed before CONNACK: {why}")
            raise ConnectFailed(broker.host, broker.port, f"no CONNACK within {timeout:g}s")
        rc = result["rc"]
        if getattr(rc, "is_failure", False):
            raise ConnectFailed(broker.host, broker.port, f"the broker refused the connection: {rc}", refused=True)
    except ConnectFailed:
        if threaded:
            client.loop_stop()
        raise
    finally:
        client.on_connect, client.on_disconnect, client.on_log = theirs
    return bool(result["present"])


# ---- errors in one line -------------------------------------------------------------------------------


def connect_error(exc: Optional[BaseException]) -> str:
    """One line for a failed connect attempt: TLS problems named as such (no traceback)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS error: {exc.verify_message or exc.reason or exc}"
    if isinstance(exc, ssl.SSLError):
        return f"TLS error: {exc.reason or exc}"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, socket.gaierror):
        return f"unknown host ({exc.strerror or exc})"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timed out"
    if exc is None:
        return "connect failed"
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def paho_error(buf: str) -> str:
    """paho's error log line, with TLS failures named as such."""
    return f"TLS error: {buf}" if "SSL" in buf or "TLS" in buf else buf


_NOT_CONNECTED = "Client is not connected"


class FailureLog:
    """The failed attempts of a client that paho retries by itself (connect_async + its loop).

    paho retries a refused connect or a failed TLS handshake silently, and reports a certificate
    the broker rejects only in its error log line; `watch` routes both to `report`, and `failed`
    logs each distinct reason once (never a line per retry, never silence) until `connected`.
    Shared by the daemon and the collector."""

    def __init__(self, host: str, port: int, logger: logging.Logger, level: int = logging.WARNING,
                 who: str = "", extra: Optional[Dict[str, Any]] = None) -> None:
        self.host, self.port, self.logger, self.level, self.extra = host, port, logger, level, extra
        self.who = f"{who} " if who else ""
        self.last: Optional[str] = None
        self._seen: Set[str] = set()

    def failed(self, reason: str) -> ConnectFailed:
        """Record one failed attempt; logs it if this reason is new since the last connect."""
        self.last = reason
        err = ConnectFailed(self.host, self.port, reason)
        if reason not in self._seen:
            self._seen.add(reason)
            self.logger.log(self.level, "%s%s (retrying)", self.who, err, extra=self.extra)
        return err

    def connected(self) -> None:
        self.last = None
        self._seen.clear()

    @staticmethod
    def watch(client: mqtt.Client, report: Callable[[str], None],
              error: Optional[Callable[[str], None]] = None) -> None:
        """Install the hooks that see a failed attempt: paho's `on_connect_fail` (called inside
        its `except OSError`, so the exception is sys.exc_info()'s) -> `report`, and its error log
        lines (a TLS alert of a broker that rejects our certificate) -> `error` (default `report`).
        Both run in paho's thread: they must only record or enqueue."""
        client.on_connect_fail = lambda _c, _u: report(connect_error(sys.exc_info()[1]))
        on_error = error or report

        def on_log(_c: Any, _u: Any, level: int, buf: str) -> None:
            # "Client is not connected": paho's loop after the failed attempt that on_connect_fail
            # reported already (its cause), not a reason of its own
            if level == mqtt.MQTT_LOG_ERR and not buf.startswith(_NOT_CONNECTED):
                on_error(paho_error(buf))

        client.on_log = on_log
