"""`fog-agent dev up|status|down`: a private broker and N local agents that outlive the command.

Why: trying a pipeline locally meant writing a broker config and one agent.toml per node by hand
(the examples are production TLS; a Mosquitto started as root switches to the `mosquitto` user and
then cannot write its log or persistence under the user's directory), and then telling fogctl the
broker again in a file of its own. `dev up` writes every file under one directory (DIR):

    DIR/dev.json               what `up` started (port, cluster, nodes): `status` and `down` read it
    DIR/env                    `. DIR/env` points fogctl, `fog-agent deploy` and `dev` at this fleet
    DIR/fogctl.toml            fogctl's settings (plain MQTT on loopback, cluster `dev`)
    DIR/broker/                mosquitto.conf, mosquitto.log, mosquitto.db, mosquitto.pid
    DIR/<node>/                agent.toml, agent.log, agent.pid, state/ (the agent's state_dir)
    DIR/sink/                  a sink directory every agent admits (`--set sink_dir=DIR/sink`)
    DIR/admin-sign.key(.pub)   the fleet's throwaway admin key: agents run only pipelines it signed,
                               fogctl and `fog-agent deploy` sign with it (fogctl.toml, env)

Unlike `fog-agent demo` (foglab.tools.demo.Fleet), whose processes end with the command, these run
detached (a session of their own, stdin closed, output in their log), so the user deploys,
publishes and watches from the same shell afterwards; `down` ends them by their pid files. A pid is
signalled only while its command line still names this fleet's file (a pid file outlives its
process and pids are reused), and `down` checks that no process is left in the process groups of
what it started (an agent's workers are in its group).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import agent
from agent.schema import identifier

__all__ = [
    "DevError", "DevFleet", "agent_toml", "broker_conf", "default_dir", "down", "env_text", "fogctl_toml",
    "status", "up",
]

ROOT = Path(agent.__file__).resolve().parents[1]  # the checkout (or site-packages when installed)
EXAMPLE_OPS = ROOT / "examples" / "operators"  # fog_example_ops, the operators of examples/operators/pipeline.toml
EXAMPLE_MODULE = "fog_example_ops.ops"
HOST = "127.0.0.1"
ADMIN_KEY = "admin-sign.key"  # the dev fleet's throwaway admin key (and .pub) in DIR
DEFAULT_AGENTS = 3
MAX_AGENTS = 32
DEFAULT_CLUSTER = "dev"
SLOTS = 4
ONLINE_BOUND = 120.0  # against a hang only: an agent starting on loaded shared cores took over 30 s
AGENT_STOP_BOUND = 15.0  # the agent's shutdown_timeout (10 s) + 5 s, as Fleet.stop allows
BROKER_STOP_BOUND = 10.0
STATE_FILE = "dev.json"


class DevError(RuntimeError):
    """One line for the user: what is wrong and what to do."""


# ---- the files (pure: text in, text out) ---------------------------------------------------------


def _q(text: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's)."""
    return json.dumps(text)


def agent_toml(node: str, cluster: str, port: int, directory: Path, modules: Sequence[str] = (),
               slots: int = SLOTS) -> str:
    """One local agent: plain MQTT on loopback, state and sinks under DIR, no metrics port (N
    agents on one machine cannot share 9108), state every second so `fogctl status` is fresh."""
    mods = ", ".join(_q(m) for m in modules)
    return f"""\
# A local agent of `fog-agent dev up` (plain MQTT on loopback; examples/agent.toml is a node's file).
[agent]
node = {_q(node)}
cluster = {_q(cluster)}
slots = {slots}
state_dir = {_q(str(directory / node / "state"))}
sink_dirs = [{_q(str(directory / "sink"))}]
state_period = 1.0
heartbeat_period = 1.0

[operators]
modules = [{mods}]

[mqtt]
host = {_q(HOST)}
port = {port}

[metrics]
port = 0

# Pipelines signed by the fleet's throwaway admin key only (DIR/admin-sign.key; docs/security.md)
[security]
admin_keys = [{_q(str(directory / ADMIN_KEY) + ".pub")}]
"""


def broker_conf(directory: Path, port: int, user: str) -> str:
    """The broker of foglab.tools.broker (queue limit, $SYS every second), every file under
    DIR/broker, and `user` = the user running `dev up`: as root, Mosquitto otherwise becomes the
    `mosquitto` user, which cannot write the log or the persistence file there."""
    from foglab.tools.broker import BROKER_CONF

    b = directory / "broker"
    return BROKER_CONF.format(port=port, user=user, persistence="true", dir=b, log=b / "mosquitto.log",
                              max_queued=10000, max_inflight=100)


def fogctl_toml(port: int, cluster: str, directory: Path) -> str:
    return f"""\
# fogctl's settings for the fleet of `fog-agent dev up`: fogctl --config THIS_FILE status
broker = {_q(f"{HOST}:{port}")}
cluster = {_q(cluster)}
sign_key = {_q(str(directory / ADMIN_KEY))}
"""


def env_text(directory: Path, port: int, nodes: Sequence[str], pythonpath: str = "") -> str:
    """Shell lines that point both CLIs at the fleet: fogctl reads $FOGCTL_CONFIG, `fog-agent
    deploy` takes broker and cluster from $FOG_AGENT_CONFIG (any agent.toml of the fleet), `dev
    status|down` find DIR in $FOG_DEV_DIR, and mosquitto_pub/sub take -p "$FOG_DEV_PORT".
    `pythonpath`: the agents' PYTHONPATH (`agent_env`), so that `fog-agent check-config` and
    `deploy`, which import the functions the agent.toml allows, find the modules the agents run
    (fog_example_ops from examples/operators, the user's --allow modules)."""
    path = f"export PYTHONPATH={_sh(pythonpath)}\n" if pythonpath else ""
    return (f"# . {directory / 'env'}   (sh, bash, zsh): point fogctl and fog-agent at the dev fleet\n"
            f"export FOGCTL_CONFIG={_sh(str(directory / 'fogctl.toml'))}\n"
            f"export FOG_AGENT_CONFIG={_sh(str(directory / nodes[0] / 'agent.toml'))}\n"
            f"export FOG_DEV_DIR={_sh(str(directory))}\n"
            f"export FOG_DEV_PORT={port}\n"
            f"export FOG_AGENT_SIGN_KEY={_sh(str(directory / ADMIN_KEY))}\n" + path)


def _sh(text: str) -> str:
    import shlex

    return shlex.quote(text)


def default_dir(env: Optional[Mapping[str, str]] = None) -> Path:
    """$FOG_DEV_DIR, else /tmp/fog-dev-<user>: the same from any working directory, so `dev
    status` and `dev down` need no option, and one per user (root and a plain user side by side)."""
    env = os.environ if env is None else env
    if env.get("FOG_DEV_DIR"):
        return Path(env["FOG_DEV_DIR"])
    return Path(tempfile.gettempdir()) / f"fog-dev-{_user()}"


def _user() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:  # a uid without a passwd entry (a container's arbitrary user)
        return str(os.geteuid())


# ---- processes -------------------------------------------------------------------------------------


def _proc_stat(pid: int) -> Optional[Tuple[str, int]]:
    """(state letter, process group) of a live pid from /proc, None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2:].split()
    return fields[0], int(fields[2])


def _alive(pid: Optional[int], marker: str) -> bool:
    """`pid` runs (not a zombie) and its command line names `marker` (this fleet's file): a pid
    file outlives its process, and the kernel reuses pids."""
    if not pid:
        return False
    st = _proc_stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return marker in cmdline


def _group_members(pgids: Sequence[int]) -> List[int]:
    """Live (non-zombie) processes in these process groups: what `down` must leave none of."""
    want = set(pgids)
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        st = _proc_stat(int(entry.name))
        if st is not None and st[1] in want and st[0] not in ("Z", "X"):
            out.append(int(entry.name))
    return sorted(out)


def _read_pid(path: Path) -> Optional[int]:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Mosquitto binds: TIME_WAIT is no obstacle
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


# ---- the fleet's record ----------------------------------------------------------------------------


@dataclass
class DevFleet:
    """What `up` started in DIR: enough for `status` and `down` in another process."""

    directory: Path
    port: int
    cluster: str
    nodes: Tuple[str, ...]

    @property
    def broker_conf(self) -> Path:
        return self.directory / "broker" / "mosquitto.conf"

    @property
    def broker_pid_file(self) -> Path:
        return self.directory / "broker" / "mosquitto.pid"

    @property
    def fogctl_config(self) -> Path:
        return self.directory / "fogctl.toml"

    @property
    def env_file(self) -> Path:
        return self.directory / "env"

    def agent_conf(self, node: str) -> Path:
        return self.directory / node / "agent.toml"

    def agent_log(self, node: str) -> Path:
        return self.directory / node / "agent.log"

    def agent_pid_file(self, node: str) -> Path:
        return self.directory / node / "agent.pid"

    def broker_pid(self) -> Optional[int]:
        pid = _read_pid(self.broker_pid_file)
        return pid if _alive(pid, str(self.broker_conf)) else None

    def agent_pid(self, node: str) -> Optional[int]:
        pid = _read_pid(self.agent_pid_file(node))
        return pid if _alive(pid, str(self.agent_conf(node))) else None

    def running(self) -> Dict[str, Optional[int]]:
        """Every process of the fleet ("broker" and the nodes) -> its pid while it runs, else None."""
        out: Dict[str, Optional[int]] = {"broker": self.broker_pid()}
        out.update({n: self.agent_pid(n) for n in self.nodes})
        return out

    def save(self) -> None:
        doc = {"port": self.port, "cluster": self.cluster, "nodes": list(self.nodes)}
        (self.directory / STATE_FILE).write_text(json.dumps(doc, indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> Optional["DevFleet"]:
        path = directory / STATE_FILE
        try:
            doc = json.loads(path.read_text())
            return cls(directory, int(doc["port"]), str(doc["cluster"]), tuple(str(n) for n in doc["nodes"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DevError(f"{path} is not a dev fleet's record ({exc}): remove it, or choose another --dir")


# ---- up ----------------------------------------------------------------------------------------------


def _prepare_dir(directory: Path) -> None:
    """DIR must be ours: a new directory (0700), an empty one, or one `dev up` made before.
    Why so strict: `down --purge` removes DIR, and /tmp is shared by every user of the machine."""
    if directory.is_symlink():
        raise DevError(f"{directory} is a symbolic link: choose a plain directory with --dir")
    if directory.exists():
        if not directory.is_dir():
            raise DevError(f"{directory} exists and is not a directory: choose another --dir")
        if directory.stat().st_uid != os.geteuid():
            raise DevError(f"{directory} belongs to another user: choose another --dir")
        if any(directory.iterdir()) and not (directory / STATE_FILE).exists():
            raise DevError(f"{directory} is not empty and holds no dev fleet: choose a new or empty --dir")
        return
    try:
        directory.mkdir(parents=True, mode=0o700)
    except OSError as exc:
        raise DevError(f"cannot create {directory}: {exc.strerror or exc}") from None


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """One `up` or `down` at a time per DIR (two at once would start two brokers)."""
    with open(directory / ".lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise DevError(f"another `fog-agent dev up` or `down` is working in {directory}") from None
        yield


def agent_env(env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The agents' environment: this checkout first on PYTHONPATH (they run the code `dev up` runs),
    examples/operators (the example pipeline's operators), then the user's own PYTHONPATH (their
    modules, named with --allow)."""
    env = dict(os.environ if env is None else env)
    paths = [str(ROOT)] + ([str(EXAMPLE_OPS)] if (EXAMPLE_OPS / "fog_example_ops").is_dir() else [])
    paths += [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]  # agents run in DIR/<node>
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.pop("FOG_AGENT_CONFIG", None)  # each agent is told its file
    return env


def _spawn(argv: List[str], log: Path, cwd: Path, env: Optional[Dict[str, str]] = None) -> "subprocess.Popen[bytes]":
    """Detached: a session of its own (a Ctrl-C or a closed terminal does not reach it), stdin
    closed, output appended to `log`; it outlives the command that started it."""
    with open(log, "ab") as fh:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, cwd=str(cwd),
                                env=env, start_new_session=True)


def _validate(agents: int, cluster: str, allow: Sequence[str], directory: Path) -> None:
    from agent.refs import check_module_name

    if not 1 <= agents <= MAX_AGENTS:
        raise DevError(f"--agents takes 1 to {MAX_AGENTS}, found {agents}")
    bad = identifier(cluster)
    if bad:
        raise DevError(f"--cluster: {bad}, found {cluster!r}")
    for m in allow:
        why = check_module_name(m)
        if why:
            raise DevError(f"--allow {m!r}: {why}")
    if any(c.isspace() for c in str(directory)):
        # Mosquitto's config has no quoting: a path with a space cuts `log_dest file PATH` short.
        raise DevError(f"--dir {str(directory)!r} contains white space, which mosquitto.conf cannot hold: choose another")


def up(directory: Path, agents: Optional[int] = None, cluster: Optional[str] = None, allow: Sequence[str] = (),
       bound: float = ONLINE_BOUND, say: Any = None) -> Dict[str, Any]:
    """Start (or find running) the dev fleet in `directory`; return what `--json` prints.

    Waits until fogctl's own view (a retained-state snapshot over the generated fogctl.toml) shows
    every agent online with a state published after this start (a persistent broker keeps the
    last run's `online`); an agent that exits meanwhile fails at once with its log's last lines,
    and then everything this call started is stopped again (logs stay)."""
    from foglab.tools.broker import MOSQUITTO, free_port, wait_port

    directory = Path(os.path.abspath(directory))
    n = DEFAULT_AGENTS if agents is None else agents
    _validate(n, DEFAULT_CLUSTER if cluster is None else cluster, allow, directory)
    if not os.path.exists(MOSQUITTO):
        raise DevError("mosquitto is not installed: run `make setup` (apt-get install mosquitto)")
    _prepare_dir(directory)
    t0 = time.monotonic()
    with _locked(directory):
        old = DevFleet.load(directory)
        if old is not None:
            running = {k: v for k, v in old.running().items() if v}
            same = agents in (None, len(old.nodes)) and cluster in (None, old.cluster)
            if running and len(running) == len(old.nodes) + 1 and same:
                return _report(old, "already-up", time.monotonic() - t0)
            if running:
                what = ", ".join(f"{k} (pid {v})" for k, v in running.items())
                raise DevError(f"a dev fleet with {len(old.nodes)} agent(s), cluster {old.cluster}, runs in {directory} "
                               f"({what}): stop it first with `fog-agent dev down --dir {directory}`")
        port = old.port if old is not None and _port_free(old.port) else free_port()
        cluster = DEFAULT_CLUSTER if cluster is None else cluster
        fleet = DevFleet(directory, port, cluster, tuple(f"n{i}" for i in range(1, n + 1)))
        modules = list(dict.fromkeys(([EXAMPLE_MODULE] if (EXAMPLE_OPS / "fog_example_ops").is_dir() else [])
                                     + list(allow)))
        (directory / "broker").mkdir(exist_ok=True)
        (directory / "sink").mkdir(exist_ok=True)
        fleet.broker_conf.write_text(broker_conf(directory, port, _user()))
        for node in fleet.nodes:
            (directory / node / "state").mkdir(parents=True, exist_ok=True)
            fleet.agent_conf(node).write_text(agent_toml(node, cluster, port, directory, modules))
        if not (directory / ADMIN_KEY).exists():  # the fleet's throwaway admin key, kept across `up`s
            from agent.signing import generate_keypair

            generate_keypair(directory / ADMIN_KEY, directory / (ADMIN_KEY + ".pub"))
        fleet.fogctl_config.write_text(fogctl_toml(port, cluster, directory))
        fleet.env_file.write_text(env_text(directory, port, fleet.nodes, agent_env()["PYTHONPATH"]))
        fleet.save()  # before any process: an interrupted `up` leaves what `down` needs
        started = time.time()
        procs: Dict[str, "subprocess.Popen[bytes]"] = {}
        try:
            blog = directory / "broker" / "mosquitto.log"
            procs["broker"] = _spawn([MOSQUITTO, "-c", str(fleet.broker_conf)], blog, directory / "broker")
            fleet.broker_pid_file.write_text(f"{procs['broker'].pid}\n")
            try:
                wait_port(HOST, port, timeout=10.0)
            except TimeoutError:
                raise DevError(f"mosquitto did not start on {HOST}:{port}: {_tail(blog) or 'no log'} "
                               f"({blog})") from None
            if procs["broker"].poll() is not None:  # what answered is another program, on a port taken meanwhile
                raise DevError(f"mosquitto exited at its start on {HOST}:{port}: {_tail(blog) or 'no log'} ({blog})")
            if old is not None and old.cluster == cluster:
                _forget(fleet, [n for n in old.nodes if n not in fleet.nodes])
            env = agent_env()
            for node in fleet.nodes:
                procs[node] = _spawn([sys.executable, "-m", "agent", "run", "--config", str(fleet.agent_conf(node))],
                                     fleet.agent_log(node), directory / node, env)
                fleet.agent_pid_file(node).write_text(f"{procs[node].pid}\n")
            if say:
                say(f"broker on {HOST}:{port}; waiting for {', '.join(fleet.nodes)} to come online "
                    f"(logs in {directory})")
            _wait_online(fleet, procs, started, bound)
        except BaseException:
            _stop(fleet)  # KeyboardInterrupt and SIGTERM (agent.cli.main.Terminated) too
            for proc in procs.values():  # one interrupted before its pid file was written
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            raise
    return _report(fleet, "up", time.monotonic() - t0)


def _forget(fleet: DevFleet, nodes: Sequence[str]) -> None:
    """Clear the retained records of the nodes an earlier, larger fleet had in this DIR: the
    persistent broker kept them, and `fogctl status` would list those nodes as offline forever."""
    if not nodes:
        return
    from agent import topics
    from agent.fogctl.client import Connection, FogctlError
    from agent.fogctl.config import load_config

    try:
        with Connection(load_config(path=fleet.fogctl_config, env={})) as conn:
            for n in nodes:
                for topic in (topics.agent_state(fleet.cluster, n), topics.agent_status(fleet.cluster, n),
                              topics.latency(fleet.cluster, n), topics.agent_hosted(fleet.cluster, n),
                              topics.agent_rehomed(fleet.cluster, n)):
                    conn.publish(topic, b"", retain=True)
    except FogctlError as exc:
        raise DevError(f"cannot clear the records of the former nodes {', '.join(nodes)}: {exc}") from None


def _wait_online(fleet: DevFleet, procs: Mapping[str, "subprocess.Popen[bytes]"], started: float,
                 bound: float) -> None:
    """fogctl's check, on fogctl's connection and settings file: what `fogctl status` will show."""
    from agent.fogctl.client import Connection, FogctlError
    from agent.fogctl.commands import fleet_snapshot
    from agent.fogctl.config import load_config

    cfg = load_config(path=fleet.fogctl_config, env={})
    deadline = time.monotonic() + bound
    online: List[str] = []
    try:
        with Connection(cfg) as conn:
            while True:
                snap = fleet_snapshot(conn, fleet.cluster)
                online = [n.node for n in snap.nodes if n.node in fleet.nodes and n.status == "online"
                          and n.ts is not None and n.ts >= started - 1.0]
                if len(online) == len(fleet.nodes):
                    return
                for name, proc in procs.items():
                    if proc.poll() is not None:
                        log = fleet.directory / "broker" / "mosquitto.log" if name == "broker" else fleet.agent_log(name)
                        raise DevError(f"{name} exited with status {proc.returncode} before the fleet was up: "
                                       f"{_tail(log) or 'no output'} ({log})")
                if time.monotonic() > deadline:
                    missing = [n for n in fleet.nodes if n not in online]
                    raise DevError(f"{', '.join(missing)} not online after {bound:g} s (logs in {fleet.directory})")
                time.sleep(0.5)
    except FogctlError as exc:
        raise DevError(f"cannot watch the fleet come up: {exc}") from None


def _report(fleet: DevFleet, state: str, seconds: float) -> Dict[str, Any]:
    running = fleet.running()
    return {
        "state": state, "seconds": round(seconds, 2), "dir": str(fleet.directory),
        "broker": f"{HOST}:{fleet.port}", "port": fleet.port, "cluster": fleet.cluster,
        "broker_pid": running["broker"], "fogctl_config": str(fleet.fogctl_config), "env_file": str(fleet.env_file),
        "nodes": [{"node": n, "pid": running[n], "config": str(fleet.agent_conf(n)), "log": str(fleet.agent_log(n))}
                  for n in fleet.nodes],
    }


def next_steps(report: Mapping[str, Any], default: bool) -> str:
    """What to type next, with this fleet's paths and port in it."""
    d = report["dir"]
    opt = "" if default else f" --dir {_sh(d)}"
    return "\n".join([
        f"  . {_sh(d + '/env')}      # sets FOGCTL_CONFIG, FOG_AGENT_CONFIG, FOG_AGENT_SIGN_KEY, FOG_DEV_DIR, "
        "FOG_DEV_PORT, PYTHONPATH",
        "  fogctl status",
        "  fog-agent deploy examples/operators/pipeline.toml",
        "or without the environment:",
        f"  fogctl --config {_sh(report['fogctl_config'])} status",
        f"  fog-agent deploy PIPELINE.toml --host {HOST} --port {report['port']} --cluster {report['cluster']} "
        f"--sign-key {_sh(d + '/' + ADMIN_KEY)}",
        f"  mosquitto_sub -h {HOST} -p {report['port']} -v -t '#'",
        f"stop: fog-agent dev down{opt}   (logs stay; --purge also removes {d})",
    ])


# ---- status ------------------------------------------------------------------------------------------


def status(directory: Path) -> Dict[str, Any]:
    """Which processes of the fleet run and what fogctl's view says of each agent."""
    directory = Path(os.path.abspath(directory))
    fleet = DevFleet.load(directory)
    if fleet is None:
        raise DevError(f"no dev fleet in {directory} (start one with `fog-agent dev up`)")
    doc = _report(fleet, "", 0.0)
    del doc["seconds"]
    views: Dict[str, str] = {}
    if doc["broker_pid"]:
        from agent.fogctl.client import Connection, FogctlError
        from agent.fogctl.commands import fleet_snapshot
        from agent.fogctl.config import load_config

        try:
            with Connection(load_config(path=fleet.fogctl_config, env={})) as conn:
                views = {n.node: n.status for n in fleet_snapshot(conn, fleet.cluster).nodes}
        except FogctlError as exc:
            doc["error"] = str(exc)
    for row in doc["nodes"]:
        row["status"] = views.get(row["node"], "unknown") if row["pid"] else "stopped"
    up_all = bool(doc["broker_pid"]) and all(r["pid"] and r["status"] == "online" for r in doc["nodes"])
    none = not doc["broker_pid"] and not any(r["pid"] for r in doc["nodes"])
    doc["state"] = "up" if up_all else "stopped" if none else "partly up"
    return doc


# ---- down --------------------------------------------------------------------------------------------


def _terminate(pids: Dict[str, int], bound: float) -> List[str]:
    """SIGTERM each, wait up to `bound` for all, then SIGKILL each one's process group; who needed it."""
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline and any(_proc_stat(p) and _proc_stat(p)[0] not in "ZX" for p in pids.values()):
        time.sleep(0.1)
    killed = []
    for name, pid in pids.items():
        st = _proc_stat(pid)
        if st is not None and st[0] not in "ZX":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            killed.append(name)
    return killed


def _stop(fleet: DevFleet) -> Dict[str, Any]:
    """Agents first (each stops its workers and says `offline` on a broker still there), then the
    broker; then nothing may be left in their process groups (each was a session leader)."""
    running = fleet.running()
    agents = {n: p for n, p in running.items() if n != "broker" and p}
    killed = _terminate(agents, AGENT_STOP_BOUND)
    broker = {"broker": running["broker"]} if running["broker"] else {}
    killed += _terminate(broker, BROKER_STOP_BOUND)
    groups = [p for p in list(agents.values()) + list(broker.values())]
    deadline = time.monotonic() + 5.0  # workers end on their agent's SIGTERM or their parent-death signal
    left = _group_members(groups)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _group_members(groups)
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if left:
                os.killpg(pgid, signal.SIGKILL)
    if left:
        time.sleep(0.2)
        left = _group_members(groups)
    for path in [fleet.broker_pid_file] + [fleet.agent_pid_file(n) for n in fleet.nodes]:
        with contextlib.suppress(OSError):
            path.unlink()
    return {"stopped": list(agents) + list(broker), "killed": killed, "left": left,
            "pids": sorted(groups)}


def down(directory: Path, purge: bool = False) -> Dict[str, Any]:
    """Stop what `up` started; keep DIR (logs, configs, the broker's persistence) unless `purge`."""
    directory = Path(os.path.abspath(directory))
    fleet = DevFleet.load(directory) if directory.is_dir() else None
    if fleet is None:
        if purge and directory.exists():
            raise DevError(f"{directory} holds no dev fleet: not removing it")
        return {"dir": str(directory), "stopped": [], "killed": [], "left": [], "pids": [], "purged": False,
                "note": "no dev fleet here"}
    with _locked(directory):
        doc = _stop(fleet)
    doc["dir"] = str(directory)
    doc["purged"] = False
    if doc["left"]:
        raise DevError(f"processes {doc['left']} of the dev fleet in {directory} are still running after SIGKILL")
    if purge:
        shutil.rmtree(directory)
        doc["purged"] = True
    return doc
