"""A site's uplink (agent/sites.py, docs/scale.md "Sites"): the topic map, the role's rendering of
it, and a real bridge between two Mosquitto brokers rendered by the role (TLS, the site's
identity, the centre's ACL): what crosses, what does not, and a 10 s uplink cut.

The cut is made by a TCP proxy between the site broker's bridge and the central broker
(lab/foglab/tools/delayproxy.py), stopped and started again on the same port: both brokers stay up,
as when a site's radio link drops, so the centre queues steering for the site while the site
queues its spill for the centre.
"""

from __future__ import annotations

import collections
import json
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent import sites, topics
from agent.collector.service import Collector
from agent.config import TlsSection
from agent.mqtt.requester import RequestTimeout
from agent.node.deploy import RpcClient
from agent.node.rpc import SeenRequests
from agent.spill.shipper import MqttShipper
from agent.spill.shipping import Outgoing, decode_chunk
from agent.spill.spool import Spool, read_records
from foglab.tools.broker import MOSQUITTO, free_port, wait_port
from foglab.tools.delayproxy import DelayProxy
from tls_certs import make_ca, make_cert
from tls_site import OK_CODES, NOT_AUTHORIZED, Client, render_role, wait_until

C = "geo"
SITE = "north"
NODES = ["n1", "n2"]
ADMIN = "fogctl-admin"
OTHER_ADMIN = "ops-south"  # an administrator of the centre who may not steer this site
BRIDGE = "bridge-north"
OTHER_SITE_NODE = "s9"  # a node of another site, bridged to the same centre
COLLECTOR = "central1"
SPY = "spy"  # a test observer that may read everything (its ACL block is added by the test)


# ---- the map, sans-IO --------------------------------------------------------------------------


def test_the_map_is_exactly_what_leaves_and_enters_a_site() -> None:
    got = {(x.local, x.remote, x.direction, x.qos) for x in sites.crossings(C, SITE, NODES, [ADMIN])}
    b = f"fog/{C}"
    want = {(f"{b}/events", f"{b}/events", "out", 1)}
    for n in NODES:
        want |= {(f"{b}/spill/{n}/chunk", f"{b}/spill/{n}/chunk", "out", 1),
                 (f"{b}/spill/{n}/ack", f"{b}/spill/{n}/ack", "in", 1),
                 (f"{b}/agents/{n}/status", f"{b}/agents/{n}/status", "out", 1),
                 (f"{b}/agents/{n}/state", f"{b}/agents/{n}/state", "out", 1),
                 (f"{b}/agents/{n}/site_manager", f"{b}/sites/{SITE}/agents/{n}/site_manager", "out", 1),
                 (f"{b}/agents/{n}/rpc/{ADMIN}", f"{b}/agents/{n}/rpc/{ADMIN}", "in", 1),
                 (f"{b}/replies/{ADMIN}/{n}", f"{b}/replies/{ADMIN}/{n}", "out", 1)}
    assert got == want
    kinds = {topics.parse(C, x.local).kind for x in sites.crossings(C, SITE, NODES, [ADMIN])}
    assert kinds == {"spill_chunk", "spill_ack", "status", "state", "rpc", "reply", "events", "site_manager"}
    # The centre's name of a node's site-manager claim parses, naming the node and its site.
    assert topics.parse(C, f"{b}/sites/{SITE}/agents/n1/site_manager") == topics.Parsed("site_manager", "n1", SITE)
    # Without administrators nothing comes in but the spill acks.
    assert {x.local for x in sites.crossings(C, SITE, NODES) if x.direction == "in"} == {
        f"{b}/spill/{n}/ack" for n in NODES}


def test_the_map_refuses_names_that_cannot_be_topic_segments() -> None:
    for bad in (dict(site="a/b"), dict(nodes=["n1", "+"]), dict(admins=["#"]), dict(nodes=["n1", "n1"]),
                dict(admins=["n1"]), dict(nodes=["n1", 7])):
        args = dict(cluster=C, site=SITE, nodes=NODES, admins=[ADMIN])
        args.update(bad)
        with pytest.raises(ValueError):
            sites.crossings(**args)
    with pytest.raises(ValueError, match="together"):
        sites.Uplink(SITE, "c.example", 8883, BRIDGE, cafile="/ca.crt")


def uplink_vars(port: int, prefix: Path) -> Dict[str, Any]:
    return {"site": SITE, "host": "127.0.0.1", "port": port, "identity": BRIDGE, "admins": [ADMIN],
            "ca_src": str(prefix / "ca"), "cert_src": str(prefix / "crt"), "key_src": str(prefix / "key"),
            "keepalive": 5, "restart_timeout": 1}


def test_the_role_renders_the_map_on_the_site_broker_and_in_the_centres_acl(tmp_path: Path) -> None:
    """One source of truth: the role's templates give, line for line, the function's stanza and
    the function's ACL block for the bridge identity."""
    v = render_role(tmp_path / "site", 8883, mosquitto_cluster=C, mosquitto_node_identities=NODES[::-1],
                    mosquitto_site_uplink=uplink_vars(18883, tmp_path))
    conf = (Path(v["mosquitto_config_dir"]) / "mosquitto.conf").read_text()
    certs = f"{v['mosquitto_config_dir']}/certs"
    up = sites.Uplink(SITE, "127.0.0.1", 18883, BRIDGE, f"{certs}/uplink-ca.crt", f"{certs}/uplink.crt",
                      f"{certs}/uplink.key", keepalive=5, restart_timeout=1)
    stanza = sites.render_bridge(C, up, NODES, [ADMIN])
    assert conf[conf.index("# Uplink of site"):] == stanza
    assert "bridge_certfile" in stanza and "cleansession false" in stanza

    bridges = [{"site": SITE, "identity": BRIDGE, "nodes": NODES[::-1], "admins": [ADMIN]},
               {"site": "south", "identity": "bridge-south", "nodes": [OTHER_SITE_NODE]}]
    v = render_role(tmp_path / "centre", 8883, mosquitto_cluster=C, mosquitto_node_identities=[],
                    mosquitto_admin_identities=[ADMIN], mosquitto_collector_identities=[COLLECTOR],
                    mosquitto_site_bridges=bridges)
    acl = (Path(v["mosquitto_config_dir"]) / "fog.acl").read_text()
    blocks = {b.split("\n", 1)[0]: "user " + b for b in acl.split("\nuser ")[1:]}
    assert blocks[BRIDGE].strip() == sites.centre_acl(C, up, NODES, [ADMIN]).strip()
    south = sites.Uplink("south", "x", 1, "bridge-south")
    assert blocks["bridge-south"].strip() == sites.centre_acl(C, south, [OTHER_SITE_NODE]).strip()
    # The collector at the centre reads the spill of every site's nodes and acks it.
    for n in NODES + [OTHER_SITE_NODE]:
        assert f"topic read fog/{C}/spill/{n}/chunk" in blocks[COLLECTOR]
        assert f"topic write fog/{C}/spill/{n}/ack" in blocks[COLLECTOR]


def test_the_role_refuses_a_site_administrator_who_is_not_an_administrator_of_the_centre(tmp_path: Path) -> None:
    """At the centre only an identity with an admin block may steer a site's nodes and read their
    records (fogctl status there): the role's preflight refuses a bridge that lists another."""
    import os
    import sys

    playbook = Path(sys.executable).parent / "ansible-playbook"
    if not playbook.exists():
        pytest.skip("ansible-core is not installed in the venv")
    ansible = Path(__file__).resolve().parent.parent / "ansible"
    play = tmp_path / "preflight.yml"
    play.write_text("- hosts: localhost\n  connection: local\n  gather_facts: false\n  tasks:\n"
                    "    - ansible.builtin.include_role:\n        name: mosquitto\n        tasks_from: preflight\n")
    env = dict(os.environ, ANSIBLE_CONFIG=str(ansible / "ansible.cfg"), ANSIBLE_ROLES_PATH=str(ansible / "roles"),
               ANSIBLE_LOCAL_TEMP=str(tmp_path / "t"), ANSIBLE_HOME=str(tmp_path / "h"), ANSIBLE_NOCOLOR="1")

    def preflight(site_admins: List[str]) -> subprocess.CompletedProcess:
        extra = {"mosquitto_tls_ca_src": "ca", "mosquitto_tls_cert_src": "crt", "mosquitto_tls_key_src": "key",
                 "mosquitto_admin_identities": [ADMIN], "mosquitto_node_identities": [],
                 "mosquitto_site_bridges": [{"site": SITE, "identity": BRIDGE, "nodes": NODES, "admins": site_admins}]}
        return subprocess.run([str(playbook), "-i", "localhost,", str(play), "-e", json.dumps(extra)], cwd=str(ansible),
                              env=env, capture_output=True, text=True, timeout=120)
    ok = preflight([ADMIN])
    assert ok.returncode == 0, ok.stdout[-2000:]
    refused = preflight([ADMIN, OTHER_ADMIN])
    assert refused.returncode != 0
    assert f"site {SITE} lists administrators {OTHER_ADMIN} that are not in mosquitto_admin_identities" in refused.stdout


def test_a_redelivered_request_is_seen_once_within_its_ttl() -> None:
    seen = SeenRequests(capacity=3, ttl=10.0)
    ping = b'{"op": "ping"}'
    assert seen.first("admin", b"c1", ping, 0.0)
    assert not seen.first("admin", b"c1", ping, 5.0)  # the redelivery
    assert seen.first("other", b"c1", ping, 5.0)  # another requester's correlation is another request
    assert seen.first("admin", b"c1", b'{"op": "stop"}', 5.0)  # a reused correlation, another request
    assert seen.first("admin", None, ping, 5.0) and seen.first("admin", None, ping, 5.0)  # nothing to tell apart
    assert seen.first("admin", b"c1", ping, 16.0)  # past the ttl (longer than any requester waits)
    for i in range(5):
        seen.first("admin", f"x{i}".encode(), ping, 20.0)
    assert len(seen) == 3


# ---- two brokers from the role, bridged ----------------------------------------------------------


@dataclass
class Broker:
    port: int
    conf: Path
    log: Path
    certs: Path
    proc: Any = None

    def start(self) -> None:
        self.proc = subprocess.Popen([MOSQUITTO, "-c", str(self.conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        wait_port("127.0.0.1", self.port)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@dataclass
class World:
    certs: Path
    centre: Broker
    site: Broker
    proxy: DelayProxy

    def cut(self) -> None:
        """The uplink goes down: its connections close and new ones are refused (a link that
        resets, as a router that lost its carrier does). A silent partition (bytes held, nothing
        reset: `DelayProxy.cut`) was not noticed by Mosquitto 2.0.11's bridge within 15 s, while
        the centre dropped the bridge after 1.5 x its keepalive (docs/scale.md, "Sites")."""
        self.proxy.stop()

    def heal(self) -> None:
        self.proxy = DelayProxy(self.proxy.target, listen=("127.0.0.1", self.proxy.port)).start()

    def tls(self, cert: str) -> TlsSection:
        return TlsSection(str(self.certs / "fog-ca.crt"), str(self.certs / f"{cert}.crt"), str(self.certs / f"{cert}.key"))


def _rendered(root: Path, certs: Path, port: int, uplink: bool, **overrides: Any) -> Broker:
    v = render_role(root, port, mosquitto_cluster=C, mosquitto_persistence=True,
                    mosquitto_persistence_location=str(root / "db") + "/", mosquitto_autosave_interval=1,
                    **overrides)
    (root / "db").mkdir()
    conf_dir = Path(v["mosquitto_config_dir"])
    copies = [("fog-ca.crt", "ca.crt"), ("server.crt", "server.crt"), ("server.key", "server.key")]
    if uplink:
        copies += [("fog-ca.crt", "uplink-ca.crt"), (f"{BRIDGE}.crt", "uplink.crt"), (f"{BRIDGE}.key", "uplink.key")]
    for src, dst in copies:
        shutil.copy(certs / src, conf_dir / "certs" / dst)
    with open(conf_dir / "fog.acl", "a") as fh:  # the test's observer
        fh.write(f"\nuser {SPY}\ntopic read #\ntopic read $SYS/#\n")
    return Broker(port, conf_dir / "mosquitto.conf", Path(v["mosquitto_log_dest"].split(" ", 1)[1]), certs)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("sites")
    certs = tmp / "certs"
    certs.mkdir()
    make_ca(certs, "fog")
    make_cert(certs, "fog", "localhost", server=True, stem="server")
    for cn in (*NODES, ADMIN, OTHER_ADMIN, BRIDGE, COLLECTOR, SPY, OTHER_SITE_NODE):
        make_cert(certs, "fog", cn, stem=cn)
    cport, sport = free_port(), free_port()
    centre = _rendered(tmp / "centre", certs, cport, False, mosquitto_node_identities=[],
                       mosquitto_admin_identities=[ADMIN, OTHER_ADMIN], mosquitto_collector_identities=[COLLECTOR],
                       mosquitto_site_bridges=[{"site": SITE, "identity": BRIDGE, "nodes": NODES, "admins": [ADMIN]},
                                               {"site": "south", "identity": "bridge-south",
                                                "nodes": [OTHER_SITE_NODE], "admins": [ADMIN, OTHER_ADMIN]}])
    centre.start()
    proxy = DelayProxy(("127.0.0.1", cport)).start()
    site = _rendered(tmp / "site", certs, sport, True, mosquitto_node_identities=NODES,
                     mosquitto_admin_identities=[], mosquitto_site_uplink=uplink_vars(proxy.port, tmp))
    site.start()
    w = World(certs, centre, site, proxy)
    try:
        watch = spy(w.site)
        assert wait_until(lambda: watch.got(f"$SYS/broker/connection/{BRIDGE}/state", b"1"), 20), \
            site.log.read_text()[-2000:]
        watch.close()
        yield w
    finally:
        site.stop()
        w.proxy.stop()
        centre.stop()


def client(b: Broker, cert: str, **connect: Any) -> Client:
    c = Client(b, cert, client_id=connect.pop("client_id", None))  # type: ignore[arg-type]
    assert c.connect(**connect) == "connected"
    return c


def spy(b: Broker, pattern: str = "#", **connect: Any) -> Client:
    c = client(b, SPY, **connect)
    assert c.subscribe(pattern) == [1]
    if pattern == "#":
        assert c.subscribe("$SYS/broker/connection/#") == [1]
    return c


def test_exactly_the_mapped_topics_cross_each_in_its_direction(world: World) -> None:
    b = f"fog/{C}"
    at_centre, at_site = spy(world.centre), spy(world.site)
    n1, admin, other_admin, collector = (client(world.site, "n1"), client(world.centre, ADMIN),
                                         client(world.centre, OTHER_ADMIN), client(world.centre, COLLECTOR))
    try:
        out_ok = {f"{b}/spill/n1/chunk": f"{b}/spill/n1/chunk", f"{b}/agents/n1/status": f"{b}/agents/n1/status",
                  f"{b}/agents/n1/state": f"{b}/agents/n1/state", f"{b}/replies/{ADMIN}/n1": f"{b}/replies/{ADMIN}/n1",
                  f"{b}/events": f"{b}/events",
                  f"{b}/agents/n1/site_manager": f"{b}/sites/{SITE}/agents/n1/site_manager"}
        # The data plane, the protocol between nodes and the node-private records: all allowed to
        # n1 by the site's ACL, none may leave the site.
        stay = [f"{b}/inbox/n2/op-1/n1", f"{b}/agents/n2/peer/n1", f"{b}/replies/n2/n1", f"{b}/locks",
                f"{b}/latency/n1", f"{b}/latency/n2/ping/n1", f"{b}/latency/n2/pong/n1",
                f"{b}/agents/n1/hosted", f"{b}/agents/n1/rehomed", f"{b}/decisions/op-1"]
        for t in stay + list(out_ok):
            assert n1.publish(t, b"from-site " + t.encode(), retain=t.endswith(("status", "state", "site_manager"))) \
                in OK_CODES, t
        in_ok = [f"{b}/agents/n1/rpc/{ADMIN}", f"{b}/spill/n1/ack"]
        assert admin.publish(in_ok[0], b"steer") in OK_CODES
        assert collector.publish(in_ok[1], b"ack") in OK_CODES
        # Steering by an administrator not listed for this site, acks of another site's node,
        # a deployed pipeline: they stay at the centre.
        keep = [f"{b}/agents/n1/rpc/{OTHER_ADMIN}", f"{b}/spill/{OTHER_SITE_NODE}/ack", f"{b}/pipelines/p"]
        assert other_admin.publish(keep[0], b"steer") in OK_CODES
        assert collector.publish(keep[1], b"ack") in OK_CODES
        assert admin.publish(keep[2], b"{}") in OK_CODES
        # The last of each direction arrives after the others (one bridge connection, in order).
        assert n1.publish(f"{b}/events", b"last") in OK_CODES
        assert admin.publish(in_ok[0], b"last") in OK_CODES
        assert at_centre.wait_for(lambda r: any(p == b"last" for t, p, _, _ in r if t == f"{b}/events"), 10)
        assert at_site.wait_for(lambda r: any(p == b"last" for t, p, _, _ in r if t == in_ok[0]), 10)
        time.sleep(0.5)
        centre_got = set(at_centre.topics())
        site_got = set(at_site.topics())
        published_at_centre = set(in_ok) | set(keep)
        assert centre_got - published_at_centre == set(out_ok.values())
        link_state = f"$SYS/broker/connection/{BRIDGE}/state"
        assert site_got - set(stay) - set(out_ok) - {link_state} == set(in_ok)
        assert link_state in site_got and not any(t.startswith("$SYS") for t in centre_got)  # it stays local
        # Retained records keep their flag: a reader joining the centre later gets them.
        late = spy(world.centre, f"{b}/agents/+/status")
        assert late.wait_for(lambda r: any(t == f"{b}/agents/n1/status" and ret for t, _, ret, _ in r), 5)
        late.close()
        # The bridge's identity at the centre may write only what leaves its own site.
        as_bridge = client(world.centre, BRIDGE, client_id=f"probe-{uuid.uuid4().hex[:6]}")
        assert as_bridge.publish(f"{b}/agents/{OTHER_SITE_NODE}/status", b"forged") == NOT_AUTHORIZED
        assert as_bridge.publish(f"{b}/inbox/n2/op-1/n1", b"x") == NOT_AUTHORIZED
        for t in (f"{b}/site_manager", f"{b}/agents/n1/site_manager", f"{b}/sites/south/agents/n1/site_manager",
                  f"{b}/sites/{SITE}/agents/{OTHER_SITE_NODE}/site_manager"):
            assert as_bridge.publish(t, b"x") == NOT_AUTHORIZED, t
        assert as_bridge.publish(f"{b}/agents/n1/status", b"ok") in OK_CODES
        as_bridge.close()
        for t in (f"{b}/agents/n1/status", f"{b}/agents/n1/state", f"{b}/agents/n1/site_manager"):  # no leftovers
            n1.publish(t, b"", retain=True)
        admin.publish(keep[2], b"", retain=True)
    finally:
        for c in (at_centre, at_site, n1, admin, other_admin, collector):
            c.close()


def steer(correlation: bytes) -> Properties:
    props = Properties(PacketTypes.PUBLISH)
    props.CorrelationData = correlation
    props.MessageExpiryInterval = 600
    return props


def fill(spool: Spool, start: int, n: int) -> List[str]:
    ids = [f"n1-{i}" for i in range(start, start + n)]
    for rid in ids:
        spool.append("records", {"record_id": rid, "fare": 7.5, "pad": "x" * 40})
    spool.rotate_all()
    return ids


def test_an_uplink_cut_queues_both_ways_and_every_record_lands_once(world: World, tmp_path: Path) -> None:
    """A 10 s cut of the uplink while the site ships spill and the centre steers the site."""
    b = f"fog/{C}"
    landing = tmp_path / "landing"
    col = Collector(C, str(landing), host="127.0.0.1", port=world.centre.port, client_id=COLLECTOR,
                    tls=world.tls(COLLECTOR)).start()
    # Chunks as they reach the centre (a persistent QoS 1 session, like the collector's).
    counter = spy(world.centre, f"{b}/spill/+/chunk", client_id="chunk-counter", clean_start=False, session_expiry=600)
    link = spy(world.site, f"$SYS/broker/connection/{BRIDGE}/state")
    rpc_at_site = spy(world.site, f"{b}/agents/+/rpc/#")
    spool = Spool(tmp_path / "spool", "n1", rotate_bytes=6000, sync_bytes=2000)
    sent: List[Tuple[float, Outgoing]] = []

    def record(out: Outgoing) -> Outgoing:
        sent.append((time.monotonic(), out))
        return out

    shipper = MqttShipper(spool, C, host="127.0.0.1", port=world.site.port, chunk_bytes=2000, ack_timeout=1.0,
                          max_backoff=4.0, window=4, tamper=record, tls=world.tls("n1")).start()
    admin = RpcClient("127.0.0.1", world.centre.port, C, client_id=f"admin-{uuid.uuid4().hex[:6]}",
                      ca_file=str(world.certs / "fog-ca.crt"), cert_file=str(world.certs / f"{ADMIN}.crt"),
                      key_file=str(world.certs / f"{ADMIN}.key"))
    admin.connect()
    try:
        assert wait_until(col.connected.is_set, 10)
        ids = fill(spool, 0, 300)
        assert shipper.wait_idle(20), "the first batch did not land before the cut"

        world.cut()
        t_cut = time.monotonic()
        assert wait_until(lambda: link.got(f"$SYS/broker/connection/{BRIDGE}/state", b"0"), 15), "the bridge never saw the link down"
        t_down = time.monotonic()
        # While the link is down the site keeps spilling: 4 batches, one every 1.5 s.
        for k in range(4):
            ids += fill(spool, 300 + 200 * k, 200)
            time.sleep(1.5)
        # Steering from the centre meanwhile: the centre keeps no session for the bridge (Mosquitto
        # 2.0's MQTT 5 bridge sends no Session Expiry Interval), so nothing is queued for the
        # site: fogctl's request times out with a message that says it will not be applied later,
        # and even a request with a long expiry is dropped, never delivered when the link returns.
        with pytest.raises(RequestTimeout, match="not be applied later"):
            admin.rpc("n1", {"op": "ping"}, timeout=2.0)
        admin.publish(topics.agent_rpc(C, "n1", ADMIN), b'{"op": "ping"}', qos=1, properties=steer(b"during-cut"))
        time.sleep(max(0.0, 10.0 - (time.monotonic() - t_cut)))
        queued = [o for t, o in sent if t >= t_down]
        world.heal()
        t_heal = time.monotonic()
        assert wait_until(lambda: link.received[-1][1] == b"1", 30), "the bridge did not come back"
        t_up = time.monotonic()
        assert shipper.wait_idle(60), "the spill queued during the cut did not land"
        t_drained = time.monotonic()

        # Every chunk the shipper published reached the centre; count duplicates by chunk id.
        def chunk_ids() -> collections.Counter:
            with counter.lock:
                got = [decode_chunk(p)[0] for _, p, _, _ in counter.received]
            return collections.Counter((h.file_id, h.index) for h in got)
        published = {(o.file_id, o.index) for _, o in sent}
        assert wait_until(lambda: published <= set(chunk_ids()), 20), "a chunk published at the site never reached the centre"
        arrived = chunk_ids()
        # Every record landed exactly once, whatever arrived twice.
        landed: collections.Counter = collections.Counter()
        for f in landing.glob("kind=*/date=*/node=*/*.jsonl.gz"):
            landed.update(r["record_id"] for r in read_records(f.read_bytes()))
        assert set(landed) == set(ids) and max(landed.values()) == 1
        # The steering: what was sent during the cut never reaches the site; after it, once.
        admin.publish(topics.agent_rpc(C, "n1", ADMIN), b'{"op": "ping"}', qos=1, properties=steer(b"after"))

        def corrs() -> collections.Counter:
            with rpc_at_site.lock:
                return collections.Counter(bytes(getattr(pr, "CorrelationData", b"")) for t, _, _, pr
                                           in rpc_at_site.received if t == topics.agent_rpc(C, "n1", ADMIN))
        assert wait_until(lambda: corrs()[b"after"] >= 1, 10)
        time.sleep(0.5)
        assert corrs() == collections.Counter({b"after": 1}), corrs()
        figures = {
            "cut_s": round(t_heal - t_cut, 1), "link_down_seen_after_s": round(t_down - t_cut, 1),
            "chunks_published_while_down": len(queued), "bytes_published_while_down": sum(len(o.payload) for o in queued),
            "files_spooled_while_down": len({o.file_id for o in queued}),
            "link_up_after_heal_s": round(t_up - t_heal, 2), "drained_after_heal_s": round(t_drained - t_heal, 2),
            "chunks_published": sum(1 for _ in sent), "distinct_chunks": len(published),
            "chunks_arrived": sum(arrived.values()), "duplicate_chunks_arrived": sum(arrived.values()) - len(arrived),
            "shipper": dict(shipper.core.stats), "collector": dict(col.core.stats),
            "records": len(ids), "records_landed": sum(landed.values()),
        }
        print("uplink-cut figures:", json.dumps(figures, sort_keys=True))
        assert col.core.stats["files_landed"] == len({o.file_id for _, o in sent})
    finally:
        shipper.stop()
        col.stop()
        admin.close()
        for c in (counter, link, rpc_at_site):
            c.close()


def test_fogctl_talks_to_a_site_broker_named_in_its_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    from agent.cli import fogctl
    from agent.fogctl.client import BrokerUnreachable
    from agent.fogctl.config import for_site, load_config
    from agent.schema import ConfigError

    conf = tmp_path / "fogctl.toml"
    conf.write_text('broker = "central.lan:8883"\ncluster = "geo"\ncafile = "/ca.crt"\n'
                    '[sites]\nnorth = "10.43.0.10:8883"\n')
    cfg = load_config(path=conf, env={})
    north = for_site(cfg, "north")
    assert (north.broker, north.cluster, north.cafile) == ("10.43.0.10:8883", "geo", "/ca.crt")
    with pytest.raises(ConfigError, match="known: north"):
        for_site(cfg, "south")
    bad = tmp_path / "bad.toml"
    for value in ('"10.43.0.10:99999"', "8883"):
        bad.write_text(f"[sites]\nnorth = {value}\n")
        with pytest.raises(ConfigError, match=r"bad.toml: sites: site north: expected \"host:port\""):
            load_config(path=bad, env={})
    bad.write_text('[sites]\n"a/b" = "h:1"\n')
    with pytest.raises(ConfigError, match="site 'a/b': expected a name"):
        load_config(path=bad, env={})

    for var in ("FOGCTL_CONFIG", "FOGCTL_BROKER"):
        monkeypatch.delenv(var, raising=False)
    asked: List[str] = []

    def connect(c: Any) -> Any:
        asked.append(c.broker)
        raise BrokerUnreachable(c.broker, "test")
    assert fogctl.main(["--config", str(conf), "--site", "north", "status"], connect=connect) == 3
    assert fogctl.main(["--config", str(conf), "status"], connect=connect) == 3
    assert asked == ["10.43.0.10:8883", "central.lan:8883"]
    assert fogctl.main(["--config", str(conf), "--site", "south", "status"], connect=connect) != 0
    assert fogctl.main(["--config", str(conf), "--site", "north", "--broker", "x:1", "status"], connect=connect) != 0
    err = capsys.readouterr().err
    assert "no site 'south'" in err and "not both" in err and len(asked) == 2


# ---- fogctl at the centre: the fleet-wide view -------------------------------------------------


def node_state(node: str, ts: float) -> bytes:
    return json.dumps({"v": 1, "node": node, "ts": ts, "cpu": 12.5, "memory": 40.0, "temperature": None,
                       "slots": 4, "free_slots": 4, "capacity": 500.0, "instances": []}).encode()


def shows_the_site(doc: Dict[str, Any]) -> bool:
    """What `fogctl status --json` at the centre must show of site north: both nodes, online, with
    their machine figures, each in site north as its bridge proved it, and n1 as its site manager."""
    nodes = {d["node"]: d for d in doc.get("nodes", [])}
    north = [s for s in doc.get("sites", []) if s["site"] == SITE]
    return (set(NODES) <= set(nodes)
            and all(nodes[n]["status"] == "online" and nodes[n]["cpu"] == 12.5 for n in NODES)
            and all(nodes[n].get("site") == SITE and nodes[n].get("site_from") == "bridge" for n in NODES)
            and len(north) == 1 and north[0]["nodes"] == NODES and north[0]["site_manager"] == "n1")


def test_fogctl_at_the_centre_shows_every_sites_nodes_with_their_site(
        world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """`fogctl status` against the central broker, as an administrator of the centre (its ACL as
    the role renders it): the nodes of site north, published on the site broker only, appear with
    their site, which fogctl reads from the claim records the site's bridge renames at the centre."""
    import threading

    from agent import events as ev_mod
    from agent.cli import fogctl
    from agent.control.fleet import Fleet
    from jsonschema import Draft202012Validator

    from agent.fogctl import fleet_sites, schemas
    from agent.fogctl.commands import fleet_filters, site_record

    b = f"fog/{C}"
    for var in ("FOGCTL_CONFIG", "FOGCTL_BROKER", "FOGCTL_CLUSTER"):
        monkeypatch.delenv(var, raising=False)
    conf = tmp_path / "fogctl.toml"
    conf.write_text(f'broker = "127.0.0.1:{world.centre.port}"\ncluster = "{C}"\ntimeout = 10.0\n'
                    f'cafile = "{world.certs}/fog-ca.crt"\ncert = "{world.certs}/{ADMIN}.crt"\n'
                    f'key = "{world.certs}/{ADMIN}.key"\n'
                    f'[sites]\n{SITE} = "127.0.0.1:{world.site.port}"\nsouth = "10.0.0.9:8883"\n')
    nodes = {n: client(world.site, n) for n in NODES}
    at_centre = spy(world.centre, f"{b}/#")
    now = time.time()
    try:
        # What each agent writes on its site broker: status, state, and its record on its claim
        # topic (n1 leads the site manager, n2 states that it follows n1).
        records = {"n1": json.dumps({"v": 1, "node": "n1", "until": now + 60, "state": {"target": 2}}).encode(),
                   "n2": json.dumps({"v": 1, "node": "n2", "until": 0, "follows": "n1"}).encode()}
        for n, c in nodes.items():
            for t, p in ((topics.agent_status(C, n), b"online"), (topics.agent_state(C, n), node_state(n, now)),
                         (topics.site_manager(C, n), records[n])):
                assert c.publish(t, p, retain=True) in OK_CODES, t
        renamed = {topics.site_manager_of(C, SITE, n) for n in NODES}
        assert at_centre.wait_for(lambda r: renamed <= {t for t, _, _, _ in r}, 10)

        assert fogctl.main(["--config", str(conf), "status", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert shows_the_site(doc), doc
        Draft202012Validator(schemas.schema("status")).validate(doc)  # the documented shape, sites included
        south = [s for s in doc["sites"] if s["site"] == "south"]
        assert south == [{"site": "south", "nodes": [], "online": 0, "site_manager": None, "newest_state_s": None,
                          "stale": False, "in_settings": True}]
        assert "latency rows" in doc["stay_in_sites"] and "decision histories" in doc["stay_in_sites"]
        assert fogctl.main(["--config", str(conf), "status"]) == 0
        text = capsys.readouterr().out
        assert f"site {SITE}: 2 nodes (2 online), site manager n1" in text, text
        assert "site south: no node seen at the centre" in text and "stay in the sites" in text
        # fogctl site: each bridged site's manager, from its renamed records (none at the centre itself).
        assert fogctl.main(["--config", str(conf), "site", "--json"]) == 0
        site_doc = json.loads(capsys.readouterr().out)
        assert site_doc["leader"] is None and site_doc["sites"][SITE]["leader"] == "n1", site_doc
        assert site_doc["sites"][SITE]["target"] == 2
        Draft202012Validator(schemas.schema("site")).validate(site_doc)
        assert fogctl.main(["--config", str(conf), "site"]) == 0
        assert f"site {SITE} (from the records its bridge renames at the centre)\nleader    n1 (lease" in \
            capsys.readouterr().out

        # fogctl why at the centre: the decision histories and re-homed records stay in the site,
        # so it has nothing but the states and says so; it does not fail.
        assert fogctl.main(["--config", str(conf), "why", "op-1", "--json"]) == 0
        why = json.loads(capsys.readouterr().out)
        assert why["decisions"] == [] and why["rehomed"] is None and why["pinned"] is None

        # On the site broker, as a node's identity (fogctl --agent-config on a node), which may not
        # read sites/+/...: the plain view, no site known, nothing refused.
        assert fogctl.main(["--broker", f"127.0.0.1:{world.site.port}", "--cluster", C, "--cafile",
                            str(world.certs / "fog-ca.crt"), "--cert", str(world.certs / "n1.crt"),
                            "--key", str(world.certs / "n1.key"), "status", "--json"]) == 0
        at_site = json.loads(capsys.readouterr().out)
        assert {d["node"] for d in at_site["nodes"]} >= set(NODES) and "sites" not in at_site
        assert not shows_the_site(at_site)

        # The assertion tells a right program from a wrong one: the same view from what the
        # centre holds under the sites' local names only (no renamed claim records) does not
        # know the nodes' site, nor does the view the site broker holds.
        with at_centre.lock:
            centre = {t: p for t, p, ret, _ in at_centre.received if ret or t.endswith(("status", "state", "site_manager"))}
        local_only = {t: p for t, p in centre.items() if not t.startswith(f"{b}/sites/")}
        fleet = Fleet.from_messages(C, {t: p for t, p in centre.items() if topics.parse(C, t).kind in ("state", "status")})
        assert set(NODES) <= {n.node for n in fleet.nodes}
        wrong, _ = fleet_sites.status(fleet, fleet_sites.membership(local_only, C), [], now, site_record)
        assert not shows_the_site(wrong)
        right, _ = fleet_sites.status(fleet, fleet_sites.membership(centre, C), [], now, site_record)
        assert shows_the_site(right)
        # A site that went quiet (its uplink cut: the centre keeps the last records, "online"
        # included) is flagged by the age of its newest state.
        later, later_text = fleet_sites.status(fleet, fleet_sites.membership(centre, C), [], now + 60, site_record)
        assert [s["stale"] for s in later["sites"]] == [True] and "its uplink may be down" in later_text
        assert fleet_filters(C) == [f"{b}/agents/+/state", f"{b}/agents/+/status", f"{b}/pipelines/+"]

        # `fogctl watch` at the centre: a site's events cross on the one events topic.
        event = ev_mod.decision(ts=now, node="n2", instance="op-1", operator="op", load=90.0, capacity=50.0,
                                probability=0.8, draw=0.1, action="duplicate", count=1, type="scale_out")
        got: Dict[str, Any] = {}
        watcher = threading.Thread(target=lambda: got.update(rc=fogctl.main(
            ["--config", str(conf), "--json", "watch", "--count", "1", "--duration", "20"])))
        watcher.start()
        deadline = time.monotonic() + 20
        while watcher.is_alive() and time.monotonic() < deadline:  # until the watch has subscribed and seen one
            nodes["n2"].publish(topics.events(C), event.to_json().encode())
            watcher.join(0.5)
        watcher.join(5)
        assert got.get("rc") == 0
        seen = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
        assert seen and seen[0]["node"] == "n2" and seen[0]["type"] == "scale_out"
    finally:
        for n, c in nodes.items():
            for t in (topics.agent_status(C, n), topics.agent_state(C, n), topics.site_manager(C, n)):
                c.publish(t, b"", retain=True)
            c.close()
        at_centre.close()


def test_a_real_agent_of_the_site_appears_at_the_centre_in_its_site(world: World, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture) -> None:
    """A real agent (`fog-agent run`, no site manager configured) on the site broker: its record on
    its claim topic, which every agent writes once connected, crosses renamed, so fogctl at the
    centre names its site; stopped, it shows offline there (its status crossed too)."""
    import types

    from agent.cli import fogctl
    from agent_process import ONLINE_BOUND, AgentProcess
    from tls_site import agent_toml

    for var in ("FOGCTL_CONFIG", "FOGCTL_BROKER", "FOGCTL_CLUSTER"):
        monkeypatch.delenv(var, raising=False)
    where = types.SimpleNamespace(tmp=tmp_path, cluster=C, port=world.site.port, certs=world.certs)
    agent = AgentProcess(agent_toml(where, "n2", "n2"), log_path=tmp_path / "n2.log")  # type: ignore[arg-type]
    argv = ["--broker", f"127.0.0.1:{world.centre.port}", "--cluster", C, "--timeout", "10",
            "--cafile", str(world.certs / "fog-ca.crt"), "--cert", str(world.certs / f"{ADMIN}.crt"),
            "--key", str(world.certs / f"{ADMIN}.key"), "status", "--json"]

    def n2_at_centre() -> Dict[str, Any]:
        assert fogctl.main(argv) == 0
        doc = json.loads(capsys.readouterr().out)
        return next((d for d in doc["nodes"] if d["node"] == "n2"), {})
    try:
        assert wait_until(lambda: n2_at_centre().get("status") == "online" and n2_at_centre().get("site") == SITE
                          or not agent.alive(), ONLINE_BOUND), agent.text()[-2000:]
        got = n2_at_centre()
        assert got["site"] == SITE and got["site_from"] == "bridge" and got["slots"] == 3, got
        assert agent.stop() == 0
        assert wait_until(lambda: n2_at_centre().get("status") == "offline", 20)
        assert n2_at_centre()["site"] == SITE
    finally:
        if agent.alive():
            agent.stop()
        n2 = client(world.site, "n2")
        for t in (topics.agent_status(C, "n2"), topics.agent_state(C, "n2"), topics.site_manager(C, "n2")):
            n2.publish(t, b"", retain=True)
        n2.close()
