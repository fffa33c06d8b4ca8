"""fogctl command handlers: read or publish through one `Connection`, print a view, return a status.

Every handler is `(args, conn_factory) -> int`; exceptions are mapped to exit statuses in one
place (`agent.cli.fogctl.main`), so a handler raises `FogctlError` / `RequestError` with a
one-line message and never prints a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, TextIO, Tuple

from agent import events as ev_mod
from agent import exitcodes, topics
from agent.fogctl import views
from agent.fogctl.client import Connection, FogctlError
from agent.fogctl.config import FogctlConfig
from agent.node.site_manager import claim_problem, follows_of, lease_bound, lease_of, leader, valid_claims
from agent.control.fleet import Fleet, Phase
from agent.control.rpc_schema import (DrainRequest, PinRequest, Reply, RequestError, ScaleRequest, check_drain,
                                     check_scale, parse_duration)

__all__ = ["COMMANDS", "fleet_snapshot", "Context"]


class Context:
    """What a handler needs: settings, a connection factory, the output streams, a clock."""

    def __init__(self, cfg: FogctlConfig, connect: Callable[[FogctlConfig], Connection] = Connection,
                 out: Optional[TextIO] = None, err: Optional[TextIO] = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg, self.connect, self.clock = cfg, connect, clock
        self.out = out or sys.stdout
        self.err = err or sys.stderr

    def emit(self, args: argparse.Namespace, doc: Any, text: str) -> None:
        if args.json:
            self.out.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        else:
            self.out.write(text + "\n")
        self.out.flush()


def fleet_filters(cluster: str, latency: bool = False) -> List[str]:
    """The retained records of a fleet snapshot. The latency rows only for the view that shows
    them: they are O(N) bytes each, so a snapshot of N nodes with them downloads O(N^2)."""
    return [topics.all_agents_state(cluster), topics.all_agents_status(cluster),
            *([topics.all_latency(cluster)] if latency else []), topics.all_pipelines(cluster)]


def fleet_snapshot(conn: Connection, cluster: str, latency: bool = False) -> Fleet:
    msgs = conn.snapshot(fleet_filters(cluster, latency))
    return Fleet.from_messages(cluster, {t: m.payload for t, m in msgs.items()})


def _with_fleet(ctx: Context, latency: bool = False) -> Fleet:
    with ctx.connect(ctx.cfg) as conn:
        return fleet_snapshot(conn, ctx.cfg.cluster, latency)


# ---- read-only commands -------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace, ctx: Context) -> int:
    """views.status; at the central broker grouped by site (agent.fogctl.fleet_sites)."""
    from agent.fogctl import fleet_sites

    with ctx.connect(ctx.cfg) as conn:
        fleet = fleet_snapshot(conn, ctx.cfg.cluster)
        member = fleet_sites.read_membership(conn, ctx.cfg.cluster)
    doc, text = fleet_sites.status(fleet, member, fleet_sites.known_sites(ctx.cfg), ctx.clock(),
                                    site_record)
    ctx.emit(args, doc, text)
    return 0


def cmd_topology(args: argparse.Namespace, ctx: Context) -> int:
    doc, text = views.topology(_with_fleet(ctx), args.pipeline)
    ctx.emit(args, doc, views.topology_tree(doc) if args.tree and doc["pipelines"] else text)
    return 0


def cmd_latency(args: argparse.Namespace, ctx: Context) -> int:
    doc, text = views.latency(_with_fleet(ctx, latency=True))
    ctx.emit(args, doc, text)
    return 0


def cmd_locks(args: argparse.Namespace, ctx: Context) -> int:
    doc, text = views.locks(_with_fleet(ctx))
    ctx.emit(args, doc, text)
    return 0


def cmd_pipelines(args: argparse.Namespace, ctx: Context) -> int:
    doc, text = views.pipelines(_with_fleet(ctx))
    ctx.emit(args, doc, text)
    return 0


def parse_filters(items: Sequence[str]) -> Dict[str, List[str]]:
    """`--filter type=scale_out,scale_in --filter operator=in_zone` -> {key: [allowed values]}."""
    allowed = ("type", "node", "instance", "operator", "pipeline")
    out: Dict[str, List[str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in allowed or not value:
            raise RequestError(f"--filter {item!r}: expected KEY=VALUE[,VALUE] with KEY one of {', '.join(allowed)}")
        out.setdefault(key, []).extend(v for v in value.split(",") if v)
    return out


def matches(event: ev_mod.Event, filters: Dict[str, List[str]]) -> bool:
    for key, values in filters.items():
        got = event.type.value if key == "type" else getattr(event, key)
        if got not in values:
            return False
    return True


def cmd_watch(args: argparse.Namespace, ctx: Context) -> int:
    """Events from `fog/<cluster>/events`, plus decisions that appear in the agents' states.

    A state-derived decision is shown unless the instance's own events are its source
    (`_from_state`), so nothing is shown twice once workers publish events. Decisions already in
    the retained states when the watch starts are history, not shown (`fogctl why` shows them).

    Only changes by default (`events.changes_something`): every instance publishes a "nothing to
    do" decision every few seconds, which would bury the scaling rounds, spawns, terminations,
    drains, locks and refusals a person watches for; `--all`, or a `--filter type=decision`,
    shows them too.
    """
    from agent.control.fleet import state_decisions

    filters = parse_filters(args.filter or [])
    everything = bool(getattr(args, "all", False)) or "decision" in filters.get("type", ())
    if args.instance:
        filters.setdefault("instance", []).append(args.instance)
    seen = 0
    known: set = set()  # (instance, ts) of state-derived decisions already shown or history
    with_events: set = set()  # (instance, type) of the decision events instances publish themselves
    publishers: set = set()  # instances that publish decision events
    cluster = ctx.cfg.cluster
    with ctx.connect(ctx.cfg) as conn:
        live = conn.stream([topics.events(cluster), topics.all_agents_state(cluster)], duration=args.duration,
                           include_retained=True)
        ctx.err.write(f"watching {topics.events(cluster)} (Ctrl-C to stop)\n")
        ctx.err.flush()
        for m in live:
            batch: List[ev_mod.Event] = []
            parsed = topics.parse(cluster, m.topic)
            if parsed is not None and parsed.kind == "state":
                for e in state_decisions(cluster, m.topic, m.payload):
                    key = (e.instance, e.ts)
                    if key in known:
                        continue
                    known.add(key)
                    if not m.retain and _from_state(e, with_events, publishers):
                        batch.append(e)
            elif not m.retain:
                try:
                    event = ev_mod.parse(m.payload)
                except ev_mod.EventError as exc:
                    ctx.err.write(f"fogctl: skipped a malformed event on {m.topic}: {str(exc)[:200]}\n")
                    continue
                if event.reason is not None and event.instance:
                    with_events.add((event.instance, event.type))
                    publishers.add(event.instance)
                batch.append(event)
            for event in batch:
                if not matches(event, filters) or not (everything or ev_mod.changes_something(event)):
                    continue
                ctx.out.write((event.to_json() if args.json else views.event_line(event)) + "\n")
                ctx.out.flush()
                seen += 1
                if args.count and seen >= args.count:
                    return 0
    return 0


def _from_state(event: ev_mod.Event, with_events: set, publishers: set) -> bool:
    """Whether `watch` shows a decision read from an agent's state. Not when the instance
    published an event of that type itself (the worker's event, with p and the draw, is the
    source), nor a policy scale-out of an instance that publishes events (its event comes).
    Shown: everything of an instance that publishes none, a forced decision (`fogctl scale`, a
    drain: the worker publishes no event for it) and a scale-in (a keyed instance leaving after
    its hand-over publishes none either). Every instance publishes a "nothing to do" decision
    every few seconds, so taking any event as the sign that its events are the source hid those."""
    if (event.instance, event.type) in with_events:
        return False
    if event.instance not in publishers:
        return True
    return event.detail.get("cause") == "forced" or event.type is ev_mod.EventType.SCALE_IN


def pin_of(states: Dict[str, Any], instance: str) -> Optional[Dict[str, Any]]:
    """The pin (fogctl scale) that holds `instance`, from the agents' retained states, or None:
    {"operator", "pipeline", "until" (unix seconds or None: until released), "node"}."""
    from agent import wire

    for topic, m in sorted(states.items()):
        try:
            doc = wire.loads(m.payload, what="state", expect=dict)
        except ValueError:
            continue
        items = doc.get("instances") if isinstance(doc.get("instances"), list) else []
        item = next((i for i in items if isinstance(i, dict) and i.get("id") == instance), None)
        if item is None or item.get("pinned") is not True:
            continue
        pins = doc.get("pins") if isinstance(doc.get("pins"), list) else []
        pin = next((p for p in pins if isinstance(p, dict) and p.get("operator") == item.get("operator")
                    and p.get("pipeline") in (None, item.get("pipeline"))), {})
        until = pin.get("until")
        return {"operator": item.get("operator"), "pipeline": item.get("pipeline"), "node": doc.get("node"),
                "until": until if isinstance(until, (int, float)) and not isinstance(until, bool) else None}
    return None


def cmd_why(args: argparse.Namespace, ctx: Context) -> int:
    with ctx.connect(ctx.cfg) as conn:
        topic = topics.decisions(ctx.cfg.cluster, args.instance)
        snap = conn.snapshot([topic])
        history: List[ev_mod.Event] = []
        if topic in snap:
            try:
                history = ev_mod.parse_history(snap[topic].payload)
            except ev_mod.EventError as exc:
                raise FogctlError(f"the decision history on {topic} is malformed: {exc}") from None
        states = conn.snapshot([topics.all_agents_state(ctx.cfg.cluster)])
        pinned = pin_of(states, args.instance)
        rehomed = rehomed_of(conn.snapshot([topics.all_agents_rehomed(ctx.cfg.cluster)]), args.instance)
        if not history:  # no retained history: the decisions the agents' states carry
            from agent.control.fleet import state_decisions

            history = sorted((e for t, m in states.items() for e in state_decisions(ctx.cfg.cluster, t, m.payload)
                              if e.instance == args.instance), key=lambda e: e.ts)
        if args.wait:
            for m in conn.stream([topics.events(ctx.cfg.cluster)], duration=args.wait):
                try:
                    e = ev_mod.parse(m.payload)
                except ev_mod.EventError:
                    continue
                if e.instance == args.instance and e.reason is not None:
                    history.append(e)
    history = [e for e in history if e.instance in (None, args.instance)][-args.last:]
    doc = {"instance": args.instance, "decisions": [e.to_dict() for e in history], "pinned": pinned,
           "rehomed": rehomed}
    text = "\n".join(views.event_line(e) for e in history) if history else \
        f"no decisions recorded for {args.instance} on {topic} (use --wait SECONDS to listen)"
    if pinned is not None:
        until = ("until " + time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(pinned["until"]))
                 if pinned["until"] is not None else "until released")
        text = (f"pinned: {pinned['operator']}'s instance count was set by fogctl scale, {until} "
                f"(fogctl scale --release {pinned['operator']}): the policy makes no automatic decision\n" + text)
    if rehomed is not None:
        at = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(rehomed["at"]))
        text = (f"re-homed by {rehomed['by']} at {at}: its node stayed offline past [agent] dead_after; it runs on with "
                f"its identity (a keyed instance on its standby, from the copy of its state)\n" + text)
    ctx.emit(args, doc, text)
    return 0


def rehomed_of(snap: Dict[str, Any], instance: str) -> Optional[Dict[str, Any]]:
    """The latest re-home of `instance` in the agents' retained re-homed records ({"by", "at"}),
    or None. A malformed record is skipped: it is bus input."""
    from agent import wire

    best: Optional[Dict[str, Any]] = None
    for topic, msg in snap.items():
        parsed = topics.parse_any(topic)
        try:
            at = wire.loads(msg.payload or b"{}", what="re-homed record", expect=dict).get(instance)
        except ValueError:
            continue
        if parsed is not None and isinstance(at, (int, float)) and not isinstance(at, bool) \
                and (best is None or at > best["at"]):
            best = {"by": parsed.node, "at": float(at)}
    return best


def site_view(record: Optional[Dict[str, Any]], now: float) -> Tuple[Dict[str, Any], str]:
    """The site manager's record as (json doc, text): leader, lease, target, spare, pending
    action, released nodes, and the reasons of its last actions. `record["void"]`, when set, says
    why nobody leads although the record's lease has not run out (its holder is offline, or
    several claims stand)."""
    if record is None:
        return {"leader": None}, "no site manager (no claim: [site_manager] enabled on no agent)"
    st = record.get("state") if isinstance(record.get("state"), dict) else {}
    left = float(record["until"]) - now
    void = record.get("void")
    doc = {"leader": None if void else record["node"], "lease_left_s": round(left, 3), "expired": left < 0 or bool(void),
           "target": st.get("target"), "spare": st.get("spare"), "min_nodes": st.get("min_nodes"),
           "max_nodes": st.get("max_nodes"), "pending": st.get("pending"),
           "released": st.get("released") or [], "actions": st.get("actions") or []}
    if void:
        doc["last_leader"], doc["void"] = record["node"], void
    pend = doc["pending"]
    head = (f"leader    -  (last {record['node']}: {void}: none leads)" if void else
            f"leader    {record['node']}" + (" (lease expired: none leads)" if left < 0 else f" (lease {left:.1f} s)"))
    lines = [head,
             f"target    {doc['target']}   spare {doc['spare']}   nodes {doc['min_nodes']}-{doc['max_nodes']}",
             "pending   " + (f"{pend.get('action')} {pend.get('node')}" if isinstance(pend, dict) else "-"),
             "released  " + (", ".join(map(str, doc["released"])) or "-")]
    for a in doc["actions"]:
        if isinstance(a, dict):
            ts = a.get("ts")
            when = time.strftime("%H:%M:%SZ", time.gmtime(ts)) if isinstance(ts, (int, float)) else "-"
            lines.append(f"{when}  {str(a.get('action')):8s} {str(a.get('node')):12s} {a.get('reason')}")
    return doc, "\n".join(lines)


# fogctl does not read the agents' [site_manager] sections: it bounds `until` as agents with the
# default lease and period do (a claim further ahead is shown as no claim).
SITE_LEASE_AHEAD = lease_bound(15.0, 5.0)


def site_record(claims_and_statuses: Mapping[str, Any], cluster: str, now: float) -> Optional[Dict[str, Any]]:
    """The record `fogctl site` shows, derived from the nodes' claims as an agent that just
    started derives the leader (`site_manager.leader`, with the nodes' statements of whom they
    follow): the leader's own record; else, with the reason none leads, the latest of the claims
    (several running claims, or a holder gone offline); None without any claim. Malformed and
    refused records are skipped (bus input)."""
    claims: Dict[str, Any] = {}
    follows: Dict[str, Optional[str]] = {}
    online: Dict[str, bool] = {}
    for topic, msg in claims_and_statuses.items():
        parsed = topics.parse(cluster, topic)
        if parsed is None or parsed.sender is not None or parsed.node is None:
            continue
        if parsed.kind == "status":
            online[parsed.node] = msg.payload == b"online"
        elif parsed.kind == "site_manager":
            lease = lease_of(msg.payload or b"")
            stated = follows_of(msg.payload or b"")
            if lease is not None and claim_problem(parsed.node, lease, now, SITE_LEASE_AHEAD) is None:
                claims[parsed.node] = lease
            elif stated is not None and stated.node == parsed.node:
                follows[parsed.node] = stated.follows
    if not claims:
        return None
    lead = leader(claims, online, now, SITE_LEASE_AHEAD, follows=follows)
    if lead is not None:
        return {"node": lead.node, "until": lead.until, "state": lead.state}
    last = max(claims.values(), key=lambda c: (c.until, c.node))
    valid = sorted(valid_claims(claims, online, now, SITE_LEASE_AHEAD))
    void = (f"claims of {', '.join(valid[:4])}" if len(valid) > 1 else
            "its holder is offline" if now < last.until else None)
    return {"node": last.node, "until": last.until, "state": last.state, **({"void": void} if void else {})}


def cmd_site(args: argparse.Namespace, ctx: Context) -> int:
    from agent.fogctl import fleet_sites

    c = ctx.cfg.cluster
    with ctx.connect(ctx.cfg) as conn:
        snap = conn.snapshot([topics.all_site_managers(c), topics.all_agents_status(c)])
        member = fleet_sites.read_membership(conn, c)  # at the central broker: each bridged site's too
    now = ctx.clock()
    doc, text = site_view(site_record(snap, c, now), now)
    doc, text = fleet_sites.site(doc, text, member, snap, c, now, site_record, site_view)
    ctx.emit(args, doc, text)
    return 0


# ---- steering -----------------------------------------------------------------------------------


def parse_delta(text: str) -> int:
    t = text.strip()
    if not t or t[0] not in "+-" or not t[1:].isdigit() or int(t[1:]) == 0:
        raise argparse.ArgumentTypeError(f"expected +N or -N with N > 0, got {text!r}")
    return int(t)


def _reply(ctx: Context, conn: Connection, node: str, body: Dict[str, Any]) -> Reply:
    return Reply.from_dict(conn.rpc(node, body))


def _wait_for(ctx: Context, conn: Connection, done: Callable[[Fleet], bool], timeout: float) -> Fleet:
    deadline = time.monotonic() + timeout
    while True:
        fleet = fleet_snapshot(conn, ctx.cfg.cluster)
        if done(fleet) or time.monotonic() >= deadline:
            return fleet
        time.sleep(0.2)


def _pin_all(conn: Connection, fleet: Fleet, pin: PinRequest) -> List[str]:
    """Send `pin` to every online agent (a copy may start on any of them); the nodes it reached."""
    nodes = [n.node for n in fleet.nodes if n.status == "online"]
    for node in nodes:
        reply = Reply.from_dict(conn.rpc(node, pin.to_dict()))
        if not reply.ok:
            raise FogctlError(f"{node} refused to {'release' if pin.release else 'pin'} {pin.operator}: {reply.error}")
    return nodes


def _operator_pipeline(fleet: Fleet, operator: str, pipeline: Optional[str]) -> Optional[str]:
    found = sorted({i.pipeline for i in fleet.instances if i.operator == operator and i.pipeline})
    return pipeline or (found[0] if len(found) == 1 else None)


def cmd_scale(args: argparse.Namespace, ctx: Context) -> int:
    """Manual scaling, which pins the operator's count (docs/fogctl.md): the agents make no
    automatic decision for its instances until `--release` or the `--for` duration has passed.
    The pin goes out before the scale requests, so the policy cannot undo the step meanwhile."""
    if args.release:
        if args.delta is not None or args.for_:
            raise RequestError("scale --release OPERATOR takes no +N/-N and no --for")
        with ctx.connect(ctx.cfg) as conn:
            fleet = fleet_snapshot(conn, ctx.cfg.cluster)
            pipeline = _operator_pipeline(fleet, args.operator, args.pipeline)
            nodes = _pin_all(conn, fleet, PinRequest(args.operator, pipeline, release=True))
        ctx.emit(args, {"ok": True, "operator": args.operator, "pipeline": pipeline, "released": nodes},
                 f"released {args.operator}: the policy decides again ({', '.join(nodes) or 'no online node'})")
        return 0
    if args.delta is None:
        raise RequestError("scale: expected OPERATOR +N or -N (or scale --release OPERATOR)")
    seconds = parse_duration(args.for_) if args.for_ else None
    req = ScaleRequest(operator=args.operator, delta=args.delta, pipeline=args.pipeline)
    with ctx.connect(ctx.cfg) as conn:
        fleet = fleet_snapshot(conn, ctx.cfg.cluster)
        plan = check_scale(fleet, req)
        want = _count_active(fleet, req.operator) + req.delta
        pin = PinRequest(req.operator, _operator_pipeline(fleet, req.operator, req.pipeline), seconds)
        pinned_on = _pin_all(conn, fleet, pin)
        results = []
        for node, sub in plan:
            reply = _reply(ctx, conn, node, sub.to_dict())
            if not reply.ok:
                raise FogctlError(f"{node} refused scale {req.operator} {sub.delta:+d}: {reply.error}")
            results.append({"node": node, "request": sub.to_dict(), "result": reply.result})
        doc: Dict[str, Any] = {"ok": True, "operator": req.operator, "delta": req.delta, "requests": results,
                               "pinned": {"pipeline": pin.pipeline, "seconds": seconds, "nodes": pinned_on}}
        text = f"scale {req.operator} {req.delta:+d}: accepted by {', '.join(n for n, _ in plan)}"
        if req.delta < 0:
            text += f" ({', '.join(i for _, s in plan for i in s.instances)} leaving)"
        text += (f"; pinned for {seconds:g}s" if seconds is not None else
                 f"; pinned until fogctl scale --release {req.operator}")
        if args.wait:
            fleet = _wait_for(ctx, conn, lambda f: _count_active(f, req.operator) == want
                              and not _count_phase(f, req.operator, Phase.TERMINATING), args.wait)
            got = _count_active(fleet, req.operator)
            doc.update(instances=got, expected=want)
            if got != want:
                ctx.emit(args, dict(doc, ok=False), text + f"; {got} active instances after {args.wait:g}s, expected {want}")
                return 1
            text += f"; {req.operator} now has {got} active instances"
    ctx.emit(args, doc, text)
    return 0


def _count_phase(fleet: Fleet, operator: str, phase: Phase) -> int:
    return sum(1 for i in fleet.instances if i.operator == operator and i.phase is phase)


def _count_active(fleet: Fleet, operator: str) -> int:
    return sum(1 for i in fleet.instances if i.operator == operator and i.phase is Phase.ACTIVE)


def cmd_drain(args: argparse.Namespace, ctx: Context) -> int:
    req = DrainRequest(node=args.node, undo=args.undo)
    with ctx.connect(ctx.cfg) as conn:
        fleet = fleet_snapshot(conn, ctx.cfg.cluster)
        leaving = check_drain(fleet, req)
        reply = _reply(ctx, conn, req.node, req.to_dict())
        if not reply.ok:
            raise FogctlError(f"{req.node} refused {'undrain' if req.undo else 'drain'}: {reply.error}")
        doc: Dict[str, Any] = {"ok": True, "node": req.node, "leaving": leaving, "result": reply.result}
        text = f"{'undrain' if req.undo else 'drain'} {req.node}: accepted" + \
            (f"; leaving: {', '.join(leaving)}" if leaving else "")
        if args.wait and not req.undo:
            fleet = _wait_for(ctx, conn, lambda f: not (f.node(req.node) and f.node(req.node).instances), args.wait)  # type: ignore[union-attr]
            left = [i.id for i in (fleet.node(req.node).instances if fleet.node(req.node) else ())]  # type: ignore[union-attr]
            doc["remaining"] = left
            if left:
                ctx.emit(args, dict(doc, ok=False), text + f"; still hosting {', '.join(left)} after {args.wait:g}s")
                return 1
            text += f"; {req.node} is empty"
    ctx.emit(args, doc, text)
    return 0


def cmd_deploy(args: argparse.Namespace, ctx: Context) -> int:
    """Same as `fog-agent deploy`: publish the TOML retained and start the keepers by placement."""
    from agent.fogctl.deploy import deploy_pipeline
    from agent.pipeline_check import check_text

    path = Path(args.file)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise FogctlError(f"cannot read {path}: {exc.strerror}") from None
    # check-config's checks, before any connection: a bad file starts nothing (agent.pipeline_check)
    _, report = check_text(text, args.file, args.agent_config)
    for problem in report.errors:  # warnings (scaling notes, functions left to the nodes): check-config's
        print(f"fogctl: error: {problem.message}", file=ctx.err)
    if not report.ok:
        if args.json:
            ctx.emit(args, {"ok": False, "errors": [p.to_json() for p in report.errors]}, "")
        return exitcodes.ERROR
    signer = None
    if ctx.cfg.sign_key:  # before any connection: a bad key file starts nothing
        from agent.signing import load_signer

        try:
            signer = load_signer(ctx.cfg.sign_key)
        except ValueError as exc:
            raise FogctlError(f"sign_key {ctx.cfg.sign_key}: {exc}") from None
    with ctx.connect(ctx.cfg) as conn:
        cfg, placed = deploy_pipeline(conn, text, path.name, timeout=args.keeper_timeout, signer=signer,
                                      node_slots=ctx.cfg.node_slots)
    name = cfg.pipeline.name
    doc = {"ok": True, "pipeline": name, "topic": topics.pipeline(ctx.cfg.cluster, name), "keepers": placed}
    text_out = f"deployed {name} ({' -> '.join(op.name for op in cfg.operators)}): " + \
        ", ".join(f"{k['instance']}@{k['node']}" for k in placed)
    ctx.emit(args, doc, text_out)
    return 0


def cmd_undeploy(args: argparse.Namespace, ctx: Context) -> int:
    """Stop every instance of the pipeline (sources first, so successors drain) and make every
    agent forget it (docs/fogctl.md, "Deploy and undeploy"): each stop carries `forget` (the
    agent deletes the stored spec before it answers), then the record becomes a tombstone,
    which agents that were away read when they come back. `--force`: also without a record
    (the broker lost it), stopping what the agents' states list under the pipeline's name."""
    from agent.control.records import parse_record, tombstone

    name = args.pipeline
    if name.endswith(".toml"):
        from agent.config import load_pipeline

        name = load_pipeline(name).pipeline.name
    topic = topics.pipeline(ctx.cfg.cluster, name)
    stopped: List[Dict[str, str]] = []
    with ctx.connect(ctx.cfg) as conn:
        fleet = fleet_snapshot(conn, ctx.cfg.cluster)
        order = {op: k for k, op in enumerate(fleet.operator_order(name))}
        insts = sorted((i for i in fleet.instances if i.pipeline == name),
                       key=lambda i: (order.get(i.operator, len(order)), not i.keeper, i.id))
        if name not in fleet.pipelines and not args.force:
            if insts:
                raise FogctlError(f"pipeline {name!r} has no description on {topic}, but the agents run "
                                  f"{len(insts)} instance(s) of it ({', '.join(f'{i.id}@{i.node}' for i in insts[:5])}"
                                  f"{', ...' if len(insts) > 5 else ''}): stop them with fogctl undeploy --force {name}")
            raise FogctlError(f"pipeline {name!r} is not deployed on {topic}")
        offline = sorted({i.node for i in insts if (fleet.node(i.node) or i).status != "online"})  # type: ignore[union-attr]
        if offline and not args.force:
            raise FogctlError(f"refused: {name} has instances on offline node(s) {', '.join(offline)} "
                              f"(fogctl undeploy --force {name} stops the others; the tombstone reaches them later)")
        for i in insts:
            if i.node in offline:
                continue
            reply = _reply(ctx, conn, i.node, {"op": "stop", "instance": i.id, "forget": True})
            if not reply.ok:
                raise FogctlError(f"{i.node} refused to stop {i.id}: {reply.error}")
            stopped.append({"instance": i.id, "node": i.node})
        record = parse_record(fleet.pipelines.get(name, "").encode("utf-8"))
        conn.publish(topic, tombstone(name, record.generation if record else None), qos=1, retain=True)
    left = [{"instance": i.id, "node": i.node} for i in insts if i.node in offline]
    text = f"undeployed {name}: stopped {len(stopped)} instance(s), {topic} holds a tombstone"
    if left:
        text += f"; left on offline node(s): {', '.join(d['instance'] + '@' + d['node'] for d in left)}"
    ctx.emit(args, {"ok": True, "pipeline": name, "topic": topic, "stopped": stopped, "offline": left,
                    "forced": bool(args.force)}, text)
    return 0


def cmd_keygen(args: argparse.Namespace, ctx: Context) -> int:
    """A new admin key pair: PRIVATE (mode 0600) for `--sign-key`, PRIVATE.pub for the nodes'
    [security] admin_keys (the Ansible role's fog_agent_admin_public_key_src). No broker."""
    from agent.signing import generate_keypair

    private = Path(args.private)
    public = private.with_name(private.name + ".pub")
    try:
        kid = generate_keypair(private, public)
    except FileExistsError:
        raise FogctlError(f"{private} exists: not overwritten (an admin key is not replaced by accident)") from None
    except OSError as exc:
        raise FogctlError(f"cannot write {private}: {exc.strerror}") from None
    ctx.emit(args, {"ok": True, "private": str(private), "public": str(public), "key": kid},
             f"admin key {kid}: private {private}, public {public}")
    return 0


def cmd_schema(args: argparse.Namespace, ctx: Context) -> int:
    """The JSON Schema of a command's `--json` output (agent.fogctl.schemas), or all of them by
    name. No broker; always JSON, with or without --json."""
    from agent.fogctl.schemas import SCHEMAS, schema

    if args.name is None:
        doc: Any = SCHEMAS
    else:
        try:
            doc = schema(args.name)
        except KeyError as exc:
            raise RequestError(exc.args[0]) from None
    ctx.out.write(json.dumps(doc, indent=2) + "\n")
    ctx.out.flush()
    return 0


COMMANDS = {
    "status": cmd_status, "topology": cmd_topology, "latency": cmd_latency, "locks": cmd_locks,
    "pipelines": cmd_pipelines, "watch": cmd_watch, "why": cmd_why, "scale": cmd_scale,
    "drain": cmd_drain, "deploy": cmd_deploy, "undeploy": cmd_undeploy, "site": cmd_site, "keygen": cmd_keygen,
    "schema": cmd_schema,
}
