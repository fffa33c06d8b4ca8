"""The collector process: one paho client (persistent session), the core, the batch scheduler.

Why a persistent session (clean_session=False, stable client id, QoS 1 subscription): while the
collector is down the broker queues the agents' chunks for it, so a restart resumes where it
stopped; chunks the broker could not queue are resent by the shippers after their ack timeout.
paho callbacks only enqueue; the main loop owns the core and the landing zone (one owner).
"""

from __future__ import annotations

import logging
import queue
import subprocess
import sys
import threading
import time
from typing import Any, List, Optional

from agent.collector.core import CollectorCore
from agent.collector.landing import LandingZone
from agent.runtime.shipper import chunk_subscription

__all__ = ["BatchScheduler", "Collector"]

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
                 password: Optional[str] = None) -> None:
        self.cluster, self.host, self.port, self.client_id = cluster, host, port, client_id
        self.landing = LandingZone(landing_dir)
        self.core = CollectorCore(cluster, self.landing.land, self.landing.contains, partial_timeout)
        self.scheduler = scheduler
        self.username, self.password = username, password
        self._inbox: "queue.Queue[bytes]" = queue.Queue()
        self._stop = threading.Event()
        self._client: Any = None
        self._thread: Optional[threading.Thread] = None
        self.connected = threading.Event()

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
        import paho.mqtt.client as mqtt

        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.client_id, clean_session=False)
        if self.username:
            c.username_pw_set(self.username, self.password)
        c.max_inflight_messages_set(100)
        c.on_connect = self._on_connect
        c.on_disconnect = lambda *a: self.connected.clear()
        c.on_message = lambda _c, _u, msg: self._inbox.put(msg.payload)
        c.reconnect_delay_set(0.2, 5)
        c.connect_async(self.host, self.port, keepalive=10)
        c.loop_start()
        self._client = c

    def _disconnect(self) -> None:
        if self._client is not None:
            self._client.disconnect()
            self._client.loop_stop()
            self._client = None

    def _on_connect(self, client: Any, _u: Any, _flags: Any, rc: Any, _p: Any = None) -> None:
        if getattr(rc, "is_failure", False):
            log.error("collector cannot connect to the broker: %s", rc)
            return
        client.subscribe(chunk_subscription(self.cluster), qos=1)
        self.connected.set()

    def _loop(self) -> None:
        last_expire = time.monotonic()
        while not self._stop.is_set():
            try:
                payload = self._inbox.get(timeout=0.2)
            except queue.Empty:
                payload = None
            now = time.monotonic()
            if payload is not None:
                before = self.core.stats["files_landed"]
                for reply in self.core.on_chunk(payload, now):
                    self._client.publish(reply.topic, reply.ack.encode(), qos=1)
                if self.scheduler is not None:
                    self.scheduler.landed(self.core.stats["files_landed"] - before)
            if now - last_expire > 5.0:
                self.core.expire(now)
                last_expire = now
            if self.scheduler is not None:
                self.scheduler.maybe_run(time.time())
