"""Signed pipeline specs (agent.signing; docs/security.md, "Signed pipeline specs"), sans-IO: the
statement and its signature, the replay rule, the record's signature line, the MQTT topic
allow-list, and an agent that requires signatures driven without a broker
(tests/recording_client.py). The attacks with a real broker and agent: test_security_signed_specs.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from agent import signing, topics
from agent.config import load_agent_config
from agent.control import records
from agent.node import rpc
from agent.operators import admission
from agent.schema import ConfigError
from recording_client import RecordingClient, message

TEXT = """[pipeline]
name = "lab"
mqtt_topics = ["lab/sensors/+", "lab/out"]
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:mqtt_source"
params = { topic = "lab/sensors/+" }
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:mqtt_sink"
params = { topic = "lab/out" }
"""


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Tuple[Path, signing.Signer, signing.Signer]:
    """An admin key pair (its public file) and a node's own key (not an admin's)."""
    d = tmp_path_factory.mktemp("keys")
    signing.generate_keypair(d / "admin.key", d / "admin.pub")
    signing.generate_keypair(d / "node.key", d / "node.pub")
    return d / "admin.pub", signing.load_signer(d / "admin.key"), signing.load_signer(d / "node.key")


# ---- the statement and its signature --------------------------------------------------------------


def test_a_signature_covers_text_name_generation_and_issue_time(keys: Any) -> None:
    pub, admin, node = keys
    v = signing.load_verifier([pub])
    sig = admin.sign("lab", "g1", TEXT, issued_at=1000)
    v.verify("lab", "g1", TEXT, sig)
    for args in (("lab", "g1", TEXT.replace("lab/out", "lab/all")), ("lab2", "g1", TEXT), ("lab", "g2", TEXT),
                 ("lab", None, TEXT)):
        with pytest.raises(ValueError, match="forged or altered"):
            v.verify(*args, sig)
    with pytest.raises(ValueError, match="forged or altered"):
        v.verify("lab", "g1", TEXT, dataclasses.replace(sig, issued_at=2000))  # a later issue time claimed
    with pytest.raises(ValueError, match="not an admin key of this node"):
        v.verify("lab", "g1", TEXT, node.sign("lab", "g1", TEXT))
    # both wire forms give the same signature back
    assert signing.Signature.from_extra(json.loads(json.dumps(sig.to_extra()))) == sig
    assert signing.Signature.from_line(sig.line()) == sig


@pytest.mark.parametrize("bad", [None, 1, [], {"key": "x"}, {"key": "0" * 16, "issued_at": "1", "sig": "A" * 86},
                                 {"key": "0" * 16, "issued_at": True, "sig": "A" * 86},
                                 {"key": "0" * 16, "issued_at": 1, "sig": "A" * 85},
                                 {"key": "0" * 16, "issued_at": -1, "sig": "A" * 86}])
def test_a_malformed_signature_field_is_a_value_error(bad: Any) -> None:
    with pytest.raises(ValueError, match="signature"):
        signing.Signature.from_extra(bad)


def test_spec_trust_refuses_unsigned_forged_and_older_statements(keys: Any) -> None:
    pub, admin, node = keys
    assert signing.SpecTrust(None).check("lab", "g1", TEXT, None) is None  # no admin keys: not required
    trust = signing.SpecTrust(signing.load_verifier([pub]))
    assert "carries no admin signature" in (trust.check("lab", "g1", TEXT, None) or "")
    assert "not an admin key" in (trust.check("lab", "g1", TEXT, node.sign("lab", "g1", TEXT).to_extra()) or "")
    assert "is not a key id" in (trust.check("lab", "g1", TEXT, {"key": 1}) or "")
    new = admin.sign("lab", "g2", TEXT, issued_at=2000)
    old = admin.sign("lab", "g1", TEXT, issued_at=1000)
    assert trust.check("lab", "g2", TEXT, new.to_extra()) is None
    assert trust.check("lab", "g2", TEXT, new) is None  # the same deploy again (a copy, a re-home)
    why = trust.check("lab", "g1", TEXT, old.to_extra())
    assert why is not None and "a replay" in why and "g2" in why, why
    assert trust.check("other", "g1", TEXT.replace('"lab"', '"other"'),
                       admin.sign("other", "g1", TEXT.replace('"lab"', '"other"'), issued_at=1000)) is None
    assert trust.newest == {"lab": (2000, "g2"), "other": (1000, "g1")}


def test_the_record_carries_the_signature_and_gives_back_the_signed_text(keys: Any) -> None:
    _, admin, _ = keys
    sig = admin.sign("lab", "g1", TEXT)
    payload = records.stamp(TEXT, "g1", sig).encode()
    rec = records.parse_record(payload)
    assert rec is not None and rec.state == "deployed" and rec.generation == "g1" and rec.signature == sig
    assert records.deployed_text(payload) == TEXT  # exactly what the keepers' specs carry
    unsigned = records.stamp(TEXT, "g1").encode()
    assert records.parse_record(unsigned) == records.PipelineRecord("deployed", "g1")
    assert records.deployed_text(unsigned) == TEXT


# ---- the MQTT topic allow-list ---------------------------------------------------------------------


@pytest.mark.parametrize("allowed,topic,covered", [
    ("lab/#", "lab/a/b", True), ("lab/#", "lab", True), ("lab/#", "lab/+", True), ("lab/#", "lab/#", True),
    ("lab/+", "lab/a", True), ("lab/+", "lab/+", True), ("lab/+", "lab/#", False), ("lab/+", "lab/a/b", False),
    ("lab/a", "lab/a", True), ("lab/a", "lab/+", False), ("lab/a", "lab/b", False), ("lab/a", "lab", False),
    ("lab", "lab/a", False), ("+/a", "lab/a", True), ("+/a", "fog/a", True),
])
def test_filter_covers(allowed: str, topic: str, covered: bool) -> None:
    assert admission.filter_covers(allowed, topic) is covered


def test_mqtt_operators_only_on_the_signed_allow_list() -> None:
    src = "agent.operators.taxi:mqtt_source"
    admission.check_mqtt_topics(src, {"topic": "plant/x"})  # no list, not required: as before
    admission.check_mqtt_topics(src, {"topic": "lab/sensors/t1"}, ("lab/sensors/+",), required=True)
    with pytest.raises(ValueError, match="is not on the pipeline's"):
        admission.check_mqtt_topics(src, {"topic": "plant/x"}, ("lab/sensors/+",))
    with pytest.raises(ValueError, match="is not on the pipeline's"):
        admission.check_mqtt_topics(src, {"topic": "lab/#"}, ("lab/sensors/+",))
    with pytest.raises(ValueError, match="names no"):
        admission.check_mqtt_topics(src, {"topic": "lab/x"}, (), required=True)
    with pytest.raises(ValueError, match="fleet's own topics"):  # the reserved roots stay refused
        admission.check_mqtt_topics(src, {"topic": "fog/c/events"}, ("#",), required=True)
    admission.check_mqtt_topics("agent.operators.builtin:in_zone", {}, (), required=True)  # not an MQTT operator
    split = "agent.operators.windows:late_split_sink"  # two topics, both checked
    admission.check_mqtt_topics(split, {"topic": "lab/out", "late_topic": "lab/late"}, ("lab/out", "lab/late"))
    with pytest.raises(ValueError, match="params.late_topic"):
        admission.check_mqtt_topics(split, {"topic": "lab/out", "late_topic": "plant/x"}, ("lab/out",))
    with pytest.raises(ValueError, match="params.late_topic: .*fleet's own"):
        admission.check_mqtt_topics(split, {"topic": "lab/out", "late_topic": "fog/c/events"})


def test_the_examples_mqtt_pipeline_names_its_topics() -> None:
    """examples/windows-pipeline.toml runs on a node that requires signed specs: every MQTT
    operator's topics are on its allow-list."""
    from agent.config import load_pipeline

    cfg = load_pipeline(Path(__file__).resolve().parent.parent / "examples/windows-pipeline.toml")
    for op in cfg.operators:
        admission.check_mqtt_topics(op.function, op.params, cfg.pipeline.mqtt_topics, required=True)


# ---- an agent that requires signatures -------------------------------------------------------------


def _agent(tmp_path: Path, pub: Path, node: str = "n2") -> Any:
    from agent.node.daemon import Agent

    conf = tmp_path / f"{node}.toml"
    conf.write_text(f'[agent]\nnode = "{node}"\ncluster = "c"\nstate_dir = "{tmp_path}/state-{node}"\n'
                    f'[mqtt]\nhost = "h"\nport = 1\n[security]\nadmin_keys = ["{pub}"]\n')
    agent = Agent(load_agent_config(conf), warm_worker=False)
    agent.bus.client = RecordingClient()
    agent.bus.retained_in = True
    started: List[Any] = []
    agent.supervisor.start = lambda spec, now: started.append(spec)  # type: ignore[method-assign]
    agent.started = started
    return agent


def _deliver(agent: Any, topic: str, payload: Any, retain: bool = False) -> None:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    agent.core._on_message(message(topic, raw, retain), agent.clock())


def _spawn(agent: Any, spec: Dict[str, Any], sender: str, peer: bool) -> Dict[str, Any]:
    """The reply to a spawn, {} when none came (a spawn taken is answered once its worker runs)."""
    topic = topics.agent_peer("c", agent.node, sender) if peer else topics.agent_rpc("c", agent.node, sender)
    before = len(agent.bus.client.on(topics.replies("c", sender, agent.node)))
    _deliver(agent, topic, rpc.encode({"op": "spawn", "spec": spec}))
    got = [json.loads(p) for p in agent.bus.client.on(topics.replies("c", sender, agent.node))]
    return got[-1] if len(got) > before else {}


def _spec(text: str, sig: Any, instance: str, generation: str = "g1", operator: str = "source") -> Dict[str, Any]:
    extra: Dict[str, Any] = {records.GENERATION_KEY: generation}
    if sig is not None:
        extra[signing.SIGNATURE_KEY] = sig.to_extra() if isinstance(sig, signing.Signature) else sig
    return {"instance": instance, "operator": operator, "pipeline": "lab", "pipeline_toml": text, "succs": [],
            "preds": [], "keeper": False, "active": True, "restart": False, "extra": extra}


def test_an_agent_with_admin_keys_runs_only_signed_specs_from_an_admin_or_a_node(tmp_path: Path, keys: Any) -> None:
    """An admin's spawn and a node's peer spawn alike: unsigned, signed by a node's key, or with a
    signature that is not over this text: refused with a reply, one log line, `refused_signatures`;
    the signed one runs."""
    pub, admin, node = keys
    agent = _agent(tmp_path, pub)
    sig = admin.sign("lab", "g1", TEXT)
    for bad, why in ((None, "carries no admin signature"), (node.sign("lab", "g1", TEXT), "not an admin key"),
                     (admin.sign("lab", "g1", TEXT.replace("lab/out", "lab/x")), "forged or altered")):
        r = _spawn(agent, _spec(TEXT, bad, "lab.source.9"), "adm", peer=False)
        assert r["ok"] is False and "not signed by an admin" in r["error"] and why in r["error"], r
    assert agent.core.counters["refused_signatures"] == 3 and agent.started == []
    assert _spawn(agent, _spec(TEXT, sig, "lab.source.1"), "adm", peer=False) == {}
    assert [s.instance for s in agent.started] == ["lab.source.1"]
    # a node's peer spawn of the deployed pipeline: the record is signed, the spec must be too
    _deliver(agent, topics.pipeline("c", "lab"), records.stamp(TEXT, "g1", sig).encode(), True)
    assert "lab" in agent.core.view.deployed
    r = _spawn(agent, _spec(TEXT, None, "lab.source.2"), "n3", peer=True)
    assert r["ok"] is False and "carries no admin signature" in r["error"], r
    assert _spawn(agent, _spec(TEXT, sig, "lab.source.3"), "n3", peer=True) == {}
    assert [s.instance for s in agent.started] == ["lab.source.1", "lab.source.3"]
    assert agent.core.counters["refused_signatures"] == 4


def test_an_unsigned_forged_or_older_record_deploys_nothing(tmp_path: Path, keys: Any) -> None:
    pub, admin, node = keys
    agent = _agent(tmp_path, pub)
    for payload in (records.stamp(TEXT, "g1").encode(), records.stamp(TEXT, "g1", node.sign("lab", "g1", TEXT)).encode(),
                    TEXT.encode()):
        _deliver(agent, topics.pipeline("c", "lab"), payload, True)
        assert "lab" not in agent.core.view.deployed and "lab" not in agent.core.view.records
    assert agent.core.counters["refused_signatures"] == 3
    _deliver(agent, topics.pipeline("c", "lab"),
             records.stamp(TEXT, "g2", admin.sign("lab", "g2", TEXT, issued_at=2000)).encode(), True)
    assert "lab" in agent.core.view.deployed and agent.core.view.records["lab"].generation == "g2"
    _deliver(agent, topics.pipeline("c", "lab"),
             records.stamp(TEXT, "g1", admin.sign("lab", "g1", TEXT, issued_at=1000)).encode(), True)
    assert agent.core.view.records["lab"].generation == "g2" and agent.core.counters["refused_signatures"] == 4
    _deliver(agent, topics.pipeline("c", "lab"), records.tombstone("lab", "g2"), True)  # an undeploy stops
    assert "lab" not in agent.core.view.deployed


def test_mqtt_operators_need_the_signed_allow_list_on_a_signing_node(tmp_path: Path, keys: Any) -> None:
    pub, admin, _ = keys
    agent = _agent(tmp_path, pub)
    for text, why in ((TEXT.replace('params = { topic = "lab/sensors/+" }', 'params = { topic = "plant/x" }'),
                       "is not on the pipeline's [pipeline] mqtt_topics"),
                      (TEXT.replace('mqtt_topics = ["lab/sensors/+", "lab/out"]\n', ""), "names no [pipeline] mqtt_topics")):
        r = _spawn(agent, _spec(text, admin.sign("lab", "g1", text), "lab.source.5"), "adm", peer=False)
        assert r["ok"] is False and why in r["error"], r
    assert agent.started == []


def test_a_stored_spec_without_a_signature_is_set_aside_not_readopted(tmp_path: Path, keys: Any) -> None:
    from agent.instance.spec import InstanceSpec
    from agent.mqtt.settings import BrokerSpec
    from agent.node import hosted

    pub, admin, _ = keys
    state = tmp_path / "state-n2"
    base = dict(operator="source", node="n2", cluster="c", pipeline="lab", pipeline_toml=TEXT,
                broker=BrokerSpec("h", 1), state_dir=str(state))
    hosted.remember(state, InstanceSpec(instance="lab.source.0", extra={records.GENERATION_KEY: "g1"}, **base))
    hosted.remember(state, InstanceSpec(instance="lab.source.1", extra={
        records.GENERATION_KEY: "g1", signing.SIGNATURE_KEY: admin.sign("lab", "g1", TEXT).to_extra()}, **base))
    agent = _agent(tmp_path, pub)
    agent.core.fencing.started(hosted.hosted(state))
    groups: List[Any] = []
    agent.core._start_group = lambda group, now: groups.append([s.instance for s in group])  # type: ignore[method-assign]
    agent.core.reconciler.readopt(agent.clock(), agent.wall())
    assert groups == [["lab.source.1"]]
    assert (state / "lab.source.0.spec.json.refused").exists() and agent.core.counters["refused_signatures"] == 1


def test_an_admin_key_that_is_not_an_ed25519_public_key_is_one_config_error(tmp_path: Path) -> None:
    from agent.node.daemon import Agent

    bad = tmp_path / "admin.pub"
    bad.write_text("not a key\n")
    conf = tmp_path / "agent.toml"
    conf.write_text(f'[agent]\nnode = "n1"\nstate_dir = "{tmp_path}/s"\n[security]\nadmin_keys = ["{bad}"]\n')
    with pytest.raises(ConfigError, match=r"agent.toml: \[security\].admin_keys: expected Ed25519 public key PEM"):
        Agent(load_agent_config(conf), warm_worker=False)
    conf.write_text('[agent]\nnode = "n1"\n[security]\nadmin_keys = "admin.pub"\n')
    with pytest.raises(ConfigError, match=r"\[security\].admin_keys"):
        load_agent_config(conf)


def test_a_signed_deploy_signs_the_record_and_every_keeper(keys: Any) -> None:
    """run_deploy with the admin's key: the retained record and each keeper's spec carry one
    signature, valid for the record's text, name and generation."""
    from agent.config import load_pipeline_text
    from agent.mqtt.settings import BrokerSpec
    from agent.node.deploy import keeper_specs, run_deploy
    from agent.node.placement import DEFAULT_POLICY, NodeView, get_policy

    pub, admin, _ = keys
    cfg = load_pipeline_text(TEXT)
    published: List[Tuple[str, bytes]] = []
    calls: List[Dict[str, Any]] = []

    def call(node: str, body: Dict[str, Any]) -> Dict[str, Any]:
        calls.append(body["spec"])
        return {"ok": True, "node": node}

    run_deploy(cfg, TEXT, keeper_specs(cfg, TEXT, "c", BrokerSpec("h", 1)), [NodeView("n1", 4, 4)],
               get_policy(DEFAULT_POLICY), call, lambda t, p: published.append((t, p)), "c", signer=admin)
    (topic, payload), = published
    rec = records.parse_record(payload)
    assert rec is not None and rec.signature is not None
    v = signing.load_verifier([pub])
    v.verify("lab", rec.generation, records.deployed_text(payload) or "", rec.signature)
    assert len(calls) == 2 and all(signing.Signature.from_extra(s["extra"][signing.SIGNATURE_KEY]) == rec.signature
                                   for s in calls)


def test_fogctl_keygen_writes_a_pair_and_never_overwrites(tmp_path: Path) -> None:
    import contextlib
    import io

    from agent.cli.fogctl import main as fogctl_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert fogctl_main(["keygen", str(tmp_path / "admin.key")]) == 0
    assert (tmp_path / "admin.key").stat().st_mode & 0o077 == 0
    signer = signing.load_signer(tmp_path / "admin.key")
    assert signer.key in out.getvalue() and set(signing.load_verifier([tmp_path / "admin.key.pub"]).keys) == {signer.key}
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert fogctl_main(["keygen", str(tmp_path / "admin.key")]) == 1
    assert "not overwritten" in err.getvalue()
    assert signing.load_signer(tmp_path / "admin.key").key == signer.key


def test_check_config_says_what_the_nodes_topic_rules_refuse(tmp_path: Path, keys: Any) -> None:
    """`check-config` (and so every deploy, before it connects) names an MQTT operator whose topic
    is off its pipeline's allow-list, and, for a node that requires signatures, one whose pipeline
    names none."""
    from agent.pipeline_check import check_text

    pub, _, _ = keys
    node = tmp_path / "agent.toml"
    node.write_text(f'[agent]\nnode = "n1"\nstate_dir = "{tmp_path}/s"\n[security]\nadmin_keys = ["{pub}"]\n')
    off = TEXT.replace('params = { topic = "lab/out" }', 'params = { topic = "plant/out" }')
    _, report = check_text(off, "p.toml", None)
    assert [p.message for p in report.errors] == [
        "p.toml: agent.operators.builtin:mqtt_sink params.topic: 'plant/out' is not on the pipeline's [pipeline] "
        "mqtt_topics ('lab/sensors/+', 'lab/out')"], report.errors
    unlisted = TEXT.replace('mqtt_topics = ["lab/sensors/+", "lab/out"]\n', "")
    assert check_text(unlisted, "p.toml", None)[1].ok  # no node that requires signatures named
    _, report = check_text(unlisted, "p.toml", str(node))
    assert len(report.errors) == 2 and all("names no [pipeline] mqtt_topics" in p.message for p in report.errors)
    assert check_text(TEXT, "p.toml", str(node))[1].ok


def test_both_deploy_commands_refuse_a_bad_signing_key_before_any_broker(tmp_path: Path, keys: Any) -> None:
    """A key that is not an Ed25519 PEM private key (here the public half) is one line, exit 1,
    and nothing is connected to: the broker port named is closed."""
    import contextlib
    import io

    from agent.cli.fogctl import main as fogctl_main
    from agent.cli.main import main as agent_main

    pub, _, _ = keys
    pipe = tmp_path / "p.toml"
    pipe.write_text(TEXT)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = fogctl_main(["--broker", "127.0.0.1:9", "--sign-key", str(pub), "deploy", str(pipe)])
    assert code == 1 and f"sign_key {pub}: not an unencrypted PEM private key" in err.getvalue(), err.getvalue()
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = agent_main(["deploy", str(pipe), "--host", "127.0.0.1", "--port", "9", "--sign-key", str(pub)])
    assert code == 1 and f"--sign-key {pub}: not an unencrypted PEM private key" in err.getvalue(), err.getvalue()
