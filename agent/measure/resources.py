"""Node measurements with psutil: what the agent publishes in its retained state.

Why: the policies need the node's real headroom, and a Raspberry Pi throttles its CPU frequency
when hot, so the capacity an instance sustains falls with the frequency. The agent samples
CPU (total, per core, per worker process), load average, memory, temperature and CPU frequency
when the platform exposes them (None otherwise: containers and this build machine expose no
sensors) and publishes them retained every state period.

API (driven by the daemon's loop, one owner):
    sampler = NodeSampler()                 # keeps psutil.Process objects between calls
    doc = sampler.sample(pids=[1234, 1240]) # dict, JSON-serializable
    measure_node(pids)                      # the same with a module-level sampler

psutil's cpu_percent(interval=None) measures since the previous call: the first call of a
process returns 0.0, so per-worker CPU is meaningful from the second sample on (the sampler keeps
the Process objects for exactly that reason). Keys used by agent.node.nodestate: "cpu" (%),
"memory" (%), "temperature" (deg C or None).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterable, Optional

import psutil

__all__ = ["NodeSampler", "measure_node", "frequency_ratio", "read_temperature", "read_frequency"]


def read_temperature() -> Optional[float]:
    """Highest reported CPU/SoC temperature in deg C, None when the platform exposes none."""
    try:
        temps = psutil.sensors_temperatures()  # type: ignore[attr-defined]
    except (AttributeError, OSError, RuntimeError):
        return None
    best: Optional[float] = None
    for name, entries in (temps or {}).items():
        for e in entries:
            if e.current is None:
                continue
            # the Pi reports "cpu_thermal"; x86 "coretemp"/"k10temp"; take the hottest sensor
            if best is None or e.current > best:
                best = float(e.current)
    if best is None:  # psutil misses it on some kernels: the Pi's sysfs file
        try:
            with open("/sys/class/thermal/thermal_zone0/temp") as f:
                best = int(f.read().strip()) / 1000.0
        except (OSError, ValueError):
            return None
    return best


def read_frequency() -> Dict[str, Optional[float]]:
    """Current / min / max CPU frequency in MHz (None when unknown; max 0 means unknown)."""
    try:
        f = psutil.cpu_freq()
    except (AttributeError, OSError, RuntimeError, NotImplementedError):
        f = None
    if f is None:
        return {"current": None, "min": None, "max": None}
    return {"current": float(f.current) or None, "min": float(f.min) or None, "max": float(f.max) or None}


def frequency_ratio(freq: Dict[str, Optional[float]]) -> Optional[float]:
    """current / max: 1.0 at full speed, < 1 when throttled; None when not exposed."""
    cur, mx = freq.get("current"), freq.get("max")
    if not cur or not mx:
        return None
    return min(1.0, cur / mx)


class NodeSampler:
    """Samples the node; keeps per-pid Process handles so that per-worker CPU is a rate."""

    def __init__(self) -> None:
        self._procs: Dict[int, psutil.Process] = {}
        psutil.cpu_percent(interval=None, percpu=True)  # prime the since-last-call counters
        psutil.cpu_percent(interval=None)

    def _proc(self, pid: int) -> Optional[psutil.Process]:
        p = self._procs.get(pid)
        if p is None:
            try:
                p = psutil.Process(pid)
                p.cpu_percent(interval=None)  # prime
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                return None
            self._procs[pid] = p
        return p

    def workers(self, pids: Iterable[int]) -> Dict[str, Dict[str, Any]]:
        out: Dict[str, Dict[str, Any]] = {}
        wanted = set(int(p) for p in pids)
        for gone in set(self._procs) - wanted:
            del self._procs[gone]
        for pid in sorted(wanted):
            p = self._proc(pid)
            if p is None:
                continue
            try:
                with p.oneshot():
                    out[str(pid)] = {
                        "cpu_percent": p.cpu_percent(interval=None),  # of ONE core (can exceed 100)
                        "rss_bytes": p.memory_info().rss,
                        "threads": p.num_threads(),
                    }
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                self._procs.pop(pid, None)
        return out

    def sample(self, pids: Iterable[int] = ()) -> Dict[str, Any]:
        per_core = psutil.cpu_percent(interval=None, percpu=True)
        total = sum(per_core) / len(per_core) if per_core else psutil.cpu_percent(interval=None)
        try:
            load1, load5, load15 = os.getloadavg()
        except (AttributeError, OSError):
            load1 = load5 = load15 = None  # type: ignore[assignment]
        vm = psutil.virtual_memory()
        freq = read_frequency()
        return {
            "cpu": float(total),
            "cpu_per_core": [float(c) for c in per_core],
            "cpu_count": psutil.cpu_count() or len(per_core),
            "load1": load1,
            "load5": load5,
            "load15": load15,
            "memory": float(vm.percent),
            "memory_available_bytes": int(vm.available),
            "memory_total_bytes": int(vm.total),
            "temperature": read_temperature(),
            "cpu_freq_mhz": freq["current"],
            "cpu_freq_max_mhz": freq["max"],
            "cpu_freq_ratio": frequency_ratio(freq),
            "workers": self.workers(pids),
        }


_default: Optional[NodeSampler] = None


def measure_node(pids: Iterable[int] = ()) -> Dict[str, Any]:
    """One sample with a module-level sampler (the daemon's retained state calls this)."""
    global _default
    if _default is None:
        _default = NodeSampler()
    return _default.sample(pids)
