"""Shipping closed spool files to the centre: the drivers, over MQTT (chunked, acked, resent) or to a path.

The sans-IO core (`ShipperCore`) and the wire format are in agent.spill.shipping; `MqttShipper`
is the thin driver (one paho client, one owner thread) and `PathShipper` the shared-filesystem
variant.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Set, Union

from agent.config import TlsSection
from agent.mqtt import client as mqttc
from agent.spill.landing import LandingZone
from agent.spill.shipping import Ack, Outgoing, ShipperCore, ack_topic, meta_for

__all__ = ["MqttShipper", "PathShipper"]

log = logging.getLogger(__name__)

class PathShipper:
    """Ship to a shared path (NFS, sshfs...): land each closed file there directly, then release.

    The shared path is a landing zone: the same verification and exactly-once rename as the
    collector's (`agent.spill.landing`)."""

    def __init__(self, spool: Any, landing_dir: Union[str, Path]) -> None:
        self.spool = spool
        self.landing = LandingZone(landing_dir)
        self.stats = {"landed": 0, "duplicates": 0}

    def ship_once(self) -> int:
        n = 0
        for f in self.spool.closed_files():
            data = f.path.read_bytes()
            result = self.landing.land(meta_for(f, data), data, decode=False)
            self.stats["landed" if result.status == "landed" else "duplicates"] += 1
            self.spool.release(f)
            n += 1
        return n


# MQTT 3.1.1, persistent (clean_session false): acks queue for us while we reconnect.
SESSION = mqttc.Session(mqtt5=False, persistent=True)


class MqttShipper:
    """Driver: one thread owns one paho client; ships the spool's closed files until stopped.

    `tamper` (tests only) may rewrite an outgoing message before it is published -- the way the
    collector tests damage a chunk on the wire. `tls`: the agent's `[mqtt.tls]` section, so the
    shipper connects with the node's certificate like the agent and its workers (the broker's ACL
    lets only that identity write `spill/<node>/chunk` and read its acks).
    """

    def __init__(self, spool: Any, cluster: str, *, host: str = "127.0.0.1", port: int = 1883,
                 client_id: Optional[str] = None, chunk_bytes: int = 256 * 1024,
                 ack_timeout: float = 5.0, max_backoff: float = 60.0, window: int = 4,
                 poll_interval: float = 0.1, clock: Callable[[], float] = time.monotonic,
                 tamper: Optional[Callable[[Outgoing], Outgoing]] = None,
                 username: Optional[str] = None, password: Optional[str] = None,
                 tls: Optional[TlsSection] = None) -> None:
        self.spool, self.cluster, self.host, self.port = spool, cluster, host, port
        self.tls = tls
        self.broker = mqttc.broker_from(host, port, tls, username, password)
        # default: the node's shipper id, bound to its key (docs/security.md, "Client ids")
        self.client_id = client_id or mqttc.shipper_id(self.broker, cluster, spool.node)
        self.core = ShipperCore(cluster, spool.node, chunk_bytes=chunk_bytes, ack_timeout=ack_timeout,
                                max_backoff=max_backoff, window=window)
        self.poll_interval, self.clock, self.tamper = poll_interval, clock, tamper
        self.username, self.password = username, password
        self._acks: "queue.Queue[bytes]" = queue.Queue()
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._client: Any = None
        self._added: Set[str] = set()  # spool file paths handed to the core (read + hashed once)

    def start(self) -> "MqttShipper":
        c = mqttc.make_client(self.broker, self.client_id, SESSION, max_inflight=100, max_queued=0,
                              reconnect_delay=(0.2, 5))
        c.on_connect = self._on_connect
        c.on_disconnect = lambda *a: self._connected.clear()
        c.on_message = lambda _c, _u, msg: self._acks.put(msg.payload)
        mqttc.connect(c, self.broker, SESSION, blocking=False)
        c.loop_start()
        self._client = c
        self._thread = threading.Thread(target=self._run, name=f"shipper-{self.spool.node}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._client is not None:
            self._client.disconnect()
            self._client.loop_stop()

    def wait_idle(self, timeout: float) -> bool:
        """True once every closed spool file is acked (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.spool.closed_files() and self.core.pending == 0:
                return True
            time.sleep(0.05)
        return False

    def _on_connect(self, client: Any, _u: Any, _flags: Any, rc: Any, _p: Any = None) -> None:
        if getattr(rc, "is_failure", False):
            return
        client.subscribe(ack_topic(self.cluster, self.spool.node), qos=1)
        self._connected.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception:  # keep shipping; a bad file or a broker hiccup must not stop the thread
                log.exception("shipper step failed")
            self._stop.wait(self.poll_interval)

    def _step(self) -> None:
        now = self.clock()
        while True:
            try:
                payload = self._acks.get_nowait()
            except queue.Empty:
                break
            try:
                ack = Ack.decode(payload)
            except (ValueError, KeyError) as exc:
                log.warning("ignoring malformed spill ack: %s", exc)
                continue
            token = self.core.on_ack(ack, now)
            if token is not None:
                self.spool.release(token)
                self._added.discard(str(token.path))
        if self.core.pending < self.core.window:
            for f in self.spool.closed_files():
                if str(f.path) in self._added:
                    continue
                data = f.path.read_bytes()
                self.core.add(meta_for(f, data), data, f)
                self._added.add(str(f.path))
                if self.core.pending >= 2 * self.core.window:
                    break
        if not self._connected.is_set():
            return
        for out in self.core.poll(now):
            msg = self.tamper(out) if self.tamper else out
            info = self._client.publish(msg.topic, msg.payload, qos=1)
            if info.rc != 0:  # MQTT_ERR_SUCCESS
                self.core.send_failed(out.file_id, now)
