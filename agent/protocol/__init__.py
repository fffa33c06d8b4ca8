"""Pure protocol state machines (no I/O, no clock, no global random) and their message types.

`scaling.ScalingCore` is the per-instance core of the decentralized scaling protocol; its API and
the ordering contract drivers must respect are documented at the top of `scaling.py`.
"""

from agent.protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from agent.protocol.messages import (
    DataBatch,
    Deletion,
    DeletionAck,
    Duplication,
    DuplicationAck,
    Message,
    Start,
    from_dict,
    from_json,
)
from agent.protocol.scaling import (
    Activate,
    CreateInstance,
    DeletionMode,
    Drain,
    Effect,
    InstanceState,
    Output,
    RoutesChanged,
    ScalingCore,
    Send,
    Terminate,
)

__all__ = [
    "ProtocolError", "LocalProtocolError", "RemoteProtocolError",
    "Message", "Duplication", "DuplicationAck", "Start", "Deletion", "DeletionAck", "DataBatch",
    "from_dict", "from_json",
    "ScalingCore", "InstanceState", "DeletionMode", "Send", "Effect", "CreateInstance",
    "Activate", "RoutesChanged", "Drain", "Terminate", "Output",
]
