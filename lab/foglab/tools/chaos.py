"""`fog-agent chaos`: the demo fleet under a changing load while faults are injected, then a verdict.

In the manner of Jepsen's nemesis and Kafka's system tests: a seeded schedule of faults hits a
real fleet (a private Mosquitto with persistence, three `fog-agent run` processes, real worker
processes), and the record-id accounting of the demo (`foglab.tools.verify`) decides at the end whether
any record was lost or reached the sink twice.

Faults (one at a time; the next one comes after the fleet recovered from the last, plus a
seeded pause):

- `kill-worker`: SIGKILL one live instance (any operator: source, keeper, sink included). Its
  agent restarts it with the same identity (docs/runtime.md, "Persistence and restart").
- `kill-agent`: SIGKILL one agent; its workers get SIGTERM from the kernel (PR_SET_PDEATHSIG),
  drain and exit keeping their sessions; after `agent_restart_delay` the agent is started again,
  as systemd's `Restart=on-failure` would, and re-adopts its instances (agent.node.hosted).
- `restart-broker`: stop Mosquitto (SIGTERM: it writes its persistence file), start it again
  on the same port after a pause; every client reconnects with backoff.
- `stall-node`: SIGSTOP an agent and all its workers for a few seconds, then SIGCONT (a Pi
  that froze under an SD-card stall or thermal throttling).
- `kill-node`: SIGKILL an agent and all its workers at once (power loss: nothing drains) and keep
  the node away longer than `dead_after`: the lowest-named surviving agent starts its instances
  elsewhere with the same identities (agent.node.rehome); then the node comes back and must
  not run them a second time.
- `partition`: cut one node off the broker for a few to ~30 s while its processes keep running
  (each node reaches the broker through a proxy of its own, foglab.tools.delayproxy: nothing
  passes while cut, nothing is dropped). Short cuts are a pause; past the MQTT keepalive the
  broker fires the node's Will and the clients reconnect on heal with their sessions. With
  re-homing on (`rehoming`, or kill-node among the faults) a partition longer than `dead_after`
  re-homes instances whose originals still run, and on heal the agent fences them before its
  workers may reconnect (see docs/reliability.md). `partition_until_rehomed` (the tests of
  that path) keeps the node cut past the drawn time until all its keepers run elsewhere, so
  that the heal comes after the re-homing however slowly a loaded machine starts the workers.

Recovery time of a fault: from the moment it was injected until every instance that was active
before it is active again with a heartbeat newer than the end of the fault (or left through a
scale-in), every agent is online, and the sink has recorded new records (when the load is not
zero). The load ends on conditions, not at a fixed time (`load_lacks`: its duration, its faults,
enough records; the source is then paused), so that a run means the same on an idle and on a
loaded machine. Then the pipeline must come back to one instance per operator ("the right
size") and every generated record id must have reached the sink exactly once.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from agent.config import load_pipeline_text
from agent.protocol.gme_fgme import DAMPING_DEFAULT
from foglab.tools.demo import Fleet, Monitor
from foglab.tools.pipeline_text import IN_ZONE, SINK, STEP_SOURCE, VALIDATE
from foglab.tools.verify import Verdict, source_counts, verify, verify_windows

log = logging.getLogger(__name__)

__all__ = ["FAULTS", "ChaosConfig", "Fault", "chaos_pipeline", "faults_wanted", "load_lacks", "run_chaos", "print_report",
           "main"]

FAULTS = ("kill-worker", "kill-agent", "restart-broker", "stall-node", "kill-node", "kill-broker", "partition")
# the four; kill-node turns re-homing on (opt-in), kill-broker and partition are extra
DEFAULT_FAULTS = FAULTS[:4]
EXIT_OK = 0
EXIT_SETUP = 1
EXIT_LOSS = 3  # a record was lost or duplicated at the sink
EXIT_UNRECOVERED = 4  # a fault was not recovered from, or the pipeline did not come back to size

PIPELINE = ("""\
# fog-agent chaos: the demo pipeline (source -> validate -> in_zone -> sink) on a shorter clock.
[pipeline]
name = "chaos"
coordination = "{coordination}"
fgme_damping = {damping}
chain = {chain}

[scaling]
policy = "decentralized"
target_ratio = 0.7
up = 0.8
down = 0.6
period = 1.0
capacity = 5000.0

""" + STEP_SOURCE + "\n" + VALIDATE + "\n" + IN_ZONE + """service_time_ms = 4.0
[operator.scaling]
capacity = 200.0
period = 1.0

""" + SINK + """[operator.scaling]
policy = "none"
""")

# `--pipeline stateful`: a keyed event-time window (trips and takings per pickup cell and 10
# minutes of pickup time) before the sink, checked window by window against a fault-free reference
# (foglab.tools.verify.verify_windows). Nothing scales: the keyed operator must run with policy
# "none", and its records must arrive in source order for the reference to be exact (copies of
# in_zone would interleave their outputs, and after a fault a replay arrives minutes of event time
# behind the rest: late, dropped by design, docs/operators.md "Keyed state"). Pickup times grow
# along the source, so no record is late; the windows still open when the load ends are not emitted.
STATEFUL_PIPELINE = ("""\
# fog-agent chaos --pipeline stateful: source -> validate -> in_zone -> cells (keyed window) -> sink
[pipeline]
name = "chaos"
coordination = "ack"

[scaling]
policy = "none"

""" + STEP_SOURCE + "\n" + VALIDATE + "\n" + IN_ZONE + """key = "pickup_cell"

[[operator]]
name = "cells"
function = "agent.operators.keyed:tumbling_window"
[operator.params]
time_field = "pickup_datetime"
size_ms = 600000
lateness_ms = 60000
agg = "sum"
field = "total_amount"

""" + SINK)

# `--pipeline stateful-scaling`: the same window scaling out and in under the load (the decentralized
# policy, a capacity below the peak), its key groups moving with their state (docs/operators.md,
# "Key groups that move"). in_zone stays one instance (records in source order per cell). The
# lateness is 10 minutes of pickup time (~1.7 s of this run's clock, which replays ~3 h of pickups
# in 30 s): records of a group on its way wait at the new owner until its state is installed, while
# that owner's other groups move its watermark on; with 60 s (~0.17 s here) a wait under load made
# them late. Each window is emitted once its owner's watermark passes it; the copies are gone
# before the load ends, so the end is the reference's.
STATEFUL_SCALING_PIPELINE = STATEFUL_PIPELINE.replace(
    'lateness_ms = 60000', 'lateness_ms = 600000').replace(
    'function = "agent.operators.keyed:tumbling_window"\n',
    'function = "agent.operators.keyed:tumbling_window"\nservice_time_ms = 3.0\n').replace(
    'field = "total_amount"\n', 'field = "total_amount"\n'
    '[operator.scaling]\npolicy = "decentralized"\ncapacity = 120.0\nperiod = 1.0\n'
    'target_ratio = 0.7\nup = 0.8\ndown = 0.6\n')

# `--pipeline mqtt-ingest`: readings of an outside publisher through mqtt_source and a keyed window,
# each reading checked against the windows (foglab.tools.chaos_ingest).
PIPELINES = ("demo", "stateful", "stateful-scaling", "mqtt-ingest")


def chaos_pipeline(duration: float, seed: int, coordination: str = "ack", fgme_damping: bool = DAMPING_DEFAULT,
                   pipeline: str = "demo", chain: bool = False, until: Optional[float] = None) -> str:
    """A load that makes in_zone scale out (to ~3 instances) and back within `duration` s;
    `coordination` "fgme" runs every round inside the 2-FGME locks (docs/gme.md). `pipeline`
    "stateful": the same load through a keyed window, nothing scaling (coordination unused).
    `chain`: the demo pipeline's keepers run chained (docs/runtime.md, "Chaining"). `until`: the
    last, low step lasts until then (default `duration`); `run_chaos` passes its load cap and
    ends the load itself, on conditions, by pausing the source (`_end_load`)."""
    if pipeline == "mqtt-ingest":
        from foglab.tools.chaos_ingest import INGEST_PIPELINE

        return INGEST_PIPELINE  # no profile: the load is the publisher's (run_chaos)
    d = float(duration)
    end = max(d, float(until)) if until is not None else d
    steps = [[0, 100], [round(0.1 * d, 1), 350], [round(0.5 * d, 1), 200], [round(0.75 * d, 1), 60], [end, 0]]
    text = {"stateful": STATEFUL_PIPELINE, "stateful-scaling": STATEFUL_SCALING_PIPELINE}.get(pipeline, PIPELINE)
    return text.format(seed=seed, steps=json.dumps(steps), coordination=coordination,
                       damping="true" if fgme_damping else "false", chain="true" if chain else "false")


@dataclass
class ChaosConfig:
    duration: float = 120.0  # seconds of load at least; faults are injected during it
    # The load ends on conditions, not at a fixed time (docs/reliability.md, "The chaos command"):
    # once `duration` has passed, every scheduled fault and at least `min_faults` faults were
    # injected, and the sources generated at least `min_records` records. A loaded machine takes
    # longer to get there; past `load_cap` seconds of load (None: 3 x duration) the run ends
    # anyway and fails, saying what it still waited for (`load_incomplete`).
    min_faults: int = 0
    min_records: int = 0
    load_cap: Optional[float] = None
    seed: int = 1
    faults: Sequence[str] = DEFAULT_FAULTS
    nodes: Sequence[str] = ("n1", "n2", "n3")
    pause: Tuple[float, float] = (3.0, 8.0)  # seconds between a recovery and the next fault
    warmup: float = 5.0  # no fault before this many seconds of load
    stall: Tuple[float, float] = (2.0, 6.0)  # SIGSTOP duration of stall-node
    broker_down: Tuple[float, float] = (0.5, 2.0)  # restart-broker: seconds without a broker
    partition: Tuple[float, float] = (3.0, 30.0)  # partition: seconds cut off (the Will comes 15-20 s in)
    agent_restart_delay: float = 1.0  # kill-agent: systemd's RestartSec
    dead_after: float = 6.0  # the agents' [agent].dead_after (kill-node: the node stays away longer)
    recovery_timeout: float = 60.0
    settle_timeout: float = 60.0  # after the load: back to one instance per operator
    workdir: Optional[Path] = None
    log_level: str = "warning"  # the agents' and workers' log level (their logs: <workdir>/<node>.log)
    # A fixed schedule instead of random faults: (t, fault, target) with target None (drawn),
    # a node, an instance or "~<operator>" (kill-worker: a copy, not the keeper), or
    # "@<instance>" (the node hosting it); [] = no fault.
    schedule: Optional[Sequence[Tuple[float, str, Optional[str]]]] = None
    deploy_extra: Dict[str, Any] = field(default_factory=dict)  # `fog-agent deploy --set` values
    rehoming: Optional[bool] = None  # the agents' dead_after > 0; None: on iff kill-node may be drawn
    coordination: str = "ack"  # the pipeline's: "ack" (the paper) or "fgme" (rounds inside 2-FGME locks)
    fgme_damping: bool = DAMPING_DEFAULT  # the pipeline's [pipeline] fgme_damping (DEVIATION 4 in the lock nodes)
    pipeline: str = "demo"  # or "stateful": a keyed window, verified window by window
    chain: bool = False  # the demo pipeline's [pipeline] chain: keepers in chain processes
    ingest_rate: float = 50.0  # mqtt-ingest: readings a second from the outside publisher
    ingest_sensors: int = 10  # mqtt-ingest: sensors they come from (the window's keys)
    # partition: stay cut past the drawn time until every keeper of the node is active
    # elsewhere (at most recovery_timeout more): a heal after the re-homing whatever the load
    partition_until_rehomed: bool = False
    spill_ack: str = "written"  # stateful and mqtt-ingest: the agents' [spill] ack ("landed": acks once landed)

    def __post_init__(self) -> None:
        if self.pipeline not in PIPELINES:
            raise ValueError(f"pipeline: expected one of {', '.join(PIPELINES)}, found {self.pipeline!r}")
        bad = [f for f in self.faults if f not in FAULTS]
        if bad or not self.faults:
            raise ValueError(f"faults: expected a non-empty subset of {', '.join(FAULTS)}, found {list(self.faults)}")
        if self.spill_ack not in ("written", "landed"):
            raise ValueError(f"spill_ack: expected written or landed, found {self.spill_ack!r}")
        if self.coordination not in ("ack", "fgme"):
            raise ValueError(f"coordination: expected ack or fgme, found {self.coordination!r}")
        if self.min_faults < 0 or self.min_records < 0:
            raise ValueError(f"min_faults, min_records: expected counts >= 0, found {self.min_faults}, "
                             f"{self.min_records}")
        if self.schedule is not None and self.min_faults > len(self.schedule):
            raise ValueError(f"min_faults: expected at most the {len(self.schedule)} faults of the schedule, "
                             f"found {self.min_faults}")
        if self.load_cap is not None and self.load_cap < self.duration:
            raise ValueError(f"load_cap: expected seconds >= duration ({self.duration}), found {self.load_cap}")

    @property
    def load_cap_s(self) -> float:
        return float(self.load_cap) if self.load_cap is not None else 3.0 * float(self.duration)


@dataclass
class Fault:
    t: float  # seconds since the load started
    kind: str
    target: str
    recovery_s: Optional[float] = None  # None: not recovered within recovery_timeout
    detail: Dict[str, Any] = field(default_factory=dict)


# ---- observing the fleet ----------------------------------------------------------------------


def _active_instances(mon: Monitor) -> Dict[str, Dict[str, Any]]:
    """id -> the instance entry of its node's retained state, for instances that are active."""
    out: Dict[str, Dict[str, Any]] = {}
    with mon._lock:
        for node, doc in mon.states.items():
            if mon.status.get(node) != "online":
                continue
            for inst in doc.get("instances", []) or []:
                if isinstance(inst, dict) and inst.get("status") == "active" and inst.get("id"):
                    out[str(inst["id"])] = dict(inst, node=node)
    return out


def _back_to_size(mon: Monitor, operators: List[str]) -> bool:
    """Every operator of the pipeline has exactly one instance on an online node, and it is
    active. An operator with none (a re-home that failed) or one still starting is not back:
    counting only the operators present would call a run with no source settled (CHANGELOG.md,
    "A run counted settled during a re-home")."""
    counts = mon.instances_per_operator()
    active = Counter(str(inst.get("operator")) for inst in _active_instances(mon).values())
    return all(counts.get(op) == 1 and active[op] == 1 for op in operators)


def _holding(mon: Monitor) -> List[str]:
    """Instances that still hold records in flight (unacked batches, an outbox, queued input),
    by their last published stats: a run is over when none does, not when the sink is quiet
    (a replay after a lost message comes up to LINK_SILENCE seconds later)."""
    out = []
    with mon._lock:
        for node, doc in mon.states.items():
            for inst in doc.get("instances", []) or []:
                st = inst.get("stats") if isinstance(inst, dict) else None
                if isinstance(st, dict) and (sum((st.get("inflight") or {}).values()) or st.get("outbox")
                                             or st.get("queued")):
                    out.append(str(inst.get("id")))
    return sorted(out)


def _lock_and_round_state(mon: Monitor) -> Dict[str, Any]:
    """At the end of a run: instances still holding or waiting for a 2-FGME lock, instances
    still in a scaling round, lock and link message counts, from the retained states (each
    worker's own view, the `lock` key fogctl locks reads)."""
    held: List[str] = []
    in_round: List[str] = []
    lock_out = 0
    links: Dict[str, int] = {}
    with mon._lock:
        for doc in mon.states.values():
            for inst in doc.get("instances", []) or []:
                if not isinstance(inst, dict):
                    continue
                st = inst.get("stats") if isinstance(inst.get("stats"), dict) else {}
                lock = inst.get("lock")
                if isinstance(lock, dict) and (lock.get("state") != "idle" or lock.get("intent") is not None or any(
                        b.get("state") != "idle" for b in lock.get("boundaries") or [] if isinstance(b, dict))):
                    held.append(str(inst.get("id")))
                if st.get("state") in ("duplicating", "deleting", "departing"):
                    in_round.append(str(inst.get("id")))
                lock_out += int(st.get("lock_out", 0) or 0)
                for k, v in (st.get("links") or {}).items():
                    if isinstance(v, int):
                        links[k] = links.get(k, 0) + v
    return {"locks_held_at_end": sorted(held), "in_round_at_end": sorted(in_round), "lock_messages": lock_out,
            "link_counts": links}


def _scaled_in_since(mon: Monitor, since_wall: float) -> Set[str]:
    return {str(e.get("instance")) for e in mon.agent_events("terminated", "scale_in")
            if float(e.get("ts", e.get("time", 0)) or 0) >= since_wall - 5.0}  # a state is up to 1 s old


def _ended_on_disk(workdir: Path, nodes: Sequence[str], instances: Iterable[str]) -> Set[str]:
    """Of `instances`, those whose scaling core says `terminated` in the state file its worker
    last wrote (`<workdir>/state-<node>/<instance>.state.json`): a copy whose scale-in ended.
    Its agent's "terminated" event is not enough: a copy that finished leaving just as its agent
    or node was killed has exited, but the agent may have died before it published the event;
    the fault would then wait for the copy to be active again until it timed out, and after a
    kill-node for the whole recovery timeout (CHANGELOG.md, "A copy that finished its scale-in as
    its agent was killed was waited for as not recovered"). Copy ids are never used again."""
    out: Set[str] = set()
    for inst in instances:
        for node in nodes:
            try:
                doc = json.loads((workdir / f"state-{node}" / f"{inst}.state.json").read_text())
            except (OSError, ValueError):
                continue
            scaling = doc.get("scaling") if isinstance(doc, dict) else None
            if isinstance(scaling, dict) and scaling.get("state") == "terminated":
                out.add(inst)
                break
    return out


def _waiting_for(mon: Monitor, nodes: Sequence[str], before: Set[str], start_wall: float, end_wall: float,
                 sink_dir: Path, recorded_at_end: float, load_on: bool, workdir: Optional[Path] = None) -> List[str]:
    """What the fleet still lacks to count as recovered from a fault that lasted from
    `start_wall` to `end_wall` (empty: recovered). With `workdir` (a local fleet), a copy whose
    state file says it terminated has left, event or not (`_ended_on_disk`)."""
    with mon._lock:
        offline = [n for n in nodes if mon.status.get(n) != "online"]
    if offline:
        return [f"{n} offline" for n in offline]
    now_active = _active_instances(mon)
    gone = _scaled_in_since(mon, start_wall)
    if workdir is not None:
        gone |= _ended_on_disk(workdir, nodes, (i for i in before - gone if i not in now_active))
    missing = []
    for inst in sorted(before - gone):
        entry = now_active.get(inst)
        stats = (entry or {}).get("stats") or {}
        if entry is None:
            missing.append(f"{inst} not active")
        elif float(stats.get("at", 0) or 0) < end_wall or stats.get("connected") is False:
            missing.append(f"{inst} no fresh heartbeat")
    if missing:
        return missing
    if load_on and _recorded(sink_dir) <= recorded_at_end:
        return ["no new record at the sink"]
    return []


def _recorded(sink_dir: Path) -> int:
    """Progress at the sinks that survives their restarts: the size of their id files (a
    restarted sink's own counters start again, and the monitor keeps the larger of two stats)."""
    return sum(p.stat().st_size for p in Path(sink_dir).glob("*.ids"))


# ---- the faults ---------------------------------------------------------------------------------


class Nemesis:
    """Injects one fault into a running `Fleet`; returns when the fault itself is over."""

    def __init__(self, fleet: Fleet, mon: Monitor, cfg: ChaosConfig, rng: random.Random) -> None:
        self.fleet = fleet
        self.mon = mon
        self.cfg = cfg
        self.rng = rng

    def inject(self, kind: str, target: Optional[str]) -> Tuple[str, Dict[str, Any]]:
        if target is not None and target.startswith("@"):  # the node that hosts this instance
            target = str(_active_instances(self.mon)[target[1:]]["node"])
        return getattr(self, kind.replace("-", "_"))(target)

    def wait_for_target(self, kind: str, target: Optional[str]) -> None:
        """A named target may not exist yet when its time comes: on a loaded machine the keeper
        restarted by the previous fault is active later and decides its scale-out later (no
        copy of "~in_zone" at 10 s under load ~30), or the instance of "@<instance>" is still
        starting. Wait for it, at most `recovery_timeout` (then the fault fails as before): a
        schedule names what to hit, its times are the earliest."""
        if target is None or target[:1] not in ("~", "@"):
            return

        def present() -> bool:
            active = _active_instances(self.mon)
            if target.startswith("@"):
                return target[1:] in active
            return any(e.get("operator") == target[1:] and not e.get("keeper") for e in active.values())

        deadline = time.monotonic() + self.cfg.recovery_timeout
        while not present() and time.monotonic() < deadline:
            time.sleep(0.2)

    def kill_worker(self, target: Optional[str]) -> Tuple[str, Dict[str, Any]]:
        for attempt in range(3):
            active = _active_instances(self.mon)
            chosen = target
            if target is None:
                chosen = self.rng.choice(sorted(active))
            elif target.startswith("~"):  # a copy (not the keeper) of this operator
                copies = sorted(i for i, e in active.items() if e.get("operator") == target[1:] and not e.get("keeper"))
                if not copies:
                    raise RuntimeError(f"kill-worker {target}: no active copy of {target[1:]} to kill")
                chosen = copies[0]
            assert chosen is not None
            pid = int(active[chosen]["pid"])
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                # The retained state lags by up to a state period: the instance just terminated
                # (scaled in). A drawn target is drawn again; a named one is an error.
                if target is not None and not target.startswith("~") or attempt == 2:
                    raise
                time.sleep(1.0)
                continue
            return chosen, {"pid": pid, "node": active[chosen]["node"]}
        raise AssertionError("unreachable")

    def kill_agent(self, target: Optional[str]) -> Tuple[str, Dict[str, Any]]:
        node = target or self.rng.choice(list(self.cfg.nodes))
        hosted = {i for i, e in _active_instances(self.mon).items() if e["node"] == node}
        proc = self.fleet.procs[node]
        proc.kill()
        proc.wait()
        time.sleep(self.cfg.agent_restart_delay)
        self.fleet.start_agent(node)
        return node, {"down_s": self.cfg.agent_restart_delay, "instances": sorted(hosted)}

    def restart_broker(self, target: Optional[str]) -> Tuple[str, Dict[str, Any]]:
        from foglab.tools.broker import start_private_broker

        broker = self.fleet.broker
        port = broker.port
        broker.stop()  # SIGTERM: Mosquitto writes its persistence file and exits
        down = round(self.rng.uniform(*self.cfg.broker_down), 2)
        time.sleep(down)
        self.fleet.broker = start_private_broker(self.fleet.workdir / "broker", max_queued=self.fleet.max_queued,
                                                 port=port)
        return "broker", {"down_s": down}

    def kill_broker(self, target: Optional[str]) -> Tuple[str, Dict[str, Any]]:
        """The broker's host loses power: SIGKILL, so what arrived since Mosquitto's last
        autosave (5 s) is lost: queued messages, and sessions' positions go back in time."""
        from foglab.tools.broker import start_private_broker

        broker = self.fleet.broker
        port = broker.port
        broker.proc.kill()
        broker.proc.wait()
        down = round(self.rng.uniform(*self.cfg.broker_down), 2)
        time.sleep(down)
        self.fleet.broker = start_private_broker(self.fleet.workdir / "broker", max_queued=self.fleet.max_queued,
                                                 port=port)
        return "broker", {"down_s": down}

    def stall_node(self, target: Optional[str]) -> Tuple[str, Dict[str, Any]]:
        import psutil

        node = target or self.rng.choice(list(self.cfg.nodes))
        agent = psutil.Process(self.fleet.procs[node].pid)
        procs = [agent] + agent.children(recursive=True)
        stalled = round(self.rng.uniform(*self.cfg.stall), 2)
        for p in procs:
            _signal(p.pid, signal.SIGSTOP)
        time.sleep(stalled)
        for p in procs:
            _signal(p.pid, signal.SIGCONT)
        return node, {"stalled_s": stalled, "processes": len(procs)}


    def kill_node(self, target: Optional[str]) -> Tuple[str, Dict[str, Any]]:
        import psutil

        node = target or self.rng.choice(list(self.cfg.nodes))
        agent = psutil.Process(self.fleet.procs[node].pid)
        procs = [agent] + agent.children(recursive=True)
        hosted = {i for i, e in _active_instances(self.mon).items() if e["node"] == node}
        killed = time.monotonic()
        for p in procs:
            _signal(p.pid, signal.SIGKILL)
        self.fleet.procs[node].wait()
        # away until its instances run elsewhere (re-homed), but at least dead_after + 2 s
        deadline = killed + self.cfg.dead_after + self.cfg.recovery_timeout
        rehomed: Optional[float] = None
        while time.monotonic() < deadline:
            now_active = _active_instances(self.mon)
            ended = _ended_on_disk(self.fleet.workdir, self.cfg.nodes, (i for i in hosted if i not in now_active))
            if all(i in now_active and now_active[i]["node"] != node or i in ended for i in hosted):
                rehomed = round(time.monotonic() - killed, 2)
                break
            time.sleep(0.2)
        time.sleep(max(0.0, killed + self.cfg.dead_after + 2.0 - time.monotonic()))
        self.fleet.start_agent(node)
        return node, {"instances": sorted(hosted), "rehomed_after_s": rehomed}

    def partition(self, target: Optional[str]) -> Tuple[str, Dict[str, Any]]:
        node = target or self.rng.choice(list(self.cfg.nodes))
        hosted = {i for i, e in _active_instances(self.mon).items() if e["node"] == node}
        drawn = round(self.rng.uniform(*self.cfg.partition), 2)
        proxy = self.fleet.proxies.proxies[node]

        # keepers only: a copy may leave (a scale-in round) instead of being re-homed
        keepers = {i for i, e in _active_instances(self.mon).items() if e["node"] == node and e.get("keeper")}

        def elsewhere() -> List[str]:
            return sorted(i for i, e in _active_instances(self.mon).items() if i in hosted and e["node"] != node)

        # Will (15-20 s) + dead_after + the re-homed workers' start: the last one is slower
        # the more loaded the machine, so `partition_until_rehomed` waits for it
        until_rehomed = self.cfg.partition_until_rehomed
        proxy.cut()
        start = time.monotonic()
        end, last, offline_after = start + drawn, start + drawn + self.cfg.recovery_timeout, None
        try:
            while True:  # the broker fires the node's Will after 1.5 keepalives
                now = time.monotonic()
                if offline_after is None and self.mon.status.get(node) == "offline":
                    offline_after = round(now - start, 2)
                if now >= end and (not until_rehomed or now >= last or keepers <= set(elsewhere())):
                    break
                time.sleep(min(0.2, end - now) if now < end else 0.2)
        finally:
            proxy.heal()
        healed = round(time.monotonic() - start, 2)
        return node, {"cut_s": drawn, "healed_after_s": healed, "offline_after_s": offline_after,
                      "instances": sorted(hosted), "active_elsewhere_at_heal": elsewhere()}


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# ---- the run ------------------------------------------------------------------------------------


def faults_wanted(cfg: ChaosConfig, t: float, injected: int, scheduled_left: int) -> bool:
    """Whether the fault phase goes on at `t` s of load: a schedule until every fault of it was
    injected (a loaded machine recovers later, so its faults come later, none is dropped);
    random faults until `duration` - 5 s (the last one still hits the load) and until at least
    `min_faults` of them were injected. The caller stops at the load cap whatever this says."""
    if cfg.schedule is not None:
        return scheduled_left > 0
    return t < cfg.duration - 5.0 or injected < cfg.min_faults


def load_lacks(cfg: ChaosConfig, t: float, injected: int, scheduled_left: int, generated: int) -> List[str]:
    """What the load still waits for at `t` s before it may end (empty: it ends now). The end is
    a condition, not a time, so that a run means the same on a fast and on a loaded machine:
    the same faults hit it and at least as many records went through them."""
    lacks = []
    if t < cfg.duration:
        lacks.append(f"{cfg.duration:.0f} s of load")
    if scheduled_left:
        lacks.append(f"{scheduled_left} scheduled fault(s) not injected")
    if injected < cfg.min_faults:
        lacks.append(f"{cfg.min_faults} faults ({injected} injected)")
    if generated < cfg.min_records:
        lacks.append(f"{cfg.min_records} records generated ({generated})")
    return lacks


def _end_load(fleet: Fleet, mon: Monitor, source: str, timeout: float = 30.0) -> Dict[str, Any]:
    """The load ends: pause every instance of the source operator through its agent (the "set"
    request, agent.node.rpc). A source killed after this would come back unpaused; no fault
    comes after it, and the profile's last step (the load cap) stops it anyway."""
    deadline = time.monotonic() + timeout
    errors: List[str] = []
    while True:
        targets = {i: str(e["node"]) for i, e in _active_instances(mon).items() if e.get("operator") == source}
        errors = []
        for inst, node in sorted(targets.items()):
            try:
                reply = mon.call(fleet.host, fleet.port, node,
                                 {"v": 1, "op": "set", "instance": inst, "fields": {"paused": True}})
            except Exception as exc:  # noqa: BLE001 - a timeout or a refusal: tried again below
                reply = {"ok": False, "error": str(exc)}
            if not reply.get("ok"):
                errors.append(f"{inst} on {node}: {reply.get('error')}")
        if targets and not errors or time.monotonic() > deadline:
            return {"paused": sorted(targets), "pause_errors": errors or ([] if targets else [f"no active {source}"])}
        time.sleep(1.0)


def _end_ingest(publisher: Any, timeout: float = 60.0) -> Dict[str, Any]:
    """mqtt-ingest: the load ends: the publisher stops, waits for the broker's PUBACK of every
    reading (paho sends again what a broker restart left unacked), then publishes the closing
    reading that makes the window emit every window of the run (foglab.tools.chaos_ingest)."""
    publisher.stop()
    acked = publisher.wait_acked(timeout)
    closer_t = publisher.close_windows()
    closer_acked = publisher.wait_acked(timeout)
    out: Dict[str, Any] = {"readings_published": publisher.published, "readings_acked_by_broker": publisher.acked,
                           "publisher_disconnects": publisher.disconnects, "closer_t_ms": closer_t}
    if not (acked and closer_acked):
        out["publisher_unacked"] = publisher.unacked()[:20]
    return out


def _window_ids(sink_dir: Path) -> int:
    from agent.operators.builtin import read_sink_ids

    received, _ = read_sink_ids(sink_dir)
    return sum(len(v) for v in received.values())


def _ingest_stats(mon: Monitor) -> Dict[str, Any]:
    """The last stats of every source and window instance seen: what the source numbered, shed
    and still held; what the window applied, skipped as replays and dropped as late."""
    keep = ("generated", "shed", "buffered", "unsettled", "keyed_applied", "duplicates_skipped", "late_dropped",
            "no_event_time", "records_in", "records_out")
    with mon._lock:
        ops = dict(mon.instance_operator)
        stats = {i: dict(s) for i, s in mon.instance_stats.items()}
    return {i: {k: st.get(k) for k in keep if k in st} for i, st in sorted(stats.items())
            if ops.get(i) in ("source", "windows")}


def _ingest_verdict(summary: Dict[str, Any], publisher: Any, fleet: Fleet, faults: List["Fault"]) -> Verdict:
    """Every published reading against the windows at the sink (chaos_ingest.ingest_verdict); a
    reading counted twice counts as a duplicate unless the fault it was in flight at allows it
    (the source's incarnation ended without a drain: chaos_ingest.attribute_twice)."""
    from foglab.tools.chaos_ingest import attribute_twice, duplicates_allowed, emitted_windows, ingest_verdict

    # every reading published, kept with the run's logs for a post-mortem: [rid, sensor, t ms] a line
    (fleet.workdir / "readings.jsonl").write_text("".join(json.dumps(list(r)) + "\n" for r in publisher.readings))
    rows, ids = emitted_windows(fleet.sink_dir, fleet.landing, sorted(fleet.workdir.glob("spool-*")))
    v = ingest_verdict(publisher.readings, rows)
    sources = [i for i in (summary.get("ingest_stats") or {}) if ".source." in i] or ["chaos.source.0"]
    fault_dicts = [asdict(f) for f in faults]
    owed = attribute_twice(v.twice_rids, v.readings_counted_twice - len(v.twice_rids),
                           {rid: t for rid, _, t in publisher.readings}, fault_dicts, summary["t0_wall"], sources)
    summary["windows"] = dict(asdict(v), exact_ok=v.ok, at_least_once=v.at_least_once, **ids)
    summary["duplicates_allowed_by"] = duplicates_allowed(fault_dicts, sources)
    summary["counted_twice_by_fault"] = owed
    twice = owed["not_allowed"]  # a loss elsewhere in the run fails it anyway (lost)
    return Verdict(generated=v.published, expected=v.windows_expected, received=v.windows_emitted,
                   lost=v.readings_lost + v.mixed, duplicated=twice + ids["dup_ids"],
                   unexpected=v.extra + ids["unread"])


def run_chaos(cfg: ChaosConfig, out: Any = sys.stderr, live: bool = True) -> Dict[str, Any]:
    """Run one chaos experiment; returns the summary (the `--json` output)."""
    rng = random.Random(cfg.seed)
    cap = cfg.load_cap_s
    text = chaos_pipeline(cfg.duration, cfg.seed, cfg.coordination, cfg.fgme_damping, cfg.pipeline, cfg.chain,
                          until=cap)
    stateful = cfg.pipeline.startswith("stateful")
    ingest = cfg.pipeline == "mqtt-ingest"
    pipeline = load_pipeline_text(text, "chaos pipeline")
    # mqtt-ingest: the publisher's steady rate while it runs (it stops when the load ends)
    profile = [[0, cfg.ingest_rate]] if ingest else pipeline.operators[0].params["steps"]
    workdir = Path(cfg.workdir) if cfg.workdir else Path(tempfile.mkdtemp(prefix="fog-chaos-"))
    started = time.monotonic()
    kinds = set(cfg.faults) if cfg.schedule is None else {k for _, k, _ in cfg.schedule}
    node_loss = "kill-node" in kinds if cfg.rehoming is None else cfg.rehoming
    fleet = Fleet(workdir, nodes=tuple(cfg.nodes), cluster="chaos", log_level=cfg.log_level, shutdown_timeout=10.0,
                  dead_after=cfg.dead_after if node_loss else 0.0,  # re-homing only where a node is lost
                  proxied="partition" in kinds, spill=stateful or ingest,  # the windows' contents are spilled
                  spill_ack=cfg.spill_ack)
    faults: List[Fault] = []
    summary: Dict[str, Any] = {"seed": cfg.seed, "duration": cfg.duration, "min_faults": cfg.min_faults,
                               "min_records": cfg.min_records, "load_cap_s": cap, "faults_enabled": list(cfg.faults),
                               "coordination": cfg.coordination, "fgme_damping": cfg.fgme_damping,
                               "spill_ack": cfg.spill_ack,
                               "workdir": str(workdir)}
    mon: Optional[Monitor] = None
    publisher: Any = None  # mqtt-ingest: the outside sensors (foglab.tools.chaos_ingest.Publisher)

    def generated() -> int:
        return publisher.published if publisher is not None else sum(source_counts(fleet.sink_dir).values())

    def say(line: str) -> None:
        if live:
            print(line, file=out, flush=True)

    def load_at(t: float) -> float:
        rate = 0.0
        for at, r in profile:
            if t >= at:
                rate = float(r)
        return rate

    try:
        fleet.start()
        mon = Monitor(fleet.host, fleet.port, fleet.cluster)
        fleet.wait_online(mon)
        fleet.deploy(text, extra=dict(cfg.deploy_extra))
        if ingest:  # deploy returned: the source's subscription is made, nothing published is missed
            from foglab.tools.chaos_ingest import Publisher

            publisher = Publisher(fleet.host, fleet.port, cfg.seed, cfg.ingest_rate, cfg.ingest_sensors)
            publisher.start()
        t0 = time.monotonic()
        summary["t0_wall"] = time.time()  # the faults' t is seconds after this (mqtt-ingest's attribution)
        say(f"chaos seed {cfg.seed}: {cfg.duration:.0f}s of load at least (at most {cap:.0f}s), faults "
            f"{', '.join(cfg.faults) if cfg.schedule is None else 'on a fixed schedule'}; work dir {workdir}")
        nemesis = Nemesis(fleet, mon, cfg, rng)
        plan = None if cfg.schedule is None else list(cfg.schedule)
        next_at = (plan[0][0] if plan else float("inf")) if plan is not None else cfg.warmup + rng.uniform(*cfg.pause)
        while True:
            t = time.monotonic() - t0
            if t >= cap or not faults_wanted(cfg, t, len(faults), len(plan or ())):
                break
            if t < next_at:
                time.sleep(min(0.5, next_at - t))
                continue
            if plan is not None:
                _, kind, target = plan.pop(0)
            else:
                kind, target = rng.choice(list(cfg.faults)), None
            nemesis.wait_for_target(kind, target)
            before = set(_active_instances(mon))
            recorded = _recorded(fleet.sink_dir)
            injected, start_wall = time.monotonic(), time.time()
            name, detail = nemesis.inject(kind, target)
            end_wall = time.time()
            fault = Fault(round(injected - t0, 2), kind, name, detail=detail)
            deadline = time.monotonic() + cfg.recovery_timeout
            while True:
                lacking = _waiting_for(mon, cfg.nodes, before, start_wall, end_wall, fleet.sink_dir, recorded,
                                       load_at(time.monotonic() - t0) > 0, fleet.workdir)
                if not lacking:
                    fault.recovery_s = round(time.monotonic() - injected, 2)
                    break
                if time.monotonic() > deadline:
                    fault.detail["waiting_for"] = lacking[:5]
                    break
                time.sleep(0.2)
            faults.append(fault)
            rec = f"{fault.recovery_s:.1f}s" if fault.recovery_s is not None else f"NOT RECOVERED {fault.detail.get('waiting_for')}"
            say(f"  t={fault.t:6.1f}s  {kind:<15} {name:<34} recovered in {rec}   instances {mon.instances_per_operator()}")
            t = time.monotonic() - t0
            if plan is not None:
                next_at = plan[0][0] if plan else float("inf")
            else:
                next_at = t + rng.uniform(*cfg.pause)
        # the load ends once its conditions hold (or at the cap, and the run fails saying why)
        while True:
            t = time.monotonic() - t0
            lacks = load_lacks(cfg, t, len(faults), len(plan or ()), generated())
            if not lacks or t >= cap:
                break
            time.sleep(0.5)
        if publisher is not None:
            summary.update(load_s=round(t, 1), **_end_ingest(publisher))
        else:
            summary.update(load_s=round(t, 1), **_end_load(fleet, mon, pipeline.operators[0].name))
        if lacks:
            summary["load_incomplete"] = (f"the load reached its cap of {cap:.0f} s still waiting for "
                                          f"{'; '.join(lacks)}: a machine too loaded for this run, or a fault "
                                          "that stopped the pipeline")
            say(f"  {summary['load_incomplete']}")
        # then wait for the sink to go quiet and every operator to be back at one instance
        settle_from = time.monotonic()
        settle = settle_from + cfg.settle_timeout
        op_names = [op.name for op in pipeline.operators]
        last, quiet, settled = -1.0, None, False
        while time.monotonic() < settle:
            tot = mon.totals()["recorded"]
            back = _back_to_size(mon, op_names)
            quiet = (quiet or time.monotonic()) if tot == last else None
            last = tot
            ends = _lock_and_round_state(mon)
            if publisher is not None and quiet is not None and time.monotonic() - quiet < 10.0:
                # the closing reading's windows: quiet for 3 s is not enough until they are all in
                # (or 10 s of quiet: a window that never comes is the verdict's to report)
                from foglab.tools.chaos_ingest import expected_window_count

                if _window_ids(fleet.sink_dir) < expected_window_count(publisher.readings):
                    time.sleep(1.0)
                    continue
            if (back and quiet is not None and time.monotonic() - quiet >= 3.0 and not _holding(mon)
                    and not ends["locks_held_at_end"] and not ends["in_round_at_end"]):
                settled = True
                break
            time.sleep(1.0)
        # a run that did not settle is stopped with records still in flight: the verdict's "lost"
        # then counts records that were late, and the summary says so (docs/reliability.md)
        summary.update(settled=settled, settle_s=round(time.monotonic() - settle_from, 1),
                       holding_at_end=_holding(mon))
        final = mon.instances_per_operator()
        tot = mon.totals()
        summary.update(
            final_instances=final,
            back_to_size=_back_to_size(mon, op_names),
            duplicates_dropped_at_sink=int(tot["duplicates_dropped"]),
            protocol_messages=int(tot["protocol_out"]),
            restarts=len(mon.agent_events("spawned", "restart")),
            scale_outs=len(mon.agent_events("spawned", "spawn")),
            scale_ins=len(mon.agent_events("terminated", "scale_in")),
            **_lock_and_round_state(mon),
        )
        if ingest:
            summary["ingest_stats"] = _ingest_stats(mon)
    finally:
        if publisher is not None:
            publisher.close()
        if mon is not None:
            mon.close()
        summary["agent_exit_codes"] = fleet.stop()
    if ingest:
        verdict = _ingest_verdict(summary, publisher, fleet, faults)
    elif stateful:
        wv = verify_windows(pipeline, fleet.sink_dir, fleet.landing)
        summary["windows"] = asdict(wv)
        verdict = Verdict(generated=sum(source_counts(fleet.sink_dir).values()), expected=wv.expected,
                          received=wv.received, lost=wv.missing, duplicated=wv.duplicated,
                          unexpected=wv.extra + wv.differing + wv.unread)
    else:
        verdict = verify(pipeline, fleet.sink_dir)
    recovered = [f.recovery_s for f in faults if f.recovery_s is not None]
    summary.update(
        faults=[asdict(f) for f in faults],
        faults_injected=len(faults),
        all_recovered=len(recovered) == len(faults),
        recovery_s={"median": round(statistics.median(recovered), 2) if recovered else None,
                    "max": round(max(recovered), 2) if recovered else None},
        records_in=verdict.generated,
        records_expected=verdict.expected,
        records_out=verdict.received,
        lost=verdict.lost,
        duplicated=verdict.duplicated + verdict.unexpected,
        lost_sample=[list(x) for x in verdict.lost_sample],
        wall_s=round(time.monotonic() - started, 1),
    )
    summary["ok"] = bool(verdict.ok and summary["all_recovered"] and summary.get("back_to_size")
                         and not summary.get("load_incomplete") and not summary.get("pause_errors")
                         and not summary.get("locks_held_at_end") and not summary.get("in_round_at_end"))
    return summary


def print_report(summary: Dict[str, Any], out: Any = sys.stdout) -> None:
    """The faults table and the verdict, for a person."""
    print(f"{'t (s)':>7}  {'fault':<15} {'target':<34} {'recovery (s)':>12}", file=out)
    for f in summary.get("faults", []):
        rec = f"{f['recovery_s']:.2f}" if f.get("recovery_s") is not None else "-"
        print(f"{f['t']:7.1f}  {f['kind']:<15} {f['target']:<34} {rec:>12}", file=out)
    r = summary.get("recovery_s") or {}
    print(f"faults {summary.get('faults_injected', 0)}, recovery median {r.get('median')} s, max {r.get('max')} s; "
          f"records in {summary.get('records_in')}, expected at the sink {summary.get('records_expected')}, "
          f"out {summary.get('records_out')}, lost {summary.get('lost')}, duplicated {summary.get('duplicated')} "
          f"(duplicates dropped at the sink {summary.get('duplicates_dropped_at_sink')}); "
          f"final instances {summary.get('final_instances')}; load {summary.get('load_s')} s "
          f"(at least {summary.get('duration')}), {summary.get('wall_s')} s in all", file=out)
    if summary.get("load_incomplete"):
        print(f"LOAD INCOMPLETE: {summary['load_incomplete']}", file=out)
    if summary.get("pause_errors"):
        print(f"the source was not paused at the end of the load: {summary['pause_errors']}", file=out)
    if summary.get("coordination") == "fgme":
        print(f"coordination fgme: lock messages {summary.get('lock_messages')}, links {summary.get('link_counts')}; "
              f"locks held at the end {summary.get('locks_held_at_end')}, "
              f"in a round at the end {summary.get('in_round_at_end')}", file=out)
    if summary.get("settled") is False:
        print(f"not settled after {summary.get('settle_s')} s: {', '.join(summary.get('holding_at_end') or []) or 'no'} "
              "instance still held records in flight; records counted lost may only have been late "
              "(raise settle_timeout)", file=out)
    w = summary.get("windows")
    if w and "windows_expected" in w:  # mqtt-ingest: every published reading against the windows
        owed = summary.get("counted_twice_by_fault") or {}
        print(f"readings: {w['published']} published ({summary.get('readings_acked_by_broker')} acked by the "
              f"broker), {w['readings_lost']} lost, {w['readings_counted_twice']} counted twice"
              + (f" ({owed.get('allowed')} allowed: in flight when the source's incarnation ended without a "
                 f"drain; {owed.get('not_allowed')} not)" if w['readings_counted_twice'] else ""), file=out)
        for fault, rids in sorted((owed.get("by_fault") or {}).items()):
            ok = (owed.get("fault_allows") or {}).get(fault)
            print(f"  counted twice, in flight at {fault} ({'allowed' if ok else 'NOT allowed'}): rids {rids}",
                  file=out)
        print(f"windows: {w['windows_expected']} expected from the published readings, "
              f"{w['windows_emitted']} at the sink: exact {w['exact']}, missing {w['missing']}, extra {w['extra']}, "
              f"different {w['different']} "
              f"(of which same count, other sum {w['mixed']}); ids recorded twice {w['dup_ids']}, "
              f"content read from an unshipped spool file {w.get('from_spool')}, found nowhere {w['unread']}",
              file=out)
        for line in w.get("samples") or ():
            print(f"  {line}", file=out)
        if summary.get("publisher_unacked"):
            print(f"readings never acked by the broker: {summary['publisher_unacked']}", file=out)
    elif w:
        print(f"windows: {w['expected']} in the fault-free reference, {w['received']} at the sink, missing "
              f"{w['missing']}, extra {w['extra']}, twice {w['duplicated']}, other content {w['differing']}, "
              f"content not landed {w['unread']}", file=out)
        for line in w.get("samples") or ():
            print(f"  {line}", file=out)
    print("verdict: " + ("OK" if summary.get("ok") else "FAILED"), file=out)


def exit_status(summary: Dict[str, Any]) -> int:
    if summary.get("lost") or summary.get("duplicated"):
        return EXIT_LOSS
    if not summary.get("ok"):
        return EXIT_UNRECOVERED
    return EXIT_OK


def main(args: Any) -> int:
    faults = [f.strip() for f in str(args.faults or ",".join(DEFAULT_FAULTS)).split(",") if f.strip()]
    try:
        rehoming = {"on": True, "off": False}.get(str(getattr(args, "rehoming", "auto")))
        cfg = ChaosConfig(duration=float(args.duration), seed=int(args.seed), faults=faults,
                          min_faults=int(getattr(args, "min_faults", 0) or 0),
                          min_records=int(getattr(args, "min_records", 0) or 0),
                          load_cap=getattr(args, "load_cap", None),
                          workdir=Path(args.workdir) if args.workdir else None, rehoming=rehoming,
                          coordination=str(getattr(args, "coordination", "ack")),
                          fgme_damping=bool(getattr(args, "fgme_damping", DAMPING_DEFAULT)),
                          pipeline=str(getattr(args, "pipeline", "demo")),
                          chain=bool(getattr(args, "chain", False)),
                          spill_ack=str(getattr(args, "spill_ack", "written")))
    except ValueError as exc:
        print(f"fog-agent chaos: {exc}", file=sys.stderr)
        return 2
    import contextlib

    from agent.log import stdout_to_stderr

    runs: List[Dict[str, Any]] = []
    for i in range(int(args.runs)):
        run_cfg = cfg if i == 0 else ChaosConfig(**{**asdict(cfg), "seed": cfg.seed + i, "workdir": None})
        try:
            with stdout_to_stderr() if args.json else contextlib.nullcontext():  # --json: stdout is the JSON alone
                summary = run_chaos(run_cfg, out=sys.stderr, live=not args.json)
        except Exception as exc:  # noqa: BLE001 - the fleet could not be set up: say so, one line
            print(f"fog-agent chaos: set-up failed: {exc}", file=sys.stderr)
            return EXIT_SETUP
        runs.append(summary)
        if not args.json:
            print_report(summary)
    if args.json:
        print(json.dumps(runs[0] if len(runs) == 1 else runs, indent=2, default=str))
    return max(exit_status(s) for s in runs)
