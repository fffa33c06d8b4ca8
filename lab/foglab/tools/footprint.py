"""Memory per process kind of a process tree (issue 39: every process under 40 MB).

`Footprint(root).sample()` reads every process under `root` from /proc: VmHWM (the kernel's
peak RSS of the process) and VmRSS from /proc/PID/status, Pss and the private pages (USS =
Private_Clean + Private_Dirty) from /proc/PID/smaps_rollup, and keeps each process's largest
figures. Forked workers share the fork server's pages copy-on-write, so RSS counts those pages in
every worker; PSS charges each shared page to its sharers in equal parts and USS only what the
process alone holds. VmHWM is the kernel's own peak, so a process's peak RSS is exact up to its
last sample; PSS and USS are the largest samples.

Kinds, from the command line and the parent:
    agent        python -m agent ... run
    forkserver   python -m agent.instance.forkserver (not forked by another fork server)
    worker:OPS   a worker: a child of the fork server, or python -m agent.instance.worker;
                 OPS are the operators of the instances it holds (the `<instance>.lock` files it
                 has open; instance ids are `<pipeline>.<operator>.<n>` for a keeper, `<operator>-<hex>` for
                 a copy), e.g. worker:in_zone, or
                 worker:validate+in_zone for a chain
    broker       mosquitto
    driver       the root itself and any other python process (the demo's monitor)

The demo samples its own tree every 0.5 s (`Sampler`) and reports the peaks per kind;
`python -m foglab.tools.footprint [--json] [--period 0.5] -- <command>` runs any command and
samples its tree (benchmarks: `... -- fog-agent bench keyed --json`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from typing import Dict, List, Mapping, Optional, Set


def _read(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as fh:
            return fh.read().decode(errors="replace")
    except OSError:
        return None


def children_map() -> Dict[int, List[int]]:
    out: Dict[int, List[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = _read(f"/proc/{name}/stat")
        if not stat:
            continue
        try:
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (IndexError, ValueError):
            continue
        out.setdefault(ppid, []).append(int(name))
    return out


def tree(root: int) -> Dict[int, int]:
    """{pid: ppid} of every descendant of root (and root)."""
    kids = children_map()
    out = {root: 0}
    todo = [root]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            if c not in out:
                out[c] = p
                todo.append(c)
    return out


def cmdline(pid: int) -> List[str]:
    raw = _read(f"/proc/{pid}/cmdline") or ""
    return [a for a in raw.split("\0") if a]


def operators_of(pid: int) -> List[str]:
    """Operators of the instances a worker holds (its open `<instance>.lock` files)."""
    ops: Set[str] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        base = os.path.basename(target)
        if base.endswith(".lock"):
            inst = base[: -len(".lock")]
            parts = inst.split(".")
            if len(parts) >= 3:  # a keeper: <pipeline>.<operator>.<n>
                ops.add(".".join(parts[1:-1]))
            elif "-" in inst:  # a copy: <operator>-<hex>
                ops.add(inst.rsplit("-", 1)[0])
    return sorted(ops)


def kind(pid: int, ppid: int, cmds: Dict[int, List[str]], root: int) -> str:
    cmd = cmds.get(pid, [])
    joined = " ".join(cmd)
    parent = " ".join(cmds.get(ppid, []))
    if cmd and os.path.basename(cmd[0]).startswith("mosquitto"):
        return "broker"
    if "agent.instance.forkserver" in joined:
        if "agent.instance.forkserver" in parent:
            return "worker"
        return "forkserver"
    if "agent.instance.worker" in joined:
        return "worker"
    if pid != root and "-m agent" in joined and " run" in joined:
        return "agent"
    return "driver"


def memory(pid: int) -> Optional[Dict[str, float]]:
    status = _read(f"/proc/{pid}/status")
    rollup = _read(f"/proc/{pid}/smaps_rollup")
    if not status or not rollup:
        return None
    vals: Dict[str, float] = {}
    for text in (status, rollup):
        for line in text.splitlines():
            k, _, v = line.partition(":")
            v = v.strip()
            if v.endswith(" kB"):
                try:
                    vals[k] = float(v[:-3])
                except ValueError:
                    pass
    if "VmRSS" not in vals:
        return None
    return {"rss": vals["VmRSS"] / 1024, "hwm": vals.get("VmHWM", vals["VmRSS"]) / 1024,
            "pss": vals.get("Pss", 0.0) / 1024,
            "uss": (vals.get("Private_Clean", 0.0) + vals.get("Private_Dirty", 0.0)) / 1024}


class Footprint:
    """The largest figures of every process ever seen under `root`, and its kind."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.peaks: Dict[int, Dict[str, float]] = {}  # pid -> largest sample of each figure
        self.kinds: Dict[int, str] = {}

    def sample(self) -> None:
        members = tree(self.root)
        cmds = {pid: cmdline(pid) for pid in set(members) | set(members.values())}  # fresh: a child execs
        for pid, ppid in members.items():
            if not cmds.get(pid):
                continue  # exiting (a zombie has no command line): keep what it was
            k = kind(pid, ppid, cmds, self.root)
            if k == "worker":
                ops = operators_of(pid)
                before = self.kinds.get(pid, "")
                k = "worker:" + "+".join(ops) if ops else (before if before.startswith("worker") else k)
            if self.kinds.get(pid, k).split(":")[0] != k.split(":")[0]:
                self.peaks.pop(pid, None)  # the pid is another program now (exec, or reused)
            self.kinds[pid] = k
            m = memory(pid)
            if m is None:
                continue
            row = self.peaks.setdefault(pid, dict(m))
            for f, v in m.items():
                row[f] = max(row[f], v)

    def per_kind(self) -> Dict[str, Dict[str, float]]:
        """{kind: {"n": processes, "rss_peak_mb", "pss_peak_mb", "uss_peak_mb"}}: the largest
        peak of any one process of the kind (MiB)."""
        out: Dict[str, Dict[str, float]] = {}
        for pid, row in self.peaks.items():
            agg = out.setdefault(self.kinds.get(pid, "driver"),
                                 {"n": 0, "rss_peak_mb": 0.0, "pss_peak_mb": 0.0, "uss_peak_mb": 0.0})
            agg["n"] += 1
            agg["rss_peak_mb"] = round(max(agg["rss_peak_mb"], row["hwm"], row["rss"]), 1)
            agg["pss_peak_mb"] = round(max(agg["pss_peak_mb"], row["pss"]), 1)
            agg["uss_peak_mb"] = round(max(agg["uss_peak_mb"], row["uss"]), 1)
        return dict(sorted(out.items()))


class Sampler:
    """A Footprint sampled every `period` s by a thread, from `start()` until `stop()` (which
    takes one last sample and returns the peaks per kind)."""

    def __init__(self, root: int, period: float = 0.5) -> None:
        self.footprint = Footprint(root)
        self.period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="footprint", daemon=True)

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.footprint.sample()
            self._stop.wait(self.period)

    def stop(self) -> Dict[str, Dict[str, float]]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.footprint.sample()
        return self.footprint.per_kind()


def table(per_kind: Mapping[str, Mapping[str, float]], notes: Optional[Mapping[str, str]] = None) -> List[str]:
    """Lines of a table: kind, processes, peak RSS, PSS and USS (MB), a note per kind."""
    notes = notes or {}
    lines = [f"{'kind':<34} {'n':>3} {'RSS peak':>9} {'PSS peak':>9} {'USS peak':>9}  (MB)"]
    for k, a in per_kind.items():
        lines.append(f"{k:<34} {int(a['n']):>3} {a['rss_peak_mb']:>9.1f} {a['pss_peak_mb']:>9.1f} "
                     f"{a['uss_peak_mb']:>9.1f}  {notes.get(k, '')}".rstrip())
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m foglab.tools.footprint", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--period", type=float, default=0.5)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE)
    out_chunks: List[bytes] = []
    reader = threading.Thread(target=lambda: out_chunks.append(proc.stdout.read()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    fp = Footprint(proc.pid)
    done = threading.Event()
    while not done.is_set():
        if proc.poll() is not None:
            done.set()  # one last sample of the tree, then out
        fp.sample()
        done.wait(args.period)
    reader.join(5.0)
    result = {"command": command, "returncode": proc.returncode, "per_kind": fp.per_kind(),
              "stdout": b"".join(out_chunks).decode(errors="replace")[-4000:]}
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        print("\n".join(table(result["per_kind"])))
    return int(proc.returncode or 0)


if __name__ == "__main__":
    sys.exit(main())
