"""`fog-agent bench handover`: what handing one key group's state to a new owner costs, through a
real Mosquitto (docs/operators.md, "Key groups that move").

The roles of agent.instance.handover (`Member` for the old and the new owner, `Predecessor` x2),
each with its own MQTT client on a private broker, QoS 1, one topic per role. One round: the
decision (the old owner's `start`: Offer, Redirects), each predecessor's end-of-stream marker and
then `after` records of the group to the new owner, the state in chunks of at most MAX_CHUNK bytes
(base64 in JSON), `take_in` and the buffered records applied at the new owner. Measured: from the
decision to the last of those records applied at the new owner, per group; the state's bytes and
the bytes on the wire; the CPU time of `hand_out` and `take_in` (this thread's: on a shared
machine the wall times grow with the load, the CPU times much less). The baseline, in the same run and alternated with it: the same round for an
empty group (the protocol messages alone). The state is a `keyed_count`'s, filled directly with
synthetic keys up to the size asked (`KeyedState.hand_out` / `take_in` are the real ones).

NOT the live system (`--live` is: foglab.tools.handover_live). Records
of other groups are not flowing during the round; its figures are the hand-over's own cost.
A tool: runs a private broker on this machine, never imported on a fog node.
"""

from __future__ import annotations

import argparse
import base64
import json
import queue
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from agent.dataplane.keygroups import key_group
from agent.dataplane.owners import GroupTable
from agent.instance.handover import (
    MAX_CHUNK, Apply, Eos, Forget, Install, Installed, Member, Offer, Predecessor, Redirect, Send, StateChunk,
)
from agent.instance.keyed_state import KeyedState

__all__ = ["run_handover_bench", "register_bench", "SIZES"]

SIZES = (1_000, 100_000, 1_000_000, 10_000_000)  # bytes of one group's state
GROUPS = 16
PREDS = ("P1", "P2")


def _keyed_state() -> KeyedState:
    from agent.operators.builtin import OperatorContext
    from agent.operators.keyed import keyed_count

    return KeyedState(keyed_count.build(OperatorContext("c-0", "c", "n", "map", params={})), "c", "k", GROUPS)


def _fill(ks: KeyedState, g: int, size: int) -> None:
    """Keys in group `g` with running counts until its hand-over bytes are about `size`."""
    per_key = len(json.dumps([["sensor-000000", [123456, 0.0]]])) - 1
    ks.states[g] = {f"sensor-{i:06d}": [123456, 0.0] for i in range(max(0, size // per_key))}


def _encode(msg: Any) -> bytes:
    if isinstance(msg, StateChunk):
        return json.dumps({"t": "chunk", "g": msg.group, "i": msg.index, "n": msg.total,
                           "d": base64.b64encode(msg.data).decode()}).encode()
    if isinstance(msg, Redirect):
        return json.dumps({"t": "redirect", "g": msg.group, "new": msg.new, "v": msg.version}).encode()
    if isinstance(msg, Eos):
        return json.dumps({"t": "eos", "g": msg.group, "p": msg.sender}).encode()
    if isinstance(msg, Offer):
        return json.dumps({"t": "offer", "g": msg.group}).encode()
    if isinstance(msg, Installed):
        return json.dumps({"t": "installed", "g": msg.group}).encode()
    return json.dumps({"t": "rec", "g": msg[1], "r": msg[2]}).encode()


def _decode(raw: bytes) -> Any:
    d = json.loads(raw)
    t, g = d["t"], int(d["g"])
    if t == "chunk":
        return StateChunk(g, int(d["i"]), int(d["n"]), base64.b64decode(d["d"]))
    if t == "redirect":
        return Redirect(g, str(d["new"]), int(d["v"]))
    if t == "eos":
        return Eos(g, str(d["p"]))
    if t == "offer":
        return Offer(g)
    if t == "installed":
        return Installed(g)
    return ("rec", g, d["r"])


class _Bus:
    """One paho client per role on the private broker; every message lands in one queue, handled
    by the bench's thread in arrival order (each pair of roles: FIFO, QoS 1 on one topic)."""

    def __init__(self, port: int, roles: List[str]) -> None:
        import paho.mqtt.client as mqtt

        self.inbox: "queue.Queue[Tuple[str, str, bytes]]" = queue.Queue()
        self.prefix = f"hb-{uuid.uuid4().hex[:8]}"
        self.clients: Dict[str, Any] = {}
        self.wire_bytes = 0
        for role in roles:
            c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{self.prefix}-{role}")
            c.on_message = lambda _c, _u, m, role=role: self.inbox.put((role, m.topic.rsplit("/", 1)[-1], m.payload))
            c.connect("127.0.0.1", port)
            c.subscribe(f"{self.prefix}/{role}/+", qos=1)
            c.loop_start()
            self.clients[role] = c
        time.sleep(0.3)  # subscriptions in place

    def send(self, src: str, dest: str, msg: Any) -> None:
        payload = _encode(msg)
        self.wire_bytes += len(payload)
        self.clients[src].publish(f"{self.prefix}/{dest}/{src}", payload, qos=1)

    def close(self) -> None:
        for c in self.clients.values():
            c.loop_stop()
            c.disconnect()


def _round(bus: _Bus, size: int, after: int, timeout: float) -> Dict[str, Any]:
    """One group handed from OLD to NEW; returns its timings and bytes."""
    table = GroupTable.dealt(["OLD"], GROUPS)
    preds = {p: Predecessor(p, table.copy()) for p in PREDS}
    old, new = Member("OLD", range(GROUPS)), Member("NEW")
    ks = {"OLD": _keyed_state(), "NEW": _keyed_state()}
    g = key_group("k-moving", GROUPS)
    _fill(ks["OLD"], g, size)
    members = {"OLD": old, "NEW": new}
    sent_after = {p: 0 for p in PREDS}
    applied_at_new = 0
    state_bytes = 0
    t_snap = t_install = c_snap = c_install = 0.0  # wall and this thread's CPU (the machine may be shared)
    wire0 = bus.wire_bytes

    def perform(who: str, outs: List[Any]) -> None:
        nonlocal applied_at_new, t_install, c_install
        for o in outs:
            if isinstance(o, Send):
                bus.send(who, o.dest, o.message)
            elif isinstance(o, Install):
                t, c = time.perf_counter(), time.thread_time()
                ks[who].take_in(o.group, o.data)
                t_install += time.perf_counter() - t
                c_install += time.thread_time() - c
            elif isinstance(o, Apply):
                items = [(str(s), int(r["n"]), {"k": "k-moving"}) for s, r in o.records]
                ks[who].apply(who, items, 1)
                if who == "NEW":
                    applied_at_new += len(o.records)
            elif not isinstance(o, Forget):
                raise AssertionError(f"unexpected output {o!r}")

    def snapshot(group: int) -> bytes:
        nonlocal state_bytes, t_snap, c_snap
        t, c = time.perf_counter(), time.thread_time()
        data = ks["OLD"].hand_out(group)
        t_snap += time.perf_counter() - t
        c_snap += time.thread_time() - c
        state_bytes = len(data)
        return data

    t0 = time.perf_counter()
    perform("OLD", old.start(g, "NEW", list(PREDS), table.moved(g, "NEW")))
    deadline = t0 + timeout
    while applied_at_new < after * len(PREDS) or old.busy() or new.busy():
        try:
            dest, src, raw = bus.inbox.get(timeout=max(0.01, deadline - time.perf_counter()))
        except queue.Empty:
            raise TimeoutError(f"hand-over of {size} B not done after {timeout:g} s") from None
        msg = _decode(raw)
        if dest in preds:
            bus.send(dest, "OLD", preds[dest].on_redirect(src, msg)[0].message)
            for i in range(after):  # the group's records now go to the new owner
                bus.send(dest, preds[dest].route(g), ("rec", g, {"n": sent_after[dest] + i}))
            sent_after[dest] += after
            continue
        m = members[dest]
        if isinstance(msg, Eos):
            perform(dest, m.on_eos(msg, snapshot))
        elif isinstance(msg, StateChunk):
            perform(dest, m.on_chunk(src, msg))
        elif isinstance(msg, Offer):
            perform(dest, m.on_offer(src, msg))
        elif isinstance(msg, Installed):
            perform(dest, m.on_installed(msg))
        else:
            perform(dest, m.on_record(src, msg[1], msg[2]))
    total = time.perf_counter() - t0
    held = ks["NEW"].states.get(g, {})
    if g in ks["OLD"].states or held.get("k-moving", [0])[0] != after * len(PREDS):
        raise AssertionError(f"group {g}: still at the old owner, or its records not applied once at the new one")
    return {"ms": total * 1000, "snapshot_ms": t_snap * 1000, "install_ms": t_install * 1000,
            "snapshot_cpu_ms": c_snap * 1000, "install_cpu_ms": c_install * 1000,
            "state_bytes": state_bytes, "wire_bytes": bus.wire_bytes - wire0,
            "chunks": -(-state_bytes // MAX_CHUNK) or 1, "keys_moved": len(held) - 1}


def run_handover_bench(sizes: Tuple[int, ...] = SIZES, rounds: int = 3, after: int = 5, timeout: float = 60.0,
                       workdir: Optional[str] = None) -> Dict[str, Any]:
    from foglab.tools.broker import start_private_broker

    tmp = Path(workdir or tempfile.mkdtemp(prefix="fog-handover-bench-"))
    broker = start_private_broker(tmp / "broker")
    bus = _Bus(broker.port, ["OLD", "NEW", *PREDS])
    res: Dict[str, Any] = {"rounds": rounds, "records_after_redirect": after * len(PREDS), "max_chunk": MAX_CHUNK,
                           "sizes": []}
    try:
        _round(bus, 0, after, timeout)  # warm-up
        for size in sizes:
            runs, base = [], []
            for r in range(rounds):
                print(f"bench handover: {size} B, round {r + 1}/{rounds}", file=sys.stderr, flush=True)
                base.append(_round(bus, 0, after, timeout))  # the baseline, alternated
                runs.append(_round(bus, size, after, timeout))
            med = statistics.median(x["ms"] for x in runs)
            bmed = statistics.median(x["ms"] for x in base)
            res["sizes"].append({
                "state_bytes": runs[0]["state_bytes"], "wire_bytes": runs[0]["wire_bytes"],
                "chunks": runs[0]["chunks"], "keys_moved": runs[0]["keys_moved"],
                "ms_per_group_median": round(med, 2), "ms_per_group_max": round(max(x["ms"] for x in runs), 2),
                "snapshot_ms_median": round(statistics.median(x["snapshot_ms"] for x in runs), 2),
                "install_ms_median": round(statistics.median(x["install_ms"] for x in runs), 2),
                "snapshot_cpu_ms_median": round(statistics.median(x["snapshot_cpu_ms"] for x in runs), 2),
                "install_cpu_ms_median": round(statistics.median(x["install_cpu_ms"] for x in runs), 2),
                "baseline_empty_ms_median": round(bmed, 2), "ratio_vs_empty": round(med / bmed, 2) if bmed else None,
                "mb_per_s": round(runs[0]["state_bytes"] / 1e6 / (med / 1000), 2) if med else None,
            })
    finally:
        bus.close()
        broker.stop()
    return res


def _cmd(args: argparse.Namespace) -> int:
    if args.live:
        if args.rounds < 1:
            print("fog-agent bench handover: --rounds must be >= 1", file=sys.stderr)
            return 2
        from foglab.tools.handover_live import main_live

        return main_live(args.max_bytes, args.rounds, args.json)
    sizes = tuple(s for s in SIZES if s <= args.max_bytes)
    if not sizes or args.rounds < 1:
        print("fog-agent bench handover: --max-bytes must be >= 1000 and --rounds >= 1", file=sys.stderr)
        return 2
    res = run_handover_bench(sizes, args.rounds)
    if args.json:
        print(json.dumps(res, indent=2, sort_keys=True))
        return 0
    print(f"{res['rounds']} rounds per size, {res['records_after_redirect']} records of the group sent to the new "
          f"owner during each, chunks of {res['max_chunk']} B; baseline: the same round for an empty group")
    print(f"{'state B':>10} {'wire B':>10} {'chunks':>6} {'ms/group':>9} {'max':>8} {'snapshot':>9} {'install':>8} "
          f"{'cpu snap':>8} {'cpu inst':>8} {'empty ms':>9} {'ratio':>6} {'MB/s':>6}")
    for r in res["sizes"]:
        print(f"{r['state_bytes']:>10} {r['wire_bytes']:>10} {r['chunks']:>6} {r['ms_per_group_median']:>9.1f} "
              f"{r['ms_per_group_max']:>8.1f} {r['snapshot_ms_median']:>9.1f} {r['install_ms_median']:>8.1f} "
              f"{r['snapshot_cpu_ms_median']:>8.1f} {r['install_cpu_ms_median']:>8.1f} "
              f"{r['baseline_empty_ms_median']:>9.1f} {r['ratio_vs_empty']:>6} {r['mb_per_s']:>6}")
    return 0


def register_bench(groups: Any) -> None:
    p = groups.bench.add_parser("handover", help="time and bytes to hand one key group's state to a new owner "
                                "(through a private Mosquitto), against an empty group in the same run")
    p.add_argument("--rounds", type=int, default=3, help="hand-overs per state size (each alternated with the baseline)")
    p.add_argument("--max-bytes", type=int, default=SIZES[-1], help="largest group state, bytes (sizes: 1 kB to 10 MB)")
    p.add_argument("--live", action="store_true",
                   help="on live instances: a local agent runs a keyed count scaled out and in by force, "
                        "against its stateless twin (foglab.tools.handover_live; --max-bytes: its total state)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout (progress on stderr)")
    p.set_defaults(func=_cmd)
