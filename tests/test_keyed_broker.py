"""Keyed state on real worker processes and a real Mosquitto: a windowed sum per key under kill -9
emits exactly the windows of the fault-free run (same ids, same contents), computed here by the
same operator over the same deterministic taxi records. The test plays the agent (LocalRunner)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
import threading
import time
from pathlib import Path
from typing import Any, Dict, Tuple

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from agent.instance.keyed_state import KeyedState
from agent.mqtt.settings import BrokerSpec
from agent.operators.builtin import OperatorContext
from agent.operators.keyed import tumbling_window
from agent.operators.taxi import TaxiGenerator
from foglab.tools.dataplane_bench import LocalRunner, initial_specs, pipeline_toml
from agent_process import ONLINE_BOUND, wait_until_answers, write_agent_conf

pytestmark = [pytest.mark.broker, pytest.mark.timeout(240)]

N = 4000
WINDOW = {"time_field": "dropoff_datetime", "size_ms": 60_000, "lateness_ms": 1_200_000, "agg": "sum",
          "field": "total_amount"}


def pipeline(topic: str) -> str:
    return pipeline_toml("keyed", [
        {"name": "source", "kind": "source", "function": "agent.operators.taxi:source", "key": "payment_type",
         "params": {"seed": 3, "profile": "constant", "rate": 1500.0, "max_records": N}, "batch_size": 50},
        {"name": "win", "function": "agent.operators.keyed:tumbling_window", "params": WINDOW, "batch_size": 20},
        {"name": "out", "kind": "sink", "function": "agent.operators.builtin:mqtt_sink", "params": {"topic": topic}},
    ], scaling={"policy": "none"})


def fault_free(source: str = "source-0") -> Dict[Tuple[str, int], str]:
    """The reference: the operator over the records in the source's order, in one process."""
    op = tumbling_window.build(OperatorContext("win-0", "win", "n", "map", params=dict(WINDOW)))
    ks = KeyedState(op, "win", "payment_type", 128)
    gen = TaxiGenerator(3, source)
    out = ks.apply(source, [(source, i, gen.record()) for i in range(N)], 1)
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
    assert len(want) > 100  # ~4000 s of event time, 1 min windows, 2 keys
    topic = "lab/keyed/out"
    coll = Collector(mosquitto.host, mosquitto.port, topic)
    runner = LocalRunner(tmp_path, ready_timeout=ONLINE_BOUND)
    try:
        specs = initial_specs(pipeline(topic), BrokerSpec(mosquitto.host, mosquitto.port), str(tmp_path / "state"),
                              cluster="keyed", extra={"sink_dir": str(tmp_path / "sink")})
        for s in reversed(specs):  # successors subscribe before predecessors send
            runner.start(s)

        def emitted() -> int:
            with coll.lock:
                return len(coll.got)

        def kill(instance: str) -> None:
            w = runner.workers[instance]
            w.proc.send_signal(signal.SIGKILL)
            w.proc.wait(timeout=10)

        wait_for(lambda: emitted() > len(want) // 4, 60, "a quarter of the windows")
        kill("win-0")
        time.sleep(0.3)  # the source keeps sending into the persistent session meanwhile
        runner.restart("win-0")
        kill("win-0")  # at once: its saved outputs may still be on their way
        runner.restart("win-0")
        wait_for(lambda: emitted() > len(want) // 2, 60, "half of the windows")
        kill("source-0")
        runner.restart("source-0")
        wait_for(lambda: emitted() >= len(want), 90, "every window of the fault-free run")
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


ROOT = Path(__file__).resolve().parent.parent


def test_a_windowed_sum_survives_kill_9_of_its_agent(mosquitto, tmp_path: Path) -> None:
    """The real daemon: `fog-agent deploy` on one agent, kill -9 of the agent mid-stream (its
    workers see their pipe close, drain and exit, saving their state), the agent started again
    re-adopts them (`restart`), and the windows are exactly those of the fault-free run.

    Heavy (30-60 s on this shared machine): an agent's start, a deploy, and above all the re-adopted
    workers waiting for their previous incarnations to finish draining (their identity locks)."""
    cluster = "keyed" + uuid.uuid4().hex[:6]
    topic = f"lab/{cluster}/out"
    want = fault_free("keyed.source.0")
    pipe = tmp_path / "keyed.toml"
    pipe.write_text(pipeline(topic))
    state = tmp_path / "n1"
    state.mkdir()
    conf = write_agent_conf(tmp_path / "n1.toml", "n1", cluster, state, mosquitto)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("FOG_AGENT_CONFIG", None)

    def start_agent(n: int) -> subprocess.Popen:
        with open(tmp_path / f"agent-{n}.log", "w") as fh:
            return subprocess.Popen([sys.executable, "-m", "agent", "run", "--config", str(conf)], stdout=fh,
                                    stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path))

    coll = Collector(mosquitto.host, mosquitto.port, topic)
    agent = start_agent(1)
    try:
        from agent.node.deploy import RpcClient

        with RpcClient(mosquitto.host, mosquitto.port, cluster) as client:
            wait_until_answers(client, "n1", lambda: agent.poll() is None)
        d = subprocess.run([sys.executable, "-m", "agent", "deploy", str(pipe), "--host", mosquitto.host,
                            "--port", str(mosquitto.port), "--cluster", cluster],
                           capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=60)
        assert d.returncode == 0, d.stdout + d.stderr

        def emitted() -> int:
            with coll.lock:
                return len(coll.got)

        wait_for(lambda: emitted() > len(want) // 3, 60, "a third of the windows")
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=10)
        agent = start_agent(2)
        wait_for(lambda: emitted() >= len(want), 90, "every window of the fault-free run")
        time.sleep(0.5)
    finally:
        coll.close()
        agent.terminate()
        try:
            agent.wait(timeout=15)
        except subprocess.TimeoutExpired:
            agent.kill()
    logs = "".join((tmp_path / f"agent-{n}.log").read_text()[-2000:] for n in (1, 2))
    assert coll.conflicts == [], coll.conflicts[:3]
    assert coll.got == want, (sorted(set(want) - set(coll.got))[:5], sorted(set(coll.got) - set(want))[:5], logs)
    from agent.instance.keyed_state import KeyedState

    saved = KeyedState.load(state / "keyed.win.0.keyed.json")
    assert saved is not None and saved["key_groups"] == 128
    floors = [a[0] for a in saved["applied"].values()]
    assert floors and max(floors) > 0, saved["applied"]  # the source's claims reached the keyed state


def test_bench_keyed_runs_all_three_pipelines_and_reports_their_state(tmp_path: Path) -> None:
    """`fog-agent bench keyed` (short): each pipeline moved records; the keyed ones held one state
    per key and saved it. Rates are the benchmark's to report, not asserted here. ~25 s here: nine
    worker processes start (three pipelines), each a few seconds on this shared machine."""
    from foglab.tools.keyed_bench import run_keyed_bench

    res = run_keyed_bench(seconds=1.0, keys=20, workdir=str(tmp_path))
    assert all(res[k]["records_per_s"] > 0 for k in ("stateless_map", "keyed_count", "keyed_window")), res
    assert res["stateless_map"]["state_saves_per_s"] == 0 and res["stateless_map"]["state_file_bytes"] == 0
    for k in ("keyed_count", "keyed_window"):
        assert res[k]["keys_held"] == 20 and res[k]["state_saves_per_s"] > 0 and res[k]["state_file_bytes"] > 0, res
        assert res[k]["ratio_vs_stateless"] is not None
    assert res["keyed_window"]["outputs_per_s"] < res["keyed_window"]["records_per_s"]  # one per key and window
