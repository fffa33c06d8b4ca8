"""Issue 5's "Must hold" on the real broker: three agents, real workers, live scaling, every id once.

Each test runs a fleet of `fog-agent run` processes (foglab.tools.demo.Fleet) on the session's
Mosquitto, deploys a taxi pipeline with a step load profile, and checks with the exactly-once
verifier (seeded sources regenerated, filters applied, compared with the counting sinks' id
files). Periods are 1 s and loads small, so that the whole file stays around three minutes.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from agent import topics
from agent.config import load_pipeline_text
from foglab.tools.demo import Fleet, Monitor
from foglab.tools.verify import verify

pytestmark = [pytest.mark.broker, pytest.mark.slow]

R, C_IN_ZONE = 0.7, 200.0

STEP_PIPELINE = """
[pipeline]
name = "{name}"
[scaling]
policy = "decentralized"
target_ratio = 0.7
up = 0.8
down = 0.6
period = 1.0
capacity = 5000.0
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
batch_size = {batch}
max_inflight_batches = {window}
[operator.params]
seed = {seed}
profile = "steps"
steps = {steps}
[[operator]]
name = "validate"
function = "agent.operators.builtin:validate"
batch_size = {batch}
max_inflight_batches = {window}
service_time_ms = {validate_ms}
[operator.scaling]
capacity = {validate_capacity}
period = 1.0
[[operator]]
name = "in_zone"
function = "agent.operators.builtin:in_zone"
batch_size = {batch}
max_inflight_batches = {window}
service_time_ms = 4.0
[operator.scaling]
capacity = 200.0
period = 1.0
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
batch_size = {batch}
max_inflight_batches = {window}
service_time_ms = {sink_ms}
[operator.scaling]
policy = "none"
"""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def rate_of(mon: Monitor, key: str, operator: str, window: float = 2.0) -> float:
    """records/s of a stat summed over an operator's instances, measured over `window` seconds."""
    def total() -> float:
        with mon._lock:
            return sum(float(s.get(key, 0) or 0) for i, s in mon.instance_stats.items()
                       if mon.instance_operator.get(i) == operator)
    a = total()
    time.sleep(window)
    return (total() - a) / window


def run_until_drained(mon: Monitor, end: float, t0: float, timeout: float = 40.0) -> bool:
    """Wait for the profile's end, then until the sink stops receiving and in_zone is back to 1."""
    while time.monotonic() - t0 < end:
        time.sleep(0.5)
    deadline = time.monotonic() + timeout
    last = -1.0
    quiet_since: Optional[float] = None
    while time.monotonic() < deadline:
        time.sleep(1.0)
        tot = mon.totals()["recorded"]
        back = all(v <= 1 for v in mon.instances_per_operator().values())
        quiet_since = (quiet_since or time.monotonic()) if tot == last else None
        last = tot
        if back and quiet_since is not None and time.monotonic() - quiet_since >= 2.0:
            return True
    return False


def stop_and_check_no_orphans(fleet: Fleet, mon: Monitor) -> Dict[str, Any]:
    import psutil

    pids = set(mon.pids)
    for proc in fleet.procs.values():  # every descendant, the idle pre-started worker included
        pids.update(c.pid for c in psutil.Process(proc.pid).children(recursive=True))
    t0 = time.monotonic()
    codes = fleet.stop(timeout=fleet.shutdown_timeout + 3.0)  # documented bound: shutdown_timeout + 3 s
    took = time.monotonic() - t0
    assert all(c == 0 for c in codes.values()), f"agents did not stop cleanly within the bound: {codes}"
    assert took <= fleet.shutdown_timeout + 3.0
    assert pids, "the monitor saw no worker pid"
    time.sleep(0.3)
    alive = [p for p in pids if pid_alive(p)]
    assert not alive, f"orphan worker processes after SIGTERM: {alive}"
    return {"stop_s": took}


def broker_dropped(mon: Monitor) -> Optional[float]:
    """The broker's dropped-message counter as the monitor knows it.

    Mosquitto publishes `$SYS/broker/publish/messages/dropped` retained with a 60 s message expiry,
    and only when it changes: a subscriber that gets nothing within a few seconds knows that it has
    not changed for 60 s. The monitor stays subscribed for the whole test, so any later change
    (a drop) arrives live; `assert_no_drop` compares with this baseline (None = unchanged).
    """
    mon.wait(lambda m: m.dropped is not None, 3)
    return mon.dropped


def assert_no_drop(mon: Monitor, baseline: Optional[float]) -> None:
    time.sleep(1.5)  # sys_interval 1: a change during the test has been published by now
    assert mon.dropped == baseline, f"the broker dropped messages: counter {baseline} -> {mon.dropped}"


def test_step_load_scales_out_and_back_exactly_once(tmp_path: Path, mosquitto: Any) -> None:
    """Step load up then down: in_zone reaches ceil(load/(r*C)) within a few periods, returns to its
    keeper, every id reaches the sink once, over >= 5 scale-outs and >= 5 scale-ins; malformed
    payloads into an inbox are counted and skipped; SIGTERM stops the fleet with no orphan."""
    high = 900.0
    steps = [[0, 60], [4, high], [34, 60], [40, 0]]
    text = STEP_PIPELINE.format(name="step", seed=7, steps=steps, validate_ms=0.0, validate_capacity=20000.0, sink_ms=0.0,
                                batch=100, window=8)
    cfg = load_pipeline_text(text)
    fleet = Fleet(tmp_path, slots=6, cluster="itstep", broker_host=mosquitto.host, broker_port=mosquitto.port,
                  shutdown_timeout=8.0)
    fleet.start()
    mon = Monitor(mosquitto.host, mosquitto.port, fleet.cluster)
    try:
        dropped_before = broker_dropped(mon)
        fleet.wait_online(mon)
        fleet.deploy(text)
        t0 = time.monotonic()
        # malformed payloads into the in_zone keeper's inbox, while it works
        time.sleep(2.0)
        from agent.node.deploy import RpcClient

        keeper = "step.in_zone.0"
        def hosts_of(m: Any) -> List[str]:  # its inbox is on the node that hosts it (per-node inboxes)
            return [n for n, doc in m.states.items() for i in doc.get("instances", []) if i["id"] == keeper]

        assert mon.wait(lambda m: len(hosts_of(m)) == 1, 10), mon.states
        host = hosts_of(mon)
        with RpcClient(mosquitto.host, mosquitto.port, fleet.cluster) as client:
            for junk in (b"garbage", b"{}", b"\xff\xfe\x00", b'{"sender": "x", "seq": "a"}', b"[1,2,3]"):
                client.publish(topics.inbox_at(fleet.cluster, host[0], keeper, "n1"), junk)
        # the load: in_zone gets ~0.95 * high records/s
        target = math.ceil(0.93 * high / (R * C_IN_ZONE))
        reached_at: Optional[float] = None
        while time.monotonic() - t0 < 34:
            n = mon.instances_per_operator().get("in_zone", 0)
            if n >= target and reached_at is None:
                reached_at = time.monotonic() - t0
            time.sleep(0.25)
        max_in_zone = max(c.get("in_zone", 0) for _, c in mon.series)
        assert reached_at is not None, f"in_zone peaked at {max_in_zone} instances, needed {target}"
        assert reached_at - 4.0 <= 15.0, f"in_zone reached {target} instances only {reached_at - 4:.1f}s after the step"
        assert run_until_drained(mon, 40.0, t0), f"pipeline not drained back to keepers: {mon.instances_per_operator()}"
        assert mon.instances_per_operator().get("in_zone") == 1, mon.instances_per_operator()
        ks = mon.stats_of(keeper)
        assert ks.get("malformed", 0) >= 5, ks  # counted and skipped...
        assert ks.get("records_in", 0) > 1000  # ...and the keeper kept working
        scale_outs = len(mon.agent_events("spawned", "spawn"))
        scale_ins = len(mon.agent_events("terminated", "scale_in"))
        assert scale_outs >= 5 and scale_ins >= 5, (scale_outs, scale_ins)
        assert mon.totals()["sends_to_non_successor"] == 0
        assert_no_drop(mon, dropped_before)
        stop_and_check_no_orphans(fleet, mon)
    finally:
        mon.close()
        fleet.stop(timeout=15)
    v = verify(cfg, fleet.sink_dir)
    assert v.generated > 15000
    assert v.lost == 0 and v.duplicated == 0 and v.unexpected == 0, v
    assert v.received == v.expected


def test_neighbours_scale_together_and_a_slow_sink_slows_producers(tmp_path: Path, mosquitto: Any) -> None:
    """validate and in_zone scale at the same time; then the sink is slowed down 10x for 20 s:
    the source slows down (back pressure), the broker drops nothing, nothing is lost or duplicated,
    and no record is ever sent to an instance that is no longer a successor. The load ends (the
    source is paused) 5 s after the sink is fast again."""
    rate = 300.0
    steps = [[0, rate], [80, 0]]
    text = STEP_PIPELINE.format(name="nb", seed=11, steps=steps, validate_ms=4.0, validate_capacity=200.0, sink_ms=0.8,
                                batch=20, window=4)  # small windows: back pressure shows within seconds
    cfg = load_pipeline_text(text)
    # Enough slots for the policy's overshoot: a refused spawn stalls the asking instance's round.
    fleet = Fleet(tmp_path, slots=8, cluster="itnb", broker_host=mosquitto.host, broker_port=mosquitto.port,
                  shutdown_timeout=8.0)
    fleet.start()
    mon = Monitor(mosquitto.host, mosquitto.port, fleet.cluster)
    try:
        dropped_before = broker_dropped(mon)
        fleet.wait_online(mon)
        placed = {d.operator: d for d in fleet.deploy(text)}
        t0 = time.monotonic()
        assert mon.wait(lambda m: m.instances_per_operator().get("validate", 0) >= 2
                        and m.instances_per_operator().get("in_zone", 0) >= 2, 20), mon.instances_per_operator()
        # precondition: the scaled pipeline keeps up with the load before the sink slows down
        deadline = time.monotonic() + 35.0
        before = 0.0
        while time.monotonic() < deadline and before < 0.85 * rate:
            before = rate_of(mon, "generated", "source", window=3.0)
        sink = placed["sink"]
        from agent.node.deploy import RpcClient

        with RpcClient(mosquitto.host, mosquitto.port, fleet.cluster) as client:
            assert client.call(sink.node, {"op": "set", "instance": sink.instance, "fields": {"service_time_ms": 8.0}})["ok"]
            time.sleep(8.0)  # let the credit windows fill
            during = rate_of(mon, "generated", "source", window=4.0)
            sink_during = rate_of(mon, "recorded", "sink", window=4.0)
            assert time.monotonic() - t0 < 80.0, "the slow phase must lie inside the load profile"
            time.sleep(20.0 - 16.0)
            assert client.call(sink.node, {"op": "set", "instance": sink.instance, "fields": {"service_time_ms": 0.8}})["ok"]
            # The backlog drains at full load for 5 s, then the load ends: the source is paused
            # instead of idling to the profile's end (80 s; it must only outlast the slow phase).
            time.sleep(5.0)
            source = placed["source"]
            assert client.call(source.node, {"op": "set", "instance": source.instance, "fields": {"paused": True}})["ok"]
            load_end = time.monotonic() - t0
        # 10x slower sink (125 records/s): the source follows it instead of flooding the broker
        assert before >= 0.85 * rate, before
        assert sink_during < 170, sink_during
        assert during < 0.7 * before, (before, during)
        assert run_until_drained(mon, load_end, t0), f"pipeline not drained back to keepers: {mon.instances_per_operator()}"
        maxima = {op: max(c.get(op, 0) for _, c in mon.series) for op in ("validate", "in_zone")}
        assert maxima["validate"] >= 2 and maxima["in_zone"] >= 2, maxima
        assert len(mon.agent_events("spawned", "spawn")) >= 2
        assert mon.totals()["sends_to_non_successor"] == 0
        assert_no_drop(mon, dropped_before)
        stop_and_check_no_orphans(fleet, mon)
    finally:
        mon.close()
        fleet.stop(timeout=15)
    v = verify(cfg, fleet.sink_dir)
    assert v.lost == 0 and v.duplicated == 0 and v.unexpected == 0, v
    assert v.received == v.expected and v.generated > 5000
