"""A site's uplink cut: what the site broker's bridge queues, what it drops past its bounds, and
how long it takes to drain after the link returns (docs/scale.md, "Sites").

Two private Mosquittos on loopback (lab/foglab/tools/broker.py's configuration): a site broker with
the bridge `agent.sites.render_bridge` renders (plain TCP: the TLS of the role's stanza is
exercised by tests/test_sites.py) and a central broker, with a TCP proxy between them
(lab/foglab/tools/delayproxy.py) that is stopped to cut the uplink and started again on the same port
to heal it. While the link is down a site client publishes `--messages` QoS 1 messages of
`--payload` bytes on the site's events topic (one of the topics that leave the site), each with
its id; a central subscriber with a persistent session counts them by id. Reported: the site
broker's stored messages and bytes at the end of the cut and its count of dropped messages
(`$SYS/broker/store/messages/*`, `$SYS/broker/publish/messages/dropped`), the seconds from the
heal to the bridge's link state 1 and to the last message at the centre, and the ids that
arrived, missing or twice.

Run: `python benchmarks/bench_uplink.py [--messages 20000] [--payload 200] [--cut 10]
[--max-queued 100000] [--max-queued-bytes 67108864] [--json]`.
"""

from __future__ import annotations

import argparse
import collections
import getpass
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import paho.mqtt.client as mqtt
from paho.mqtt.properties import Properties
from paho.mqtt.packettypes import PacketTypes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent import sites, topics  # noqa: E402
from foglab.tools.broker import BROKER_CONF, MOSQUITTO, free_port, wait_port  # noqa: E402
from foglab.tools.delayproxy import DelayProxy  # noqa: E402

CLUSTER, SITE, NODE, BRIDGE = "bench", "north", "n1", "bridge-north"


def start_broker(d: Path, port: int, max_queued: int, max_queued_bytes: int, extra: str = "") -> subprocess.Popen:
    d.mkdir(parents=True, exist_ok=True)
    conf = d / "mosquitto.conf"
    conf.write_text(BROKER_CONF.format(port=port, dir=d, log=d / "mosquitto.log", max_queued=max_queued,
                                       max_inflight=100, persistence="true", user=getpass.getuser())
                    + f"max_queued_bytes {max_queued_bytes}\n" + extra)
    proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port("127.0.0.1", port)
    return proc


class Watcher:
    """Records (time, topic, payload) of what it receives; QoS 1."""

    def __init__(self, port: int, client_id: str, filters: List[str], persistent: bool = False) -> None:
        self.got: List[Any] = []
        self.lock = threading.Lock()
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        self.c.on_message = lambda _c, _u, m: self._add(m)
        self.c.on_connect = lambda c, _u, _f, _rc, _p: [c.subscribe(f, qos=1) for f in filters]
        props = None
        if persistent:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = 3600
        self.c.connect("127.0.0.1", port, clean_start=not persistent, properties=props)
        self.c.loop_start()

    def _add(self, m: Any) -> None:
        with self.lock:
            self.got.append((time.monotonic(), m.topic, bytes(m.payload)))

    def last(self, topic: str) -> Any:
        with self.lock:
            for _, t, p in reversed(self.got):
                if t == topic:
                    return p
        return None

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def wait(pred: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def run(messages: int, payload: int, cut: float, max_queued: int, max_queued_bytes: int) -> Dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-uplink-"))
    cport, sport = free_port(), free_port()
    centre = start_broker(tmp / "centre", cport, max_queued, max_queued_bytes)
    proxy = DelayProxy(("127.0.0.1", cport)).start()
    stanza = sites.render_bridge(CLUSTER, sites.Uplink(SITE, "127.0.0.1", proxy.port, BRIDGE, restart_timeout=1),
                                 [NODE], ["admin"])
    site = start_broker(tmp / "site", sport, max_queued, max_queued_bytes, stanza)
    state = f"$SYS/broker/connection/{BRIDGE}/state"
    events = topics.events(CLUSTER)
    sys_topics = ["$SYS/broker/store/messages/count", "$SYS/broker/store/messages/bytes",
                  "$SYS/broker/publish/messages/dropped"]
    local = Watcher(sport, "bench-local", [state, *sys_topics])
    far = Watcher(cport, "bench-centre", [events], persistent=True)
    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-pub", protocol=mqtt.MQTTv5)
    pub.max_inflight_messages_set(100)
    pub.max_queued_messages_set(0)
    pub.connect("127.0.0.1", sport)
    pub.loop_start()
    try:
        assert wait(lambda: local.last(state) == b"1", 20), "the bridge did not connect"
        time.sleep(1.0)
        proxy.stop()
        t_cut = time.monotonic()
        assert wait(lambda: local.last(state) == b"0", 20), "the bridge did not see the cut"
        body = b"x" * max(0, payload - 16)
        infos = [pub.publish(events, b"%015d " % i + body, qos=1) for i in range(messages)]
        for info in infos:
            info.wait_for_publish(60)
        t_published = time.monotonic()
        time.sleep(max(0.0, cut - (t_published - t_cut)) + 2.5)  # + 2 $SYS intervals for the counters
        stored = {t.rsplit("/", 1)[1] if "dropped" not in t else "dropped": local.last(t) for t in sys_topics}
        proxy = DelayProxy(("127.0.0.1", cport), listen=("127.0.0.1", proxy.port)).start()
        t_heal = time.monotonic()
        assert wait(lambda: local.last(state) == b"1", 60), "the bridge did not come back"
        t_up = time.monotonic()

        def ids() -> collections.Counter:
            with far.lock:
                return collections.Counter(int(p[:15]) for _, t, p in far.got if t == events)
        wait(lambda: len(ids()) >= messages, 120)
        time.sleep(1.0)  # anything late, or twice
        got = ids()
        with far.lock:
            t_last = max((t for t, top, _ in far.got if top == events), default=t_up)
        return {
            "messages": messages, "payload_bytes": payload, "cut_s": round(t_heal - t_cut, 1),
            "max_queued_messages": max_queued, "max_queued_bytes": max_queued_bytes,
            "publish_s": round(t_published - t_cut, 2),
            "site_store_messages_at_end_of_cut": int(stored["count"] or 0),
            "site_store_bytes_at_end_of_cut": int(stored["bytes"] or 0),
            "site_dropped_messages": int(stored["dropped"] or 0),
            "link_up_after_heal_s": round(t_up - t_heal, 2),
            "drained_after_heal_s": round(t_last - t_heal, 2),
            "drain_messages_per_s": round(len(got) / max(1e-3, t_last - t_up), 0),
            "arrived": len(got), "missing": messages - len(set(got) & set(range(messages))),
            "twice": sum(1 for v in got.values() if v > 1),
        }
    finally:
        pub.disconnect()
        pub.loop_stop()
        local.close()
        far.close()
        proxy.stop()
        for p in (site, centre):
            p.terminate()
            p.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--payload", type=int, default=200)
    ap.add_argument("--cut", type=float, default=10.0)
    ap.add_argument("--max-queued", type=int, default=100000)
    ap.add_argument("--max-queued-bytes", type=int, default=67108864)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    out = run(a.messages, a.payload, a.cut, a.max_queued, a.max_queued_bytes)
    print(json.dumps(out, sort_keys=True) if a.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
