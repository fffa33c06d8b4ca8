"""The collector process: one paho client (persistent session), the core, the batch scheduler.

Why a persistent session (clean_session=False, stable client id, QoS 1 subscription): while the
collector is down the broker queues the agents' chunks for it, so a restart resumes where it
stopped; chunks the broker could not queue are resent by the shippers after their ack timeout.
paho callbacks only enqueue; the main loop owns the core and the landing zone (one owner).

Who it is on the bus (docs/security.md, "Identities"): with `[mqtt.tls]` the client certificate's
CN, which the broker takes as the user name and the mosquitto role lists in
`mosquitto_collector_identities`; its ACL lets it read every listed node's
`spill/<node>/chunk` and write `spill/<node>/ack`, nothing else. A chunk's sender is the node in
its topic, never the one its header claims (`CollectorCore.on_chunk`).
"""

from __future__ import annotations

import logging
import queue
import subprocess
import sys
import threading
import time
from typing import Any, List, Optional, Tuple

from agent import topics
from agent.collector.core import CollectorCore
from agent.spill.landing import LandingZone
from agent.config import TlsSection
from agent.mqtt import client as mqttc
from agent.spill.shipping import chunk_subscription

__all__ = ["BatchScheduler", "Collector"]

# MQTT 3.1.1, persistent (clean_session false): the broker queues chunks while we are away.
SESSION = mqttc.Session(mqtt5=False, persistent=True)

log = logging.getLogger(__name__)


class BatchScheduler:
    """Decides when to run the analytics job: by time and/or by count of newly landed files.

    Pure decision (`due(now)`) plus a runner that starts one subprocess at a time, so that the
    collector never holds a JVM and a slow job never overlaps the next one."""

    def __init__(self, landing: str, out: str, master: str, schedule_seconds: float,
                 trigger_files: int, now: float) -> None:
        self.landing, self.out, self.master = landing, out, master
        self.schedule_seconds, self.trigger_files = schedule_seconds, trigger_files
        self.new_files = 0
        self.last_run = now
        self.proc: Optional[subprocess.Popen] = None
        self.runs = 0

    def landed(self, n: int = 1) -> None:
        self.new_files += n

    def due(self, now: float) -> bool:
        if self.new_files == 0 or (self.proc is not None and self.proc.poll() is None):
            return False
        if self.trigger_files and self.new_files >= self.trigger_files:
            return True
        return bool(self.schedule_seconds) and now - self.last_run >= self.schedule_seconds

    def command(self) -> List[str]:
        return [sys.executable, "-m", "agent", "analytics", "run", "--landing", self.landing,
                "--out", self.out, "--master", self.master]

    def maybe_run(self, now: float) -> bool:
        if not self.due(now):
            return False
        log.info("starting the batch job on %d new files: %s", self.new_files, " ".join(self.command()))
        self.proc = subprocess.Popen(self.command())
        self.new_files, self.last_run = 0, now
        self.runs += 1
        return True


class Collector:
    def __init__(self, cluster: str, landing_dir: str, *, host: str = "127.0.0.1", port: int = 1883,
                 client_id: str = "fog-collector", partial_timeout: float = 600.0,
                 scheduler: Optional[BatchScheduler] = None, username: Optional[str] = None,
                 password: Optional[str] = None, tls: Optional[TlsSection] = None) -> None:
        self.cluster, self.host, self.port, self.client_id = cluster, host, port, client_id
        self.landing = LandingZone(landing_dir)
        self.core = CollectorCore(cluster, self.landing.land, self.landing.contains, partial_timeout)
        self.scheduler = scheduler
        self.username, self.password, self.tls = username, password, tls
        self.bad_messages = 0  # messages the loop could not handle (counted, logged, skipped)
        self._inbox: "queue.Queue[Tuple[str, bytes, bool]]" = queue.Queue()
        self._stop = threading.Event()
        self._client: Any = None
        self._thread: Optional[threading.Thread] = None
        self.connected = threading.Event()
        # The broker settings, and the client id bound to our key (docs/security.md, "Client ids").
        self.broker = mqttc.broker_from(host, port, tls, username, password)
        self.session_id = mqttc.client_id(client_id, mqttc.node_secret(self.broker))
        self._connect_log = mqttc.FailureLog(host, port, log, logging.ERROR, who="collector")

    # Run in the foreground (the CLI) or in a thread (tests) ----------------------------------

    def start(self) -> "Collector":
        self._connect()
        self._thread = threading.Thread(target=self._loop, name="collector", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._connect()
        try:
            self._loop()
        finally:
            self._disconnect()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._disconnect()

    def _connect(self) -> None:
        c = mqttc.make_client(self.broker, self.session_id, SESSION, max_inflight=100, reconnect_delay=(0.2, 5))
        c.on_connect = self._on_connect
        mqttc.FailureLog.watch(c, self._connect_log.failed)  # paho's thread: logs, touches no state of ours
        c.on_disconnect = lambda *a: self.connected.clear()
        c.on_message = lambda _c, _u, msg: self._inbox.put((msg.topic, msg.payload, bool(msg.retain)))
        mqttc.connect(c, self.broker, SESSION, blocking=False)
        c.loop_start()
        self._client = c

    def _disconnect(self) -> None:
        if self._client is not None:
            self._client.disconnect()
            self._client.loop_stop()
            self._client = None

    def _on_connect(self, client: Any, _u: Any, _flags: Any, rc: Any, _p: Any = None) -> None:
        if getattr(rc, "is_failure", False):
            self._connect_log.failed(f"the broker refused the connection: {rc}")
            return
        self._connect_log.connected()
        client.subscribe(chunk_subscription(self.cluster), qos=1)
        self.connected.set()

    def _handle(self, topic: str, payload: bytes, retained: bool, now: float) -> None:
        """One chunk: land it, answer the node named by its topic. Bus input never ends the loop:
        what cannot be handled is counted, logged in one line naming the topic, and skipped.
        A shipper never retains a chunk; a retained one would be replayed at every subscription."""
        parsed = topics.parse(self.cluster, topic)
        if parsed is None or parsed.kind != "spill_chunk" or parsed.node is None or retained:
            self.bad_messages += 1
            log.warning("ignoring a message on %.200r: %s", topic,
                        "retained" if parsed is not None and retained else "not a spill chunk topic")
            return
        before = self.core.stats["files_landed"]
        try:
            for reply in self.core.on_chunk(payload, now, sender=parsed.node):
                self._client.publish(reply.topic, reply.ack.encode(), qos=1)
        except Exception as exc:  # noqa: BLE001 - a chunk that breaks the core must not stop the collector
            self.bad_messages += 1
            log.warning("skipping a spill chunk on %s: %s: %.200s", topic, type(exc).__name__, exc)
        if self.scheduler is not None:
            self.scheduler.landed(self.core.stats["files_landed"] - before)

    def _loop(self) -> None:
        last_expire = time.monotonic()
        while not self._stop.is_set():
            try:
                message: Optional[Tuple[str, bytes, bool]] = self._inbox.get(timeout=0.2)
            except queue.Empty:
                message = None
            now = time.monotonic()
            if message is not None:
                self._handle(*message, now)
            if now - last_expire > 5.0:
                self.core.expire(now)
                last_expire = now
            if self.scheduler is not None:
                self.scheduler.maybe_run(time.time())
