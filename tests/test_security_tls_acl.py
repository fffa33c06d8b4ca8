"""Security with real processes: a private Mosquitto with the TLS listener and the ACL that the
Ansible role `mosquitto` ships (both rendered from ansible/roles/mosquitto/templates with the
role's defaults; only paths, port, cluster and the identity lists are set: nodes n1 and n2, the
admin `admin`, the collector `collector`), client certificates whose CN is the identity
(`require_certificate` + `use_identity_as_username`, no anonymous access) and the CA's CRL.

What it shows (docs/security.md, "Topics and who may use them"):
- the broker alone, with MQTT 5 test clients (QoS 1; 135 = PUBACK "not authorized"): a node writes
  its own records, the shared topics, peer requests, replies and probes that end in its own name,
  and nothing else (no rpc, no other node's name, no pipelines, no inbox in the shared format of
  before); it reads no other node's rpc, peer, reply or ack topics, nor the inboxes of another
  node's instances (`inbox/<node>/...`, per-node inboxes); an admin writes rpc and pipelines but no inbox nor agent records; a
  CA-signed certificate on no list (CN=intruder) and the broker's own certificate can neither
  publish nor receive anything; a revoked certificate is refused at the handshake; a packet over
  `max_packet_size` closes the connection; a client that takes another identity's client id
  receives nothing that identity may read and it may not;
- real agents (`python -m agent run`) with their node certificate publish their retained status
  and state; fogctl with the admin certificate reads and steers them;
- a client without a certificate, with a certificate of a foreign CA, or without TLS is refused;
- TLS mistakes in the agent's own configuration are one line, never a traceback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent import topics
from agent.cli.fogctl import main as fogctl_main
from agent_process import ONLINE_BOUND
from tls_site import (NOT_AUTHORIZED, OK_CODES, ROOT, AgentProc, Client, Site, agent_toml, have_tools, make_crl,
                      render_role, running_site, wait_until)

from pipelines import taxi_in_zone  # noqa: E402

pytestmark = pytest.mark.broker

CLUSTER = "sec"
ADMIN = "admin"
COLLECTOR = "collector"
NODES = ("n1", "n2")

PIPELINE = taxi_in_zone("taxi", seed=1, rate=50.0)


def T(rest: str) -> str:
    """A topic of the test cluster, written out as docs/security.md's table names it."""
    return f"fog/{CLUSTER}/{rest}"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    if not have_tools():
        pytest.skip("openssl or mosquitto missing")
    with running_site(tmp_path_factory.mktemp("sec"), CLUSTER, NODES, [ADMIN], extra_certs=["intruder"],
                      revoked=["n2"], collectors=[COLLECTOR]) as s:
        yield s


@pytest.fixture(scope="module")
def agents(site: Site) -> Iterator[Dict[str, AgentProc]]:
    procs = {n: AgentProc(site, n) for n in NODES}
    try:
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture()
def admin(site: Site) -> Iterator[Client]:
    c = Client(site, ADMIN)
    assert c.connect() == "connected"
    try:
        yield c
    finally:
        c.close()


def connected(site: Site, cert: str, **kw: Any) -> Client:
    c = Client(site, cert, **kw)
    outcome = c.connect()
    assert outcome == "connected", f"{cert}: {outcome}"
    return c


def fogctl(capsys: Any, site: Site, *argv: str, cert: str = ADMIN) -> Tuple[int, str, str]:
    code = fogctl_main(["--broker", f"127.0.0.1:{site.port}", "--cluster", CLUSTER, "--timeout", "10",
                        "--cafile", str(site.certs / "fog-ca.crt"), "--cert", str(site.certs / f"{cert}.crt"),
                        "--key", str(site.certs / f"{cert}.key"), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def routed(sender: Client, receivers: List[Client], marker: bytes) -> None:
    """A positive control: once `marker` (published last on events) reached every receiver, every
    message published before it by `sender` has been routed."""
    assert sender.publish(T("events"), marker) in OK_CODES
    for r in receivers:
        assert r.wait_for(lambda m: (T("events"), marker) in {(t, p) for t, p, _, _ in m}, 5), r.client_id


# ---- the rendered configuration --------------------------------------------------------------------


def test_rendered_broker_is_tls_only_with_certificates_crl_and_limits(site: Site) -> None:
    conf = site.conf.read_text().splitlines()
    for line in ("allow_anonymous false", "require_certificate true", "use_identity_as_username true",
                 f"listener {site.port} 127.0.0.1", f"acl_file {site.acl}", "max_packet_size 1048576",
                 f"crlfile {site.conf.parent}/certs/crl.pem"):
        assert line in conf, line
    assert sum(line.startswith("listener ") for line in conf) == 1  # no plain listener
    assert "password_file" not in site.conf.read_text()  # certificates are the only credential here
    queued = [int(line.split()[1]) for line in conf if line.startswith("max_queued_bytes ")]
    assert queued and queued[0] >= 16 * 1024 * 1024, queued  # bounded, and above the spill window
    assert [line for line in conf if line.startswith("max_queued_messages ")] == ["max_queued_messages 100000"]


def test_rendered_acl_has_one_block_per_listed_identity_and_no_patterns(site: Site) -> None:
    lines = [line.strip() for line in site.acl.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert not [line for line in lines if line.startswith("pattern")], "a pattern applies to every user"
    users = [line.split()[1] for line in lines if line.startswith("user ")]
    assert sorted(users) == sorted([*NODES, ADMIN, COLLECTOR])
    assert lines[0].startswith("user "), "topic lines before the first user apply to anonymous clients"
    assert all(re.fullmatch(r"(user \S+|topic (read|write|readwrite) \S+)", line) for line in lines), lines
    # a wildcard never stands where a sender's name belongs
    for line in lines:
        topic = line.split()[-1]
        for kind in ("peer", "rpc", "ping", "pong"):
            if f"/{kind}/" in topic and line.startswith("topic write"):
                assert not topic.endswith("/+"), line
        if "/replies/" in topic and "write" in line:
            assert not topic.endswith("/+"), line


def test_role_defaults_turn_tls_on_and_plaintext_off(tmp_path: Path) -> None:
    """The role's defaults, not the test's overrides: TLS listener, no plain listener; a plain
    listener turned on listens on loopback unless told otherwise."""
    v = render_role(tmp_path / "a", 18883, groups={"fog_nodes": ["pi1", "pi2"], "brokers": ["broker"]})
    conf = (Path(v["mosquitto_config_dir"]) / "mosquitto.conf").read_text().splitlines()
    assert [line for line in conf if line.startswith("listener ")] == ["listener 18883 127.0.0.1"]  # the TLS one
    assert "require_certificate true" in conf and "crlfile" not in "\n".join(conf)  # no CRL given: none
    # the node list defaults to the inventory's fog_nodes group; no admin, no collector by default
    acl = (Path(v["mosquitto_config_dir"]) / "fog.acl").read_text()
    assert re.findall(r"^user (\S+)$", acl, re.M) == ["pi1", "pi2"]
    assert "topic write fog/default/agents/pi1/state" in acl.splitlines()
    v = render_role(tmp_path / "b", 18883, mosquitto_listener_enabled=True)
    conf = (Path(v["mosquitto_config_dir"]) / "mosquitto.conf").read_text().splitlines()
    assert "listener 1883 127.0.0.1" in conf


# ---- the broker alone: who may write and read what -------------------------------------------------


def test_node_writes_own_shared_and_own_name_topics_only(site: Site) -> None:
    admin, n2, coll = connected(site, ADMIN), connected(site, "n2"), connected(site, COLLECTOR)
    n1 = connected(site, "n1")
    # The certificate's CN is the identity: claiming to be the admin in the CONNECT changes nothing.
    n1_claiming_admin = connected(site, "n1", username=ADMIN)
    try:
        for r in (admin, n2, coll):
            assert r.subscribe("fog/#") == [1]
        own = [T("agents/n1/state"), T("agents/n1/status"), T("agents/n1/hosted"), T("agents/n1/rehomed"),
               T("latency/n1"), T("spill/n1/chunk")]
        shared = [T("locks"), T("locks/x"), T("decisions/taxi.sink.7")]
        own_name = [T("inbox/n2/taxi.sink.7/n1"), T("inbox/n1/taxi.sink.7/n1"), T("agents/n2/peer/n1"), T("replies/admin/n1"), T("replies/n2/n1"), T("latency/n2/ping/n1"),
                    T("latency/n2/pong/n1")]
        foreign = [T("agents/n2/status"), T("agents/n2/state"), T("agents/n2/hosted"), T("agents/n1/state/x"),
                   T("latency/n2"), T("spill/n2/chunk"), T("spill/n1/ack"),
                   # control requests are for admins only, to anyone
                   T("agents/n2/rpc/n1"), T("agents/n2/rpc/admin"), T("agents/n1/rpc/admin"), T("agents/n2/rpc"),
                   # requests, replies and probes that end in another node's name
                   T("agents/n2/peer/n2"), T("agents/n1/peer/n2"), T("replies/admin/n2"), T("replies/n1/n2"),
                   T("latency/n2/ping/n2"), T("latency/n1/pong/n2"),
                   # data in another node's name, or with no node at all, or in the shared
                   # format of before (mosquitto_inbox_per_node false)
                   T("inbox/n2/taxi.sink.7/n2"), T("inbox/n2/taxi.sink.7"), T("inbox/n2/taxi.sink.7/n1/x"),
                   T("inbox/taxi.sink.7/n1"), T("inbox/taxi.sink.7/n2"),
                   T("pipelines/taxi"), T("pipelines/taxi/x"), "fog/othercluster/events"]
        allowed = {t: n1.publish(t, b"probe") for t in own + shared + own_name}
        denied = {t: n1.publish(t, b"forged", retain=True) for t in foreign}
        spoofed = {t: n1_claiming_admin.publish(t, b"forged", retain=True) for t in foreign[:3] + foreign[7:9] + foreign[17:19]}
        routed(n1, [admin, n2], b"marker")
        assert all(code in OK_CODES for code in allowed.values()), allowed
        assert all(code == NOT_AUTHORIZED for code in denied.values()), denied
        assert all(code == NOT_AUTHORIZED for code in spoofed.values()), spoofed

        def delivered() -> set:
            return {t for r in (admin, n2, coll) for t, p, _, _ in list(r.received) if p == b"probe"}

        wait_until(lambda: set(own + shared + own_name) <= delivered(), 5, 0.05)
        assert set(own + shared + own_name) <= delivered(), set(own + shared + own_name) - delivered()
        forged = [t for r in (admin, n2, coll) for t, p, _, _ in r.received if p == b"forged"]
        assert not forged, "a refused publish reached a subscriber"
    finally:
        for c in (admin, n2, coll, n1, n1_claiming_admin):
            c.close()


def test_a_node_writes_its_own_site_manager_claim_only(site: Site) -> None:
    """The site manager's lease is single-writer (docs/site-manager.md, "Election"): n1 writes
    its claim on agents/n1/site_manager, which the other node and the admin read; it may not write
    n2's claim (renew, clear or overwrite n2's lease), nor the shared record every node could
    write before, nor a site's claims at the centre."""
    n1, n2, admin = connected(site, "n1"), connected(site, "n2"), connected(site, ADMIN)
    try:
        for r in (n2, admin):
            assert r.subscribe(T("agents/+/site_manager")) == [1] and r.subscribe(T("events")) == [1]
        claim = json.dumps({"v": 1, "node": "n1", "until": time.time() + 15}).encode()
        assert n1.publish(T("agents/n1/site_manager"), claim, retain=True) in OK_CODES
        for t in (T("agents/n2/site_manager"), T("site_manager"), T("sites/north/agents/n2/site_manager")):
            assert n1.publish(t, b"", retain=True) == NOT_AUTHORIZED, t
            assert n1.publish(t, json.dumps({"v": 1, "node": "n1", "until": time.time() + 15}).encode(),
                              retain=True) == NOT_AUTHORIZED, t
        routed(n1, [n2, admin], b"claims-marker")
        for r in (n2, admin):
            got = [(t, p) for t, p, _, _ in list(r.received) if t.endswith("/site_manager")]
            assert got == [(T("agents/n1/site_manager"), claim)], (r.client_id, got)
        assert n1.publish(T("agents/n1/site_manager"), b"", retain=True) in OK_CODES  # no retained leftover
    finally:
        for c in (n1, n2, admin):
            c.close()


def test_node_reads_no_other_nodes_requests_replies_or_acks(site: Site) -> None:
    admin, n2, coll, n1 = (connected(site, c) for c in (ADMIN, "n2", COLLECTOR, "n1"))
    try:
        private = {T("agents/n2/rpc/admin"): admin, T("agents/n2/peer/n1"): n1, T("replies/n2/n1"): n1,
                   T("replies/admin/n2"): n2, T("latency/n2/ping/n1"): n1, T("latency/n2/pong/n1"): n1,
                   T("spill/n2/ack"): coll, T("spill/n2/chunk"): n2,
                   # the inboxes of n2's instances, whoever writes them (n1 itself included)
                   T("inbox/n2/taxi.sink.0/n2"): n2, T("inbox/n2/taxi.sink.0/n1"): n1}
        # Mosquitto 2.0 grants the SUBACK and checks read access per message: nothing is delivered.
        for t in [*private, T("agents/n2/#"), T("replies/#"), T("spill/#"), T("events"), T("inbox/#"), T("inbox/n2/#"),
                  T("inbox/+/+/+")]:
            n1.subscribe(t)
        for t, writer in private.items():
            assert writer.publish(t, b"private") in OK_CODES, t
        routed(n2, [n1], b"marker-2")  # every publish above was PUBACKed: routed before it
        assert not {t for t, _, _, _ in n1.received} & set(private), n1.topics()
        # n2 (the addressee) does read them: the refusal above is about n1, not the topics.
        assert n2.subscribe(T("agents/n2/#")) == [1] and n2.subscribe(T("replies/n2/+")) == [1]
        assert n2.subscribe(T("inbox/n2/+/+")) == [1]
        mine = (T("agents/n2/rpc/admin"), T("agents/n2/peer/n1"), T("replies/n2/n1"), T("inbox/n2/taxi.sink.0/n2"),
                T("inbox/n2/taxi.sink.0/n1"))
        for t in mine:
            assert private[t].publish(t, b"to-n2") in OK_CODES
        assert n2.wait_for(lambda m: set(mine) <= {t for t, p, _, _ in m if p == b"to-n2"}, 5), n2.topics()
    finally:
        for c in (admin, n2, coll, n1):
            c.close()


def test_admin_sends_requests_and_deploys_but_writes_no_data_or_records(site: Site) -> None:
    admin, n2 = connected(site, ADMIN), connected(site, "n2")
    try:
        assert n2.subscribe(T("agents/n2/rpc/+")) == [1] and n2.subscribe(T("pipelines/+")) == [1]
        assert n2.subscribe(T("inbox/#")) == [1] and n2.subscribe(T("agents/+/state")) == [1]
        assert admin.publish(T("agents/n2/rpc/admin"), b'{"op": "ping"}') in OK_CODES
        assert admin.publish(T("pipelines/probe"), b"x", retain=True) in OK_CODES
        assert admin.publish(T("pipelines/probe"), b"", retain=True) in OK_CODES  # clear it again
        refused = {t: admin.publish(t, b"forged") for t in
                   (T("inbox/n2/taxi.sink.0/admin"), T("inbox/n2/taxi.sink.0/n2"), T("inbox/taxi.sink.0/n2"), T("agents/n2/state"), T("agents/admin/state"), T("agents/n2/rpc/other"),
                    T("agents/n2/peer/admin"), T("replies/n2/admin"), T("events"), T("locks"),
                    T("latency/admin"), T("spill/n2/ack"), T("decisions/x"))}
        assert all(code == NOT_AUTHORIZED for code in refused.values()), refused
        assert n2.wait_for(lambda m: any(t == T("pipelines/probe") for t, _, _, _ in m), 5)
        assert n2.got(T("agents/n2/rpc/admin"))
        assert not [t for t, p, _, _ in n2.received if p == b"forged"]
    finally:
        admin.close()
        n2.close()


def test_collector_reads_chunks_and_writes_acks_only(site: Site) -> None:
    coll, n1 = connected(site, COLLECTOR), connected(site, "n1")
    try:
        assert coll.subscribe(T("spill/+/chunk")) == [1] and coll.subscribe(T("inbox/#")) == [1]
        assert n1.subscribe(T("spill/n1/ack")) == [1]
        assert n1.publish(T("spill/n1/chunk"), b"chunk") in OK_CODES
        assert n1.publish(T("inbox/n1/x/n1"), b"data") in OK_CODES
        assert coll.publish(T("spill/n1/ack"), b"ack") in OK_CODES
        refused = {t: coll.publish(t, b"forged") for t in
                   (T("spill/n1/chunk"), T("inbox/n1/x/n1"), T("inbox/n1/x/collector"), T("agents/n1/rpc/collector"), T("pipelines/x"), T("events"))}
        assert all(code == NOT_AUTHORIZED for code in refused.values()), refused
        assert coll.wait_for(lambda m: any(t == T("spill/n1/chunk") for t, _, _, _ in m), 5)
        assert n1.wait_for(lambda m: any(t == T("spill/n1/ack") for t, _, _, _ in m), 5)
        assert not coll.got(T("inbox/n1/x/n1"))  # no data for the collector
    finally:
        coll.close()
        n1.close()


@pytest.mark.parametrize("cert", ["intruder", "server"])
def test_certificates_on_no_list_get_nothing(site: Site, cert: str) -> None:
    """A certificate the site CA signed but the role lists nowhere (CN=intruder), and the broker's
    own server certificate (CN=localhost): the handshake succeeds, and nothing else does."""
    n1, admin = connected(site, "n1"), connected(site, ADMIN)
    x = connected(site, cert)
    try:
        assert n1.publish(T("agents/n1/state"), b'{"node": "n1"}', retain=True) in OK_CODES
        for t in ("#", "fog/#", "$SYS/#"):
            x.subscribe(t)
        attempts = [T("events"), T("inbox/n1/taxi.sink.0/n1"), T("inbox/n1/taxi.sink.0/intruder"), T("locks"), T("decisions/x"), T("pipelines/x"),
                    T("agents/n1/rpc/intruder"), T("agents/n1/rpc/localhost"), T("agents/n1/rpc/admin"),
                    T("agents/n1/peer/intruder"), T("agents/n1/peer/localhost"), T("agents/intruder/state"),
                    T("agents/n1/state"), T("replies/admin/intruder"), T("replies/admin/n1"), T("latency/intruder"),
                    T("latency/n1/ping/intruder"), T("spill/n1/ack"), "fog/other/events", "elsewhere"]
        codes = {t: x.publish(t, b"forged") for t in attempts}
        assert all(code == NOT_AUTHORIZED for code in codes.values()), codes
        for t in (T("events"), T("inbox/n1/taxi.sink.0/n1")):
            assert n1.publish(t, b"live") in OK_CODES
        assert admin.publish(T("agents/n1/rpc/admin"), b"live") in OK_CODES
        assert admin.subscribe(T("events")) == [1]
        routed(n1, [admin], b"marker-x")
        time.sleep(0.3)
        assert x.received == [], [t for t, _, _, _ in x.received]  # not even the retained state
    finally:
        for c in (n1, admin, x):
            c.close()


def test_revoked_certificate_is_refused_at_the_handshake(site: Site) -> None:
    good, revoked = Client(site, "n2"), Client(site, "n2-revoked")
    try:
        assert good.connect() == "connected"
        outcome = revoked.connect()
        assert outcome != "connected", outcome
        assert not revoked.connected.is_set()  # no CONNACK: refused before MQTT
    finally:
        good.close()
        revoked.close()
    assert "certificate verify failed" in site.log.read_text()


def test_revocation_and_removal_from_the_lists_take_effect_on_reload(tmp_path: Path) -> None:
    """docs/security.md, "Revoking": a new CRL and an ACL without the identity, then SIGHUP (the
    role's reload handler): the revoked certificate cannot connect again, its open connection may
    do nothing any more, and nobody else is disconnected."""
    with running_site(tmp_path, CLUSTER, NODES, [ADMIN]) as s:
        old, other = connected(s, "n1"), connected(s, "n2")
        try:
            assert old.publish(T("events"), b"before") in OK_CODES
            crl = make_crl(s.certs, "fog", ["n1"])
            shutil.copy(crl, s.conf.parent / "certs/crl.pem")
            v = render_role(tmp_path / "root", s.port, mosquitto_cluster=CLUSTER, mosquitto_node_identities=["n2"],
                            mosquitto_admin_identities=[ADMIN], mosquitto_tls_crl_src=str(crl))
            assert Path(v["mosquitto_acl_file"]) == s.acl and "user n1" not in s.acl.read_text()
            os.kill(s.proc.pid, signal.SIGHUP)
            again = Client(s, "n1")
            assert wait_until(lambda: "Reloading config" in s.log.read_text(), 5)
            outcome = again.connect()
            again.close()
            assert outcome != "connected", outcome
            assert old.publish(T("events"), b"after") == NOT_AUTHORIZED
            assert other.publish(T("events"), b"after") in OK_CODES
            assert not old.disconnected.is_set() and not other.disconnected.is_set()

            # A CRL past its nextUpdate refuses every client, revoked or not (the doc's warning).
            expired = s.certs / "expired-crl.pem"
            subprocess.run(["openssl", "ca", "-config", str(s.certs / "fog-ca-db/ca.cnf"), "-keyfile",
                            str(s.certs / "fog-ca.key"), "-cert", str(s.certs / "fog-ca.crt"), "-gencrl",
                            "-crlsec", "1", "-out", str(expired)], check=True, capture_output=True)
            time.sleep(1.5)
            shutil.copy(expired, s.conf.parent / "certs/crl.pem")
            os.kill(s.proc.pid, signal.SIGHUP)
            assert wait_until(lambda: s.log.read_text().count("Reloading config") >= 2, 5)
            late = Client(s, "n2")
            outcome = late.connect()
            late.close()
            assert outcome != "connected", outcome
        finally:
            old.close()
            other.close()


def test_packets_over_the_limit_close_the_connection(site: Site) -> None:
    """max_packet_size 1 MiB: a spill chunk (256 KiB + header) and a 200 kB batch pass; 2 MiB does
    not reach anyone and costs the sender its connection."""
    n2 = connected(site, "n2")
    try:
        assert n2.subscribe(T("inbox/n2/big/n1")) == [1]
        for size in (200_000, 256 * 1024 + 512, 1_000_000):
            n1 = connected(site, "n1")
            try:
                assert n1.publish_outcome(T("inbox/n2/big/n1"), b"a" * size) in ("puback 0", "puback 16"), size
            finally:
                n1.close()
        big = connected(site, "n1")
        try:
            assert big.publish_outcome(T("inbox/n2/big/n1"), b"b" * (2 * 1024 * 1024)) == "disconnected"
        finally:
            big.close()
        sizes = lambda: sorted(len(p) for t, p, _, _ in n2.received if t == T("inbox/n2/big/n1"))  # noqa: E731
        assert wait_until(lambda: len(sizes()) == 3, 5)
        time.sleep(0.3)
        assert sizes() == [200_000, 256 * 1024 + 512, 1_000_000], sizes()
        assert "oversize packet" in site.log.read_text()
    finally:
        n2.close()


def test_client_id_takeover_gets_nothing_the_taker_may_not_read(site: Site) -> None:
    """Mosquitto 2.0.11 lets any identity connect with another's client id (docs/security.md,
    "Client ids"): it takes over the session, subscriptions included, and each side kicks the
    other when it connects. What the taker receives is still checked against ITS identity: an
    unlisted one gets nothing, another node none of the owner's requests. The owner's queued
    messages that the taker was refused are dropped (the denial of service the doc describes)."""
    admin = connected(site, ADMIN)
    try:
        for taker in ("intruder", "n2"):
            cid = f"fog-agent-{CLUSTER}-n1-{taker}"
            owner = Client(site, "n1", client_id=cid)
            assert owner.connect(clean_start=True, session_expiry=600) == "connected"
            assert owner.subscribe(T("agents/n1/rpc/+")) == [1] and owner.subscribe(T("replies/n1/+")) == [1]
            owner.close()
            assert admin.publish(T("agents/n1/rpc/admin"), b"queued") in OK_CODES
            thief = Client(site, taker, client_id=cid)
            back = Client(site, "n1", client_id=cid)
            try:
                assert thief.connect(clean_start=False, session_expiry=600) == "connected"
                assert thief.session_present  # the owner's session, as measured
                assert admin.publish(T("agents/n1/rpc/admin"), b"live") in OK_CODES
                time.sleep(0.5)
                assert not [t for t, _, _, _ in thief.received], thief.topics()
                # the owner comes back: the taker is kicked, and the refused messages are gone
                assert back.connect(clean_start=False, session_expiry=600) == "connected"
                assert wait_until(thief.disconnected.is_set, 5)
                time.sleep(0.5)
                assert back.session_present and back.received == [], back.topics()
            finally:
                thief.c.loop_stop()
                back.close()
    finally:
        admin.close()


# ---- real agents and fogctl ------------------------------------------------------------------------


def test_agents_with_node_certificates_publish_status_and_state(site: Site, agents: Dict[str, AgentProc],
                                                                admin: Client) -> None:
    assert admin.subscribe(topics.all_agents_status(CLUSTER)) == [1]
    assert admin.subscribe(topics.all_agents_state(CLUSTER)) == [1]

    def up(msgs: List[Any]) -> bool:
        got = {t: p for t, p, _, _ in msgs}
        return all(got.get(topics.agent_status(CLUSTER, n)) == b"online" and topics.agent_state(CLUSTER, n) in got
                   for n in NODES)

    assert admin.wait_for(up, 30), (admin.topics(), agents["n1"].text()[-2000:])
    got = admin.topics()
    for n in ("n1", "n2"):
        assert json.loads(got[topics.agent_state(CLUSTER, n)])["node"] == n
    assert "Traceback" not in agents["n1"].text()


def test_agents_answer_on_the_requesters_reply_topic_only(site: Site, agents: Dict[str, AgentProc]) -> None:
    """An admin's ping on `agents/n2/rpc/admin` is answered on `replies/admin/n2`, the topic
    computed from the request's; a Response Topic naming n1's status is ignored. A node may send
    peer requests, but only the ones the protocol needs: n1's ping on `agents/n2/peer/n1` is
    answered with a refusal on `replies/n1/n2`."""
    admin, n1 = connected(site, ADMIN), connected(site, "n1")
    try:
        assert admin.subscribe(T("replies/admin/+")) == [1] and admin.subscribe(T("agents/n1/status")) == [1]
        assert n1.subscribe(T("replies/n1/+")) == [1]

        def ask(c: Client, topic: str, reply_topic: str, corr: bytes) -> Dict[str, Any]:
            props = Properties(PacketTypes.PUBLISH)
            props.ResponseTopic = T("agents/n1/status")  # the attack of issue #20: must be ignored
            props.CorrelationData = corr

            def replied(msgs: List[Any]) -> bool:
                return any(t == reply_topic and getattr(pr, "CorrelationData", None) == corr for t, _, _, pr in msgs)

            deadline = time.monotonic() + 20  # the agent may still be starting: ask again until it answers
            while time.monotonic() < deadline and not replied(c.received):
                assert c.publish(topic, b'{"op": "ping"}', properties=props) in OK_CODES
                c.wait_for(replied, 2)
            assert replied(c.received), agents["n2"].text()[-2000:]
            return json.loads(next(p for t, p, _, pr in c.received
                                   if t == reply_topic and getattr(pr, "CorrelationData", None) == corr))

        body = ask(admin, T("agents/n2/rpc/admin"), T("replies/admin/n2"), b"c-1")
        assert body["ok"] is True and body["node"] == "n2"
        refused = ask(n1, T("agents/n2/peer/n1"), T("replies/n1/n2"), b"c-2")
        assert refused["ok"] is False, refused
        time.sleep(0.3)
        with admin.lock:
            statuses = [p for t, p, _, _ in admin.received if t == T("agents/n1/status")]
        assert statuses and set(statuses) == {b"online"}, statuses  # no reply landed on n1's status
        assert agents["n2"].alive() and agents["n1"].alive()
    finally:
        admin.close()
        n1.close()


def test_anonymous_foreign_and_plain_clients_are_refused(site: Site) -> None:
    outcomes = {
        "n1 certificate (control)": Client(site, "n1"),
        "no client certificate": Client(site, None),
        "certificate of a foreign CA, CN=n1": Client(site, "foreign-n1"),
        "no TLS at all": Client(site, None, tls=False),
    }
    try:
        got = {name: c.connect() for name, c in outcomes.items()}
    finally:
        for c in outcomes.values():
            c.close()
    assert got["n1 certificate (control)"] == "connected", got
    for name, outcome in got.items():
        if name != "n1 certificate (control)":
            assert outcome != "connected", f"{name}: {outcome}"


def test_fogctl_with_admin_certificate_reads_and_steers_the_fleet(capsys: Any, site: Site,
                                                                  agents: Dict[str, AgentProc]) -> None:
    def status() -> Dict[str, Any]:
        code, out, err = fogctl(capsys, site, "--json", "status")
        assert code == 0, err
        return {n["node"]: n for n in json.loads(out)["nodes"]}

    wait_until(lambda: all(status().get(n, {}).get("status") == "online" for n in NODES)
               or not all(a.alive() for a in agents.values()), ONLINE_BOUND)
    assert all(status().get(n, {}).get("status") == "online" for n in NODES), status()

    # deploy: agents answer fogctl's requests (replies/<client>), workers run with the node's certificate
    pipe = site.tmp / "taxi.toml"
    pipe.write_text(PIPELINE)
    code, out, err = fogctl(capsys, site, "deploy", str(pipe), "--keeper-timeout", "20")
    assert code == 0, err + agents["n1"].text()[-2000:]
    keepers = {"taxi.source.0", "taxi.in_zone.0", "taxi.sink.0"}

    running = wait_until(lambda: keepers <= {i for n in status().values() for i in n.get("instances", [])}, 20)
    assert running, status()

    def sink_records() -> int:  # from the agents' retained state, as the admin reads it
        c = Client(site, ADMIN)
        try:
            assert c.connect() == "connected"
            c.subscribe(topics.all_agents_state(CLUSTER))
            c.wait_for(lambda m: len({t for t, _, _, _ in m}) >= 2, 3)
            docs = [json.loads(p) for p in c.topics().values() if p]
        finally:
            c.close()
        return sum(int(i.get("stats", {}).get("records_in", 0)) for d in docs for i in d.get("instances", [])
                   if i.get("id") == "taxi.sink.0")

    assert wait_until(lambda: sink_records() > 0, 20), status()  # records went through the inboxes

    # latency probes: n1 pings n2 on latency/n2/ping, n2 answers on latency/n1/pong
    code, out, err = fogctl(capsys, site, "--json", "latency")
    assert code == 0, err
    assert wait_until(lambda: "n2" in json.dumps(json.loads(fogctl(capsys, site, "--json", "latency")[1])), 15)

    code, out, err = fogctl(capsys, site, "undeploy", "taxi")
    assert code == 0, err
    for a in agents.values():
        assert "Traceback" not in a.text(), a.text()[-3000:]


def test_fogctl_without_client_certificate_is_one_line(capsys: Any, site: Site) -> None:
    code = fogctl_main(["--broker", f"127.0.0.1:{site.port}", "--cluster", CLUSTER, "--timeout", "3",
                        "--cafile", str(site.certs / "fog-ca.crt"), "status"])
    err = capsys.readouterr().err
    assert code in (1, 3) and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_agent_tls_mistakes_are_one_line(site: Site) -> None:
    # An unreadable key: a configuration error, exit 78 (systemd does not restart it), one line.
    conf = agent_toml(site, "n3", "n1").read_text().replace(f"{site.certs}/n1.key", f"{site.certs}/missing.key")
    bad = site.tmp / "bad-key.toml"
    bad.write_text(conf)
    r = subprocess.run([sys.executable, "-m", "agent", "run", "--config", str(bad)], capture_output=True, text=True,
                       timeout=30, cwd=str(ROOT), env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 78, r.stderr
    assert "missing.key" in r.stderr and "Traceback" not in r.stderr, r.stderr

    # A certificate the broker does not trust: the agent keeps retrying, and says why once.
    foreign = AgentProc(site, "n3", conf=agent_toml(site, "n3", "foreign-n1"))
    try:
        assert wait_until(lambda: "TLS error" in foreign.text(), 15), foreign.text()
        time.sleep(2.5)  # several reconnect attempts (1 s backoff)
        text = foreign.text()
    finally:
        code = foreign.stop()
    assert code == 0, text
    assert "Traceback" not in text, text
    problems = [line.split(" msg=", 1)[1] for line in text.splitlines() if "cannot connect to" in line]
    assert any("TLS error" in p for p in problems), text
    assert len(problems) == len(set(problems)), text  # each reason once, not once per retry
