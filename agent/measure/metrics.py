"""Prometheus metrics of an agent and its workers (prometheus_client, multiprocess mode).

Why multiprocess mode: every operator instance is its own worker process, and the agent serves
one endpoint per node. prometheus_client's multiprocess mode has each process write its values
to mmap files in one directory (PROMETHEUS_MULTIPROC_DIR) and the endpoint sums them at scrape
time, so a worker never talks to the agent to report a counter, and a crashed worker's counts
are not lost (counters of dead processes stay in the sum; gauges use "live" modes and the agent
calls `process_exited(pid)` so a dead worker's queue length disappears).

How to use:
    agent (before it imports anything that creates metrics, before it spawns workers):
        d = metrics.enable_multiprocess(state_dir / "metrics")   # sets the env var, clears old files
        m = metrics.Metrics()                                     # node-level metrics
        server = metrics.serve(cfg.metrics.port, cfg.metrics.address)   # None when port == 0
        ...  m.instances.labels(pipeline, operator).set(n); m.reconnect("agent")
        ...  on worker exit: metrics.process_exited(pid)
    worker (inherits PROMETHEUS_MULTIPROC_DIR through its environment):
        m = metrics.Metrics()
        im = m.instance(pipeline, operator, instance)
        im.records_in.inc(len(batch)); im.records_out.inc(k); im.records_invalid.inc(bad)
        im.queue.set(len(inbox)); im.load_ratio.set(load / capacity)
        m.protocol_message("duplication", "out"); m.lock_message("req", "in")
        m.decision(pipeline, operator, "duplicate")

    or, without touching the worker, from its heartbeat stats in the agent:
        bridge = metrics.StatsBridge(m); bridge.observe(pipeline, operator, instance, stats)

Names (all prefixed `fog_`, documented in docs/fogctl.md): see `METRICS` below.
"""

from __future__ import annotations

import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

__all__ = [
    "METRICS", "Metrics", "InstanceMetrics", "MetricsServer", "StatsBridge", "enable_multiprocess",
    "process_exited", "serve", "render", "ENV",
]

ENV = "PROMETHEUS_MULTIPROC_DIR"

# name -> (type, help, labels, multiprocess gauge mode)
METRICS: Dict[str, Tuple[str, str, Tuple[str, ...], str]] = {
    "fog_records_in_total": ("counter", "Records received by an operator instance",
                             ("pipeline", "operator", "instance"), ""),
    "fog_records_out_total": ("counter", "Records emitted by an operator instance to its successors",
                              ("pipeline", "operator", "instance"), ""),
    "fog_records_invalid_total": ("counter", "Records dropped on purpose as invalid input (counted, logged)",
                                  ("pipeline", "operator", "instance"), ""),
    "fog_queue_length": ("gauge", "Records waiting in an instance's queue",
                         ("pipeline", "operator", "instance", "queue"), "livesum"),
    "fog_load_ratio": ("gauge", "Load over capacity (l_t / C) of an instance at its last decision",
                       ("pipeline", "operator", "instance"), "livesum"),
    "fog_instances": ("gauge", "Operator instances hosted by this node, by phase",
                      ("pipeline", "operator", "phase"), "livesum"),
    "fog_protocol_messages_total": ("counter", "Scaling protocol messages by type and direction",
                                    ("type", "direction"), ""),
    "fog_lock_messages_total": ("counter", "2-FGME lock messages by kind and direction",
                                ("kind", "direction"), ""),
    "fog_scaling_decisions_total": ("counter", "Scaling decisions by action (duplicate, terminate, none)",
                                    ("pipeline", "operator", "action"), ""),
    "fog_spool_bytes": ("gauge", "Bytes waiting in the spill spool", (), "livesum"),
    "fog_spool_files": ("gauge", "Files waiting in the spill spool", (), "livesum"),
    "fog_mqtt_reconnects_total": ("counter", "MQTT reconnections by client (agent or instance id)",
                                  ("client",), ""),
}


def enable_multiprocess(directory: Union[str, Path], clear: bool = True) -> Path:
    """Point this process and its future children at `directory` for metric files.

    Call it in the agent before creating any metric; `clear` removes the files of a previous run
    (their pids may be reused by new workers and would add stale counts).
    """
    path = Path(directory)
    if clear and path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    os.environ[ENV] = str(path)
    import prometheus_client.values as values

    # The value class is chosen at import time from the environment: re-choose it now.
    values.ValueClass = values.get_value_class()
    return path


def multiprocess_dir() -> Optional[str]:
    d = os.environ.get(ENV)
    return d if d and os.path.isdir(d) else None


def process_exited(pid: int) -> None:
    """The agent calls this when a worker exits: its live gauges leave the sums."""
    if multiprocess_dir():
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


@dataclass(frozen=True)
class InstanceMetrics:
    """The children of one instance, bound to its labels (cheap to call in the data path)."""

    records_in: Any
    records_out: Any
    records_invalid: Any
    queue: Any
    outbox: Any
    load_ratio: Any


class Metrics:
    """All metric families of one process; in single-process mode they live in `self.registry`."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        if registry is None:
            # Multiprocess: values go to files, the registry only avoids the global default one.
            registry = CollectorRegistry(auto_describe=True)
        self.registry = registry
        self._m: Dict[str, Any] = {}
        for name, (kind, help_text, labels, mode) in METRICS.items():
            if kind == "counter":
                self._m[name] = Counter(name[: -len("_total")], help_text, labels, registry=registry)
            else:
                self._m[name] = Gauge(name, help_text, labels, registry=registry, multiprocess_mode=mode)
        self.instances = self._m["fog_instances"]
        self.spool_bytes = self._m["fog_spool_bytes"]
        self.spool_files = self._m["fog_spool_files"]
        self._lock = threading.Lock()

    def __getitem__(self, name: str) -> Any:
        return self._m[name]

    def instance(self, pipeline: str, operator: str, instance: str) -> InstanceMetrics:
        labels = (pipeline, operator, instance)
        return InstanceMetrics(
            records_in=self._m["fog_records_in_total"].labels(*labels),
            records_out=self._m["fog_records_out_total"].labels(*labels),
            records_invalid=self._m["fog_records_invalid_total"].labels(*labels),
            queue=self._m["fog_queue_length"].labels(*labels, "inbox"),
            outbox=self._m["fog_queue_length"].labels(*labels, "outbox"),
            load_ratio=self._m["fog_load_ratio"].labels(*labels),
        )

    def protocol_message(self, type: str, direction: str, n: int = 1) -> None:
        self._m["fog_protocol_messages_total"].labels(type, direction).inc(n)

    def lock_message(self, kind: str, direction: str, n: int = 1) -> None:
        self._m["fog_lock_messages_total"].labels(kind, direction).inc(n)

    def decision(self, pipeline: str, operator: str, action: str) -> None:
        self._m["fog_scaling_decisions_total"].labels(pipeline, operator, action).inc()

    def reconnect(self, client: str) -> None:
        self._m["fog_mqtt_reconnects_total"].labels(client).inc()

    def set_instances(self, counts: Dict[Tuple[str, str, str], int]) -> None:
        """Replace the per-(pipeline, operator, phase) counts of this node (absent -> 0)."""
        g = self.instances
        with self._lock:
            for key in list(getattr(self, "_last_counts", {})):
                if key not in counts:
                    g.labels(*key).set(0)
            for key, n in counts.items():
                g.labels(*key).set(n)
            self._last_counts = dict(counts)

    def observe_node(self, workers: Any, spill: Any = None) -> None:
        """The node-level gauges, from what the agent holds: its workers (fog_instances) and its
        spill's closed files waiting to be shipped (fog_spool_bytes, fog_spool_files)."""
        self.set_instances(self.instance_counts(workers))
        view = getattr(spill, "view", None)
        if view is not None:
            try:
                files = view.closed_files()
            except OSError:
                return
            self.set_spool(sum(f.size for f in files), len(files))

    @staticmethod
    def instance_counts(workers: Any) -> Dict[Tuple[str, str, str], int]:
        """(pipeline, operator, phase) -> instances, from the supervisor's workers; the phases are
        fogctl's: starting (not ready, or created and not yet started by its creator), active,
        terminating (stopping, or its protocol core is deleting/departing)."""
        counts: Dict[Tuple[str, str, str], int] = {}
        for w in workers:
            status = getattr(w.status, "value", str(w.status))
            state = w.stats.get("state") if isinstance(w.stats, dict) else None
            if status == "terminating" or state in ("deleting", "departing", "terminated"):
                phase = "terminating"
            elif status == "active" and state != "idle":
                phase = "active"
            else:
                phase = "starting"
            key = (w.spec.pipeline, w.spec.operator, phase)
            counts[key] = counts.get(key, 0) + 1
        return counts

    def set_spool(self, nbytes: int, nfiles: int) -> None:
        self.spool_bytes.set(nbytes)
        self.spool_files.set(nfiles)


# Worker heartbeat stats (agent.instance.worker.snapshot_stats) -> metric, for StatsBridge.
STATS_COUNTERS: Dict[str, Tuple[str, ...]] = {
    "fog_records_in_total": ("records_in",),
    "fog_records_out_total": ("records_out",),
    "fog_records_invalid_total": ("malformed", "operator_errors", "invalid"),
}
STATS_DECISIONS: Dict[str, str] = {"scale_outs": "duplicate", "scale_ins": "terminate"}


class StatsBridge:
    """Export workers' cumulative heartbeat stats from the agent process (an alternative wiring).

    Why: the agent already receives every worker's counters on its control pipe once per
    heartbeat; turning them into Prometheus counters there needs no change in the worker's data
    path. Counters grow by the difference to the previous heartbeat; a worker restarted with the
    same id starts again from 0, which is read as a reset (the new value is added), so the
    exported counter equals the sum of everything every incarnation reported.
    """

    def __init__(self, m: Metrics) -> None:
        self.m = m
        self._last: Dict[Tuple[str, str], float] = {}

    def observe(self, pipeline: str, operator: str, instance: str, stats: Dict[str, Any],
                capacity: Optional[float] = None) -> None:
        im = self.m.instance(pipeline, operator, instance)
        children = {"fog_records_in_total": im.records_in, "fog_records_out_total": im.records_out,
                    "fog_records_invalid_total": im.records_invalid}
        for name, keys in STATS_COUNTERS.items():
            self._advance(children[name], (instance, name), sum(_count(stats.get(k)) for k in keys))
        for key, action in STATS_DECISIONS.items():
            if key in stats:
                child = self.m["fog_scaling_decisions_total"].labels(pipeline, operator, action)
                self._advance(child, (instance, key), _count(stats.get(key)))
        # The worker counts its scaling protocol messages, not their types: exported as type="all"
        # (`Metrics.protocol_message` keeps per-type counts for a caller that knows them).
        for direction in ("in", "out"):
            if f"protocol_{direction}" in stats:
                child = self.m["fog_protocol_messages_total"].labels("all", direction)
                self._advance(child, (instance, f"protocol_{direction}"), _count(stats.get(f"protocol_{direction}")))
        if "reconnects" in stats:
            self._advance(self.m["fog_mqtt_reconnects_total"].labels(instance), (instance, "reconnects"),
                          _count(stats.get("reconnects")))
        locks = stats.get("lock_messages")  # 2-FGME messages by direction and kind (worker stats)
        if isinstance(locks, dict):
            for direction in ("in", "out"):
                by_kind = locks.get(direction)
                for kind, n in sorted(by_kind.items()) if isinstance(by_kind, dict) else ():
                    child = self.m["fog_lock_messages_total"].labels(str(kind), direction)
                    self._advance(child, (instance, f"lock_{direction}_{kind}"), _count(n))
        if "queued" in stats:
            im.queue.set(_count(stats.get("queued")))
        if "outbox" in stats:
            im.outbox.set(_count(stats.get("outbox")))
        cap = capacity if capacity is not None else stats.get("capacity")
        load = stats.get("load")
        if isinstance(load, (int, float)) and isinstance(cap, (int, float)) and cap > 0:
            im.load_ratio.set(float(load) / float(cap))

    def _advance(self, child: Any, key: Tuple[str, str], total: float) -> None:
        last = self._last.get(key, 0.0)
        delta = total - last if total >= last else total  # smaller: the worker restarted
        if delta > 0:
            child.inc(delta)
        self._last[key] = total

    def forget(self, instance: str) -> None:
        """The instance left for good (not a restart): drop its remembered totals."""
        for key in [k for k in self._last if k[0] == instance]:
            del self._last[key]


def _count(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 else 0.0


def _collecting_registry(registry: Any = None) -> Any:
    """What a scrape reads: the multiprocess files when enabled, else `registry`."""
    from prometheus_client import REGISTRY, CollectorRegistry

    d = multiprocess_dir()
    if d:
        from prometheus_client import multiprocess

        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg, path=d)
        return reg
    return registry if registry is not None else REGISTRY


def render(registry: Any = None) -> str:
    """The text exposition a scrape would get (used by tests and `fog-agent` diagnostics)."""
    from prometheus_client import generate_latest

    return generate_latest(_collecting_registry(registry)).decode("utf-8")


class MetricsServer:
    """The agent's HTTP endpoint (`/metrics`) on a daemon thread; `port` is the bound port."""

    def __init__(self, port: int, address: str = "127.0.0.1", registry: Any = None) -> None:
        from wsgiref.simple_server import WSGIRequestHandler, make_server

        from prometheus_client import make_wsgi_app
        from prometheus_client.exposition import ThreadingWSGIServer

        class _Quiet(WSGIRequestHandler):
            def log_message(self, *args: Any) -> None:  # scrapes every 15 s must not fill the journal
                pass

        # Build the registry per scrape: workers started after the server must be seen too.
        inner = registry

        def app(environ: Dict[str, Any], start_response: Any) -> List[bytes]:
            return make_wsgi_app(_collecting_registry(inner))(environ, start_response)

        self.httpd = make_server(address, port, app, ThreadingWSGIServer, handler_class=_Quiet)
        self.address = address
        self.port = self.httpd.server_port
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="metrics-http", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}/metrics"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def serve(port: int, address: str = "127.0.0.1", registry: Any = None, ephemeral: bool = False) -> Optional[MetricsServer]:
    """Start the endpoint on `[metrics].port`; port 0 disables it unless `ephemeral` (tests)."""
    if port == 0 and not ephemeral:
        return None
    return MetricsServer(port, address, registry)
