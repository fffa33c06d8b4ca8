"""Scaling decisions: small pure functions of measured numbers (see decentralized.py)."""

from agent.policy.decentralized import (
    NO_DECISION,
    Action,
    Decision,
    ScalingParams,
    decide,
    r_secure,
    replication_factor,
)

__all__ = ["NO_DECISION", "Action", "Decision", "ScalingParams", "decide", "r_secure", "replication_factor"]
