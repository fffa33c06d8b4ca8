"""The site manager's election from the nodes' own claims (agent.node.site_manager.leader,
LeaseBoard; docs/site-manager.md, "Election"). Sans-IO: claims and statuses in, leader out.

Each node writes its claim on `agents/<node>/site_manager`, which the role's ACL lets only that
node write (tests/test_security_tls_acl.py holds the broker to it); here n3 is a node with a
stolen key, writing what it likes on its own topic."""

from __future__ import annotations

import json
import time
from typing import Dict, Optional

from agent import topics
from agent.node.site_manager import Lease, LeaseBoard, claim_problem, lease_bound, leader, valid_claims

NOW = 1_795_000_000.0
AHEAD = lease_bound(15.0, 5.0)  # 60 s
UP = {"n1": True, "n2": True, "n3": True}


def rec(node: str, until: float, **state: object) -> bytes:
    return json.dumps(Lease(node, until, dict(state)).to_dict()).encode()


def test_the_claim_topic_is_the_nodes_own() -> None:
    assert topics.site_manager("c", "n1") == "fog/c/agents/n1/site_manager"
    assert topics.parse("c", topics.site_manager("c", "n1")) == topics.Parsed("site_manager", "n1")
    assert topics.parse("c", "fog/c/site_manager") is None  # the shared record of before is no topic of ours
    assert topics.parse("c", topics.site_manager_of("c", "north", "n1")) == topics.Parsed("site_manager", "n1", "north")


def test_a_claim_naming_another_node_is_refused_and_never_leads() -> None:
    """n3 writes, on its own topic, a lease in n1's name: refused at receipt, and the pure
    function ignores it too (a record counts only on its holder's own topic)."""
    forged = Lease("n1", NOW + 15.0)
    assert "names node 'n1'" in str(claim_problem("n3", forged, NOW, AHEAD))
    assert leader({"n3": forged}, UP, NOW, AHEAD) is None
    board = LeaseBoard("n2", AHEAD)
    assert "names node 'n1'" in str(board.on_record("n3", rec("n1", NOW + 15.0), NOW))
    assert board.current(UP, NOW) is None and board.claims == {}


def test_a_claim_far_ahead_is_refused_and_never_leads() -> None:
    """{node: n3, until: now + 1e9} on n3's own topic: refused, as is anything past the bound."""
    far = Lease("n3", NOW + 1e9)
    assert "ahead" in str(claim_problem("n3", far, NOW, AHEAD))
    assert leader({"n3": far}, UP, NOW, AHEAD) is None
    assert leader({"n3": Lease("n3", NOW + AHEAD + 1.0)}, UP, NOW, AHEAD) is None
    assert leader({"n3": Lease("n3", NOW + AHEAD)}, UP, NOW, AHEAD) == Lease("n3", NOW + AHEAD)
    board = LeaseBoard("n2", AHEAD)
    board.on_record("n3", rec("n3", NOW + 15.0), NOW)
    assert "ahead" in str(board.on_record("n3", rec("n3", NOW + 1e9), NOW))
    assert board.current(UP, NOW) is None  # its earlier, plausible claim was replaced: none stands


def test_the_lease_of_an_offline_holder_is_void() -> None:
    """A revoked certificate cannot connect again; its Will (or a clean stop) says offline: its
    lease is void at once, and a reader that has no status for it yet does not count it."""
    lease = Lease("n1", NOW + 15.0)
    assert leader({"n1": lease}, UP, NOW, AHEAD) == lease
    assert leader({"n1": lease}, dict(UP, n1=False), NOW, AHEAD) is None
    assert leader({"n1": lease}, {}, NOW, AHEAD) is None
    # the next candidate's claim is then the lease, even while the old one "runs"
    claims = {"n1": lease, "n2": Lease("n2", NOW + 15.0)}
    assert leader(claims, dict(UP, n1=False), NOW, AHEAD, held="n1") == claims["n2"]


def test_the_leader_held_stays_and_a_claim_beside_it_takes_nothing() -> None:
    """n2 leads; n3 writes its own plausible claim beside it: a reader that follows n2 keeps n2
    (no node takes a running lease); a fresh reader sees two claims and follows none until one
    remains; n2's lease running out (or n2 clearing its record) leaves n3's."""
    n2, n3 = Lease("n2", NOW + 15.0), Lease("n3", NOW + 15.0)
    claims: Dict[str, Optional[Lease]] = {"n2": n2, "n3": n3}
    assert leader(claims, UP, NOW, AHEAD, held="n2") == n2
    assert leader(claims, UP, NOW, AHEAD, held=None) is None
    assert leader(claims, UP, NOW + 15.0, AHEAD, held="n2") is None  # both ran out
    assert leader({"n2": Lease("n2", NOW + 5.0), "n3": n3}, UP, NOW + 6.0, AHEAD, held="n2") == n3
    assert set(valid_claims(claims, UP, NOW, AHEAD)) == {"n2", "n3"}
    board = LeaseBoard("n1", AHEAD)
    board.on_record("n2", rec("n2", NOW + 15.0), NOW)
    assert board.current(UP, NOW) == n2
    board.on_record("n3", rec("n3", NOW + 15.0), NOW)
    assert board.current(UP, NOW + 1.0) == n2
    board.on_record("n2", b"", NOW + 2.0)  # only n2 can clear n2's record: it let go
    assert board.current(UP, NOW + 2.0) == n3


def said(node: str, follows: Optional[str]) -> bytes:
    """The statement a node that does not lead writes on its own claim topic: whom it follows."""
    return json.dumps({"v": 1, "node": node, "until": 0, "follows": follows}).encode()


def test_a_fresh_reader_follows_the_claim_most_other_nodes_follow() -> None:
    """n2 leads and n4 follows it; n3 (a stolen key) claims beside n2. n1 has just started: it
    followed none of two running claims (and refused n2's drains) until n3 stopped. Each other
    node's own record is one vote (a claim: for itself; a statement: whom it follows): n2 has
    two of three, n1 follows n2. n3 alone never has a majority: its lie about whom it follows
    is no vote beside its own claim (one record), and in three nodes (n1, n2, n3) the votes tie:
    none leads for n1 until n3 stops."""
    up = dict(UP, n4=True)
    n2, n3 = Lease("n2", NOW + 15.0), Lease("n3", NOW + 15.0)
    claims: Dict[str, Optional[Lease]] = {"n2": n2, "n3": n3}
    assert leader(claims, up, NOW, AHEAD, follows={"n4": "n2"}, me="n1") == n2
    assert leader(claims, up, NOW, AHEAD, follows={"n4": None}, me="n1") is None
    assert leader(claims, UP, NOW, AHEAD, follows={"n1": None}, me="n1") is None  # three nodes
    assert leader(claims, up, NOW, AHEAD, follows={"n4": "n3"}, me="n1") == n3  # an honest node's vote
    assert leader(claims, dict(up, n4=False), NOW, AHEAD, follows={"n4": "n2"}, me="n1") is None  # offline: no vote
    assert leader(claims, up, NOW, AHEAD, follows={"n1": "n3", "n4": "n2"}, me="n1") == n2  # the reader's own: none
    board = LeaseBoard("n1", AHEAD)
    board.on_record("n2", rec("n2", NOW + 15.0), NOW)
    board.on_record("n3", rec("n3", NOW + 15.0), NOW)
    assert board.on_record("n3", said("n3", "n3"), NOW) is None  # n3 states instead: its claim is gone
    board.on_record("n3", rec("n3", NOW + 15.0), NOW)
    assert board.current(up, NOW) is None
    assert board.on_record("n4", said("n4", "n2"), NOW) is None
    assert board.current(up, NOW) == n2 and board.held == "n2"
    assert "names node" in str(board.on_record("n4", said("n2", "n3"), NOW))  # in another's name: refused
    assert board.current(up, NOW) == n2  # followed now: held while its claim runs


def test_a_reader_states_whom_it_follows_when_that_changes_and_a_leader_never() -> None:
    board = LeaseBoard("n1", AHEAD)
    assert json.loads(board.statement(UP, NOW) or b"") == {"v": 1, "node": "n1", "until": 0, "follows": None}
    assert board.statement(UP, NOW) is None
    board.on_record("n2", rec("n2", NOW + 15.0), NOW)
    assert json.loads(board.statement(UP, NOW) or b"")["follows"] == "n2"
    board.on_record("n1", said("n1", "n2"), NOW)  # the echo
    assert board.statement(UP, NOW) is None and board.claims.keys() == {"n2"}
    board.lead(Lease("n1", NOW + 15.0))
    assert board.statement(UP, NOW) is None  # its claim says it
    board.withdraw()  # its record is cleared: it states again
    assert json.loads(board.statement(UP, NOW) or b"")["follows"] == "n2"
    board.restate()  # a new connection
    assert json.loads(board.statement(UP, NOW) or b"")["follows"] == "n2"
    from agent.node.site_manager import lease_of
    assert lease_of(said("n4", "n2")) is None  # a statement is no claim


def test_malformed_records_are_refused_and_counted_never_raise() -> None:
    board = LeaseBoard("n1", AHEAD)
    for bad in (b"{", b"[]", b'{"node": "n3"}', b'{"node": "n3", "until": NaN}', b"\xff\xfe",
                b"[" * 100_000, b'{"node": "n3", "until": 1, "x": "' + b"a" * 20_000 + b'"}',
                b'{"node": "n3", "follows": 7}', b'{"node": 3, "follows": "n2"}', b'{"node": "n3", "follows": ""}'):
        assert board.on_record("n3", bad, NOW) == "malformed record"
    assert board.on_record("n3", b"", NOW) is None  # cleared: no claim, nothing to refuse
    small = LeaseBoard("n1", AHEAD, max_claims=2)
    assert small.on_record("a", rec("a", NOW + 5), NOW) is None and small.on_record("b", rec("b", NOW + 5), NOW) is None
    assert "claimers" in str(small.on_record("c", rec("c", NOW + 5), NOW)) and set(small.claims) == {"a", "b"}


def test_a_candidate_knows_its_own_lease_before_the_broker_echoes_it() -> None:
    board = LeaseBoard("n2", AHEAD)
    own = Lease("n2", NOW + 15.0)
    board.lead(own)
    board.on_record("n3", rec("n3", NOW + 15.0), NOW)  # arrives before n2's own record comes back
    assert board.current({}, NOW) == own
    board.withdraw()
    assert board.current(UP, NOW) == Lease("n3", NOW + 15.0)


def test_leader_cost_per_message() -> None:
    """Not an assertion on time: the figure for docs/site-manager.md (`pytest -s`)."""
    for n in (10, 100):
        board = LeaseBoard("n0", AHEAD)
        for i in range(n):
            board.on_record(f"n{i}", rec(f"n{i}", NOW + 15.0) if i == 1 else b"", NOW)
        for i in range(2, n):  # the others' claims: expired records of former leaders
            board.on_record(f"n{i}", rec(f"n{i}", NOW - 100.0), NOW)
        up = {f"n{i}": True for i in range(n)}
        reps = 2000
        t0 = time.perf_counter()
        for _ in range(reps):
            board.current(up, NOW)
        per = (time.perf_counter() - t0) / reps
        t0 = time.perf_counter()
        payload = rec("n1", NOW + 15.0, released=[], actions=[])
        for _ in range(reps):
            board.on_record("n1", payload, NOW)
        rx = (time.perf_counter() - t0) / reps
        assert board.current(up, NOW) == Lease("n1", NOW + 15.0, {"released": [], "actions": []})
        print(f"site lease: {n} claimers: leader {per * 1e6:.1f} us per check, {rx * 1e6:.1f} us per record received")


def test_fogctl_site_shows_the_leader_the_agents_derive() -> None:
    """`fogctl site` reads every node's claim and status and shows what an agent that just
    started follows: the leader's own record; a record in another node's name is no claim; a
    holder gone offline, or two running claims, lead nobody."""
    from agent.fogctl.commands import site_record, site_view
    from recording_client import message

    def snap(*items: tuple) -> Dict[str, object]:
        return {t: message(t, p, True) for t, p in items}

    def status(n: str, s: bytes) -> tuple:
        return (topics.agent_status("c", n), s)

    def claim(writer: str, node: str, until: float) -> tuple:
        return (topics.site_manager("c", writer), rec(node, until, target=0.3))

    up = [status("n1", b"online"), status("n2", b"online"), status("n3", b"online")]
    assert site_record(snap(*up), "c", NOW) is None
    doc, text = site_view(site_record(snap(*up, claim("n1", "n1", NOW + 10)), "c", NOW), NOW)
    assert doc["leader"] == "n1" and not doc["expired"] and doc["target"] == 0.3, doc
    assert site_record(snap(*up, claim("n3", "n1", NOW + 10)), "c", NOW) is None  # forged: no claim
    assert site_record(snap(*up, claim("n3", "n3", NOW + 1e9)), "c", NOW) is None  # far ahead: no claim
    doc, text = site_view(site_record(snap(*up, claim("n1", "n1", NOW + 10), claim("n3", "n3", NOW + 12)),
                                      "c", NOW), NOW)
    assert doc["leader"] is None and doc["expired"] and "claims of n1, n3" in text, text
    doc, text = site_view(site_record(snap(*up[1:], status("n1", b"offline"), claim("n1", "n1", NOW + 10)),
                                      "c", NOW), NOW)
    assert doc["leader"] is None and doc["last_leader"] == "n1" and "offline" in text, text
    doc, _ = site_view(site_record(snap(*up, claim("n1", "n1", NOW - 1)), "c", NOW), NOW)
    assert doc["leader"] == "n1" and doc["expired"], doc
    bad = snap(*up, (topics.site_manager("c", "n1"), b"{not json"), ("fog/c/agents/n2/site_manager", b"\xff"))
    assert site_record(bad, "c", NOW) is None


def test_fogctl_site_counts_whom_the_nodes_follow() -> None:
    """Two running claims, n2's and n3's, and n4 says it follows n2: `fogctl site` shows n2 as the
    leader, as an agent that just started derives it; a statement alone is no claim."""
    from agent.fogctl.commands import site_record, site_view
    from recording_client import message

    up = {topics.agent_status("c", n): message(topics.agent_status("c", n), b"online", True)
          for n in ("n1", "n2", "n3", "n4")}
    recs = {topics.site_manager("c", "n2"): rec("n2", NOW + 10, target=0.3),
            topics.site_manager("c", "n3"): rec("n3", NOW + 12),
            topics.site_manager("c", "n4"): said("n4", "n2")}
    snap = dict(up, **{t: message(t, p, True) for t, p in recs.items()})
    doc, _ = site_view(site_record(snap, "c", NOW), NOW)
    assert doc["leader"] == "n2" and doc["target"] == 0.3, doc
    only = dict(up, **{topics.site_manager("c", "n4"): message(topics.site_manager("c", "n4"), said("n4", "n2"), True)})
    assert site_record(only, "c", NOW) is None
