"""The sites testbed's pure parts (lab/foglab/tools/testbed_sites.py, testbed_uplink.py): the plan,
the inventory `site.yml` installs it from, and the uplink-cut verdict. No container: the run itself
is `fog-agent testbed uplink-cut` (minutes; docs/operations.md, "Sites on the testbed")."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Dict

import pytest
import yaml

from foglab.tools import testbed, testbed_sites, testbed_uplink
from foglab.tools.testbed_uplink import SiteLanding

PKI = testbed_sites.Pki("/pki/ca.crt", "/pki/fogc.crt", "/pki/fogc.key", "/pki/collector.crt", "/pki/collector.key",
                        {"site1": ("/pki/b1.crt", "/pki/b1.key"), "site2": ("/pki/b2.crt", "/pki/b2.key")})


def _inventory(tmp_path: Path) -> str:
    plan, layout = testbed_sites.make_sites_plan(2, 3)
    pw = {n.name: f"pw-{n.name}" for n in plan.nodes} | {"fogctl-admin": "pw-admin"}
    return testbed_sites.sites_inventory_yaml(layout, PKI, plan, tmp_path / "key", tmp_path / "known", pw,
                                              tmp_path / "fog-agent_0.2.0_all.deb")


def test_the_plan_puts_each_site_broker_and_only_it_on_the_centres_bridge() -> None:
    plan, layout = testbed_sites.make_sites_plan(2, 3)
    assert [s.nodes for s in layout.sites] == [("fog1", "fog2", "fog3"), ("fog4", "fog5", "fog6")]
    assert [s.broker for s in layout.sites] == ["fog1", "fog4"]
    by = {n.name: n for n in plan.nodes}
    assert by["fogc"].bridge == plan.uplink_bridge == testbed_sites.UPLINK_BRIDGE
    assert by["fogc"].address.startswith(testbed_sites.UPLINK_SUBNET + ".")
    # the brokers have a second link on the uplink bridge; no other site node does
    assert {n for n, node in by.items() if node.uplink_address} == {"fog1", "fog4"}
    assert all(by[n].bridge is None and by[n].address.startswith(testbed.SUBNET + ".") for n in by if n != "fogc")
    assert len({n.address for n in plan.nodes} | {n.uplink_address for n in plan.nodes if n.uplink_address}) == 9
    argv = testbed.nspawn_argv(by["fog1"], Path("/m"), plan.bridge_of(by["fog1"]))
    assert "--network-veth-extra=vu-fog1:uplink0" in argv and f"--network-bridge={testbed.BRIDGE}" in argv
    assert not any(a.startswith("--network-veth-extra") for a in testbed.nspawn_argv(by["fog2"], Path("/m"), "b"))
    assert f"--network-bridge={testbed_sites.UPLINK_BRIDGE}" in testbed.nspawn_argv(by["fogc"], Path("/m"),
                                                                                   plan.bridge_of(by["fogc"]))
    assert testbed_sites.Layout.from_json(layout.to_json()) == layout


@pytest.mark.parametrize("sites,nodes", [(0, 3), (10, 1), (2, 0), (2, 101)])
def test_the_plan_refuses_impossible_sizes(sites: int, nodes: int) -> None:
    with pytest.raises(testbed.TestbedError, match="--sites|--nodes"):
        testbed_sites.make_sites_plan(sites, nodes)


def test_the_inventory_gives_each_site_its_broker_users_and_uplink(tmp_path: Path) -> None:
    inv = yaml.safe_load(_inventory(tmp_path))["all"]
    ch = inv["children"]
    assert set(ch["brokers"]["hosts"]) == {"fog1", "fog4", "fogc"}
    assert set(ch["central"]["hosts"]) == {"fogc"}
    assert set(ch["fog_nodes"]["hosts"]) == {f"fog{i}" for i in range(1, 7)}  # the centre runs no agent
    for site, broker, addr, nodes in (("site1", "fog1", "10.213.0.11", ["fog1", "fog2", "fog3"]),
                                      ("site2", "fog4", "10.213.0.14", ["fog4", "fog5", "fog6"])):
        v = ch[site]["vars"]
        assert list(ch[site]["hosts"]) == nodes
        assert v["fog_agent_mqtt_host"] == v["mosquitto_listener_address"] == addr
        assert v["mosquitto_node_identities"] == nodes
        # only this site's nodes and the administrator get a password on this site broker
        assert {u["name"]: u["password"] for u in v["mosquitto_users"]} == {
            **{n: f"pw-{n}" for n in nodes}, "fogctl-admin": "pw-admin"}
        up = v["mosquitto_site_uplink"]
        assert (up["site"], up["identity"], up["host"], up["port"]) == (site, f"bridge-{site}", "10.213.1.10", 8883)
        assert (up["ca_src"], up["cert_src"], up["key_src"]) == (PKI.ca, *PKI.bridges[site])
    c = ch["central"]["vars"]
    assert c["mosquitto_tls_enabled"] is True and c["mosquitto_listener_enabled"] is False
    assert c["mosquitto_node_identities"] == [] and c["mosquitto_collector_identities"] == ["collector"]
    assert c["mosquitto_site_bridges"] == [
        {"site": "site1", "identity": "bridge-site1", "nodes": ["fog1", "fog2", "fog3"], "admins": ["fogctl-admin"]},
        {"site": "site2", "identity": "bridge-site2", "nodes": ["fog4", "fog5", "fog6"], "admins": ["fogctl-admin"]}]
    assert c["fog_central_mqtt_tls"] is True and c["fog_central_mqtt_tls_cert_src"] == PKI.collector_cert
    assert inv["vars"]["fog_agent_spill_enabled"] is True


@pytest.mark.skipif(shutil.which("ansible-inventory", path=str(Path(sys.executable).parent)) is None,
                    reason="ansible-inventory is not installed beside this Python")
def test_ansible_resolves_the_inventory_per_host(tmp_path: Path) -> None:
    """What each host gets once Ansible merged all, group and host vars: a wrong group layout
    (a site's vars on the other site, the centre's TLS on a site broker) shows here."""
    path = tmp_path / "hosts.yml"
    path.write_text(_inventory(tmp_path))
    proc = subprocess.run([str(Path(sys.executable).parent / "ansible-inventory"), "-i", str(path), "--list"],
                          capture_output=True, text=True, timeout=120, check=True)
    hv: Dict[str, Dict[str, Any]] = json.loads(proc.stdout)["_meta"]["hostvars"]
    assert hv["fog2"]["fog_agent_mqtt_host"] == "10.213.0.11" and hv["fog6"]["fog_agent_mqtt_host"] == "10.213.0.14"
    assert hv["fog1"]["mosquitto_site_uplink"]["identity"] == "bridge-site1"
    assert hv["fog4"]["mosquitto_site_uplink"]["identity"] == "bridge-site2"
    assert hv["fog1"]["mosquitto_tls_enabled"] is False and hv["fogc"]["mosquitto_tls_enabled"] is True
    assert "mosquitto_site_uplink" not in hv["fogc"] and hv["fogc"]["ansible_host"] == "10.213.1.10"
    assert hv["fog5"]["fog_agent_mqtt_password"] == "pw-fog5"


def test_landed_ids_are_counted_per_occurrence_and_per_site() -> None:
    line = json.dumps({"k": ["a"], "r": [["tbsite1.source.0", 0, [1]], ["tbsite1.source.0", 1, [2]]]}).encode()
    rec = json.dumps([{"src": "tbsite2.source.0", "seq": 5, "a": 1}]).encode()
    counts = testbed_uplink.count_ids([line, line, rec, b"not json"])
    assert counts == Counter({("tbsite1.source.0", 0): 2, ("tbsite1.source.0", 1): 2, ("tbsite2.source.0", 5): 1})
    s1 = testbed_uplink.site_landing({"tbsite1.source.0": {0, 1, 2}}, counts)
    assert (s1.expected, s1.landed, s1.lost, s1.duplicated, s1.unexpected) == (3, 2, 1, 2, 0)
    assert s1.lost_sample == (("tbsite1.source.0", 2),)
    s2 = testbed_uplink.site_landing({"tbsite2.source.0": {5}}, counts)  # site1's ids are not site2's
    assert (s2.expected, s2.landed, s2.lost, s2.duplicated, s2.unexpected) == (1, 1, 0, 0, 0)
    s3 = testbed_uplink.site_landing({"tbsite2.source.0": {4}}, counts)
    assert (s3.lost, s3.unexpected) == (1, 1)


def test_backlog_time_and_landings_during_the_cut_come_from_the_ledger() -> None:
    ledger = [{"node": "fog1", "kind": "batches", "records": 100, "landed_at": 1000.0},
              {"node": "fog4", "kind": "batches", "records": 500, "landed_at": 1100.0},  # another site
              {"node": "fog2", "kind": "metrics", "records": 900, "landed_at": 1150.0},  # not records
              {"node": "fog2", "kind": "batches", "records": 300, "landed_at": 1240.0},
              {"node": "fog3", "kind": "records", "records": 50, "landed_at": 1300.0}]
    site1 = ["fog1", "fog2", "fog3"]
    assert testbed_uplink.backlog_landed_after(ledger, site1, 400, healed_at=1200.0) == 40.0
    assert testbed_uplink.backlog_landed_after(ledger, site1, 450, healed_at=1200.0) == 100.0
    assert testbed_uplink.backlog_landed_after(ledger, site1, 451, healed_at=1200.0) is None
    assert testbed_uplink.landed_between(ledger, site1, 1001.0, 1240.0) == 0
    assert testbed_uplink.landed_between(ledger, site1, 1000.0, 1300.0) == 400


def test_a_landed_files_records_are_counted_from_the_file_not_the_ledgers_lines() -> None:
    # the collector's ledger counts lines; a sink's line is a whole batch of records
    ledger = [{"file_id": "f1", "node": "fog1", "kind": "batches", "records": 2, "landed_at": 10.0},
              {"file_id": "f2", "node": "fog4", "kind": "batches", "records": 1, "landed_at": 11.0}]
    ids1 = Counter({("a", i): 1 for i in range(250)})
    ids2 = Counter({("b", 0): 2})
    entries = testbed_uplink.file_entries(ledger, [("f1", ids1), ("f2", ids2)])
    assert [(e["node"], e["records"], e["landed_at"]) for e in entries] == [("fog1", 250, 10.0), ("fog4", 2, 11.0)]
    with pytest.raises(ValueError, match="not in the collector's ledger"):
        testbed_uplink.file_entries(ledger, [("f3", ids2)])


def _checks(**over: Any) -> Dict[str, bool]:
    good = SiteLanding(expected=10, landed=10, lost=0, duplicated=0, unexpected=0)
    args: Dict[str, Any] = dict(landing={"site1": good, "site2": good}, cut_site="site1", processed_during_cut=500,
                                max_in_zone_during_cut=3, landed_from_cut_site_during_cut=0,
                                broker_reached_centre_during_cut=False, nodes_reached_broker_during_cut=True,
                                spool_peak_bytes=10 << 20, spool_cap_bytes=512 << 20, spool_files_left=0)
    args.update(over)
    return {c.name: c.ok for c in testbed_uplink.verdict(**args)}


def test_the_verdict_fails_each_way_a_run_can_go_wrong() -> None:
    assert all(_checks().values())
    bad = SiteLanding(expected=10, landed=10, lost=0, duplicated=1, unexpected=0)
    assert _checks(landing={"site1": SiteLanding(10, 10, 0, 0, 0), "site2": bad}) == {**_checks(), "site2: every record landed once": False}
    assert not _checks(landing={"site1": SiteLanding(10, 9, 1, 0, 0)})["site1: every record landed once"]
    assert not _checks(landing={"site1": SiteLanding(0, 0, 0, 0, 0)})["site1: every record landed once"]
    assert not _checks(landing={"site1": SiteLanding(10, 10, 0, 0, 2)})["site1: every record landed once"]
    assert not _checks(broker_reached_centre_during_cut=True)["site1: uplink really cut"]
    assert not _checks(landed_from_cut_site_during_cut=7)["site1: uplink really cut"]
    assert not _checks(nodes_reached_broker_during_cut=False)["site1: nodes reached their broker"]
    assert not _checks(processed_during_cut=0)["site1: kept processing"]
    assert not _checks(max_in_zone_during_cut=1)["site1: kept scaling"]
    assert not _checks(spool_peak_bytes=512 << 20)["spool bounded"]
    assert not _checks(spool_files_left=3)["spool empty after landing"]


def test_the_table_names_the_cut_site_and_every_check() -> None:
    checks = testbed_uplink.verdict({"site1": SiteLanding(10, 9, 1, 0, 0)}, "site1", 5, 2, 0, False, True, 1, 2, 0)
    summary = {"cut_site": "site1", "cut_seconds": 300.0, "backlog_landed_after_heal_s": 12.5,
               "all_landed_after_heal_s": 80.0, "ok": all(c.ok for c in checks),
               "landing": {"site1": {"expected": 10, "landed": 9, "lost": 1, "duplicated": 0}},
               "sites": {"site1": {"processed_during_cut": 5, "max_in_zone_during_cut": 2, "spool_peak_bytes": 2e6}},
               "checks": [c.__dict__ for c in checks]}
    text = testbed_uplink.table(summary)
    assert "site1 (cut)" in text and "FAIL site1: every record landed once" in text
    assert text.rstrip().endswith("verdict: FAILED")
