"""`fogctl drain` of the node hosting a keyed keeper (issue 22): the keeper migrates with its keyed
state (agent.node.statexfer: the compacted snapshot in chunks before the hand-over's spawn), a
keyed copy on the same node leaves by its termination (its groups go to the keeper first), and the
windows at the sink are exactly those of the fault-free run. Real agents, workers and Mosquitto."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Tuple

import pytest

from agent.instance.keyed_state import KeyedState
from agent.node.deploy import RpcClient
from agent.operators.builtin import OperatorContext
from agent.operators.keyed import sliding_window, tumbling_window
from agent.operators.taxi import TaxiGenerator
from foglab.tools.demo import Fleet, Monitor
from test_fogctl_agents import fogctl
from test_keyed_broker import Collector

pytestmark = [pytest.mark.broker, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parent.parent
N = 1800
WINDOW = {"time_field": "pickup_datetime", "size_ms": 300_000, "lateness_ms": 600_000, "agg": "sum",
          "field": "total_amount"}
# 30-minute windows every minute: ~30 open windows per medallion, a keyed state of ~600 kB when
# the keeper moves, so that it travels in several chunks (statexfer.CHUNK_BYTES, 128 KiB).
SLIDING = dict(WINDOW, size_ms=1_800_000, slide_ms=60_000)


def _function(window: Dict[str, Any]) -> Any:
    return sliding_window if "slide_ms" in window else tumbling_window


def pipeline(topic: str, rate: float = 150.0, n: int = N, window: Dict[str, Any] = WINDOW) -> str:
    """source (500 medallions) -> win (a windowed sum per medallion, keyed) -> an MQTT sink."""
    params = ", ".join(f"{k} = {json.dumps(v)}" for k, v in window.items())
    function = "sliding_window" if "slide_ms" in window else "tumbling_window"
    return f"""
[pipeline]
name = "dk"
[scaling]
policy = "none"
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
key = "medallion"
batch_size = 20
params = {{ seed = 4, profile = "constant", rate = {rate}, max_records = {n} }}
[[operator]]
name = "win"
function = "agent.operators.keyed:{function}"
batch_size = 20
params = {{ {params} }}
[[operator]]
name = "out"
kind = "sink"
function = "agent.operators.builtin:mqtt_sink"
params = {{ topic = "{topic}" }}
"""


def fault_free(n: int = N, window: Dict[str, Any] = WINDOW) -> Dict[Tuple[str, int], str]:
    """The reference: the operator over the source's records in order, in one process."""
    op = _function(window).build(OperatorContext("w", "win", "n", "map", params=dict(window)))
    ks = KeyedState(op, "win", "medallion", 128)
    gen = TaxiGenerator(4, "dk.source.0")
    out = ks.apply("dk.source.0", [("dk.source.0", i, gen.record()) for i in range(n)], 1)
    return {(s, q): json.dumps(r, sort_keys=True) for s, q, r in out}


class Run:
    """One live run: the sink's collector, a fleet of one agent (`node`) on the test broker, its
    monitor, and the checks against the reference."""

    def __init__(self, mosquitto: Any, tmp_path: Path, prefix: str, node: str, slots: int) -> None:
        self.cluster = prefix + uuid.uuid4().hex[:8]
        self.topic = f"lab/{self.cluster}/out"
        self.coll = Collector(mosquitto.host, mosquitto.port, self.topic)
        self.fleet = Fleet(tmp_path, nodes=(node,), slots=slots, cluster=self.cluster, broker_host=mosquitto.host,
                           broker_port=mosquitto.port, state_period=0.5, heartbeat_period=0.2, shutdown_timeout=8.0)
        self.fleet.start()
        self.mon = Monitor(mosquitto.host, mosquitto.port, self.cluster)
        self.stats: Dict[str, Any] = {}  # the keyed instances' last counters, for a failure's message

    def emitted(self) -> int:
        with self.coll.lock:
            return len(self.coll.got)

    def wait_for(self, want: Dict[Tuple[str, int], str], bound: float = 60.0) -> None:
        """Until every window of the reference came (or `bound`), then a moment for any more."""
        deadline = time.monotonic() + bound
        while self.emitted() < len(want) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # anything more (a window the reference does not have) arrives now

    def stop(self) -> Dict[str, Any]:
        codes = self.fleet.stop()
        keyed = ("keyed_applied", "duplicates_skipped", "late_dropped", "keys_held")
        self.stats = {i: {k: st.get(k) for k in keyed}
                      for i, st in self.mon.instance_stats.items() if st.get("keyed_state")}
        self.mon.close()
        self.coll.close()
        return codes

    def check(self, want: Dict[Tuple[str, int], str]) -> None:
        """Every window of the reference once, with its content, and no other."""
        got = self.coll.got
        assert self.coll.conflicts == [], self.coll.conflicts[:3]  # an id never carries two windows
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        assert not missing and not extra, (len(missing), missing[:3], len(extra), extra[:3])
        # the windows whose content differs, each with both contents (a whole-dict diff drowns
        # them: the sink's arrival order is not the reference's)
        differ = [(k, got[k], want[k]) for k in want if got[k] != want[k]]
        assert not differ, (len(differ), differ[:5], self.stats)


def test_drain_moves_a_keyed_keeper_with_its_state_and_the_windows_equal_the_fault_free_run(
        capsys: Any, mosquitto: Any, tmp_path: Path) -> None:
    """h2 hosts every keeper and a copy of the keyed window; `fogctl drain h2` mid-stream: the copy
    terminates (its groups back to the keeper), then the keeper stops, its agent ships its keyed state
    and starts it on h1 or h3 with the same identity, which installs the state before it starts.
    Then every window of the reference is at the sink, once, with the same sum, and no other.
    The windows slide (30 min every minute): the state the keeper takes along is ~250-600 kB,
    several chunks. Without the shipped keyed state the new incarnation starts empty: the
    windows open at the drain lose what came before it and the medallions' output numbering
    restarts (ids reused with other content, as when the worker's install was cut)."""
    started = time.monotonic()
    want = fault_free(window=SLIDING)
    assert len(want) > 6000  # ~30 min of pickups, 30-min windows every minute, ~480 medallions
    run = Run(mosquitto, tmp_path, "dk", "h2", slots=4)
    fleet, mon, cluster = run.fleet, run.mon, run.cluster
    keeper = "dk.win.0"

    def hosts(m: Any, inst: str) -> list:
        return [(n, i) for n, doc in m.states.items() if m.status.get(n) == "online"
                for i in doc.get("instances", []) if i["id"] == inst]

    def pause(node: str, paused: bool) -> None:
        with RpcClient(mosquitto.host, mosquitto.port, cluster) as client:
            reply = client.call(node, {"op": "set", "instance": "dk.source.0", "fields": {"paused": paused}})
        assert reply["ok"], reply

    def wins(m: Any, node: Any = None) -> list:
        return [i["id"] for n, doc in m.states.items() if node in (None, n) and m.status.get(n) == "online"
                for i in doc.get("instances", []) if i["operator"] == "win" and i["status"] == "active"]

    try:
        fleet.wait_online(mon)
        fleet.deploy(pipeline(run.topic, rate=180.0, window=SLIDING))  # returns once the keepers run
        pause("h2", True)  # held while the fleet grows, so that the drain comes mid-stream at any load
        fleet.nodes = ("h1", "h2", "h3")
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        for node in ("h1", "h3"):
            fleet.start_agent(node, env)
        assert mon.wait(lambda m: bool(hosts(m, keeper)) and hosts(m, keeper)[0][0] == "h2", 20), mon.states
        fleet.wait_online(mon)
        assert "accepted" in fogctl(capsys, mosquitto, cluster, "scale", "win", "+1")
        assert mon.wait(lambda m: len(wins(m, "h2")) == 2, 30), mon.states.get("h2")  # the copy: h2 too
        [copy] = [i for i in wins(mon, "h2") if i != keeper]
        pause("h2", False)
        assert mon.wait(lambda m: run.emitted() > len(want) // 10, 30), run.emitted()  # both hold state
        at_drain = run.emitted()
        assert at_drain < len(want) // 2, at_drain  # mid-stream
        doc = fogctl(capsys, mosquitto, cluster, "--json", "drain", "h2")
        assert doc["ok"] and {keeper, copy} <= set(doc["result"]["leaving"]), doc
        assert mon.wait(lambda m: m.states.get("h2", {}).get("instances") == [], 30), mon.states.get("h2")
        assert mon.wait(lambda m: any(n != "h2" and i["status"] == "active" for n, i in hosts(m, keeper)), 20)
        [(node, inst)] = hosts(mon, keeper)  # one process per identity, on another node
        assert node in ("h1", "h3") and inst["keeper"] is True, (node, inst)
        run.wait_for(want)
        # the copy left by its termination (a scale-in), the keeper by a hand-over, nothing crashed
        [copy_left] = [e["ts"] for e in mon.agent_events("terminated", "scale_in") if e["instance"] == copy]
        [keeper_left] = [e["ts"] for e in mon.agent_events("terminated", "handover") if e["instance"] == keeper]
        assert copy_left <= keeper_left, (copy_left, keeper_left)  # the keeper stopped once the copy had left
        assert not mon.agent_events("terminated", "crash")
        stats = mon.instance_stats.get(keeper, {})
        pause(hosts(mon, "dk.source.0")[0][0], True)
    finally:
        codes = run.stop()
    assert all(c == 0 for c in codes.values()), codes
    left = sorted(p.name for p in (tmp_path / "state-h2").glob(f"{keeper}.*") if p.suffix != ".lock")
    assert left == [], left  # h2 forgot the keeper: no state, keyed state or spec to re-adopt
    run.check(want)
    print(f"keyed drain test: {time.monotonic() - started:.1f}s, {len(want)} windows ({at_drain} before the drain), keeper on {node}, "
          f"replayed records skipped there: {stats.get('duplicates_skipped')}, copies at the sink: {run.coll.copies}, "
          f"keyed counters: {run.stats}")


def test_the_site_manager_consolidates_a_fleet_running_a_keyed_pipeline(mosquitto: Any, tmp_path: Path) -> None:
    """The site manager (docs/site-manager.md) drains the node that hosts the keyed window's
    keeper, as it drains any node the fleet can do without, and releases it once it is empty:
    the keeper lands on the other node with its keyed state, and the windows at the sink equal
    the fault-free run. n1 (3 slots) runs the pipeline before n2 (24 slots, the only site
    manager candidate) starts: spare capacity without n2 is below the target, without n1 it is
    not, so n1 is the node to drain (`site_manager.decide`)."""
    started = time.monotonic()
    n = 3000
    want = fault_free(n)
    run = Run(mosquitto, tmp_path, "dks", "n1", slots=3)
    fleet, mon = run.fleet, run.mon
    keeper = "dk.win.0"

    def on(m: Any, inst: str) -> list:
        return [nd for nd, doc in m.states.items() if m.status.get(nd) == "online"
                for i in doc.get("instances", []) if i["id"] == inst and i["status"] == "active"]

    try:
        fleet.wait_online(mon)
        fleet.deploy(pipeline(run.topic, rate=120.0, n=n))
        assert mon.wait(lambda m: on(m, keeper) == ["n1"], 20), mon.states
        assert mon.wait(lambda m: run.emitted() > 20, 20)  # records flow: n1's instances report a load
        fleet.nodes, fleet.slots = ("n1", "n2"), 24
        fleet.extra_toml = ("[site_manager]\nenabled = true\ntarget = 0.9\nmin_nodes = 1\nmax_nodes = 2\n"
                            "cooldown = 1.0\ntimeout = 60.0\nperiod = 0.5\nlease = 4.0\n")
        fleet.start_agent("n2", dict(os.environ, PYTHONPATH=str(ROOT)))
        fleet.wait_online(mon)  # the drain's bound below starts once n2 runs (not paused meanwhile: an
        # idle n1 would make n2, empty, the node to drain)

        def site(m: Any) -> list:
            return [((e.get("detail") or {}).get("action"), (e.get("detail") or {}).get("node"))
                    for e in list(m.events) if e.get("type") == "site_action"]

        assert mon.wait(lambda m: ("drain", "n1") in site(m), 30), (site(mon), mon.states)
        assert run.emitted() < len(want), run.emitted()  # mid-stream
        assert mon.wait(lambda m: ("release", "n1") in site(m), 30), (site(mon), mon.states.get("n1"))
        assert mon.states["n1"]["instances"] == []
        assert mon.wait(lambda m: on(m, keeper) == ["n2"], 20), mon.states.get("n2")
        run.wait_for(want)
        assert site(mon)[:2] == [("drain", "n1"), ("release", "n1")], site(mon)
        assert keeper in {e["instance"] for e in mon.agent_events("terminated", "handover")}
        # released only once the keeper ran on n2 (n1 listed it as `handing_over` until then)
        [ready] = [e["ts"] for e in mon.agent_events("spawned", "handover") if e["instance"] == keeper]
        [release] = [e["ts"] for e in list(mon.events) if e.get("type") == "site_action"
                     and (e.get("detail") or {}).get("action") == "release"]
        assert ready < release, (ready, release)
    finally:
        codes = run.stop()
    assert all(c == 0 for c in codes.values()), codes
    run.check(want)
    print(f"keyed consolidation test: {time.monotonic() - started:.1f}s, {len(want)} windows")
