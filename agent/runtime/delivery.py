"""Is the broker still delivering our inbox? A probe to ourselves says so (sans-IO).

Why: a sender knows its batches reached the broker (PUBACK) but not that the broker delivers
them. A chaos run (docs/reliability.md, seed 5002) had a sink whose connection stayed up after a
broker restart with persistence while nothing more was delivered to it for 80 s: its senders'
batches were PUBACKed and held in their replay buffers, the sink saw no hole (nothing came
after the missing batches), so no other check fired and the run ended with records missing.
Whatever the broker's reason, the receiver can see it: when its inbox has been quiet for
`QUIET` seconds it publishes a probe to its own inbox, through the same broker queue as every
other message to it. A probe not back within `TIMEOUT` while connected means the path is
broken. The first remedy is a reconnect (the broker resends what it holds in flight for a
persistent session and restarts its queue); if the next probe is lost too, a clean session
(the broker's queue for us is dropped) and a new incarnation, whose predecessors replay what we
have not acked, as after a broker that lost our session (agent.runtime.worker).

The driver (the worker) publishes `payload()` when `due()` says "probe", calls `seen()` for every
message on the inbox and `echoed()` for a probe that came back, and acts on "reconnect" and
"new_session". Time is the caller's; nothing here does I/O.
"""

from __future__ import annotations

import json
from typing import Optional

__all__ = ["DeliveryCheck", "QUIET", "TIMEOUT", "is_probe"]

QUIET = 10.0  # inbox silent this long: probe
TIMEOUT = 15.0  # a probe not back within this long (connected all along): the path is broken
_MAGIC = b'["delivery-check",'  # never a valid envelope (those are 6-element arrays of a version)
GAP = 2.0  # the caller did not run for this long (a stalled node): restart the probe's clock


def is_probe(payload: bytes) -> bool:
    return payload.startswith(_MAGIC)


class DeliveryCheck:
    def __init__(self, instance: str, token: str, now: float) -> None:
        self.instance = instance
        self.token = token  # per process: a probe of an earlier incarnation is not ours
        self.last_in = now
        self.last_call = now
        self.sent_at: Optional[float] = None
        self.n = 0
        self.failures = 0  # consecutive lost probes
        self.probes = 0
        self.lost = 0

    def payload(self) -> bytes:
        return _MAGIC + json.dumps([self.instance, self.token, self.n]).encode()[1:]

    def seen(self, now: float) -> None:
        """Any message arrived on the inbox: the path works, no need to probe for a while."""
        self.last_in = now

    def echoed(self, payload: bytes, now: float) -> bool:
        """A probe came back; True if it is the one we wait for."""
        try:
            _, instance, token, n = json.loads(payload)
        except (ValueError, TypeError):
            return False
        if self.sent_at is None or [instance, token, n] != [self.instance, self.token, self.n]:
            return False
        self.sent_at = None
        self.failures = 0
        self.last_in = now
        return True

    def due(self, now: float, connected: bool) -> Optional[str]:
        """What to do now: None, "probe", "reconnect" or "new_session"."""
        stalled = now - self.last_call >= GAP
        self.last_call = now
        if not connected or stalled:
            # a probe's clock runs only while the connection is up and we run: a reconnect or a
            # stall delays delivery for reasons we already know of
            self.last_in = now
            if self.sent_at is not None:
                self.sent_at = now
            return None
        if self.sent_at is None:
            if now - self.last_in < QUIET:
                return None
            self.n += 1
            self.probes += 1
            self.sent_at = now
            return "probe"
        if now - self.sent_at < TIMEOUT:
            return None
        self.sent_at = None
        self.last_in = now
        self.lost += 1
        self.failures += 1
        return "reconnect" if self.failures == 1 else "new_session"
