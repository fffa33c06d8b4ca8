"""`fog-agent bench dataplane`: throughput of the worker data path against the raw broker limit.

Also home of `LocalRunner`, a minimal stand-in for the agent daemon (it plays the agent's side
of the control pipe: starts workers, answers "spawn" by starting another worker and replying
"spawned" once it is ready). Tests and this benchmark use it to run workers without the daemon.

Measured in one run, on one private Mosquitto (docs/runtime.md, "Numbers"):
- raw, one process: a paho publisher and a no-op paho subscriber in one process (one thread,
  one select loop: a worker's per-process equivalent) send pre-encoded batches (the same bytes a
  worker sends: same batch size, same records, QoS 1) through the broker;
- raw, two processes: the same publisher, the subscriber in a child process;
  both raws keep at most `raw_window` batches between publish and the subscriber's receipt (so
  the broker never queues what the subscriber cannot take) and end at the last receipt;
- pipeline: source -> identity -> sink (3 operators of trivial work, one instance each, the
  real worker processes with envelopes, FIFO channels, credit flow control and PUBACK-gated
  acks), records/s at the sink;
- ratio = pipeline / raw one process (goal >= 0.5), and against the two-process raw;
- CPU ms per batch of every process of each part;
- RSS of one idle worker (goal < 40 MB) next to a bare `python -c "import paho.mqtt.client"`;
- alternating (`--rounds`, `--slice`): the raws and the pipelines (whole chain, source -> chain
  of 2, unchained) take turns in short slices, ratio per round to that round's raws and the
  medians, so that a shared machine's load falls on both sides of a ratio alike
  (docs/measurement.md, "Cheap cuts of the data plane, and the data-plane goal").
A phase in which the broker dropped any message (`$SYS/broker/publish/messages/dropped`) fails
the bench (BenchFailed, exit 1): its numbers would count messages that were never delivered.

Why one module: the raw baselines, the pipeline run and the rescale cycles share
the LocalRunner, the broker watch and the report; it is a tool, never imported on a fog node.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import agent
from agent.instance.spec import InstanceSpec, control_line, parse_control_line
from agent.operators.admission import ENV_MODULES
from agent.mqtt.settings import BrokerSpec
from agent.mqtt import client as mqttc
from agent.mqtt.transport import DATA_MQTT5
from foglab.operators import MODULES as OPERATOR_MODULES

__all__ = ["BenchFailed", "DropWatch", "WorkerProc", "ChainProc", "MemberProc", "LocalRunner", "pipeline_toml", "initial_specs", "measure_raw",
           "measure_raw_2proc", "register_bench", "run_bench"]

PY = sys.executable


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {v!r} as TOML")


def pipeline_toml(name: str, operators: Sequence[Dict[str, Any]], scaling: Optional[Dict[str, Any]] = None) -> str:
    """A pipeline description from dicts (tests and benchmarks build pipelines with it)."""
    lines = ["[pipeline]", f"name = {_toml_value(name)}", ""]
    if scaling:
        lines.append("[scaling]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in scaling.items()]
        lines.append("")
    for op in operators:
        lines.append("[[operator]]")
        sub = {}
        for k, v in op.items():
            if k == "scaling":
                sub = v
                continue
            lines.append(f"{k} = {_toml_value(v)}")
        if sub:
            lines.append("[operator.scaling]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in sub.items()]
        lines.append("")
    return "\n".join(lines)


def initial_specs(
    toml_text: str,
    broker: BrokerSpec,
    state_dir: str,
    cluster: str = "bench",
    node: str = "local",
    extra: Optional[Dict[str, Any]] = None,
) -> List[InstanceSpec]:
    """One keeper instance "<operator>-0" per operator, wired in a chain."""
    from agent.config import load_pipeline_text

    cfg = load_pipeline_text(toml_text)
    names = [op.name for op in cfg.operators]
    specs = []
    for i, name in enumerate(names):
        specs.append(
            InstanceSpec(
                instance=f"{name}-0",
                operator=name,
                node=node,
                cluster=cluster,
                pipeline=cfg.pipeline.name,
                pipeline_toml=toml_text,
                broker=broker,
                succs=(f"{names[i + 1]}-0",) if i + 1 < len(names) else (),
                preds=(f"{names[i - 1]}-0",) if i > 0 else (),
                keeper=True,
                state_dir=state_dir,
                heartbeat_period=0.5,
                extra=dict(extra or {}),
            )
        )
    return specs


class _Watched:
    """What the runner knows of one instance from its lines: ready, last stats, exit, events."""

    spec: InstanceSpec
    instance: str
    ready: threading.Event
    exit_info: Optional[Dict[str, Any]]
    stats: Dict[str, Any]
    events: Deque[Dict[str, Any]]

    def _watch(self, spec: InstanceSpec) -> None:
        self.spec = spec
        self.instance = spec.instance
        self.ready = threading.Event()
        self.exit_info = None
        self.stats = {}
        self.events = deque(maxlen=1000)
        # each heartbeat's arrival (monotonic) and a count of them: the alternating slices
        # measure between two heartbeats instead of two sleeps (`next_beat`)
        self.beat = threading.Condition()
        self.beats = 0
        self.stats_at = 0.0

    def next_beat(self, timeout: float = 5.0) -> Tuple[float, Dict[str, Any]]:
        """Wait for the next heartbeat; its arrival time and stats."""
        with self.beat:
            n = self.beats
            if not self.beat.wait_for(lambda: self.beats > n, timeout):
                raise BenchFailed(f"{self.instance}: no heartbeat within {timeout:.0f} s")
            return self.stats_at, self.stats


class _PipedProc:
    """A worker process (one instance, or a chain of several) and our end of its control pipe."""

    proc: subprocess.Popen
    _on_line: Callable[[Any, Dict[str, Any]], None]

    def _open(self, first_line: str, name: str, log_dir: Path, warm: Optional["WarmProc"]) -> None:
        """Take a spare (or start a process), give it its first line, read its lines."""
        self.exited = threading.Event()
        self._lock = threading.Lock()
        if warm is None:
            warm = WarmProc(log_dir, name)
        self.log_path = warm.log_path
        self._log = warm.log
        self.proc = warm.proc
        assert self.proc.stdin is not None
        self.proc.stdin.write(first_line + "\n")
        self.proc.stdin.flush()
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"read-{name}")
        self._reader.start()

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def _view(self, msg: Dict[str, Any]) -> Any:
        """Whom a line is about: this process (one instance), or a chain's member."""
        return self

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = parse_control_line(line)
            except ValueError:
                continue
            view = self._view(msg)
            if view is None:
                continue
            ev = msg["event"]
            if ev == "ready":
                view.ready.set()
            elif ev == "heartbeat":
                with view.beat:
                    view.stats = msg.get("stats", {})
                    view.stats_at = time.monotonic()
                    view.beats += 1
                    view.beat.notify_all()
            elif ev == "exit":
                view.exit_info = msg
            view.events.append(msg)
            self._on_line(view, msg)
        self.proc.wait()
        self.exited.set()

    def send(self, event: str, **fields: Any) -> None:
        with self._lock:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(control_line(event, **fields))
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError, OSError):
                pass

    def stop(self, timeout: float = 15.0) -> Optional[int]:
        self.send("stop")
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                return self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


class WorkerProc(_Watched, _PipedProc):
    """One worker process and our end of its control pipe."""

    def __init__(
        self,
        spec: InstanceSpec,
        log_dir: Path,
        on_line: Callable[["WorkerProc", Dict[str, Any]], None],
        warm: Optional["WarmProc"] = None,
    ) -> None:
        self._watch(spec)
        self._on_line = on_line
        self._open(spec.to_json(), spec.instance, log_dir, warm)


class ChainProc(_PipedProc):
    """One chain process (agent.instance.chain): several instances, one control pipe whose lines
    carry "member". Each member is seen through a `MemberProc` (the WorkerProc interface)."""

    def __init__(
        self,
        specs: Sequence[InstanceSpec],
        log_dir: Path,
        on_line: Callable[["MemberProc", Dict[str, Any]], None],
        warm: Optional["WarmProc"] = None,
    ) -> None:
        from agent.instance.spec import chain_json

        self.specs = list(specs)
        self._on_line = on_line
        self.members: Dict[str, MemberProc] = {s.instance: MemberProc(self, s) for s in specs}
        self._open(chain_json(self.specs), "chain-" + "+".join(s.instance for s in specs), log_dir, warm)

    def _view(self, msg: Dict[str, Any]) -> Any:
        return self.members.get(str(msg.pop("member", "")))


class MemberProc(_Watched):
    """One instance of a chain process, with the interface of a `WorkerProc`: "stop" stops the
    whole chain (upstream first), any other line goes to this member."""

    def __init__(self, chain: ChainProc, spec: InstanceSpec) -> None:
        self.chain = chain
        self._watch(spec)

    @property
    def proc(self) -> subprocess.Popen:
        return self.chain.proc

    @property
    def exited(self) -> threading.Event:
        return self.chain.exited

    @property
    def pid(self) -> int:
        return self.chain.pid

    @property
    def log_path(self) -> Path:
        return self.chain.log_path

    def send(self, event: str, **fields: Any) -> None:
        if event in ("stop", "eof"):
            self.chain.send(event)
        else:
            self.chain.send(event, member=self.instance, **fields)

    def stop(self, timeout: float = 15.0) -> Optional[int]:
        return self.chain.stop(timeout)

    def close(self) -> None:
        self.chain.close()


class WarmProc:
    """A started `python -m agent.instance.worker` that has not been given its spec yet."""

    def __init__(self, log_dir: Path, name: str) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        self.log = open(self.log_path, "ab")
        env = dict(os.environ)
        # The worker's allow-list as an agent of a lab node gives it: the lab's operators too
        # (foglab.operators, on its path), as if its agent.toml listed them in [operators] modules.
        root = os.pathsep.join([str(Path(agent.__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault(ENV_MODULES, ",".join(OPERATOR_MODULES))
        self.proc = subprocess.Popen(
            [PY, "-m", "agent.instance.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
            env=env,
        )

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # EOF before a spec: the worker exits (bad spec)
            except OSError:
                pass
            try:
                self.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _as_agent_sets(spec: InstanceSpec) -> InstanceSpec:
    """The spec fields an agent sets on every worker that the runner plays too: the writer check
    and per-node inboxes (docs/security.md, "Data channels", "Who may read an inbox")."""
    return replace(spec, extra=dict(spec.extra, check_sender_node=True, inbox_per_node=True))


class LocalRunner:
    """Plays the agent for a set of workers on this machine (tests, benchmarks).

    `warm=True` keeps one pre-started worker process waiting for its spec, as the agent's
    supervisor does by default (`supervisor.prewarm`): the next `start` (a scale-out's spawn)
    takes it and a new spare is started. Its log is `logs/warm-<n>.log`.

    Like the agent, it binds every instance to the node of its spec and sends every worker those
    bindings (the control line "hosts"; the worker then accepts an envelope only from the node
    its sender is bound to: docs/security.md, "Data channels")."""

    def __init__(self, workdir: Path, ready_timeout: float = 20.0, warm: bool = False) -> None:
        self.workdir = Path(workdir)
        self.warm = warm
        self.hosts: Dict[str, str] = {}  # instance -> node (extra bindings a test may add)
        self._spare: Optional[WarmProc] = None
        self._spares = 0
        self.warm_used = 0
        self.workers: Dict[str, Any] = {}  # instance -> WorkerProc, or MemberProc of a chain
        self.lock = threading.Lock()
        self._hosts_order = threading.Lock()  # send_hosts: tables sent in the order taken
        self.spawned: List[str] = []
        self.exited: List[str] = []
        self.ready_timeout = ready_timeout
        self.spawn_times: Dict[str, float] = {}
        # (creator, new instance, monotonic time): spawn lines seen, "spawned" answers sent
        self.spawn_requests: List[tuple] = []
        self.spawn_replies: List[tuple] = []

    def _prewarm(self) -> None:
        with self.lock:
            if not self.warm or self._spare is not None:
                return
            self._spares += 1
            self._spare = WarmProc(self.workdir / "logs", f"warm-{self._spares}")

    def _take_spare(self) -> Optional[WarmProc]:
        with self.lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare.proc.poll() is not None:
            spare.close()
            return None
        return spare

    def start(self, spec: InstanceSpec, wait: bool = True) -> WorkerProc:
        spare = self._take_spare()
        if spare is not None:
            self.warm_used += 1
        spec = _as_agent_sets(spec)
        w = WorkerProc(spec, self.workdir / "logs", self._on_line, warm=spare)
        self._prewarm()
        with self.lock:
            self.workers[spec.instance] = w
            self.hosts[spec.instance] = spec.node
        self.send_hosts()
        if wait and not w.ready.wait(self.ready_timeout):
            raise TimeoutError(f"worker {spec.instance} not ready after {self.ready_timeout}s; see {w.log_path}")
        return w

    def start_chain(self, specs: Sequence[InstanceSpec], wait: bool = True) -> List[MemberProc]:
        """Start several consecutive instances in one chain process (upstream first)."""
        spare = self._take_spare()
        if spare is not None:
            self.warm_used += 1
        specs = [_as_agent_sets(s) for s in specs]
        chain = ChainProc(specs, self.workdir / "logs", self._on_line, warm=spare)
        self._prewarm()
        with self.lock:
            for s in specs:
                self.workers[s.instance] = chain.members[s.instance]
                self.hosts[s.instance] = s.node
        self.send_hosts()
        members = list(chain.members.values())
        for m in members:
            if wait and not m.ready.wait(self.ready_timeout):
                raise TimeoutError(f"chain member {m.instance} not ready after {self.ready_timeout}s; see {chain.log_path}")
        return members

    def send_hosts(self) -> None:
        """Every worker gets the bindings of every instance (the agent's "hosts" line). One line
        replaces a worker's whole table, so the tables go out in the order they were taken: two
        spawns answered at once (a duplication of two copies) could otherwise send the older
        table last, and a worker never learnt one copy's binding (it refused the copy's request
        for its Start, and the copy stayed idle)."""
        with self._hosts_order:
            with self.lock:
                table = {"bound": dict(self.hosts)}
                ws = list(self.workers.values())
            for w in ws:
                w.send("hosts", **table)

    def _on_line(self, w: Any, msg: Dict[str, Any]) -> None:
        if msg["event"] == "spawn":
            with self.lock:
                self.spawn_requests.append((w.instance, (msg.get("spec") or {}).get("instance"), time.monotonic()))
            threading.Thread(target=self._spawn, args=(w, msg), daemon=True).start()
        elif msg["event"] == "exit":
            with self.lock:
                self.exited.append(w.instance)

    def _spawn(self, parent: Any, msg: Dict[str, Any]) -> None:
        """createNode(): start the new instance; reply only once it is subscribed (invariant 2)."""
        t0 = time.monotonic()
        try:
            spec = InstanceSpec.from_json(json.dumps(msg["spec"]))
            spec = replace(spec, node=parent.spec.node)
            child = self.start(spec, wait=True)
            with self.lock:
                self.spawned.append(child.instance)
                self.spawn_times[child.instance] = time.monotonic() - t0
            with self.lock:
                self.spawn_replies.append((parent.instance, spec.instance, time.monotonic()))
            parent.send("spawned", request=msg["request"], ok=True, instance=spec.instance, node=spec.node)
        except Exception as exc:  # noqa: BLE001
            parent.send("spawned", request=msg.get("request"), ok=False, error=str(exc)[:200])

    def restart(self, instance: str) -> WorkerProc:
        """Start a dead worker again with the same identity (`restart = true`), like the agent."""
        with self.lock:
            old = self.workers[instance]
        if old.proc.poll() is None:
            raise RuntimeError(f"{instance} is still running")
        old.close()
        if isinstance(old, MemberProc):  # a chain restarts as a whole, with the same members
            members = self.start_chain([replace(m.spec, restart=True) for m in old.chain.members.values()])
            return next(m for m in members if m.instance == instance)
        return self.start(replace(old.spec, restart=True))

    def alive(self) -> List[WorkerProc]:
        with self.lock:
            return [w for w in self.workers.values() if w.proc.poll() is None]

    def stop_all(self, timeout: float = 15.0) -> Dict[str, Optional[int]]:
        codes = {}
        with self.lock:
            ws = list(self.workers.values())
        for w in ws:
            w.send("stop")
        for w in ws:
            codes[w.instance] = w.stop(timeout)
            w.close()
        with self.lock:
            spare, self._spare = self._spare, None
            self.warm = False  # no new spare after a stop_all
        if spare is not None:
            spare.close()
        return codes


# ---- the benchmark ------------------------------------------------------------------------------


def _payloads(batch_size: int, n_batches: int, record: str) -> List[bytes]:
    from agent.dataplane.envelope import encode_data
    from agent.operators.taxi import TaxiGenerator

    gen = TaxiGenerator(1, "raw")
    recs = [gen.record() if record == "taxi" else {"v": 1} for _ in range(batch_size)]
    return [
        encode_data("raw-0", 0, i + 1, [("src-0", i * batch_size + k, recs[k]) for k in range(batch_size)])
        for i in range(n_batches)
    ]


SYS_DROPPED = "$SYS/broker/publish/messages/dropped"
RAW_TOPIC = "fog/bench/raw"


class BenchFailed(RuntimeError):
    """A phase did not measure what it claims (the broker dropped messages, a raw run stalled):
    the bench reports it and exits non-zero instead of printing a number."""


class DropWatch:
    """The private broker's `$SYS/broker/publish/messages/dropped`, read around each phase.

    Mosquitto publishes its $SYS tree in passes, one every 2 s with `sys_interval 1` (broker.py;
    it compares whole seconds), each pass in a fixed order: `uptime` first, `dropped` (only when
    it changed) in the middle, `bytes/sent` (changes every pass: it counts these messages) near
    the end. So the value is final for a phase once a pass that started after the phase ended
    has been read to its `bytes/sent`."""

    UPTIME = "$SYS/broker/uptime"
    PASS_END = "$SYS/broker/bytes/sent"

    def __init__(self, host: str, port: int, timeout: float = 10.0) -> None:
        self.timeout = timeout
        self.value = 0.0
        self.per_phase: Dict[str, float] = {}
        self._cond = threading.Condition()
        self._pass_start = 0.0
        self._last_pass = 0.0  # start time of the last pass read to its end
        self._subscribed = threading.Event()
        broker = mqttc.broker_from(host, port, keepalive=60)
        c = mqttc.make_client(broker, f"bench-dropwatch-{os.getpid()}")
        topics = [(SYS_DROPPED, 0), (self.UPTIME, 0), (self.PASS_END, 0)]
        c.on_connect = lambda cl, u, f, rc, p=None: cl.subscribe(topics)
        c.on_subscribe = lambda *a: self._subscribed.set()
        c.on_message = self._on_message
        mqttc.connect(c, broker)
        c.loop_start()
        self._client = c
        if not self._subscribed.wait(timeout):
            raise BenchFailed(f"cannot subscribe to {SYS_DROPPED} on {host}:{port}")

    def _read_dropped(self, payload: bytes) -> None:
        try:
            self.value = float(payload.decode())
        except (ValueError, UnicodeDecodeError):
            pass

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        if msg.retain:  # the value at subscription time, before any phase
            if msg.topic == SYS_DROPPED:
                self._read_dropped(msg.payload)
            return
        with self._cond:
            if msg.topic == self.UPTIME:
                self._pass_start = time.monotonic()
            elif msg.topic == SYS_DROPPED:
                self._read_dropped(msg.payload)
            elif msg.topic == self.PASS_END and self._pass_start:
                self._last_pass = self._pass_start
                self._cond.notify_all()

    def settled(self, since: float, margin: float = 0.25) -> float:
        """The counter once a pass that began `margin` s after `since` (monotonic) was read."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._last_pass > since + margin, self.timeout):
                raise BenchFailed(f"{SYS_DROPPED}: no $SYS update within {self.timeout:.0f} s")
            return self.value

    @contextmanager
    def phase(self, name: str, into: Optional[Dict[str, Any]] = None) -> Iterator[Dict[str, Any]]:
        """Run one phase; afterwards raise BenchFailed if the broker dropped any message in it
        (a stall inside the phase is reported with the phase's drop count). The phase writes
        its numbers into the dict it is given; they reach `into` only if the phase was valid."""
        before = self.value
        err: Optional[BenchFailed] = None
        part: Dict[str, Any] = {}
        try:
            yield part
        except BenchFailed as exc:
            err = exc
        dropped = self.settled(time.monotonic()) - before
        self.per_phase[name] = dropped
        if dropped:
            raise BenchFailed(f"{name}: the broker dropped {dropped:.0f} messages ({SYS_DROPPED}); "
                              "the numbers of this run are not valid" + (f" ({err})" if err else "")) from err
        if err is not None:
            raise err
        if into is not None:
            into.update(part)

    def close(self) -> None:
        self._client.loop_stop()
        self._client.disconnect()


def _raw_client(name: str, host: str, port: int, topic: Optional[str] = None, timeout: float = 10.0) -> Any:
    """A connected paho client (the MQTT version of a worker's data path, `DATA_MQTT5`),
    subscribed to `topic` at QoS 1 if given; driven by the caller's own select loop (no network
    thread)."""
    broker = mqttc.broker_from(host, port, keepalive=60)
    session = mqttc.Session(mqtt5=DATA_MQTT5)
    # TCP_NODELAY like a worker's (agent.mqtt.client), else each small ack waits; max_inflight 0:
    # no paho-side cap, the bench's window is the only limit
    c = mqttc.make_client(broker, f"{name}-{os.getpid()}", session, max_inflight=0)
    ready = threading.Event()
    c.on_connect = lambda cl, u, f, rc, p=None: (cl.subscribe(topic, qos=1) if topic else ready.set())
    c.on_subscribe = lambda *a: ready.set()
    mqttc.connect(c, broker, session)
    deadline = time.monotonic() + timeout
    while not ready.is_set():
        if time.monotonic() > deadline:
            raise BenchFailed(f"{name}: not connected/subscribed to {host}:{port} after {timeout}s")
        mqttc.loop_once(c, 0.05)  # never loop(): its wake-up socket pair costs a send per publish
    return c


def _drain(client: Any, count: Callable[[], int]) -> None:
    """Read every packet waiting on `client`'s socket (paho's loop_read reads one PUBLISH)."""
    while True:
        before = count()
        client.loop_read()
        if count() == before:
            return


class _Delivered:
    """Messages the subscriber has received, and when the last one arrived."""

    def __init__(self) -> None:
        self.n = 0
        self.last = 0.0

    def add(self, k: int = 1) -> None:
        self.n += k
        self.last = time.monotonic()


def _publish_windowed(
    pub: Any,
    body: Callable[[int], bytes],
    window: int,
    seconds: float,
    delivered: _Delivered,
    others: Sequence[Any],
    on_readable: Callable[[Any], None],
    stall_s: float,
) -> Dict[str, float]:
    """Publish for `seconds` with at most `window` messages sent but not yet received by the
    subscriber (so the broker's queue for it never holds more than `window`), then wait for
    the last one. `others`: further sockets/clients to select on (the subscriber's client in one
    process, its pipe in two), handled by `on_readable`. Raises BenchFailed when nothing is
    delivered for `stall_s` (a message the broker dropped never arrives)."""
    ps = pub.socket()
    sent = 0
    t0 = time.monotonic()
    deadline = t0 + seconds
    last_n, progress, misc = 0, t0, t0
    while True:
        now = time.monotonic()
        if now < deadline:
            while sent - delivered.n < window:
                info = pub.publish(RAW_TOPIC, body(sent), qos=1)
                if info.rc != 0:
                    raise BenchFailed(f"raw: publish failed (rc {info.rc})")
                sent += 1
        elif delivered.n >= sent:
            break
        writers = [c.socket() for c in [pub, *others] if hasattr(c, "want_write") and c.want_write()]
        rd = [ps] + [c.socket() if hasattr(c, "socket") else c for c in others]
        r, w, _ = select.select(rd, writers, [], 0.05)
        for c in [pub, *others]:
            if hasattr(c, "want_write") and c.socket() in w:
                c.loop_write()
        if ps in r:
            pub.loop_read()
        for x in others:
            if (x.socket() if hasattr(x, "socket") else x) in r:
                on_readable(x)
        if delivered.n != last_n:
            last_n, progress = delivered.n, now
        elif now - progress > stall_s:
            raise BenchFailed(f"raw: {sent} sent, {delivered.n} received, nothing received for {stall_s:.0f} s "
                              "(the broker dropped a message?)")
        if now - misc >= 1.0:
            for c in [pub, *others]:
                if hasattr(c, "loop_misc"):
                    c.loop_misc()
            misc = now
    return {"t0": t0, "sent": float(sent)}


def _raw_result(batch_size: int, payload: int, sent: float, delivered: _Delivered, t0: float, window: int,
                cpu0: Dict[str, float], cpu1: Dict[str, float]) -> Dict[str, Any]:
    elapsed = max(1e-9, delivered.last - t0)  # up to the last message received, never a timeout
    n = delivered.n
    return {
        "sent": sent,
        "delivered": float(n),
        "batches": float(n),
        "elapsed_s": round(elapsed, 4),
        "window": window,
        "records_per_s": n * batch_size / elapsed,
        "batches_per_s": n / elapsed,
        "payload_bytes": float(payload),
        "cpu_ms_per_batch": {k: round(1000 * (cpu1[k] - cpu0[k]) / max(1, n), 4)
                             for k in cpu1 if k != "machine_busy" and not k.endswith("_sys")},
    }


def measure_raw(
    host: str, port: int, batch_size: int, record: str, seconds: float, encode: bool = False, broker_pid: int = 0,
    window: int = 100, stall_s: float = 2.0,
) -> Dict[str, Any]:
    """One process: a publisher and a no-op subscriber (two connections, one thread, one select
    loop -- a worker's per-process equivalent: receive batches and send batches) through the
    broker, QoS 1, pre-encoded batches (the broker + paho limit per process); with `encode`, the
    publisher encodes every batch like a worker does. At most `window` batches are between
    publish and receipt, counted from what the subscriber received (not from the broker's
    PUBACK: the broker would queue, then drop, what the subscriber cannot take)."""
    from agent.dataplane.envelope import encode_data
    from agent.operators.taxi import TaxiGenerator

    delivered = _Delivered()
    sub = _raw_client("bench-raw-sub", host, port, RAW_TOPIC)
    sub.on_message = lambda c, u, m: delivered.add()
    pub = _raw_client("bench-raw-pub", host, port)
    payloads = _payloads(batch_size, 64, record)
    gen = TaxiGenerator(1, "raw")
    recs = [gen.record() if record == "taxi" else {"v": 1} for _ in range(batch_size)]

    def body(i: int) -> bytes:
        if encode:
            return encode_data("raw-0", 0, i + 1, [("src-0", i * batch_size + k, r) for k, r in enumerate(recs)])
        return payloads[i % len(payloads)]

    pids = {"process": os.getpid(), "broker": broker_pid} if broker_pid else {"process": os.getpid()}
    try:
        c0 = _cpu_seconds(pids)
        out = _publish_windowed(pub, body, window, seconds, delivered, [sub],
                                lambda c: _drain(c, lambda: delivered.n), stall_s)
        c1 = _cpu_seconds(pids)
    finally:
        sub.disconnect()
        pub.disconnect()
    return _raw_result(batch_size, len(payloads[0]), out["sent"], delivered, out["t0"], window, c0, c1)


def measure_raw_2proc(
    host: str, port: int, batch_size: int, record: str, seconds: float, broker_pid: int = 0,
    window: int = 100, stall_s: float = 2.0,
) -> Dict[str, Any]:
    """Two processes: this one publishes (pre-encoded batches, QoS 1), a child process
    subscribes and writes one byte to its stdout per message received; the window counts
    those bytes. The two-core limit of the broker + paho for one hop."""
    env = dict(os.environ)
    root = os.pathsep.join([str(Path(agent.__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    child = subprocess.Popen([PY, "-m", "foglab.tools.dataplane_bench", "raw-subscriber", host, str(port)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    assert child.stdout is not None and child.stdin is not None
    fd = child.stdout.fileno()
    delivered = _Delivered()
    try:
        r, _, _ = select.select([fd], [], [], 15.0)
        if not r or os.read(fd, 1) != b"R":
            raise BenchFailed("raw 2-proc: the subscriber process did not get ready")
        pub = _raw_client("bench-raw-pub2", host, port)
        payloads = _payloads(batch_size, 64, record)

        def on_pipe(x: Any) -> None:
            data = os.read(fd, 65536)
            if not data:
                raise BenchFailed("raw 2-proc: the subscriber process exited")
            delivered.add(len(data))

        pids = {"publisher": os.getpid(), "subscriber": child.pid}
        if broker_pid:
            pids["broker"] = broker_pid
        try:
            c0 = _cpu_seconds(pids)
            out = _publish_windowed(pub, lambda i: payloads[i % len(payloads)], window, seconds, delivered, [fd],
                                    on_pipe, stall_s)
            c1 = _cpu_seconds(pids)
        finally:
            pub.disconnect()
    finally:
        child.stdin.close()  # EOF: the subscriber disconnects and exits
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        child.stdout.close()
    return _raw_result(batch_size, len(payloads[0]), out["sent"], delivered, out["t0"], window, c0, c1)


def _raw_subscriber_main(host: str, port: int) -> int:
    """The subscriber process of `measure_raw_2proc`: b"R" once subscribed, then one byte per
    message received; exits at EOF on stdin."""
    n = [0]
    sub = _raw_client("bench-raw-sub2", host, port, RAW_TOPIC)
    sub.on_message = lambda c, u, m: n.__setitem__(0, n[0] + 1)
    os.write(1, b"R")
    ss, stdin = sub.socket(), sys.stdin.fileno()
    misc = time.monotonic()
    while True:
        r, w, _ = select.select([ss, stdin], [ss] if sub.want_write() else [], [], 0.5)
        if w:
            sub.loop_write()
        if ss in r:
            _drain(sub, lambda: n[0])
            if n[0]:
                os.write(1, b"." * n[0])
                n[0] = 0
        if stdin in r and not os.read(stdin, 4096):
            break
        if time.monotonic() - misc >= 1.0:
            sub.loop_misc()
            misc = time.monotonic()
    sub.disconnect()
    return 0


def _cpu_seconds(pids: Dict[str, int]) -> Dict[str, float]:
    """user + system CPU seconds of each process so far, and of the whole machine ("machine_busy",
    all cores, every process: tells how much the other jobs of a shared machine took)."""
    import psutil

    out: Dict[str, float] = {}
    for name, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
            out[name] = t.user + t.system
            out[name + "_sys"] = t.system
        except psutil.Error:
            out[name] = out[name + "_sys"] = 0.0
    m = psutil.cpu_times()
    out["machine_busy"] = m.user + m.system + getattr(m, "nice", 0.0) + getattr(m, "irq", 0.0) + getattr(m, "softirq", 0.0)
    return out


def _rss_mb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 1e6


def _progress(msg: str) -> None:
    """Progress goes to stderr: `--json` keeps stdout pure JSON."""
    print(f"bench dataplane: {msg}", file=sys.stderr, flush=True)


def run_bench(
    seconds: float = 8.0,
    batch_size: int = 100,
    record: str = "taxi",
    window: int = 8,
    workdir: Optional[str] = None,
    rescale: int = 3,
    warm: bool = True,
    raw_window: int = 100,
    broker_max_queued: int = 10000,
    broker_max_inflight: int = 100,
    result: Optional[Dict[str, Any]] = None,
    chain: bool = False,
    max_instances: Optional[int] = None,
    rounds: int = 0,
    slice_s: float = 2.0,
) -> Dict[str, Any]:
    """Every phase on one private broker; raises BenchFailed (with the partial numbers in
    `result` if the caller passed a dict) when the broker dropped a message in any phase."""
    from foglab.tools.broker import start_private_broker

    tmp = Path(workdir or tempfile.mkdtemp(prefix="fog-dataplane-"))
    broker = start_private_broker(tmp / "broker", max_queued=broker_max_queued, max_inflight=broker_max_inflight)
    if result is None:
        result = {}
    result.update({"batch_size": batch_size, "record": record, "seconds": seconds, "window": window,
                   "raw_window": raw_window, "mqtt": "5" if DATA_MQTT5 else "3.1.1", "max_instances": max_instances})
    runner = LocalRunner(tmp)
    drops: Optional[DropWatch] = None
    try:
        drops = DropWatch(broker.host, broker.port)
        result["dropped"] = drops.per_phase  # filled phase by phase: every value must be 0
        raw_args = dict(batch_size=batch_size, record=record, seconds=seconds, broker_pid=broker.pid, window=raw_window)
        _progress(f"raw, one process ({seconds:g} s)")
        with drops.phase("raw_1proc", result) as part:
            part["raw_1proc"] = measure_raw(broker.host, broker.port, **raw_args)  # type: ignore[arg-type]
        _progress(f"raw, two processes ({seconds:g} s)")
        with drops.phase("raw_2proc", result) as part:
            part["raw_2proc"] = measure_raw_2proc(broker.host, broker.port, **raw_args)  # type: ignore[arg-type]
        _progress(f"raw, one process encoding each batch ({seconds:g} s)")
        with drops.phase("raw_1proc_encoding", result) as part:
            part["raw_1proc_encoding"] = measure_raw(broker.host, broker.port, encode=True,
                                                       **raw_args)  # type: ignore[arg-type]
        toml = pipeline_toml(
            "bench",
            [
                {"name": "source", "kind": "source", "function": "foglab.operators.bench:bench_source",
                 "batch_size": batch_size, "max_inflight_batches": window,
                 "params": {"profile": "constant", "rate": 5e6, "record": record}},
                {"name": "map", "function": "agent.operators.builtin:identity", "batch_size": batch_size,
                 "max_inflight_batches": window},
                {"name": "sink", "kind": "sink", "function": "agent.operators.builtin:null_sink",
                 "batch_size": batch_size},
            ],
            # max_instances = 1: no route memory anywhere (agent.dataplane.sticky.needed), so a
            # run with it against one without gives what invariant 8 costs on the data path
            scaling={"policy": "none", **({"max_instances": max_instances} if max_instances else {})},
        )
        bspec = BrokerSpec(host=broker.host, port=broker.port)
        specs = initial_specs(toml, bspec, str(tmp / "state"), extra={"sink_dir": str(tmp / "sink")})
        _progress(f"pipeline source -> identity -> sink ({seconds:g} s)")
        with drops.phase("pipeline", result) as part:
            procs = [runner.start(s) for s in reversed(specs)]  # successors subscribe first
            sink = procs[0]
            time.sleep(1.0)  # warm-up
            pids = {"source": procs[-1].pid, "map": procs[1].pid, "sink": procs[0].pid, "broker": broker.pid,
                    "bench": os.getpid()}  # this process: the runner's pipe readers and the drop watch
            c0 = _cpu_seconds(pids)
            r0 = sink.stats.get("recorded", 0)
            t0 = time.monotonic()
            time.sleep(seconds)
            r1 = sink.stats.get("recorded", 0)
            t1 = time.monotonic()
            c1 = _cpu_seconds(pids)
            rate = (r1 - r0) / (t1 - t0)
            batches = max(1.0, (r1 - r0) / batch_size)
            part["pipeline"] = {
                "records_per_s": rate,
                # Where the CPU goes (the machine is shared: `machine_busy` counts the other jobs too):
                # CPU seconds per wall second of each process, and CPU ms per batch of `batch_size`.
                "cpu_share": {k: round((c1[k] - c0[k]) / (t1 - t0), 3) for k in c1},
                "cpu_ms_per_batch": {k: round(1000 * (c1[k] - c0[k]) / batches, 3) for k in c1},
                "source": procs[-1].stats,
                "map": procs[1].stats,
                "sink": sink.stats,
            }
            r1p = result["raw_1proc"]["records_per_s"]
            r2p = result["raw_2proc"]["records_per_s"]
            # The goal (issue 26): >= 0.5 of the one-process raw, a worker's per-process equivalent.
            part["ratio"] = rate / r1p if r1p else 0.0
            part["ratio_vs_raw_2proc"] = rate / r2p if r2p else 0.0
            enc = result["raw_1proc_encoding"]["records_per_s"]
            part["ratio_vs_encoding_producer"] = rate / enc if enc else 0.0
            # Idle worker memory: pause the source, wait, read the map worker's RSS.
            procs[-1].send("set", paused=True)
            time.sleep(1.5)
            part["rss_mb"] = {
                "idle_worker": _rss_mb(procs[1].pid),
                "sink_worker": _rss_mb(procs[0].pid),
                "python_paho_baseline": _baseline_rss(),
            }
            part["pipeline"]["count_check"] = count_check(procs[-1], sink)
            runner.stop_all()
        if chain:
            _progress(f"chained pipeline [source -> identity -> sink] in one process ({seconds:g} s)")
            with drops.phase("chained", result) as part:
                part["chained"] = measure_chained(LocalRunner(tmp / "chained"), toml, bspec, tmp / "chained",
                                                  seconds, batch_size, broker.pid)
            # The same with the source in its own process: one MQTT hop into the chain, so the
            # broker is on the path and the ratio against the raw limits means what it says.
            _progress(f"chained pipeline source -> [identity -> sink] ({seconds:g} s)")
            with drops.phase("chained_tail", result) as part:
                part["chained_tail"] = measure_chained(LocalRunner(tmp / "chained_tail"), toml, bspec,
                                                       tmp / "chained_tail", seconds, batch_size, broker.pid, alone=1)
            for name in ("chained", "chained_tail"):
                c = result[name]
                r1p = result["raw_1proc"]["records_per_s"]
                r2p = result["raw_2proc"]["records_per_s"]
                unchained = result["pipeline"]["records_per_s"]
                c["ratio"] = c["records_per_s"] / r1p if r1p else 0.0
                c["ratio_vs_raw_2proc"] = c["records_per_s"] / r2p if r2p else 0.0
                c["vs_unchained"] = c["records_per_s"] / unchained if unchained else 0.0
        if rounds:
            with drops.phase("alternating", result) as part:
                part["alternating"] = measure_alternating(broker.host, broker.port, toml, bspec, tmp, rounds, slice_s,
                                                          batch_size, raw_args)
        if rescale:
            _progress(f"rescale, {rescale} step-load cycles")
            with drops.phase("rescale", result) as part:
                part["rescale"] = measure_rescale(broker.host, broker.port, tmp, cycles=rescale, warm=warm)
                part["rescale"]["warm_worker"] = warm
    finally:
        runner.stop_all()
        if drops is not None:
            drops.close()
        broker.stop()
    return result


def measure_chained(runner: LocalRunner, toml: str, bspec: BrokerSpec, workdir: Path, seconds: float,
                    batch_size: int, broker_pid: int, alone: int = 0) -> Dict[str, Any]:
    """The bench pipeline with its keepers in one chain process (docs/runtime.md, "Chaining"),
    except the first `alone`, which run as processes of their own (alone = 1: the source sends
    to the chain over the broker, one MQTT hop): records/s at the sink, CPU per batch of each
    process and the broker, and the chain's RSS with the source paused (goal < 40 MB). Its own
    cluster, so that no session of another phase's instances is taken over."""
    specs = initial_specs(toml, bspec, str(workdir / "state"), cluster=f"bench-chain{alone}",
                          extra={"sink_dir": str(workdir / "sink")})
    try:
        run = start_pipeline(runner, specs, broker_pid, chained_from=alone)
        members, heads, sink = run.members, run.heads, run.sink
        time.sleep(1.0)  # warm-up
        pids = run.pids
        c0, r0, t0 = _cpu_seconds(pids), sink.stats.get("recorded", 0), time.monotonic()
        time.sleep(seconds)
        c1, r1, t1 = _cpu_seconds(pids), sink.stats.get("recorded", 0), time.monotonic()
        batches = max(1.0, (r1 - r0) / batch_size)
        out: Dict[str, Any] = {
            "records_per_s": (r1 - r0) / (t1 - t0),
            "cpu_share": {k: round((c1[k] - c0[k]) / (t1 - t0), 3) for k in c1},
            "cpu_ms_per_batch": {k: round(1000 * (c1[k] - c0[k]) / batches, 3) for k in c1},
            "members": {m.instance: m.stats for m in members},
        }
        (heads or members)[0].send("set", paused=True)
        time.sleep(1.5)
        out["rss_mb"] = {"chain": _rss_mb(members[0].pid), "python_paho_baseline": _baseline_rss()}
        out["count_check"] = count_check((heads or members)[0], sink)
        return out
    finally:
        runner.stop_all()


class Running:
    """A started bench pipeline: its source, its sink, the chain's members (if any) and the pids
    whose CPU a phase counts."""

    def __init__(self, heads: List[Any], members: List[Any], pids: Dict[str, int]) -> None:
        self.heads, self.members, self.pids = heads, members, pids
        self.source = (heads or members)[0]
        self.sink = (members or heads)[-1]


def start_pipeline(runner: LocalRunner, specs: Sequence[InstanceSpec], broker_pid: int,
                   chained_from: Optional[int] = None) -> Running:
    """Start the bench pipeline: every instance a process of its own (`chained_from` None), or
    the instances from `chained_from` on in one chain process and the ones before it alone."""
    cut = len(specs) if chained_from is None else chained_from
    members = runner.start_chain(specs[cut:]) if cut < len(specs) else []
    heads = [runner.start(s) for s in reversed(specs[:cut])][::-1]  # successors subscribed first
    pids = {"broker": broker_pid, "bench": os.getpid(),  # bench: the runner's pipe readers, the drop watch
            **{h.spec.operator: h.pid for h in heads}}
    if members:
        pids["chain"] = members[0].pid
    return Running(heads, members, pids)


def measure_slice(run: Running, seconds: float, batch_size: int, warm_up: float = 0.5) -> Dict[str, Any]:
    """One slice of a pipeline in the alternating phase: resume its (paused) source, let it warm
    up, count the sink's records between two of its heartbeats `seconds` apart (the arrival times
    of the heartbeats, not of our sleeps, are the clock), pause the source again and wait until
    everything it generated was recorded (a count balance, as `count_check`)."""
    run.source.send("set", paused=False)
    time.sleep(warm_up)
    t0, st0 = run.sink.next_beat()
    c0, r0 = _cpu_seconds(run.pids), int(st0.get("recorded", 0))
    time.sleep(max(0.0, seconds - 0.5 * float(run.sink.spec.heartbeat_period)))
    t1, st1 = run.sink.next_beat()
    c1, r1 = _cpu_seconds(run.pids), int(st1.get("recorded", 0))
    run.source.send("set", paused=True)
    batches = max(1.0, (r1 - r0) / batch_size)
    out = {
        "records_per_s": (r1 - r0) / max(1e-9, t1 - t0),
        "elapsed_s": round(t1 - t0, 3),
        "cpu_share": {k: round((c1[k] - c0[k]) / max(1e-9, t1 - t0), 3) for k in c1},
        "cpu_ms_per_batch": {k: round(1000 * (c1[k] - c0[k]) / batches, 3) for k in c1 if not k.endswith("_sys")},
    }
    out["count_check"] = count_check(run.source, run.sink)
    if out["count_check"]["missing"]:
        raise BenchFailed(f"alternating slice: count check {out['count_check']}")
    return out


ALTERNATING = ("chained", "chained_tail", "pipeline")  # the pipelines of a round, in their order


def measure_alternating(host: str, port: int, toml: str, bspec: BrokerSpec, tmp: Path, rounds: int,
                        slice_s: float, batch_size: int, raw_args: Dict[str, Any]) -> Dict[str, Any]:
    """The raws and the pipelines taking turns in short slices (docs/measurement.md, "Cheap cuts
    of the data plane, and the data-plane goal"): the whole chain, source -> chain of 2 and the unchained pipeline
    run at once, each with its source paused but the slice's; each round is raw one process,
    whole chain, source -> chain of 2, unchained, raw two processes, so that the other jobs of a
    shared machine fall on a pipeline and the raws it is divided by alike. Per round the ratios of
    each pipeline to that round's raws; the medians over the rounds."""
    runner = LocalRunner(tmp / "alternating")
    try:
        runs: Dict[str, Running] = {}
        for name, chained_from in (("chained", 0), ("chained_tail", 1), ("pipeline", None)):
            specs = initial_specs(toml, bspec, str(tmp / "alternating" / name / "state"), cluster=f"bench-alt-{name}",
                                  extra={"sink_dir": str(tmp / "alternating" / name / "sink")})
            runs[name] = start_pipeline(runner, specs, raw_args["broker_pid"], chained_from)
            runs[name].source.send("set", paused=True)
        for run in runs.values():
            count_check(run.source, run.sink)
        raw_args = {**raw_args, "seconds": slice_s}
        out_rounds: List[Dict[str, Any]] = []
        for i in range(rounds):
            _progress(f"alternating round {i + 1} of {rounds} ({slice_s:g} s slices)")
            rnd: Dict[str, Any] = {"raw_1proc": measure_raw(host, port, **raw_args)}
            for name in ALTERNATING:
                rnd[name] = measure_slice(runs[name], slice_s, batch_size)
            rnd["raw_2proc"] = measure_raw_2proc(host, port, **raw_args)
            r1, r2 = rnd["raw_1proc"]["records_per_s"], rnd["raw_2proc"]["records_per_s"]
            for name in ALTERNATING:
                rnd[name]["ratio"] = rnd[name]["records_per_s"] / r1 if r1 else 0.0
                rnd[name]["ratio_vs_raw_2proc"] = rnd[name]["records_per_s"] / r2 if r2 else 0.0
                # each process on a core of its own: the raw process's CPU per batch over the
                # busiest process of the pipeline (the load cancels out of a CPU-per-batch figure)
                cpu = rnd[name]["cpu_ms_per_batch"]
                busiest = max(v for k, v in cpu.items() if k not in ("broker", "bench", "machine_busy"))
                rnd[name]["cpu_bound_ratio"] = rnd["raw_1proc"]["cpu_ms_per_batch"]["process"] / busiest if busiest else 0.0
            out_rounds.append(rnd)
        med: Dict[str, Any] = {}
        for name in ALTERNATING:
            med[name] = {k: statistics.median(r[name][k] for r in out_rounds)
                         for k in ("ratio", "ratio_vs_raw_2proc", "cpu_bound_ratio", "records_per_s")}
            med[name]["cpu_ms_per_batch"] = {
                k: statistics.median(r[name]["cpu_ms_per_batch"][k] for r in out_rounds)
                for k in out_rounds[0][name]["cpu_ms_per_batch"]}
        for raw in ("raw_1proc", "raw_2proc"):
            med[raw] = {"records_per_s": statistics.median(r[raw]["records_per_s"] for r in out_rounds),
                        "cpu_ms_per_batch": {k: statistics.median(r[raw]["cpu_ms_per_batch"][k] for r in out_rounds)
                                             for k in out_rounds[0][raw]["cpu_ms_per_batch"]}}
        return {"rounds": out_rounds, "median": med, "slice_s": slice_s}
    finally:
        runner.stop_all()


def count_check(source: Any, sink: Any, timeout: float = 10.0) -> Dict[str, Any]:
    """After the source was paused: its `generated` against the sink's `recorded` once both have
    settled (two heartbeats in a row equal, or `timeout`). The throughput phases use the null sink
    (no id bookkeeping, so that they measure the data path alone), so this is a count balance, not
    the rescale part's per-id check: `missing` > 0 means records lost, < 0 records duplicated, and
    0 cannot tell a loss from a duplicate that cancel out."""
    deadline = time.monotonic() + timeout
    last: Optional[Tuple[int, int]] = None
    while True:
        now = (int(source.stats.get("generated", 0)), int(sink.stats.get("recorded", 0)))
        if (now[0] == now[1] and now == last) or time.monotonic() > deadline:
            break
        last = now
        time.sleep(max(0.1, float(getattr(sink.spec, "heartbeat_period", 1.0))))
    return {"generated": now[0], "recorded": now[1], "missing": now[0] - now[1]}


def measure_rescale(
    host: str, port: int, tmp: Path, cycles: int = 3, up_s: float = 8.0, down_s: float = 7.0, warm: bool = True
) -> Dict[str, Any]:
    """Scale-out disruption: a step load makes `work` (emulated 2 ms per record, declared
    capacity 250/s) duplicate, then scale back in, `cycles` times.

    - decision -> first record: wall time from the creator's duplication decision to the new
      instance's first processed record (includes the spawn: with `warm`, the pre-started worker
      reads its spec, connects and subscribes; without, a Python process starts first), split
      into spawn / protocol round / first batch (`rescale_parts`);
    - min output/input: the lowest ratio of sink records to source records over 1-second windows
      from each decision to 3 s after the new instance's first record (we never stop: goal >= 0.9);
    - lost/duplicated from the counting sink's id files.
    """
    from agent.operators.builtin import read_sink_ids

    steps: List[List[float]] = []
    t = 0.0
    for _ in range(cycles):
        steps += [[t, 100.0], [t + 2.0, 420.0], [t + 2.0 + up_s, 40.0]]
        t += 2.0 + up_s + down_s
    steps.append([t, 0.0])
    toml = pipeline_toml(
        "rescale",
        [
            {"name": "source", "kind": "source", "function": "foglab.operators.bench:bench_source",
             "batch_size": 20, "linger_ms": 10.0,
             "params": {"profile": "steps", "steps": steps, "record": "tiny", "max_lag_s": 5.0}},
            {"name": "work", "function": "agent.operators.builtin:identity", "batch_size": 20, "linger_ms": 10.0,
             "service_time_ms": 2.0, "scaling": {"policy": "decentralized", "capacity": 250.0, "period": 1.0}},
            {"name": "sink", "kind": "sink", "function": "agent.operators.builtin:counting_sink",
             "batch_size": 20, "linger_ms": 10.0},
        ],
        scaling={"policy": "none"},
    )
    # A pre-started worker takes each spawn, as in the agent (supervisor.prewarm, on by default).
    runner = LocalRunner(tmp / "rescale", warm=warm)
    specs = initial_specs(toml, BrokerSpec(host=host, port=port), str(tmp / "rescale" / "state"), cluster="rescale",
                          extra={"sink_dir": str(tmp / "rescale" / "sink"), "seed": 5})
    specs = [replace(sp, heartbeat_period=0.2) for sp in specs]
    ins: Dict[float, float] = {}
    outs: Dict[float, float] = {}
    try:
        procs = {p.spec.operator: p for p in (runner.start(sp) for sp in reversed(specs))}
        src, sink = procs["source"], procs["sink"]
        end = time.monotonic() + t + 3.0
        while time.monotonic() < end:
            a, b = dict(src.stats), dict(sink.stats)
            if "at" in a:
                ins[a["at"]] = float(a.get("generated", 0))
            if "at" in b:
                outs[b["at"]] = float(b.get("recorded", 0))
            time.sleep(0.05)
        deadline = time.monotonic() + 15
        while sink.stats.get("recorded", -1) != src.stats.get("generated", -2) and time.monotonic() < deadline:
            time.sleep(0.2)
        generated = int(src.stats.get("generated", 0))
        stats = {w.instance: dict(w.stats) for w in runner.workers.values()}
    finally:
        runner.stop_all()
    ids, dup = read_sink_ids(tmp / "rescale" / "sink")
    got = ids.get("source-0", set())
    firsts = {i: st.get("first_record_at") for i, st in stats.items()}
    delays: List[float] = []
    ratios: List[float] = []
    parts = rescale_parts(stats)
    decisions = [d for st in stats.values() for d in st.get("decisions", []) if d["kind"] == "scale_out"]
    for d in decisions:
        fr = [firsts.get(n) for n in d["new"] if firsts.get(n)]
        if not fr:
            continue
        delays.append(min(fr) - d["at"])
        lo, hi = d["at"], max(fr) + 3.0
        w0 = lo
        while w0 + 1.0 <= hi:  # 1-second windows, counters interpolated at each worker's own time
            din = _interp(ins, w0 + 1.0) - _interp(ins, w0)
            dout = _interp(outs, w0 + 1.0) - _interp(outs, w0)
            if din > 50:
                ratios.append(dout / din)
            w0 += 0.25
    delays.sort()
    return {
        "scale_outs": len(decisions),
        "scale_ins": sum(1 for st in stats.values() for d in st.get("decisions", []) if d["kind"] == "scale_in"),
        "instances_created": len([i for i in stats if i.startswith("work-") and i != "work-0"]),
        "decision_to_first_record_s": {
            "median": delays[len(delays) // 2] if delays else None,
            "max": delays[-1] if delays else None,
            "all": [round(x, 3) for x in delays],
        },
        "breakdown_median_s": parts,
        "min_output_over_input_1s": min(ratios) if ratios else None,
        "records": generated,
        "lost": len(set(range(generated)) - got),
        "duplicated": dup + len(got - set(range(generated))),
    }


def rescale_parts(stats: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """Where decision -> first record goes, medians over the scale-outs (wall clock, workers on
    this machine), from the creator's decision record and the new instance's stats:
    spawn = decision -> last "spawned" reply (process start, imports, connect, subscribe);
    round = spawned -> the new instance's Start (duplication messages and acks through the
    broker, each behind the data its sender queued before it: FIFO channels);
    first = Start -> its first processed record."""
    spawn: List[float] = []
    rnd: List[float] = []
    first: List[float] = []
    each: List[List[Optional[float]]] = []
    for st in stats.values():
        for d in st.get("decisions", []) or []:
            if not isinstance(d, dict) or d.get("kind") != "scale_out" or not d.get("new"):
                continue
            new = [stats.get(n, {}) for n in d["new"]]
            act = [x.get("activated_at") for x in new if isinstance(x.get("activated_at"), (int, float))]
            fr = [x.get("first_record_at") for x in new if isinstance(x.get("first_record_at"), (int, float))]
            sp = d.get("spawned_at")
            row: List[Optional[float]] = [None, None, None]
            if isinstance(sp, (int, float)):
                spawn.append(sp - d["at"])
                row[0] = round(spawn[-1], 3)
                if act:
                    rnd.append(min(act) - sp)
                    row[1] = round(rnd[-1], 3)
            if act and fr:
                first.append(min(fr) - min(act))
                row[2] = round(first[-1], 3)
            each.append(row)

    def med(xs: List[float]) -> Optional[float]:
        return round(sorted(xs)[len(xs) // 2], 3) if xs else None

    return {"spawn": med(spawn), "round": med(rnd), "first_batch": med(first), "each": each}


def _interp(series: Dict[float, float], t: float) -> float:
    """Value of a monotone counter at time t, linear between its samples."""
    pts = sorted(series.items())
    if not pts:
        return 0.0
    if t <= pts[0][0]:
        return pts[0][1]
    for (t0, v0), (t1, v1) in zip(pts, pts[1:]):
        if t0 <= t <= t1:
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1
    return pts[-1][1]


def _baseline_rss() -> float:
    code = "import paho.mqtt.client, psutil, os; print(psutil.Process(os.getpid()).memory_info().rss/1e6)"
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def _fmt_cpu(cpu: Dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in cpu.items())


def _cmd(args: argparse.Namespace) -> int:
    res: Dict[str, Any] = {}
    try:
        run_bench(
            seconds=args.seconds, batch_size=args.batch_size, record=args.record, window=args.window,
            rescale=args.rescale_cycles, warm=not args.no_warm_worker, raw_window=args.raw_window,
            broker_max_queued=args.broker_max_queued, broker_max_inflight=args.broker_max_inflight, result=res,
            chain=args.chain, max_instances=args.max_instances, rounds=args.rounds, slice_s=args.slice,
        )
    except BenchFailed as exc:
        res["error"] = str(exc)
        print(f"error: bench dataplane failed: {exc}", file=sys.stderr)
        if args.json:
            print(json.dumps(res, indent=2, sort_keys=True, default=str))
        return 1
    if args.json:
        print(json.dumps(res, indent=2, sort_keys=True, default=str))
    else:
        r1, r2 = res["raw_1proc"], res["raw_2proc"]
        pipe = res["pipeline"]["records_per_s"]
        print(f"batch size {res['batch_size']} ({res['record']} records, {r1['payload_bytes']:.0f} B/batch), "
              f"raw window {res['raw_window']} batches counted from the subscriber's receipts")
        print(f"raw, one process (publisher + subscriber):   {r1['records_per_s']:10.0f} records/s  "
              f"CPU ms/batch: {_fmt_cpu(r1['cpu_ms_per_batch'])}")
        print(f"raw, two processes:                          {r2['records_per_s']:10.0f} records/s  "
              f"CPU ms/batch: {_fmt_cpu(r2['cpu_ms_per_batch'])}")
        enc = res["raw_1proc_encoding"]["records_per_s"]
        print(f"raw, one process encoding each batch:        {enc:10.0f} records/s")
        print(f"pipeline source -> identity -> sink:         {pipe:10.0f} records/s  "
              f"CPU ms/batch: {_fmt_cpu({k: v for k, v in res['pipeline']['cpu_ms_per_batch'].items() if k in ('source', 'map', 'sink', 'broker')})}")
        print(f"ratio vs one-process raw: {res['ratio']:.3f} (goal >= 0.5); vs two-process raw: "
              f"{res['ratio_vs_raw_2proc']:.3f}; vs the encoding producer: {res['ratio_vs_encoding_producer']:.3f}")
        print("messages the broker dropped, per phase: " + ", ".join(f"{k} {v:.0f}" for k, v in res["dropped"].items()))
        rss = res["rss_mb"]
        print(f"RSS idle worker {rss['idle_worker']:.1f} MB (python+paho baseline {rss['python_paho_baseline']:.1f} MB; goal < 40 MB)")
        print(_fmt_count(res["pipeline"]["count_check"]))
        for name, what in (("chained", "[source -> identity -> sink]"), ("chained_tail", "source -> [identity -> sink]")):
            ch = res.get(name)
            if not ch:
                continue
            print(f"chained {what}: {ch['records_per_s']:10.0f} records/s  "
                  f"CPU ms/batch: {_fmt_cpu({k: v for k, v in ch['cpu_ms_per_batch'].items() if not k.endswith('_sys')})}")
            print(f"  ratio vs one-process raw {ch['ratio']:.3f}, vs two-process raw "
                  f"{ch['ratio_vs_raw_2proc']:.3f}, vs the unchained pipeline {ch['vs_unchained']:.2f}x; "
                  f"RSS of the chain process {ch['rss_mb']['chain']:.1f} MB (goal < 40 MB)")
            print("  " + _fmt_count(ch["count_check"]))
        alt = res.get("alternating")
        if alt:
            print(f"alternating, {len(alt['rounds'])} rounds of {alt['slice_s']:g} s slices (ratio per round to that "
                  "round's raws):")
            for name, what in (("chained", "whole chain"), ("chained_tail", "source -> chain of 2"),
                               ("pipeline", "unchained")):
                m = alt["median"][name]
                per = ", ".join(f"{r[name]['ratio']:.2f}" for r in alt["rounds"])
                print(f"  {what}: {m['records_per_s']:10.0f} records/s, ratio vs raw 1 proc median {m['ratio']:.3f} "
                      f"({per}), vs raw 2 proc {m['ratio_vs_raw_2proc']:.3f}, CPU-bound {m['cpu_bound_ratio']:.3f}")
            print(f"  raw one process {alt['median']['raw_1proc']['records_per_s']:.0f}, two processes "
                  f"{alt['median']['raw_2proc']['records_per_s']:.0f} records/s (medians)")
        rs = res.get("rescale")
        if rs:
            d = rs["decision_to_first_record_s"]
            med = "n/a" if d["median"] is None else f"{d['median']:.2f}"
            mx = "n/a" if d["max"] is None else f"{d['max']:.2f}"
            low = rs["min_output_over_input_1s"]
            print(f"rescale: {rs['scale_outs']} scale-outs, {rs['scale_ins']} scale-ins; decision -> first record "
                  f"median {med} s, max {mx} s (goal < 1 s)")
            print(f"lowest 1 s output/input during scale-out: {'n/a' if low is None else f'{low:.2f}'} (goal >= 0.9); "
                  f"records {rs['records']}, lost {rs['lost']}, duplicated {rs['duplicated']}")
    if res.get("rescale") and (res["rescale"]["lost"] or res["rescale"]["duplicated"]):
        return 1
    if any(res[k]["count_check"]["missing"] for k in ("pipeline", "chained", "chained_tail") if k in res):
        return 1
    return 0


def _fmt_count(c: Dict[str, Any]) -> str:
    return (f"count check: source generated {c['generated']}, sink recorded {c['recorded']}, "
            f"missing {c['missing']} (must be 0)")


def register_bench(groups: Any) -> None:
    p = groups.bench.add_parser("dataplane", help="worker data path throughput vs the raw broker limit")
    p.add_argument("--seconds", type=float, default=8.0, help="measurement time of each part")
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--record", choices=("taxi", "tiny"), default="taxi")
    p.add_argument("--window", type=int, default=8, help="max_inflight_batches of each operator")
    p.add_argument("--raw-window", type=int, default=100,
                   help="raw parts: batches between publish and the subscriber's receipt (default: the "
                        "broker's max_inflight_messages, so nothing waits in the broker's queue)")
    p.add_argument("--rescale-cycles", type=int, default=3, help="step-load cycles of the rescale part (0: skip)")
    p.add_argument("--no-warm-worker", action="store_true",
                   help="rescale part: start each new instance's process cold (no pre-started worker)")
    p.add_argument("--chain", action="store_true",
                   help="also run the pipeline's three keepers chained in one process (docs/runtime.md, \"Chaining\")")
    p.add_argument("--max-instances", type=int, default=None,
                   help="[scaling] max_instances of the throughput pipeline (1: its operators keep no route "
                        "memory, invariant 8; default: unset, i.e. 64)")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds of the alternating phase: raw, whole chain, source -> chain of 2, unchained, raw "
                        "two processes in slices of --slice s, ratios per round and their medians (0: skip)")
    p.add_argument("--slice", type=float, default=2.0, help="seconds of each slice of the alternating phase")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout (progress on stderr)")
    # Tests make the private broker drop messages with these (a bench that saw a drop must fail).
    p.add_argument("--broker-max-queued", type=int, default=10000, help=argparse.SUPPRESS)
    p.add_argument("--broker-max-inflight", type=int, default=100, help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd)


if __name__ == "__main__":  # the subscriber process of measure_raw_2proc
    if len(sys.argv) == 4 and sys.argv[1] == "raw-subscriber":
        sys.exit(_raw_subscriber_main(sys.argv[2], int(sys.argv[3])))
    sys.exit(2)
