"""The sans-IO half of `fog-agent bench fleet` (lab/foglab/tools/fleet_bench.py): attribution of a
publication, the broker's fan-out from the daemon's subscriptions, and the N -> 1,000 model.
The bench itself is a command (docs/scale.md), not a test: a fleet run takes minutes."""

from agent import topics
from foglab.tools import fleet_bench as fb

NODES = ["n1", "n2", "n3", "n4"]


def test_agent_filters_are_the_daemons_subscriptions():
    """AGENT_FILTERS is a copy of the daemon's subscriptions (agent.node.bus): a subscription added
    there and not here would make the bench undercount what each agent receives."""
    from agent.node.bus import subscriptions

    ours = {t for t, _ in subscriptions("c", "n1")}
    filters = fb.agent_filters("c", "n1")
    assert topics.agent_rpc_inbox("c", "n1") in ours and ours <= set(filters), ours - set(filters)
    assert topics.latency_pings("c", "n1") in filters and topics.latency_pongs("c", "n1") in filters


def test_fanout_and_attribution():
    state = topics.agent_state("c", "n2")
    assert fb.receivers("c", state, NODES) == NODES  # every agent reads every state
    ping = topics.latency_ping("c", "n3", "n1")
    assert fb.receivers("c", ping, NODES) == ["n3"]
    assert fb.publisher("c", ping, b"{}") == ("ping", "n1")
    assert fb.publisher("c", topics.latency_pong("c", "n1", "n3"), b"{}") == ("pong", "n3")
    assert fb.publisher("c", topics.events("c"), b'{"node": "n4"}') == ("events", "n4")
    assert fb.receivers("c", topics.events("c"), NODES) == []  # agents do not read the events
    every = [topics.agent_state("c", "n1"), topics.agent_status("c", "n2"), topics.agent_hosted("c", "n3"),
             topics.agent_rehomed("c", "n4"), topics.latency("c", "n1"), topics.pipeline("c", "p"),
             topics.site_manager("c", "n2"), topics.agent_rpc("c", "n2", "admin"), topics.agent_peer("c", "n3", "n1"),
             topics.replies("c", "n1", "n2"), ping, topics.latency_pong("c", "n1", "n3"),
             topics.latency_pong("c", "n9", "n3"), topics.events("c"), topics.spill_chunk("c", "n1")]
    for t in every:  # the shortcut by topic kind is what paho's matcher says of the daemon's filters
        assert fb.receivers("c", t, NODES) == fb.receivers("c", t, NODES, exact=True), t


def test_window_and_quadratic_model():
    def run(n):
        nodes = [f"n{i}" for i in range(n)]
        pubs = []
        for a in nodes:  # 10 s: two state rounds, two ping rounds to every other node
            pubs += [(topics.agent_state("c", a), b"x" * 100)] * 2
            pubs += [(topics.latency_ping("c", b, a), b"y" * 10) for b in nodes if b != a] * 2
        r = fb.summarize_window("c", nodes, pubs, 10.0)
        r["nodes"] = n
        return r

    runs = [run(4), run(8)]
    st = runs[1]["kinds"]["state"]
    assert st["fanout"] == 8 and abs(st["in_msgs_per_node_s"] - 1.6) < 1e-9
    assert abs(runs[1]["mean"]["out_msgs_s"] - (0.2 + 0.2 * 7)) < 1e-9
    ext = fb.extrapolate(fb.fit_model(runs), 1000)
    # state: 0.2/s per node x 1000 nodes, each to 1000 agents; ping: 0.2*(N-1)/s per node, to one
    assert abs(ext["kinds"]["state"]["broker_out_msgs_s"] - 0.2 * 1000 * 1000) < 1e-6
    assert abs(ext["kinds"]["ping"]["broker_in_msgs_s"] - 0.2 * 999 * 1000) < 1e-6
    assert abs(ext["per_node_in_msgs_s"] - (0.2 * 1000 + 0.2 * 999)) < 1e-6
