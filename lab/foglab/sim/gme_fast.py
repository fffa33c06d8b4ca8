"""The exhaustive GME search, compiled (gme_fast.c), for sizes the Python search cannot finish.

Why: 2-FGME with 2+2 nodes x 2 requests has more than a billion states after every reduction;
the Python search (`gme_check.exhaustive_check`) does ~60k states per CPU second under PyPy. The
C loop does the same search, in the same order, ~20x faster (`fog-agent bench gme-check --fast`).

What is shared, so that the compiled search proves the same thing: the protocol cores, the
local transition memo with its soundness checks (`_LocalStates`: acyclicity measure,
communication graph, dead-variable classes), the layout and the symmetries (`_Layout`). C only
combines memoized answers into global states. The tests check that both searches visit exactly
the same number of states and transitions and find the same seeded faults.

Not in C: traces. A violation or deadlock is reported with the state; the Python search gives
the schedule for it (it stops at the same first violation, in the same order).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Union

from foglab.sim.gme_check import (
    _PROGRESS,
    CheckResult,
    ReductionUnsound,
    _CoreError,
    _budgets,
    _Layout,
    _LocalStates,
    make_nodes,
)

__all__ = ["fast_check", "compiler_available"]

_SRC = Path(__file__).with_name("gme_fast.c")
_CODES = {-1: "request", -2: "exit"}
_ERRORS = {1: "callback", 2: "violation", 3: "deadlock", 4: "table full", 5: "max states", 6: "out of memory",
           7: "I/O error on the sub-layer files", 8: "a step lowered the sweep's progress measure"}

i32p = ctypes.POINTER(ctypes.c_int32)
STEP = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, i32p, ctypes.c_int)
INT1 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)
INT2 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_int)
PROGRESS = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_double))


def _node_counter(ls: _LocalStates, sid: int, left: int) -> int:
    """The sweep's e for one node: its progress counter, 0 once it is idle with no request left."""
    return 0 if left == 0 and ls.idle[sid] else ls.progress[sid]


def _sweep_counter(ls: _LocalStates, sid: int, left: int) -> int:
    """`_node_counter`, checked: with merging, the sweep needs it to be a function of the class
    (one measure per class, so one table per class); checked for every local state met."""
    e = _node_counter(ls, sid, left)
    if ls.merge:
        c = ls.klass(sid, left)
        if ls.class_counter.setdefault(c, e) != e:
            raise ReductionUnsound(f"the sweep's counter differs inside class {c} ({ls.class_counter[c]} and {e}): "
                                   "a class must have one progress measure")
    return e


def compiler_available() -> bool:
    from shutil import which

    return which(os.environ.get("CC", "cc")) is not None


def _library() -> ctypes.CDLL:
    """gme_fast.c compiled once per content into the user's cache (a source change rebuilds)."""
    src = _SRC.read_bytes()
    tag = hashlib.sha256(src).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fog-agent"
    cache.mkdir(parents=True, exist_ok=True)
    lib = cache / f"gme_fast-{tag}.so"
    if not lib.exists():
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / lib.name
            cc = os.environ.get("CC", "cc")
            proc = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(_SRC)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"compiling {_SRC} with {cc} failed:\n{proc.stderr}")
            os.replace(out, lib)
    dll = ctypes.CDLL(str(lib))
    dll.gme_new.restype = ctypes.c_void_p
    dll.gme_new.argtypes = [ctypes.c_int] * 6 + [i32p] * 7 + [ctypes.c_int, ctypes.c_double, ctypes.c_double, ctypes.c_double,
                                                               STEP, INT1, INT2, INT2, INT2, INT2, PROGRESS]
    dll.gme_search.argtypes = [ctypes.c_void_p, i32p]
    dll.gme_sweep.argtypes = [ctypes.c_void_p, i32p, ctypes.c_char_p]
    dll.gme_free.argtypes = [ctypes.c_void_p]
    dll.gme_counts.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_double)]
    dll.gme_bad_state.restype = i32p
    dll.gme_bad_state.argtypes = [ctypes.c_void_p]
    return dll


def _ints(xs: Sequence[int]) -> Any:
    return (ctypes.c_int32 * max(1, len(xs)))(*xs)


def fast_check(
    algorithm: str,
    sizes: Sequence[int] = (2, 2),
    requests: Union[int, Sequence[int]] = 2,
    fault: Optional[str] = None,
    symmetry: bool = True,
    reduction: bool = True,
    merge_dead: bool = True,
    table_bits: int = 24,
    max_states: float = 1e12,
    progress: Optional[Callable[[CheckResult], None]] = None,
    progress_every: int = 10_000_000,
    sweep_dir: Optional[str] = None,
    memory_gb: float = 16.0,
) -> CheckResult:
    """`exhaustive_check` with hash compaction, in C. `table_bits`: 2^bits 8-byte slots (filled
    to 0.9 at most). `collision_bound` is fingerprint comparisons / 2^63 (see gme_fast.c).

    `sweep_dir`: explore in the order of a progress measure instead (the sweep-line method, see
    gme_fast.c): only the fingerprints of states not yet passed are held, in tables that grow up
    to `memory_gb` in all (`table_bits` is then unused); the states waiting for a later
    sub-layer are kept in files in this directory, each removed once read."""
    dll = _library()
    nodes0 = make_nodes(algorithm, sizes, fault)
    ls = _LocalStates(nodes0, _PROGRESS.get(algorithm, lambda x: 0))
    merge = ls.merge = merge_dead and hasattr(nodes0[0], "live_snapshot")
    budgets = _budgets(requests, len(nodes0))
    ls.stride = max(budgets) + 1
    lay = _Layout(nodes0, symmetry)
    ls.allowed = lay.allowed
    n, perms = lay.n, lay.perms
    res = CheckResult(reduced=reduction, hashed=True, symmetry=bool(perms), merged=merge)
    failure: List[BaseException] = []

    def guard(fn: Callable[..., int]) -> Callable[..., int]:
        def call(*a: Any) -> int:
            if failure:
                return -1
            try:
                return fn(*a)
            except BaseException as exc:  # told to C as -1, raised again below
                failure.append(exc)
                return -1
        return call

    def step(node: int, sid: int, code: int, mid: int, out: Any, cap: int) -> int:
        nsid, sends = ls.step(node, sid, _CODES.get(code, "deliver"), mid)
        if 2 + 2 * len(sends) > cap:
            raise RuntimeError(f"{len(sends)} sends in one step: more than gme_fast.c's buffer")
        out[0], out[1] = nsid, len(sends)
        for q, (to, m) in enumerate(sends):
            out[2 + 2 * q], out[3 + 2 * q] = to, m
        return 2 + 2 * len(sends)

    def take(counts: Any) -> None:
        """The first five counts, laid out alike by gme_counts and the progress callback."""
        res.states, res.transitions, res.schedules, res.full_expansions = (int(counts[k]) for k in range(4))
        res.local_states = len(ls.objs)
        res.collision_bound = counts[4] / 2.0 ** 63

    def report(counts: Any) -> None:
        take(counts)
        res.layer = int(counts[6])
        res.held = int(counts[7])
        if progress is not None:
            progress(res)

    rename_node = ls.rename_class if merge else ls.rename
    callbacks = (
        STEP(guard(step)),
        INT1(guard(lambda sid: int(ls.in_cs[sid]) | int(ls.idle[sid]) << 1)),
        INT2(guard(ls.klass)),
        INT2(guard(lambda c, p: rename_node(c, perms[p]))),
        INT2(guard(lambda mid, p: ls.rename_msg(mid, perms[p]))),
        INT2(guard(lambda sid, left: _sweep_counter(ls, sid, left))),
        PROGRESS(lambda c: guard(lambda: report(c) or 0)()),
    )
    nin = [len(lay.inbound[i]) for i in range(n)]
    in_b = [0] * (n * n)
    in_k = [0] * (n * n)
    for i in range(n):
        for t, (b, k) in enumerate(lay.inbound[i]):
            in_b[i * n + t], in_k[i * n + t] = b, k
    out_slot = [lay.out_slot[i].get(to, -1) for i in range(n) for to in range(n)]
    s = dll.gme_new(
        n, lay.nch, len(perms), ls.stride, int(merge), int(reduction),
        _ints(lay.groups), _ints(nin), _ints(in_b), _ints(in_k), _ints(out_slot),
        _ints([x for p in perms for x in p]), _ints([x for pos in lay.perm_pos for x in pos]),
        0 if sweep_dir else table_bits, memory_gb * 2.0 ** 30, float(max_states), float(progress_every), *callbacks,
    )
    if not s:
        raise MemoryError("gme_fast: no memory to set up the search" if sweep_dir else
                          f"gme_fast: no memory for 2^{table_bits} slots")
    start = list(ls.initial) + list(budgets) + [0] * lay.nch
    try:
        if sweep_dir:
            Path(sweep_dir).mkdir(parents=True, exist_ok=True)
            rc = dll.gme_sweep(s, _ints(start), os.fsencode(sweep_dir))
        else:
            rc = dll.gme_search(s, _ints(start))
    finally:
        dll.gme_free(s)
        for f in Path(sweep_dir).glob("sub-*.bin") if sweep_dir else ():
            f.unlink()  # left by a search that stopped early
    counts = (ctypes.c_double * 8)()
    dll.gme_counts(s, counts)
    take(counts)
    res.held, res.sublayers, res.unchecked = int(counts[5]), int(counts[6]), int(counts[7])
    if failure:
        exc = failure[0]
        if isinstance(exc, _CoreError):
            res.protocol_errors += 1
            res.first_failure = f"{type(exc.__cause__).__name__}: {exc.__cause__}"
            return res
        raise exc
    if rc in (2, 3):
        bad = dll.gme_bad_state(s)
        state = [bad[k] for k in range(n)]
        what = ", ".join(f"{i}:{lay.groups[i]}:{ls.objs[state[i]].state.name}" for i in range(n))
        if rc == 2:
            res.safety_violations += 1
            res.first_failure = f"two groups in the CS: {what}"
        else:
            res.deadlocks += 1
            res.first_failure = f"deadlock or unserved request: {what}"
    elif rc == 4:
        where = f"{memory_gb} GB of sub-layer tables" if sweep_dir else f"2^{table_bits} slots"
        raise RuntimeError(f"digest table full: {res.states} states in {where}")
    elif rc == 5:
        raise RuntimeError(f"state space larger than {max_states:.0f} states")
    elif rc != 0:
        raise RuntimeError(f"gme_fast: {_ERRORS.get(rc, rc)}")
    return res


if __name__ == "__main__":  # pragma: no cover - manual runs: python -m foglab.sim.gme_fast 2,2 2 30
    r = fast_check("2fgme", tuple(int(x) for x in sys.argv[1].split(",")), int(sys.argv[2]),
                   table_bits=int(sys.argv[3]) if len(sys.argv) > 3 else 24,
                   progress=lambda r: print(r.states, r.transitions, flush=True))
    print(r)
