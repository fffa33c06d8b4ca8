"""No code from the bus (issue 20, item 2; docs/security.md): the operator function a spec names
must be on the node's own allow-list, and paths a spec names must resolve inside the node's own
directories. Checked where a spec enters a node (spawn from the bus, a worker's spawn, a re-home
from another node's retained hosted record, re-adoption from the state dir) and again in the
worker before it imports anything. The steering fields of a spec's extra too: an epoch floor far
ahead of the node's clock is refused, `crash_at` is dropped unless fault injection is on.

Every refused module here writes a marker file when it is imported: the tests assert the marker
is absent and the module is not in sys.modules, i.e. the check never imported it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from agent.operators import admission

from agent.node import hosted
from agent.operators.admission import AllowList, NodeDirs, OperatorRefused, PathRefused
from agent.operators.builtin import OperatorContext, load_operator
from agent.instance.spec import InstanceSpec
from agent.mqtt.settings import BrokerSpec
from pipelines import with_work

ROOT = Path(__file__).resolve().parent.parent

OPS_SRC = '''
import os
from os import system
from os import getcwd as cwd
from agent.operators.builtin import record_map
open(os.environ.get("FOGSEC_MARKER_DIR", ".") + "/ops_imported", "a").write(str(os.getpid()) + "\\n")

def double(rec):
    return rec * 2 if isinstance(rec, int) else rec

@record_map
def scaled(rec, params):
    return rec * params.get("k", 1)

def _hidden(rec):
    return rec
'''

EVIL_SRC = '''
import os
open(os.environ.get("FOGSEC_MARKER_DIR", ".") + "/evil_imported", "a").write("imported\\n")

def run(rec):
    return rec
'''

EP_MOD_SRC = '''
def upper(rec):
    return rec.upper()
'''


@pytest.fixture
def opsdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Tuple[Path, Dict[str, str]]]:
    """A directory on sys.path with an allowed module, an evil one and an installed distribution
    that registers an entry point; unique module names per test (sys.modules is per process)."""
    tag = uuid.uuid4().hex[:8]
    d = tmp_path / "pkgs"
    d.mkdir()
    names = {"ops": f"fogsec_ops_{tag}", "evil": f"fogsec_evil_{tag}", "epmod": f"fogsec_ep_{tag}"}
    (d / f"{names['ops']}.py").write_text(OPS_SRC)
    (d / f"{names['evil']}.py").write_text(EVIL_SRC)
    (d / f"{names['epmod']}.py").write_text(EP_MOD_SRC)
    dist = d / f"fogsec_dist_{tag}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fogsec-dist-{tag}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[fog_agent.operators]\nupper_{tag} = {names['epmod']}:upper\n")
    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv("FOGSEC_MARKER_DIR", str(markers))
    monkeypatch.syspath_prepend(str(d))
    yield d, names
    for n in names.values():
        sys.modules.pop(n, None)


def installed_entry_points(exclude: str) -> Dict[str, str]:
    """The `fog_agent.operators` entry points of the installed distributions other than
    `exclude` (e.g. fog-agent-lab's, where the lab is installed)."""
    from importlib import metadata

    out: Dict[str, str] = {}
    for dist in metadata.distributions():
        if dist.metadata["Name"] == exclude:
            continue
        for entry in dist.entry_points:
            if entry.group == admission.ENTRY_POINT_GROUP:
                out[entry.name] = entry.value
    return out


def ctx() -> OperatorContext:
    return OperatorContext("i", "o", "n", "map")


# ---- the allow-list ------------------------------------------------------------------------------


def test_builtins_are_allowed_and_nothing_else_by_default() -> None:
    allowed = AllowList.for_node()
    for ref in sorted(admission.BUILTIN):
        assert allowed.check(ref) == tuple(ref.split(":"))
    assert load_operator("agent.operators.builtin:identity", ctx(), allowed).process([("s", 1, 5)]) == [("s", 1, 5)]
    assert hasattr(load_operator("agent.operators.taxi:source", ctx(), allowed), "poll")
    # public, in the operators module, but not an operator: not on the list
    for ref in ("agent.operators.builtin:read_sink_ids", "agent.operators.builtin:load_operator",
                "agent.operators.builtin:_read_ids", "agent.operators.builtin:_private"):
        name = ref.partition(":")[2]
        with pytest.raises(OperatorRefused, match=f"module 'agent.operators.builtin' has no operator '{name}'"):
            allowed.check(ref)
    # a misspelt built-in is named as such (it used to be "not an operator module of this node")
    with pytest.raises(OperatorRefused, match="module 'agent.operators.builtin' has no operator 'mqtt_snk'; "
                                              "did you mean 'mqtt_sink'\\?"):
        allowed.check("agent.operators.builtin:mqtt_snk")
    with pytest.raises(OperatorRefused, match="module 'mylab.ops' is not an operator module of this node"):
        allowed.check("mylab.ops:f")


@pytest.mark.parametrize("ref", ["builtins:exec", "builtins:eval", "os:system", "subprocess:run",
                                 "agent.operators.builtin:_private", "importlib:import_module"])
def test_refused_functions_name_the_function_and_the_allow_list(ref: str) -> None:
    with pytest.raises(OperatorRefused) as err:
        AllowList.for_node().check(ref)
    msg = str(err.value)
    assert repr(ref) in msg and "allowed here: built-in agent.operators.builtin:{counting_sink,identity,in_zone" in msg
    assert "[operators] modules: none" in msg


@pytest.mark.parametrize("ref", ["os:system;rm -rf /", "os :system", "os:sys tem", "mod:double()",
                                 "\uff4fs:system", "os:syst\u0435m", "a..b:c", ".a:b", "a:b:c", "a:", ":b",
                                 "a/b:c", "a\0b:c", "", "x" * 300 + ":y", None, 42, ["os", "system"]])
def test_odd_names_are_refused_before_anything_else(ref: Any) -> None:
    with pytest.raises(OperatorRefused, match='expected "package.module:function"'):
        AllowList.for_node(modules=["os"]).check(ref)


def test_a_configured_module_allows_its_own_public_functions_only(opsdir: Tuple[Path, Dict[str, str]]) -> None:
    _, names = opsdir
    ops = names["ops"]
    allowed = AllowList.for_node(modules=[ops])
    assert load_operator(f"{ops}:double", ctx(), allowed).process([("s", 1, 4)]) == [("s", 1, 8)]
    op = load_operator(f"{ops}:scaled", OperatorContext("i", "o", "n", "map", params={"k": 3}), allowed)
    assert op.process([("s", 1, 2)]) == [("s", 1, 6)]
    with pytest.raises(OperatorRefused, match="private"):
        allowed.check(f"{ops}:_hidden")
    # imported into the module from elsewhere: the module is allowed, the object is not its own
    for name in ("system", "cwd", "record_map"):
        with pytest.raises(OperatorRefused, match=f"{name!r} is not defined in"):
            load_operator(f"{ops}:{name}", ctx(), allowed)
    with pytest.raises(ValueError, match=f"module '{ops}' has no operator 'missing'"):
        load_operator(f"{ops}:missing", ctx(), allowed)


def test_an_entry_point_allows_exactly_its_target(opsdir: Tuple[Path, Dict[str, str]]) -> None:
    _, names = opsdir
    allowed = AllowList.for_node()  # reads the installed distributions' metadata, imports nothing
    ep = names["epmod"]
    assert f"{ep}:upper" in allowed.entry_points.values()
    assert ep not in sys.modules
    assert load_operator(f"{ep}:upper", ctx(), allowed).process([("s", 1, "a")]) == [("s", 1, "A")]
    with pytest.raises(OperatorRefused):
        allowed.check(f"{ep}:__import__")  # its module is not a configured module: only the target
    assert f"{ep}:upper" in allowed.describe()


def test_a_refused_module_is_never_imported(opsdir: Tuple[Path, Dict[str, str]], tmp_path: Path) -> None:
    _, names = opsdir
    evil = names["evil"]
    allowed = AllowList.for_node(modules=[names["ops"]])
    for ref in (f"{evil}:run", f"{evil}:_x", f"{names['ops']}.{evil}:run"):
        with pytest.raises(OperatorRefused):
            load_operator(ref, ctx(), allowed)
    assert evil not in sys.modules
    assert not (tmp_path / "markers" / "evil_imported").exists()
    # a listed module is imported only by resolve, never by check
    allowed.check(f"{names['ops']}:double")
    assert names["ops"] not in sys.modules


def test_the_worker_allow_list_comes_from_its_environment_not_its_spec(opsdir: Tuple[Path, Dict[str, str]]) -> None:
    _, names = opsdir
    env = AllowList.for_node(modules=[names["ops"], "os", "agent.node.daemon"]).env()
    # the agent filters its own list the same way config loading does: no stdlib, no fog-agent
    # module; the entry points it read go along, so that a worker need not read the metadata
    ep = {**installed_entry_points(exclude=f"fogsec-dist-{names['epmod'].rpartition('_')[2]}"),
          f"upper_{names['epmod'].rpartition('_')[2]}": f"{names['epmod']}:upper"}
    ep = dict(sorted(ep.items()))
    assert env == {admission.ENV_MODULES: names["ops"], admission.ENV_ENTRY_POINTS: json.dumps(ep, separators=(",", ":"))}
    assert AllowList.from_env(env) == AllowList(modules=(names["ops"],), entry_points=ep)
    assert AllowList.from_env({}) == AllowList(modules=(), entry_points=ep)  # read from the metadata
    # what the agent gave is what the worker allows (the metadata is not read again) ...
    given = AllowList.from_env({admission.ENV_MODULES: "os," + names["ops"], admission.ENV_ENTRY_POINTS: "{}"})
    assert given == AllowList(modules=(names["ops"],), entry_points={})
    with pytest.raises(OperatorRefused):
        given.check(f"{names['epmod']}:upper")
    # ... unless it is not a map of names to "module:function": then the metadata, as without it
    for bad in ("", "[", '["x"]', '{"x": 3}', '{"x": "os system"}', '{"x": "os:system()"}'):
        assert AllowList.from_env({admission.ENV_ENTRY_POINTS: bad}).entry_points == ep, bad


def test_agent_toml_operators_and_sink_dirs(tmp_path: Path) -> None:
    from agent.config import load_agent_config
    from agent.schema import ConfigError

    conf = tmp_path / "a.toml"
    conf.write_text('[agent]\nnode = "n"\nsink_dirs = ["/srv/sinks"]\n[operators]\nmodules = ["mylab.ops"]\n')
    cfg = load_agent_config(conf)
    assert cfg.operators.modules == ("mylab.ops",) and cfg.agent.sink_dirs == ("/srv/sinks",)
    for bad, msg in (('[operators]\nmodules = ["os"]', "standard library"),
                     ('[operators]\nmodules = ["builtins"]', "standard library"),
                     ('[operators]\nmodules = ["agent.operators.builtin"]', "built in"),
                     ('[operators]\nmodules = ["my lab"]', "module name"),
                     ('[agent]\nnode = "n"\nsink_dirs = ["sinks"]', "absolute")):
        text = bad if bad.startswith("[agent]") else '[agent]\nnode = "n"\n' + bad
        conf.write_text(text + "\n")
        with pytest.raises(ConfigError, match=msg):
            load_agent_config(conf)


def test_check_config_names_file_key_and_what_is_allowed(tmp_path: Path, opsdir: Tuple[Path, Dict[str, str]]) -> None:
    _, names = opsdir
    pipe = tmp_path / "p.toml"
    pipe.write_text(with_work("builtins:exec"))
    agent_toml = tmp_path / "agent.toml"
    agent_toml.write_text(f'[agent]\nnode = "n"\n[operators]\nmodules = ["{names["ops"]}"]\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(opsdir[0])]))
    r = subprocess.run([sys.executable, "-m", "agent", "check-config", str(pipe), "--agent-config", str(agent_toml)],
                       capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=60)
    assert r.returncode == 1
    [line] = r.stderr.strip().splitlines()
    assert line.startswith(f'error: {pipe}: [operator[1]].function: "builtins:exec" is not allowed on this node')
    assert f"[operators] modules: {names['ops']}:*" in line and "built-in" in line and str(agent_toml) in line
    pipe.write_text(with_work(f"{names['ops']}:double"))
    r = subprocess.run([sys.executable, "-m", "agent", "check-config", str(pipe), "--agent-config", str(agent_toml)],
                       capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=60)
    assert r.returncode == 0, r.stderr
    assert names["ops"] not in sys.modules  # check-config never imports a module either


def test_calibrate_imports_through_the_nodes_allow_list(tmp_path: Path, opsdir: Tuple[Path, Dict[str, str]]) -> None:
    """`fog-agent calibrate --config agent.toml` measures a function of the node's `[operators]
    modules` (before, it used only the built-ins and entry points and refused it); a module the
    agent.toml does not list is refused there too, and never imported."""
    pkgs, names = opsdir
    pipe = tmp_path / "p.toml"
    pipe.write_text(with_work(f"{names['ops']}:double"))
    agent_toml = tmp_path / "agent.toml"
    agent_toml.write_text(f'[agent]\nnode = "n7"\nstate_dir = "{tmp_path}/state"\n'
                          f'[operators]\nmodules = ["{names["ops"]}"]\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(pkgs)]))
    env.pop(admission.ENV_MODULES, None)
    cmd = [sys.executable, "-m", "agent", "calibrate", "--pipeline", str(pipe), "--operator", "work",
           "--config", str(agent_toml), "--window", "0.05", "--start-rate", "100", "--max-rate", "300", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["node"] == "n7" and out["operator"] == "work" and out["capacity"] > 0 and out["steps"], out
    stored = json.loads((tmp_path / "state" / "capacity.json").read_text())
    assert "n7" in json.dumps(stored) and "work" in json.dumps(stored)
    assert (tmp_path / "markers" / "ops_imported").exists()
    # a module the node does not list: refused with the allow-list, never imported
    pipe.write_text(with_work(f"{names['evil']}:run"))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=60)
    assert r.returncode == 1 and f"{names['evil']}:run" in r.stderr and "allowed here" in r.stderr, r.stderr
    assert f"[operators] modules: {names['ops']}:*" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "markers" / "evil_imported").exists()


# ---- paths ---------------------------------------------------------------------------------------


def test_paths_resolve_inside_the_node_directories(tmp_path: Path) -> None:
    state, outside = tmp_path / "state", tmp_path / "outside"
    state.mkdir()
    outside.mkdir()
    (state / "link").symlink_to(outside)
    dirs = NodeDirs((os.path.realpath(state),))
    assert dirs.check("extra.sink_dir", str(state / "sinks")) == str(state / "sinks")
    assert dirs.check("extra.sink_dir", str(state)) == str(state)
    for bad in (f"{state}/../escape", "/x/../escape", str(state / "link"), str(state / "link" / "sub"),
                f"{state}x", "relative/dir", "", "/a\0b", 5):
        with pytest.raises(PathRefused, match="extra.sink_dir"):
            dirs.check("extra.sink_dir", bad)
    assert not (tmp_path / "escape").exists() and list(outside.iterdir()) == []


# ---- the agent: every place a spec enters ---------------------------------------------------------



def agent_for(tmp_path: Path, extra_toml: str = "") -> Any:
    from agent.config import load_agent_config
    from agent.node.daemon import Agent

    conf = tmp_path / "a.toml"
    conf.write_text(f'[agent]\nnode = "me"\ncluster = "c"\nstate_dir = "{tmp_path}/state"\ndead_after = 1.0\n'
                    '[mqtt]\nhost = "127.0.0.1"\nport = 1\n' + extra_toml)
    return Agent(load_agent_config(conf), warm_worker=False)


def spec_body(func: str, instance: str = "p.work.0", **extra: Any) -> Dict[str, Any]:
    return {"instance": instance, "operator": "work", "pipeline": "p", "pipeline_toml": with_work(func),
            "succs": ["p.sink.0"], "preds": ["p.source.0"], "keeper": True, "extra": extra}


def test_spec_from_refuses_and_logs_the_requester(tmp_path: Path, opsdir: Tuple[Path, Dict[str, str]],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    _, names = opsdir
    agent = agent_for(tmp_path, f'[operators]\nmodules = ["{names["ops"]}"]\n')
    caplog.set_level(logging.WARNING, logger="agent.node.daemon")
    for func in ("builtins:exec", "os:system", f"{names['evil']}:run", "agent.operators.builtin:_private"):
        with pytest.raises(ValueError, match="refused"):
            agent.core.gate.spec_from(agent.wall(), spec_body(func), template=None, requester="admin intruder")
    assert agent.core.counters["refused_specs"] == 4
    assert sum("from admin intruder" in r.getMessage() and "builtins:exec" in r.getMessage() for r in caplog.records) == 1
    good = agent.core.gate.spec_from(agent.wall(), spec_body(f"{names['ops']}:double"), template=None)
    assert good.instance == "p.work.0"
    # this node does not spill: a request's spool settings (a directory anywhere) are dropped
    spilling = agent.core.gate.spec_from(agent.wall(), spec_body(f"{names['ops']}:double", spill={"dir": str(tmp_path / "evil")}),
                                template=None)
    assert agent.spill is None and "spill" not in spilling.extra
    # a worker's createNode() is admitted too, and logged with the worker as the requester
    caplog.clear()
    with pytest.raises(ValueError):
        agent.core.gate.spec_from(agent.wall(), {"operator": "work", "pipeline_toml": with_work("os:system")}, template=good)
    assert any("from worker p.work.0" in r.getMessage() for r in caplog.records)
    # a pipeline text nested 100k deep is refused, not a RecursionError in the agent's loop
    deep = spec_body("agent.operators.builtin:identity")
    deep["pipeline_toml"] = "x = " + "[" * 100_000 + "]" * 100_000 + "\n" + deep["pipeline_toml"]
    with pytest.raises(ValueError, match="nested too deeply"):
        agent.core.gate.spec_from(agent.wall(), deep, template=None)
    # an operator that is not in the pipeline text
    with pytest.raises(ValueError, match="not in pipeline"):
        agent.core.gate.spec_from(agent.wall(), dict(spec_body("agent.operators.builtin:identity"), operator="nope"), template=None)
    assert names["evil"] not in sys.modules and names["ops"] not in sys.modules  # the agent imports no user code
    assert not (tmp_path / "markers" / "evil_imported").exists()
    assert hosted.hosted(tmp_path / "state") == []  # nothing saved


def test_spec_paths_and_the_spool_are_the_nodes_own(tmp_path: Path) -> None:
    agent = agent_for(tmp_path, f'[spill]\nenabled = true\nspool_dir = "{tmp_path}/spool"\nship = "none"\n')
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "link").symlink_to(tmp_path)
    ok = "agent.operators.builtin:identity"
    for sink_dir in (f"{tmp_path}/state/../escape", "/x/../escape", f"{tmp_path}/state/link/escape", "rel", 7):
        with pytest.raises(ValueError, match="extra.sink_dir"):
            agent.core.gate.spec_from(agent.wall(), spec_body(ok, sink_dir=sink_dir), template=None)
    spec = agent.core.gate.spec_from(agent.wall(), spec_body(ok, sink_dir=f"{tmp_path}/spool/sinks"), template=None)
    assert spec.extra["sink_dir"] == f"{tmp_path}/spool/sinks"
    # a request's spool settings never reach the worker: the node's own replace them at start
    spec = agent.core.gate.spec_from(agent.wall(), spec_body(ok, spill={"dir": "/tmp/evil", "max_bytes": 1}), template=None)
    assert "spill" not in spec.extra
    assert agent.spill.with_spill(spec).extra["spill"]["dir"] == f"{tmp_path}/spool"
    # a source's profile file is a path too
    text = with_work(ok).replace('function = "agent.operators.taxi:source"',
                                                 'function = "agent.operators.taxi:source"\n'
                                                 'params = { profile = "csv", csv = "/etc/fog-agent/tls/client.key" }')
    with pytest.raises(ValueError, match="params.csv"):
        agent.core.gate.spec_from(agent.wall(), {"instance": "p.source.0", "operator": "source", "pipeline": "p", "pipeline_toml": text},
                         template=None)
    assert not (tmp_path / "escape").exists()
    agent.spill.close()


def test_readopt_sets_aside_a_stored_spec_the_node_does_not_admit(tmp_path: Path) -> None:
    agent = agent_for(tmp_path)
    started: List[InstanceSpec] = []
    agent.supervisor.start = lambda spec, now: started.append(spec)  # type: ignore[assignment]
    state = tmp_path / "state"
    broker = BrokerSpec("h", 1)

    def stored(inst: str, func: str, **extra: Any) -> InstanceSpec:
        return InstanceSpec(inst, "work", "me", "c", "p", with_work(func), broker, extra=extra)

    hosted.remember(state, stored("p.work.0", "agent.operators.builtin:identity"))
    hosted.remember(state, stored("p.work.1", "builtins:exec"))  # saved before this node refused it
    hosted.remember(state, stored("p.work.2", "agent.operators.builtin:identity", sink_dir="/x/../escape"))
    agent.core.fencing.started(hosted.hosted(state))
    agent.core.reconciler.readopt(0.0, agent.wall())
    assert [s.instance for s in started] == ["p.work.0"]
    assert [s.instance for s in hosted.hosted(state)] == ["p.work.0"]  # neither re-adopted nor published again
    assert sorted(p.name for p in state.glob("*.refused")) == ["p.work.1.spec.json.refused",
                                                               "p.work.2.spec.json.refused"]
    assert agent.core.counters["refused_specs"] == 2


def test_rehome_from_a_hosted_record_is_admitted_like_a_spawn(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    agent = agent_for(tmp_path)
    created: List[InstanceSpec] = []
    agent.core.creating.create = lambda spec, reply, cause, now: created.append(spec)  # type: ignore[assignment]
    agent.bus.connected, agent.core.view.online, agent.core.rehoming.offline_since = True, {"n9": False}, {"n9": 0.0}
    agent.bus.retained_in = True  # the retained records are in (the sync marker came back)
    record = [spec_body("agent.operators.builtin:identity", "p.work.0"),
              spec_body("builtins:exec", "p.work.1"),
              spec_body("agent.operators.builtin:identity", "p.work.2", sink_dir="/x/../escape")]
    agent.core.view.hosted_by_node["n9"] = record
    caplog.set_level(logging.WARNING, logger="agent.node.daemon")
    agent.core.rehomer.tick(100.0, agent.wall())
    assert [s.instance for s in created] == ["p.work.0"]
    refused = [r.getMessage() for r in caplog.records if "refused spec" in r.getMessage()]
    assert len(refused) == 2 and all("the hosted record of n9" in m for m in refused)


# ---- steering fields of extra: epoch floors and fault injection ----------------------------------

NOW = 1_795_000_000.0  # the node's wall clock in these tests


def test_an_epoch_floor_ahead_of_the_nodes_clock_is_refused_and_never_saved(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A forged `min_epoch` of 2^53 would give the instance an absurd epoch that its receivers
    keep (docs/security.md, "Steering fields"): refused wherever a spec enters from the bus (a
    spawn, a worker's createNode, a re-home from a retained hosted record), as is a hand-over
    state's epoch; a floor a real re-home or hand-over sets (another node's clock, a moment ago,
    within MAX_EPOCH_AHEAD of skew) passes."""
    agent = agent_for(tmp_path)
    agent.wall = lambda: NOW
    ok = "agent.operators.builtin:identity"
    caplog.set_level(logging.WARNING, logger="agent.node.daemon")
    with pytest.raises(ValueError, match="extra.min_epoch"):
        agent.core.gate.spec_from(agent.wall(), spec_body(ok, min_epoch=2 ** 53), template=None, requester="peer n7")
    ahead = int(NOW) + admission.MAX_EPOCH_AHEAD + 1
    for i, extra in enumerate(({"min_epoch": 2 ** 53}, {"min_epoch": ahead}, {"min_epoch": "1795000000"},
                               {"min_epoch": True}, {"min_epoch": -1}, {"min_epoch": 1.7e9},
                               {"handover_state": {"epoch": 2 ** 53, "inbound": {}}})):
        with pytest.raises(ValueError, match="extra.(min_epoch|handover_state.epoch)"):
            agent.core.gate.spec_from(agent.wall(), spec_body(ok, f"p.work.{i}", **extra), template=None, requester="peer n7")
    assert agent.core.counters["refused_specs"] == 8
    assert any("from peer n7" in r.getMessage() and "ahead of this node's clock" in r.getMessage()
               for r in caplog.records)
    for floor in (int(NOW), int(NOW) + admission.MAX_EPOCH_AHEAD - 1, 0, None):  # skew within the margin
        spec = agent.core.gate.spec_from(agent.wall(), spec_body(ok, min_epoch=floor), template=None)
        assert spec.extra["min_epoch"] == floor
    handed = agent.core.gate.spec_from(agent.wall(), spec_body(ok, handover_state={"epoch": 4, "inbound": {}}), template=None)
    assert handed.extra["handover_state"]["epoch"] == 4
    # a worker's createNode() carrying a forged floor
    with pytest.raises(ValueError, match="extra.min_epoch"):
        agent.core.gate.spec_from(agent.wall(), {"operator": "work", "extra": {"min_epoch": 2 ** 53}}, template=handed)
    # a re-home from a dead node's retained hosted record: the plan keeps the record's larger floor
    created: List[InstanceSpec] = []
    agent.core.creating.create = lambda spec, reply, cause, now: created.append(spec)  # type: ignore[assignment]
    agent.bus.connected, agent.core.view.online, agent.core.rehoming.offline_since = True, {"n9": False}, {"n9": 0.0}
    agent.bus.retained_in = True  # the retained records are in (the sync marker came back)
    agent.core.view.hosted_by_node["n9"] = [spec_body(ok, "p.work.0"), spec_body(ok, "p.work.1", min_epoch=2 ** 53)]
    agent.core.rehomer.tick(100.0, agent.wall())
    assert [(s.instance, s.extra["min_epoch"]) for s in created] == [("p.work.0", int(NOW))]
    assert hosted.hosted(tmp_path / "state") == []  # nothing refused was saved


def test_a_stored_epoch_floor_survives_a_clock_set_back(tmp_path: Path) -> None:
    """A spec in the node's own state dir was held to the clock when it arrived; a Pi without a
    real-time clock may boot with an older time, which must not set its instances aside. A
    malformed floor there is still refused."""
    agent = agent_for(tmp_path)
    agent.wall = lambda: NOW - 3600.0  # booted with the time saved an hour before the re-home
    started: List[InstanceSpec] = []
    agent.supervisor.start = lambda spec, now: started.append(spec)  # type: ignore[assignment]
    state = tmp_path / "state"
    broker = BrokerSpec("h", 1)
    text = with_work("agent.operators.builtin:identity")
    hosted.remember(state, InstanceSpec("p.work.0", "work", "me", "c", "p", text, broker, extra={"min_epoch": int(NOW)}))
    hosted.remember(state, InstanceSpec("p.work.1", "work", "me", "c", "p", text, broker, extra={"min_epoch": "x"}))
    agent.core.fencing.started(hosted.hosted(state))
    agent.core.reconciler.readopt(0.0, agent.wall())
    assert [s.instance for s in started] == ["p.work.0"] and started[0].extra["min_epoch"] == int(NOW)
    assert [p.name for p in state.glob("*.refused")] == ["p.work.1.spec.json.refused"]


def test_crash_at_is_honoured_only_where_fault_injection_is_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """`extra.crash_at` kills a worker at a named point (agent.instance.worker `crash_point`): from
    a request it is dropped, unless the node's environment enables fault injection (the
    reliability tests do; nothing else)."""
    assert admission.ENV_FAULT_INJECTION == "FOG_AGENT_FAULT_INJECTION"  # the name tests/test_reliability.py sets
    agent = agent_for(tmp_path)
    ok = "agent.operators.builtin:identity"
    crash = "p.work.0:spawn_requested"
    caplog.set_level(logging.WARNING, logger="agent.node.daemon")
    for value in (None, "0", "true", "yes"):
        if value is None:
            monkeypatch.delenv(admission.ENV_FAULT_INJECTION, raising=False)
        else:
            monkeypatch.setenv(admission.ENV_FAULT_INJECTION, value)
        spec = agent.core.gate.spec_from(agent.wall(), spec_body(ok, crash_at=crash, sink_dir=f"{tmp_path}/state/s"), template=None)
        assert "crash_at" not in spec.extra and spec.extra["sink_dir"] == f"{tmp_path}/state/s", value
        child = agent.core.gate.spec_from(agent.wall(), {"operator": "work", "extra": {"crash_at": "x:spawn_requested"}}, template=spec)
        assert "crash_at" not in child.extra
    assert any("dropped extra.crash_at" in r.getMessage() and admission.ENV_FAULT_INJECTION in r.getMessage()
               for r in caplog.records)
    monkeypatch.setenv(admission.ENV_FAULT_INJECTION, "1")
    spec = agent.core.gate.spec_from(agent.wall(), spec_body(ok, crash_at=crash), template=None)
    assert spec.extra["crash_at"] == crash
    assert agent.core.gate.spec_from(agent.wall(), {"operator": "work"}, template=spec).extra["crash_at"] == crash  # copies too


# ---- the worker refuses on its own ---------------------------------------------------------------


def test_the_worker_refuses_a_function_before_importing_or_creating_anything(
        tmp_path: Path, opsdir: Tuple[Path, Dict[str, str]]) -> None:
    pkgs, names = opsdir
    state = tmp_path / "wstate"
    spec = InstanceSpec("p.work.0", "work", "me", "c", "p", with_work(f"{names['evil']}:run"),
                        BrokerSpec("127.0.0.1", 1), state_dir=str(state), extra={"sink_dir": str(tmp_path / "wsink")})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(pkgs)]))
    env.pop(admission.ENV_MODULES, None)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "agent.instance.worker"], input=spec.to_json() + "\n",
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2  # EXIT_BAD_SPEC: the agent does not restart it
    [line] = [json.loads(x) for x in r.stdout.splitlines() if x.strip()]
    assert line["event"] == "exit" and line["code"] == 2
    assert f"{names['evil']}:run" in line["reason"] and "refused" in line["reason"]
    assert "Traceback" not in r.stderr and f"{names['evil']}:run" in r.stderr
    assert not (tmp_path / "markers" / "evil_imported").exists()
    assert not state.exists() and not (tmp_path / "wsink").exists()
    assert time.monotonic() - t0 < 30


# ---- a real agent on a real broker ---------------------------------------------------------------


@pytest.mark.broker
def test_a_real_agent_refuses_spawns_of_code_escaping_paths_and_forged_epochs(
        tmp_path: Path, mosquitto: Any, opsdir: Tuple[Path, Dict[str, str]]) -> None:
    from agent.node.deploy import RpcClient
    from agent_process import wait_until_answers

    pkgs, names = opsdir
    cluster = "sec" + uuid.uuid4().hex[:6]
    state = tmp_path / "state"
    state.mkdir()
    (state / "link").symlink_to(tmp_path)
    conf = tmp_path / "n1.toml"
    conf.write_text(f'[agent]\nnode = "n1"\ncluster = "{cluster}"\nslots = 2\nstate_dir = "{state}"\n'
                    f'state_period = 0.5\nheartbeat_period = 0.2\nshutdown_timeout = 3.0\n'
                    f'[operators]\nmodules = ["{names["ops"]}"]\n'
                    f'[mqtt]\nhost = "{mosquitto.host}"\nport = {mosquitto.port}\n[metrics]\nport = 0\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(pkgs)]))
    log_path = tmp_path / "n1.log"
    with open(log_path, "w") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "agent", "run", "--config", str(conf), "--no-warm-worker"],
                                stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
    try:
        with RpcClient(mosquitto.host, mosquitto.port, cluster) as client:
            wait_until_answers(client, "n1", lambda: proc.poll() is None)  # the agent is up
            bad = [spec_body("builtins:exec", "p.work.1"), spec_body(f"{names['evil']}:run", "p.work.2"),
                   spec_body(f"{names['ops']}:system", "p.work.3"),  # allowed module, imported name: the worker refuses
                   spec_body(f"{names['ops']}:double", "p.work.4", sink_dir=f"{state}/../escape"),
                   spec_body(f"{names['ops']}:double", "p.work.5", sink_dir=f"{state}/link/escape"),
                   spec_body(f"{names['ops']}:double", "p.work.6", min_epoch=2 ** 53)]  # a forged epoch floor
            replies = [client.call("n1", {"op": "spawn", "spec": b, "cause": "rpc"}, timeout=20) for b in bad]
            good = client.call("n1", {"op": "spawn", "spec": spec_body(f"{names['ops']}:double", "p.work.0")},
                               timeout=20)
        assert good["ok"] and good["instance"] == "p.work.0", good
        assert [r["ok"] for r in replies] == [False] * 6, replies
        assert "'builtins:exec' refused" in replies[0]["error"] and "allowed here" in replies[0]["error"]
        assert f"{names['evil']}:run" in replies[1]["error"]
        assert "extra.sink_dir" in replies[3]["error"] and "extra.sink_dir" in replies[4]["error"]
        assert "extra.min_epoch" in replies[5]["error"] and "ahead of this node's clock" in replies[5]["error"]
        # the allowed module ran in the worker (the agent handed its list over), never in the agent
        pids = (tmp_path / "markers" / "ops_imported").read_text().split()
        assert pids and str(proc.pid) not in pids
        assert not (tmp_path / "markers" / "evil_imported").exists()
        assert not (tmp_path / "escape").exists()
        assert [s.instance for s in hosted.hosted(state)] == ["p.work.0"]  # refused specs are never saved
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert text.count("refused spec of instance") == 5, text  # p.work.3 is refused by its worker
    assert "is not defined in" in text
    assert proc.returncode == 0
