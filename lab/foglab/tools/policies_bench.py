"""`fog-agent bench policies`: every scaling policy on a local fleet of real agents, next to the
policy simulator on the same compressed taxi trace (docs/measurement.md, "Live vs simulated").

One run per policy: a private Mosquitto and three `fog-agent run` processes (foglab.tools.demo.Fleet),
the pipeline source -> in_zone -> counting sink, in_zone at `service_time_ms` per record (capacity
C = 1000 / service_time_ms records/s) under the policy, the source replaying the simulator's taxi
trace (`policies_trace.taxi_trace`, two days compressed into `minutes`, peak `peak` records/s) as a
step profile. The monitor samples in_zone's instance count (supply); demand is computed from the
trace exactly as the simulator computes it (per-"minute" mean, smallest n with n x C >= it), and
the SPEC metrics come from the same module (agent.metrics_spec). After the trace the fleet drains
and the exactly-once verifier counts records lost and duplicated.

With `consolidate` (docs/site-manager.md) every agent is also a site-manager candidate: the
leader drains and releases nodes the fleet can do without and acquires them back when spare
capacity falls below the target. The hooks only log (a released agent stays up, drained and
hosting nothing: one host cannot power its agents off), so the node-minutes are those a fleet
whose hooks cut the power would pay: a node counts from the start until its release and again
from its acquisition. The cost a user pays for that: the figures of both runs side by side
(reconfigurations, under-provisioning, records the source could not generate on time because
the pipeline held it back, in-flight latency, records lost).

The simulated row runs `foglab.sim.policies.simulate` on the same trace with a platform of the same
capacity (alpha = C, beta = 1, gamma = 0: the agents share one host, RTTs ~1 ms), three nodes, one
initial instance, the live decision period and cooldown, spawn and drain delays as measured here.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from foglab.tools.pipeline_text import IN_ZONE, SINK, STEP_SOURCE

__all__ = ["PIPELINE", "SiteParams", "live_trace", "seasonal_profile", "run_live", "run_simulated", "compare", "format_rows",
           "plot_consolidation"]

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
{extra_scaling}
""" + SINK

NODES = ("n1", "n2", "n3")
SLOTS = 4

# The hooks append "<action> <node> <unix time>" to a file in the run's directory (nothing is powered off).
SITE_TOML = """
[site_manager]
enabled = true
target = {target}
min_nodes = {min_nodes}
max_nodes = {max_nodes}
cooldown = {cooldown}
timeout = 60.0
period = {period}
lease = {lease}
release_hook = ["{hook}", "release"]
acquire_hook = ["{hook}", "acquire"]
"""


@dataclass(frozen=True)
class SiteParams:
    """The [site_manager] section of every agent in a consolidation run (docs/site-manager.md)."""

    target: float = 0.3
    min_nodes: int = 1
    cooldown: float = 5.0
    period: float = 1.0
    lease: float = 4.0

    def toml(self, hook: Path) -> str:
        return SITE_TOML.format(target=self.target, min_nodes=self.min_nodes, max_nodes=len(NODES),
                                cooldown=self.cooldown, period=self.period, lease=self.lease, hook=hook)


def _write_hook(workdir: Path) -> Path:
    hook = workdir / "site-hook.sh"
    hook.write_text('#!/bin/sh\necho "$1 $2 $(date +%s.%N)" >> "$(dirname "$0")/site-hooks.log"\n')
    hook.chmod(0o755)
    return hook


def hook_actions(workdir: Path, wall0: float) -> List[Tuple[float, str, str]]:
    """(seconds since wall0, action, node) of every hook run, in time order: the power actions
    themselves (the events topic is not retained: a monitor that subscribes after the fleet
    started misses a release made before; the hooks' log misses none). Before wall0 counts as 0."""
    path = workdir / "site-hooks.log"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = line.split()
        if len(parts) == 3 and parts[0] in ("release", "acquire"):
            try:
                out.append((max(0.0, float(parts[2]) - wall0), parts[0], parts[1]))
            except ValueError:
                continue
    return sorted(out)


def powered_series(times: Sequence[float], actions: Sequence[Tuple[float, str, str]], nodes: int) -> List[int]:
    """Nodes powered at each sample time: all of them, less those released and not acquired
    since (`actions` = (time, action, node), in time order)."""
    out, off, i = [], set(), 0
    for t in times:
        while i < len(actions) and actions[i][0] <= t:
            _, act, node = actions[i]
            if act == "release":
                off.add(node)
            elif act == "acquire":
                off.discard(node)
            i += 1
        out.append(nodes - len(off))
    return out


def step_minutes(times: Sequence[float], values: Sequence[float], end: float) -> float:
    """The integral of a step function sampled at `times` up to `end`, in value-minutes."""
    total = 0.0
    for k, (t, v) in enumerate(zip(times, values)):
        nxt = times[k + 1] if k + 1 < len(times) else end
        total += v * max(0.0, min(nxt, end) - t)
    return total / 60.0


def live_trace(seed: int, minutes: float, peak: float) -> List[float]:
    """The simulator's two taxi days compressed into `minutes` (records/s per second), scaled so
    that its largest second is `peak` (noise and bursts put the raw maximum well above the
    diurnal peak)."""
    from foglab.sim.policies_trace import taxi_trace

    raw = taxi_trace(seed, days=2.0, speed_factor=2 * 86400 / (minutes * 60))
    top = max(raw) or 1.0
    return [x * peak / top for x in raw]


def seasonal_profile(seed: int, minutes: float, peak: float) -> List[float]:
    """The `seasonal` policy's profile for a bench run: the mean input of each second of the
    compressed day, learned from another seed's two days (training days apart from the test
    days; same weekday shape, other noise and bursts)."""
    from agent.policy.seasonal import learn_profile

    train = live_trace(seed + 1000, minutes, peak)
    return [round(x, 1) for x in learn_profile(train, 1, len(train) // 2)]


def _steps(trace: Sequence[float], every: int) -> List[List[float]]:
    out = []
    for t in range(0, len(trace), every):
        chunk = trace[t:t + every]
        out.append([float(t), round(sum(chunk) / len(chunk), 1)])
    out.append([float(len(trace)), 0.0])
    return out


def _demand_series(trace: Sequence[float], capacity: float, n_max: int, bucket: int) -> List[int]:
    from foglab.sim.policies import Platform, _demand

    plat = Platform(alpha=capacity, beta=1.0, gamma=0.0)
    mst = [0.0] + [plat.mst(n, 0.0) for n in range(1, n_max + 1)]
    means = []
    for m0 in range(0, len(trace), bucket):
        chunk = trace[m0:m0 + bucket]
        means.append(sum(chunk) / len(chunk))
    return [_demand(means[t // bucket], mst) for t in range(len(trace))]


def run_live(policy: str, trace: Sequence[float], workdir: Path, seed: int = 0, capacity: float = 250.0,
             period: float = 1.0, cooldown: float = 2.0, n_max: int = 3, bucket: int = 10,
             consolidate: Optional[SiteParams] = None, log: Any = None) -> Dict[str, Any]:
    """One policy on a fresh private broker and three agents; figures of the run."""
    from agent.config import load_pipeline_text
    from agent.metrics_spec import elasticity_metrics
    from foglab.tools.demo import Fleet, Monitor
    from foglab.tools.verify import verify

    extra_scaling = ""
    if policy in ("seasonal", "planned"):  # slot j of the profile = second j of each compressed day, from the deploy on
        extra_scaling = (f"profile = {seasonal_profile(seed, len(trace) / 60.0, max(trace))}\n"
                         f"profile_slot = 1.0\nprofile_start = {{start}}")
    text = PIPELINE.format(seed=seed, steps=_steps(trace, 2), service_ms=round(1000.0 / capacity, 3), policy=policy,
                           period=period, cooldown=cooldown, capacity=capacity, n_max=n_max,
                           extra_scaling=extra_scaling)
    cfg = load_pipeline_text(text.replace("{start}", "0.0"))
    workdir.mkdir(parents=True, exist_ok=True)
    extra = consolidate.toml(_write_hook(workdir)) if consolidate is not None else ""
    fleet = Fleet(workdir, nodes=NODES, slots=SLOTS, cluster=f"pol{policy.replace('-', '')}{'c' if extra else ''}",
                  shutdown_timeout=8.0, log_level="warning", extra_toml=extra)
    fleet.start()
    mon = Monitor(fleet.host, fleet.port, fleet.cluster)
    times: List[float] = []
    supply: List[int] = []
    counts: List[Tuple[float, float]] = []  # (generated, recorded) as the instances last reported
    actions: List[Tuple[float, str, str]] = []  # (time, action, node) of the site manager's events seen
    seen = 0
    try:
        fleet.wait_online(mon)
        fleet.deploy(text.replace("{start}", repr(time.time())))
        t0, wall0 = time.monotonic(), time.time()
        while True:
            t = time.monotonic() - t0
            if t >= len(trace):
                break
            n = mon.instances_per_operator(include_terminating=False).get("in_zone", 0)
            tot = mon.totals()
            times.append(t)
            supply.append(max(1, n))
            counts.append((tot["generated"], tot["recorded"]))
            site = [e for e in list(mon.events) if e.get("type") == "site_action"]
            for e in site[seen:]:
                d = e.get("detail") or {}
                actions.append((t, str(d.get("action")), str(d.get("node"))))
            seen = len(site)
            time.sleep(0.5)
        # drain: the source stops at the trace's end; wait until the sink stops receiving
        last, quiet = -1.0, 0
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and quiet < 4:
            time.sleep(1.0)
            tot = mon.totals()
            quiet = quiet + 1 if tot["recorded"] == last else 0
            last = tot["recorded"]
        drain_s = time.monotonic() - t0 - len(trace)
        events = [e for e in mon.events if e.get("operator") == "in_zone" and e.get("type") in ("scale_out", "scale_in")]
        final = mon.totals()
        deferred = sum(float(s.get("deferred", 0) or 0) for i, s in mon.instance_stats.items()
                       if mon.instance_operator.get(i) == "source")
    finally:
        mon.close()
        fleet.stop(timeout=20)
    v = verify(cfg, fleet.sink_dir)
    per_s = _demand_series(trace, capacity, n_max, bucket)
    demand = [per_s[min(len(per_s) - 1, int(t))] for t in times]
    end = float(len(trace))
    m = elasticity_metrics(times, demand, supply, end=end)
    ops = sum(abs(b - a) for a, b in zip(supply, supply[1:]))
    power = hook_actions(workdir, wall0)
    powered = powered_series(times, power, len(NODES))
    # The fewest nodes that could host every instance at each sample (in_zone + source + sink),
    # i.e. perfect consolidation with no delay: the floor for the node-minutes.
    packed = [max(1, math.ceil((s + 2) / SLOTS)) for s in supply]
    offered = sum(trace)
    # in_zone filters: of what the source generated, the share `kept` reaches the sink; records in
    # flight = generated x kept - recorded (both as last reported, each within a state period)
    kept = final["recorded"] / final["generated"] if final["generated"] else 1.0
    in_flight = [max(0.0, g * kept - r) for g, r in counts]
    return {"policy": policy, "mode": "live", "consolidation": consolidate is not None,
            **{k: round(float(x), 4) for k, x in m.as_dict().items()},
            "instance_ops": ops, "decisions": len(events), "records_generated": v.generated,
            "records_lost": v.lost, "records_duplicated": v.duplicated, "drain_s": round(drain_s, 1),
            "node_minutes": round(step_minutes(times, powered, end), 3),
            "node_minutes_packed": round(step_minutes(times, packed, end), 3),
            # within the trace (an idle fleet after it may release one more)
            "nodes_released": sum(1 for a in power if a[1] == "release" and a[0] <= end),
            "nodes_acquired": sum(1 for a in power if a[1] == "acquire" and a[0] <= end),
            "site_actions": [[round(t, 1), a, n] for t, a, n in actions],
            "records_deferred": int(deferred), "deferred_share": round(deferred / offered, 4) if offered else 0.0,
            # Little's law: mean records in flight / mean throughput = mean time in the pipeline
            "latency_s": round((sum(in_flight) / len(in_flight)) / (final["recorded"] / end), 3)
            if in_flight and final["recorded"] else None,
            "series": {"t": [round(t, 1) for t in times], "supply": supply, "demand": demand, "powered": powered}}


def run_simulated(policy: str, trace: Sequence[float], seed: int = 0, capacity: float = 250.0,
                  period: float = 1.0, cooldown: float = 2.0, n_max: int = 3, bucket: int = 10,
                  spawn_delay: float = 2.0, drain_delay: float = 1.0) -> Dict[str, Any]:
    """The simulator on the same trace, platform and timing (see the module doc)."""
    from foglab.sim import policies as sim

    matrix = {a: {b: 1.0 for b in NODES[:n_max] if b != a} for a in NODES[:n_max]}
    profile = tuple(seasonal_profile(seed, len(trace) / 60.0, max(trace))) if policy in ("seasonal", "planned") else None
    cfg = sim.SimConfig(period=period, spawn_delay=spawn_delay, drain_delay=drain_delay, initial=1,
                        cooldown=cooldown, platform=sim.Platform(alpha=capacity, beta=1.0, gamma=0.0), profile=profile)
    # the simulator's demand uses 60-sample buckets; ours uses `bucket` on both sides: recompute
    r = sim.simulate(policy, list(trace), matrix, seed, cfg)
    from agent.metrics_spec import elasticity_metrics

    times = [float(t) for t in range(len(trace))]
    demand = _demand_series(trace, capacity, n_max, bucket)
    m = elasticity_metrics(times, demand, r.supply, end=float(len(trace)))
    return {"policy": policy, "mode": "simulated", **{k: round(float(x), 4) for k, x in m.as_dict().items()},
            "instance_ops": r.operations, "records_lost": 0}


def compare(policies: Sequence[str], workdir: Path, minutes: float = 4.0, peak: float = 600.0, seed: int = 0,
            capacity: float = 250.0, period: float = 1.0, cooldown: float = 2.0, consolidation: str = "off",
            site: SiteParams = SiteParams(), progress: Any = None) -> List[Dict[str, Any]]:
    """Per policy: the simulated row, then the live run without node consolidation ("off"),
    with it ("on"), or both, on the same trace."""
    if consolidation not in ("off", "on", "both"):
        raise ValueError(f"consolidation must be off, on or both, not {consolidation!r}")
    trace = live_trace(seed, minutes, peak)
    rows: List[Dict[str, Any]] = []

    def add(row: Dict[str, Any]) -> None:
        rows.append(row)
        if progress:
            progress(row)

    for p in policies:
        add(run_simulated(p, trace, seed, capacity, period, cooldown))
        if consolidation in ("off", "both"):
            add(run_live(p, trace, workdir / p, seed, capacity, period, cooldown))
        if consolidation in ("on", "both"):
            add(run_live(p, trace, workdir / f"{p}-consolidated", seed, capacity, period, cooldown, consolidate=site))
    return rows


def gap(live: float, sim: float) -> Optional[float]:
    if sim == 0:
        return None if live == 0 else math.inf
    return (live - sim) / abs(sim)


def format_rows(rows: Sequence[Dict[str, Any]]) -> str:
    head = "| policy | mode | #reconf. | cost (instance-min) | accuracy_U | accuracy_O | timeshare_U % | instance ops | records lost |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        mode = r["mode"] + (", consolidated" if r.get("consolidation") else "")
        lines.append(f"| {r['policy']} | {mode} | {r['reconfigurations']:.0f} | {r['cost']:.2f} | "
                     f"{r['accuracy_u']:.3f} | {r['accuracy_o']:.3f} | {100 * r['timeshare_u']:.1f} | "
                     f"{r['instance_ops']} | {r['records_lost']} |")
    return "\n".join(lines)


def format_consolidation(rows: Sequence[Dict[str, Any]]) -> str:
    """The live runs with and without node consolidation: what it saves and what it costs."""
    head = ("| policy | consolidation | node-min | node-min floor | released / acquired | #reconf. | "
            "instance-min | accuracy_U | timeshare_U % | deferred % | latency s | records lost |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        if r.get("mode") != "live":
            continue
        lat = "-" if r.get("latency_s") is None else f"{r['latency_s']:.2f}"
        lines.append(f"| {r['policy']} | {'on' if r['consolidation'] else 'off'} | {r['node_minutes']:.2f} | "
                     f"{r['node_minutes_packed']:.2f} | {r['nodes_released']} / {r['nodes_acquired']} | "
                     f"{r['reconfigurations']:.0f} | {r['cost']:.2f} | {r['accuracy_u']:.3f} | "
                     f"{100 * r['timeshare_u']:.1f} | {100 * r['deferred_share']:.2f} | {lat} | {r['records_lost']} |")
    return "\n".join(lines)


def plot_consolidation(rows: Sequence[Dict[str, Any]], path: Path) -> None:
    """Top: per policy, in_zone's instances and the powered nodes over the run, with and without
    consolidation, and the demand. Bottom: node-minutes and instance-minutes per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    live = [r for r in rows if r.get("mode") == "live" and r.get("series")]
    policies = list(dict.fromkeys(r["policy"] for r in live))
    fig, axes = plt.subplots(len(policies) + 1, 1, figsize=(9, 2.4 * len(policies) + 3), squeeze=False)
    for ax, p in zip(axes[:, 0], policies):
        for r in (x for x in live if x["policy"] == p):
            s = r["series"]
            tag = "consolidated" if r["consolidation"] else "3 nodes"
            ax.step(s["t"], s["supply"], where="post", label=f"in_zone instances ({tag})",
                    linestyle="-" if r["consolidation"] else ":")
            if r["consolidation"]:
                ax.step(s["t"], s["powered"], where="post", label="powered nodes (consolidated)", color="k")
        first = next(x for x in live if x["policy"] == p)
        ax.step(first["series"]["t"], first["series"]["demand"], where="post", label="demand", color="grey", alpha=0.5)
        ax.set_ylabel(p)
        ax.set_ylim(0, len(NODES) + 0.5)
        ax.legend(fontsize=7, loc="upper right")
    ax = axes[-1, 0]
    width = 0.2
    for k, p in enumerate(policies):
        for j, cons in enumerate((False, True)):
            r = next((x for x in live if x["policy"] == p and x["consolidation"] == cons), None)
            if r is None:
                continue
            ax.bar(k + (j - 0.5) * 2 * width, r["node_minutes"], width, color="k" if cons else "0.6",
                   label=("node-min, " + ("consolidated" if cons else "3 nodes")) if k == 0 else None)
            ax.bar(k + (j - 0.5) * 2 * width + width, r["cost"], width, color="C1" if cons else "C0",
                   label=("instance-min, " + ("consolidated" if cons else "3 nodes")) if k == 0 else None)
    ax.set_xticks(range(len(policies)))
    ax.set_xticklabels(policies)
    ax.set_ylabel("minutes")
    ax.legend(fontsize=7)
    axes[0, 0].set_title("bench policies: node consolidation on a 3-agent fleet (in_zone)")
    axes[-2, 0].set_xlabel("s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
