"""`fog-agent bench policies`: every scaling policy on a local fleet of real agents, next to the
policy simulator on the same compressed taxi trace (docs/measurement.md, "Live vs simulated").

One run per policy: a private Mosquitto and three `fog-agent run` processes (agent.tools.demo.Fleet),
the pipeline source -> in_zone -> counting sink, in_zone at `service_time_ms` per record (capacity
C = 1000 / service_time_ms records/s) under the policy, the source replaying the simulator's taxi
trace (`policies_trace.taxi_trace`, two days compressed into `minutes`, peak `peak` records/s) as a
step profile. The monitor samples in_zone's instance count (supply); demand is computed from the
trace exactly as the simulator computes it (per-"minute" mean, smallest n with n x C >= it), and
the SPEC metrics come from the same module (agent.metrics_spec). After the trace the fleet drains
and the exactly-once verifier counts records lost and duplicated.

The simulated row runs `agent.sim.policies.simulate` on the same trace with a platform of the same
capacity (alpha = C, beta = 1, gamma = 0: the agents share one host, RTTs ~1 ms), three nodes, one
initial instance, the live decision period and cooldown, spawn and drain delays as measured here.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from agent.tools.pipeline_text import IN_ZONE, SINK, STEP_SOURCE

__all__ = ["PIPELINE", "live_trace", "run_live", "run_simulated", "compare", "format_rows"]

PIPELINE = """
[pipeline]
name = "pol"
[scaling]
policy = "none"
period = {period}
""" + STEP_SOURCE + IN_ZONE + """service_time_ms = {service_ms}
[operator.scaling]
policy = "{policy}"
period = {period}
cooldown = {cooldown}
capacity = {capacity}
max_instances = {n_max}
""" + SINK

NODES = ("n1", "n2", "n3")


def live_trace(seed: int, minutes: float, peak: float) -> List[float]:
    """The simulator's two taxi days compressed into `minutes` (records/s per second), scaled so
    that its largest second is `peak` (noise and bursts put the raw maximum well above the
    diurnal peak)."""
    from agent.sim.policies_trace import taxi_trace

    raw = taxi_trace(seed, days=2.0, speed_factor=2 * 86400 / (minutes * 60))
    top = max(raw) or 1.0
    return [x * peak / top for x in raw]


def _steps(trace: Sequence[float], every: int) -> List[List[float]]:
    out = []
    for t in range(0, len(trace), every):
        chunk = trace[t:t + every]
        out.append([float(t), round(sum(chunk) / len(chunk), 1)])
    out.append([float(len(trace)), 0.0])
    return out


def _demand_series(trace: Sequence[float], capacity: float, n_max: int, bucket: int) -> List[int]:
    from agent.sim.policies import Platform, _demand

    plat = Platform(alpha=capacity, beta=1.0, gamma=0.0)
    mst = [0.0] + [plat.mst(n, 0.0) for n in range(1, n_max + 1)]
    means = []
    for m0 in range(0, len(trace), bucket):
        chunk = trace[m0:m0 + bucket]
        means.append(sum(chunk) / len(chunk))
    return [_demand(means[t // bucket], mst) for t in range(len(trace))]


def run_live(policy: str, trace: Sequence[float], workdir: Path, seed: int = 0, capacity: float = 250.0,
             period: float = 1.0, cooldown: float = 2.0, n_max: int = 3, bucket: int = 10,
             log: Any = None) -> Dict[str, Any]:
    """One policy on a fresh private broker and three agents; figures of the run."""
    from agent.config import load_pipeline_text
    from agent.metrics_spec import elasticity_metrics
    from agent.tools.demo import Fleet, Monitor
    from agent.tools.verify import verify

    text = PIPELINE.format(seed=seed, steps=_steps(trace, 2), service_ms=round(1000.0 / capacity, 3), policy=policy,
                           period=period, cooldown=cooldown, capacity=capacity, n_max=n_max)
    cfg = load_pipeline_text(text)
    fleet = Fleet(workdir, nodes=NODES, slots=4, cluster=f"pol{policy.replace('-', '')}", shutdown_timeout=8.0,
                  log_level="warning")
    fleet.start()
    mon = Monitor(fleet.host, fleet.port, fleet.cluster)
    times: List[float] = []
    supply: List[int] = []
    try:
        if not mon.wait(lambda m: list(m.status.values()).count("online") == len(NODES), 60):
            raise RuntimeError(f"the agents did not come online: {mon.status}")
        fleet.deploy(text)
        t0 = time.monotonic()
        while True:
            t = time.monotonic() - t0
            if t >= len(trace):
                break
            n = mon.instances_per_operator(include_terminating=False).get("in_zone", 0)
            times.append(t)
            supply.append(max(1, n))
            time.sleep(0.5)
        # drain: the source stops at the trace's end; wait until the sink stops receiving
        last, quiet = -1.0, 0
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and quiet < 4:
            time.sleep(1.0)
            tot = mon.totals()["recorded"]
            quiet = quiet + 1 if tot == last else 0
            last = tot
        drain_s = time.monotonic() - t0 - len(trace)
        events = [e for e in mon.events if e.get("operator") == "in_zone" and e.get("type") in ("scale_out", "scale_in")]
    finally:
        mon.close()
        fleet.stop(timeout=20)
    v = verify(cfg, fleet.sink_dir)
    per_s = _demand_series(trace, capacity, n_max, bucket)
    demand = [per_s[min(len(per_s) - 1, int(t))] for t in times]
    m = elasticity_metrics(times, demand, supply, end=float(len(trace)))
    ops = sum(abs(b - a) for a, b in zip(supply, supply[1:]))
    return {"policy": policy, "mode": "live", **{k: round(float(x), 4) for k, x in m.as_dict().items()},
            "instance_ops": ops, "decisions": len(events), "records_generated": v.generated,
            "records_lost": v.lost, "records_duplicated": v.duplicated, "drain_s": round(drain_s, 1)}


def run_simulated(policy: str, trace: Sequence[float], seed: int = 0, capacity: float = 250.0,
                  period: float = 1.0, cooldown: float = 2.0, n_max: int = 3, bucket: int = 10,
                  spawn_delay: float = 2.0, drain_delay: float = 1.0) -> Dict[str, Any]:
    """The simulator on the same trace, platform and timing (see the module doc)."""
    from agent.sim import policies as sim

    matrix = {a: {b: 1.0 for b in NODES[:n_max] if b != a} for a in NODES[:n_max]}
    cfg = sim.SimConfig(period=period, spawn_delay=spawn_delay, drain_delay=drain_delay, initial=1,
                        cooldown=cooldown, platform=sim.Platform(alpha=capacity, beta=1.0, gamma=0.0))
    # the simulator's demand uses 60-sample buckets; ours uses `bucket` on both sides: recompute
    r = sim.simulate(policy, list(trace), matrix, seed, cfg)
    from agent.metrics_spec import elasticity_metrics

    times = [float(t) for t in range(len(trace))]
    demand = _demand_series(trace, capacity, n_max, bucket)
    m = elasticity_metrics(times, demand, r.supply, end=float(len(trace)))
    return {"policy": policy, "mode": "simulated", **{k: round(float(x), 4) for k, x in m.as_dict().items()},
            "instance_ops": r.operations, "records_lost": 0}


def compare(policies: Sequence[str], workdir: Path, minutes: float = 4.0, peak: float = 600.0, seed: int = 0,
            capacity: float = 250.0, period: float = 1.0, cooldown: float = 2.0,
            progress: Any = None) -> List[Dict[str, Any]]:
    trace = live_trace(seed, minutes, peak)
    rows: List[Dict[str, Any]] = []
    for p in policies:
        rows.append(run_simulated(p, trace, seed, capacity, period, cooldown))
        if progress:
            progress(rows[-1])
        rows.append(run_live(p, trace, workdir / p, seed, capacity, period, cooldown))
        if progress:
            progress(rows[-1])
    return rows


def gap(live: float, sim: float) -> Optional[float]:
    if sim == 0:
        return None if live == 0 else math.inf
    return (live - sim) / abs(sim)


def format_rows(rows: Sequence[Dict[str, Any]]) -> str:
    head = "| policy | mode | #reconf. | cost (instance-min) | accuracy_U | accuracy_O | timeshare_U % | instance ops | records lost |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['mode']} | {r['reconfigurations']:.0f} | {r['cost']:.2f} | "
                     f"{r['accuracy_u']:.3f} | {r['accuracy_o']:.3f} | {100 * r['timeshare_u']:.1f} | "
                     f"{r['instance_ops']} | {r['records_lost']} |")
    return "\n".join(lines)
