"""agent.node.routes on its own: where a message from the bus goes on node "me", by its topic,
whether it came retained and whether this connection's retained records are in."""

from __future__ import annotations

from agent import topics
from agent.node import routes


def to(topic: str, retain: bool = False, retained_in: bool = True) -> str:
    return routes.route("me", topics.parse("c", topic), retain, retained_in)


def test_requests_go_to_the_requests_and_a_peers_waits_for_the_retained_records() -> None:
    assert to(topics.agent_rpc("c", "me", "admin")) == routes.REQUEST
    assert to(topics.agent_peer("c", "me", "n2")) == routes.REQUEST
    assert to(topics.agent_peer("c", "me", "n2"), retained_in=False) == routes.HOLD
    assert to(topics.agent_rpc("c", "me", "admin"), retained_in=False) == routes.REQUEST  # an admin's: at once
    assert to(topics.agent_rpc("c", "n2", "admin")) == routes.IGNORE  # another node's
    assert to(topics.agent_peer("c", "n2", "me")) == routes.IGNORE


def test_a_reply_from_another_node_answers_a_call_and_ours_is_the_sync_marker() -> None:
    assert to(topics.replies("c", "me", "n2")) == routes.REPLY
    assert to(topics.replies("c", "me", "me")) == routes.MARKER
    assert to(topics.replies("c", "n2", "me")) == routes.IGNORE  # a reply to another requester


def test_what_is_never_retained_is_dropped_when_it_comes_retained_and_records_go_inbound() -> None:
    for topic in (topics.agent_rpc("c", "me", "admin"), topics.agent_peer("c", "me", "n2"),
                  topics.replies("c", "me", "n2"), topics.latency_ping("c", "me", "n2"), topics.events("c"),
                  topics.agent_rpc("c", "n2", "admin")):
        assert to(topic, retain=True) == routes.RETAINED, topic
    for topic in (topics.agent_state("c", "n2"), topics.agent_status("c", "n2"), topics.agent_state("c", "me")):
        assert to(topic) == to(topic, retain=True) == routes.INBOUND, topic
    assert to(topics.latency_ping("c", "me", "n2")) == routes.INBOUND  # the probes' handler checks the target
    assert to("other/cluster/topic") == routes.IGNORE


def test_the_sender_of_a_message_as_its_topic_says() -> None:
    assert routes.sender(topics.parse("c", topics.agent_peer("c", "me", "n2"))) == "n2"
    assert routes.sender(topics.parse("c", topics.agent_state("c", "n3"))) == "n3"
    assert routes.sender(None) is None
