"""The `--json` shapes of every command: one JSON Schema (draft 2020-12) per command.

Why data in the package: a script that reads `fogctl status --json` and the tests that run the
commands read the same schemas (`fogctl schema COMMAND` prints one), and the section "JSON
output" of docs/fogctl.md is generated from them (`markdown()`; `python -m agent.fogctl.schemas`
prints it), so the three cannot drift apart. tests/test_json_shapes.py validates each schema
against the real output of its command.

The shapes are what the commands print with `--json`: fogctl's views (`agent/fogctl/views.py`),
its command handlers (`agent/fogctl/commands.py`), `fog-agent check-config`
(`agent/cli/config_cmd.py`). A key a schema lists is always printed unless the row says
"optional"; objects a command copies from the bus as they came (an event's `detail`, an rpc
reply's `result`) are open. Within an object no other key is printed: `additionalProperties` is
false wherever the command builds the object itself.
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any, Dict, List, Optional, Sequence

from agent.fogctl.fleet_sites import STALE_AFTER_S

__all__ = ["SCHEMAS", "ERROR", "DIALECT", "schema", "markdown"]

DIALECT = "https://json-schema.org/draft/2020-12/schema"

# ---- building blocks ------------------------------------------------------------------------------

S: Dict[str, Any] = {"type": "string"}
NUM: Dict[str, Any] = {"type": "number"}
INT: Dict[str, Any] = {"type": "integer"}
BOOL: Dict[str, Any] = {"type": "boolean"}


def _d(base: Dict[str, Any], description: str) -> Dict[str, Any]:
    return dict(base, description=description)


def _null(base: Dict[str, Any], description: str = "") -> Dict[str, Any]:
    """`base` or null (a value fogctl does not know)."""
    out = dict(base)
    if "enum" in out:
        out["enum"] = list(out["enum"]) + [None]
    else:
        out["type"] = [out["type"], "null"] if isinstance(out["type"], str) else list(out["type"]) + ["null"]
    if description:
        out["description"] = description
    return out


def _list(items: Dict[str, Any], description: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {"type": "array", "items": items}
    if description:
        out["description"] = description
    return out


def _obj(props: Dict[str, Any], optional: Sequence[str] = (), description: str = "",
         closed: bool = True) -> Dict[str, Any]:
    out: Dict[str, Any] = {"type": "object", "properties": props,
                           "required": [k for k in props if k not in optional]}
    if closed:
        out["additionalProperties"] = False
    if description:
        out["description"] = description
    return out


def _open(description: str) -> Dict[str, Any]:
    return {"type": "object", "description": description}


def _map(values: Dict[str, Any], description: str) -> Dict[str, Any]:
    return {"type": "object", "additionalProperties": values, "description": description}


CLUSTER = _d(S, "the cluster (topic prefix fog/<cluster>)")
PHASE = {"enum": ["starting", "active", "terminating", "unknown"]}
LOCK = {"enum": ["idle", "requesting", "in_cs"]}
EVENT_TYPES = ["decision", "scale_out", "scale_in", "spawned", "terminated", "refused", "lock_request",
               "lock_enter", "lock_exit", "drain", "steer", "site_action", "spool_full", "spool_resumed",
               "spool_recovered"]

INSTANCE = _obj({
    "id": S, "operator": S, "node": S, "pipeline": _null(S),
    "keeper": _d(BOOL, "the operator's keeper (never terminates)"),
    "phase": PHASE, "load": _null(NUM, "records/s"), "capacity": _null(NUM, "records/s"),
    "ratio": _null(NUM, "load / capacity"),
    "lock": _null(LOCK, "2-FGME state as a whole (coordination = \"fgme\")"),
    "boundary": _null(S, "the boundary of an older single-boundary lock state"),
    "locks": _map(LOCK, "2-FGME state per boundary \"a|b\""),
})

NODE_PIN = _obj({"operator": S, "pipeline": _null(S), "until": _null(NUM, "unix seconds; null: until released")})

REASON = _obj({
    "load": NUM, "capacity": NUM, "ratio": NUM,
    "probability": _d(NUM, "p of the decision"), "draw": _d(NUM, "the uniform draw compared with p"),
    "action": _d(S, "duplicate, terminate or none"), "count": INT,
}, optional=("probability", "draw", "action"))

EVENT = _obj({
    "v": {"const": 1}, "ts": _d(NUM, "unix seconds"), "node": S, "instance": _null(S), "operator": _null(S),
    "pipeline": _null(S), "type": {"enum": EVENT_TYPES},
    "reason": _null(REASON, "the numbers a scaling decision was made from"),
    "detail": _open("per type: cause, new, boundary, error, source, ... (docs/fogctl.md, Payloads)"),
}, description="one event (agent/events.py)")

PROBLEM = _obj({
    "file": _d(S, "the file as named on the command line"),
    "key": _d(S, "the key, e.g. [operator[2]].params.feild; empty when the file as a whole"),
    "expected": S,
    "given": {"description": "the value found (null when none was given; a value JSON cannot hold as text)"},
    "message": _d(S, "the line printed on stderr"),
})

ERROR = {
    "$schema": DIALECT,
    "title": "error",
    "description": "a check that failed: what `fog-agent check-config --json` and `fogctl deploy --json` "
                   "(`fog-agent deploy --json`) print on stdout with exit status 1 (the same lines go to stderr)",
    **_obj({"ok": {"const": False}, "errors": dict(_list(PROBLEM), minItems=1),
            "warnings": _list(S, "check-config only")}, optional=("warnings",)),
}

KEEPER = _obj({"operator": S, "instance": S, "node": S})
STOPPED = _obj({"instance": S, "node": S})

SITE_CLAIM: Dict[str, Any] = {
    "leader": _null(S, "null: none leads (void, or the lease expired)"),
    "lease_left_s": _d(NUM, "negative once expired"), "expired": BOOL,
    "target": _null(NUM, "the spare-capacity fraction kept"), "spare": _null(NUM), "min_nodes": _null(INT),
    "max_nodes": _null(INT),
    "pending": _null(_open("{action, node, since}: the action under way")),
    "released": _list(S, "nodes released to the pool"),
    "actions": _list(_open("{action, node, reason, ts}"), "its last actions, oldest first"),
    "last_leader": _d(S, "with void: the node of the latest claim"),
    "void": _d(S, "why none leads although a lease runs"),
}
SITES_AT_CENTRE = _map({"oneOf": [_obj({"leader": {"const": None}}, description="no claim"),
                                  _obj(SITE_CLAIM, optional=("last_leader", "void"), description="a claim")]},
                       "at the central broker: each bridged site's site manager, by site (a document as above)")

# ---- one schema per command -----------------------------------------------------------------------

_SHAPES: Dict[str, Dict[str, Any]] = {
    "status": _obj({
        "cluster": CLUSTER,
        "nodes": _list(_obj({
            "node": S, "status": {"enum": ["online", "offline", "unknown"]},
            "draining": _d(BOOL, "fogctl drain holds the node"),
            "cpu": _null(NUM, "%; null when offline"), "memory": _null(NUM, "%; null when offline"),
            "temperature": _null(NUM, "degrees C; null when offline or not reported"),
            "slots": _null(INT), "free_slots": _null(INT, "null when offline"),
            "capacity": _null(NUM, "records/s"),
            "instances": _list(S, "instance ids"), "pins": _list(NODE_PIN, "the pins this agent holds"),
            "ts": _null(NUM, "when the agent published its state (unix seconds)"),
            "last_seen_s": _null(NUM, "seconds since ts"), "error": _null(S, "why its state could not be read"),
            "site": _null(S, "at the central broker: the node's site; null: not known"),
            "site_from": _null({"enum": ["bridge", "this broker"]},
                               "at the central broker: its site's bridge delivered its record, or it is connected "
                               "to the central broker itself; null: neither"),
        }, optional=("site", "site_from")), "one per node, by name"),
        "pins": _list(_obj({"operator": S, "pipeline": _null(S), "until": _null(NUM, "the latest end; null: until released"),
                            "nodes": _list(S, "the agents that hold it")}), "fogctl scale pins, once per operator"),
        "sites": _list(_obj({
            "site": S, "nodes": _list(S, "its nodes seen at the centre"), "online": INT,
            "site_manager": _null(S, "the leader its agents would derive; null: none"),
            "newest_state_s": _null(NUM, "age of its newest node state"),
            "stale": _d(BOOL, f"no node state for over {STALE_AFTER_S:g} s: its uplink may be down"),
            "in_settings": _d(BOOL, "named in fogctl's [sites] table"),
        }), "at the central broker (or with a [sites] table): one per site"),
        "stay_in_sites": _list(S, "with sites: what does not cross to the centre"),
    }, optional=("sites", "stay_in_sites")),
    "topology": _obj({
        "cluster": CLUSTER,
        "pipelines": _list(_obj({
            "pipeline": _null(S, "null: instances that name no pipeline"),
            "operators": _list(_obj({"operator": S, "count": INT, "load": _null(NUM, "sum over its instances"),
                                     "instances": _list(INSTANCE, "the keeper first")}), "in pipeline order"),
        })),
    }),
    "latency": _obj({
        "cluster": CLUSTER,
        "measured_ms": _map(_map(NUM, "to -> ms"), "measured RTT, from -> to -> ms"),
        "emulated_ms": _map(_map(NUM, "to -> ms"), "configured emulated delay, from -> to -> ms"),
    }),
    "locks": _obj({
        "cluster": CLUSTER,
        "boundaries": _list(_obj({
            "boundary": _d(S, "\"a|b\""), "in_cs": _list(S), "requesting": _list(S), "idle": _list(S),
            "groups_in_cs": _list(S, "operators"), "groups_requesting": _list(S, "operators"),
        }), "in pipeline order; instance ids sorted"),
    }),
    "pipelines": _obj({
        "cluster": CLUSTER,
        "pipelines": _list(_obj({
            "pipeline": S, "deployed": _d(BOOL, "its record is on pipelines/<name>"),
            "operators": _list(_obj({"operator": S, "instances": INT}), "in pipeline order"),
            "instances": INT,
        })),
    }),
    "site": {"oneOf": [
        _obj({"leader": {"const": None}, "sites": SITES_AT_CENTRE}, optional=("sites",),
             description="no claim: no agent runs the site manager"),
        _obj(dict(SITE_CLAIM, sites=SITES_AT_CENTRE), optional=("last_leader", "void", "sites"), description="a claim"),
    ]},
    "watch": dict(EVENT, description="one event per line (JSON Lines), complete"),
    "why": _obj({
        "instance": S,
        "decisions": _list(EVENT, "oldest first, at most --last"),
        "pinned": _null(_obj({"operator": S, "pipeline": _null(S), "node": _null(S),
                              "until": _null(NUM, "unix seconds; null: until released")}),
                        "the fogctl scale pin that holds it"),
        "rehomed": _null(_obj({"by": S, "at": _d(NUM, "unix seconds")}), "its latest re-home"),
    }),
    "scale": {"oneOf": [
        _obj({
            "ok": _d(BOOL, "false: --wait ran out (exit 1)"), "operator": S, "delta": INT,
            "requests": _list(_obj({"node": S, "request": _open("the scale request sent"),
                                    "result": _open("the agent's reply result")})),
            "pinned": _obj({"pipeline": _null(S), "seconds": _null(NUM, "--for; null: until --release"),
                            "nodes": _list(S)}),
            "instances": _d(INT, "with --wait: active instances at the end"),
            "expected": _d(INT, "with --wait"),
        }, optional=("instances", "expected"), description="scale OPERATOR +N|-N"),
        _obj({"ok": {"const": True}, "operator": S, "pipeline": _null(S), "released": _list(S, "nodes")},
             description="scale --release OPERATOR"),
    ]},
    "drain": _obj({
        "ok": _d(BOOL, "false: --wait ran out (exit 1)"), "node": S, "leaving": _list(S, "instance ids"),
        "result": _open("the agent's reply result"),
        "remaining": _list(S, "with --wait: instances still on the node"),
    }, optional=("remaining",)),
    "deploy": {"oneOf": [
        _obj({"ok": {"const": True}, "pipeline": S, "topic": S,
              "keepers": _list(KEEPER, "in pipeline order")}, description="deployed"),
        {k: v for k, v in ERROR.items() if k not in ("$schema", "title")},
    ]},
    "undeploy": _obj({
        "ok": {"const": True}, "pipeline": S, "topic": S, "stopped": _list(STOPPED, "sources first"),
        "offline": _list(STOPPED, "--force: left on offline nodes"), "forced": BOOL,
    }),
    "keygen": _obj({"ok": {"const": True}, "private": S, "public": S, "key": _d(S, "the key id")}),
}

_TITLES = {name: f"fogctl {name} --json" for name in _SHAPES}
_TITLES["deploy"] = "fogctl deploy --json, fog-agent deploy --json"

# check-config --json: the effective configuration (the file's tables, every default filled in),
# told apart by its tables as the command tells the file's kind; or the error shape.
_CONFIG_KINDS = {"agent": ("agent", "mqtt"), "pipeline": ("pipeline", "operator"),
                 "central": ("collector", "mqtt"), "latency": ("nodes", "rtt_ms")}
_SHAPES["check-config"] = {"oneOf": [
    {"type": "object", "not": {"required": ["ok"]},
     "description": "valid: the effective configuration, the file's own tables and key names",
     "anyOf": [{"required": list(tables), "description": f"{kind}: [{'], ['.join(tables)}] ..."}
               for kind, tables in _CONFIG_KINDS.items()]},
    {k: v for k, v in ERROR.items() if k not in ("$schema", "title")},
]}
_TITLES["check-config"] = "fog-agent check-config FILE --json"

SCHEMAS: Dict[str, Dict[str, Any]] = {
    name: {"$schema": DIALECT, "title": _TITLES[name], **shape} for name, shape in _SHAPES.items()
}
SCHEMAS["error"] = ERROR


def schema(command: str) -> Dict[str, Any]:
    """The schema of `command` ("status", "check-config", "error", ...), a copy."""
    try:
        return copy.deepcopy(SCHEMAS[command])
    except KeyError:
        raise KeyError(f"no JSON schema for {command!r} (known: {', '.join(SCHEMAS)})") from None


# ---- docs/fogctl.md, "JSON output": generated --------------------------------------------------------


def _type(s: Dict[str, Any]) -> str:
    if "const" in s:
        return json.dumps(s["const"])
    if "enum" in s:
        return " \\| ".join(json.dumps(v) for v in s["enum"])
    t = s.get("type")
    if t is None:
        return "any"
    types = [t] if isinstance(t, str) else list(t)
    shown = []
    for one in types:
        if one == "array":
            shown.append(f"array of {_type(s['items'])}")
        elif one == "object" and "additionalProperties" in s and isinstance(s["additionalProperties"], dict):
            shown.append(f"object of {_type(s['additionalProperties'])}")
        else:
            shown.append(one)
    return " \\| ".join(shown)


def _rows(s: Dict[str, Any], path: str, rows: List[List[str]]) -> None:
    """Table rows for the keys of object schema `s` (nested objects and arrays of objects too)."""
    target = s.get("items", s) if s.get("type") == "array" else s
    if target.get("type") == "array":
        target = target["items"]
    props = target.get("properties", {})
    required = set(target.get("required", ()))
    for key, sub in props.items():
        here = f"{path}{key}"
        note = sub.get("description", "")
        if key not in required:
            note = "optional" + (f": {note}" if note else "")
        shown = _type(sub)
        inner = sub.get("items") if sub.get("type") == "array" else sub
        nested = isinstance(inner, dict) and "properties" in inner
        if nested:
            shown = "array of objects" if sub.get("type") == "array" else \
                "object" if "null" not in (sub.get("type") or ()) else "object \\| null"
        rows.append([f"`{here}`", shown, note.replace("|", "\\|")])
        if nested:
            _rows(sub, here + ("[]." if sub.get("type") == "array" else "."), rows)


def _table(s: Dict[str, Any]) -> str:
    rows: List[List[str]] = []
    _rows(s, "", rows)
    lines = ["| key | type | meaning |", "| --- | --- | --- |"]
    lines += [f"| {' | '.join(r)} |" for r in rows]
    return "\n".join(lines)


def _section(name: str, s: Dict[str, Any]) -> str:
    head = [f"#### `{s['title']}`", ""]
    if s.get("description"):
        head += [s["description"][0].upper() + s["description"][1:] + ".", ""]
    if "oneOf" in s:
        parts = []
        for alt in s["oneOf"]:
            what = alt.get("description", "")
            if alt.get("anyOf"):
                kinds = "; ".join(a["description"] for a in alt["anyOf"])
                parts.append(f"One of: {what} (an object with the tables of its kind: {kinds}).")
            elif alt.get("title") == "error" or alt.get("properties", {}).get("errors"):
                parts.append("Or the error shape (`error`, below).")
            elif alt.get("type") == "array" and alt.get("items") in s["oneOf"]:
                parts.append(f"One of: {what}: an array of the objects above.")
            else:
                parts.append(f"One of: {what}:\n\n{_table(alt)}")
        return "\n".join(head) + "\n" + "\n\n".join(parts) + "\n"
    return "\n".join(head) + "\n" + _table(s) + "\n"


def markdown(shapes: Optional[Dict[str, Dict[str, Any]]] = None) -> str:
    """The section of docs/fogctl.md that lists every command's shape (tests compare the two); with
    `shapes`, the same tables for those schemas (`fog-agent`'s, agent/cli/schemas.py)."""
    out = [_section(name, s) for name, s in (SCHEMAS if shapes is None else shapes).items()]
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m agent.fogctl.schemas`: the generated docs section; with a name, that schema."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args:
        print(json.dumps(schema(args[0]), indent=2))
    else:
        print(markdown(), end="")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
