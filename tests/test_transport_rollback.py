"""A worker's transport after a broker rollback (Mosquitto SIGKILLed between autosaves) that kept
its session but not the subscription it made since (CHANGELOG.md, "A session rolled back by a
kill-broker lacked the inbox subscription"). Real Mosquitto, restarted on its own port."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import List

import pytest

from agent.mqtt.settings import BrokerSpec
from foglab.tools.broker import MOSQUITTO, wait_port
from conftest import start_broker

pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]


def _restart(proc: "subprocess.Popen[bytes]", conf: Path, port: int, kill: bool) -> "subprocess.Popen[bytes]":
    """Stop Mosquitto (SIGTERM: it saves its database; SIGKILL: it does not, a rollback to the
    last save) and start it again from the same config, port and database."""
    if kill:
        proc.kill()
    else:
        proc.terminate()
    proc.wait(timeout=10)
    new = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port("127.0.0.1", port)
    return new


def test_a_session_rolled_back_to_before_our_subscription_still_delivers_our_inbox(tmp_path: Path) -> None:
    """An earlier process with the same client id (a copy's first start on another node, whose
    SUBACK never came during a broker restart) left a persistent session without our
    subscription, and the broker saved it. Then we connect (session present), subscribe our inbox
    (SUBACK), and the broker is SIGKILLed before its next save: it comes back with the saved
    session, which lacks that subscription. We reconnect, see `session present`, and must still
    get what is published to our inbox (a copy that gets nothing never receives its Start, its
    predecessor's credit to it runs out and the pipeline stalls)."""
    from agent.mqtt.transport import Connected, Received, Transport

    broker = start_broker(tmp_path / "b")
    # no autosave between our subscribe and the SIGKILL, however slow the machine is
    broker.conf_path.write_text(broker.conf_path.read_text().replace("autosave_interval 5", "autosave_interval 3600"))
    proc = broker.proc
    spec = BrokerSpec(broker.host, broker.port)
    topic, cid = "fog/test/inbox/n2/op-c458", "fog-test-rollback-copy"
    ours = pub = None
    try:
        earlier = Transport(cid, spec)
        earlier.connect()  # the session exists; its subscribe never completed
        earlier.close()
        proc = _restart(proc, broker.conf_path, broker.port, kill=False)  # saved: session, no subscription

        ours = Transport(cid, spec)
        assert ours.connect() is True  # the earlier process's session
        ours.subscribe(topic)
        proc = _restart(proc, broker.conf_path, broker.port, kill=True)  # back to the save

        events: List[object] = []
        deadline = time.monotonic() + 15
        while not any(isinstance(e, Connected) for e in events) and time.monotonic() < deadline:
            ours.poll(0.05)
            events += ours.take_events()
        assert Connected(True) in events, events  # a rollback, not a lost session

        pub = Transport("fog-test-rollback-pub", spec, persistent=False)
        pub.connect()
        pub.publish(topic, b"Start", qos=1)
        got: List[bytes] = []
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            pub.poll(0.02)
            ours.poll(0.05)
            got += [e.payload for e in ours.take_events() if isinstance(e, Received)]
        assert got == [b"Start"], "the inbox subscription was lost with the broker's rollback"
    finally:
        for t in (ours, pub):
            if t is not None:
                t.close(final=True)
        proc.terminate()
        proc.wait(timeout=10)
