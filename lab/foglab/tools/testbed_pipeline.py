"""The taxi pipeline on the testbed's containers, every record accounted for (docs/operations.md, "Testbed").

The agents are the ones Ansible installed (the .deb, under systemd); this module only acts as an
administrator would: a deploy through the site broker with the administrator's password (the
specs' `extra.sink_dir` is a directory of this run under the agents' state dir), `fogctl topology`
every few seconds (which container hosts which instance), `fogctl undeploy` once the sources have
stopped and the sinks are quiet; then it copies each node's source positions and sink id files
(`<sink_dir>/*.source.json`, `*.ids`) to the host and runs the demo's exactly-once verifier
(`foglab.tools.verify.verify`) over all of them.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

from agent.config import load_pipeline_text
from foglab.tools import testbed
from agent.node.deploy import deploy
from agent.signing import load_signer
from foglab.tools.verify import verify

STATE_DIR = "/var/lib/fog-agent"

PIPELINE = """
[pipeline]
name = "{name}"
coordination = "ack"

[scaling]
policy = "decentralized"
period = 2.0
capacity = 500.0

[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
[operator.params]
seed = 7
profile = "steps"
steps = [[0, {base}], [{t1}, {rate}], [{t2}, {base}], [{t3}, 0]]

[[operator]]
name = "validate"
function = "agent.operators.builtin:validate"

[[operator]]
name = "in_zone"
function = "agent.operators.builtin:in_zone"
service_time_ms = {service_ms}
[operator.scaling]
capacity = {capacity}
period = 2.0

[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""


def pipeline_text(duration: float, rate: float, service_ms: float = 5.0, base: float = 80.0,
                  name: str = "tb") -> str:
    """A load step from `base` rec/s to `rate` for the middle of `duration`, then the source stops.

    in_zone's capacity (1000 / service_ms rec/s) is below `rate`, so the step must be absorbed by
    scaling out, and the slots of one node (4) are not enough for every instance: the extra
    instances land on other containers."""
    t1, t2 = round(duration * 0.15, 1), round(duration * 0.75, 1)
    return PIPELINE.format(t1=t1, t2=t2, t3=round(duration, 1), rate=rate, service_ms=service_ms,
                           capacity=round(1000.0 / service_ms, 1), base=base, name=name)


class _During:
    """What runs beside the pipeline: a shell command on the host, or a function of this process
    (a fault schedule, an upgrade) in a thread; `poll()` is None while it runs, then its status."""

    def __init__(self, during: Union[str, Callable[[], int]], log: Optional[Path] = None) -> None:
        self.label = during if isinstance(during, str) else getattr(during, "__name__", "function")
        self.error: Optional[str] = None
        self.log = log
        self._proc: Optional[subprocess.Popen] = None
        self._status: Optional[int] = None
        if isinstance(during, str):
            if log is None:
                self._proc = subprocess.Popen(during, shell=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                return
            # its output is kept in the run's directory: a rolling playbook that failed is read there
            with open(log, "ab") as out:
                self._proc = subprocess.Popen(during, shell=True, stdout=out, stderr=subprocess.STDOUT)
            return

        def body() -> None:
            try:
                self._status = int(during())
            except Exception as exc:  # noqa: BLE001 - reported in the summary, the pipeline still ends
                self.error = f"{type(exc).__name__}: {exc}"
                self._status = 1
        self._thread = threading.Thread(target=body, name="testbed-during", daemon=True)
        self._thread.start()

    def poll(self) -> Optional[int]:
        if self._proc is not None:
            return self._proc.poll()
        return None if self._thread.is_alive() else self._status


def _fogctl(broker: str, password: str, *args: str, timeout: float = 120) -> Dict[str, Any]:
    cmd = [sys.executable, "-c", "import sys; from agent.cli.fogctl import main; sys.exit(main())",
           "--broker", broker, "--cluster", "testbed", "-u", "fogctl-admin", "-P", password, "--json", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise testbed.TestbedError(f"fogctl {args[0]} exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return json.loads(proc.stdout) if proc.stdout.strip() else {}


def placement(topology: Dict[str, Any], pipeline: str) -> Dict[str, Dict[str, int]]:
    """{operator: {node: instances}} of one pipeline in a `fogctl topology --json` document."""
    out: Dict[str, Dict[str, int]] = {}
    for p in topology.get("pipelines", []):
        if p.get("pipeline") != pipeline:
            continue
        for op in p.get("operators", []):
            nodes: Dict[str, int] = {}
            for inst in op.get("instances", []):
                nodes[inst["node"]] = nodes.get(inst["node"], 0) + 1
            out[op["operator"]] = nodes
    return out


def _sink_fingerprint(run: Optional[Path], names: List[str], sink_dir: str) -> str:
    return "|".join(testbed.ssh(n, f"cd {sink_dir} 2>/dev/null && cat *.source.json 2>/dev/null; wc -c *.ids 2>/dev/null | tail -1",
                                run=run, check=False).stdout for n in names)


def _collect(run: Optional[Path], names: List[str], sink_dir: str, into: Path) -> Tuple[Dict[str, int], Dict[str, List[str]]]:
    """Copy each node's source positions and sink ids into one directory.

    An instance that ran on two nodes (a re-home, or a spawn answered late and placed again) left
    a file on each: they are concatenated, so that the verifier sees every id it recorded
    anywhere. Returns the files per node and {file: nodes} for those found on several nodes."""
    files: Dict[str, int] = {}
    where: Dict[str, List[str]] = {}
    for name in names:
        proc = subprocess.run(
            testbed.ssh_argv(_address(run, name), _key(run), _known(run),
                             f"cd {sink_dir} 2>/dev/null && tar -cf - $(ls *.source.json *.ids 2>/dev/null)"),
            capture_output=True, timeout=120)
        if not proc.stdout:
            files[name] = 0
            continue
        with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and "/" not in m.name]
            for m in members:
                extracted = tar.extractfile(m)
                assert extracted is not None
                data = extracted.read()
                where.setdefault(m.name, []).append(name)
                if m.name.endswith(".source.json") and (into / m.name).exists():
                    # a source that moved: its position file with the most records generated is the last
                    old = json.loads((into / m.name).read_text()).get("generated", 0)
                    if json.loads(data).get("generated", 0) < old:
                        continue
                mode = "ab" if m.name.endswith(".ids") else "wb"
                with open(into / m.name, mode) as fh:
                    if mode == "ab" and fh.tell() > 0 and not data.startswith(b"\n"):
                        fh.write(b"\n")
                    fh.write(data)
            files[name] = len(members)
    return files, {f: nodes for f, nodes in where.items() if len(nodes) > 1}


def _run_dir(run: Optional[Path]) -> Path:
    return run or testbed.run_dir(testbed.cache_dir())


def _address(run: Optional[Path], name: str) -> str:
    state = testbed.load_state(run=_run_dir(run))
    assert state is not None
    return str(next(n["address"] for n in state.nodes if n["name"] == name))


def _key(run: Optional[Path]) -> Path:
    return _run_dir(run) / "id_ed25519"


def _known(run: Optional[Path]) -> Path:
    return _run_dir(run) / "known_hosts"


def run_pipeline(duration: float = 60.0, rate: float = 500.0, run: Optional[Path] = None,
                 progress: Callable[[str], None] = lambda line: print(f"testbed: {line}", file=sys.stderr),
                 settle_timeout: float = 90.0, keep: Optional[Path] = None,
                 during: Union[str, Callable[[], int], None] = None, during_at: float = 10.0,
                 service_ms: float = 5.0, base: float = 80.0, broker: Optional[str] = None,
                 names: Optional[List[str]] = None, name: str = "tb", sink_dir: Optional[str] = None) -> Dict[str, Any]:
    """Deploy, follow, undeploy, verify; `keep`: a directory that gets the collected files.

    `broker` ("host:port"), `names`, `name`, `sink_dir`: one site of a sites testbed (its broker,
    its nodes, a pipeline name of its own so that record ids differ between sites, and where its
    sinks write); default: the first node's broker, every node, "tb", a fresh directory.

    `during`: a shell command run on the host `during_at` seconds after the deploy (e.g. a rolling
    `ansible-playbook` run), or a function run in a thread then (returning an exit status); the
    pipeline is not undeployed before it has finished, and its exit status and time window go
    into the summary."""
    state = testbed.load_state(run=_run_dir(run))
    if state is None or not state.admin_password:
        raise testbed.TestbedError("no testbed with an inventory is up: run `fog-agent testbed up` and Ansible first")
    names = names or [str(n["name"]) for n in state.nodes]
    broker = broker or f"{state.nodes[0]['address']}:1883"
    text = pipeline_text(duration, rate, service_ms, base, name)
    cfg = load_pipeline_text(text, "testbed.toml")
    name = cfg.pipeline.name
    # A sink directory of this run under the agents' state dir (allowed without configuration):
    # instance ids repeat across runs, so a previous run's files would count twice.
    sink_dir = sink_dir or f"{STATE_DIR}/testbed-runs/{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory(prefix="fog-testbed-") as tmp:
        started = time.monotonic()
        host, port = broker.rsplit(":", 1)
        # Signed with the admin key the fog_agent role generated next to the inventory (the nodes
        # run only signed pipelines, docs/security.md); none there: the role was told not to sign.
        key = Path(state.inventory).parent / "admin-sign.key" if state.inventory else None
        signer = load_signer(key) if key is not None and key.exists() else None
        placed = deploy(text, host, int(port), "testbed", extra={"sink_dir": sink_dir}, username="fogctl-admin",
                        password=state.admin_password, name=f"{name}.toml", timeout=60.0, signer=signer)
        progress(f"deployed {name} (sink_dir {sink_dir}): " + ", ".join(f"{d.instance}@{d.node}" for d in placed))
        seen: Dict[str, Set[str]] = {}
        max_instances: Dict[str, int] = {}
        last, quiet_since = "", None
        side: Optional[_During] = None
        side_window: Dict[str, Any] = {}
        try:
            while True:
                time.sleep(3.0)
                now = time.monotonic() - started
                if during and side is None and now >= during_at:
                    side = _During(during, _run_dir(run) / f"during-{time.strftime('%Y%m%dT%H%M%S')}.log")
                    side_window["started_s"] = round(now, 1)
                    if isinstance(during, str):
                        side_window["log"] = str(side.log)
                    progress(f"t={now:5.0f} s  started: {side.label}")
                status = side.poll() if side is not None and "exit" not in side_window else None
                if side is not None and status is not None:
                    side_window.update(exit=status, ended_s=round(now, 1))
                    if side.error:
                        side_window["error"] = side.error
                    progress(f"t={now:5.0f} s  finished with exit {status}: {side.label}")
                where = placement(_fogctl(broker, state.admin_password, "topology"), name)
                for op, nodes in where.items():
                    seen.setdefault(op, set()).update(nodes)
                    max_instances[op] = max(max_instances.get(op, 0), sum(nodes.values()))
                progress(f"t={now:5.0f} s  " + "  ".join(f"{op}={dict(sorted(n.items()))}" for op, n in where.items()))
                if now < duration:
                    continue
                fp = _sink_fingerprint(run, names, sink_dir)
                quiet_since = (quiet_since or now) if fp == last else None
                last = fp
                if side is not None and "exit" not in side_window:
                    continue
                if quiet_since is not None and now - quiet_since >= 6.0 or now > duration + settle_timeout:
                    break
        finally:
            # Also after a failure or Ctrl-C: the pipeline must not keep running on the fleet.
            _fogctl(broker, state.admin_password, "undeploy", name)
        time.sleep(2.0)
        out = Path(tmp) / "sink"
        out.mkdir()
        files, on_several = _collect(run, names, sink_dir, out)
        verdict = verify(cfg, out)
        if keep is not None:
            shutil.copytree(out, keep, dirs_exist_ok=True)
            (keep / "tb.toml").write_text(text)
    return {"nodes": names, "sink_dir": sink_dir, "during": dict(side_window, command=side.label if side else str(during)) if during else None, "duration_s": duration, "peak_rate": rate,
            "nodes_per_operator": {op: sorted(n) for op, n in seen.items()}, "max_instances": max_instances,
            "files_per_node": files, "files_on_several_nodes": on_several, "generated": verdict.generated, "expected": verdict.expected,
            "received": verdict.received, "lost": verdict.lost, "duplicated": verdict.duplicated,
            "unexpected": verdict.unexpected, "lost_sample": [list(x) for x in verdict.lost_sample],
            "ok": verdict.ok, "seconds": round(time.monotonic() - started, 1)}
