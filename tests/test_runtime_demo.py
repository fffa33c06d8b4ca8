"""The demo: its exactly-once verifier must catch loss, duplicates and strays; its exit status must
follow the verdict; and a short run through the real CLI (private broker, three agents) ends OK
with the promised summary keys and a PNG plot."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest

from agent_process import CHECKOUT_PATH
from agent.config import load_pipeline_text
from foglab.tools import demo
from foglab.tools.verify import verify
from agent.operators.taxi import TaxiGenerator

ROOT = Path(__file__).resolve().parent.parent

PIPELINE = """
[pipeline]
name = "mini"
[scaling]
period = 1.0
capacity = 5000.0
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
[operator.params]
seed = 3
profile = "steps"
steps = [[0, 100], [4, 400], [10, 50], [14, 0]]
[[operator]]
name = "validate"
function = "agent.operators.builtin:validate"
[[operator]]
name = "in_zone"
function = "agent.operators.builtin:in_zone"
service_time_ms = 4.0
[operator.scaling]
capacity = 200.0
period = 1.0
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""


def _expected(n: int) -> set:
    from agent.operators.builtin import in_zone, validate

    gen = TaxiGenerator(3, "mini.source.0")
    keep = set()
    for seq in range(n):
        rec = gen.record()
        r1 = _apply(validate, rec)
        if r1 is not None and _apply(in_zone, r1) is not None:
            keep.add(seq)
    return keep


def _apply(fn: Any, rec: Any) -> Any:
    return fn(rec, {})


def write_run(sink_dir: Path, n: int, ids: Any) -> None:
    sink_dir.mkdir(parents=True, exist_ok=True)
    (sink_dir / "mini.source.0.source.json").write_text(json.dumps({"instance": "mini.source.0", "generated": n}))
    (sink_dir / "mini.sink.0.ids").write_text("".join(f"mini.source.0 {s}\n" for s in ids))


def test_verifier_accepts_exactly_once_and_catches_loss_duplicates_and_strays(tmp_path: Path) -> None:
    cfg = load_pipeline_text(PIPELINE)
    n = 500
    keep = sorted(_expected(n))
    assert 0 < len(keep) < n  # the seeded stream has records both filters drop

    ok = tmp_path / "ok"
    write_run(ok, n, keep)
    v = verify(cfg, ok)
    assert v.ok and v.generated == n and v.expected == len(keep) == v.received

    lost = tmp_path / "lost"
    write_run(lost, n, keep[:-3])
    v = verify(cfg, lost)
    assert not v.ok and v.lost == 3 and v.lost_sample[0] == ("mini.source.0", keep[-3])

    dup = tmp_path / "dup"
    write_run(dup, n, keep)
    (dup / "mini.sink.1.ids").write_text(f"mini.source.0 {keep[0]}\n")  # the same id at a second sink
    v = verify(cfg, dup)
    assert not v.ok and v.duplicated == 1 and v.lost == 0

    stray = tmp_path / "stray"
    dropped = next(s for s in range(n) if s not in set(keep))
    write_run(stray, n, keep + [dropped, n + 5])  # a filtered record and a never-generated one
    v = verify(cfg, stray)
    assert not v.ok and v.unexpected == 2


def test_duration_stretches_the_step_profile() -> None:
    text = demo.scale_profile(PIPELINE, 28.0)
    steps = load_pipeline_text(text).operators[0].params["steps"]
    assert steps == [[0.0, 100], [8.0, 400], [20.0, 50], [28.0, 0]]
    assert demo.scale_profile(PIPELINE, None) == PIPELINE


@pytest.mark.parametrize("ok,status", [(True, demo.EXIT_OK), (False, demo.EXIT_LOSS)])
def test_demo_exit_status_follows_the_verdict(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ok: bool, status: int,
                                               capsys: pytest.CaptureFixture) -> None:
    def fake_run(*a: Any, **k: Any) -> Dict[str, Any]:
        return {"ok": ok, "workdir": str(tmp_path), "lost": 0 if ok else 2, "duplicated": 0}

    monkeypatch.setattr(demo, "run_demo", fake_run)
    args = argparse.Namespace(pipeline=None, duration=None, workdir=None, plot=None, quiet=True, json=True,
                              no_analytics=True)
    assert demo.main(args) == status
    assert json.loads(capsys.readouterr().out)["ok"] is ok


@pytest.mark.broker
@pytest.mark.slow
def test_short_demo_through_the_cli(tmp_path: Path) -> None:
    pipeline = tmp_path / "mini.toml"
    pipeline.write_text(PIPELINE)
    env = dict(os.environ, PYTHONPATH=CHECKOUT_PATH)
    proc = subprocess.run(
        [sys.executable, "-m", "agent", "demo", "--pipeline", str(pipeline), "--json", "--no-analytics",
         "--workdir", str(tmp_path / "run"), "--plot", str(tmp_path / "demo.png")],
        capture_output=True, text=True, timeout=150, env=env, cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    for key in ("records_in", "records_out", "lost", "duplicated", "scale_outs", "scale_ins", "max_instances",
                "protocol_messages"):
        assert key in summary, key
    assert summary["lost"] == 0 and summary["duplicated"] == 0 and summary["ok"] is True
    assert summary["records_in"] > 1500 and summary["records_out"] > 0.8 * summary["records_in"]
    assert summary["max_instances"]["in_zone"] >= 2  # 400 records/s > r*C = 140: it scaled out
    assert summary["scale_outs"] >= 1 and summary["protocol_messages"] > 0
    # decision -> first record per operator (foglab.tools.rescale_split): its rows add up, and the
    # overall figure is taken over the same scale-outs
    r = summary["rescale_by_operator"]["in_zone"]
    assert r["keyed"] is False and r["decision_to_first_record_s"]["n"] >= 1
    for row in r["each"]:
        assert 0 <= row["spawn"] <= row["round"] <= row["total"] and row["first"] >= 0, row
        assert abs(row["round"] + row["first"] - row["total"]) <= 0.002, row
    assert summary["decision_to_first_record_s"]["n"] == sum(
        x["decision_to_first_record_s"]["n"] for x in summary["rescale_by_operator"].values())
    assert summary["duration_s"] < 120
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "in/s" in proc.stderr  # the live table went to stderr with --json


@pytest.mark.broker
@pytest.mark.slow
def test_sigterm_to_the_demo_stops_its_whole_fleet(tmp_path: Path) -> None:
    """`timeout`, systemd or a CI cancel stop a demo with SIGTERM: it must unwind like Ctrl-C
    (exit 143) and take its private Mosquitto, agents and workers with it. Before, Python's
    default SIGTERM action killed the demo alone and the whole fleet kept running."""
    import signal
    import time

    pipeline = tmp_path / "mini.toml"
    pipeline.write_text(PIPELINE)
    env = dict(os.environ, PYTHONPATH=CHECKOUT_PATH)
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent", "demo", "--pipeline", str(pipeline), "--json", "--no-analytics",
         "--duration", "60", "--workdir", str(tmp_path / "run")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=str(ROOT),
        start_new_session=True,
    )
    pgid = proc.pid

    def group() -> list:
        """The live processes of the demo's session (the demo, its broker, agents and workers)."""
        out = []
        for d in Path("/proc").iterdir():
            try:
                if d.name.isdigit() and os.getpgid(int(d.name)) == pgid:
                    state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        out.append((int(d.name), (d / "cmdline").read_bytes().replace(b"\0", b" ")[:120]))
            except (ProcessLookupError, FileNotFoundError, PermissionError):
                pass
        return out

    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(b"agent.instance.worker" in c for _, c in group()):
            time.sleep(0.5)
        assert any(b"mosquitto" in c for _, c in group()), group()
        assert any(b"agent.instance.worker" in c for _, c in group()), group()
        time.sleep(2.0)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        assert rc == 143, (rc, proc.stderr.read()[-2000:] if proc.stderr else "")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and group():
            time.sleep(0.2)
        assert group() == []
    finally:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.broker
def test_a_monitor_is_built_with_the_retained_states_in(mosquitto: Any) -> None:
    """Monitor() returns once the echo of its sync marker came back, so every retained state and
    status is in its view: a check made at once (fewer instances than a bound, nobody offline)
    must not pass on an empty view. Before, it returned at the CONNACK, before even subscribing."""
    import uuid

    import paho.mqtt.client as mqtt

    from agent import topics

    cluster = "mon" + uuid.uuid4().hex[:8]
    nodes = [f"n{i}" for i in range(1, 6)]
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"states-{uuid.uuid4().hex[:6]}",
                    protocol=mqtt.MQTTv5)
    c.connect(mosquitto.host, mosquitto.port)
    c.loop_start()
    retained = [(topics.agent_state(cluster, n), json.dumps({"node": n, "instances": [
        {"id": f"p.work.{n}", "operator": "work", "status": "active"}]}).encode()) for n in nodes]
    retained += [(topics.agent_status(cluster, n), b"online") for n in nodes]
    try:
        for topic, payload in retained:
            c.publish(topic, payload, qos=1, retain=True).wait_for_publish(5)
        mon = demo.Monitor(mosquitto.host, mosquitto.port, cluster)
        try:
            assert mon.instances_per_operator() == {"work": len(nodes)}  # at once: no wait
            assert mon.status == {n: "online" for n in nodes}
        finally:
            mon.close()
    finally:
        for topic, _ in retained:
            c.publish(topic, b"", qos=1, retain=True).wait_for_publish(5)
        c.loop_stop()
        c.disconnect()
