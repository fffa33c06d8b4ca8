"""What an agent hands a worker process, and the local control channel between them.

Why a spec file and a pipe instead of MQTT between an agent and its own workers: the agent must
notice a dead or hung worker without the broker (heartbeats on a pipe stop when the process
stops), and a worker's request to create a sibling (the paper's createNode()) must reach its own
agent even while the broker is restarting. MQTT is for everything that crosses nodes.

Worker process: `python -m agent.instance.worker` with one JSON `InstanceSpec` line on stdin,
then the control channel is JSON lines:

worker -> agent (worker's stdout; logs go to stderr):
  {"event": "ready"}                                   inbox subscribed (invariant 2: only now may
                                                       anybody be told this instance exists)
  {"event": "heartbeat", "stats": {...}}               every heartbeat_period while healthy
  {"event": "spawn", "request": "<id>", "spec": {...}} createNode(): place and start a new instance
  {"event": "exit", "code": 0, "reason": "..."}        just before a clean exit (after draining)

agent -> worker (worker's stdin):
  {"event": "spawned", "request": "<id>", "ok": true, "instance": "...", "node": "..."}
  {"event": "spawned", "request": "<id>", "ok": false, "error": "..."}
  {"event": "stop"}                                    drain and exit (agent shutdown)
  {"event": "hosts", "bound": {"<instance>": "<node>"}} which node hosts which instance of the
                                                       pipeline: an inbox message counts only if
                                                       written by its sender's node (docs/security.md)

A chain (several consecutive instances in one process, docs/runtime.md "Chaining") gets the line
`{"chain": [spec, spec, ...]}` (upstream first) instead of one spec. Every line it writes carries
"member": the instance it is about; a line to it with "member" goes to that instance, one
without to every instance, except "stop", which stops the whole chain (upstream first).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Tuple

from agent.mqtt.settings import BrokerSpec


@dataclass(frozen=True)
class InstanceSpec:
    """Everything a worker needs to run one operator instance, serializable as JSON.

    `pipeline_toml` is the pipeline description text itself (not a path): an instance placed on a
    remote node must not depend on files that exist only where the pipeline was deployed.
    `succs`/`preds` are the initial routing table; `keeper` is true for the first instance of an
    operator (it never terminates itself). `restart` is true when the agent restarts a crashed
    worker with the same identity (the worker then restores its persisted state).

    A spec that arrives from the bus or the state dir is input to check, not to trust: the agent
    replaces its node-local fields and admits its operator function and paths
    (`Gate.spec_from`, agent.operators.admission) before any worker sees it.
    """

    instance: str
    operator: str
    node: str
    cluster: str
    pipeline: str
    pipeline_toml: str
    broker: BrokerSpec
    succs: Tuple[str, ...] = ()
    preds: Tuple[str, ...] = ()
    keeper: bool = False
    active: bool = True
    state_dir: str = "/var/lib/fog-agent"
    heartbeat_period: float = 1.0
    restart: bool = False
    extra: Dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "InstanceSpec":
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "InstanceSpec":
        data = dict(data)
        data["broker"] = BrokerSpec(**data["broker"])
        data["succs"] = tuple(data.get("succs", ()))
        data["preds"] = tuple(data.get("preds", ()))
        return cls(**data)


def chain_json(specs: List[InstanceSpec]) -> str:
    """The first line for a chain process: its members' specs, upstream first."""
    return json.dumps({"chain": [asdict(s) for s in specs]}, sort_keys=True)


def specs_from_line(text: str) -> List[InstanceSpec]:
    """The specs of a worker's first line: one spec, or a chain's (see the module docstring)."""
    data = json.loads(text)
    if isinstance(data, dict) and "chain" in data:
        members = data["chain"]
        if not isinstance(members, list) or len(members) < 2 or not all(isinstance(m, dict) for m in members):
            raise ValueError("chain: expected a list of at least 2 instance specs")
        return [InstanceSpec.from_dict(m) for m in members]
    if not isinstance(data, dict):
        raise ValueError("expected an instance spec (a JSON object)")
    return [InstanceSpec.from_dict(data)]


def request_spec(spec: InstanceSpec) -> Dict[str, Any]:
    """The spec as sent in an MQTT `spawn` request: everything but the broker settings.

    The agent that starts the instance always puts its OWN broker settings into the spec
    (`Gate.spec_from`), so the requester's are useless there, and they hold its credentials
    (password, certificate paths): never publish them where other nodes can read them.
    """
    data = json.loads(spec.to_json())
    data.pop("broker", None)
    return data


def control_line(event: str, **fields: Any) -> str:
    """One line of the control channel (newline-terminated)."""
    return json.dumps({"event": event, **fields}, sort_keys=True) + "\n"


def parse_control_line(line: str) -> Dict[str, Any]:
    msg = json.loads(line)
    if not isinstance(msg, dict) or not isinstance(msg.get("event"), str):
        raise ValueError(f"control line without an event: {line[:80]!r}")
    return msg


__all__: List[str] = ["BrokerSpec", "InstanceSpec", "chain_json", "control_line", "parse_control_line", "request_spec",
                      "specs_from_line"]
