"""A duplication whose createNode() fails on real agents is cancelled, not retried forever.

Why: the worker used to hold its round's protocol messages and retry the spawn every second,
stalling its neighbours and leaving records undelivered at shutdown. Here the only agent has no
free slot; a scale request sent straight to it (fogctl itself would refuse it) makes the keeper
start a round that cannot create its copy: the round must be cancelled (event), the instance
count unchanged, and every record still delivered exactly once.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

import agent.node.daemon  # noqa: E402,F401  (a broken daemon must fail here, not skip)

from pipelines import taxi_in_zone  # noqa: E402

pytestmark = pytest.mark.broker

PIPELINE = taxi_in_zone("full", seed=4, rate=40.0)


def test_failed_spawn_cancels_the_round_and_loses_nothing(mosquitto: Any, tmp_path: Any) -> None:
    from agent.config import load_pipeline_text
    from foglab.tools.demo import Fleet, Monitor
    from foglab.tools.verify import verify
    from agent.node.deploy import RpcClient

    cluster = "c" + uuid.uuid4().hex[:8]
    fleet = Fleet(tmp_path, nodes=("c1",), slots=3, cluster=cluster, broker_host=mosquitto.host,
                  broker_port=mosquitto.port, state_period=0.5, heartbeat_period=0.2, shutdown_timeout=8.0)
    fleet.start()
    mon = Monitor(mosquitto.host, mosquitto.port, cluster)
    try:
        fleet.wait_online(mon)
        fleet.deploy(PIPELINE)
        assert mon.wait(lambda m: m.instances_per_operator() == {"source": 1, "in_zone": 1, "sink": 1}, 30)
        with RpcClient(mosquitto.host, mosquitto.port, cluster) as client:
            reply = client.call("c1", {"v": 1, "op": "scale", "operator": "in_zone", "delta": 1, "pipeline": None})
            assert reply["ok"], reply  # accepted: the agent's own check does not count slots
            assert mon.wait(lambda m: any(is_cancel(e) for e in m.events), 20), m_events(mon)
            ev = next(e for e in mon.events if is_cancel(e))
            assert ev["instance"] == "full.in_zone.0"
            sink_before = mon.sink_records_in()
            time.sleep(2.0)
            # the keeper is back to work: records still reach the sink, no instance appeared
            assert mon.wait(lambda m: m.sink_records_in() > sink_before + 20, 20)
            assert mon.instances_per_operator() == {"source": 1, "in_zone": 1, "sink": 1}
            keeper = mon.instance_stats.get("full.in_zone.0", {})
            assert keeper.get("state") == "active", keeper
            src = "full.source.0"
            assert client.call("c1", {"op": "set", "instance": src, "fields": {"paused": True}})["ok"]
        mon.wait_sink_quiet(30)
    finally:
        codes = fleet.stop()
        mon.close()
    assert all(c == 0 for c in codes.values()), codes
    v = verify(load_pipeline_text(PIPELINE), fleet.sink_dir)
    assert v.generated > 40 and v.ok, v  # records flowed before and after the cancel (asserted above)


def m_events(mon: Any) -> Any:
    return [e.get("type") for e in mon.events]


def is_cancel(e: Any) -> bool:
    return e.get("type") == "refused" and (e.get("detail") or {}).get("what") == "round_cancelled"
