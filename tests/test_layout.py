"""The package layout of docs/runtime.md ("Layout"): no module imports a package of a higher layer,
not even inside a function (a hidden upward dependency is how a fog node ends up importing a tool
or fogctl importing the daemon)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[1]

# Bottom up, as docs/runtime.md lists them; entries of one inner list share a layer.
LAYERS = [
    ["wire", "topics", "schema", "files", "refs", "journal", "log", "identity", "metrics_spec", "notify",
     "events", "config", "central_config", "exitcodes", "sites", "signing", "__init__"],
    ["protocol", "policy"],
    ["dataplane", "control", "mqtt"],
    ["spill"],
    ["operators", "pipeline_check"],
    ["measure"],
    ["instance"],
    ["node"],
    ["fogctl", "collector"],
    ["sim", "analytics", "testing"],
    ["tools"],
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
