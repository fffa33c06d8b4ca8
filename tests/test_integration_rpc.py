"""RpcClient.snapshot against a broker where agents keep publishing (the `deploy` hang).

Why this test: the old snapshot waited for 0.3 s of silence and restarted the wait on every
message, so with agents publishing more often than that it never returned. The snapshot must end
at its sync marker, return every retained topic, and raise (not hang) when no marker comes back.
"""

from __future__ import annotations

import threading
import time
from typing import Dict, List

import pytest

from agent import topics
from agent.node.deploy import RpcClient, RpcError

pytestmark = pytest.mark.broker


def test_snapshot_ends_while_agents_publish_every_100ms(mosquitto) -> None:
    cluster = "snaphang"
    base = f"fog/{cluster}/agents"
    stop = threading.Event()
    with RpcClient(mosquitto.host, mosquitto.port, cluster) as pub:
        for n in ("n1", "n2", "n3"):
            pub.publish(f"{base}/{n}/state", b'{"node": "%s"}' % n.encode(), retain=True)

        def chatter() -> None:
            # non-stop publishing, faster than the old 0.3 s settle window (only this thread publishes)
            i = 0
            while not stop.is_set():
                for n in ("n1", "n2", "n3"):
                    pub._client.publish(f"{base}/{n}/state", b'{"node": "%s", "i": %d}' % (n.encode(), i),
                                        qos=0, retain=True)
                i += 1
                time.sleep(0.1)

        t = threading.Thread(target=chatter, daemon=True)
        t.start()
        try:
            results: List[Dict[str, bytes]] = []
            with RpcClient(mosquitto.host, mosquitto.port, cluster) as reader:
                def run() -> None:
                    for _ in range(3):
                        results.append(reader.snapshot(f"{base}/+/state"))

                th = threading.Thread(target=run, daemon=True)
                t0 = time.monotonic()
                th.start()
                th.join(20.0)
                assert not th.is_alive(), "snapshot did not return within 20 s while agents publish"
                elapsed = time.monotonic() - t0
        finally:
            stop.set()
            t.join(5)
    assert len(results) == 3
    for snap in results:
        assert set(snap) == {f"{base}/{n}/state" for n in ("n1", "n2", "n3")}, snap
    assert elapsed < 20.0


def test_snapshot_has_a_hard_deadline(mosquitto) -> None:
    """If the marker never comes back the snapshot raises within its timeout instead of hanging."""
    with RpcClient(mosquitto.host, mosquitto.port, "snapdead") as reader:
        # the marker goes to another identity's reply namespace: nobody here listens
        reader.reply_topic = topics.replies("snapdead", "nobody-listens", reader.identity)
        t0 = time.monotonic()
        with pytest.raises(RpcError, match="sync marker"):
            reader.snapshot("fog/snapdead/agents/+/state", timeout=1.5)
        assert time.monotonic() - t0 < 6.0
