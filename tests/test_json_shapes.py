"""The `--json` shapes (agent/fogctl/schemas.py) against the real output of every command.

Each schema is checked on what its command prints: fogctl's commands through `main` with
`--json` on a fake fleet on the session's real Mosquitto (agent.fogctl.testing: real MQTT
clients publishing what agents publish, answering rpc as the daemon does), its views sans-IO on
recorded states for the cases a live fleet rarely shows (offline nodes, pins, a void site
claim), and `fog-agent check-config --json` on every example file and on broken ones. A schema
that accepted anything would pass those, so every required key of every real document is also
removed once, and a wrong type put in, and the schema must refuse the result. The docs'
section "JSON output" (docs/fogctl.md) must be what `schemas.markdown()` generates.
"""

from __future__ import annotations

import copy
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
from jsonschema import Draft202012Validator

from agent import events, topics
from agent.cli.fogctl import main as fogctl
from agent.control.fleet import Fleet
from agent.fogctl import commands, schemas, views
from agent.fogctl.testing import FakeAgent, FakeInstance

ROOT = Path(__file__).resolve().parent.parent

# What the tests below validated, per schema: the negative checks run over these real documents.
SEEN: Dict[str, List[Any]] = {}


def valid(name: str, doc: Any) -> Any:
    """Assert `doc` fits schema `name` (every error listed), remember it, return it."""
    return fits(schemas.schema(name), name, doc, SEEN)


def fits(schema: Dict[str, Any], name: str, doc: Any, seen: Dict[str, List[Any]]) -> Any:
    """Assert `doc` fits `schema` (every error listed), remember it in `seen` under `name`, return
    it (tests/test_fog_agent_json_shapes.py checks fog-agent's schemas with it too)."""
    validator = Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, f"{name}: " + "; ".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)
    seen.setdefault(name, []).append(copy.deepcopy(doc))
    return doc


def test_every_schema_is_a_valid_draft_2020_12_schema_and_every_json_command_has_one() -> None:
    for name, s in schemas.SCHEMAS.items():
        Draft202012Validator.check_schema(s)
        assert s["$schema"] == schemas.DIALECT and s["title"], name
    json_commands = set(commands.COMMANDS) - {"schema"}  # schema prints schemas, no shape of its own
    assert set(schemas.SCHEMAS) == json_commands | {"check-config", "error"}


def test_the_docs_section_is_generated_from_the_schemas() -> None:
    text = (ROOT / "docs" / "fogctl.md").read_text()
    begin, end = "<!-- json-shapes: begin", "<!-- json-shapes: end -->"
    assert begin in text and end in text
    section = text.split(begin, 1)[1].split("-->", 1)[1].split(end, 1)[0]
    assert section.strip() == schemas.markdown().strip(), \
        "docs/fogctl.md is out of date: paste the output of `python -m agent.fogctl.schemas` between the markers"


def test_fogctl_schema_prints_the_packages_schemas(capsys: pytest.CaptureFixture) -> None:
    def never(*a: Any, **k: Any) -> Any:
        raise AssertionError("fogctl schema connected to a broker")

    assert fogctl(["schema", "status"], connect=never) == 0
    assert json.loads(capsys.readouterr().out) == schemas.SCHEMAS["status"]
    assert fogctl(["schema"], connect=never) == 0
    assert json.loads(capsys.readouterr().out) == schemas.SCHEMAS
    assert fogctl(["schema", "nope"], connect=never) == 1
    assert "no JSON schema for 'nope'" in capsys.readouterr().err


# ---- sans-IO: views on recorded states ----------------------------------------------------------


def _recorded_fleet(cluster: str) -> Fleet:
    """Three nodes as a broker would hold them: n1 with a pinned operator and fgme locks, n2
    offline (its last state retained), n3 with a state that does not parse."""
    a1 = FakeAgent("127.0.0.1", 1, cluster, "n1", instances=[
        FakeInstance("p.a.0", "a", pipeline="p", keeper=True, lock={"boundary": "a|b", "state": "in_cs"}),
        FakeInstance("p.b.0", "b", pipeline="p", keeper=True, phase="starting", lock={"boundary": "a|b", "state": "requesting"})])
    a1.pins = {"p/a": {"pipeline": "p", "operator": "a", "until": None}}
    a2 = FakeAgent("127.0.0.1", 1, cluster, "n2", instances=[FakeInstance("p.a.1", "a", pipeline="p")])
    msgs = {topics.agent_state(cluster, "n1"): json.dumps(a1.state()).encode(),
            topics.agent_status(cluster, "n1"): b"online",
            topics.agent_state(cluster, "n2"): json.dumps(a2.state()).encode(),
            topics.agent_status(cluster, "n2"): b"offline",
            topics.agent_state(cluster, "n3"): b"{not json",
            topics.latency(cluster, "n1"): json.dumps({"node": "n1", "ts": 1.0, "rtt_ms": {"n2": 1.5},
                                                       "emulated_ms": {"n2": 20.0}}).encode(),
            topics.pipeline(cluster, "p"): b'[pipeline]\nname = "p"\n'}
    return Fleet.from_messages(cluster, msgs)


def test_views_on_recorded_states_fit_their_schemas() -> None:
    fleet = _recorded_fleet("rec")
    now = time.time()
    doc = valid("status", views.status(fleet, now)[0])
    assert {n["node"]: n["status"] for n in doc["nodes"]}["n2"] == "offline" and doc["pins"]
    assert any(n["error"] for n in doc["nodes"])
    valid("topology", views.topology(fleet)[0])
    valid("topology", views.topology(fleet, "nothing-here")[0])
    valid("latency", views.latency(fleet)[0])
    assert valid("locks", views.locks(fleet)[0])["boundaries"]
    valid("pipelines", views.pipelines(fleet)[0])
    empty = Fleet.from_messages("none", {})
    for name, view in (("status", lambda f: views.status(f, now)), ("topology", views.topology),
                       ("latency", views.latency), ("locks", views.locks), ("pipelines", views.pipelines)):
        valid(name, view(empty)[0])


def test_site_views_fit_the_schema_claim_void_or_none() -> None:
    now = 1000.0
    state = {"target": 0.3, "min_nodes": 1, "max_nodes": 3, "spare": 0.41,
             "pending": {"action": "drain", "node": "n3", "since": 990.0}, "released": ["n4"],
             "actions": [{"action": "drain", "node": "n3", "reason": "spare 0.41 > target", "ts": 990.0}]}
    valid("site", commands.site_view(None, now)[0])
    valid("site", commands.site_view({"node": "n1", "until": now + 10, "state": state}, now)[0])
    void = valid("site", commands.site_view({"node": "n1", "until": now + 10, "state": {}, "void": "its holder is offline"},
                                            now)[0])
    assert void["leader"] is None and void["last_leader"] == "n1"


# ---- live: every fogctl command on a fake fleet on the real broker --------------------------------


def run(capsys: pytest.CaptureFixture, broker: Any, cluster: str, *argv: str) -> Tuple[int, Any, str]:
    code = fogctl(["--broker", broker.address, "--cluster", cluster, "--timeout", "5", "--json", *argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


@pytest.fixture
def fleet(mosquitto: Any) -> Iterator[Tuple[str, List[FakeAgent]]]:
    cluster = "j" + uuid.uuid4().hex[:8]
    fgme = lambda s: {"boundary": "validate|in_zone", "state": s}  # noqa: E731
    agents = [
        FakeAgent(mosquitto.host, mosquitto.port, cluster, "n1", slots=6, latency_ms={"n2": 1.2}, emulated_ms={"n2": 10.0},
                  instances=[FakeInstance("validate-1", "validate", keeper=True, lock=fgme("requesting")),
                             FakeInstance("in_zone-1", "in_zone", keeper=True, lock=fgme("in_cs"))]).start(),
        FakeAgent(mosquitto.host, mosquitto.port, cluster, "n2", slots=6, latency_ms={"n1": 1.4},
                  instances=[FakeInstance("in_zone-2", "in_zone", lock=fgme("idle"))]).start(),
    ]
    yield cluster, agents
    for a in agents:
        a.stop()


@pytest.mark.broker
def test_inspection_commands_fit_their_schemas(capsys: pytest.CaptureFixture, mosquitto: Any, fleet: Any) -> None:
    cluster, agents = fleet
    for name in ("status", "topology", "latency", "locks", "pipelines"):
        code, doc, err = run(capsys, mosquitto, cluster, name)
        assert code == 0, err
        valid(name, doc)
    code, doc, err = run(capsys, mosquitto, cluster, "topology", "--tree")  # --json wins over --tree
    assert code == 0 and valid("topology", doc)["pipelines"]
    code, doc, _ = run(capsys, mosquitto, cluster, "site")
    assert valid("site", doc) == {"leader": None}
    # a site manager's claim, as the leading agent publishes it
    claim = {"v": 1, "node": "n1", "until": time.time() + 10,
             "state": {"target": 0.3, "min_nodes": 1, "max_nodes": 2, "spare": 0.5, "pending": None,
                       "released": [], "actions": []}}
    agents[0]._pub(topics.site_manager(cluster, "n1"), json.dumps(claim).encode())
    code, doc, err = run(capsys, mosquitto, cluster, "site")
    assert code == 0, err
    assert valid("site", doc)["leader"] == "n1"


@pytest.mark.broker
def test_watch_and_why_fit_their_schemas(capsys: pytest.CaptureFixture, mosquitto: Any, fleet: Any) -> None:
    cluster, agents = fleet
    hist: List[events.Event] = []
    for k in range(3):
        hist = events.remember(hist, events.decision(ts=1000.0 + k, node="n1", instance="in_zone-1", operator="in_zone",
                                                     load=100.0 + k, capacity=400.0, probability=0.2, draw=0.5,
                                                     action="none"))
    agents[0].publish_history("in_zone-1", hist)
    agents[1]._pub(topics.agent_rehomed(cluster, "n2"), json.dumps({"in_zone-1": 1500.0}).encode())
    code, doc, err = run(capsys, mosquitto, cluster, "why", "in_zone-1")
    assert code == 0, err
    assert len(valid("why", doc)["decisions"]) == 3 and doc["rehomed"] == {"by": "n2", "at": 1500.0}
    code, doc, _ = run(capsys, mosquitto, cluster, "why", "nobody-1")
    assert valid("why", doc)["decisions"] == []
    out = [events.make("scale_out", ts=time.time(), node="n1", instance="in_zone-1", operator="in_zone", pipeline="taxi",
                       reason=events.Reason(560.0, 500.0, 1.12, 0.6, 0.31, "duplicate", 1), detail={"new": ["in_zone-7"]}),
           events.make("terminated", ts=time.time(), node="n2", instance="in_zone-2", operator="in_zone",
                       detail={"cause": "scale_in", "stats": {"records_in": 5}})]
    threading.Timer(0.5, lambda: [agents[0].publish_event(e) for e in out]).start()
    code = fogctl(["--broker", mosquitto.address, "--cluster", cluster, "--json", "watch", "--count", "2",
                   "--duration", "10"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0 and len(lines) == 2
    for line in lines:
        valid("watch", json.loads(line))


@pytest.mark.broker
def test_steering_commands_fit_their_schemas(capsys: pytest.CaptureFixture, mosquitto: Any, fleet: Any) -> None:
    cluster, agents = fleet
    code, doc, err = run(capsys, mosquitto, cluster, "scale", "in_zone", "+1", "--for", "10m", "--wait", "5")
    assert code == 0, err
    assert valid("scale", doc)["expected"] == 3
    code, doc, err = run(capsys, mosquitto, cluster, "why", "in_zone-1")  # pinned now
    assert code == 0 and valid("why", doc)["pinned"]["operator"] == "in_zone"
    code, doc, _ = run(capsys, mosquitto, cluster, "status")
    assert valid("status", doc)["pins"][0]["nodes"] == ["n1", "n2"]
    code, doc, err = run(capsys, mosquitto, cluster, "scale", "in_zone", "-1")
    assert code == 0, err
    valid("scale", doc)
    code, doc, err = run(capsys, mosquitto, cluster, "scale", "--release", "in_zone")
    assert code == 0, err
    assert valid("scale", doc)["released"] == ["n1", "n2"]
    code, doc, err = run(capsys, mosquitto, cluster, "drain", "n2", "--wait", "5")
    assert code == 0, err
    assert valid("drain", doc)["remaining"] == []
    code, doc, err = run(capsys, mosquitto, cluster, "drain", "n2", "--undo")
    assert code == 0, err
    valid("drain", doc)


def _wait_until_gone(capsys: pytest.CaptureFixture, broker: Any, cluster: str, prefix: str) -> None:
    """Until no agent's retained state lists an instance named `prefix`...: undeploy returns on the
    agents' replies, their states follow a moment later, and a deploy right after reads those."""
    deadline = time.monotonic() + 10.0
    while True:
        code, doc, err = run(capsys, broker, cluster, "status")
        assert code == 0, err
        if not any(i.startswith(prefix) for n in doc["nodes"] for i in n["instances"]):
            return
        assert time.monotonic() < deadline, f"{prefix}* still listed after undeploy: {doc['nodes']}"
        time.sleep(0.05)


@pytest.mark.broker
def test_deploy_undeploy_and_keygen_fit_their_schemas(capsys: pytest.CaptureFixture, mosquitto: Any, fleet: Any,
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster, _ = fleet
    monkeypatch.delenv("FOG_AGENT_CONFIG", raising=False)
    f = tmp_path / "taxi.toml"
    f.write_text((ROOT / "examples" / "pipeline.toml").read_text())
    code, doc, err = run(capsys, mosquitto, cluster, "deploy", str(f))
    assert code == 0, err
    assert [k["operator"] for k in valid("deploy", doc)["keepers"]] == ["source", "validate", "in_zone", "sink"]
    code, doc, err = run(capsys, mosquitto, cluster, "undeploy", "taxi")
    assert code == 0, err
    valid("undeploy", doc)
    bad = tmp_path / "bad.toml"
    bad.write_text(f.read_text().replace('seed = 1', 'sede = 1', 1))
    code, doc, err = run(capsys, mosquitto, cluster, "deploy", str(bad))
    assert code == 1 and valid("deploy", doc)["ok"] is False
    valid("error", doc)
    assert [p["message"] for p in doc["errors"]] == [line[len("fogctl: error: "):] for line in err.splitlines()]
    # fog-agent deploy --json prints the same documents
    from agent.cli.main import main as fog_agent

    monkeypatch.delenv("FOG_AGENT_SIGN_KEY", raising=False)
    base = ["deploy", "--host", mosquitto.host, "--port", str(mosquitto.port), "--cluster", cluster, "--json"]
    _wait_until_gone(capsys, mosquitto, cluster, "taxi.")
    assert fog_agent(base + [str(f)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [k["operator"] for k in valid("deploy", doc)["keepers"]] == ["source", "validate", "in_zone", "sink"]
    assert doc["topic"] == topics.pipeline(cluster, "taxi")
    code, doc, err = run(capsys, mosquitto, cluster, "undeploy", "taxi")
    assert code == 0, err
    assert fog_agent(base + [str(bad)]) == 1
    out, err = capsys.readouterr()
    doc = valid("error", json.loads(out))
    assert [p["message"] for p in doc["errors"]] == [line[len("error: "):] for line in err.splitlines()]
    code, doc, err = run(capsys, mosquitto, cluster, "keygen", str(tmp_path / "admin.key"))
    assert code == 0, err
    valid("keygen", doc)


# ---- fog-agent check-config --json -----------------------------------------------------------------


def check_config(capsys: pytest.CaptureFixture, *argv: str) -> Tuple[int, Any]:
    from agent.cli.main import main

    code = main(["check-config", *argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


@pytest.mark.parametrize("name", ["agent.toml", "pipeline.toml", "windows-pipeline.toml", "central.toml",
                                  "latency.toml", "demo-pipeline.toml"])
def test_check_config_of_every_example_fits_the_schema(name: str, capsys: pytest.CaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FOG_AGENT_CONFIG", raising=False)
    code, doc = check_config(capsys, str(ROOT / "examples" / name))
    assert code == 0, doc
    valid("check-config", doc)


def test_check_config_errors_fit_the_error_shape(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FOG_AGENT_CONFIG", raising=False)
    bad = tmp_path / "p.toml"
    bad.write_text((ROOT / "examples" / "pipeline.toml").read_text().replace('seed = 1', 'sede = 1', 1))
    for path in (bad, tmp_path / "missing.toml"):
        code, doc = check_config(capsys, str(path))
        assert code == 1
        valid("check-config", doc)
        assert valid("error", doc)["errors"]
    (tmp_path / "odd.toml").write_text("x = 1\n")
    code, doc = check_config(capsys, str(tmp_path / "odd.toml"))
    assert code == 1 and valid("error", doc)["errors"][0]["file"] == "odd.toml"


# ---- the schemas refuse what is not the shape ---------------------------------------------------


def _mutations(doc: Any, schema: Dict[str, Any]) -> Iterator[Tuple[str, Any]]:
    """`doc` with one required key of its (matching) object schema removed, for each such key;
    and with each such key's value replaced by one of another JSON type (an array for an object
    or null, else an object)."""
    if not isinstance(doc, dict):
        return
    alts = schema.get("oneOf", [schema])
    for alt in alts:
        if not alt.get("required") or not Draft202012Validator(alt).is_valid(doc):
            continue
        for key in alt["required"]:
            yield f"without {key!r}", {k: v for k, v in doc.items() if k != key}
            wrong = [doc[key]] if isinstance(doc[key], dict) or doc[key] is None else {"wrong": 1}
            yield f"{key!r} of the wrong type", dict(doc, **{key: wrong})
        return


def test_a_missing_key_or_a_wrong_type_is_refused_in_every_real_document() -> None:
    if not SEEN:
        pytest.skip("runs after the tests that collect real documents (same file, same process)")
    checked = 0
    for name, docs in SEEN.items():
        v = Draft202012Validator(schemas.schema(name))
        for doc in docs:
            for what, broken in _mutations(doc, schemas.SCHEMAS[name]):
                assert not v.is_valid(broken), f"{name} accepted a document {what}"
                checked += 1
    assert checked > 100


def test_the_schemas_refuse_typical_mistakes() -> None:
    status = schemas.schema("status")
    ok = {"cluster": "c", "nodes": [], "pins": []}
    v = Draft202012Validator(status)
    assert v.is_valid(ok)
    assert not v.is_valid(dict(ok, extra=1))                     # a key nobody documented
    node = {"node": "n1", "status": "sleeping", "draining": False, "cpu": None, "memory": None, "temperature": None,
            "slots": 4, "free_slots": None, "capacity": None, "instances": [], "pins": [], "ts": None,
            "last_seen_s": None, "error": None}
    assert not v.is_valid(dict(ok, nodes=[node]))                 # a status no agent has
    assert v.is_valid(dict(ok, nodes=[dict(node, status="offline")]))
    err = Draft202012Validator(schemas.schema("error"))
    assert not err.is_valid({"ok": False, "errors": []})          # an error names at least one problem
    assert not err.is_valid({"ok": True, "errors": [{"file": "f", "key": "", "expected": "x", "given": None,
                                                     "message": "f: x"}]})
    cc = Draft202012Validator(schemas.schema("check-config"))
    assert not cc.is_valid({"ok": True, "pipeline": {}, "operator": []})  # success carries no "ok"
    assert not cc.is_valid({"something": {}})                    # no kind's tables
