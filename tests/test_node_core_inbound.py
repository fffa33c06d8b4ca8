"""agent.node.inbound's probes on their own: which agents the latency core pings and when our
retained latency row goes out, with a recording core and no broker."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional, Tuple

from agent.node.fleetview import FleetView
from agent.node.hostsync import HostSync
from agent.node.inbound import Inbound, InboundCalls
from agent.node.rehoming import Rehoming
from agent.node.replicas import Replication
from agent.node.site_manager import LeaseBoard


class Core:
    """A latency core that says what it was told (agent.measure.latency.LatencyCore's methods)."""

    def __init__(self, due: bool) -> None:
        self.due = due
        self.neighbours: Optional[Tuple[List[str], Any]] = None
        self.polled: List[float] = []

    def set_neighbours(self, nodes: Any, near: Any) -> None:
        self.neighbours = (sorted(nodes), near)

    def poll(self, now: float) -> List[Tuple[str, bytes]]:
        self.polled.append(now)
        return [(f"ping/{n}", b"p") for n in (self.neighbours or ([], None))[0]]

    def publish_due(self, now: float) -> bool:
        return self.due

    def retained(self, wall: float) -> Tuple[str, bytes]:
        return "latency/me", str(wall).encode()


def inbound(tmp_path: Path, core: Any) -> Tuple[Inbound, List[Tuple[str, bytes, dict]]]:
    sent: List[Tuple[str, bytes, dict]] = []
    view = FleetView("me")
    view.fleet = {"me": {}, "n2": {}, "n3": {}, "n4": {}}
    view.online = {"n2": True, "n3": False}  # n4: no status yet
    hosts = HostSync("me")
    hosts.near = {"n2"}
    calls = InboundCalls(publish=lambda t, p, **kw: sent.append((t, p, kw)), keep=lambda *a: True,
                         bad=lambda *a: None, changed=lambda: None, drop_stale=lambda *a: None,
                         retained_in=lambda: True, restate_rehomed=lambda: None, received=lambda msg, t: t)
    return Inbound("me", "c", view, hosts, Replication("me", tmp_path), Rehoming("me"), None, LeaseBoard("me", 60.0),
                   core, {}, lambda: 5.0, lambda: 1700.0, calls), sent


def test_the_core_pings_the_online_agents_and_publishes_its_row_when_due(tmp_path: Path) -> None:
    core = Core(due=False)
    part, sent = inbound(tmp_path, core)
    part.probe()
    assert core.neighbours == (["n2"], {"n2"}) and core.polled == [5.0]  # not us, not an offline or unknown one
    assert sent == [("ping/n2", b"p", {"qos": 0})]
    core.due = True
    part.probe()
    assert sent[-1] == ("latency/me", b"1700.0", {"retain": True})


def test_without_a_latency_core_nothing_is_sent(tmp_path: Path) -> None:
    part, sent = inbound(tmp_path, None)
    part.probe()
    assert sent == []
