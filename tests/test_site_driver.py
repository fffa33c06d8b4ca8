"""The site manager's driver (agent.node.site_driver): what a new leader sends, in which order."""

from __future__ import annotations

import json
from typing import Any, Dict

from agent.config import SiteManagerSection
from agent.node.site_driver import Emit, Publish, SiteDriver, Steer


def docs(now: float) -> Dict[str, Dict[str, Any]]:
    """n1 (3 slots, full, loaded) can go: without it the spare stays above the target; n2 (12
    free slots) cannot."""
    busy = [{"id": f"p.op{i}.0", "operator": f"op{i}", "capacity": 500.0, "load": 100.0} for i in range(3)]
    return {"n1": {"time": now, "slots": 3, "free_slots": 0, "instances": busy},
            "n2": {"time": now, "slots": 12, "free_slots": 12, "instances": []}}


def test_a_new_leader_publishes_its_lease_before_it_steers_any_node() -> None:
    """The agents accept a drain only from the holder of the lease they have received (daemon
    `_peer_may_steer`): a new leader's first period publishes its record and orders nothing; from
    the next period on the record still goes out before the period's requests. (The drain used
    to leave with the first record and arrive first: refused, and the manager then waited its
    whole `timeout` for a drain that never started.)"""
    section = SiteManagerSection(enabled=True, target=0.88, min_nodes=1, max_nodes=2, cooldown=1.0,
                                 timeout=60.0, period=0.5, lease=4.0)
    driver = SiteDriver(section, "n2", "c", stale_after=5.0)
    online = {"n1": True, "n2": True}
    first = driver.tick(1000.0, docs(1000.0), online)
    assert [type(e) for e in first] == [Publish], first
    record = json.loads(first[0].payload)
    assert record["node"] == "n2" and record["until"] == 1004.0 and first[0].retain
    driver.on_lease(first[0].payload)  # the broker's retained copy comes back
    second = driver.tick(1000.5, docs(1000.5), online)
    assert [type(e) for e in second] == [Publish, Emit, Steer], second
    assert second[2].node == "n1" and second[2].body["op"] == "drain"
