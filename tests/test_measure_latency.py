"""Latency: the sans-IO core, the delay proxy, RTTs through the broker and the echo vs the matrix.

Tolerance (stated): a measured RTT is the configured emulated RTT plus the real loopback/broker
path and Python scheduling on a shared 2-core machine, so each median must lie within
[configured - 2 ms, configured + max(25 ms, 10 %)]. The lower bound catches a proxy that does not
delay; the upper bound catches one that delays twice or a measurement that adds the period.
"""

from __future__ import annotations

import json
import statistics
import time

import pytest

from agent import topics
from agent.node.placement import rank_nodes_for_scale_out
from foglab.tools.delayproxy import DelayProxy, ProxyBank, pair_proxies
from agent.measure.latency import (
    BROKER,
    EchoServer,
    LatencyCore,
    MqttLatencyAgent,
    SmoothedRow,
    ping_topic,
    pong_topic,
    tcp_rtt,
    udp_rtt,
)


def within(measured: float, configured: float) -> bool:
    return configured - 2.0 <= measured <= configured + max(25.0, 0.10 * configured)


# ---- sans-IO core -----------------------------------------------------------------------------------


def test_core_ping_pong_on_a_fake_link():
    a, b = LatencyCore("a", "c", period=5.0), LatencyCore("b", "c", period=5.0)
    a.set_neighbours(["b", "a"])  # itself is ignored
    pings = a.poll(100.0)
    # the sender is the topic's last level: latency/<target>/ping/<sender>
    assert [t for t, _ in pings] == [ping_topic("c", "a", "a"), ping_topic("c", "b", "a")]
    assert ping_topic("c", "b", "a") == "fog/c/latency/b/ping/a"
    assert a.poll(101.0) == []  # one round per period
    # b answers its ping with a pong to a, on a's pong topic, signed with b: latency/a/pong/b
    (to_b,) = [p for t, p in pings if t == ping_topic("c", "b", "a")]
    replies = b.on_message(ping_topic("c", "b", "a"), to_b, 100.02)
    assert replies == [(pong_topic("c", "a", "b"), to_b)]
    assert pong_topic("c", "a", "b") == "fog/c/latency/a/pong/b"
    assert a.on_message(pong_topic("c", "a", "b"), to_b, 100.05) == []
    assert a.rtt("b") == pytest.approx(50.0)
    assert a.on_message(pong_topic("c", "a", "b"), to_b, 100.5) == [] and a.rtt("b") == pytest.approx(50.0)  # duplicate
    (self_ping,) = [p for t, p in pings if t == ping_topic("c", "a", "a")]
    a.on_message(ping_topic("c", "a", "a"), self_ping, 100.004)
    assert a.rtt(BROKER) == pytest.approx(4.0)
    topic, payload = a.retained(200.0)
    doc = json.loads(payload)
    assert topic == topics.latency("c", "a")
    assert doc["rtt_ms"] == {"b": 50.0} and doc["broker_rtt_ms"] == 4.0
    # a malformed probe is refused with the documented error type (the caller counts it)
    with pytest.raises(ValueError):
        a.on_message(pong_topic("c", "a", "b"), b"garbage", 1.0)
    assert a.rtt("b") == pytest.approx(50.0)


def test_core_refuses_probes_whose_payload_contradicts_the_topic():
    """The peer is the topic's last level (the ACL proves it): a ping naming another origin, a
    ping {"o": ""} (once ended the agent) or a 100k-deep one is refused, nothing is sent."""
    b = LatencyCore("b", "c", period=5.0)
    forged = json.dumps({"o": "victim", "t": "b", "n": 1, "s": 0.0}).encode()
    for topic, payload in [
        (ping_topic("c", "b", "mallory"), forged),
        (ping_topic("c", "b", "a"), b'{"o": ""}'),
        (ping_topic("c", "b", "a"), b"[" * 100_000),
        (ping_topic("c", "b", "a"), json.dumps({"o": "a", "t": "b", "n": True, "s": 0.0}).encode()),
        (ping_topic("c", "b", "a"), json.dumps({"o": "a", "t": "b", "n": 1, "s": float("inf")}).encode()),
    ]:
        with pytest.raises(ValueError):
            b.on_message(topic, payload, 1.0)
    assert b.on_message(ping_topic("c", "x", "a"), forged, 1.0) == []  # not ours
    assert b.on_message(topics.latency("c", "b"), forged, 1.0) == []


def test_core_counts_lost_pings_and_forgets_departed_neighbours():
    a = LatencyCore("a", "c", period=1.0, timeout=2.0)
    a.set_neighbours(["b"])
    a.poll(0.0)
    a.poll(5.0)  # both first-round pings timed out
    assert a.lost == 2
    a.record("b", 10.0)
    a.set_neighbours([])
    assert a.rtt("b") is None and a.dirty


def test_smoothing_is_an_ewma():
    row = SmoothedRow(0.5)
    row.add("x", 100.0)
    row.add("x", 50.0)
    assert row.value["x"] == pytest.approx(75.0) and row.samples["x"] == 2
    with pytest.raises(ValueError):
        row.add("x", -1.0)


def test_fogctl_and_nodestate_read_the_retained_document():
    from agent.control.fleet import parse_latency as fogctl_parse
    from agent.node.nodestate import parse_latency as node_parse

    a = LatencyCore("a", "c", emulated={"b": 50.0})
    a.record("b", 51.5)
    _, payload = a.retained(1.0)
    assert node_parse(payload) == {"b": 51.5}
    assert fogctl_parse(payload) == ({"b": 51.5}, {"b": 50.0})


# ---- real sockets -------------------------------------------------------------------------------------


def test_echo_through_pairwise_proxies_follows_the_full_matrix():
    matrix = {"n1": {"n2": 0.0, "n3": 50.0, "n4": 150.0}, "n2": {"n4": 300.0}}
    echoes = {n: EchoServer().start() for n in ("n2", "n3", "n4")}
    proxies = pair_proxies({n: ("127.0.0.1", e.port) for n, e in echoes.items()}, matrix)
    try:
        for (src, dst), proxy in proxies.items():
            med = statistics.median(tcp_rtt("127.0.0.1", proxy.port, count=3))
            assert within(med, matrix[src][dst]), (src, dst, med)
        direct = udp_rtt("127.0.0.1", echoes["n2"].port, count=3)
        assert direct and max(direct) < 25.0  # UDP echo without a proxy: loopback only
    finally:
        for p in proxies.values():
            p.stop()
        for e in echoes.values():
            e.stop()


def test_proxy_rtt_can_change_at_runtime():
    echo = EchoServer().start()
    try:
        with DelayProxy(("127.0.0.1", echo.port), rtt_ms=40.0) as proxy:
            assert within(statistics.median(tcp_rtt("127.0.0.1", proxy.port, count=3)), 40.0)
            proxy.set_rtt(120.0)
            assert within(statistics.median(tcp_rtt("127.0.0.1", proxy.port, count=3)), 120.0)
    finally:
        echo.stop()


@pytest.fixture
def nodelay_broker(tmp_path):
    """A private broker with `set_tcp_nodelay true` (the setting docs/measurement.md recommends for
    latency measurement): with Mosquitto's default (Nagle on), a pong queued behind an unacked
    packet waits for the peer's delayed ACK (~40 ms), which is the broker's artefact, not the link's."""
    import subprocess

    from conftest import MOSQUITTO, free_port, wait_port

    port = free_port()
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\nset_tcp_nodelay true\n")
    proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port("127.0.0.1", port)
        yield ("127.0.0.1", port)
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.broker
def test_rtt_through_the_broker_follows_the_emulated_matrix(nodelay_broker):
    """Four agents, each behind its own proxy to the broker: RTT(x, y) = d_x + d_y."""
    to_broker = {"a": 0.0, "b": 50.0, "c": 150.0, "d": 300.0}
    cluster = f"lat{int(time.time() * 1000) % 100000}"
    samples = {n: {} for n in to_broker}
    with ProxyBank(nodelay_broker, to_broker) as bank:
        agents = []
        try:
            for node in to_broker:
                core = LatencyCore(node, cluster, period=0.7, smoothing=0.3, timeout=3.0)
                core.set_neighbours(n for n in to_broker if n != node)
                record = core.record

                def spy(peer, rtt_ms, via="echo", node=node, record=record):
                    samples[node].setdefault(peer, []).append(rtt_ms)
                    record(peer, rtt_ms, via)

                core.record = spy
                agents.append(MqttLatencyAgent(core, "127.0.0.1", bank.port(node)).start())
            deadline = time.monotonic() + 8.0
            while time.monotonic() < deadline:
                time.sleep(0.2)
                if all(len(samples[x].get(y, ())) >= 5 for x in to_broker for y in list(to_broker) + [BROKER] if y != x):
                    break
        finally:
            for ag in agents:
                ag.stop()
    medians = {x: {y: statistics.median(v) for y, v in row.items()} for x, row in samples.items()}
    bad = []
    for x in to_broker:
        if not within(medians[x].get(BROKER, -1.0), to_broker[x]):
            bad.append((x, BROKER, medians[x].get(BROKER)))
        for y in to_broker:
            if y != x and not within(medians[x].get(y, -1.0), to_broker[x] + to_broker[y]):
                bad.append((x, y, medians[x].get(y), samples[x].get(y)))
    assert not bad, bad
    # the measured row drives placement: from a, the nearer of c and d is chosen
    measured = {"a": {y: v for y, v in medians["a"].items() if y != BROKER}, "c": {"d": medians["c"]["d"]}}
    assert rank_nodes_for_scale_out(measured, ["a"], ["d", "c"])[0] == "c"


def test_proxy_cut_holds_every_byte_and_new_connection_until_heal():
    """A partition (chaos `partition`): nothing passes either way while cut, nothing is lost or
    reordered, and a connection opened during the cut goes through only after `heal`."""
    import socket

    echo = EchoServer().start()
    try:
        with DelayProxy(("127.0.0.1", echo.port)) as proxy:
            a = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
            a.sendall(b"one")
            assert a.recv(16) == b"one"
            proxy.cut()
            a.sendall(b"two")
            b = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)  # accepted, held
            b.sendall(b"three")
            for s in (a, b):
                s.settimeout(0.6)
                with pytest.raises(socket.timeout):
                    s.recv(16)
            proxy.heal()
            for s, want in ((a, b"two"), (b, b"three")):
                s.settimeout(5)
                got = b""
                while len(got) < len(want):
                    got += s.recv(16)
                assert got == want
            a.close()
            b.close()
    finally:
        echo.stop()


def _round(core, t, rtt_ms):
    """One probing round of `core` at `t`, every pinged peer answering after rtt_ms[peer] (10 ms
    if not given); returns the peers pinged and the times the row was due for publication."""
    pings = core.poll(t)
    pinged, published = [], []
    for topic, payload in pings:
        peer = topic.split("/")[3]
        pinged.append(peer)
        if peer == core.node:  # the self-ping: its echo is the ping itself
            core.on_message(topic, payload, t + 0.002)
        else:
            core.on_message(pong_topic("c", core.node, peer), payload, t + rtt_ms.get(peer, 10.0) / 1000.0)
        if core.publish_due(t + 0.5):
            published.append(t)
            core.retained(t)
    return pinged, published


def test_a_round_pings_the_near_peers_and_the_others_in_turn():
    """Pinging every node every period cost each of N nodes 2N probes a period (N^2 at the
    broker, docs/scale.md): a round pings itself, the near peers and 8 others in turn, and in
    ceil(others / 8) rounds every pair has been measured once."""
    a = LatencyCore("a", "c", period=5.0)
    peers = [f"n{i:02d}" for i in range(20)]
    a.set_neighbours(peers + ["a"], near=["n03", "n17", "stranger"])
    assert a.near == ("n03", "n17")  # only online peers are near
    seen = set()
    for r in range(3):
        pinged, _ = _round(a, 100.0 + 5 * r, {})
        assert pinged[:3] == ["a", "n03", "n17"] and len(pinged) == 3 + 8
        seen.update(pinged[3:])
    assert seen == set(peers) - {"n03", "n17"}
    assert set(a.row.value) == set(peers) | {BROKER}  # out of the rotation, a value is kept
    a.set_neighbours(peers[:5])
    assert set(a.row.value) == set(peers[:5]) | {BROKER}  # a node that left is forgotten
    few = LatencyCore("b", "c", period=5.0)
    few.set_neighbours(["x", "y"])
    assert few.targets() == ("b", "x", "y")


def test_the_row_is_published_on_news_at_most_once_a_period_else_every_refresh():
    """Each publication costs the broker N deliveries of O(N) bytes: the row goes out when a peer
    came or an RTT moved by more than a fifth, at most once a period, and otherwise once every
    6 periods, however many pongs changed it a little."""
    a = LatencyCore("a", "c", period=5.0)
    peers = [f"n{i}" for i in range(20)]
    a.set_neighbours(peers, near=["n0"])
    published = []
    t = 100.0
    for _ in range(12):  # 3 rounds bring new peers into the row, then 9 steady ones
        published += _round(a, t, {})[1]
        t += 5.0
    # a round's first pong publishes (new peers); the peers that came later in the round go out
    # with the next round; from the fourth round on nothing is news: the 30 s refresh only
    assert published == [100.0, 105.0, 110.0, 115.0, 145.0]
    published = []
    for r in range(3):  # n0 (near) is now 5 times as far: news, but once a period
        published += _round(a, t, {"n0": 50.0})[1]
        t += 5.0
    assert published and published[0] == 160.0
    assert len(published) == len(set(published))
    assert json.loads(a.retained(t)[1])["rtt_ms"]["n0"] > 12.0
    assert set(json.loads(a.retained(t)[1])) == {"node", "ts", "rtt_ms", "broker_rtt_ms", "lost", "period"}
    a.dirty = False
    assert not a.publish_due(t + 100)  # nothing changed since
