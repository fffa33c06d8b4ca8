"""`fog-agent chaos --testbed`: node loss on real separate systems (docs/operations.md, "Chaos on
the testbed").

The demo's `kill-node` SIGKILLs processes of one host and its `partition` cuts a userspace proxy;
here the same faults hit the testbed's containers while the taxi pipeline runs across them
(foglab.tools.testbed_pipeline, Ansible-installed agents under systemd):

- `kill-node`: a power cut (foglab.tools.testbed.kill_node: SIGKILL to the container, its disk
  stays), `down` seconds away (at least the agents' `dead_after` plus a margin, so that the
  survivors re-home its instances), then the container boots again and its agent starts under
  systemd (enabled unit), re-adopting or fencing what it had;
- `partition`: the host side of the node's veth goes down for a drawn number of seconds (cut from
  the broker and every other node while everything in it keeps running), then up;
- `lose-node` (drawn only when asked for): a power cut that also loses the disk (an SD card that
  died: `testbed kill --wipe`); once the survivors re-homed its instances, a replacement boots
  on a fresh disk under the same name and the role installs it (`site.yml --limit NODE`), as an
  operator would bring in a new Pi.

Never the broker's node (the first): losing the site broker is a different fault. Each fault
records when it was injected, what the node hosted, when its instances were seen on other nodes
(`fogctl topology`) and when the node was back (agent active and online); the verdict is the
pipeline's record-by-record accounting.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set

from foglab.tools import testbed
from foglab.tools.testbed_pipeline import _fogctl, run_pipeline
from foglab.tools.testbed_scenarios import _ansible

FAULTS = ("kill-node", "partition")  # the default draw
ALL_FAULTS = FAULTS + ("lose-node",)


def instance_nodes(topology: Dict[str, Any], pipeline: str) -> Dict[str, Set[str]]:
    """{instance id: nodes listing it} of one pipeline in a `fogctl topology --json` document (an
    offline node's retained state still lists what it ran, beside the node that re-homed it)."""
    out: Dict[str, Set[str]] = {}
    for p in topology.get("pipelines", []):
        if p.get("pipeline") == pipeline:
            for op in p.get("operators", []):
                for i in op.get("instances", []):
                    out.setdefault(str(i["id"]), set()).add(str(i["node"]))
    return out


def _hosted(broker: str, password: str, pipeline: str, node: str) -> List[str]:
    where = instance_nodes(_fogctl(broker, password, "topology"), pipeline)
    return sorted(i for i, nodes in where.items() if node in nodes)


def _online(broker: str, password: str, node: str) -> bool:
    doc = _fogctl(broker, password, "status")
    return any(isinstance(row, dict) and row.get("node") == node and row.get("status") == "online"
               for row in doc.get("nodes", []))


class TestbedNemesis:
    """Injects the drawn faults one after the other; `schedule()` is run_pipeline's `during`."""

    def __init__(self, faults: Sequence[str], count: int, seed: int, down: float, cut: Sequence[float],
                 pause: Sequence[float], run: Optional[Path], progress: Any) -> None:
        state = testbed.load_state(run=run)
        if state is None or not state.admin_password:
            raise testbed.TestbedError("no testbed with an inventory is up: run `fog-agent testbed up` and Ansible first")
        if len(state.nodes) < 2:
            raise testbed.TestbedError("chaos on the testbed needs 2 nodes or more (the first one is the broker)")
        self.run, self.progress = run, progress
        self.broker = f"{state.nodes[0]['address']}:1883"
        self.password = state.admin_password
        self.targets = [str(n["name"]) for n in state.nodes[1:]]
        self.rng = random.Random(seed)
        self.faults, self.count, self.down, self.cut, self.pause = list(faults), count, down, cut, pause
        self.records: List[Dict[str, Any]] = []
        self.started = 0.0
        self.inventory = str(state.inventory or "")
        self.extra_vars: List[str] = []  # what the fleet was installed with, for a replacement node

    def _wait(self, what: str, pred: Any, timeout: float) -> Optional[float]:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            try:
                if pred():
                    return round(time.monotonic() - t0, 1)
            except testbed.TestbedError:
                pass
            time.sleep(1.0)
        self.progress(f"chaos: {what}: not within {timeout:.0f} s")
        return None

    def kill_node(self, node: str, wipe: bool = False) -> Dict[str, Any]:
        hosted = _hosted(self.broker, self.password, "tb", node)
        killed = time.monotonic()
        testbed.kill_node(node, run=self.run, wipe=wipe)
        # Each of its instances seen on another node (same identity) or gone (scaled in): the
        # survivors re-homed them after dead_after.
        def rehomed() -> bool:
            where = instance_nodes(_fogctl(self.broker, self.password, "topology"), "tb")
            return all(where.get(i, set()) - {node} or i not in where for i in hosted)
        rehomed_s = self._wait(f"{node}'s instances elsewhere", rehomed, self.down) if hosted else 0.0
        time.sleep(max(0.0, killed + self.down - time.monotonic()))
        down_s = round(time.monotonic() - killed, 1)
        boot0 = time.monotonic()
        testbed.start_node(node, run=self.run)
        booted_s = round(time.monotonic() - boot0, 1)
        detail: Dict[str, Any] = {}
        if wipe:  # a blank disk: the role installs the replacement
            log = Path(self.inventory).parent.parent / "logs" / f"reinstall-{node}.log"
            proc = _ansible(self.inventory, log, 900.0, ["--limit", node, *self.extra_vars])
            detail = {"reinstall_s": round(time.monotonic() - boot0 - booted_s, 1), "reinstall_exit": proc.returncode}
            if proc.returncode != 0:
                self.progress(f"chaos: reinstalling {node} failed (exit {proc.returncode}): see {log}")
        back_s = self._wait(f"{node} back online", lambda: _online(self.broker, self.password, node), 300.0)
        return {"hosted": hosted, "down_s": down_s, "rehomed_after_s": rehomed_s, "ssh_after_boot_s": booted_s,
                **detail, "online_after_boot_s": (round(time.monotonic() - boot0, 1) if back_s is not None else None)}

    def lose_node(self, node: str) -> Dict[str, Any]:
        return self.kill_node(node, wipe=True)

    def partition(self, node: str) -> Dict[str, Any]:
        hosted = _hosted(self.broker, self.password, "tb", node)
        cut = round(self.rng.uniform(*self.cut), 1)
        t0 = time.monotonic()
        testbed.partition(node, cut=True, run=self.run)
        offline_s = self._wait(f"{node} offline", lambda: not _online(self.broker, self.password, node), cut)
        time.sleep(max(0.0, t0 + cut - time.monotonic()))
        testbed.partition(node, cut=False, run=self.run)
        back_s = self._wait(f"{node} back online", lambda: _online(self.broker, self.password, node), 120.0)
        return {"hosted": hosted, "cut_s": cut, "offline_after_s": offline_s, "online_after_heal_s": back_s}

    def schedule(self) -> int:
        self.started = time.monotonic()
        for _ in range(self.count):
            # A node that hosts instances of the pipeline, if one does: losing an idle node shows nothing.
            where = instance_nodes(_fogctl(self.broker, self.password, "topology"), "tb")
            busy = sorted({n for nodes in where.values() for n in nodes} & set(self.targets))
            kind, node = self.rng.choice(self.faults), self.rng.choice(busy or self.targets)
            t = round(time.monotonic() - self.started, 1)
            self.progress(f"chaos: t+{t} s {kind} {node}")
            try:
                detail = getattr(self, kind.replace("-", "_"))(node)
            finally:
                if kind == "partition":  # a node must never stay cut, whatever failed
                    testbed.partition(node, cut=False, run=self.run)
            self.records.append({"t_s": t, "kind": kind, "node": node, **detail})
            self.progress(f"chaos: {kind} {node}: {detail}")
            time.sleep(self.rng.uniform(*self.pause))
        return 0


def kill_node_down(down: Optional[float], dead_after: str) -> float:
    """How long a kill-node keeps a container off: `down` if given, else the agents' `dead_after`
    (as agent.toml says it) plus 25 s for the detection and the re-home, and at least 40 s."""
    if down is not None:
        return float(down)
    try:
        dead = float(dead_after)
    except ValueError:
        dead = 0.0
    return max(40.0, dead + 25.0)


def run_testbed_chaos(faults: Sequence[str] = FAULTS, count: int = 2, seed: int = 1, duration: float = 150.0,
                      rate: float = 300.0, down: Optional[float] = None, cut: Sequence[float] = (20.0, 40.0),
                      pause: Sequence[float] = (5.0, 10.0), at: float = 40.0, run: Optional[Path] = None,
                      progress: Any = testbed._stderr_progress) -> Dict[str, Any]:
    """`count` faults drawn from `faults` (seeded), the first `at` s after the deploy (once the load
    step has made in_zone scale out across containers); a kill-node keeps the container off for
    `down` s (default: the agents' dead_after plus 25 s, at least 40 s, so that its instances are
    re-homed with the fleet's own setting), a partition lasts a drawn time in `cut` (long cuts
    pass the MQTT keepalive: the broker fires the Will)."""
    bad = [f for f in faults if f not in ALL_FAULTS]
    if bad or not faults:
        raise testbed.TestbedError(f"--faults: on the testbed expected a subset of {', '.join(ALL_FAULTS)}, "
                                   f"found {list(faults)}")
    nemesis = TestbedNemesis(faults, count, seed, 0.0, cut, pause, run, progress)
    dead_after = testbed.ssh(nemesis.targets[0], "sed -n 's/^dead_after = //p' /etc/fog-agent/agent.toml",
                             run=run, check=False).stdout.strip()
    nemesis.down = kill_node_down(down, dead_after)
    nemesis.extra_vars = ["-e", f"fog_agent_dead_after={dead_after}"] if dead_after else []
    if {"kill-node", "lose-node"} & set(faults) and float(dead_after or 0) <= 0:
        progress("chaos: the agents have dead_after = 0: a dead node's instances are not re-homed "
                 "(run site.yml with -e fog_agent_dead_after=15)")
    summary = run_pipeline(duration, rate, run=run, progress=progress, during=nemesis.schedule, during_at=at)
    summary.update(testbed_faults=nemesis.records, dead_after=dead_after, seed=seed,
                   faults_injected=len(nemesis.records))
    summary["ok"] = bool(summary["ok"] and len(nemesis.records) == count
                         and (summary.get("during") or {}).get("exit") == 0)
    return summary
