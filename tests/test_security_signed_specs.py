"""Signed pipeline specs against a stolen node key (issue #35; docs/security.md, "Signed pipeline
specs"): the role's TLS broker (tests/tls_site.py), one real agent n1 that requires an admin's
signature (`[security] admin_keys`) and re-homes dead nodes' instances, and n3, a listed node
identity without an agent (its key stolen).

n3 lists instances in its own retained hosted record and then says it is offline: n1 re-homes
what the record lists, taking each spec from it. The retained record of the pipeline is gone (a
broker that lost its retained store), so nothing but the spec itself says what the admin deployed.
Before signatures, n1 ran whatever n3's record carried: a pipeline of n3's making, an admin's
pipeline with its text altered, an older deploy of it. Now each is refused (logged, counted), and
an instance of the current signed deploy listed in the same record is re-homed (the path works).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

from agent import signing
from agent.config import load_pipeline_text
from agent.control import records
from agent.instance.spec import request_spec
from agent.mqtt.settings import BrokerSpec
from agent.node.deploy import keeper_specs
from agent_process import ONLINE_BOUND
from pipelines import taxi_in_zone
from tls_site import OK_CODES, AgentProc, Client, Site, agent_toml, have_tools, running_site, wait_until

pytestmark = pytest.mark.broker

CLUSTER = "sig"
ADMIN = "admin"


def T(rest: str) -> str:
    return f"fog/{CLUSTER}/{rest}"


@dataclasses.dataclass
class Fleet:
    site: Site
    n1: AgentProc
    admin: Client
    signer: signing.Signer
    current: Dict[str, Dict[str, Any]]  # operator -> hosted-record spec of the current signed deploy
    older: Dict[str, Dict[str, Any]]  # the same, of an older signed deploy (another rate)

    def instances(self) -> List[str]:
        with self.admin.lock:
            got = [p for t, p, _, _ in self.admin.received if t == T("agents/n1/state")]
        try:
            doc = json.loads(got[-1]) if got else {}
        except ValueError:
            return []
        return [str(i.get("id")) for i in doc.get("instances", []) if isinstance(i, dict)]


def _signed_specs(signer: signing.Signer, text: str, generation: str, issued_at: int) -> Dict[str, Dict[str, Any]]:
    """The keepers' specs as a deploy signed by `signer` hands them out (agent.node.deploy.run_deploy)."""
    cfg = load_pipeline_text(text)
    sig = signer.sign(cfg.pipeline.name, generation, text, issued_at=issued_at)
    extra = {records.GENERATION_KEY: generation, signing.SIGNATURE_KEY: sig.to_extra()}
    out = {}
    for s in keeper_specs(cfg, text, CLUSTER, BrokerSpec("127.0.0.1", 1883), extra):
        d = request_spec(dataclasses.replace(s, node="n3"))
        out[s.operator] = d
    return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if not have_tools():
        pytest.skip("openssl or mosquitto missing")
    tmp = tmp_path_factory.mktemp("sig")
    signing.generate_keypair(tmp / "admin.key", tmp / "admin.pub")
    signer = signing.load_signer(tmp / "admin.key")
    with running_site(tmp, CLUSTER, ("n1", "n3"), [ADMIN]) as site:
        conf = agent_toml(site, "n1", "n1", extra=f'[security]\nadmin_keys = ["{tmp / "admin.pub"}"]\n')
        conf.write_text(conf.read_text().replace("state_period = 0.5\n", "state_period = 0.5\ndead_after = 1.0\n"))
        n1 = AgentProc(site, "n1", conf=conf)
        admin = Client(site, ADMIN)
        try:
            assert admin.connect() == "connected"
            assert admin.subscribe(T("agents/+/status")) == [1] and admin.subscribe(T("agents/n1/state")) == [1]
            assert wait_until(lambda: admin.got(T("agents/n1/status"), b"online") or not n1.alive(), ONLINE_BOUND), \
                n1.text()[-3000:]
            now = int(time.time() * 1000)
            older = _signed_specs(signer, taxi_in_zone("sig", rate=50.0), "a-older", now - 600_000)
            text = taxi_in_zone("sig", rate=20.0)
            gen = "b-current"
            current = _signed_specs(signer, text, gen, now)
            # The admin's current deploy reaches n1 (its retained record), then the broker loses
            # the record: only n1's memory of the newest signed deploy is left.
            record = records.stamp(text, gen, signer.sign("sig", gen, text, issued_at=now)).encode()
            assert admin.publish(T("pipelines/sig"), record, retain=True) in OK_CODES
            time.sleep(1.0)
            assert admin.publish(T("pipelines/sig"), b"", retain=True) in OK_CODES
            time.sleep(0.5)
            assert "pipeline record sig refused" not in n1.text(), n1.text()[-2000:]
            yield Fleet(site, n1, admin, signer, current, older)
        finally:
            admin.close()
            n1.stop()


def _n3_dies_hosting(fleet: Fleet, specs: List[Dict[str, Any]]) -> None:
    """n3 (the stolen key) lists `specs` in its own hosted record, is online, then offline: n1,
    the lowest-named online node, re-homes them after dead_after."""
    n3 = Client(fleet.site, "n3")
    try:
        assert n3.connect() == "connected"
        assert n3.publish(T("agents/n3/hosted"), json.dumps(specs).encode(), retain=True) in OK_CODES
        assert n3.publish(T("agents/n3/status"), b"online", retain=True) in OK_CODES
        time.sleep(1.0)  # n1 reads both before the offline word (one connection, in order)
        assert n3.publish(T("agents/n3/status"), b"offline", retain=True) in OK_CODES
    finally:
        n3.close()


def test_a_spec_forged_or_altered_by_a_node_key_is_never_rehomed(fleet: Fleet) -> None:
    """n3 lists (a) a pipeline of its own making, unsigned: an mqtt_source that would read
    `plant/+/secrets` with n1's identity; (b) the admin's in_zone keeper with its text altered
    (another rate) under the admin's signature; (c) the admin's sink keeper, as signed. Only (c)
    runs on n1; (a) and (b) are refused with one log line each and counted."""
    leak = ('[pipeline]\nname = "leak"\n[[operator]]\nname = "tap"\nkind = "source"\n'
            'function = "agent.operators.taxi:mqtt_source"\nparams = { topic = "plant/+/secrets" }\n'
            '[[operator]]\nname = "out"\nkind = "sink"\nfunction = "agent.operators.builtin:counting_sink"\n')
    forged = {**fleet.current["sink"], "instance": "leak.tap.0", "operator": "tap", "pipeline": "leak",
              "pipeline_toml": leak, "preds": [], "succs": [], "extra": {}}
    altered = dict(fleet.current["in_zone"], pipeline_toml=fleet.current["in_zone"]["pipeline_toml"].replace(
        "rate = 20.0", "rate = 2000.0"))
    assert altered["pipeline_toml"] != fleet.current["in_zone"]["pipeline_toml"]
    _n3_dies_hosting(fleet, [forged, altered, fleet.current["sink"]])
    assert wait_until(lambda: "sig.sink.0" in fleet.instances() or not fleet.n1.alive(), 60), \
        (fleet.instances(), fleet.n1.text()[-3000:])
    time.sleep(1.0)  # a refused one that started after all would show in the next states
    log = fleet.n1.text()
    assert "leak.tap.0" not in fleet.instances() and "sig.in_zone.0" not in fleet.instances(), fleet.instances()
    assert "refused spec of instance leak.tap.0 from the hosted record of n3: not signed by an admin: " \
           "pipeline 'leak' carries no admin signature" in log, log[-3000:]
    assert "refused spec of instance sig.in_zone.0 from the hosted record of n3: not signed by an admin" in log
    assert "does not match the pipeline's text, name and generation (forged or altered)" in log, log[-3000:]
    assert fleet.n1.alive() and "Traceback" not in log, log[-3000:]


def test_an_older_signed_deploy_replayed_by_a_node_key_is_refused(fleet: Fleet) -> None:
    """n3 lists the admin's source keeper of an older signed deploy (validly signed, earlier) and
    an in_zone copy of the current one: n1 has seen the current deploy's record, so the older one
    is a replay and refused even though the broker no longer holds the record; the current one runs."""
    copy = dict(fleet.current["in_zone"], instance="sig.in_zone.7")
    _n3_dies_hosting(fleet, [fleet.older["source"], copy])
    assert wait_until(lambda: "sig.in_zone.7" in fleet.instances() or not fleet.n1.alive(), 60), \
        (fleet.instances(), fleet.n1.text()[-3000:])
    time.sleep(1.0)
    log = fleet.n1.text()
    assert "sig.source.0" not in fleet.instances(), fleet.instances()
    assert "refused spec of instance sig.source.0 from the hosted record of n3: not signed by an admin: " \
           "pipeline 'sig': signed deploy a-older" in log and "(a replay)" in log, log[-3000:]
    assert fleet.n1.alive() and "Traceback" not in log, log[-3000:]


def test_the_record_of_an_older_signed_deploy_is_refused_and_changes_nothing(fleet: Fleet) -> None:
    """The record itself: an older signed record written again (an admin's stale tool, or a
    restored broker backup) is refused, so instances of the current deploy are not judged stale by it."""
    older_text = fleet.older["source"]["pipeline_toml"]
    sig = signing.Signature.from_extra(fleet.older["source"]["extra"][signing.SIGNATURE_KEY])
    record = records.stamp(older_text, "a-older", sig).encode()
    assert fleet.admin.publish(T("pipelines/sig"), record, retain=True) in OK_CODES
    try:
        assert wait_until(lambda: "pipeline record sig refused" in fleet.n1.text(), 10), fleet.n1.text()[-3000:]
        time.sleep(1.0)
        assert "sig.sink.0" in fleet.instances(), fleet.instances()  # not dropped as "another deploy"
    finally:
        fleet.admin.publish(T("pipelines/sig"), b"", retain=True)
