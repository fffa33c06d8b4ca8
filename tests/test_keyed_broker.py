"""Keyed state on real worker processes and a real Mosquitto: a windowed sum per key under kill -9
emits exactly the windows of the fault-free run (same ids, same contents), computed here by the
same operator over the same deterministic taxi records. The test plays the agent (LocalRunner)."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any, Dict, Tuple

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from agent.instance.keyed_state import KeyedState
from agent.instance.spec import BrokerSpec
from agent.operators.builtin import OperatorContext
from agent.operators.keyed import tumbling_window
from agent.operators.taxi import TaxiGenerator
from agent.tools.dataplane_bench import LocalRunner, initial_specs, pipeline_toml

pytestmark = [pytest.mark.broker, pytest.mark.timeout(120)]

N = 6000
WINDOW = {"time_field": "dropoff_datetime", "size_ms": 120_000, "lateness_ms": 1_200_000, "agg": "sum",
          "field": "total_amount"}


def pipeline(topic: str) -> str:
    return pipeline_toml("keyed", [
        {"name": "source", "kind": "source", "function": "agent.operators.taxi:source", "key": "payment_type",
         "params": {"seed": 3, "profile": "constant", "rate": 1200.0, "max_records": N}, "batch_size": 50},
        {"name": "win", "function": "agent.operators.keyed:tumbling_window", "params": WINDOW, "batch_size": 20},
        {"name": "out", "kind": "sink", "function": "agent.operators.builtin:mqtt_sink", "params": {"topic": topic}},
    ], scaling={"policy": "none"})


def fault_free() -> Dict[Tuple[str, int], str]:
    """The reference: the operator over the records in the source's order, in one process."""
    op = tumbling_window.build(OperatorContext("win-0", "win", "n", "map", params=dict(WINDOW)))
    ks = KeyedState(op, "win", "payment_type", 128)
    gen = TaxiGenerator(3, "source-0")
    out = ks.apply("source-0", [("source-0", i, gen.record()) for i in range(N)], 1)
    return {(s, q): json.dumps(r, sort_keys=True) for s, q, r in out}


class Collector:
    """Every message the mqtt_sink publishes; an id seen twice must carry the same window."""

    def __init__(self, host: str, port: int, topic: str) -> None:
        self.got: Dict[Tuple[str, int], str] = {}
        self.conflicts: list = []
        self.copies = 0
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"keyed-{time.monotonic_ns()}")
        self.c.on_message = self._msg
        self.c.on_subscribe = lambda *a: self.ready.set()
        self.c.connect(host, port)
        self.c.subscribe(topic, qos=1)
        self.c.loop_start()
        assert self.ready.wait(10)

    def _msg(self, c: Any, u: Any, m: Any) -> None:
        body = json.loads(m.payload)
        with self.lock:
            for (s, q), rec in zip(body["ids"], body["records"]):
                text = json.dumps(rec, sort_keys=True)
                old = self.got.setdefault((s, q), text)
                if old != text:
                    self.conflicts.append(((s, q), old, text))
                elif old is not text:
                    self.copies += 1

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def wait_for(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_a_windowed_sum_under_kill_9_emits_exactly_the_windows_of_the_fault_free_run(mosquitto, tmp_path: Path) -> None:
    """kill -9 of the keyed instance twice (the second time right after a restart, while it
    resends its saved outputs) and of the source once, mid-stream. Each restart takes the saved
    state and position; the predecessor (or the resumed source) replays what was not acked."""
    want = fault_free()
    assert len(want) > 100  # ~6000 s of event time, 2 min windows, 2 keys
    topic = "lab/keyed/out"
    coll = Collector(mosquitto.host, mosquitto.port, topic)
    runner = LocalRunner(tmp_path)
    try:
        specs = initial_specs(pipeline(topic), BrokerSpec(mosquitto.host, mosquitto.port), str(tmp_path / "state"),
                              cluster="keyed", extra={"sink_dir": str(tmp_path / "sink")})
        procs = {p.spec.operator: p for p in [runner.start(s) for s in reversed(specs)]}

        def emitted() -> int:
            with coll.lock:
                return len(coll.got)

        def kill(instance: str) -> None:
            w = runner.workers[instance]
            w.proc.send_signal(signal.SIGKILL)
            w.proc.wait(timeout=10)

        wait_for(lambda: emitted() > len(want) // 4, 30, "a quarter of the windows")
        kill("win-0")
        time.sleep(0.3)  # the source keeps sending into the persistent session meanwhile
        runner.restart("win-0")
        kill("win-0")  # at once: its saved outputs may still be on their way
        runner.restart("win-0")
        wait_for(lambda: emitted() > len(want) // 2, 30, "half of the windows")
        kill("source-0")
        runner.restart("source-0")
        wait_for(lambda: emitted() >= len(want), 60, "every window of the fault-free run")
        time.sleep(0.5)  # anything more (a window the reference does not have) arrives now
        stats = runner.workers["win-0"].stats
        runner.stop_all()
    finally:
        coll.close()
        for w in runner.alive():
            w.proc.kill()
    assert coll.conflicts == [], coll.conflicts[:3]
    missing = sorted(set(want) - set(coll.got))[:5]
    extra = sorted(set(coll.got) - set(want))[:5]
    assert not missing and not extra, (missing, extra)
    assert coll.got == want
    # the restarts really replayed: records applied before a crash came again and were skipped
    skipped = stats.get("duplicates_skipped", 0)
    print(f"copies dropped by id: {coll.copies}; replayed records skipped by the last incarnation: {skipped}")
