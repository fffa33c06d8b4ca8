"""Latency matrix -> `tc` commands that emulate it on one node (Gesscale's tc-emulated testbed).

The tree on the node's interface (one class and one netem leaf per destination):

    root 1: htb default 1                      (or: prio bands N+1 with --root prio)
      class 1:1   htb rate 10gbit              unmatched traffic: no delay
      class 1:1k  htb rate 10gbit  -> qdisc k: netem delay D ms [J ms distribution normal] [loss L%]
      filter u32 match ip dst <address of destination k>/32 -> flowid 1:1k

Matrix semantics: values are ROUND-TRIP times in ms between two nodes; each node delays its own
egress toward a destination by half of it, so that with the matrix applied on both ends the RTT
between them is the configured value (use `one_way=True` to apply the value as is).

Idempotence: `plan()` reads the current `tc qdisc show` of the device. If our root (htb 1:) is
there with exactly the wanted leaves, it only issues `replace` commands (classes, leaves and
filters with fixed handles 800::k are all replaceable: re-applying changes nothing); otherwise it
deletes the root and rebuilds. `clear` deletes the root qdisc; a device without one is not an error.

netem detection: this build machine's kernel lacks sch_netem ("Specified qdisc kind is unknown").
`netem_available()` checks /sys/module/sch_netem, then probes `tc qdisc add ... netem` on the
loopback of a throw-away network namespace; `apply()` refuses with `NetemMissing` (one clear line)
unless the leaf kind is overridden (tests run the same tree with a pfifo/tbf leaf, which this
kernel accepts, so that at least the htb/u32 tree is validated for real).

Matrix file (TOML):

    [nodes]                      # name -> address (and optional device)
    pi1 = "10.0.0.1"
    pi2 = { address = "10.0.0.2", dev = "eth0" }
    [rtt_ms]                     # from -> to -> RTT ms; a missing pair falls back to to -> from
    pi1 = { pi2 = 50, pi3 = 150 }
    pi2 = { pi3 = { delay = 300, jitter = 10, loss = 0.5 } }
"""

from __future__ import annotations

import ipaddress
import os
import shlex
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

__all__ = [
    "Link",
    "LatencyMatrix",
    "load_matrix",
    "parse_matrix",
    "build_commands",
    "plan",
    "apply",
    "clear",
    "netem_available",
    "NetemError",
    "NetemMissing",
    "Runner",
    "NETEM_MISSING_LINE",
]

NETEM_MISSING_LINE = ("netem: this kernel has no sch_netem qdisc (\"Specified qdisc kind is unknown\"); "
                      "load the module (modprobe sch_netem) or use the userspace delay proxy "
                      "(foglab.tools.delayproxy)")

Runner = Callable[[Sequence[str]], Tuple[int, str, str]]


class NetemError(RuntimeError):
    """A tc command failed; the message names the command and tc's error."""


class NetemMissing(NetemError):
    pass


@dataclass(frozen=True)
class Link:
    delay_ms: float
    jitter_ms: float = 0.0
    loss_pct: float = 0.0

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0 or not 0 <= self.loss_pct <= 100:
            raise ValueError(f"invalid link delay={self.delay_ms} jitter={self.jitter_ms} loss={self.loss_pct}")


@dataclass(frozen=True)
class LatencyMatrix:
    addresses: Mapping[str, str]
    devices: Mapping[str, str]
    links: Mapping[str, Mapping[str, Link]]  # from -> to -> Link (RTT semantics)

    def link(self, a: str, b: str) -> Optional[Link]:
        return self.links.get(a, {}).get(b) or self.links.get(b, {}).get(a)

    def rtt_ms(self) -> Dict[str, Dict[str, float]]:
        """Plain {from: {to: RTT ms}} for every pair (what the placement code consumes)."""
        out: Dict[str, Dict[str, float]] = {}
        for a in self.addresses:
            for b in self.addresses:
                if a != b:
                    lk = self.link(a, b)
                    if lk is not None:
                        out.setdefault(a, {})[b] = lk.delay_ms
        return out


def _link(value: object, where: str) -> Link:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return Link(float(value))
    if isinstance(value, dict):
        unknown = set(value) - {"delay", "jitter", "loss"}
        if unknown or "delay" not in value:
            raise ValueError(f"{where}: expected a number or {{delay, jitter, loss}}, found keys {sorted(value)}")
        return Link(float(value["delay"]), float(value.get("jitter", 0.0)), float(value.get("loss", 0.0)))
    raise ValueError(f"{where}: expected a number of ms or a table, found {value!r}")


def parse_matrix(data: Mapping[str, object], source: str = "matrix") -> LatencyMatrix:
    nodes = data.get("nodes")
    if not isinstance(nodes, dict) or not nodes:
        raise ValueError(f"{source}: a [nodes] table (name = address) is required")
    addresses: Dict[str, str] = {}
    devices: Dict[str, str] = {}
    for name, v in nodes.items():
        addr = v.get("address") if isinstance(v, dict) else v
        try:
            ipaddress.ip_address(str(addr))
        except ValueError:
            raise ValueError(f"{source}: nodes.{name}: expected an IP address, found {addr!r}") from None
        addresses[name] = str(addr)
        if isinstance(v, dict) and v.get("dev"):
            devices[name] = str(v["dev"])
    raw = data.get("rtt_ms", data.get("latency", {}))
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: [rtt_ms] must be a table")
    links: Dict[str, Dict[str, Link]] = {}
    for a, row in raw.items():
        if a not in addresses:
            raise ValueError(f"{source}: rtt_ms.{a}: unknown node (not in [nodes])")
        if not isinstance(row, dict):
            raise ValueError(f"{source}: rtt_ms.{a}: expected a table of destinations")
        for b, v in row.items():
            if b not in addresses:
                raise ValueError(f"{source}: rtt_ms.{a}.{b}: unknown node (not in [nodes])")
            links.setdefault(a, {})[b] = _link(v, f"{source}: rtt_ms.{a}.{b}")
    return LatencyMatrix(addresses, devices, links)


def load_matrix(path: Union[str, Path]) -> LatencyMatrix:
    from agent.schema import tomllib

    p = Path(path)
    with p.open("rb") as f:
        return parse_matrix(tomllib.load(f), p.name)


def _ms(v: float) -> str:
    return f"{v:.3f}".rstrip("0").rstrip(".") + "ms"


def _leaf(link: Link, one_way: bool, leaf: str) -> List[str]:
    if leaf != "netem":  # kernels without netem (tests): the same tree with another leaf
        return {"pfifo": ["pfifo", "limit", "1000"],
                "tbf": ["tbf", "rate", "1gbit", "burst", "32k", "latency", "50ms"]}[leaf]
    half = 1.0 if one_way else 0.5
    args = ["netem", "delay", _ms(link.delay_ms * half)]
    if link.jitter_ms:
        args += [_ms(link.jitter_ms * half), "distribution", "normal"]
    if link.loss_pct:
        args += ["loss", f"{link.loss_pct:g}%"]
    return args


def destinations(matrix: LatencyMatrix, node: str) -> List[Tuple[int, str, str, Link]]:
    """(class minor, destination, address, link) for every other node with a link, stable order."""
    if node not in matrix.addresses:
        raise ValueError(f"node {node!r} is not in the matrix (nodes: {', '.join(sorted(matrix.addresses))})")
    linked = [(d, matrix.link(node, d)) for d in sorted(matrix.addresses) if d != node]
    return [(k, d, matrix.addresses[d], lk) for k, (d, lk) in
            enumerate(((d, lk) for d, lk in linked if lk is not None), start=0x10)]


def build_commands(matrix: LatencyMatrix, node: str, dev: Optional[str] = None, root: str = "htb",
                   leaf: str = "netem", one_way: bool = False, with_root: bool = True) -> List[List[str]]:
    """The tc argv lists that build the tree for `node` (see module doc)."""
    dev = dev or matrix.devices.get(node) or "eth0"
    dests = destinations(matrix, node)
    cmds: List[List[str]] = []
    if root == "htb":
        if with_root:
            cmds.append(["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"])
        cmds.append(["tc", "class", "replace", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", "10gbit"])
        for k, _, _, _ in dests:
            cmds.append(["tc", "class", "replace", "dev", dev, "parent", "1:", "classid", f"1:{k:x}",
                         "htb", "rate", "10gbit"])
        parent = lambda k: f"1:{k:x}"  # noqa: E731
    elif root == "prio":
        bands = len(dests) + 1
        if bands > 16:
            raise ValueError(f"prio supports at most 16 bands, {len(dests)} destinations need htb")
        if with_root:
            cmds.append(["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "prio", "bands", str(bands),
                         "priomap"] + ["0"] * 16)
        parent = lambda k: f"1:{k - 0x10 + 2:x}"  # noqa: E731  band 1 = default, 2.. = destinations
    else:
        raise ValueError(f"root must be htb or prio, found {root!r}")
    for k, _, _, lk in dests:
        cmds.append(["tc", "qdisc", "replace", "dev", dev, "parent", parent(k), "handle", f"{k:x}:"]
                    + _leaf(lk, one_way, leaf))
    for k, _, addr, _ in dests:
        proto, plen = ("ip", 32) if ipaddress.ip_address(addr).version == 4 else ("ipv6", 128)
        cmds.append(["tc", "filter", "replace", "dev", dev, "parent", "1:", "protocol", proto, "prio", "1",
                     "handle", f"800::{k:x}", "u32", "match", proto, "dst", f"{addr}/{plen}",
                     "flowid", parent(k)])
    return cmds


def _root_kind(qdisc_show: str) -> Tuple[Optional[str], List[str]]:
    """(kind of a root with handle 1:, handles of its children) from `tc qdisc show dev X`."""
    kind = None
    children = []
    for line in qdisc_show.splitlines():
        parts = line.split()
        if len(parts) < 3 or parts[0] != "qdisc":
            continue
        if "root" in parts and parts[2] == "1:":
            kind = parts[1]
        elif "parent" in parts and parts[parts.index("parent") + 1].startswith("1:"):
            children.append(parts[2])
    return kind, sorted(children)


def default_runner(prefix: Sequence[str] = ()) -> Runner:
    def run(argv: Sequence[str]) -> Tuple[int, str, str]:
        try:
            p = subprocess.run(list(prefix) + list(argv), capture_output=True, text=True, timeout=30)
        except FileNotFoundError as exc:
            return 127, "", f"{exc.filename}: not found"
        return p.returncode, p.stdout, p.stderr

    return run


def plan(matrix: LatencyMatrix, node: str, run: Runner, dev: Optional[str] = None, root: str = "htb",
         leaf: str = "netem", one_way: bool = False) -> List[List[str]]:
    """Commands to reach the wanted tree from the current one (see Idempotence in the module doc)."""
    dev = dev or matrix.devices.get(node) or "eth0"
    rc, out, err = run(["tc", "qdisc", "show", "dev", dev])
    if rc != 0:
        raise NetemError(f"tc qdisc show dev {dev}: {err.strip() or out.strip()} (exit {rc})")
    kind, children = _root_kind(out)
    wanted = sorted(f"{k:x}:" for k, _, _, _ in destinations(matrix, node))
    if kind == root and children == wanted:
        return build_commands(matrix, node, dev, root, leaf, one_way, with_root=False)
    cmds = [] if kind is None else [["tc", "qdisc", "del", "dev", dev, "root"]]
    return cmds + build_commands(matrix, node, dev, root, leaf, one_way, with_root=True)


def _unknown_qdisc(err: str) -> bool:
    return "Specified qdisc kind is unknown" in err or "Unknown qdisc" in err


def apply(matrix: LatencyMatrix, node: str, run: Runner, dev: Optional[str] = None, root: str = "htb",
          leaf: str = "netem", one_way: bool = False) -> List[List[str]]:
    """Run the plan; stops at the first failing command with its error. Returns what was run."""
    cmds = plan(matrix, node, run, dev, root, leaf, one_way)
    for argv in cmds:
        rc, out, err = run(argv)
        if rc != 0:
            if leaf == "netem" and "netem" in argv and _unknown_qdisc(err):
                raise NetemMissing(NETEM_MISSING_LINE)
            raise NetemError(f"`{shlex.join(argv)}` failed (exit {rc}): {err.strip() or out.strip()}")
    return cmds


def clear(run: Runner, dev: str) -> bool:
    """Remove our tree; False when there was nothing to remove."""
    rc, out, err = run(["tc", "qdisc", "del", "dev", dev, "root"])
    if rc == 0:
        return True
    msg = err + out
    if "handle of zero" in msg or "No such file" in msg or "Invalid handle" in msg or "Cannot find" in msg:
        return False
    raise NetemError(f"tc qdisc del dev {dev} root failed (exit {rc}): {msg.strip()}")


def netem_available(run: Optional[Runner] = None) -> Optional[bool]:
    """True/False when known; None when it cannot be probed (not root, no `ip`)."""
    if os.path.isdir("/sys/module/sch_netem"):
        return True
    if run is None:
        if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
            return None
        run = default_runner()
    ns = f"fogprobe{uuid.uuid4().hex[:8]}"
    rc, _, _ = run(["ip", "netns", "add", ns])
    if rc != 0:
        return None
    try:
        run(["ip", "-n", ns, "link", "set", "lo", "up"])
        rc, out, err = run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                            "delay", "1ms"])
        if rc == 0:
            return True
        return False if _unknown_qdisc(err + out) else None
    finally:
        run(["ip", "netns", "del", ns])


def format_commands(cmds: Sequence[Sequence[str]]) -> str:
    return "\n".join(shlex.join(c) for c in cmds)
