"""Exactly-once verification of a demo or chaos run: which record ids had to reach the sink, and
which did (docs/design.md, "exactly once").

Sources are seeded, so the verifier regenerates each source's records (`taxi.TaxiGenerator`),
passes them through the pipeline's map operators, and compares the ids that should reach the sink
with the ids the counting sinks recorded (`*.ids` files).
"""

from __future__ import annotations

import importlib
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

from agent.config import PipelineConfig
from agent.operators.builtin import MapOperator, OperatorContext, load_operator, read_sink_ids
from agent.operators.keyed import KeyedOperator
from agent.operators.taxi import TaxiGenerator
from agent.refs import parse_ref
from foglab.operators import lab_allow_list


@dataclass(frozen=True)
class Verdict:
    generated: int
    expected: int  # ids that pass the pipeline's filters
    received: int
    lost: int
    duplicated: int
    unexpected: int  # ids at the sink that should have been filtered or were never generated
    lost_sample: Tuple[Tuple[str, int], ...] = ()

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.duplicated == 0 and self.unexpected == 0


def source_counts(sink_dir: Path) -> Dict[str, int]:
    """Records generated per source instance, from the sources' `<instance>.source.json` files."""
    out: Dict[str, int] = {}
    for path in sorted(Path(sink_dir).glob("*.source.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out[str(data.get("instance", path.name[: -len(".source.json")]))] = int(data.get("generated", 0))
    return out


def expected_ids(cfg: PipelineConfig, counts: Dict[str, int]) -> Dict[str, Set[int]]:
    """Ids that should reach the sink: regenerate each seeded source, apply the map operators."""
    src = cfg.operators[0]
    maps = []
    for op in cfg.operators[1:-1]:
        ctx = OperatorContext(instance="verifier", operator=op.name, node="verifier", kind=op.kind,
                              params=dict(op.params), state_dir=Path(tempfile.gettempdir()),
                              sink_dir=Path(tempfile.gettempdir()), restart=False)
        built = load_operator(op.function, ctx, lab_allow_list())
        if isinstance(built, KeyedOperator) and built.forwards:
            continue  # passes every record on unchanged; its own outputs are checked apart
        if not isinstance(built, MapOperator):
            raise ValueError(f"verifier: operator {op.name} is not a per-record map")
        maps.append(built.fn)
    regenerate = src.function.endswith(":source") and src.function.startswith("agent.operators.taxi")
    out: Dict[str, Set[int]] = {}
    for instance, n in counts.items():
        if not regenerate:
            out[instance] = set(range(n))
            continue
        gen = TaxiGenerator(int(src.params.get("seed", 1)), instance)
        keep = set()
        for seq in range(n):
            rec: Any = gen.record()
            for fn in maps:
                rec = fn(rec)
                if rec is None:
                    break
            if rec is not None:
                keep.add(seq)
        out[instance] = keep
    return out


def verify(cfg: PipelineConfig, sink_dir: Path) -> Verdict:
    counts = source_counts(sink_dir)
    expected = expected_ids(cfg, counts)
    received, dup = read_sink_ids(sink_dir)
    # a keyed operator's outputs (ids "<operator>#<key digest>") are not source records
    received = {k: v for k, v in received.items() if "#" not in k}
    lost: List[Tuple[str, int]] = []
    unexpected = 0
    for src, ids in expected.items():
        got = received.get(src, set())
        lost.extend((src, s) for s in sorted(ids - got))
        unexpected += len(got - ids)
    unexpected += sum(len(v) for k, v in received.items() if k not in expected)
    return Verdict(
        generated=sum(counts.values()),
        expected=sum(len(v) for v in expected.values()),
        received=sum(len(v) for v in received.values()),
        lost=len(lost),
        duplicated=dup,
        unexpected=unexpected,
        lost_sample=tuple(lost[:5]),
    )


def verify_settled(cfg: PipelineConfig, sink_dir: Path, timeout: float, quiet: float = 3.0,
                   step: float = 0.25) -> Verdict:
    """`verify` once the tail of a paused source has reached the sinks: the first verdict that
    stayed ok for `quiet` seconds, else the last one after `timeout`. For a run that goes on
    after the check (agents still up): a fixed pause before `verify` lists the tail as lost when
    the machine is slow. `quiet` outlasts a source's write of its count (every 2 s, with its
    heartbeat: a stale count hides records still on their way) and gives a duplicate time to
    show."""
    deadline = time.monotonic() + timeout
    ok_since: Optional[float] = None
    while True:
        v = verify(cfg, sink_dir)
        now = time.monotonic()
        ok_since = (ok_since or now) if v.ok else None
        if (ok_since is not None and now - ok_since >= quiet) or now >= deadline:
            return v
        time.sleep(step)


# ---- keyed (windowed) pipelines: every window against a fault-free reference ---------------------


@dataclass(frozen=True)
class WindowVerdict:
    """A keyed pipeline's outputs at the sink against the fault-free reference, output by output:
    ids from the sinks' id files (the accounting), contents from what the sinks spilled."""

    expected: int  # outputs of the reference run
    received: int  # distinct output ids at the sink
    missing: int  # in the reference, not at the sink
    extra: int  # at the sink, not in the reference
    duplicated: int  # ids recorded by more than one sink instance
    differing: int  # same id, other content
    unread: int  # ids at the sink whose content was not found in the landed spill files
    samples: Tuple[str, ...] = ()  # up to 5 differences, one line each

    @property
    def ok(self) -> bool:
        return not (self.missing or self.extra or self.duplicated or self.differing or self.unread)


def keyed_index(cfg: PipelineConfig) -> int:
    """The position of the pipeline's keyed operator, which must be the one before the sink."""
    for i, op in enumerate(cfg.operators):
        module, name = parse_ref(op.function)
        obj = getattr(importlib.import_module(module), name, None)
        if isinstance(obj, type) and issubclass(obj, KeyedOperator):
            if i != len(cfg.operators) - 2:
                raise ValueError(f"verifier: keyed operator {op.name} must be the last before the sink")
            return i
    raise ValueError("verifier: the pipeline has no keyed operator")


def expected_outputs(cfg: PipelineConfig, counts: Dict[str, int]) -> Dict[Tuple[str, int], Any]:
    """The keyed operator's outputs in a fault-free run: each seeded source regenerated, passed
    through the maps before it, and applied in source order, in one process (the keyed state's
    outputs do not depend on batching; they match a distributed run whose keyed operator takes its
    records in source order: one source instance and no scaling stage before it)."""
    from agent.instance.keyed_state import KeyedState

    k = keyed_index(cfg)
    op = cfg.operators[k]
    ctx = OperatorContext(instance="verifier", operator=op.name, node="verifier", kind=op.kind,
                          params=dict(op.params), state_dir=Path(tempfile.gettempdir()),
                          sink_dir=Path(tempfile.gettempdir()), restart=False)
    built = load_operator(op.function, ctx, lab_allow_list())
    state = KeyedState(built, op.name, cfg.operators[k - 1].key, op.key_groups)  # type: ignore[arg-type]
    maps = []
    for o in cfg.operators[1:k]:
        m = load_operator(o.function, ctx, lab_allow_list())
        if not isinstance(m, MapOperator):
            raise ValueError(f"verifier: operator {o.name} is not a per-record map")
        maps.append(m.fn)
    src = cfg.operators[0]
    if not (src.function.startswith("agent.operators.taxi") and src.function.endswith(":source")):
        raise ValueError("verifier: the reference of a keyed pipeline regenerates agent.operators.taxi:source only")
    out: Dict[Tuple[str, int], Any] = {}
    for instance, n in sorted(counts.items()):
        gen = TaxiGenerator(int(src.params.get("seed", 1)), instance)
        items = []
        for seq in range(n):
            rec: Any = gen.record()
            for fn in maps:
                rec = fn(rec)
                if rec is None:
                    break
            if rec is not None:
                items.append((instance, seq, rec))
        for s, q, r in state.apply(instance, items, 1):
            out[(s, q)] = r
    return out


def landed_records(landing: Path) -> Dict[Tuple[str, int], Any]:
    """Every record the sinks spilled and their shippers landed (docs/spill.md), by record id."""
    import gzip

    out: Dict[Tuple[str, int], Any] = {}
    for path in sorted(Path(landing).glob("kind=*/date=*/node=*/*.gz")):
        kind = path.parts[-4][len("kind="):]
        if kind not in ("batches", "records"):
            continue
        add_spilled(gzip.decompress(path.read_bytes()).splitlines(), out)
    return out


def add_spilled(lines: Iterable[bytes], out: Dict[Tuple[str, int], Any]) -> None:
    """The records of a sink's spilled lines into `out`, by record id: a batch line
    `{"k": keys, "r": [[src, seq, values], ...]}`, or records with "src" and "seq" (one, or an
    array of them, per line). Lines that do not parse, and lines of other kinds, are skipped."""
    for line in lines:
        try:
            v = json.loads(line)
        except ValueError:
            continue
        if isinstance(v, dict) and "k" in v and "r" in v:
            for s, q, values in v["r"]:
                out[(str(s), int(q))] = dict(zip(v["k"], values))
            continue
        for r in v if isinstance(v, list) else [v]:
            if isinstance(r, dict) and "src" in r and "seq" in r:
                key = (str(r.pop("src")), int(r.pop("seq")))
                out[key] = r["value"] if set(r) == {"value"} else r


def verify_windows(cfg: PipelineConfig, sink_dir: Path, landing: Path) -> WindowVerdict:
    """The keyed operator's outputs at the sink, against `expected_outputs`: the same ids, each
    once, and the same content (compared as canonical JSON: the same floats, bit for bit)."""
    want = expected_outputs(cfg, source_counts(sink_dir))
    received, dup = read_sink_ids(sink_dir)
    got_ids = {(s, q) for s, qs in received.items() for q in qs}
    contents = landed_records(landing)
    samples: List[str] = []
    missing = sorted(set(want) - got_ids)
    extra = sorted(got_ids - set(want))
    samples += [f"missing {i}: {json.dumps(want[i], sort_keys=True)}" for i in missing[:3]]
    samples += [f"extra {i}" for i in extra[:2]]
    differing = unread = 0
    for i in sorted(got_ids & set(want)):
        if i not in contents:
            unread += 1
            continue
        a, b = json.dumps(want[i], sort_keys=True), json.dumps(contents[i], sort_keys=True)
        if a != b:
            differing += 1
            if len(samples) < 5:
                samples.append(f"differs {i}: reference {a}, sink {b}")
    return WindowVerdict(expected=len(want), received=len(got_ids), missing=len(missing), extra=len(extra),
                         duplicated=dup, differing=differing, unread=unread, samples=tuple(samples[:5]))
