"""fog-agent: decentralized elastic stream processing for fleets of fog nodes."""

__version__ = "0.2.0"
