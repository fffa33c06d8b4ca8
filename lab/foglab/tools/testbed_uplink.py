"""A site's uplink cut on the sites testbed, with its verdict (docs/operations.md, "Sites on the
testbed"; issue #40 item 3).

On `fog-agent testbed up --sites S --nodes N` installed by `site.yml`: the taxi pipeline runs on
every site (its own name per site, so that record ids differ between sites), each through its own
site broker; `cut_at` seconds after the deploy one site's uplink goes down (`testbed partition
<broker> --uplink`: only the link between that site broker and the centre) for `cut_seconds`,
during the sources' load step, then comes back. The sinks spill every record they recorded; the
spill crosses site broker -> bridge -> central broker -> collector and lands in the centre's
landing zone. After the pipelines end, the command waits until every site node's spool has
shipped everything, copies the landing zone to the host and counts each record id.

The verdict (`verdict`, pure): per site, every record the pipeline had to deliver (regenerated
from the seeded sources, `foglab.tools.verify.expected_ids`) landed at the centre exactly once
(none lost, none twice, none unexpected); during the cut the cut site kept processing (its sinks
recorded records) and scaling (in_zone ran more than one instance), nothing of it reached the
centre (the cut is real), its site broker could not reach the centre while its nodes reached their
broker; the spool stayed below its cap and was empty once landed.

Only the pure parts are tested in the suite (`tests/test_testbed_sites.py`); the run takes the
cut plus a few minutes.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

from agent.operators.builtin import _line_ids
from foglab.tools import testbed, testbed_pipeline
from foglab.tools.testbed_sites import CENTRAL_PORT, Layout, Site, load_layout

SPOOL = "/var/lib/fog-agent/spool"
LANDING = "/var/lib/fog-collector/landing"
SPILLED_KINDS = ("batches", "records")  # what a counting sink spills (docs/spill.md)

# ---------------------------------------------------------------------------------------------
# Pure: counting and the verdict.


def count_ids(lines: Iterable[bytes]) -> "Counter[Tuple[str, int]]":
    """How many times each record id occurs in a sink's spilled lines (a landed file's lines)."""
    out: "Counter[Tuple[str, int]]" = Counter()
    for line in lines:
        out.update(_line_ids(line))
    return out


@dataclass(frozen=True)
class SiteLanding:
    """One site's records at the centre, against what its pipeline had to deliver."""

    expected: int
    landed: int  # distinct expected ids landed
    lost: int  # expected, never landed
    duplicated: int  # extra copies of landed ids (an id landed k times counts k - 1)
    unexpected: int  # ids of this site's sources that were not expected
    lost_sample: Tuple[Tuple[str, int], ...] = ()


def site_landing(expected: Dict[str, Set[int]], landed: "Counter[Tuple[str, int]]") -> SiteLanding:
    """Account one site: `expected` {source instance: ids} against the landed ids of every site
    (only ids of this site's sources count here; source instance ids name their pipeline)."""
    want = {(src, seq) for src, seqs in expected.items() for seq in seqs}
    mine = {rid: n for rid, n in landed.items() if rid[0] in expected}
    lost = sorted(want - set(mine))
    return SiteLanding(expected=len(want), landed=len(want & set(mine)), lost=len(lost),
                       duplicated=sum(n - 1 for n in mine.values() if n > 1),
                       unexpected=len(set(mine) - want), lost_sample=tuple(lost[:5]))


def file_entries(ledger: List[Dict[str, Any]], files: List[Tuple[str, "Counter[Tuple[str, int]]"]]) -> List[Dict[str, Any]]:
    """One entry per landed file of spilled records: its node, kind and landing time from the
    collector's ledger, its number of records counted from the file itself (`files`: (file id,
    its ids)). The ledger's own `records` counts a file's lines, and a sink's line is a whole batch."""
    by_id = {str(e.get("file_id")): e for e in ledger}
    out = []
    for fid, ids in files:
        e = by_id.get(fid)
        if e is None:
            raise ValueError(f"landed file {fid[:12]} is not in the collector's ledger")
        out.append({"node": e.get("node"), "kind": e.get("kind"), "landed_at": float(e.get("landed_at", 0.0)),
                    "records": sum(ids.values()), "file_id": fid})
    return out


def backlog_landed_after(entries: List[Dict[str, Any]], nodes: Iterable[str], recorded_at_heal: int,
                         healed_at: float) -> Optional[float]:
    """Seconds after the heal until the centre's ledger held as many of the site's spilled records
    as its sinks had recorded by the heal (the backlog of the cut), or None if it never did.
    `entries`: the collector's ledger lines (`landed_at` wall time, `records`, `node`, `kind`)."""
    names = set(nodes)
    total = 0
    for e in sorted(entries, key=lambda e: float(e.get("landed_at", 0.0))):
        if e.get("node") in names and e.get("kind") in SPILLED_KINDS:
            total += int(e.get("records", 0))
            if total >= recorded_at_heal:
                return max(0.0, float(e["landed_at"]) - healed_at)
    return None


def landed_between(entries: List[Dict[str, Any]], nodes: Iterable[str], start: float, end: float) -> int:
    """Spilled records of these nodes that landed at the centre with start <= landed_at < end."""
    names = set(nodes)
    return sum(int(e.get("records", 0)) for e in entries
               if e.get("node") in names and e.get("kind") in SPILLED_KINDS
               and start <= float(e.get("landed_at", 0.0)) < end)


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def verdict(landing: Dict[str, SiteLanding], cut_site: str, processed_during_cut: int, max_in_zone_during_cut: int,
            landed_from_cut_site_during_cut: int, broker_reached_centre_during_cut: bool,
            nodes_reached_broker_during_cut: bool, spool_peak_bytes: int, spool_cap_bytes: int,
            spool_files_left: int) -> List[Check]:
    """Each claim of the uplink-cut run as a check that a wrong run fails.

    The spill crossing the uplink during the cut (`landed_from_cut_site_during_cut` > 0) means the
    partition did not cut the uplink, and a site that stops processing or scaling while its centre
    is away is what sites are there to prevent."""
    checks = []
    for site, s in sorted(landing.items()):
        ok = s.expected > 0 and s.lost == 0 and s.duplicated == 0 and s.unexpected == 0 and s.landed == s.expected
        checks.append(Check(f"{site}: every record landed once", ok,
                            f"{s.landed}/{s.expected} landed, {s.lost} lost, {s.duplicated} duplicated, "
                            f"{s.unexpected} unexpected" + (f", lost e.g. {list(s.lost_sample)}" if s.lost else "")))
    checks.append(Check(f"{cut_site}: uplink really cut", not broker_reached_centre_during_cut
                        and landed_from_cut_site_during_cut == 0,
                        f"site broker reached the centre: {broker_reached_centre_during_cut}; records landed "
                        f"from the site during the cut: {landed_from_cut_site_during_cut}"))
    checks.append(Check(f"{cut_site}: nodes reached their broker", nodes_reached_broker_during_cut,
                        f"during the cut: {nodes_reached_broker_during_cut}"))
    checks.append(Check(f"{cut_site}: kept processing", processed_during_cut > 0,
                        f"{processed_during_cut} records recorded by its sinks during the cut"))
    checks.append(Check(f"{cut_site}: kept scaling", max_in_zone_during_cut >= 2,
                        f"in_zone up to {max_in_zone_during_cut} instances during the cut"))
    checks.append(Check("spool bounded", 0 <= spool_peak_bytes < spool_cap_bytes,
                        f"peak {spool_peak_bytes} bytes on one node, cap {spool_cap_bytes}"))
    checks.append(Check("spool empty after landing", spool_files_left == 0,
                        f"{spool_files_left} closed files not shipped"))
    return checks


def table(summary: Dict[str, Any]) -> str:
    """The run as a text table: per site, then the checks."""
    rows = [("site", "expected", "landed once", "lost", "duplicated", "during cut", "in_zone max", "spool peak")]
    for site, s in sorted(summary["landing"].items()):
        d = summary["sites"][site]
        rows.append((site + (" (cut)" if site == summary["cut_site"] else ""), str(s["expected"]), str(s["landed"]),
                     str(s["lost"]), str(s["duplicated"]), str(d["processed_during_cut"]),
                     str(d["max_in_zone_during_cut"]), f"{d['spool_peak_bytes'] / 1e6:.1f} MB"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    out.append("")
    out.append(f"cut {summary['cut_seconds']:g} s of {summary['cut_site']}'s uplink "
               f"({summary.get('cut_kind', 'link down')}); backlog landed "
               f"{summary['backlog_landed_after_heal_s']} s after the heal; all landed "
               f"{summary['all_landed_after_heal_s']} s after the heal")
    for c in summary["checks"]:
        out.append(f"{'ok  ' if c['ok'] else 'FAIL'} {c['name']}: {c['detail']}")
    out.append("verdict: " + ("OK" if summary["ok"] else "FAILED"))
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# The host side.


def _sh(run: Path, node: str, command: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return testbed.ssh(node, command, run=run, check=False, timeout=timeout)


def _recorded(run: Path, site: Site, sink_dir: str) -> int:
    """Record ids the site's sinks have recorded so far (lines of their ids files)."""
    total = 0
    for n in site.nodes:
        out = _sh(run, n, f"cat {sink_dir}/*.ids 2>/dev/null | wc -l").stdout.strip()
        total += int(out or 0)
    return total


def _spool(run: Path, node: str) -> Tuple[int, int]:
    """(bytes under the node's spool, files of it not shipped yet: every closed file, and the
    sinks' open files; the agent's own open metrics/events file is always there and not counted)."""
    out = _sh(run, node, f"du -sb {SPOOL} 2>/dev/null | cut -f1; find {SPOOL} -type f \\( -path '*/closed/*' -o "
              f"-path '*/open/*' \\) ! -path '{SPOOL}/_agent/open/*' 2>/dev/null | wc -l").stdout.split()
    return (int(out[0]), int(out[1])) if len(out) == 2 else (0, 0)


def _reaches(run: Path, node: str, address: str, port: int) -> bool:
    return _sh(run, node, f"timeout 3 bash -c '</dev/tcp/{address}/{port}'", timeout=20).returncode == 0


def _ledger(run: Path, central: str) -> List[Dict[str, Any]]:
    out = _sh(run, central, f"cat {LANDING}/_ledger.jsonl 2>/dev/null", timeout=60).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def _landed_files(run: Path, central: str) -> List[Tuple[str, "Counter[Tuple[str, int]]"]]:
    """Every landed file of spilled records in the centre's landing zone: (file id, its record ids
    with how often each occurs)."""
    import gzip

    state = testbed.load_state(run=run)
    assert state is not None
    address = next(str(n["address"]) for n in state.nodes if n["name"] == central)
    cmd = f"cd {LANDING} && tar -cf - $(ls -d {' '.join('kind=' + k for k in SPILLED_KINDS)} 2>/dev/null)"
    proc = subprocess.run(testbed.ssh_argv(address, run / "id_ed25519", run / "known_hosts", cmd),
                          capture_output=True, timeout=600)
    files: List[Tuple[str, "Counter[Tuple[str, int]]"]] = []
    if not proc.stdout:
        return files
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
        for m in tar.getmembers():
            if m.isfile() and m.name.endswith(".jsonl.gz"):
                f = tar.extractfile(m)
                assert f is not None
                files.append((Path(m.name).name[: -len(".jsonl.gz")], count_ids(gzip.decompress(f.read()).splitlines())))
    return files


def _in_zone(broker: str, password: str, pipeline: str) -> int:
    try:
        topo = testbed_pipeline._fogctl(broker, password, "topology", timeout=60)
    except (testbed.TestbedError, subprocess.TimeoutExpired, ValueError):
        return 0
    return sum(testbed_pipeline.placement(topo, pipeline).get("in_zone", {}).values())


def _spool_cap(run: Path, node: str) -> int:
    out = _sh(run, node, "sed -n '/^\\[spill\\]/,/^\\[/p' /etc/fog-agent/agent.toml | grep '^max_bytes'").stdout
    return int(out.split("=")[1]) if "=" in out else 0


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def run_uplink_cut(cut_seconds: float = 300.0, site: Optional[str] = None, cut_at: float = 40.0, after: float = 60.0,
                   rate: float = 200.0, land_timeout: float = 600.0, run: Optional[Path] = None,
                   sample_every: float = 15.0, silent: bool = False,
                   progress: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """Run the pipelines, cut `site`'s uplink from `cut_at` for `cut_seconds`, heal, wait for the
    spill to land, count every record at the centre; returns the summary with `checks` and `ok`."""
    progress = progress or (lambda line: print(f"uplink-cut: {line}", file=sys.stderr, flush=True))
    if cut_seconds <= 0 or cut_at < 0 or after < 0 or rate <= 0:
        raise ValueError("--cut-seconds and --rate must be positive, --cut-at and --after not negative")
    run = run or testbed.run_dir(testbed.cache_dir())
    layout: Layout = load_layout(run)
    state = testbed.load_state(run=run)
    if state is None or not state.admin_password:
        raise testbed.TestbedError("no testbed with an inventory is up: run `fog-agent testbed up --sites` and Ansible first")
    names = [s.name for s in layout.sites]
    if site is None:
        cut = layout.sites[0]
    elif site in names:
        cut = next(s for s in layout.sites if s.name == site)
    else:
        raise ValueError(f"--site {site}: expected one of {', '.join(names)}")
    address = {str(n["name"]): str(n["address"]) for n in state.nodes}
    central_address = address[layout.central]
    password = state.admin_password
    duration = cut_at + cut_seconds + after
    stamp = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    sink_dirs = {s.name: f"{testbed_pipeline.STATE_DIR}/testbed-runs/{stamp}-{s.name}" for s in layout.sites}
    # A pipeline name of this run per site: the sources are seeded, so a previous run's records at
    # the centre would otherwise have the same ids and count as duplicates.
    pipelines = {s.name: f"tb{s.name}x{stamp[-6:]}" for s in layout.sites}
    brokers = {s.name: f"{address[s.broker]}:1883" for s in layout.sites}
    cap = _spool_cap(run, cut.broker)
    if not _reaches(run, cut.broker, central_address, CENTRAL_PORT):
        raise testbed.TestbedError(f"{cut.broker} cannot reach the central broker {central_address}:{CENTRAL_PORT} "
                                   "before the cut: is site.yml installed?")
    timeline: Dict[str, Any] = {"samples": []}
    per_site: Dict[str, Dict[str, Any]] = {s.name: {"spool_peak_bytes": 0, "max_in_zone_during_cut": 0}
                                           for s in layout.sites}

    def sample(t_cut: float) -> None:
        row: Dict[str, Any] = {"t_s": round(time.time() - t_cut, 1)}
        for s in layout.sites:
            spools = [_spool(run, n) for n in s.nodes]
            peak = max(b for b, _ in spools)
            inz = _in_zone(brokers[s.name], password, pipelines[s.name])
            per_site[s.name]["spool_peak_bytes"] = max(per_site[s.name]["spool_peak_bytes"], peak)
            per_site[s.name]["max_in_zone_during_cut"] = max(per_site[s.name]["max_in_zone_during_cut"], inz)
            row[s.name] = {"recorded": _recorded(run, s, sink_dirs[s.name]), "in_zone": inz,
                           "spool_bytes": [b for b, _ in spools], "unshipped_files": sum(f for _, f in spools)}
        timeline["samples"].append(row)
        progress(f"cut t={row['t_s']:.0f} s " + "  ".join(
            f"{s.name}: recorded {row[s.name]['recorded']} in_zone {row[s.name]['in_zone']} "
            f"unshipped files {row[s.name]['unshipped_files']}" for s in layout.sites))

    def schedule() -> int:
        """The cut: what `during` of the cut site's pipeline runs, `cut_at` s after its deploy."""
        before = {s.name: _recorded(run, s, sink_dirs[s.name]) for s in layout.sites}
        testbed.partition(cut.broker, cut=True, run=run, uplink=True, silent=silent)
        t_cut = time.time()
        timeline.update(cut_at=t_cut, recorded_at_cut=before)
        progress(f"cut {cut.name}'s uplink ({cut.broker} -> {layout.central}) for {cut_seconds:g} s")
        try:
            timeline["broker_reached_centre_during_cut"] = _reaches(run, cut.broker, central_address, CENTRAL_PORT)
            timeline["nodes_reached_broker_during_cut"] = all(
                _reaches(run, n, address[cut.broker], 1883) for n in cut.nodes[1:]) if len(cut.nodes) > 1 else True
            while time.time() - t_cut < cut_seconds:
                sample(t_cut)
                time.sleep(max(0.0, min(sample_every, cut_seconds - (time.time() - t_cut))))
        finally:
            testbed.partition(cut.broker, cut=False, run=run, uplink=True, silent=silent)
        t_heal = time.time()
        timeline.update(healed_at=t_heal,
                        recorded_at_heal={s.name: _recorded(run, s, sink_dirs[s.name]) for s in layout.sites})
        progress(f"healed {cut.name}'s uplink after {t_heal - t_cut:.0f} s")
        return 0

    results: Dict[str, Dict[str, Any]] = {}
    errors: Dict[str, str] = {}
    keep = Path(tempfile.mkdtemp(prefix="fog-uplink-"))

    def one(s: Site) -> None:
        try:
            results[s.name] = testbed_pipeline.run_pipeline(
                duration, rate, run=run, keep=keep / s.name, during=schedule if s is cut else None,
                during_at=cut_at, broker=brokers[s.name], names=list(s.nodes), name=pipelines[s.name],
                sink_dir=sink_dirs[s.name], settle_timeout=180.0,
                progress=lambda line, n=s.name: progress(f"{n}: {line}"))
        except Exception as exc:  # noqa: BLE001 - reported, the other site's run goes on
            errors[s.name] = f"{type(exc).__name__}: {exc}"

    started = time.time()
    threads = [threading.Thread(target=one, args=(s,), name=f"uplink-{s.name}") for s in layout.sites]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise testbed.TestbedError("; ".join(f"{k}: {v}" for k, v in sorted(errors.items())))
    if "healed_at" not in timeline:
        raise testbed.TestbedError(f"the cut never ran: {results[cut.name].get('during')}")
    # Wait until every site node has shipped everything (no spool file of a sink left, closed or
    # open) and the centre's ledger stopped growing.
    deadline = time.time() + land_timeout
    previous = -1
    while True:
        ledger = _ledger(run, layout.central)
        waiting = sum(_spool(run, n)[1] for s in layout.sites for n in s.nodes)
        progress(f"landing: {len(ledger)} files in the centre's ledger; {waiting} spool files still on the sites")
        if waiting == 0 and len(ledger) == previous:
            break
        if time.time() > deadline:
            progress(f"landing: gave up after {land_timeout:g} s")
            break
        previous = len(ledger)
        time.sleep(10.0)
    # This run's files only: the landing zone keeps earlier runs' files (all landed before this
    # run started: each run waits for its own landing).
    ledger_all = _ledger(run, layout.central)
    since = {str(e.get("file_id")) for e in ledger_all if float(e.get("landed_at", 0.0)) >= started}
    files = [(fid, ids) for fid, ids in _landed_files(run, layout.central) if fid in since]
    ledger = file_entries(ledger_all, files)
    counts: "Counter[Tuple[str, int]]" = Counter()
    for _, ids in files:
        counts.update(ids)
    from agent.config import load_pipeline_text
    from foglab.tools.verify import expected_ids, source_counts

    landing: Dict[str, SiteLanding] = {}
    for s in layout.sites:
        cfg = load_pipeline_text((keep / s.name / "tb.toml").read_text(), "tb.toml")
        landing[s.name] = site_landing(expected_ids(cfg, source_counts(keep / s.name)), counts)
    t_cut, t_heal = float(timeline["cut_at"]), float(timeline["healed_at"])
    recorded_at_heal = int(timeline["recorded_at_heal"][cut.name])
    backlog = backlog_landed_after(ledger, cut.nodes, recorded_at_heal, t_heal)
    last = max((float(e["landed_at"]) for e in ledger if e.get("node") in cut.nodes
                and e.get("kind") in SPILLED_KINDS), default=None)
    during_cut_landed = landed_between(ledger, cut.nodes, t_cut + 5.0, t_heal)  # 5 s: a file already in flight
    files_left = sum(_spool(run, n)[1] for s in layout.sites for n in s.nodes)
    for s in layout.sites:
        d = per_site[s.name]
        d["processed_during_cut"] = int(timeline["recorded_at_heal"][s.name]) - int(timeline["recorded_at_cut"][s.name])
        d["pipeline"] = {k: results[s.name][k] for k in ("generated", "expected", "received", "lost", "duplicated",
                                                        "unexpected", "max_instances", "nodes_per_operator", "ok")}
        d["landed_during_cut"] = landed_between(ledger, s.nodes, t_cut + 5.0, t_heal)
    checks = verdict(landing, cut.name, per_site[cut.name]["processed_during_cut"],
                     per_site[cut.name]["max_in_zone_during_cut"], during_cut_landed,
                     bool(timeline.get("broker_reached_centre_during_cut")),
                     bool(timeline.get("nodes_reached_broker_during_cut")),
                     max(d["spool_peak_bytes"] for d in per_site.values()), cap, files_left)
    return {"cut_site": cut.name, "cut_broker": cut.broker, "cut_kind": "silent" if silent else "link down", "cut_seconds": round(t_heal - t_cut, 1),
            "cut_at_s": round(t_cut - started, 1), "duration_s": duration, "rate": rate,
            "backlog_landed_after_heal_s": None if backlog is None else round(backlog, 1),
            "all_landed_after_heal_s": None if last is None else round(last - t_heal, 1),
            "started_utc": _utc(started), "cut_utc": _utc(t_cut), "healed_utc": _utc(t_heal),
            "recorded_at_cut": timeline["recorded_at_cut"], "recorded_at_heal": timeline["recorded_at_heal"],
            "files_landed": len(files), "spool_cap_bytes": cap, "spool_files_left": files_left,
            "landing": {k: asdict(v) for k, v in landing.items()}, "sites": per_site,
            "samples": timeline["samples"], "checks": [asdict(c) for c in checks],
            "ok": all(c.ok for c in checks), "seconds": round(time.time() - started, 1), "kept": str(keep)}
