"""`fog-agent bench handover --live`: key groups handed over by live instances, during a forced
scale-out and scale-in, against the same run with a stateless operator (docs/operators.md, "Key
groups that move", issue 22 item 7).

One run: a private Mosquitto and one `fog-agent run` (foglab.tools.demo.Fleet; its workers are real
processes), the pipeline source -> x -> sink of foglab.tools.handover_ops. x is either `PaddedCount`
(a running count per key whose cold keys hold `pad` bytes each: the instance's state is about
`cold_keys x pad`) or `StatelessTag` (the same output without state), both at `service_time_ms`
per record, with policy "none": the rounds are forced, as `fogctl scale` forces them (rpc `scale`
+1 to the keeper's agent, then -1 naming the copy). Timeline: the cold records, then the hot keys
at `rate` records/s; `hold` s after the stream is warm the scale-out, `hold` s after its groups are
processed at the copy the scale-in, `hold` s later the source is paused, the sink drained, the fleet
stopped.

Measured, per phase (out: from the scale-out request to the scale-in request; in: from the
scale-in request to the pause):
- per round: the decision (the `at` of the instance's decision record, in its stats) to its
  `moved_at` (every group it moved installed at its new owner with its held records applied:
  agent.instance.scaling_events `stamp_moved`); for the stateless twin, decision -> the copy's first record;
- per group: the decision to the first output of the group's new owner at the sink (for groups
  with hot keys; it includes waiting for a record of the group: hot_keys / rate s at most);
- hand-over messages and bytes (`handover_out`, `handover_bytes_out`: the creator's in the
  scale-out, the keeper's `handover_in`/`handover_bytes_in` in the scale-in, which is what the
  leaver sent) apart from the protocol's messages (`protocol_out`, all instances);
- the lowest 1-second output/input ratio (outputs arriving at the sink in that second over records
  generated in it) and the p50/p99 latency (sink arrival - generation) of records of moving keys
  (processed by another instance after the phase than before it) and of the other keys.
Checked: every output once and equal to the reference regenerated from the stream (key, count,
sequence number: the count of key k at its n-th record is n): 0 lost, 0 duplicated.
A tool: it runs a private broker and agents on this machine, never on a fog node.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from agent.dataplane.keygroups import key_group
from agent.operators.builtin import read_sink_ids
from foglab.tools.handover_ops import LAT_SUFFIX, read_lat, stream_key
from foglab.tools.verify import source_counts

__all__ = ["LIVE_SIZES", "LiveParams", "run_live_handover", "run_live_bench", "live_pipeline", "check_outputs"]

# total state of the keyed instance, bytes of padding: 0 (the counts alone, ~1-2 kB), 100 kB, 1 MB, 10 MB
LIVE_SIZES = (0, 100_000, 1_000_000, 10_000_000)
GROUPS = 128
OPS_MODULE = "fog_handover_ops"  # handover_ops.py written under this name into the run's directory
PIPELINE_NAME = "hb"

PIPELINE = """
[pipeline]
name = "{name}"

[scaling]
policy = "none"

[[operator]]
name = "source"
kind = "source"
function = "{ops}:HandoverSource"
key = "k"
[operator.params]
profile = "constant"
rate = {rate}
cold_keys = {cold_keys}
hot_keys = {hot_keys}
pad = {pad}

[[operator]]
name = "x"
function = "{ops}:{function}"
service_time_ms = {service_ms}
key_groups = {groups}

[[operator]]
name = "sink"
kind = "sink"
function = "{ops}:StampingSink"
"""


class LiveParams:
    """One run's knobs (the defaults: ~30-40 s a run on the 2-core development machine)."""

    def __init__(self, state_bytes: int = 0, stateful: bool = True, rate: float = 300.0, hot_keys: int = 64,
                 cold_keys: int = 256, service_ms: float = 1.0, hold: float = 3.0, timeout: float = 90.0) -> None:
        self.state_bytes, self.stateful = int(state_bytes), bool(stateful)
        self.rate, self.hot_keys, self.service_ms, self.hold, self.timeout = rate, hot_keys, service_ms, hold, timeout
        self.cold_keys = cold_keys if state_bytes > 0 else 0
        self.pad = int(math.ceil(state_bytes / cold_keys)) if state_bytes > 0 else 0


def live_pipeline(p: LiveParams) -> str:
    return PIPELINE.format(name=PIPELINE_NAME, ops=OPS_MODULE, rate=p.rate, cold_keys=p.cold_keys, hot_keys=p.hot_keys, pad=p.pad,
                           function="PaddedCount" if p.stateful else "StatelessTag", service_ms=p.service_ms,
                           groups=GROUPS)


# ---- the verdict --------------------------------------------------------------------------------

Row = Tuple[str, int, int, float, str, float]  # key, n, s, t0, instance, arrival


def check_outputs(rows: Sequence[Row], generated: int, p: LiveParams, dup_ids: int) -> Dict[str, Any]:
    """Every output against the reference regenerated from the stream: the output of record s is
    (stream_key(s), its count, s) for the keyed count, (stream_key(s), 0, s) for the twin."""
    want: Set[Tuple[str, int, int]] = set()
    per_key: Counter = Counter()
    for s in range(generated):
        k = stream_key(s, p.cold_keys, p.hot_keys)
        per_key[k] += 1
        want.add((k, per_key[k] if p.stateful else 0, s))
    got = Counter((k, n, s) for k, n, s, _t0, _i, _a in rows)
    lost = len(want - set(got))
    extra = len(set(got) - want)
    twice = sum(c - 1 for c in got.values() if c > 1) + dup_ids
    return {"generated": generated, "outputs": len(rows), "lost": lost, "duplicated": twice,
            "differing": extra, "exactly_once": lost == 0 and twice == 0 and extra == 0 and generated > 0}


# ---- measures over the sink's rows ----------------------------------------------------------------


def _pct(values: List[float], q: float) -> Optional[float]:
    if not values:
        return None
    v = sorted(values)
    return round(v[min(len(v) - 1, max(0, int(math.ceil(q * len(v))) - 1))] * 1000, 1)


def _owners(rows: Iterable[Row], t_from: float, t_to: float) -> Dict[str, str]:
    """key -> the instance that processed its last record generated in [t_from, t_to)."""
    out: Dict[str, str] = {}
    for k, _n, _s, t0, inst, _a in rows:
        if t_from <= t0 < t_to:
            out[k] = inst
    return out


def phase_figures(rows: Sequence[Row], t_from: float, t_to: float, before: Dict[str, str],
                  after: Dict[str, str], decision_at: float) -> Dict[str, Any]:
    """The figures of one phase [t_from, t_to): keys that moved (their owner before the phase is
    not their owner after it), the lowest 1-s output/input ratio, latencies of moving and other
    keys, and per moved group the decision -> the first output of its new owner at the sink."""
    moving = {k for k, inst in after.items() if before.get(k) not in (None, inst)}
    lat_moving: List[float] = []
    lat_other: List[float] = []
    ins: Counter = Counter()
    outs: Counter = Counter()
    first_new: Dict[int, float] = {}
    for k, _n, _s, t0, inst, arrival in rows:
        if t_from <= t0 < t_to:
            (lat_moving if k in moving else lat_other).append(arrival - t0)
            ins[int(t0 - t_from)] += 1
        if t_from <= arrival < t_to:
            outs[int(arrival - t_from)] += 1
        if k in moving and inst == after[k] and arrival >= decision_at:
            g = key_group(k, GROUPS)
            first_new[g] = min(first_new.get(g, arrival), arrival)
    seconds = range(int(t_to - t_from))  # whole seconds only
    ratios = [outs[i] / ins[i] for i in seconds if ins[i]]
    per_group = sorted((t - decision_at) * 1000 for t in first_new.values())
    return {
        "moving_keys": len(moving), "moved_groups_seen": len(first_new),
        "min_ratio_1s": round(min(ratios), 3) if ratios else None,
        "p50_ms_moving": _pct(lat_moving, 0.5), "p99_ms_moving": _pct(lat_moving, 0.99),
        "p50_ms_other": _pct(lat_other, 0.5), "p99_ms_other": _pct(lat_other, 0.99),
        "records_moving": len(lat_moving), "records_other": len(lat_other),
        "group_ms_median": round(statistics.median(per_group), 1) if per_group else None,
        "group_ms_max": round(max(per_group), 1) if per_group else None,
    }


# ---- one run ------------------------------------------------------------------------------------


def _wait(what: str, pred: Callable[[], bool], timeout: float, step: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench handover --live: {what} not after {timeout:g} s")
        time.sleep(step)


def _instances(mon: Any, operator: str) -> List[str]:
    with mon._lock:
        return sorted(str(i["id"]) for doc in mon.states.values() for i in doc.get("instances", []) or []
                      if isinstance(i, dict) and i.get("operator") == operator and i.get("status") == "active")


def _last_decision(st: Dict[str, Any], kind: str) -> Dict[str, Any]:
    ds = [d for d in st.get("decisions", []) or [] if isinstance(d, dict) and d.get("kind") == kind]
    return ds[-1] if ds else {}


def _num(st: Dict[str, Any], key: str) -> int:
    v = st.get(key, 0)
    return int(v) if isinstance(v, (int, float)) else 0


def _ops_fleet_class() -> Any:
    from foglab.tools import handover_ops
    from foglab.tools.demo import Fleet

    class OpsFleet(Fleet):
        """The demo's fleet whose agents admit the bench's operators as a user's module: the
        source of foglab.tools.handover_ops under the name OPS_MODULE, in the run's directory, on
        the agents' PYTHONPATH and in their `[operators] modules` (fog-agent's own modules may
        not be listed there)."""

        def start(self) -> "OpsFleet":
            ops = self.workdir / "ops"
            ops.mkdir(parents=True, exist_ok=True)
            (ops / f"{OPS_MODULE}.py").write_text(Path(handover_ops.__file__).read_text())
            return super().start()  # type: ignore[return-value]

        def start_agent(self, node: str, env: Optional[Dict[str, str]] = None) -> Any:
            env = dict(env or self.agent_env())
            env["PYTHONPATH"] = os.pathsep.join([env.get("PYTHONPATH", ""), str(self.workdir / "ops")]).strip(os.pathsep)
            return super().start_agent(node, env)

    return OpsFleet


def _OpsFleet(*args: Any, **kwargs: Any) -> Any:
    return _ops_fleet_class()(*args, **kwargs)


def run_live_handover(p: LiveParams, workdir: Path, say: Callable[[str], None] = lambda _l: None) -> Dict[str, Any]:
    """One run (module docstring); returns its figures and verdict."""
    from foglab.tools.demo import Monitor

    name = "stateful" if p.stateful else "stateless"
    fleet = _OpsFleet(Path(workdir), nodes=("n1",), slots=8, cluster=f"hb{os.getpid() % 10000}{name[:5]}",
                  log_level="info", shutdown_timeout=8.0, operator_modules=(OPS_MODULE,))  # info: the moved_at lines
    res: Dict[str, Any] = {"operator": "PaddedCount" if p.stateful else "StatelessTag", "pad_per_key": p.pad,
                           "cold_keys": p.cold_keys, "hot_keys": p.hot_keys, "rate": p.rate,
                           "service_time_ms": p.service_ms, "load_avg_start": round(os.getloadavg()[0], 1)}
    mon = None
    fleet.start()
    try:
        mon = Monitor(fleet.host, fleet.port, fleet.cluster)
        fleet.wait_online(mon)
        fleet.deploy(live_pipeline(p))
        _wait("the pipeline's instances active",
              lambda: all(len(_instances(mon, op)) == 1 for op in ("source", "x", "sink")), p.timeout)
        (keeper,), (src,), (sink,) = (_instances(mon, op) for op in ("x", "source", "sink"))
        warm = p.cold_keys + int(p.rate * p.hold)
        _wait("the cold keys and a warm stream at the sink",
              lambda: _num(mon.stats_of(sink), "recorded") >= warm, p.timeout)  # type: ignore[union-attr]
        k0 = mon.stats_of(keeper)
        proto0 = _protocol_out(mon)
        # -- scale-out
        say(f"  {name}: scale-out")
        t_out = time.time()
        reply = mon.call(fleet.host, fleet.port, "n1", {"v": 1, "op": "scale", "operator": "x", "delta": 1,
                                                        "pipeline": PIPELINE_NAME})
        if not reply.get("ok"):
            raise RuntimeError(f"bench handover --live: scale +1 refused: {reply.get('error')}")
        copies: List[str] = []

        def out_done() -> bool:
            copies[:] = [i for i in _instances(mon, "x") if i != keeper]  # type: ignore[union-attr]
            if len(copies) != 1:
                return False
            copy = copies[0]
            d = _last_decision(mon.stats_of(keeper), "scale_out")  # type: ignore[union-attr]
            if p.stateful:
                return "moved_at" in d
            return isinstance(mon.stats_of(copy).get("first_record_at"), (int, float))  # type: ignore[union-attr]

        _wait("the scale-out's groups at the copy", out_done, p.timeout)
        copy = copies[0]
        time.sleep(p.hold)
        k1, c1 = mon.stats_of(keeper), mon.stats_of(copy)
        proto1 = _protocol_out(mon)
        d_out = _last_decision(k1, "scale_out")
        # -- scale-in
        say(f"  {name}: scale-in")
        t_in = time.time()
        reply = mon.call(fleet.host, fleet.port, "n1", {"v": 1, "op": "scale", "operator": "x", "delta": -1,
                                                        "instances": [copy], "pipeline": PIPELINE_NAME})
        if not reply.get("ok"):
            raise RuntimeError(f"bench handover --live: scale -1 refused: {reply.get('error')}")
        _wait("the copy gone", lambda: _instances(mon, "x") == [keeper], p.timeout)  # type: ignore[union-attr]
        time.sleep(p.hold)
        t_end = time.time()
        reply = mon.call(fleet.host, fleet.port, "n1", {"v": 1, "op": "set", "instance": src, "fields": {"paused": True}})
        if not reply.get("ok") or not mon.wait_sink_quiet(p.timeout, quiet=2.0):
            raise TimeoutError(f"bench handover --live: the source not paused ({reply}) or the sink not quiet")
        k2, c2 = mon.stats_of(keeper), mon.stats_of(copy)
        proto2 = _protocol_out(mon)
    finally:
        if mon is not None:
            mon.close()
        res["agent_exit_codes"] = fleet.stop()
    res["load_avg_end"] = round(os.getloadavg()[0], 1)
    rows: List[Row] = []
    for path in sorted(fleet.sink_dir.glob(f"*{LAT_SUFFIX}")):
        rows.extend(read_lat(path))
    _ids, dup_ids = read_sink_ids(fleet.sink_dir)
    generated = sum(source_counts(fleet.sink_dir).values())
    res["verdict"] = check_outputs(rows, generated, p, dup_ids)
    start = min((r[3] for r in rows), default=t_out)
    before_out = _owners(rows, start, t_out)
    mid = _owners(rows, t_out, t_in)
    after_in = _owners(rows, t_in, t_end)
    at_out = float(d_out.get("at") or t_out)
    at_in = t_in  # the leaver's stats are gone with it: its groups are timed from the request
    res["scale_out"] = dict(
        phase_figures(rows, t_out, t_in, before_out, mid, at_out),
        round_ms=_round_ms(d_out, c1, p.stateful),
        handover_messages=_num(k1, "handover_out") - _num(k0, "handover_out"),
        handover_bytes=_num(k1, "handover_bytes_out") - _num(k0, "handover_bytes_out"),
        protocol_messages=proto1 - proto0,
        groups_moved=_num(k1.get("handover") or {}, "groups_out") - _num(k0.get("handover") or {}, "groups_out"),
    )
    res["scale_in"] = dict(
        phase_figures(rows, t_in, t_end, mid, after_in, at_in),
        round_ms=_logged_round_ms(fleet.workdir / "n1.log", copy, "scale_in"),
        handover_messages=_num(k2, "handover_in") - _num(k1, "handover_in"),
        handover_bytes=_num(k2, "handover_bytes_in") - _num(k1, "handover_bytes_in"),
        protocol_messages=proto2 - proto1,
        groups_moved=_num(k2.get("handover") or {}, "groups_in") - _num(k1.get("handover") or {}, "groups_in"),
    )
    res["keys_held_at_end"] = k2.get("keys_held")
    return res


def _logged_round_ms(log_path: Path, instance: str, kind: str) -> Optional[float]:
    """The leaver's own decision -> moved time, from its log line (agent.instance.scaling_events
    `stamp_moved`): its stats leave with it."""
    pat = re.compile(r'instance=(\S+) msg="key groups of the (\w+) decided (\d+) ms ago')
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    found = [float(m.group(3)) for m in pat.finditer(text) if m.group(1) == instance and m.group(2) == kind]
    return found[-1] if found else None


def _round_ms(d: Dict[str, Any], copy_stats: Dict[str, Any], stateful: bool) -> Optional[float]:
    """Decision -> every moved group processed at its new owner (stateful), or -> the copy's first
    record (stateless: a copy processes its groups as soon as it is in the successors' routes)."""
    if not d or "at" not in d:
        return None
    end = d.get("moved_at") if stateful else copy_stats.get("first_record_at")
    return round((float(end) - float(d["at"])) * 1000, 1) if isinstance(end, (int, float)) else None


def _protocol_out(mon: Any) -> int:
    with mon._lock:
        return sum(_num(st or {}, "protocol_out") for st in mon.instance_stats.values())


# ---- the bench ----------------------------------------------------------------------------------


def run_live_bench(sizes: Sequence[int] = LIVE_SIZES, rounds: int = 1, workdir: Optional[Path] = None,
                   baseline: bool = True, params: Optional[Dict[str, Any]] = None,
                   say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> Dict[str, Any]:
    """Each size `rounds` times, the stateless twin (the baseline) and the keyed count alternated."""
    base = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="fog-handover-live-"))
    out: Dict[str, Any] = {"live": True, "rounds": rounds, "groups": GROUPS, "workdir": str(base), "sizes": []}
    for size in sizes:
        entry: Dict[str, Any] = {"state_bytes_nominal": size, "stateful": [], "stateless": []}
        for r in range(rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            for stateful in order:
                if not stateful and not baseline:
                    continue
                p = LiveParams(size, stateful, **(params or {}))
                label = "stateful" if stateful else "stateless"
                say(f"bench handover --live: {size} B, {label}, round {r + 1}/{rounds}")
                entry[label].append(run_live_handover(p, base / f"{size}-{label}-{r}", say))
        entry["summary"] = summarize(entry)
        out["sizes"].append(entry)
    out["exactly_once"] = all(run["verdict"]["exactly_once"] for e in out["sizes"]
                              for run in e["stateful"] + e["stateless"])
    return out


def _med(runs: List[Dict[str, Any]], phase: str, key: str) -> Optional[float]:
    vals = [r[phase][key] for r in runs if isinstance(r[phase].get(key), (int, float))]
    return round(statistics.median(vals), 3) if vals else None


def summarize(entry: Dict[str, Any]) -> Dict[str, Any]:
    """Medians over the rounds of one size: the keyed count's figures next to the twin's."""
    s: Dict[str, Any] = {}
    for phase in ("scale_out", "scale_in"):
        row: Dict[str, Any] = {}
        for key in ("round_ms", "group_ms_median", "group_ms_max", "handover_messages", "handover_bytes",
                    "protocol_messages", "groups_moved", "min_ratio_1s", "p99_ms_moving", "p99_ms_other"):
            row[key] = _med(entry["stateful"], phase, key)
        for key in ("round_ms", "min_ratio_1s", "p99_ms_moving", "p99_ms_other"):
            row[f"stateless_{key}"] = _med(entry["stateless"], phase, key)
        s[phase] = row
    s["load_avg"] = [r["load_avg_start"] for r in entry["stateful"] + entry["stateless"]]
    return s


def print_live(res: Dict[str, Any], out: Any = sys.stdout) -> None:
    print(f"{res['rounds']} round(s) per size, {res['groups']} key groups; keyed count vs its stateless twin "
          f"(in brackets), same stream, alternated; work dir {res['workdir']}", file=out)
    print(f"{'state B':>9} {'phase':<9} {'round ms':>16} {'group ms med/max':>17} {'h/o msgs':>8} {'h/o bytes':>10} "
          f"{'proto':>5} {'min ratio 1s':>14} {'p99 moving ms':>16} {'p99 other ms':>16}", file=out)
    for e in res["sizes"]:
        for phase in ("scale_out", "scale_in"):
            r = e["summary"][phase]
            print(f"{e['state_bytes_nominal']:>9} {phase:<9} {str(r['round_ms']) + ' [' + str(r['stateless_round_ms']) + ']':>16} "
                  f"{str(r['group_ms_median']) + '/' + str(r['group_ms_max']):>17} {str(r['handover_messages']):>8} "
                  f"{str(r['handover_bytes']):>10} {str(r['protocol_messages']):>5} "
                  f"{str(r['min_ratio_1s']) + ' [' + str(r['stateless_min_ratio_1s']) + ']':>14} "
                  f"{str(r['p99_ms_moving']) + ' [' + str(r['stateless_p99_ms_moving']) + ']':>16} "
                  f"{str(r['p99_ms_other']) + ' [' + str(r['stateless_p99_ms_other']) + ']':>16}", file=out)
    print(f"exactly once (every output equal to the reference, none twice): {res['exactly_once']}", file=out)


def main_live(max_bytes: int, rounds: int, as_json: bool) -> int:
    sizes = tuple(s for s in LIVE_SIZES if s <= max_bytes)
    res = run_live_bench(sizes, rounds)
    if as_json:
        print(json.dumps(res, indent=2, sort_keys=True, default=str))
    else:
        print_live(res)
    return 0 if res["exactly_once"] else 3

