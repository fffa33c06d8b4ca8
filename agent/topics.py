"""The MQTT topic space (DESIGN.md section 5), in one place.

Everything an agent publishes is readable with `mosquitto_sub -v -t 'fog/#'`; fogctl and the
daemon build topics only through these functions so that the two never drift apart.
"""

from __future__ import annotations

ROOT = "fog"


def _check(part: str) -> str:
    if not part or any(c in part for c in "/+#\0"):
        raise ValueError(f"invalid topic segment {part!r}: must be non-empty without '/', '+', '#'")
    return part


def base(cluster: str) -> str:
    return f"{ROOT}/{_check(cluster)}"


def inbox(cluster: str, instance: str) -> str:
    """Data batches AND protocol messages to one instance (one FIFO channel per sender)."""
    return f"{base(cluster)}/inbox/{_check(instance)}"


def agent_state(cluster: str, node: str) -> str:
    return f"{base(cluster)}/agents/{_check(node)}/state"


def agent_status(cluster: str, node: str) -> str:
    return f"{base(cluster)}/agents/{_check(node)}/status"


def agent_rpc(cluster: str, node: str) -> str:
    return f"{base(cluster)}/agents/{_check(node)}/rpc"


def latency(cluster: str, node: str) -> str:
    return f"{base(cluster)}/latency/{_check(node)}"


def events(cluster: str) -> str:
    return f"{base(cluster)}/events"


def pipeline(cluster: str, name: str) -> str:
    return f"{base(cluster)}/pipelines/{_check(name)}"


def locks(cluster: str) -> str:
    return f"{base(cluster)}/locks"


def spill(cluster: str, node: str) -> str:
    return f"{base(cluster)}/spill/{_check(node)}"


def agent_hosted(cluster: str, node: str) -> str:
    """Retained JSON list of the specs of the instances a node hosts (no broker settings): what
    the survivors need to start them elsewhere if the node stays away (agent.runtime.rehome)."""
    return f"{base(cluster)}/agents/{_check(node)}/hosted"


def all_agents_hosted(cluster: str) -> str:
    return f"{base(cluster)}/agents/+/hosted"


def agent_rehomed(cluster: str, node: str) -> str:
    """Retained JSON {instance: wall time} of the instances this node re-homed from dead nodes:
    a node that comes back must not re-adopt them, even after they terminated elsewhere."""
    return f"{base(cluster)}/agents/{_check(node)}/rehomed"


def all_agents_rehomed(cluster: str) -> str:
    return f"{base(cluster)}/agents/+/rehomed"


def all_agents_state(cluster: str) -> str:
    return f"{base(cluster)}/agents/+/state"


def all_agents_status(cluster: str) -> str:
    return f"{base(cluster)}/agents/+/status"


# Added by the fogctl issue (additive): fogctl's reads and its MQTT 5 request/response replies.


def decisions(cluster: str, instance: str) -> str:
    """Retained JSON array of the last scaling decisions of one instance (`fogctl why`)."""
    return f"{base(cluster)}/decisions/{_check(instance)}"


def replies(cluster: str, client: str) -> str:
    """Response topic of one fogctl client for rpc requests (MQTT 5 response topic)."""
    return f"{base(cluster)}/replies/{_check(client)}"


def all_latency(cluster: str) -> str:
    return f"{base(cluster)}/latency/+"


def all_pipelines(cluster: str) -> str:
    return f"{base(cluster)}/pipelines/+"
