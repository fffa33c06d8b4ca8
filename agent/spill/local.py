"""The agent's side of the spill (`[spill] enabled = true`): settings for its sink workers, its
own spool of per-instance metrics and protocol events, and the shipper of every closed file.

Layout under `[spill].spool_dir` (one root per agent):

    <root>/_agent/{open,closed}/       this daemon's spool: kinds "metrics" and "events"
    <root>/<instance>/{open,closed}/   one spool per sink worker (written by the worker itself)

Why the workers write their own spools: the ack of a batch must wait until its records are
recorded (docs/runtime.md, invariant 5); a sink that handed records to another process would need
one more acknowledged hop. The daemon only *ships*: one shipper (MQTT or path) over every
`closed/` directory under the root (`spool.SpoolDirs`); a worker notices released files when it
recounts its directory (back pressure ends). Rules: this object belongs to the daemon's loop
thread (appends, tick, close); the MQTT shipper has its own thread and paho client, the path
shipper its own thread.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from agent.spill.batchspool import BatchSpool
from agent.spill.spool import Spool, SpoolDirs

__all__ = ["AgentSpill", "AGENT_SPOOL"]

log = logging.getLogger(__name__)

AGENT_SPOOL = "_agent"  # not a valid instance id prefix, so it never collides with a worker's spool
# The spools of sinks that no longer run here are salvaged for shipping this often (`salvage_orphans`).
SALVAGE_PERIOD = 10.0


class AgentSpill:
    def __init__(self, cfg: Any, broker: Any = None) -> None:
        s = cfg.spill
        self.node, self.cluster = cfg.agent.node, cfg.agent.cluster
        self.root = Path(s.spool_dir)
        self.settings = {"dir": str(self.root), "node": self.node, "max_bytes": s.max_bytes,
                         "rotate_bytes": s.rotate_bytes, "rotate_seconds": s.rotate_seconds, "ack": s.ack}
        self.spool = Spool(self.root / AGENT_SPOOL, self.node, max_bytes=s.max_bytes,
                           rotate_bytes=s.rotate_bytes, rotate_seconds=s.rotate_seconds)
        self.view = SpoolDirs(self.root, self.node)
        self.dropped = 0  # metrics/events refused by a full agent spool (counted, logged once)
        self._last_tick = 0.0
        self._salvaged_at = -1e9  # salvage_orphans, every SALVAGE_PERIOD
        self._mqtt: Any = None
        self._path: Any = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if s.ship == "mqtt":
            from agent.config import TlsSection
            from agent.spill.shipper import MqttShipper

            # The node's own identity, like the agent's and its workers': [mqtt.tls] as the
            # daemon checked it (docs/security.md, "Identities").
            tls = (TlsSection(broker.ca_file, broker.cert_file, broker.key_file, broker.tls_insecure)
                   if broker.ca_file else None)
            self._mqtt = MqttShipper(self.view, self.cluster, host=broker.host, port=broker.port,
                                     username=broker.username, password=broker.password, tls=tls).start()
        elif s.ship == "path":
            from agent.spill.shipper import PathShipper

            if not s.ship_path:
                raise ValueError('[spill] ship = "path" needs ship_path')
            self._path = PathShipper(self.view, s.ship_path)
            self._thread = threading.Thread(target=self._ship_loop, name="spill-path", daemon=True)
            self._thread.start()

    @classmethod
    def maybe(cls, cfg: Any, broker: Any = None) -> Optional["AgentSpill"]:
        return cls(cfg, broker) if getattr(cfg, "spill", None) is not None and cfg.spill.enabled else None

    def with_spill(self, spec: Any) -> Any:
        """The spec a local worker starts with: the node's spool settings in `extra["spill"]`
        (node-local, like state_dir: always this agent's, whatever the spec carried; a request's
        own spill settings are dropped where it enters, `Gate.node_local`)."""
        extra = dict(spec.extra)
        extra["spill"] = dict(self.settings)
        return dataclasses.replace(spec, extra=extra)

    def on_heartbeat(self, spec: Any, stats: Mapping[str, Any], ts: float) -> None:
        if not isinstance(stats, Mapping):
            return
        cap = stats.get("capacity", spec.extra.get("capacity"))
        row: Dict[str, Any] = {"ts": ts, "operator": spec.operator, "instance": spec.instance,
                               "load": float(stats.get("load") or 0.0),
                               "capacity": float(cap) if isinstance(cap, (int, float)) else None}
        self._append("metrics", row)

    def on_event(self, payload: Mapping[str, Any]) -> None:
        self._append("events", payload)

    def _append(self, kind: str, row: Mapping[str, Any]) -> None:
        # Metrics and events are observations, not records: when the agent's own spool is full
        # they are counted and logged (not silently lost), never allowed to block the loop.
        if not self.spool.append(kind, row):
            self.dropped += 1
            if self.dropped == 1:
                log.warning("agent spool full: metrics/events not spilled (counted)", extra={"node": self.node})

    def tick(self, now: float, running: Any, lock_dir: Path) -> None:
        """Once per loop turn: the agent spool's rotation (once a second), and every SALVAGE_PERIOD
        the spools of sinks that no longer run here (`running`: our workers' instances) salvaged
        for shipping (`salvage_orphans`)."""
        if now - self._last_tick >= 1.0:
            self._last_tick = now
            self.spool.tick()
        if now - self._salvaged_at >= SALVAGE_PERIOD:
            self._salvaged_at = now
            self.salvage_orphans(set(running), lock_dir)

    def salvage_orphans(self, running: Any, lock_dir: Path) -> int:
        """Close the files left open in the spools of sinks that no longer run here (the node lost
        power and came back while the sink was re-homed elsewhere; a sink that left for good), so
        that the shipper ships them: their records were acked upstream once written there, and
        nobody else holds them. The landing and the analytics count each record id once, so what
        the sink's new incarnation also wrote is not counted twice. A spool whose instance lock is
        held (a worker starting or still draining) is left to that worker. Returns the spools
        salvaged."""
        import fcntl
        import os

        done = 0
        for d in sorted(self.root.iterdir()) if self.root.is_dir() else ():
            if d.name == AGENT_SPOOL or d.name in running or not d.is_dir():
                continue
            opened = d / "open"
            if not opened.is_dir() or not any(opened.iterdir()):
                continue
            fd = os.open(str(lock_dir / f"{d.name}.lock"), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                spool = BatchSpool(d, self.node, max_bytes=self.settings["max_bytes"],
                                   rotate_bytes=self.settings["rotate_bytes"],
                                   rotate_seconds=self.settings["rotate_seconds"])
                spool.close()  # its start-up salvaged the open files; close() waits for their compression
                done += 1
                log.info("spool of %s salvaged: its open files closed for shipping", d.name, extra={"node": self.node})
            except (OSError, ValueError) as exc:
                log.warning("spool of %s not salvaged: %s", d.name, exc, extra={"node": self.node})
            finally:
                os.close(fd)  # releases the lock
        return done

    def _ship_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._path.ship_once()
            except Exception:  # noqa: BLE001 - keep shipping; a bad file must not stop the thread
                log.exception("path shipping failed")
            self._stop.wait(0.5)

    def close(self, ship_timeout: float = 5.0) -> None:
        """Clean shutdown (after the workers stopped, so their spools are closed): close this
        spool, ship what is closed (bounded), stop the shipper. Unshipped files stay for the
        next start."""
        self.spool.close()
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._path.ship_once()
        if self._mqtt is not None:
            self._mqtt.wait_idle(ship_timeout)
            self._mqtt.stop()

    def stats(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"closed_files": len(self.view.closed_files()), "not_spilled": self.dropped}
        if self._mqtt is not None:
            out.update(self._mqtt.core.stats)
        if self._path is not None:
            out.update(self._path.stats)
        return out


def _now() -> float:
    return time.time()
