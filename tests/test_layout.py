"""The package layout of docs/runtime.md ("Layout"): no module imports a package of a higher layer,
not even inside a function (a hidden upward dependency is how a fog node ends up importing a tool
or fogctl importing the daemon), and the node's package imports the lab (`foglab`, not in its
wheel or .deb) in one place only: the CLI hook that finds the lab's commands."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import List, Optional, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Bottom up, as docs/runtime.md lists them; entries of one inner list share a layer.
LAYERS = [
    ["wire", "topics", "schema", "files", "refs", "journal", "log", "identity", "metrics_spec", "notify",
     "events", "config", "central_config", "exitcodes", "sites", "signing", "ed25519", "__init__"],
    ["protocol", "policy"],
    ["dataplane", "control", "mqtt"],
    ["spill"],
    ["operators", "pipeline_check"],
    ["measure"],
    ["instance"],
    ["node"],
    ["fogctl", "collector"],
    ["analytics", "testing"],
    ["cli", "__main__"],
]
RANK = {part: i for i, layer in enumerate(LAYERS) for part in layer}


def _part(module: str) -> Optional[str]:
    parts = module.split(".")
    return parts[1] if parts[0] == "agent" and len(parts) > 1 else None


def test_every_package_has_a_layer() -> None:
    parts = {p.stem if p.is_file() else p.name for p in (ROOT / "agent").iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}
    assert parts - set(RANK) == set(), "add the new package to LAYERS and to docs/runtime.md"


def test_no_module_imports_a_higher_layer() -> None:
    upward: List[str] = []
    for path in sorted((ROOT / "agent").rglob("*.py")):
        me = _part(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names] if node.module == "agent" else [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                target = _part(name)
                if target is not None and me is not None and target != me and RANK.get(target, -1) > RANK[me]:
                    upward.append(f"{path.relative_to(ROOT)}:{node.lineno} {me} -> {target}")
    assert upward == []


# The one import of the lab allowed in `agent`: (file, function) of agent.cli.main's hook.
LAB_HOOK = ("agent/cli/main.py", "_lab_cli")
LAB_NAME = re.compile(r"^foglab(\.|$)")


def lab_imports(rel: str, source: str) -> List[Tuple[str, int, str]]:
    """(file, line, function) of every import of `foglab` in `source`, outside LAB_HOOK: import
    statements at any depth, and a module name given as a string (importlib.import_module,
    __import__), which would dodge the statement check."""
    found: List[Tuple[str, int, str]] = []

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            names: List[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [child.module]
            elif isinstance(child, ast.Call):
                names = [a.value for a in child.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if any(LAB_NAME.match(n) for n in names) and (rel, func) != LAB_HOOK:
                found.append((rel, child.lineno, func))
            visit(child, inner)

    visit(ast.parse(source), "<module>")
    return found


def test_the_node_package_imports_the_lab_only_in_the_cli_hook() -> None:
    found: List[Tuple[str, int, str]] = []
    for path in sorted((ROOT / "agent").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        found += lab_imports(rel, path.read_text())
    assert found == [], "the node's package must run without the lab: only agent.cli.main._lab_cli imports foglab"
    hook = (ROOT / LAB_HOOK[0]).read_text()
    assert lab_imports("elsewhere.py", hook) != [], "the CLI hook no longer imports foglab.cli"


def test_the_node_admits_as_built_in_only_its_own_operators_and_the_lab_registers_its_own() -> None:
    """The allow-list's built-ins are the node's package's (a node without the lab runs them);
    the demo's operators are the lab's, which registers them as entry points of fog-agent-lab."""
    import importlib

    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib  # type: ignore[no-redef]
    from agent.operators.admission import BUILTIN, ENTRY_POINT_GROUP

    assert sorted(r for r in BUILTIN if not r.startswith("agent.")) == []
    assert not (ROOT / "agent" / "operators" / "debs.py").exists()
    eps = tomllib.loads((ROOT / "lab" / "pyproject.toml").read_text())["project"]["entry-points"][ENTRY_POINT_GROUP]
    assert eps and all(LAB_NAME.match(ref) for ref in eps.values()), eps
    for ref in eps.values():
        module, _, name = ref.partition(":")
        assert getattr(importlib.import_module(module), name).__module__ == module, ref


def test_the_lab_check_sees_every_way_of_importing_the_lab() -> None:
    source = ("import foglab.tools.demo\n"
              "def f():\n    from foglab.sim import checker\n"
              "def g():\n    import importlib\n    return importlib.import_module('foglab.cli')\n"
              "def _lab_cli():\n    import foglab.cli\n"
              "import foglabs, agent.tools\n")
    assert [(line, func) for _, line, func in lab_imports("agent/node/x.py", source)] == [
        (1, "<module>"), (3, "f"), (6, "g"), (8, "_lab_cli")]
    assert [(line, func) for _, line, func in lab_imports(LAB_HOOK[0], source)] == [
        (1, "<module>"), (3, "f"), (6, "g")]


def _module_name(path: Path, top: Path) -> str:
    parts = path.relative_to(top).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT / "agent") -> dict:
    """module -> the agent modules it imports, at any depth: inside functions and under
    TYPE_CHECKING too (a cycle hidden there is still a cycle a reader has to untangle)."""
    modules = {_module_name(p, root.parent): p for p in root.rglob("*.py")}
    graph: dict = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != mod and not mod.startswith(t + "."):  # a package's own __init__ is no edge
                    graph[mod].add(t)
    return graph


def cycles(graph: dict) -> List[frozenset]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict = {}
    low: dict = {}
    stack: List[str] = []
    on: set = set()
    out: List[frozenset] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on:
                    low[v] = min(low[v], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(frozenset(comp))
    return out


def test_no_import_cycle_even_through_local_or_type_only_imports() -> None:
    found = set(cycles(import_graph()))
    assert found == set(), f"import cycles: {found}"


def _members_used(path: Path, names: Tuple[str, ...]) -> set:
    """Attributes read through `self.w`, `w` or `worker` (the instance) in one module."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in names:
            used.add(node.attr)
        elif (isinstance(base, ast.Attribute) and base.attr == "w" and isinstance(base.value, ast.Name)
              and base.value.id == "self"):
            used.add(node.attr)
    return used


@pytest.mark.parametrize("part", ["driver.py", "adoption.py", "creates.py", "scaling_events.py", "group_side.py",
                                  "moves.py"])
def test_no_part_of_the_instance_holds_the_instance(part: str) -> None:
    """The parts that once called back into the instance (through `self.w`) act through the parts
    they are handed instead (agent.instance.driver_parts, .group_side, .moves_parts), and the
    driver's idle copies, createNode() requests and events return commands: none reads a member
    through a name of the instance, and none imports agent.instance.core."""
    path = ROOT / "agent" / "instance" / part
    tree = ast.parse(path.read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "agent.instance.core" not in imported
    assert _members_used(path, ("w", "worker", "instance")) == set()


def test_the_cycle_finder_sees_a_cycle_made_by_a_function_local_import(tmp_path: Path) -> None:
    pkg = tmp_path / "agent" / "x"
    pkg.mkdir(parents=True)
    (tmp_path / "agent" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from agent.x.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from agent.x import a\n")
    (pkg / "c.py").write_text("from . import a\n")
    assert cycles(import_graph(tmp_path / "agent")) == [frozenset({"agent.x.a", "agent.x.b"})]


def _external_imports(module: str) -> set:
    path = ROOT.joinpath(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found - {"agent"}


NETWORK = {"paho", "socket", "ssl", "select", "subprocess"}
PURE = NETWORK | {"os", "time", "threading", "random"}  # no connection, clock, file, thread or random
NODE_CORE = {"paho", "socket", "select", "subprocess", "threading", "random"}
# The sans-IO cores and what they may not reach, through any chain of agent modules: the pure
# packages touch no clock, file, thread or random at all; the spill's wire format and the
# collector's core verify files on disk but open no connection.
SANS_IO = {
    "agent.protocol": PURE,
    "agent.dataplane": PURE,
    "agent.policy": PURE,
    "agent.spill.shipping": NETWORK,
    "agent.spill.ackhold": PURE,
    "agent.collector.core": NETWORK,
    # The node daemon's decisions (agent.node.gate, ...): they read pipeline texts and spec paths
    # through agent.config and agent.operators.admission (which import os, ssl and time for their
    # file checks), but open no connection, start no thread or process and draw no random number;
    # the clock is an argument.
    "agent.node.gate": NODE_CORE,
    "agent.node.pins": PURE,
    "agent.node.restarts": NODE_CORE,
    "agent.node.rehoming": PURE,
    "agent.node.fleetview": NODE_CORE,
    "agent.node.drain": PURE,
    "agent.node.loopevents": PURE,
    "agent.node.hostsync": PURE,
    "agent.node.spawns": PURE,
    "agent.node.contexts": NODE_CORE,
    "agent.node.fencing": NODE_CORE,
    "agent.node.exits": NODE_CORE,
    "agent.node.rehomer": NODE_CORE,
    "agent.node.reconcile": NODE_CORE,
    "agent.node.workerlines": NODE_CORE,
    "agent.node.routes": PURE,
    "agent.node.workers": PURE,
    "agent.node.rpc": PURE,
    # The node's core and every part it holds; the daemon, the bus, the supervisor, the report and
    # the site manager's hooks are the shell around it.
    "agent.node.core": NODE_CORE,
    "agent.node.requests": NODE_CORE,
    "agent.node.spawnshell": NODE_CORE,
    "agent.node.inbound": NODE_CORE,
    "agent.node.handover": NODE_CORE,
    "agent.node.replicas": NODE_CORE,
    "agent.node.statexfer": NODE_CORE,
    # the hand-over's wire codec, the scaling driver's parts with state of their own (the driver
    # itself draws from its own seeded generator and reads agent.config), and what the instance
    # hands the driver and the moves instead of itself
    "agent.instance.handover_wire": PURE,
    "agent.instance.adoption": PURE,
    "agent.instance.creates": PURE,
    "agent.instance.scaling_events": PURE,
    "agent.instance.clock": PURE,
    "agent.instance.driver_parts": PURE,
    "agent.instance.moves_parts": PURE,
    "agent.instance.emitter": PURE,  # how the parts return their commands
}


@pytest.mark.parametrize("package", sorted(SANS_IO))
def test_a_sans_io_core_reaches_no_io_through_its_imports(package: str) -> None:
    graph = import_graph()
    todo = [m for m in graph if m == package or m.startswith(package + ".")]
    assert todo, package
    seen: set = set()
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += graph[m]
    reached = {m: sorted(_external_imports(m) & SANS_IO[package]) for m in sorted(seen)}
    assert {m: b for m, b in reached.items() if b} == {}
