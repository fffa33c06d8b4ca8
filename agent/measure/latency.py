"""Round-trip times to neighbour agents: through the broker and over a small TCP/UDP echo.

Why: placement prefers low-latency nodes and the model policy needs ND_max (Gesscale), so every
agent measures its RTT to its neighbours every period, keeps a smoothed row of the matrix and
publishes it retained on `agent.topics.latency(cluster, node)`.

API for the daemon (sans-IO core: the daemon owns the MQTT client and the clock):

    core = LatencyCore(node, cluster, period=cfg.latency.period, smoothing=cfg.latency.smoothing)
    for topic in core.subscriptions(): client.subscribe(topic, qos=0)
    core.set_neighbours(["n2", "n3"])                  # from the retained agent states
    every loop turn:
        for topic, payload in core.poll(now): publish(topic, payload, qos=0)     # pings due
        on a message: for topic, payload in core.on_message(topic, payload, now): publish(...)
        if core.publish_due(now): publish(*core.retained(wall), retain=True)
    direct echo (optional, config latency.echo_port): EchoServer(port).start() on every agent and
        core.record(peer, tcp_rtt(host, port), via="echo") from a worker thread or the loop.

The broker path measures me -> broker -> peer -> broker -> me: it includes both agents' links
to the broker, which is what an MQTT message between them costs, and nothing of either agent's
loop (docs/measurement.md, "What the RTT includes"): a probe is timestamped at receipt, on the
MQTT client's network thread (`received_at`: paho stamps every message there), not when the
loop gets round to it, and a pong carries how long the peer held the ping before answering
(`h`, ms), which is subtracted. So a busy loop on either side shows in neither figure. A ping to oneself measures the
RTT to the broker (published as the "broker" entry). Pings and pongs are QoS 0 (a lost ping is
just a missing sample; a retransmitted one would measure the retransmission). A pong carries the
sender's own send time back, so the RTT is computed on one clock; the nonce rejects stale and
duplicated pongs. Smoothing: EWMA with weight `smoothing` for the newest sample.

`MqttLatencyAgent` is a thin standalone driver (its own paho client, one owner thread) for tests,
tools and nodes without a daemon.
"""

from __future__ import annotations

import json
import math
import queue
import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from agent import topics, wire
from agent.mqtt import client as mqttc

__all__ = [
    "ping_topic",
    "pong_topic",
    "SmoothedRow",
    "LatencyCore",
    "EchoServer",
    "tcp_rtt",
    "udp_rtt",
    "MqttLatencyAgent",
    "BROKER",
    "received_at",
]

BROKER = "broker"  # the pseudo-peer of a self-ping
PROBES = 8  # peers pinged per round beside the near ones (`LatencyCore.targets`)
REFRESH_PERIODS = 6  # an unchanged row is published again every 6 periods (30 s by default)
CHANGE = 0.2  # an RTT that moved by more than this fraction of its published value is news...
CHANGE_FLOOR_MS = 1.0  # ...and by more than this: sub-millisecond jitter on a LAN is not


def ping_topic(cluster: str, target: str, sender: str) -> str:
    """`sender`'s ping to `target` (agent.topics.latency_ping)."""
    return topics.latency_ping(cluster, target, sender)


def pong_topic(cluster: str, sender: str, target: str) -> str:
    """`target`'s pong to the ping of `sender` (agent.topics.latency_pong)."""
    return topics.latency_pong(cluster, sender, target)


class SmoothedRow:
    """EWMA of RTT samples per peer (one row of the matrix), plus sample counts and last values."""

    def __init__(self, smoothing: float = 0.3) -> None:
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], found {smoothing}")
        self.smoothing = smoothing
        self.value: Dict[str, float] = {}
        self.last: Dict[str, float] = {}
        self.samples: Dict[str, int] = {}
        self.via: Dict[str, str] = {}

    def add(self, peer: str, rtt_ms: float, via: str = "broker") -> float:
        if rtt_ms < 0:
            raise ValueError(f"negative RTT {rtt_ms} to {peer}")
        old = self.value.get(peer)
        new = rtt_ms if old is None else self.smoothing * rtt_ms + (1 - self.smoothing) * old
        self.value[peer] = new
        self.last[peer] = rtt_ms
        self.samples[peer] = self.samples.get(peer, 0) + 1
        self.via[peer] = via
        return new

    def forget(self, peer: str) -> None:
        for d in (self.value, self.last, self.samples, self.via):
            d.pop(peer, None)


@dataclass(frozen=True)
class Probe:
    origin: str
    target: str
    nonce: int
    sent_at: float
    # On a pong: ms the answering agent held the ping between its receipt and the answer. Not
    # part of the probe's identity (a pong matches its ping whatever the hold).
    hold_ms: float = field(default=0.0, compare=False)

    def encode(self) -> bytes:
        d: Dict[str, Any] = {"o": self.origin, "t": self.target, "n": self.nonce, "s": self.sent_at}
        if self.hold_ms > 0:
            d["h"] = round(self.hold_ms, 3)
        return json.dumps(d).encode()

    @classmethod
    def decode(cls, payload: bytes) -> "Probe":
        """Parse a probe from the bus; raises wire.BusInputError (a ValueError) saying why."""
        d = wire.loads(payload, what="latency probe", expect=dict)
        o, t, n, s = d.get("o"), d.get("t"), d.get("n"), d.get("s")
        if not isinstance(o, str) or not isinstance(t, str) or not o or not t:
            raise wire.BusInputError("latency probe: 'o' and 't' must be non-empty strings")
        if isinstance(n, bool) or not isinstance(n, int):
            raise wire.BusInputError("latency probe: 'n' must be an integer")
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
            raise wire.BusInputError("latency probe: 's' must be a finite number")
        h = d.get("h", 0.0)
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not math.isfinite(h) or h < 0:
            raise wire.BusInputError("latency probe: 'h' must be a finite number >= 0")
        return cls(o, t, n, float(s), float(h))


class LatencyCore:
    """Sans-IO latency measurement of one agent (see module doc for the daemon's loop)."""

    def __init__(self, node: str, cluster: str, period: float = 5.0, smoothing: float = 0.3,
                 timeout: Optional[float] = None, emulated: Optional[Mapping[str, float]] = None,
                 probes: int = PROBES, refresh: Optional[float] = None) -> None:
        self.node = node
        self.cluster = cluster
        self.period = period
        self.timeout = timeout if timeout is not None else max(period, 2.0)
        self.row = SmoothedRow(smoothing)
        self.neighbours: Tuple[str, ...] = ()
        self.near: Tuple[str, ...] = ()
        self.probes = max(0, int(probes))
        self.refresh = refresh if refresh is not None else REFRESH_PERIODS * period
        self.emulated = dict(emulated or {})
        self._next_round: Optional[float] = None
        self._rotation = 0
        self._nonce = 0
        self._outstanding: Dict[int, Probe] = {}
        self.lost = 0
        self.dirty = False
        self._published_at: Optional[float] = None
        self._published: Dict[str, float] = {}

    def subscriptions(self) -> List[str]:
        return [topics.latency_pings(self.cluster, self.node), topics.latency_pongs(self.cluster, self.node)]

    def set_neighbours(self, peers: Iterable[str], near: Iterable[str] = ()) -> None:
        """`peers`: every online node; `near`: those of them that host a neighbour of a local
        instance (where placement and the model read this node's RTTs most). A peer that left
        is forgotten; one only out of this round's rotation keeps its last value."""
        known = set(peers) - {self.node}
        for gone in set(self.neighbours) - known:
            self.row.forget(gone)
            self.dirty = True
        self.neighbours = tuple(sorted(known))
        self.near = tuple(sorted(known.intersection(near)))

    def targets(self) -> Tuple[str, ...]:
        """Whom the next round pings: itself (the broker's RTT), every near peer, and `probes`
        of the others in turn, so each pair is measured every N / `probes` rounds.

        Pinging every node every period cost each of N nodes 2N probes a period, N^2 at the
        broker (docs/scale.md, "The costs that grow faster than N"); this is 2 (1 + near +
        probes) a period whatever N."""
        near = set(self.near)
        others = [p for p in self.neighbours if p not in near]
        if len(others) <= self.probes:
            turn = others
        else:
            start = self._rotation % len(others)
            turn = (others[start:] + others[:start])[:self.probes]
        return (self.node,) + self.near + tuple(turn)

    def poll(self, now: float) -> List[Tuple[str, bytes]]:
        """Pings due now (one round per period, to `targets()`)."""
        for nonce, p in list(self._outstanding.items()):
            if now - p.sent_at > self.timeout:
                del self._outstanding[nonce]
                self.lost += 1
        if self._next_round is not None and now < self._next_round:
            return []
        self._next_round = now + self.period
        out = []
        for target in self.targets():
            self._nonce += 1
            p = Probe(self.node, target, self._nonce, now)
            self._outstanding[p.nonce] = p
            out.append((ping_topic(self.cluster, target, self.node), p.encode()))
        self._rotation += self.probes
        return out

    def next_due(self) -> Optional[float]:
        return self._next_round

    def on_message(self, topic: str, payload: bytes, now: float,
                   received: Optional[float] = None) -> List[Tuple[str, bytes]]:
        """A ping to answer (returns the pong) or a pong of ours (records the RTT).

        `received`: when the message arrived, on the MQTT network thread (`received_at`), on the
        clock of `now`; None means now. A pong's RTT is its receipt minus our ping's send time,
        less the hold the peer reports; a ping's answer reports now - received as its hold.

        The peer is the topic's last level (the broker's ACL proved it), and the probe must say
        the same: a pong goes only to the pinging node's own pong topic, never to a topic the
        payload names. Raises wire.BusInputError (a ValueError) for a malformed or mismatched
        probe, so that the caller counts it; a topic not ours returns []."""
        parsed = topics.parse(self.cluster, topic)
        if parsed is None or parsed.node != self.node or parsed.kind not in ("ping", "pong"):
            return []
        probe = Probe.decode(payload)
        peer = parsed.sender or ""
        at = now if received is None or received > now else received
        if parsed.kind == "ping":
            if probe.origin != peer or probe.target != self.node:
                raise wire.BusInputError(f"latency ping from {peer}: probe says {probe.origin[:40]!r} -> {probe.target[:40]!r}")
            if peer == self.node:
                return self._pong(probe, at)  # the self-ping: its echo is this very message
            hold_ms = (now - at) * 1000.0
            if hold_ms <= 0:
                return [(pong_topic(self.cluster, peer, self.node), payload)]
            return [(pong_topic(self.cluster, peer, self.node), replace(probe, hold_ms=hold_ms).encode())]
        if probe.origin != self.node or probe.target != peer:
            raise wire.BusInputError(f"latency pong from {peer}: probe says {probe.origin[:40]!r} -> {probe.target[:40]!r}")
        return self._pong(probe, at)

    def _pong(self, probe: Probe, at: float) -> List[Tuple[str, bytes]]:
        sent = self._outstanding.pop(probe.nonce, None)
        if sent is None or sent != probe:
            return []  # stale, duplicated or forged
        peer = BROKER if probe.target == self.node else probe.target
        total = (at - sent.sent_at) * 1000.0
        # The peer's hold is its word: it can make itself look nearer only by what its answer
        # took (never below 0), and farther only as a slow answer already could.
        self.record(peer, max(0.0, total - min(probe.hold_ms, total)), "broker")
        return []

    def record(self, peer: str, rtt_ms: float, via: str = "echo") -> None:
        self.row.add(peer, rtt_ms, via)
        self.dirty = True

    def publish_due(self, now: float) -> bool:
        """Whether to publish the retained row now (True also records `now` as that time).

        Every node reads every row, so each publication costs the broker N deliveries of O(N)
        bytes (docs/scale.md). Every pong changes the smoothed row a little; publishing each change
        sent it about 0.08 N times a second. Now at most once a period, and only when a peer
        came or went or an RTT moved by more than `CHANGE` (and `CHANGE_FLOOR_MS`), else once every
        `refresh` seconds: a steady fleet publishes a row per node every 30 s, and placement
        still sees a link that got slower within a period."""
        if not self.dirty or (self._published_at is not None and now - self._published_at < self.period):
            return False
        if self._published_at is not None and now - self._published_at < self.refresh and not self._moved():
            return False
        self._published_at = now
        return True

    def _moved(self) -> bool:
        if set(self.row.value) != set(self._published):
            return True
        return any(abs(v - self._published[p]) > max(CHANGE * self._published[p], CHANGE_FLOOR_MS)
                   for p, v in self.row.value.items())

    def rtt(self, peer: str) -> Optional[float]:
        return self.row.value.get(peer)

    def retained(self, now: float) -> Tuple[str, bytes]:
        """The retained document (read by fogctl and agent.node.nodestate: key "rtt_ms").

        Only what its readers use: every node receives every row, so each byte a peer costs is
        paid N^2 times (the last sample, sample counts and paths stay in `self.row`)."""
        self.dirty = False
        self._published = dict(self.row.value)
        doc: Dict[str, Any] = {
            "node": self.node,
            "ts": now,
            "rtt_ms": {p: round(v, 3) for p, v in sorted(self.row.value.items()) if p != BROKER},
            "broker_rtt_ms": round(self.row.value[BROKER], 3) if BROKER in self.row.value else None,
            "lost": self.lost,
            "period": self.period,
        }
        if self.emulated:
            doc["emulated_ms"] = dict(sorted(self.emulated.items()))
        return topics.latency(self.cluster, self.node), json.dumps(doc, sort_keys=True).encode()


def received_at(msg: Any, now: float, clock: Callable[[], float]) -> float:
    """When an MQTT message arrived: paho stamps `msg.timestamp` with time.monotonic on its
    network thread as it reads the PUBLISH, before the loop that owns the client handles it.
    Usable only when `clock` is that same clock (a test's fake clock is not): else `now`."""
    ts = getattr(msg, "timestamp", None)
    if clock is not time.monotonic or isinstance(ts, bool) or not isinstance(ts, (int, float)):
        return now
    return float(ts) if 0 < ts <= now else now


# ---- direct echo ------------------------------------------------------------------------------------


class _TcpEcho(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            data = sock.recv(4096)
            if not data:
                return
            sock.sendall(data)


class _UdpEcho(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        data, sock = self.request
        sock.sendto(data, self.client_address)


class _ThreadingTCP(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True


class EchoServer:
    """TCP and UDP echo on the same port number (0: pick a free TCP port, reuse it for UDP)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.tcp = _ThreadingTCP((host, port), _TcpEcho)
        self.port = self.tcp.server_address[1]
        try:
            self.udp: Optional[socketserver.UDPServer] = socketserver.ThreadingUDPServer((host, self.port), _UdpEcho)
        except OSError:
            self.udp = None  # the UDP port is taken: TCP echo only
        self._threads: List[threading.Thread] = []

    def start(self) -> "EchoServer":
        for srv in (self.tcp, self.udp):
            if srv is not None:
                t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
                t.start()
                self._threads.append(t)
        return self

    def stop(self) -> None:
        for srv in (self.tcp, self.udp):
            if srv is not None:
                srv.shutdown()
                srv.server_close()


def tcp_rtt(host: str, port: int, count: int = 3, timeout: float = 5.0,
            clock: Callable[[], float] = time.perf_counter) -> List[float]:
    """RTT samples in ms over one TCP connection (connection set-up is not measured)."""
    out = []
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(count):
            msg = b"fog-echo %08d\n" % i
            t0 = clock()
            s.sendall(msg)
            got = b""
            while len(got) < len(msg):
                chunk = s.recv(len(msg) - len(got))
                if not chunk:
                    raise ConnectionError(f"echo {host}:{port} closed the connection")
                got += chunk
            out.append((clock() - t0) * 1000.0)
            if got != msg:
                raise ConnectionError(f"echo {host}:{port} answered {got!r}, expected {msg!r}")
    return out


def udp_rtt(host: str, port: int, count: int = 3, timeout: float = 2.0,
            clock: Callable[[], float] = time.perf_counter) -> List[float]:
    """RTT samples in ms over UDP; a lost datagram is skipped (fewer samples)."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        for i in range(count):
            msg = b"fog-echo %08d" % i
            t0 = clock()
            s.sendto(msg, (host, port))
            try:
                while True:
                    data, _ = s.recvfrom(64)
                    if data == msg:
                        break
            except socket.timeout:
                continue
            out.append((clock() - t0) * 1000.0)
    return out


# ---- standalone MQTT driver -------------------------------------------------------------------------


class MqttLatencyAgent:
    """Drives a LatencyCore with its own paho client. paho's network thread only enqueues; all
    publishing happens in this object's own thread (paho is not thread-safe for publishing)."""

    def __init__(self, core: LatencyCore, host: str, port: int, client_id: Optional[str] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.core = core
        self.clock = clock
        self.inbox: "queue.Queue[Tuple[str, bytes, float]]" = queue.Queue()
        self.connected = threading.Event()
        self._broker = mqttc.broker_from(host, port)
        # MQTT 3.1.1, clean session; TCP_NODELAY (a pong behind an unacked packet waits ~40 ms)
        self.client = mqttc.make_client(self._broker, client_id or f"lat-{core.node}", mqttc.CLEAN_311)
        self.client.on_connect = self._on_connect
        self.bad_messages = 0
        # a retained probe is never legitimate (docs/security.md): dropped here
        self.client.on_message = lambda c, u, m: m.retain or self.inbox.put((m.topic, m.payload, self.clock()))
        self.host, self.port = host, port
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _on_connect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any = None) -> None:
        for t in self.core.subscriptions():
            client.subscribe(t, qos=0)
        self.connected.set()

    def _publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        info = self.client.publish(topic, payload, qos=0 if not retain else 1, retain=retain)
        if info.rc != 0:
            raise RuntimeError(f"publish to {topic} failed with paho rc {info.rc}")

    def start(self) -> "MqttLatencyAgent":
        mqttc.connect_and_wait(self.client, self._broker, mqttc.CLEAN_311, timeout=10)  # ConnectFailed
        time.sleep(0.05)  # let the SUBACKs arrive before anybody pings us
        self._thread = threading.Thread(target=self._run, name=f"latency-{self.core.node}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            now = self.clock()
            for topic, payload in self.core.poll(now):
                self._publish(topic, payload)
            try:
                topic, payload, at = self.inbox.get(timeout=0.01)
            except queue.Empty:
                pass
            else:
                self._handle(topic, payload, at)
                while True:
                    try:
                        topic, payload, at = self.inbox.get_nowait()
                    except queue.Empty:
                        break
                    self._handle(topic, payload, at)
            if self.core.publish_due(self.clock()):  # a change waiting for its period goes out without new messages
                self._publish(*self.core.retained(time.time()), retain=True)

    def _handle(self, topic: str, payload: bytes, at: float) -> None:
        try:
            out = self.core.on_message(topic, payload, self.clock(), received=at)
        except ValueError:
            self.bad_messages += 1  # a malformed probe: skipped, never the end of this thread
            return
        for t, p in out:
            self._publish(t, p)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.client.loop_stop()
        self.client.disconnect()
