"""The container testbed as sites: S sites of N nodes, each with its own broker bridged to a central
node (docs/operations.md, "Sites on the testbed").

Layout: every site node is on the testbed's bridge (`fogtb0`, 10.213.0.0/24) and talks only to its
site broker (the site's first node); the central node (`fogc`) is on a bridge of its own, the
uplink bridge (`fogtbu0`, 10.213.1.0/24), and runs the central broker (TLS, client certificates)
and the collector (`fog_central`). Each site broker reaches the centre through a second link of its
own on the uplink bridge (`vu-<broker>` on the host, `uplink0` inside), so `testbed partition
<broker> --uplink` cuts exactly the link between that site and the centre: the site's nodes still
reach their broker, the other site keeps its uplink. Site nodes have no route to the centre at all
(no gateway): what reaches the centre crosses the bridge of their broker, as on a real site.

Everything is installed by `ansible/site.yml` with the inventory `sites_inventory_yaml` writes (a
pure function of the plan, tested without root): the mosquitto role renders each site broker's
uplink (`mosquitto_site_uplink`, TLS with the site's bridge identity) and the centre's ACL
(`mosquitto_site_bridges`); fog_central installs the collector from the same .deb (no JRE and no
PySpark: the root has neither and the containers have no mirror, so the batch job is not run).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from foglab.tools import testbed
from foglab.tools.testbed import Node, Plan, TestbedError, _q

UPLINK_BRIDGE = "fogtbu0"
UPLINK_SUBNET = "10.213.1"  # the centre is .10, site broker of node i is .(10 + i), the host .1
CENTRAL = "fogc"
CENTRAL_PORT = 8883
ADMIN = "fogctl-admin"
COLLECTOR = "collector"
MAX_SITES = 9
LAYOUT_FILE = "sites.json"


@dataclass(frozen=True)
class Site:
    """One site: its nodes (the first runs the site broker) and its bridge identity at the centre
    (the CN of the bridge's certificate, the user the centre's ACL names)."""

    name: str
    nodes: Tuple[str, ...]

    @property
    def broker(self) -> str:
        return self.nodes[0]

    @property
    def identity(self) -> str:
        return f"bridge-{self.name}"


@dataclass(frozen=True)
class Layout:
    sites: Tuple[Site, ...]
    central: str = CENTRAL

    def site_of(self, node: str) -> Site:
        for s in self.sites:
            if node in s.nodes:
                return s
        raise TestbedError(f"{node} is in no site (sites: {', '.join(s.name for s in self.sites)})")

    def to_json(self) -> str:
        return json.dumps({"central": self.central, "sites": [{"name": s.name, "nodes": list(s.nodes)}
                                                              for s in self.sites]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Layout":
        data = json.loads(text)
        return cls(sites=tuple(Site(str(s["name"]), tuple(s["nodes"])) for s in data["sites"]),
                   central=str(data["central"]))


def make_sites_plan(sites: int, nodes: int, arch: str = "amd64") -> Tuple[Plan, Layout]:
    """`sites` sites of `nodes` nodes and one central node. Site k's nodes are fog<i> for
    i = (k-1)*nodes+1 .. k*nodes at 10.213.0.(10+i) on the testbed's bridge; the site broker (the
    site's first node) also gets 10.213.1.(10+i) on the uplink bridge; the central node is `fogc`
    at 10.213.1.10 on the uplink bridge only."""
    if not 1 <= sites <= MAX_SITES:
        raise TestbedError(f"--sites {sites}: expected 1 to {MAX_SITES}")
    if not 1 <= nodes or sites * nodes > testbed.MAX_NODES:
        raise TestbedError(f"--nodes {nodes} per site: expected 1 to {testbed.MAX_NODES // sites} with {sites} sites")
    base = testbed.make_plan(sites * nodes, arch)
    plan_nodes: List[Node] = []
    layout: List[Site] = []
    for k in range(sites):
        members = base.nodes[k * nodes:(k + 1) * nodes]
        for j, n in enumerate(members):
            uplink = f"{UPLINK_SUBNET}.{n.address.rsplit('.', 1)[1]}" if j == 0 else None
            plan_nodes.append(Node(n.name, n.address, arch, None, uplink))
        layout.append(Site(f"site{k + 1}", tuple(n.name for n in members)))
    plan_nodes.append(Node(CENTRAL, f"{UPLINK_SUBNET}.10", arch, UPLINK_BRIDGE, None))
    plan = Plan(nodes=tuple(plan_nodes), arch=arch, uplink_bridge=UPLINK_BRIDGE,
                uplink_host_address=f"{UPLINK_SUBNET}.1")
    return plan, Layout(tuple(layout))


@dataclass(frozen=True)
class Pki:
    """Files on the control node (the host): the fleet's CA, the central broker's server
    certificate, the collector's and each site bridge's client certificate (CN = identity)."""

    ca: str
    server_cert: str
    server_key: str
    collector_cert: str
    collector_key: str
    bridges: Dict[str, Tuple[str, str]]  # site -> (cert, key)


def _node(plan: Plan, name: str) -> Node:
    return next(n for n in plan.nodes if n.name == name)


def sites_inventory_yaml(layout: Layout, pki: Pki, plan: Plan, key: Path, known_hosts: Path,
                         passwords: Dict[str, str], deb: Optional[Path]) -> str:
    """The inventory of a sites testbed for `ansible-playbook -i <this> ansible/site.yml`.

    Groups: `brokers` (each site broker and the centre), `central` (the centre: central broker and
    collector), `fog_nodes` (every site node), and one group per site whose vars point the site's
    agents at their broker and give that broker its users, its node identities and its uplink.
    Site brokers keep the testbed's password listener on the site bridge; the central broker has
    only the TLS listener (bridges and the collector by certificate). Spill is on: the sinks'
    records travel node -> site broker -> bridge -> central broker -> collector."""
    central = _node(plan, layout.central)
    out = [
        *testbed.inventory_head("`fog-agent testbed up --sites`", key, known_hosts),
        "    mosquitto_cluster: testbed",
        "    mosquitto_install_packages: false",
        f"    mosquitto_admin_identities: [{ADMIN}]",
        "    fog_agent_cluster: testbed",
        "    fog_agent_install_method: deb",
        "    fog_agent_install_packages: false",
        "    fog_agent_mqtt_port: 1883",
        "    fog_agent_mqtt_tls: false",
        "    fog_agent_spill_enabled: true",
        "    fog_netem_enabled: false",
    ]
    if deb is not None:
        out.append(f"    fog_agent_deb_src: {_q(str(deb))}")
    out += ["  children:", "    brokers:", "      hosts:"]
    out += [f"        {s.broker}:" for s in layout.sites] + [f"        {central.name}:"]
    out += [
        "    central:",
        "      hosts:",
        f"        {central.name}:",
        f"          ansible_host: {_q(central.address)}",
        "      vars:",
        "        mosquitto_tls_enabled: true",
        "        mosquitto_listener_enabled: false",
        f"        mosquitto_tls_port: {CENTRAL_PORT}",
        f"        mosquitto_tls_ca_src: {_q(pki.ca)}",
        f"        mosquitto_tls_cert_src: {_q(pki.server_cert)}",
        f"        mosquitto_tls_key_src: {_q(pki.server_key)}",
        "        mosquitto_users: []",
        "        mosquitto_node_identities: []",
        f"        mosquitto_collector_identities: [{COLLECTOR}]",
        "        mosquitto_site_bridges:",
    ]
    for s in layout.sites:
        out.append(f"          - {{site: {s.name}, identity: {s.identity}, nodes: [{', '.join(s.nodes)}], "
                   f"admins: [{ADMIN}]}}")
    out += [
        "        fog_central_cluster: testbed",
        "        fog_central_install_packages: false",
        "        fog_central_install_pyspark: false",
        "        fog_central_mqtt_host: 127.0.0.1",
        f"        fog_central_mqtt_port: {CENTRAL_PORT}",
        "        fog_central_mqtt_tls: true",
        f"        fog_central_mqtt_tls_ca_src: {_q(pki.ca)}",
        f"        fog_central_mqtt_tls_cert_src: {_q(pki.collector_cert)}",
        f"        fog_central_mqtt_tls_key_src: {_q(pki.collector_key)}",
        "    fog_nodes:",
        "      hosts:",
    ]
    for s in layout.sites:
        for name in s.nodes:
            out += [f"        {name}:", f"          ansible_host: {_q(_node(plan, name).address)}",
                    f"          fog_agent_mqtt_password: {_q(passwords[name])}"]
    for s in layout.sites:
        broker = _node(plan, s.broker)
        cert, keyfile = pki.bridges[s.name]
        out += [f"    {s.name}:", "      hosts:"] + [f"        {name}:" for name in s.nodes]
        out += [
            "      vars:",
            f"        fog_broker_host: {_q(broker.address)}",
            f"        fog_agent_mqtt_host: {_q(broker.address)}",
            "        mosquitto_tls_enabled: false",
            "        mosquitto_listener_enabled: true",
            f"        mosquitto_listener_address: {_q(broker.address)}",
            "        mosquitto_listener_port: 1883",
            f"        mosquitto_node_identities: [{', '.join(s.nodes)}]",
            "        mosquitto_users:",
        ]
        for name in [*s.nodes, ADMIN]:
            out += [f"          - name: {_q(name)}", f"            password: {_q(passwords[name])}"]
        out += [
            "        mosquitto_site_uplink:",
            f"          site: {s.name}",
            f"          host: {_q(central.address)}",
            f"          port: {CENTRAL_PORT}",
            f"          identity: {s.identity}",
            f"          admins: [{ADMIN}]",
            f"          ca_src: {_q(pki.ca)}",
            f"          cert_src: {_q(cert)}",
            f"          key_src: {_q(keyfile)}",
        ]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# The host side: certificates, boot.

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str) -> None:
    testbed._run(["openssl", *args], f"openssl {args[0]}")


def _cert(d: Path, cn: str, san: Optional[str] = None) -> Tuple[str, str]:
    crt, key, csr = d / f"{cn}.crt", d / f"{cn}.key", d / f"{cn}.csr"
    _openssl("req", *_EC, "-subj", f"/CN={cn}", "-keyout", str(key), "-out", str(csr))
    args = ["x509", "-req", "-in", str(csr), "-CA", str(d / "ca.crt"), "-CAkey", str(d / "ca.key"),
            "-CAcreateserial", "-days", "30", "-out", str(crt)]
    if san:
        (d / f"{cn}.ext").write_text(f"subjectAltName={san}\n")
        args += ["-extfile", str(d / f"{cn}.ext")]
    _openssl(*args)
    os.chmod(key, 0o600)
    csr.unlink()
    return str(crt), str(key)


def make_pki(d: Path, layout: Layout, central_address: str) -> Pki:
    """A CA of this testbed (in its run directory, removed by `down`) and the certificates the
    inventory names. The server certificate names the centre's uplink address (the bridges check
    it) and 127.0.0.1 (the collector on the central node)."""
    if shutil.which("openssl") is None:
        raise TestbedError("missing openssl: apt-get install openssl")
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", *_EC, "-days", "30", "-subj", "/CN=fog-testbed-ca", "-keyout", str(d / "ca.key"),
             "-out", str(d / "ca.crt"))
    os.chmod(d / "ca.key", 0o600)
    server = _cert(d, layout.central, f"DNS:{layout.central},IP:{central_address},IP:127.0.0.1")
    collector = _cert(d, COLLECTOR)
    bridges = {s.name: _cert(d, s.identity) for s in layout.sites}
    return Pki(str(d / "ca.crt"), server[0], server[1], collector[0], collector[1], bridges)


def _writer(layout: Layout, plan: Plan, key: Path, known_hosts: Path, passwords: Dict[str, str],
            deb: Optional[Path]) -> str:
    central = _node(plan, layout.central)
    pki = make_pki(key.parent / "pki", layout, central.address)
    (key.parent / LAYOUT_FILE).write_text(layout.to_json())
    return sites_inventory_yaml(layout, pki, plan, key, known_hosts, passwords, deb)


def up_sites(sites: int, nodes: int, deb: Optional[Path] = None, arch: str = "amd64",
             progress: testbed.Progress = testbed._stderr_progress) -> Tuple[testbed.UpResult, Layout]:
    """Boot the sites testbed and write its inventory (and its layout, `sites.json`)."""
    plan, layout = make_sites_plan(sites, nodes, arch)
    result = testbed.up(len(plan.nodes), arch, deb=deb, progress=progress, plan=plan,
                        inventory_writer=partial(_writer, layout))
    return result, layout


def load_layout(run: Optional[Path] = None) -> Layout:
    path = (run or testbed.run_dir(testbed.cache_dir())) / LAYOUT_FILE
    if not path.exists():
        raise TestbedError("the testbed that is up has no sites: run `fog-agent testbed up --sites S --nodes N`")
    return Layout.from_json(path.read_text())


__all__ = ["Layout", "Pki", "Site", "load_layout", "make_pki", "make_sites_plan", "sites_inventory_yaml",
           "up_sites"]
