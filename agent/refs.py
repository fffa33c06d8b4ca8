"""How an operator function is named in a pipeline (`function = "package.module:name"`).

Why a module of its own, below the configuration and the allow-list: `agent.config` checks the
name's form while it loads a pipeline, and `agent.operators.admission` decides whether a
well-formed name may be imported on this node (docs/security.md, "No code from the bus"). The form
is checked on text only: nothing is imported here.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Mapping, Optional, Tuple

log = logging.getLogger(__name__)

MAX_REF = 200  # characters of a "module:name"


# Built-in modules that moved when agent/runtime/ was split (0.2.0). Specs saved by an older agent
# (hosted records, state dirs) and pipelines written for it still name the old modules; they are
# read under the new names, with one warning, until 0.3.0 (docs/operators.md, "Upgrading").
RENAMED_MODULES: Mapping[str, str] = {
    "agent.runtime.operators": "agent.operators.builtin",
    "agent.runtime.taxi": "agent.operators.taxi",
}


def current_ref(ref: str) -> str:
    """`ref` with a built-in module renamed since 0.1 replaced by its current name."""
    module, sep, name = ref.partition(":")
    new = RENAMED_MODULES.get(module)
    if new is None:
        return ref
    log.warning("operator function %r was renamed %r in fog-agent 0.2.0; the old name is read until 0.3.0",
                ref, f"{new}{sep}{name}")
    return f"{new}{sep}{name}"


def _dotted(name: str) -> bool:
    return bool(name) and all(p.isidentifier() and p.isascii() for p in name.split("."))


def parse_ref(ref: Any) -> Tuple[str, str]:
    """("module", "name") of a "module:name", or ValueError for anything else (odd characters,
    spaces, a second colon, non-ASCII look-alikes)."""
    if not isinstance(ref, str) or len(ref) > MAX_REF:
        raise ValueError('expected "package.module:function"')
    module, sep, name = ref.partition(":")
    if not sep or not _dotted(module) or not (name.isidentifier() and name.isascii()):
        raise ValueError('expected "package.module:function"')
    return module, name


def check_module_name(module: Any) -> Optional[str]:
    """What is wrong with a module name in `[operators] modules` (None: nothing). Standard
    library modules and fog-agent's own are refused: listing `os` or `subprocess` would allow
    their functions, listing `agent.operators.builtin` its helpers."""
    if not isinstance(module, str) or not _dotted(module):
        return 'expected a module name like "mylab.ops"'
    top = module.split(".")[0]
    if top in getattr(sys, "stdlib_module_names", ()) or top in sys.builtin_module_names:
        return "a standard library module is not an operator module"
    if top == "agent":
        return "fog-agent's own operators are built in (BUILTIN); list only your own modules"
    return None
