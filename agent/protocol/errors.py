"""Errors of the protocol cores (h11 style).

`LocalProtocolError`: *we* asked the core for something its state does not allow (a bug in the
driver, e.g. starting a second round while one is in progress). `RemoteProtocolError`: a *peer*
sent something the protocol does not expect in our current state, or bytes that are not a valid
message. A core that raises either one leaves its state unchanged, so a driver can log the error,
drop the offending message and carry on (reliability requirement: a garbled or late message must
never corrupt a routing table).
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Root of the protocol errors; the message names the state, what was expected and found."""


class LocalProtocolError(ProtocolError):
    """The local driver misused the core."""


class RemoteProtocolError(ProtocolError):
    """A peer sent an invalid or unexpected message."""
