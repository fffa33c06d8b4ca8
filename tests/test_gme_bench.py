"""2-FGME / RA1 / RA2 through the private Mosquitto: one paho client per node, verifier on events."""

from __future__ import annotations

import pytest

from agent.runtime.gme_bench import BenchConfig, run_bench


@pytest.mark.broker
@pytest.mark.parametrize("alg", ["2fgme", "ra1", "ra2"])
def test_real_broker_run_is_safe_and_serves_every_request(mosquitto, alg):
    r = run_bench(BenchConfig(algorithm=alg, nodes=4, entries=3, think_ms=20, cs_ms=20,
                              host=mosquitto.host, port=mosquitto.port, timeout_s=60))
    assert r["errors"] == []
    assert r["safety_violations"] == 0
    assert r["unserved_requests"] == 0 and r["cs_entries"] == 12
    if alg == "ra1":
        assert r["messages"] == 12 * 2 * 3  # 2 (n - 1) per entry, also on the wire
