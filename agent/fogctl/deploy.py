"""`fogctl deploy`: agent.node.deploy.deploy_over on fogctl's own connection.

One deploy path for both tools (`fog-agent deploy` runs the same function on its RpcClient):
the TOML checked, one snapshot of the agents' states ended by the sync marker, placement checked
before anything is published, sink first (a successor is subscribed before its predecessor
exists, docs/design.md invariant 2), one `spawn` rpc per keeper answered only after the worker is
ready, and the transaction around them (`run_deploy`: every keeper started, or the started ones
stopped and the record replaced by a tombstone). Here: its errors as fogctl's exit statuses.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from agent import exitcodes
from agent.fogctl.client import Connection, FogctlError
from agent.node.deploy import DeployError, deploy_over

__all__ = ["DeployFailed", "deploy_pipeline"]


class DeployFailed(FogctlError):
    """A deploy that did not happen; `status` is the exit status (agent.exitcodes, the same for
    `fog-agent deploy`): 1 refused before anything was started or published, 4 failed and rolled
    back, 5 failed and the rollback is incomplete."""

    def __init__(self, message: str, status: int = exitcodes.ERROR) -> None:
        super().__init__(message)
        self.status = status


def deploy_pipeline(conn: Connection, text: str, name: str, timeout: float,
                    policy_name: Optional[str] = None, signer: Any = None,
                    node_slots: Optional[Dict[str, int]] = None) -> Tuple[Any, List[Dict[str, str]]]:
    """Publish the TOML retained (signed by `signer`, an agent.signing.Signer, when given) and
    start its keepers; returns (PipelineConfig, placed keepers)."""
    try:
        cfg, placed = deploy_over(conn, text, name, timeout, policy_name, signer=signer, node_slots=node_slots)
    except DeployError as exc:
        raise DeployFailed(str(exc), getattr(exc, "status", exitcodes.ERROR)) from None
    return cfg, [{"operator": d.operator, "instance": d.instance, "node": d.node} for d in placed]
