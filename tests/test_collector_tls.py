"""The collector and the shippers over TLS, against the broker the mosquitto role renders.

A private Mosquitto with the role's TLS listener and ACL (`tests/tls_site.py`: nodes n1 and n2, the
collector identity `central`; `intruder` is a certificate the site CA signed but no list names).
What it shows (docs/security.md, "Identities"; docs/spill.md, "The collector"):
- `fog-agent collector` with the central.toml the fog_central role renders with TLS on (its
  `[mqtt.tls]`, the certificate CN `central`, files where the role copies them) receives
  a node's spill chunks, shipped by the node's certificate, lands them and acks them: the shipper
  releases every file;
- the agent's own shipper (`AgentSpill`) takes the TLS settings of `agent.toml`;
- an unlisted certificate used as the collector connects and receives nothing: no chunk, no
  landing, no ack; the node keeps its files and resends them, and the real collector then lands
  them all (nothing lost);
- a chunk whose header names another node than its topic is not landed and not answered;
- TLS mistakes in central.toml are one line naming the file and the key (exit 78).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Dict, Iterator

import jinja2
import pytest
import yaml

from agent.collector.service import Collector
from agent.config import TlsSection, load_agent_config
from agent.spill.shipper import MqttShipper
from agent.spill.shipping import ShipperCore, meta_for
from agent.mqtt.settings import BrokerSpec
from agent.spill.local import AgentSpill
from agent.spill.spool import Spool, file_id
from tls_site import OK_CODES, ROOT, Client, Site, agent_toml, have_tools, running_site, wait_until

pytestmark = pytest.mark.broker

CLUSTER = "ctls"
COLLECTOR = "central"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    if not have_tools():
        pytest.skip("openssl or mosquitto missing")
    with running_site(tmp_path_factory.mktemp("ctls"), CLUSTER, ("n1", "n2"), (), extra_certs=["intruder"],
                      collectors=[COLLECTOR]) as s:
        yield s


def tls(site: Site, cert: str) -> TlsSection:
    return TlsSection(str(site.certs / "fog-ca.crt"), str(site.certs / f"{cert}.crt"), str(site.certs / f"{cert}.key"))


def fill_spool(path: Path, node: str, n: int, seed: int) -> Spool:
    rng = random.Random(seed)
    s = Spool(path, node, rotate_bytes=6000, sync_bytes=2000)
    for i in range(n):
        s.append("records", {"record_id": f"{node}-{i}", "fare": rng.uniform(3, 50), "r": rng.getrandbits(40)})
    s.rotate_all()
    return s


def originals(s: Spool) -> Dict[str, bytes]:
    return {file_id(f.path.read_bytes()): f.path.read_bytes() for f in s.closed_files()}


def landed(landing: Path, node: str = "*") -> Dict[str, bytes]:
    return {p.name.split(".")[0]: p.read_bytes() for p in landing.glob(f"kind=*/date=*/node={node}/*.jsonl.gz")}


def shipper(site: Site, spool: Spool, cert: str, **kw: object) -> MqttShipper:
    return MqttShipper(spool, CLUSTER, host="127.0.0.1", port=site.port, client_id=f"ship-{uuid.uuid4().hex[:8]}",
                       chunk_bytes=3000, tls=tls(site, cert), **kw).start()  # type: ignore[arg-type]


def collector(site: Site, landing: Path, cert: str) -> Collector:
    c = Collector(CLUSTER, str(landing), host="127.0.0.1", port=site.port,
                  client_id=f"coll-{cert}-{uuid.uuid4().hex[:8]}", tls=tls(site, cert)).start()
    assert c.connected.wait(10), f"{cert}: the collector did not connect"
    return c


def central_toml(site: Site, landing: Path, cert: str, key: str = "") -> Path:
    p = site.tmp / f"central-{uuid.uuid4().hex[:6]}.toml"
    p.write_text(f'[collector]\ncluster = "{CLUSTER}"\nlanding_dir = "{landing}"\nclient_id = "coll-{uuid.uuid4().hex[:8]}"\n'
                 f'[mqtt]\nhost = "127.0.0.1"\nport = {site.port}\n'
                 f'[mqtt.tls]\nca_file = "{site.certs}/fog-ca.crt"\ncert_file = "{site.certs}/{cert}.crt"\n'
                 f'key_file = "{key or site.certs / (cert + ".key")}"\n'
                 "[analytics]\nenabled = false\n")
    return p


def role_central_toml(site: Site, landing: Path, cert: str) -> Path:
    """central.toml as the fog_central role renders it (its template and defaults, with the example
    inventory's TLS settings), and the certificate files where the role copies them."""
    role = ROOT / "ansible/roles/fog_central"
    v = yaml.safe_load((role / "defaults/main.yml").read_text())
    conf_dir = site.tmp / f"central-{uuid.uuid4().hex[:6]}"
    v.update(fog_central_config_dir=str(conf_dir), fog_central_cluster=CLUSTER, fog_central_mqtt_port=site.port,
             fog_central_mqtt_tls=True, fog_central_client_id=f"coll-{uuid.uuid4().hex[:8]}")
    env = jinja2.Environment(trim_blocks=True, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["bool"] = lambda x: x if isinstance(x, bool) else str(x).lower() in ("true", "yes", "on", "1")
    env.filters["ternary"] = lambda cond, yes, no: yes if cond else no
    for _ in range(3):
        v = {k: env.from_string(x).render(v) if isinstance(x, str) and "{{" in x else x for k, x in v.items()}
    text = env.from_string((role / "templates/central.toml.j2").read_text()).render(v)
    (conf_dir / "collector-tls").mkdir(parents=True)
    for src, dst in (("fog-ca.crt", "ca.crt"), (f"{cert}.crt", "collector.crt"), (f"{cert}.key", "collector.key")):
        shutil.copy(site.certs / src, conf_dir / "collector-tls" / dst)
    text = text.replace(f'landing_dir = "{v["fog_central_state_dir"]}/landing"', f'landing_dir = "{landing}"')
    assert f'landing_dir = "{landing}"' in text and "username" not in text, text
    (conf_dir / "central.toml").write_text(text)
    return conf_dir / "central.toml"


def run_collector(conf: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "agent", "collector", "--config", str(conf)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=str(ROOT),
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))


def stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err


def test_collector_with_its_certificate_lands_a_nodes_chunks_and_acks_them(site: Site, tmp_path: Path) -> None:
    landing = tmp_path / "landing"
    spool = fill_spool(tmp_path / "n1", "n1", 600, seed=1)
    expected = originals(spool)
    assert len(expected) >= 3
    proc = run_collector(role_central_toml(site, landing, COLLECTOR))
    sh = shipper(site, spool, "n1", ack_timeout=2.0)
    try:
        assert sh.wait_idle(15), f"files not acked: {sh.core.stats}"  # released only on the collector's ack
    finally:
        sh.stop()
        err = stop(proc)
    assert "identity central" in err and "TLS" in err, err
    assert landed(landing, "n1") == expected
    assert sh.core.stats["files_acked"] == len(expected) and spool.closed_files() == []
    assert "Traceback" not in err, err


def test_agent_shipper_takes_tls_from_agent_toml(site: Site, tmp_path: Path) -> None:
    """`AgentSpill` ships over TLS with the node's certificate named in agent.toml's [mqtt.tls]."""
    cfg = load_agent_config(agent_toml(site, "n2", "n2", extra=f'[spill]\nenabled = true\nspool_dir = "{tmp_path}/spool"\n'))
    assert cfg.mqtt.tls is not None
    broker = BrokerSpec("127.0.0.1", site.port, ca_file=cfg.mqtt.tls.ca_file, cert_file=cfg.mqtt.tls.cert_file,
                        key_file=cfg.mqtt.tls.key_file)
    landing = tmp_path / "landing"
    coll = collector(site, landing, COLLECTOR)
    try:
        spill = AgentSpill(cfg, broker)
        for i in range(50):
            spill.on_event({"type": "test", "i": i})
        spill.close(ship_timeout=10)  # closes the spool, waits for the acks
        assert spill.stats()["closed_files"] == 0, spill.stats()
    finally:
        coll.stop()
    files = list(landing.glob("kind=events/date=*/node=n2/*.jsonl.gz"))
    assert len(files) == 1 and coll.core.stats["records_landed"] == 50, coll.core.stats


def test_unlisted_certificate_as_the_collector_gets_nothing(site: Site, tmp_path: Path) -> None:
    landing_x, landing = tmp_path / "landing-x", tmp_path / "landing"
    spool = fill_spool(tmp_path / "n1", "n1", 300, seed=2)
    expected = originals(spool)
    intruder = collector(site, landing_x, "intruder")  # the handshake succeeds: the CA signed it
    sh = shipper(site, spool, "n1", ack_timeout=0.5, max_backoff=1.0)
    try:
        assert wait_until(lambda: sh.core.stats["file_resends"] >= len(expected), 10), sh.core.stats
        assert intruder.core.stats["chunks"] == 0 and landed(landing_x) == {}
        assert sh.core.stats["files_acked"] == 0 and len(spool.closed_files()) == len(expected)
        intruder.stop()
        # The listed collector then gets every file: the node kept and resent them, nothing is lost.
        coll = collector(site, landing, COLLECTOR)
        try:
            assert sh.wait_idle(15), sh.core.stats
        finally:
            coll.stop()
    finally:
        sh.stop()
        intruder.stop()
    assert landed(landing, "n1") == expected and landed(landing_x) == {}


def test_chunk_whose_header_names_another_node_is_not_landed(site: Site, tmp_path: Path) -> None:
    """n1 may write only spill/n1/chunk (the ACL); a chunk there that claims to be n2's file would
    land in n2's partition and answer n2: the collector goes by the topic."""
    landing = tmp_path / "landing"
    f = fill_spool(tmp_path / "n2", "n2", 50, seed=3).closed_files()[0]
    body = f.path.read_bytes()
    core = ShipperCore(CLUSTER, "n2", chunk_bytes=10_000_000)
    core.add(meta_for(f, body), body)  # n2's real file: without the topic check it would land
    (forged,) = core.poll(0.0)
    genuine = originals(fill_spool(tmp_path / "n1", "n1", 50, seed=4))
    coll = collector(site, landing, COLLECTOR)
    n1, n2 = Client(site, "n1"), Client(site, "n2")
    try:
        assert n1.connect() == "connected" and n2.connect() == "connected"
        assert n2.subscribe(f"fog/{CLUSTER}/spill/n2/ack") == [1]
        assert n1.publish(f"fog/{CLUSTER}/spill/n2/chunk", forged.payload) == 135  # the ACL
        assert n1.publish(f"fog/{CLUSTER}/spill/n1/chunk", forged.payload) in OK_CODES
        sh = shipper(site, Spool(tmp_path / "n1", "n1"), "n1")  # then a genuine file of n1's
        try:
            assert sh.wait_idle(10), sh.core.stats
        finally:
            sh.stop()
        time.sleep(0.3)
    finally:
        for c in (n1, n2):
            c.close()
        coll.stop()
    assert coll.core.stats["forged_senders"] == 1, coll.core.stats
    assert landed(landing, "n2") == {} and landed(landing, "n1") == genuine
    assert n2.received == []  # no ack on n2's topic for a file n2 never sent


def test_collector_tls_mistakes_are_one_line(site: Site, tmp_path: Path) -> None:
    conf = central_toml(site, tmp_path / "landing", COLLECTOR, key=str(site.certs / "missing.key"))
    r = subprocess.run([sys.executable, "-m", "agent", "collector", "--config", str(conf)], capture_output=True,
                       text=True, timeout=30, cwd=str(ROOT), env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 78, r.stderr  # EX_CONFIG: fog-collector.service does not restart it
    assert r.stderr.strip().splitlines() == [
        f'error: {conf.name}: [mqtt.tls].key_file: expected a readable PEM file (No such file or directory), '
        f'got "{site.certs}/missing.key"'], r.stderr
    # a key that is not the certificate's: named too
    wrong = central_toml(site, tmp_path / "landing", COLLECTOR, key=str(site.certs / "n1.key"))
    r = subprocess.run([sys.executable, "-m", "agent", "collector", "--config", str(wrong)], capture_output=True,
                       text=True, timeout=30, cwd=str(ROOT), env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 78 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"{wrong.name}: [mqtt.tls].cert_file: expected a PEM client certificate" in r.stderr, r.stderr
    assert json.dumps(str(site.certs / "central.crt")) in r.stderr, r.stderr


def test_collector_whose_certificate_the_broker_rejects_says_why_once(site: Site, tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A certificate of another CA (the right name, `n1`, from the `foreign` CA): no connection,
    and one error line naming the TLS failure, not one per retry and not silence."""
    bad = TlsSection(str(site.certs / "fog-ca.crt"), str(site.certs / "foreign-n1.crt"),
                     str(site.certs / "foreign-n1.key"))
    caplog.set_level("ERROR", logger="agent.collector.service")
    c = Collector(CLUSTER, str(tmp_path / "landing"), host="127.0.0.1", port=site.port,
                  client_id=f"coll-foreign-{uuid.uuid4().hex[:8]}", tls=bad).start()
    try:
        assert wait_until(lambda: any("TLS error" in r.getMessage() for r in caplog.records), 10), caplog.text
        time.sleep(1.5)  # several retries (reconnect delay 0.2 s, doubling)
        assert not c.connected.is_set()
    finally:
        c.stop()
    lines = [r.getMessage() for r in caplog.records if "cannot connect" in r.getMessage()]
    assert len(lines) == len(set(lines)) >= 1, lines
