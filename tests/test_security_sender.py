"""Proof of the sender of a data envelope (issue #20; docs/security.md, "Data channels").

The inbox topic names the node that wrote it (`fog/<c>/inbox/<instance>/<node>`, and the role's
ACL lets a node write only `inbox/+/<itself>`); a receiver accepts an envelope only if that node
hosts the instance the envelope claims as its sender, as its agent's binding table says
(agent.node.hostmap). These tests check:

- the binding rule (`HostMap`): sticky while its node lives and lists the instance, follows a
  hand-over and a re-home, never goes to a node that merely lists a live node's instance;
  examples, every short sequence of events over three nodes, and random long ones;
- the worker's use of it, in process: a batch written by the wrong node is refused before it
  touches any state and cannot take the place of the real batch; an unknown binding holds
  (bounded, apart from other nodes' streams) until the agent's "hosts" line, then refuses;
- the attack itself against the real TLS broker with the role's config and two real agents
  (`test_a_node_cannot_write_data_in_the_name_of_another_nodes_instance`);
- per-node inboxes (docs/security.md, "Who may read an inbox"): the topics, a worker addressing
  the bound node, parking what is unbound and following a move, in process; on the TLS broker,
  a node reading only its own instances' inboxes before and after a drain moves them, every record
  exactly once.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent import topics
from agent.dataplane.envelope import Envelope, Kind, encode, encode_data
from agent.dataplane.inbound import ACCEPT, HOLD, REFUSE, writer_verdict
from agent.instance.events import Abort, Control
from agent.mqtt.transport import Received
from agent.node.hostmap import HostMap
from agent_process import ONLINE_BOUND
from test_security_dataplane import _records, _run, _worker

# ---- the rule ------------------------------------------------------------------------------------


def test_only_the_bound_node_is_accepted_and_any_other_waits_for_the_binding() -> None:
    assert writer_verdict("n1", (), "n1") == ACCEPT
    # n2 writes in the name of n1's instance: a forgery, or a new incarnation on n2 whose hosted
    # record has not reached us yet; held (the worker refuses it when WRITER_HOLD_TTL is up)
    assert writer_verdict("n1", (), "n2") == HOLD
    assert writer_verdict(None, (), "n2") == HOLD  # not known yet (a new copy's record on its way)
    # n0 hosted it before and is offline: what it wrote then, still queued, counts
    assert writer_verdict("n1", ("n0",), "n0") == ACCEPT
    assert REFUSE not in {writer_verdict(b, (), w) for b in (None, "n1", "n2") for w in ("n1", "n2")}


def _map(me: str = "me") -> HostMap:
    return HostMap(me)


def _hosted(**nodes: List[str]) -> Dict[str, List[Tuple[str, str]]]:
    return {n: [(i, "p") for i in insts] for n, insts in nodes.items()}


def test_a_binding_is_the_listing_node_and_a_local_instance_is_ours() -> None:
    m = _map()
    m.update({"sink-0": "p"}, _hosted(a=["work-0"], b=["source-0"], me=["sink-0"]), {"a": True, "b": True})
    assert (m.bound("work-0"), m.bound("source-0"), m.bound("sink-0")) == ("a", "b", "me")
    # another node listing our own running instance changes nothing
    m.update({"sink-0": "p"}, _hosted(a=["work-0", "sink-0"], b=["source-0"]), {"a": True, "b": True})
    assert m.bound("sink-0") == "me" and m.pending("sink-0") == ("a",)
    assert m.table("p") == {"bound": {"work-0": "a", "source-0": "b", "sink-0": "me"}, "former": {}}
    assert m.table("other") == {"bound": {}, "former": {}}


def test_the_near_nodes_are_those_bound_to_instances_of_our_pipelines() -> None:
    """The latency probes' near peers (docs/scale.md): where our pipelines' other instances run,
    not every node of the fleet."""
    m = _map()
    m.update({"sink-0": "p"}, {"a": [("work-0", "p")], "b": [("other-0", "q")], "c": [("src-0", "p")],
                               "me": [("sink-0", "p")]}, {"a": True, "b": True, "c": True})
    assert m.nodes_of({"p"}) == {"a", "c", "me"}
    assert m.nodes_of({"q"}) == {"b"} and m.nodes_of(set()) == set()


def test_a_node_that_lists_a_live_nodes_instance_does_not_get_its_binding() -> None:
    m = _map()
    up = {"a": True, "b": True}
    m.update({}, _hosted(a=["work-0"]), up)
    m.update({}, _hosted(a=["work-0"], b=["work-0"]), up)  # b claims it too (hostile, or a move)
    assert m.bound("work-0") == "a" and m.pending("work-0") == ("b",)
    m.update({}, _hosted(a=["work-0"], b=["work-0"]), up)
    assert m.bound("work-0") == "a"


def test_a_handover_moves_the_binding_when_the_old_node_forgets_the_instance() -> None:
    m = _map()
    up = {"a": True, "d": True}
    m.update({}, _hosted(a=["keep.0"]), up)
    m.update({}, _hosted(a=["keep.0"], d=["keep.0"]), up)  # d's new incarnation is ready
    assert m.bound("keep.0") == "a" and m.pending("keep.0") == ("d",)  # d's envelopes wait
    m.update({}, _hosted(a=[], d=["keep.0"]), up)  # a forgot it (the reply said d has it)
    assert m.bound("keep.0") == "d" and m.pending("keep.0") == ()


def test_a_rehome_moves_the_binding_and_the_dead_node_coming_back_does_not_take_it_back() -> None:
    m = _map()
    m.update({}, _hosted(a=["work-0"]), {"a": True, "c": True})
    m.update({}, _hosted(a=["work-0"]), {"a": False, "c": True})  # a died: nobody else lists it
    assert m.bound("work-0") == "a"  # its draining workers' last envelopes still count
    m.update({}, _hosted(a=["work-0"], c=["work-0"]), {"a": False, "c": True})  # c re-homed it
    assert m.bound("work-0") == "c"
    # what a wrote before it died may still be queued (a re-homed receiver's inherited session)
    assert m.former_offline("work-0") == ["a"] and m.table("p")["former"] == {"work-0": ["a"]}
    m.update({}, _hosted(a=["work-0"], c=["work-0"]), {"a": True, "c": True})  # a back, record stale
    assert m.bound("work-0") == "c" and m.pending("work-0") == ("a",)
    assert m.former_offline("work-0") == []  # online again: its (fenced) workers count no more


def test_a_terminated_instance_keeps_its_binding_for_its_last_messages() -> None:
    m = _map()
    m.update({}, _hosted(a=["work-3"]), {"a": True})
    m.update({}, _hosted(a=[]), {"a": True})  # it terminated; its final acks may still be queued
    assert m.bound("work-3") == "a"


def test_a_namesake_of_another_deploy_starts_over_but_not_while_the_old_deploy_lists_it() -> None:
    """Copy ids repeat across deploys of a pipeline name. `testbed pipeline --rate 800` twice on
    one fleet: a validate copy ran here in the first deploy and on b in the second; its binding
    history made b's claim a move without a word (unproven), so the new copy's first epoch was
    held and refused ("not bound to node b within 20s") and the pipeline stalled."""
    up = {"me": True, "b": True, "c": True}
    m = _map()
    m.update({"validate-x": "p"}, {"me": [("validate-x", "p", "g1")]}, up)
    assert m.bound("validate-x") == "me"
    m.update({}, {"me": []}, up)  # undeployed
    # c still lists it under the old deploy (late, or hostile): nothing starts over
    m.update({}, {"b": [("validate-x", "p", "g2")], "c": [("validate-x", "p", "g1")]}, up)
    assert m.bound("validate-x") == "me"
    # every claimer lists it under the new deploy: a new instance, bound to its one claimer, proven
    m.update({}, {"b": [("validate-x", "p", "g2")]}, up)
    assert m.bound("validate-x") == "b" and m.proven("validate-x")
    # within one deploy the usual rules: another claimer does not take it
    m.update({}, {"b": [("validate-x", "p", "g2")], "c": [("validate-x", "p", "g2")]}, up)
    assert m.bound("validate-x") == "b" and m.pending("validate-x") == ("c",)


def test_among_several_new_claimers_only_one_a_statement_names_is_bound() -> None:
    """An agent with no binding yet (it just started) and several online claimers: a claim proves
    nothing (a node writes its own hosted and re-homed records: c's later re-homed entry once won
    the binding), so none is bound until another node's statement names one (or the re-homer's,
    which may name itself); their envelopes wait meanwhile. One claimer alone is bound."""
    m = _map()
    m.update({}, _hosted(b=["w"], c=["w"]), {"b": True, "c": True}, {"c": {"w": 5.0}, "b": {"w": 2.0}})
    assert m.bound("w") is None and m.pending("w") == ("b", "c")
    m.update({}, _hosted(b=["w"], c=["w"]), {"b": True, "c": True}, None, {"c": {"w": "c"}})
    assert m.bound("w") is None  # c vouching for itself: nothing (c is not the re-homer, b is)
    m.update({}, _hosted(b=["w"], c=["w"]), {"b": True, "c": True}, None, {"a": {"w": "c"}, "c": {"w": "c"}})
    assert m.bound("w") == "c" and m.pending("w") == ("b",)
    m2 = _map()
    m2.update({}, _hosted(c=["w"], b=["w"]), {"b": True, "c": True})
    assert m2.bound("w") is None  # no statement: no binding (no longer the smallest name)
    m2.update({}, _hosted(c=["w"]), {"b": True, "c": True})
    assert m2.bound("w") == "c"


def test_a_handover_goes_only_where_the_old_node_says_even_when_a_hostile_node_claims_it() -> None:
    """Issue #20 item 3: b (hostile, the smallest name) lists keep.0 all along. a hands it over to
    d: b gets the binding neither while d is not listed yet nor after; without a's statement and
    with two claimers it stays with a (b can delay a move, not take it)."""
    m = _map()
    up = {"a": True, "b": True, "d": True}
    m.update({}, _hosted(a=["keep.0"]), up)  # deployed on a; b lists it from then on
    m.update({}, _hosted(a=["keep.0"], b=["keep.0"]), up)
    assert m.bound("keep.0") == "a"
    m.update({}, _hosted(a=[], b=["keep.0"]), up, None, {"a": {"keep.0": "d"}})  # a forgot it, d not in yet
    assert m.bound("keep.0") == "a" and m.pending("keep.0") == ("b",)
    m.update({}, _hosted(a=[], b=["keep.0"], d=["keep.0"]), up, None, {"a": {"keep.0": "d"}, "b": {"keep.0": "b"}})
    assert m.bound("keep.0") == "d" and m.pending("keep.0") == ("b",)
    m.update({}, _hosted(a=[], b=["keep.0"], d=["keep.0"]), up, None, {"a": {"keep.0": "d"}})
    assert m.bound("keep.0") == "d"  # and sticky there
    # without a's word (an agent of before), two claimers: nobody takes it
    m2 = _map()
    m2.update({}, _hosted(a=["keep.0"]), up)
    m2.update({}, _hosted(a=["keep.0"], b=["keep.0"]), up)
    m2.update({}, _hosted(a=[], b=["keep.0"], d=["keep.0"]), up)
    assert m2.bound("keep.0") == "a"
    m2.update({}, _hosted(a=[], d=["keep.0"]), up)  # b gone: one claimer, as before
    assert m2.bound("keep.0") == "d"


def test_a_rehome_goes_where_the_rehomer_says_not_to_a_claimer_with_a_later_record() -> None:
    """a dies; c (the lowest-named online node: the re-homer) places work-0 on d; h lists it too
    and writes a re-homed record later than c's. The binding goes to d, as c says; a statement of
    h's, which is not the re-homer, counts for nothing. Without c's statement (not arrived yet)
    neither claimer gets it; once only d lists it, d does."""
    rehomed = {"c": {"work-0": 5.0}, "h": {"work-0": 9.0}}
    m = _map()
    m.update({}, _hosted(a=["work-0"]), {"a": True, "c": True, "d": True, "h": True})
    m.update({}, _hosted(a=["work-0"], d=["work-0"], h=["work-0"]), {"a": False, "c": True, "d": True, "h": True},
             rehomed, {"c": {"work-0": "d"}, "h": {"work-0": "h"}})
    assert m.bound("work-0") == "d" and m.pending("work-0") == ("a", "h")
    m2 = _map()
    m2.update({}, _hosted(a=["work-0"]), {"a": True, "c": True, "d": True, "h": True})
    m2.update({}, _hosted(a=["work-0"], d=["work-0"], h=["work-0"]), {"a": False, "c": True, "d": True, "h": True},
              rehomed, {"h": {"work-0": "h"}})
    assert m2.bound("work-0") == "a"
    m2.update({}, _hosted(a=["work-0"], d=["work-0"]), {"a": False, "c": True, "d": True, "h": True}, rehomed)
    assert m2.bound("work-0") == "d"


def test_the_table_is_bounded_and_forgets_unlisted_instances_first() -> None:
    m = HostMap("me", max_entries=10)
    m.update({}, _hosted(a=[f"old-{i}" for i in range(10)]), {"a": True})
    m.update({}, _hosted(a=[f"new-{i}" for i in range(5)]), {"a": True})
    bound = m.table("p")["bound"]
    assert len(bound) == 10 and all(f"new-{i}" in bound for i in range(5))


# Events on one instance "x" over three nodes: (node, listed?) or (node, online?).
NODES = ("a", "b", "c")
EVENTS = [("list", n, v) for n in NODES for v in (True, False)] + [("up", n, v) for n in NODES for v in (True, False)]


def _check_sequence(events: List[Tuple[str, str, bool]]) -> None:
    """Replays `events` and checks after each update:
    - the binding is a node that listed "x" at some point (nobody else can get it);
    - it moves only when its node stopped listing "x" or went offline while another online
      node lists it (sticky), and then to a node that lists it;
    - if its node stopped listing and exactly one node lists "x", it moves there;
    - the pending nodes are exactly the other nodes that list "x";
    - the former nodes whose writes count are offline nodes "x" was bound to before."""
    m = _map("me")
    listed: Set[str] = set()
    online = {n: True for n in NODES}
    ever: Set[str] = set()
    was_bound: Set[str] = set()
    for kind, node, v in events:
        before = m.bound("x")
        if kind == "list":
            (listed.add if v else listed.discard)(node)
        else:
            online[node] = v
        ever |= listed
        m.update({}, {n: [("x", "p")] if n in listed else [] for n in NODES}, dict(online))
        now = m.bound("x")
        if not ever:
            assert now is None
            continue
        assert now in ever, (events, now)
        if before is not None and now != before:
            assert now in listed, (events, before, now)
            assert before not in listed or (not online[before] and online[now]), (events, before, now)
        if before is not None and before in listed and online[before]:
            assert now == before, (events, before, now)
        if before is not None and before not in listed and len(listed) == 1:
            assert now in listed, (events, before, now)
        assert set(m.pending("x")) == listed - {now}, (events, now, m.pending("x"))
        if before is not None:
            was_bound.add(before)
        former = m.former_offline("x")
        assert now not in former and all(not online[n] and n in was_bound for n in former), (events, now, former)


def test_every_short_sequence_of_listing_and_status_events_keeps_the_binding_rules() -> None:
    count = 0
    for n in range(1, 5):
        for events in itertools.product(EVENTS, repeat=n):
            _check_sequence(list(events))
            count += 1
    assert count == 12 + 12 ** 2 + 12 ** 3 + 12 ** 4


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(EVENTS), min_size=5, max_size=40))
def test_random_long_sequences_keep_the_binding_rules(events: List[Tuple[str, str, bool]]) -> None:
    _check_sequence(events)


# ---- the worker, in process ----------------------------------------------------------------------


def _sink(tmp_path: Path, clock: List[float]):  # type: ignore[no-untyped-def]
    w, wire = _worker(tmp_path, "sink", clock, node="n2",
                      extra={"sink_dir": str(tmp_path / "sink"), "check_sender_node": True})
    return w, wire


def test_a_batch_written_by_a_node_that_does_not_host_its_sender_is_refused_and_replaces_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from agent.instance.admission import WRITER_HOLD_TTL
    from agent.operators.builtin import read_sink_ids

    clock = [100.0]
    w, wire = _sink(tmp_path, clock)
    w.feed(Control({"event": "hosts", "bound": {"work-0": "n1", "sink-0": "n2"}}), clock[0])
    real, forged_by = topics.inbox("c", "sink-0", "n1"), topics.inbox("c", "sink-0", "n3")
    fake = [("source-0", 1000 + i, r) for i, (_, _, r) in enumerate(_records(0, 4))]
    # n3 sends, in work-0's name, the batch numbers and record ids work-0 is about to send
    wire.events.append(Received(forged_by, encode_data("work-0", 0, 1, fake)))
    wire.events.append(Received(forged_by, encode_data("work-0", 2 ** 53, 1, fake)))
    _run(w, clock, 0.3)
    assert w.core.stats["records_in"] == 0 and w.core.inbound.senders() == 0  # waiting, apart, no trace
    assert w.core.admission.hold.count == 2 and ("work-0", "n3") in w.core.admission.hold
    real_records = [("source-0", 1000 + i, r) for i, (_, _, r) in enumerate(_records(0, 4))]
    wire.events.append(Received(real, encode_data("work-0", 0, 1, real_records)))
    _run(w, clock, 0.3)
    assert w.core.stats["records_in"] == 4 and w.core.stats["duplicate_envelopes"] == 0  # not behind them
    _run(w, clock, WRITER_HOLD_TTL + 1.0, step=0.5)
    assert w.core.stats["refused_nodes"] == 2 and w.core.admission.hold.count == 0 and w.core.stats["records_in"] == 4
    state = json.loads((tmp_path / "state" / "sink-0.state.json").read_text())
    assert state["inbound"] and json.dumps(state["inbound"]).count("work-0") == 1  # the real channel only
    assert w.core.inbound.position("work-0")[0] == 0  # epoch 2**53 never reached the channel
    w.feed(Abort("test"), clock[0])
    ids, dup = read_sink_ids(tmp_path / "sink")
    assert ids == {"source-0": {1000, 1001, 1002, 1003}} and dup == 0
    # and it acked the real batch, to work-0, on its own node's topic
    acks = [(t, e) for t, e in ((t, __import__("agent.dataplane.envelope", fromlist=["decode"]).decode(p))
                                for t, p in wire.sent) if e.kind is Kind.ACK]
    assert acks and all(t == topics.inbox("c", "work-0", "n2") for t, _ in acks), acks


def test_an_unknown_binding_holds_apart_from_other_nodes_streams_until_the_agent_says(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from agent.instance.admission import HOLD_TTL, WRITER_HOLD_TTL

    clock = [100.0]
    w, wire = _sink(tmp_path, clock)
    real, other = topics.inbox("c", "sink-0", "n1"), topics.inbox("c", "sink-0", "n3")
    # before any "hosts" line: the real batches and a forgery of another node wait, apart
    wire.events.append(Received(other, encode_data("work-0", 0, 1, _records(100, 4))))
    for seq in (1, 2):
        wire.events.append(Received(real, encode_data("work-0", 0, seq, _records(4 * (seq - 1), 4))))
    _run(w, clock, 0.3)
    assert w.core.admission.hold.count == 3 and w.core.stats["records_in"] == 0 and w.core.inbound.senders() == 0
    assert ("work-0", "n1") in w.core.admission.hold and ("work-0", "n3") in w.core.admission.hold
    w.feed(Control({"event": "hosts", "bound": {"work-0": "n1"}}), clock[0])
    _run(w, clock, 0.3)
    # the real ones, in their order; the forgery still waits apart (n3 might be bound next)
    assert w.core.stats["records_in"] == 8 and w.core.stats["held_released"] == 2
    assert w.core.admission.hold.count == 1 and ("work-0", "n3") in w.core.admission.hold
    wire.events.append(Received(real, encode_data("work-0", 0, 3, _records(8, 4))))  # not behind it
    _run(w, clock, 0.3)
    assert w.core.stats["records_in"] == 12
    _run(w, clock, WRITER_HOLD_TTL + 1.0, step=0.5)
    assert w.core.admission.hold.count == 0 and w.core.stats["refused_nodes"] == 1 and w.core.stats["records_in"] == 12
    # a move: work-0's next incarnation writes from n3 before n3's record reaches our agent
    wire.events.append(Received(other, encode_data("work-0", 1, 1, _records(12, 4))))
    _run(w, clock, 0.3)
    assert w.core.admission.hold.count == 1 and w.core.stats["records_in"] == 12
    w.feed(Control({"event": "hosts", "bound": {"work-0": "n3"}}), clock[0])
    _run(w, clock, 0.3)
    assert w.core.admission.hold.count == 0 and w.core.stats["records_in"] == 16 and w.core.stats["held_released"] == 3
    # and from now on n1, online, is the stranger
    wire.events.append(Received(real, encode_data("work-0", 1, 2, _records(16, 4))))
    _run(w, clock, WRITER_HOLD_TTL + 1.0, step=0.5)
    assert w.core.stats["records_in"] == 16 and w.core.stats["refused_nodes"] == 2
    # unless n1 is offline: what it wrote while it hosted work-0 counts (here, it is stale)
    w.feed(Control({"event": "hosts", "bound": {"work-0": "n3"}, "former": {"work-0": ["n1"]}}), clock[0])
    wire.events.append(Received(real, encode_data("work-0", 0, 4, _records(20, 4))))
    _run(w, clock, 0.3)
    assert w.core.admission.hold.count == 0 and w.core.stats["refused_nodes"] == 2 and w.core.stats["duplicate_envelopes"] == 1
    assert HOLD_TTL > WRITER_HOLD_TTL


def test_a_worker_writes_in_its_own_nodes_name_and_subscribes_to_every_writer() -> None:
    import paho.mqtt.client as mqtt

    assert topics.inbox("c", "work-0", "n1") == "fog/c/inbox/work-0/n1"
    assert mqtt.topic_matches_sub(topics.inbox_all("c", "work-0"), topics.inbox("c", "work-0", "n1"))
    assert topics.parse("c", "fog/c/inbox/work-0") is None  # the old layout is no inbox any more


# ---- the attack, against the role's broker with real agents --------------------------------------

CLUSTER = "snd"


def T(rest: str) -> str:
    return f"fog/{CLUSTER}/{rest}"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    from tls_site import have_tools, running_site

    if not have_tools():
        pytest.skip("openssl or mosquitto missing")
    with running_site(tmp_path_factory.mktemp("snd"), CLUSTER, ("n1", "n2"), ["admin"]) as s:
        yield s


def _fogctl(site, *argv: str) -> Tuple[int, str]:  # type: ignore[no-untyped-def]
    import contextlib
    import io

    from agent.cli.fogctl import main as fogctl_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = fogctl_main(["--broker", f"127.0.0.1:{site.port}", "--cluster", CLUSTER, "--timeout", "10",
                            "--cafile", str(site.certs / "fog-ca.crt"), "--cert", str(site.certs / "admin.crt"),
                            "--key", str(site.certs / "admin.key"), *argv])
    return code, out.getvalue() + err.getvalue()


def _instances(watch) -> Dict[str, Tuple[str, Dict]]:  # type: ignore[no-untyped-def]
    """{instance: (node, stats)} from the retained state records `watch` received."""
    out: Dict[str, Tuple[str, Dict]] = {}
    for t, p in watch.topics().items():
        if t.endswith("/state") and p:
            doc = json.loads(p)
            for i in doc.get("instances", []):
                out[str(i.get("id"))] = (str(doc.get("node")), i.get("stats") or {})
    return out


def _pause_and_settle(watch, src: str, mid: str, sink: str, tag: bytes,  # type: ignore[no-untyped-def]
                      moved: bool = False) -> None:
    """Pause the source (rpc as the admin) and wait until every generated record went through
    (`moved`: the counters restarted with the new incarnations, so until the sink has recorded
    nothing new for 3 s; the record ids are the verdict)."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    from tls_site import OK_CODES, wait_until

    props = Properties(PacketTypes.PUBLISH)
    props.CorrelationData = tag
    assert watch.subscribe(T("replies/admin/+")) == [1]
    body = {"v": 1, "op": "set", "instance": src, "fields": {"paused": True}}
    assert watch.publish(T(f"agents/{_instances(watch)[src][0]}/rpc/admin"), json.dumps(body).encode(),
                         properties=props) in OK_CODES
    assert watch.wait_for(lambda m: any(getattr(pr, "CorrelationData", None) == tag for _, _, _, pr in m), 10)

    def settled() -> bool:
        i = _instances(watch)
        gen = int(i[src][1].get("generated", -1))
        return gen > 0 and int(i[mid][1].get("records_in", -2)) == gen and \
            int(i[sink][1].get("records_in", -1)) == int(i[mid][1].get("records_out", -2))

    if moved:
        last = [-1, time.monotonic()]

        def settled() -> bool:  # noqa: F811
            n = int(_instances(watch)[sink][1].get("records_in", 0))
            if n != last[0]:
                last[:] = [n, time.monotonic()]
            return time.monotonic() - last[1] >= 3.0

    assert wait_until(settled, 30), _instances(watch)
    time.sleep(1.0)


@pytest.mark.broker
def test_a_node_cannot_write_data_in_the_name_of_another_nodes_instance(site) -> None:  # type: ignore[no-untyped-def]
    """Two agents (n1, n2) run source -> in_zone -> sink. Node B (the one that does not host
    in_zone's keeper) forges, with its own certificate, the batches in_zone would send next to the
    sink (its numbers, the source's next record ids): on A's topic the broker refuses them (PUBACK
    135); on its own topic the sink refuses them (`refused_nodes`). Then the source pauses and
    every record it generated reaches the sink exactly once, none of the forged ones. ~45 s: the
    forgeries wait WRITER_HOLD_TTL (20 s) for a binding before they are refused."""
    from agent.operators.builtin import in_zone, read_sink_ids
    from agent.operators.taxi import TaxiGenerator
    from pipelines import taxi_in_zone
    from tls_site import NOT_AUTHORIZED, OK_CODES, AgentProc, Client, wait_until

    agents = {n: AgentProc(site, n) for n in ("n1", "n2")}
    watch = Client(site, "admin")
    forger: Optional[Client] = None
    try:
        assert watch.connect() == "connected" and watch.subscribe(T("agents/+/state")) == [1]

        def instances() -> Dict[str, Tuple[str, Dict]]:
            return _instances(watch)

        pipe = site.tmp / "snd.toml"
        pipe.write_text(taxi_in_zone("taxi", seed=1, rate=100.0))
        assert wait_until(lambda: len([t for t in watch.topics() if t.endswith("/state")]) == 2, 30)
        code, out = _fogctl(site, "deploy", str(pipe), "--keeper-timeout", "20")
        assert code == 0, out
        sink, mid, src = "taxi.sink.0", "taxi.in_zone.0", "taxi.source.0"
        assert wait_until(lambda: instances().get(sink, ("", {}))[1].get("records_in", 0) > 0, 30), instances()
        a = instances()[mid][0]
        b = "n2" if a == "n1" else "n1"
        at = instances()[sink][0]  # the sink's node: its inbox is inbox/<at>/<sink>/<writer>
        forger = Client(site, b)
        assert forger.connect() == "connected"
        generated = int(instances()[src][1].get("generated", 0))
        fake = [(src, generated + 50 + i, {"forged": True}) for i in range(100)]
        on_a = [forger.publish(topics.inbox_at(CLUSTER, at, sink, a), encode_data(mid, e, s, fake))
                for e in range(3) for s in range(1, 40, 8)]
        assert set(on_a) == {NOT_AUTHORIZED}, on_a  # the broker: b may not write in a's name
        on_b = [forger.publish(topics.inbox_at(CLUSTER, at, sink, b), encode_data(mid, e, s, fake))
                for e in range(3) for s in range(1, 40, 8)]
        on_b.append(forger.publish(topics.inbox_at(CLUSTER, at, sink, b),
                                   encode(Envelope(mid, 0, 1, Kind.ACK, [0, 10 ** 6]))))
        assert set(on_b) <= set(OK_CODES), on_b
        # all of them wait, apart from in_zone's real stream, for a binding to b that never
        # comes, and are refused when WRITER_HOLD_TTL is up
        assert wait_until(lambda: instances()[sink][1].get("held", 0) == len(on_b), 10), \
            str({k: v for k, v in instances()[sink][1].items() if "refused" in k or "held" in k})
        assert wait_until(lambda: instances()[sink][1].get("refused_nodes", 0) == len(on_b), 40), \
            (str({k: v for k, v in instances()[sink][1].items() if "refused" in k or "held" in k}),
             agents[instances()[sink][0]].text()[-3000:])
        # 0 records lost: pause the source, let everything drain, compare ids
        _pause_and_settle(watch, src, mid, sink, b"pause-1")
        generated = int(instances()[src][1]["generated"])
        gen = TaxiGenerator(1, src)
        want = {k for k in range(generated) if in_zone(gen.record(), {}) is not None}
        ids, dup = read_sink_ids(site.tmp / f"state-{instances()[sink][0]}")
        assert dup == 0 and ids.get(src, set()) == want, (len(want), len(ids.get(src, set())), sorted(ids.get(src, set()) - want)[:5])
        assert instances()[sink][1].get("held", 0) == 0
        for n, ag in agents.items():
            assert ag.alive() and "Traceback" not in ag.text(), ag.text()[-2000:]
        assert f"(written by {b}): not bound to node {b}" in agents[instances()[sink][0]].text()  # logged
    finally:
        watch.close()
        if forger is not None:
            forger.close()
        for ag in agents.values():
            ag.stop()


# ---- per-node inboxes: only the receiver's node reads (docs/security.md, "Who may read an inbox") --


def test_per_node_inbox_topics_name_the_receiving_node_and_only_it() -> None:
    import paho.mqtt.client as mqtt

    t = topics.inbox_at("c", "n2", "work-0", "n1")
    assert t == "fog/c/inbox/n2/work-0/n1"
    assert mqtt.topic_matches_sub(topics.inbox_all_at("c", "n2", "work-0"), t)
    assert not mqtt.topic_matches_sub(topics.inbox_all_at("c", "n3", "work-0"), t)  # another node's
    assert not mqtt.topic_matches_sub(topics.inbox_all_at("c", "n2", "work-1"), t)
    assert topics.inbox_writer(topics.inbox_all_at("c", "n2", "work-0"), t) == "n1"
    assert topics.inbox_writer(topics.inbox_all_at("c", "n3", "work-0"), t) is None
    assert topics.parse("c", t) == ("inbox", "work-0", "n1")
    # the role's per-node lines: n1 writes inbox/+/+/n1, reads inbox/n1/+/+
    assert mqtt.topic_matches_sub("fog/c/inbox/+/+/n1", t) and not mqtt.topic_matches_sub("fog/c/inbox/n1/+/+", t)


def test_a_per_node_worker_sends_to_the_bound_node_parks_what_is_unbound_and_follows_a_move(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """work-0 on n1, per-node inboxes: what it sends goes to the node its table binds the receiver
    to; before the table names the receiver, its batch waits in order (and nothing it carries is
    acked upstream); when sink-0 moves to n3, the new incarnation's replay request (written by n3)
    waits for the binding, then every unacked batch goes again to n3's topic, none to n2."""
    from agent.dataplane.envelope import decode

    clock = [100.0]
    w, wire = _worker(tmp_path, "work", clock, node="n1",
                      extra={"sink_dir": str(tmp_path / "sink"), "check_sender_node": True, "inbox_per_node": True})
    assert w.core.inbox == "fog/c/inbox/n1/work-0/+"
    mine = lambda writer: topics.inbox_at("c", "n1", "work-0", writer)  # noqa: E731

    def sent(kind: Kind) -> List[Tuple[str, Envelope]]:
        return [(t, e) for t, e in ((t, decode(p)) for t, p in wire.sent) if e.kind is kind]

    w.feed(Control({"event": "hosts", "bound": {"source-0": "n1", "work-0": "n1"}}), clock[0])
    wire.events.append(Received(mine("n1"), encode_data("source-0", 0, 1, _records(0, 4))))
    _run(w, clock, 0.5)
    assert w.core.stats["records_in"] == 4 and not wire.sent  # sink-0 unbound: parked, nothing acked upstream
    assert [len(q) for q in w.core.outputs.unrouted.values()] == [1] and not w.core.drained()
    w.feed(Control({"event": "hosts", "bound": {"source-0": "n1", "work-0": "n1", "sink-0": "n2"}}), clock[0])
    _run(w, clock, 0.3)
    data = sent(Kind.DATA)
    assert [t for t, _ in data] == [topics.inbox_at("c", "n2", "sink-0", "n1")] and not w.core.outputs.unrouted
    # sink-0 (n2) acks it: work-0 acks the source, on the source's node's topic
    wire.events.append(Received(mine("n2"), encode(Envelope("sink-0", 0, 1, Kind.ACK, [0, 1]))))
    _run(w, clock, 0.5)
    assert sent(Kind.ACK) and {t for t, _ in sent(Kind.ACK)} == {topics.inbox_at("c", "n1", "source-0", "n1")}
    # a batch sent while sink-0 moves: to n2 (in a real broker dropped at delivery: n3 may not read it)
    wire.events.append(Received(mine("n1"), encode_data("source-0", 0, 2, _records(4, 4))))
    _run(w, clock, 0.3)
    assert sent(Kind.DATA)[-1][0] == topics.inbox_at("c", "n2", "sink-0", "n1")
    # sink-0's new incarnation on n3 asks for a replay before our table knows it moved: held
    before = len(wire.sent)
    wire.events.append(Received(mine("n3"), encode(Envelope("sink-0", 5, 1, Kind.ACK, [0, 0]))))
    _run(w, clock, 0.3)
    assert len(wire.sent) == before and w.core.admission.hold.count == 1
    # the binding follows the hosted records (n2 offline, n3 lists it): the replay goes to n3 at once
    w.feed(Control({"event": "hosts", "bound": {"source-0": "n1", "work-0": "n1", "sink-0": "n3"},
                    "former": {"sink-0": ["n2"]}}), clock[0])
    _run(w, clock, 0.3)
    replayed = sent(Kind.DATA)[2:]
    # the replay marker (an empty batch: what follows is our replay), then the replay, both to n3
    assert [t for t, _ in replayed] == [topics.inbox_at("c", "n3", "sink-0", "n1")] * 2, replayed
    assert replayed[0][1].body == []
    assert [r[1] for r in replayed[1][1].body] == [4, 5, 6, 7]  # the unacked batch, its records once
    assert w.core.stats["held_released"] == 1
    # an envelope on our inbox at another node (a subscription an earlier incarnation's session
    # kept) is dropped, never taken for data
    wire.events.append(Received(topics.inbox_at("c", "n9", "work-0", "n1"), encode_data("source-0", 0, 3, _records(8, 4))))
    _run(w, clock, 0.3)
    assert w.core.stats["foreign_inbox"] == 1 and w.core.stats["records_in"] == 8
    w.feed(Abort("test"), clock[0])


def test_a_per_node_worker_resends_at_once_what_went_to_a_moved_receivers_old_node(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue #20's drain stall: sink-0 moves from n2 to n3 (a drain's hand-over) and takes a
    while to start. Nothing acks work-0's batch meanwhile, so work-0's silent-link replays go to
    n2's topic, where the broker drops them, and its wait doubles each time (5, then 10 s). When the
    binding names n3, the unacked batch goes to n3 at once under its own number, not after the
    next wait of 20 s; and the backoff starts over (a resend lost again is retried after 5 s)."""
    from agent.dataplane.envelope import decode
    from agent.instance.outputs import LINK_SILENCE

    clock = [100.0]
    w, wire = _worker(tmp_path, "work", clock, node="n1",
                      extra={"sink_dir": str(tmp_path / "sink"), "check_sender_node": True, "inbox_per_node": True})
    mine = topics.inbox_at("c", "n1", "work-0", "n1")
    at = {n: topics.inbox_at("c", n, "sink-0", "n1") for n in ("n2", "n3")}

    def data_to(node: str) -> List[int]:
        return [e.seq for t, e in ((t, decode(p)) for t, p in wire.sent) if e.kind is Kind.DATA and t == at[node]]

    bound = {"source-0": "n1", "work-0": "n1", "sink-0": "n2"}
    w.feed(Control({"event": "hosts", "bound": bound}), clock[0])
    wire.events.append(Received(mine, encode_data("source-0", 0, 1, _records(0, 4))))
    _run(w, clock, 0.5)
    assert data_to("n2") == [1]
    _run(w, clock, 3 * LINK_SILENCE + 1.5)  # replays after 5 s and 10 s more, both to n2 (dropped there)
    assert data_to("n2") == [1, 1, 1] and not data_to("n3")
    w.feed(Control({"event": "hosts", "bound": {**bound, "sink-0": "n3"}, "former": {"sink-0": ["n2"]}}), clock[0])
    _run(w, clock, 0.5)
    assert data_to("n3") == [1], "the batch sent to the old node is not sent to the new one at once"
    assert data_to("n2") == [1, 1, 1]
    _run(w, clock, LINK_SILENCE + 1.5)  # lost again: retried after LINK_SILENCE, not after 20 s
    assert data_to("n3") == [1, 1]
    # acked by the moved receiver: nothing more is sent
    wire.events.append(Received(topics.inbox_at("c", "n1", "work-0", "n3"),
                                encode(Envelope("sink-0", 0, 1, Kind.ACK, [0, 1]))))
    _run(w, clock, 3 * LINK_SILENCE)
    assert data_to("n3") == [1, 1] and w.core.outputs.links["sink-0"].inflight == 0
    w.feed(Abort("test"), clock[0])


@pytest.mark.broker
def test_a_node_reads_only_its_own_instances_inboxes_and_a_drain_moves_them_exactly_once(site) -> None:  # type: ignore[no-untyped-def]
    """Per-node inboxes on the role's TLS broker with real agents: n1 alone at deploy time hosts
    the three keepers; n2 joins; each node's certificate subscribes to every inbox (`inbox/#`,
    `inbox/+/+/+`). n2 receives nothing while n1 hosts everything (Mosquitto grants the SUBACK and
    checks read access per message), n1 reads its own instances' traffic (the positive control).
    `fogctl drain n1` moves every keeper to n2, with the same identity and session: after the move
    each node still reads only `inbox/<itself>/...`, records keep flowing through the moved
    instances, and every generated record reaches the sinks exactly once. ~40 s."""
    from agent.operators.builtin import in_zone, read_sink_ids
    from agent.operators.taxi import TaxiGenerator
    from pipelines import taxi_in_zone
    from tls_site import AgentProc, Client, agent_toml, wait_until

    def agent(node: str) -> AgentProc:  # state dirs of its own: nothing of the module's other test to re-adopt
        conf = agent_toml(site, node, node)
        conf.write_text(conf.read_text().replace(f"/state-{node}\"", f"/state-rd-{node}\""))
        return AgentProc(site, node, conf=conf)

    agents = {"n1": agent("n1")}
    watch = Client(site, "admin")
    spies = {n: Client(site, n) for n in ("n1", "n2")}
    try:
        assert watch.connect() == "connected" and watch.subscribe(T("agents/+/state")) == [1]
        assert watch.subscribe(T("agents/+/status")) == [1]
        # online now (the module's other test left its agents' retained records behind)
        online = lambda n: watch.topics().get(T(f"agents/{n}/status")) == b"online"  # noqa: E731
        for spy in spies.values():
            assert spy.connect() == "connected"
            assert spy.subscribe(T("inbox/#")) == [1] and spy.subscribe(T("inbox/+/+/+")) == [1]
        pipe = site.tmp / "rd.toml"
        pipe.write_text(taxi_in_zone("rd", seed=2, rate=100.0))
        assert wait_until(lambda: online("n1"), ONLINE_BOUND)
        code, out = _fogctl(site, "deploy", str(pipe), "--keeper-timeout", "20")
        assert code == 0, out
        src, mid, sink = "rd.source.0", "rd.in_zone.0", "rd.sink.0"
        assert wait_until(lambda: _instances(watch).get(sink, ("", {}))[1].get("records_in", 0) > 0, 30)
        agents["n2"] = agent("n2")
        assert wait_until(lambda: online("n2"), ONLINE_BOUND)

        def inbox_topics(n: str) -> List[str]:
            return [t for t, _, _, _ in list(spies[n].received) if "/inbox/" in t]

        assert wait_until(lambda: len(inbox_topics("n1")) > 20, 10)
        assert inbox_topics("n2") == [], inbox_topics("n2")[:5]  # n1's records: not for n2
        assert all(t.startswith(T("inbox/n1/")) for t in inbox_topics("n1"))
        code, out = _fogctl(site, "drain", "n1")
        assert code == 0, out
        moved = lambda: all(_instances(watch).get(k, ("",))[0] == "n2" for k in (src, mid, sink))  # noqa: E731
        assert wait_until(moved, 40), _instances(watch)
        # n1 says where each keeper went, in the state record only n1 may write: the receivers'
        # bindings follow that statement, not whichever node lists the keeper (agent.node.hostmap)
        stated = lambda: json.loads(watch.topics().get(T("agents/n1/state")) or b"{}").get("moved")  # noqa: E731
        assert wait_until(lambda: stated() == {k: "n2" for k in (src, mid, sink)}, 30), (
            stated(), [ln for ln in agents["n1"].text().splitlines() if "hand" in ln or "drain" in ln])
        before = int(_instances(watch)[sink][1].get("records_in", 0))
        assert wait_until(lambda: int(_instances(watch)[sink][1].get("records_in", 0)) > before + 20, 30)
        seen1 = len(inbox_topics("n1"))
        assert wait_until(lambda: len(inbox_topics("n2")) > 20, 10)
        assert all(t.startswith(T("inbox/n2/")) for t in inbox_topics("n2")), set(inbox_topics("n2"))
        assert all(t.startswith(T("inbox/n1/")) for t in inbox_topics("n1")), set(inbox_topics("n1"))
        _pause_and_settle(watch, src, mid, sink, b"pause-rd", moved=True)
        assert len(inbox_topics("n1")) == seen1  # n1 hosts nothing any more: it reads nothing more
        generated = int(_instances(watch)[src][1]["generated"])
        gen = TaxiGenerator(2, src)
        want = {k for k in range(generated) if in_zone(gen.record(), {}) is not None}
        got: List[int] = []
        for n in ("n1", "n2"):  # the sink wrote its ids where it ran: before and after the move
            ids, dup = read_sink_ids(site.tmp / f"state-rd-{n}")
            assert dup == 0, n
            got += sorted(ids.get(src, set()))
        assert len(got) == len(set(got)) and set(got) == want, (len(want), len(got), sorted(set(got) ^ want)[:5])
        for ag in agents.values():
            assert ag.alive() and "Traceback" not in ag.text(), ag.text()[-2000:]
    finally:
        for c in (watch, *spies.values()):
            c.close()
        for ag in agents.values():
            ag.stop()
