"""Issue 39's broker hop, stage by stage: where the CPU of a record crossing MQTT between two
operator instances goes, per batch and per record.

`bench dataplane` measures whole processes (CPU ms per batch of the source, the map, the sink
and the broker); it cannot say which part of a worker's turn a batch's CPU goes to. Here the
bench pipeline of `bench dataplane` (taxi `bench_source` -> `identity` -> `null_sink`) runs as
three real `Worker`s (agent.instance.worker: the shell, the sans-IO `Instance` core, the real
`Transport` over a real paho client) in ONE process and one thread, each client connected to a
socket pair instead of a TCP connection to Mosquitto. The other end of every pair is a minimal
broker stand-in (`MiniBroker`, below): it parses the MQTT 3.1.1 packets paho writes, PUBACKs
every QoS 1 PUBLISH to its publisher and delivers it, under a new packet id, to the client whose
inbox filter matches its topic, as Mosquitto does. So every byte a worker writes and reads is
what it writes and reads against Mosquitto (same packets, same payloads, same acks); only the
broker's own work (C, another process in production) is replaced, and it is timed apart and
left out of the table.

Two passes per batch size, each in `--rounds` rounds (the median is reported):
- plain: CPU (process_time) of each worker's turns (`Transport.poll` + `Worker.step`) per batch
  delivered at the sink; no instrumentation: the figures to compare with `bench dataplane`'s
  CPU ms per batch;
- staged: the same run with the real functions of each stage wrapped by a timer (perf_counter,
  exclusive time: a stage's time excludes the stages it calls). The timers cost about 0.1-0.2 us
  a call; the staged total is given next to the plain one.

Stages (each the real function the data path runs):
    paho: publish (build)  Client.publish: the PUBLISH packet built and queued
    paho: write (send)     Client.loop_write: packets written to the socket (a PUBLISH at once
                           from `publish`, PUBACKs of deliveries from the loop)
    paho: read             Client.loop_read: packets read and parsed (PUBLISH in, PUBACK in),
                           the on_message/on_publish callbacks (Transport: one event object each)
    paho: select/misc      loop_once's select and loop_misc (keepalive)
    decode: parse       envelope._parse (orjson, with the hostile-input guards)
    decode: records     envelope._expand (the compact body back into items; dicts unless the
                        receiver reads only ids)
    decode: envelope    the rest of envelope.decode (header checks, the Envelope object)
    admission           Admission.screen (sender, node, epoch/seq bounds)
    order/dedup         Inbound.receive (per-sender FIFO, duplicates)
    operator            Processing.apply (the map function on every record: identity here)
    route/outbox        Outputs.forward (Outbox.add: partitioning over the successors)
    encode: data        envelope.encode_data (a fresh batch; a Passed batch: its bytes again)
    encode: body slice  envelope.data_body_bytes (a passed-on batch's body out of its bytes)
    encode: ack/proto   envelope.encode (acks)
    ack: decide         Instance._send_acks (what to ack, cumulative per sender)
    ack: in             Delivery._ack (a successor's ack: credit back, replay buffer freed)
    sink: record        SinkSide.record (null_sink: counts ids)
    source: generate    the source operator's `poll` (taxi records made; not part of the hop)
    core: other         the rest of Instance.handle (tick, flush, tracker, publish tokens, ...)
    shell: other        the rest of Worker.step/_perform/feed (event objects, command dispatch)

`--chain`: the same pipeline as one chain (agent.instance.chain: the three instances in one
process, records handed in memory, `bench dataplane`'s "whole chain"), one role `chain`, with
the stages of a hand-off as well (route memory, delivery, the chain's own loop).

`--against DIR`: each round runs twice more, plain, in child processes: once on this checkout,
once on the agent and lab of the checkout DIR (e.g. `git archive main agent lab | tar -x -C DIR`),
alternating; per role the CPU per batch of this checkout over DIR's, per round and the median.

Run: `python benchmarks/bench_hop.py [--batches 1,10,100] [--batches-per-run 2000] [--rounds 3]
[--chain] [--against DIR] [--json]`.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

if os.environ.get("BENCH_HOP_SRC"):  # a child of --against: the agent and lab of another checkout
    _src = os.environ["BENCH_HOP_SRC"]
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
    sys.path[:0] = [_src, os.path.join(_src, "lab")]

import paho.mqtt.client as mqtt

from agent.dataplane import envelope as envmod
from agent.dataplane.channel import Inbound
from agent.dataplane import sticky as stickymod
from agent.instance import core as coremod
from agent.instance import intake as intmod
from agent.instance import outputs as outmod
from agent.instance import processing as procmod
from agent.instance import sink as sinkmod
from agent.instance.admission import Admission
from agent.instance.delivery import Delivery
from agent.instance.outputs import Outputs
from agent.instance.processing import Processing
from agent.instance.sink import SinkSide
from agent.instance.worker import Worker
from agent.instance.chain import Chain
from agent.mqtt import client as mqttc
from agent.mqtt.settings import BrokerSpec
from agent.mqtt.transport import Transport
from foglab.tools.dataplane_bench import initial_specs, pipeline_toml

ROLES = ("source", "map", "sink")


# ---- a broker stand-in on socket pairs -------------------------------------------------------------


class MiniBroker:
    """Mosquitto's part of a QoS 1 exchange, for clients on socket pairs: PUBACK to the publisher
    at once, the PUBLISH to the one subscriber whose filter prefix matches, under a packet id of
    its own; the subscriber's PUBACK ends it. PINGREQ is answered; nothing else is expected."""

    def __init__(self) -> None:
        self.conns: List[Dict[str, Any]] = []
        self.routes: List[Tuple[str, Dict[str, Any]]] = []  # (topic prefix, connection)
        self.cpu = 0.0
        self.delivered = 0

    def attach(self, transport: Transport, inbox_filter: str) -> None:
        a, b = socket.socketpair()
        for s in (a, b):
            s.setblocking(False)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        c = transport.client
        c._sock = a  # noqa: SLF001 - the client "connected" over the pair
        c._state = mqtt._ConnectionState.MQTT_CS_CONNECTED  # noqa: SLF001
        c._last_msg_in = c._last_msg_out = time.monotonic()  # noqa: SLF001
        transport._connected = True  # noqa: SLF001
        conn = {"sock": b, "inbuf": bytearray(), "out": bytearray(), "mid": 0}
        self.conns.append(conn)
        assert inbox_filter.endswith("/+")
        self.routes.append((inbox_filter[:-1], conn))

    def pump(self) -> None:
        t0 = time.process_time()
        for conn in self.conns:
            try:
                while True:
                    data = conn["sock"].recv(1 << 20)
                    if not data:
                        break
                    conn["inbuf"] += data
            except BlockingIOError:
                pass
            self._parse(conn)
        for conn in self.conns:
            if conn["out"]:
                try:
                    n = conn["sock"].send(conn["out"])
                    del conn["out"][:n]
                except BlockingIOError:
                    pass
        self.cpu += time.process_time() - t0

    def _parse(self, conn: Dict[str, Any]) -> None:
        buf = conn["inbuf"]
        pos = 0
        while True:
            if len(buf) - pos < 2:
                break
            head = buf[pos]
            length, mult, i = 0, 1, pos + 1
            while True:
                if i >= len(buf):
                    length = -1
                    break
                byte = buf[i]
                length += (byte & 0x7F) * mult
                mult *= 128
                i += 1
                if not byte & 0x80:
                    break
            if length < 0 or len(buf) - i < length:
                break
            body = bytes(buf[i:i + length])
            pos = i + length
            kind = head >> 4
            if kind == 3:  # PUBLISH
                qos = (head >> 1) & 3
                tlen = int.from_bytes(body[:2], "big")
                topic = body[2:2 + tlen].decode()
                rest = body[2 + tlen:]
                if qos:
                    conn["out"] += bytes([0x40, 2]) + rest[:2]
                    rest = rest[2:]
                self._deliver(topic, rest)
            elif kind == 12:  # PINGREQ
                conn["out"] += b"\xd0\x00"
        del buf[:pos]

    def _deliver(self, topic: str, payload: bytes) -> None:
        for prefix, conn in self.routes:
            if topic.startswith(prefix):
                conn["mid"] = conn["mid"] % 65535 + 1
                t = topic.encode()
                var = len(t).to_bytes(2, "big") + t + conn["mid"].to_bytes(2, "big")
                n = len(var) + len(payload)
                rl = bytearray()
                while True:
                    byte, n = n % 128, n // 128
                    rl.append(byte | (0x80 if n else 0))
                    if not n:
                        break
                conn["out"] += b"\x32" + bytes(rl) + var + payload
                self.delivered += 1
                return


# ---- stage timers -----------------------------------------------------------------------------------


class Stages:
    """Exclusive time per stage (perf_counter): a wrapped function's time, less the time of the
    wrapped functions it called. `role` says which worker's turn is running."""

    def __init__(self) -> None:
        self.t: Dict[Tuple[str, str], float] = defaultdict(float)
        self.calls: Dict[Tuple[str, str], int] = defaultdict(int)
        self.stack: List[List[float]] = []  # [start, child time]
        self.role = "?"
        self.on = False
        self._undo: List[Callable[[], None]] = []

    def wrap(self, owner: Any, attr: str, stage: str) -> None:
        orig = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        stages = self
        clock = time.perf_counter

        def timed(*a: Any, **kw: Any) -> Any:
            if not stages.on:
                return orig(*a, **kw)
            frame = [clock(), 0.0]
            stages.stack.append(frame)
            try:
                return orig(*a, **kw)
            finally:
                el = clock() - frame[0]
                stages.stack.pop()
                key = (stages.role, stage)
                stages.t[key] += el - frame[1]
                stages.calls[key] += 1
                if stages.stack:
                    stages.stack[-1][1] += el

        setattr(owner, attr, timed)
        self._undo.append(lambda: setattr(owner, attr, orig))

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


def instrument(st: Stages) -> None:
    st.wrap(mqtt.Client, "publish", "paho: publish (build)")
    st.wrap(mqtt.Client, "loop_read", "paho: read")
    st.wrap(mqtt.Client, "loop_write", "paho: write (send)")
    st.wrap(mqttc, "loop_once", "paho: select/misc")
    st.wrap(envmod, "_parse", "decode: parse")
    st.wrap(envmod, "_expand", "decode: records")
    st.wrap(intmod, "decode", "decode: envelope")
    st.wrap(Admission, "screen", "admission")
    st.wrap(Inbound, "receive", "order/dedup")
    st.wrap(Processing, "apply", "operator")
    st.wrap(Outputs, "forward", "route/outbox")
    st.wrap(outmod, "encode_data", "encode: data")
    st.wrap(procmod, "data_body_bytes", "encode: body slice")
    st.wrap(sinkmod, "data_body_bytes", "encode: body slice")
    st.wrap(outmod, "encode", "encode: ack/proto")
    st.wrap(coremod.Instance, "_send_acks", "ack: decide")
    st.wrap(Delivery, "_ack", "ack: in")
    st.wrap(SinkSide, "record", "sink: record")
    st.wrap(coremod.Instance, "handle", "core: other")
    st.wrap(Worker, "step", "shell: other")
    st.wrap(Worker, "feed", "shell: other")
    st.wrap(Worker, "_perform", "shell: other")
    st.wrap(coremod.Instance, "_produce", "core: other")
    for attr in ("split", "sent", "released", "take_save"):
        st.wrap(stickymod.RouteMemory, attr, "route memory")
    st.wrap(Worker, "_save_routes", "route memory: write")
    st.wrap(Delivery, "handed", "hand-off: in")
    st.wrap(Chain, "step", "chain: other")
    st.wrap(Chain, "_deliver", "chain: other")


# ---- one run -----------------------------------------------------------------------------------------


def _bench_source() -> str:
    """The benchmarks' source: the lab's (foglab.operators.bench, admitted as a lab node's
    `[operators] modules` admits it), or the node's `agent.operators.taxi:bench_source` in an
    older checkout run by --against."""
    import importlib.util

    if importlib.util.find_spec("foglab.operators.bench") is None:
        return "agent.operators.taxi:bench_source"
    os.environ.setdefault("FOG_AGENT_OPERATOR_MODULES", "foglab.operators.bench")
    return "foglab.operators.bench:bench_source"


def _pipeline(batch_size: int, window: int) -> str:
    return pipeline_toml(
        "bench",
        [
            {"name": "source", "kind": "source", "function": _bench_source(),
             "batch_size": batch_size, "max_inflight_batches": window,
             "params": {"profile": "constant", "rate": 5e6, "record": "taxi"}},
            {"name": "map", "function": "agent.operators.builtin:identity", "batch_size": batch_size,
             "max_inflight_batches": window},
            {"name": "sink", "kind": "sink", "function": "agent.operators.builtin:null_sink",
             "batch_size": batch_size},
        ],
        scaling={"policy": "none"},
    )


def run_once(batch_size: int, records: int, window: int, stages: Optional[Stages],
             chain: bool = False) -> Dict[str, Any]:
    """The three workers on the stand-in broker (or, `chain`, the three instances as one chain
    process) until `records` more records reached the sink (after a warm-up of a tenth of that):
    CPU per worker, per batch and per record."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-hop-"))
    bspec = BrokerSpec(host="127.0.0.1", port=1)  # never connected: the clients sit on socket pairs
    specs = initial_specs(_pipeline(batch_size, window), bspec, str(tmp / "state"), cluster="hop",
                          extra={"sink_dir": str(tmp / "sink")})
    broker = MiniBroker()
    workers: Dict[str, Worker] = {}
    links: Optional[Chain] = None
    if chain:  # the members make their own transports: each is put on a socket pair before it starts
        links = Chain(specs, io.StringIO())
        for w in links.members:
            broker.attach(w.transport, w.core.inbox)
        workers = dict(zip(ROLES, links.members))
    else:
        for role, spec in zip(ROLES, specs):
            t = Transport(f"hop-{role}", bspec)
            w = Worker(spec, out=io.StringIO(), transport=t)
            broker.attach(t, w.core.inbox)
            workers[role] = w
    # source's generator: wrapped per instance (its class is the operator's)
    if stages is not None:
        stages.wrap(workers["source"].operator, "poll", "source: generate")
    for role in reversed(ROLES):  # successors first, as the bench starts them
        workers[role].begin()
    if links is not None:
        links._deliver(links.clock())  # noqa: SLF001 - the starts' hand-offs, as Chain.start does
    sink = workers["sink"].core
    roles = ("chain",) if links is not None else ROLES

    def turn(cpu: Dict[str, float]) -> None:
        for role in roles:
            if stages is not None:
                stages.role = role
            c0 = time.process_time()
            if links is not None:
                for w in links.members:
                    w.transport.poll(0.0)
                links.step(links.clock())
            else:
                w = workers[role]
                w.transport.poll(0.0)
                w.step(w.clock())
            cpu[role] += time.process_time() - c0
            if stages is not None:
                stages.role = "?"
            broker.pump()

    warm: Dict[str, float] = defaultdict(float)
    while sink.stats["records_in"] < records // 10:
        turn(warm)
    if stages is not None:
        stages.t.clear()
        stages.calls.clear()
        stages.on = True
    cpu: Dict[str, float] = defaultdict(float)
    r0, broker.cpu = sink.stats["records_in"], 0.0
    b0 = sink.stats["batches_in"]
    w0 = time.perf_counter()
    while sink.stats["records_in"] - r0 < records:
        turn(cpu)
    wall = time.perf_counter() - w0
    if stages is not None:
        stages.on = False
    n = sink.stats["records_in"] - r0
    nb = sink.stats["batches_in"] - b0
    out = {
        "batch_size": batch_size, "records": n, "batches": nb, "wall_s": wall,
        "cpu_us_per_batch": {r: 1e6 * cpu[r] / nb for r in roles},
        "broker_standin_us_per_batch": 1e6 * broker.cpu / nb,
        "stats": {r: {k: workers[r].core.stats.get(k, 0) for k in (
            "batches_in", "batches_out", "acks_in", "acks_sent", "passed_batches", "duplicate_envelopes",
            "malformed")} for r in ROLES},
    }
    if stages is not None:
        out["stages_us_per_batch"] = {f"{r}|{s}": 1e6 * v / nb for (r, s), v in stages.t.items()}
        out["stage_calls_per_batch"] = {f"{r}|{s}": c / nb for (r, s), c in stages.calls.items()}
    for w in workers.values():
        os.close(w._identity_lock)  # noqa: SLF001
        w.transport.client._sock.close()  # noqa: SLF001
    for conn in broker.conns:
        conn["sock"].close()
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def _child(src: Optional[str], bs: int, batches: int, window: int, chain: bool = False) -> Dict[str, Any]:
    """One plain run in a child process, on this checkout (src None) or on the checkout `src`."""
    env = dict(os.environ)
    env.pop("BENCH_HOP_SRC", None)
    if src:
        env["BENCH_HOP_SRC"] = src
    out = subprocess.run([sys.executable, __file__, "--plain-child", "--batches", str(bs), "--batches-per-run",
                          str(batches), "--window", str(window)] + (["--chain"] if chain else []),
                         env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def measure(batch_sizes: List[int], batches: int, rounds: int, window: int,
            against: Optional[str] = None, chain: bool = False) -> Dict[str, Any]:
    import agent

    res: Dict[str, Any] = {"batch_sizes": batch_sizes, "batches_per_run": batches, "rounds": rounds,
                           "window": window, "agent": agent.__file__, "against": against, "chain": chain, "runs": {}}
    st = Stages()
    for bs in batch_sizes:
        plain, staged, ours, theirs = [], [], [], []
        for i in range(rounds):  # the variants alternate, so that load falls on all alike
            plain.append(run_once(bs, batches * bs, window, None, chain))
            instrument(st)
            try:
                staged.append(run_once(bs, batches * bs, window, st, chain))
            finally:
                st.undo()
            if against:  # which checkout goes first alternates too
                if i % 2:
                    theirs.append(_child(against, bs, batches, window, chain))
                ours.append(_child(None, bs, batches, window, chain))
                if not i % 2:
                    theirs.append(_child(against, bs, batches, window, chain))
        res["runs"][str(bs)] = {"plain": plain, "staged": staged}
        if against:
            res["runs"][str(bs)].update(ours=ours, theirs=theirs)
    return res


def summarize(res: Dict[str, Any]) -> Dict[str, Any]:
    """Medians over the rounds: per batch size, per role, per stage (us per batch)."""
    out: Dict[str, Any] = {}
    for bs, r in res["runs"].items():
        roles = tuple(r["plain"][0]["cpu_us_per_batch"])  # ROLES, or ("chain",)
        plain = {role: statistics.median(x["cpu_us_per_batch"][role] for x in r["plain"]) for role in roles}
        staged_tot = {role: statistics.median(x["cpu_us_per_batch"][role] for x in r["staged"]) for role in roles}
        keys = sorted({k for x in r["staged"] for k in x["stages_us_per_batch"]})
        stages = {k: statistics.median(x["stages_us_per_batch"].get(k, 0.0) for x in r["staged"]) for k in keys}
        out[bs] = {"plain_us_per_batch": plain, "staged_total_us_per_batch": staged_tot, "stages_us_per_batch": stages,
                   "broker_standin_us_per_batch": statistics.median(x["broker_standin_us_per_batch"] for x in r["plain"]),
                   "stats_last": r["plain"][-1]["stats"]}
        if "ours" in r:
            cmp: Dict[str, Any] = {"agent": [r["ours"][0]["agent"], r["theirs"][0]["agent"]]}
            for role in roles + ("total",):
                def cpu(x: Dict[str, Any]) -> float:
                    c = x["cpu_us_per_batch"]
                    return sum(c.values()) if role == "total" else c[role]
                ratios = [cpu(a) / cpu(b) for a, b in zip(r["ours"], r["theirs"])]
                cmp[role] = {"ours_us": statistics.median(cpu(a) for a in r["ours"]),
                             "theirs_us": statistics.median(cpu(b) for b in r["theirs"]),
                             "ratio_per_round": [round(x, 3) for x in ratios], "ratio_median": statistics.median(ratios)}
            out[bs]["against"] = cmp
    return out


ORDER = ["paho: select/misc", "paho: read", "decode: parse", "decode: records", "decode: envelope", "admission",
         "order/dedup", "operator", "sink: record", "route/outbox", "encode: body slice", "encode: data",
         "paho: publish (build)", "paho: write (send)", "ack: decide", "encode: ack/proto", "ack: in", "core: other",
         "shell: other", "route memory", "route memory: write", "hand-off: in", "chain: other", "source: generate"]


def table(summary: Dict[str, Any]) -> str:
    lines = []
    for bs, s in summary.items():
        b = int(bs)
        roles = tuple(s["plain_us_per_batch"])
        lines.append(f"\nbatch size {b}: plain CPU us/batch  "
                     + "  ".join(f"{r} {s['plain_us_per_batch'][r]:.1f}" for r in roles)
                     + f"  (broker stand-in {s['broker_standin_us_per_batch']:.1f}, not counted)")
        lines.append(f"{'stage':22s}" + "".join(f"{r + ' us/b':>13s}{'us/rec':>8s}{'share':>7s}" for r in roles))
        st = s["stages_us_per_batch"]
        tot = {r: sum(v for k, v in st.items() if k.startswith(r + "|")) for r in roles}
        for stage in ORDER + ["total (staged)"]:
            row = f"{stage:22s}"
            for r in roles:
                v = tot[r] if stage.startswith("total") else st.get(f"{r}|{stage}", 0.0)
                row += f"{v:13.1f}{v / b:8.2f}{(v / tot[r] if tot[r] else 0):7.1%}" if v else f"{'-':>13s}{'':8s}{'':7s}"
            lines.append(row)
        if "against" in s:
            a = s["against"]
            lines.append(f"against {a['agent'][1]}: CPU us/batch ours / theirs, median of per-round ratios")
            for role in roles + ("total",):
                c = a[role]
                lines.append(f"  {role:8s} {c['ours_us']:9.1f} / {c['theirs_us']:9.1f}  ratio {c['ratio_median']:.3f}  "
                             f"rounds {c['ratio_per_round']}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,10,100", help="batch sizes, comma-separated")
    ap.add_argument("--batches-per-run", type=int, default=2000, help="batches at the sink per run (x0.1 more warm-up)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=int, default=8, help="max_inflight_batches, as bench dataplane")
    ap.add_argument("--chain", action="store_true", help="the three instances as one chain process")
    ap.add_argument("--against", metavar="DIR", help="also compare with the agent and lab of checkout DIR")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plain-child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.batches.split(",")]
    if a.plain_child:
        import agent

        out = run_once(sizes[0], a.batches_per_run * sizes[0], a.window, None, a.chain)
        out["agent"] = os.path.dirname(agent.__file__)
        json.dump(out, sys.stdout)
        return 0
    res = measure(sizes, a.batches_per_run, a.rounds, a.window, a.against and os.path.abspath(a.against), a.chain)
    summary = summarize(res)
    if a.json:
        json.dump({"summary": summary, "raw": res}, sys.stdout, indent=1)
        print()
    else:
        print(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
