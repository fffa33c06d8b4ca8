"""Issue 26's cheap cuts, each against its baseline in the same run, alternated in short slices so
that the machine's load falls on every variant alike.

1. One MQTT hop in one process, four client set-ups:

`bench dataplane` measures whole pipelines, whose CPU per batch swings by 2x with the load of a
shared machine (docs/measurement.md, "Cheap cuts"); cuts of 5-30% drown in that. Here one process
runs a publisher and a subscriber (the same 21.7 kB taxi batches a worker sends, QoS 1, at most
`--window` batches between publish and receipt) through a private Mosquitto, and the variants
take turns in short slices, so each round compares them under the same load:

    mqtt5    MQTT 5, paho's loop()                          (the worker's client before the cuts)
    mqtt311  MQTT 3.1.1, paho's loop()                      (cut: protocol version)
    own      MQTT 3.1.1, agent.mqtt.client.loop_once        (cut: no wake-up socket pair)
    buffer   MQTT 3.1.1, loop_once, BufferedReads below      (tried and rejected: one recv of
             64 kB for many packets instead of paho's 1-byte header reads)

   Per variant: the median process CPU per delivered batch (publisher + subscriber, i.e. a
   worker's receive-and-send per batch) and the median of the per-round ratios to the variant
   before it.
2. A forwarding map's own work on one 100-record taxi batch (decode, `validate` through
   MapOperator, encode), with the batch encoded again (`encode`) or forwarded as the bytes it
   arrived in (`passed`, agent.dataplane.envelope.Passed): CPU per batch and the ratio.
3. The source's position file (`write_atomic` of a source.json): CPU per write; the source
   writes it every 2,000 records before the cut, about once a second after.

Run: `python benchmarks/bench_cuts.py [--rounds 10] [--batches 1500] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import paho.mqtt.client as mqtt

from agent.mqtt import client as mqttc
from foglab.tools.broker import start_private_broker
from agent.dataplane.envelope import Envelope, Kind, encode
from foglab.tools.dataplane_bench import _payloads

VARIANTS: List[Tuple[str, bool, bool, bool]] = [  # name, mqtt5, own loop, buffered reads
    ("mqtt5", True, False, False),
    ("mqtt311", False, False, False),
    ("own", False, True, False),
    ("buffer", False, True, True),
]


class BufferedReads:
    """paho's socket with its reads served from one large `recv` (the rejected cut: paho reads the
    type byte and each remaining-length byte with a `recv` of its own). `pending()` tells
    `loop_once` that bytes are already here (paho's TLS convention)."""

    CHUNK = 65536

    def __init__(self, sock: Any) -> None:
        self._sock, self._buf, self._pos = sock, b"", 0

    def recv(self, n: int) -> bytes:
        pos, buf = self._pos, self._buf
        if pos >= len(buf):
            buf = self._sock.recv(max(n, self.CHUNK))
            if len(buf) <= n:
                self._buf, self._pos = b"", 0
                return buf
            self._buf, pos = buf, 0
        out = buf[pos:pos + n]
        self._pos = pos + len(out)
        return out

    def pending(self) -> int:
        return len(self._buf) - self._pos

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _BufferedClient(mqtt.Client):
    def _create_socket(self) -> Any:
        return BufferedReads(super()._create_socket())


def _client(broker: Any, cid: str, session: Any, buffered: bool) -> Any:
    c = mqttc.make_client(broker, cid, session, max_inflight=0)
    if buffered:  # the same settings, on the subclass whose socket reads through BufferedReads
        c.__class__ = _BufferedClient
    return c


class Hop:
    def __init__(self, name: str, host: str, port: int, mqtt5: bool, own: bool, buffered: bool) -> None:
        broker = mqttc.broker_from(host, port, keepalive=60)
        session = mqttc.Session(mqtt5=mqtt5)
        self.topic = f"fog/bench/hop/{name}"
        self.got = 0
        self.step: Callable[[Any, float], Any] = mqttc.loop_once if own else (lambda c, t: c.loop(t))
        self.sub = _client(broker, f"hop-sub-{name}", session, buffered)
        self.pub = _client(broker, f"hop-pub-{name}", session, buffered)
        for c in (self.sub, self.pub):
            mqttc.connect(c, broker, session)
        self.sub.on_message = lambda c, u, m: self._add()
        subscribed: List[int] = []
        self.sub.on_subscribe = lambda *a: subscribed.append(1)
        deadline = time.monotonic() + 10
        while not (self.sub.is_connected() and self.pub.is_connected()):
            self._turn(0.05)
            if time.monotonic() > deadline:
                raise SystemExit(f"{name}: not connected")
        self.sub.subscribe(self.topic, qos=1)
        while not subscribed:
            self._turn(0.05)

    def _add(self) -> None:
        self.got += 1

    def _turn(self, timeout: float) -> None:
        self.step(self.pub, 0.0)
        self.step(self.sub, timeout)

    def run(self, payloads: List[bytes], batches: int, window: int) -> float:
        """CPU seconds of this process per delivered batch over `batches` batches."""
        sent, self.got = 0, 0
        c0 = time.process_time()
        while self.got < batches:
            while sent < batches and sent - self.got < window:
                self.pub.publish(self.topic, payloads[sent % len(payloads)], qos=1)
                sent += 1
            self._turn(0.01)
        while self.pub.want_write() or len(self.pub._out_messages):  # noqa: SLF001 - PUBACKs of the last ones
            self._turn(0.01)
        return (time.process_time() - c0) / batches


def forward_parts(rounds: int, reps: int = 300) -> Dict[str, List[float]]:
    """CPU seconds per batch of decode + validate + encode, with and without the pass-through."""
    from agent.dataplane.envelope import Passed, data_body_bytes, decode, encode_data
    from agent.operators.builtin import OperatorContext, load_operator

    raw = _payloads(100, 1, "taxi")[0]
    op = load_operator("agent.operators.builtin:identity", OperatorContext("map-0", "map", "n", "map"))

    def once(passed: bool) -> None:
        env = decode(raw)
        out = op.process(env.body)
        if passed and op.unchanged:  # as Processing.batch does
            body = data_body_bytes(env)
            if body is not None:
                out = Passed(out, body)
        encode_data("map-0", 0, env.seq, out)

    per: Dict[str, List[float]] = {"encode": [], "passed": []}
    for r in range(rounds):
        for name in (["encode", "passed"] if r % 2 == 0 else ["passed", "encode"]):
            c0 = time.process_time()
            for _ in range(reps):
                once(name == "passed")
            per[name].append((time.process_time() - c0) / reps)
    return per


def source_write_ms(tmp: Path, n: int = 300) -> Tuple[float, float]:
    """CPU and wall ms of one write of a source's position file (as the worker performs
    PersistSource; the worker's one thread waits for the wall time)."""
    from agent.files import write_atomic

    data = json.dumps({"instance": "source-0", "generated": 123456, "deferred": 0, "finished": False,
                       "resume_from": 123000, "reserved": 125456, "profile_started_at": time.time()})
    path = tmp / "source-0.source.json"
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        write_atomic(path, data)
    return 1000 * (time.process_time() - c0) / n, 1000 * (time.perf_counter() - w0) / n


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--batches", type=int, default=1500, help="batches per variant per round")
    ap.add_argument("--window", type=int, default=100)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="fog-hop-"))
    broker = start_private_broker(tmp / "broker")
    try:
        payloads = _payloads(100, 64, "taxi")
        hops = {name: Hop(name, broker.host, broker.port, m5, own, buf) for name, m5, own, buf in VARIANTS}
        for h in hops.values():  # warm-up
            h.run(payloads, 200, a.window)
        per: Dict[str, List[float]] = {n: [] for n in hops}
        for r in range(a.rounds):
            order = list(hops) if r % 2 == 0 else list(reversed(hops))
            for n in order:
                per[n].append(hops[n].run(payloads, a.batches, a.window))
            print(f"round {r + 1}: " + ", ".join(f"{n} {1000 * per[n][-1]:.4f}" for n in hops), file=sys.stderr)
        # An ack's share: the same hop (3.1.1, own loop) with ack-sized messages (a 45-byte envelope)
        ack = encode(Envelope("sink-0", 0, 12345, Kind.ACK, [0, 12345]))
        small = [statistics.median(hops["own"].run([ack], a.batches, a.window) for _ in range(3))
                 for _ in range(max(1, a.rounds // 3))]
    finally:
        broker.stop()
    fwd = forward_parts(a.rounds)
    write_ms = source_write_ms(tmp)
    names = list(hops)
    out: Dict[str, Any] = {"cpu_ms_per_batch": {n: round(1000 * statistics.median(v), 4) for n, v in per.items()},
                           "ratio_to_previous": {}, "rounds": a.rounds, "batches": a.batches,
                           "payload_bytes": len(payloads[0])}
    for prev, n in zip(names, names[1:]):
        out["ratio_to_previous"][n] = round(statistics.median(x / y for x, y in zip(per[n], per[prev])), 3)
    out["ratio_buffer_to_mqtt5"] = round(statistics.median(x / y for x, y in zip(per["buffer"], per["mqtt5"])), 3)
    out["forward_cpu_ms_per_batch"] = {k: round(1000 * statistics.median(v), 4) for k, v in fwd.items()}
    out["forward_ratio_passed_to_encode"] = round(statistics.median(x / y for x, y in zip(fwd["passed"], fwd["encode"])), 3)
    out["source_write_ms"] = round(write_ms[0], 4)
    out["source_write_wall_ms"] = round(write_ms[1], 4)
    out["ack_message_cpu_ms"] = round(1000 * statistics.median(small), 4)
    if a.json:
        print(json.dumps(out))
    else:
        for n in names:
            print(f"{n:8s} {out['cpu_ms_per_batch'][n]:.4f} ms/batch  x{out['ratio_to_previous'].get(n, 1.0):.3f} vs previous")
        print(f"buffer / mqtt5: x{out['ratio_buffer_to_mqtt5']:.3f}")
        f = out["forward_cpu_ms_per_batch"]
        print(f"forward: encode {f['encode']:.4f} ms/batch, passed {f['passed']:.4f} ms/batch, "
              f"x{out['forward_ratio_passed_to_encode']:.3f}")
        print(f"source.json write: {write_ms[0]:.4f} ms of CPU, {write_ms[1]:.4f} ms of wall time each")
        print(f"an ack-sized message through the hop: {out['ack_message_cpu_ms']:.4f} ms of CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
