"""A fleet of real Debian machines on one host: systemd-nspawn containers with systemd as PID 1.

Why containers and not the demo's processes: the demo runs every agent as a process of one host,
so it cannot show what a Pi sees -- a package installed by dpkg, the unit started by systemd,
Ansible reaching the node over SSH, a node losing its network. Each testbed node is a booted
Debian bookworm (systemd PID 1, journald, sshd) on its own network namespace, reached over SSH
with a key generated for the fleet, and listed in an Ansible inventory (docs/operations.md,
"Testbed").

What it changes on the host, and `down` removes: one bridge (`fogtb0`, 10.213.0.1/24; each node
gets `vb-<name>` on it from `--network-bridge`), one overlay mount and one `systemd-nspawn`
process per node, and the run directory (machine dirs, key, inventory, state). The debootstrapped
root stays cached (`~/.cache/fog-agent/testbed/roots/`, or `$FOG_TESTBED_CACHE`): a second `up`
reuses it and each node is a copy-on-write overlay on it.

The plan (names, addresses, command lines, the inventory) is pure functions of the request, tested
without root; `up`/`down` are the only functions that touch the host.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

SUITE = "bookworm"
# The Debian releases a root can be built of (`testbed scenarios` runs the role on each).
SUITES = ("bookworm", "trixie")
# Everything the nodes need is in the root: the containers have no route to a package mirror.
# systemd/dbus/sshd: a booted machine reached like a Pi; python3-*: the .deb's Depends and
# Ansible's modules (apt needs python3-apt); mosquitto: the broker role; sudo: `become`.
ROOT_PACKAGES: Tuple[str, ...] = (
    "systemd", "systemd-sysv", "dbus", "iproute2", "openssh-server", "sudo", "adduser",
    "python3", "python3-venv", "python3-setuptools", "python3-psutil", "python3-systemd",
    "python3-apt", "mosquitto", "mosquitto-clients",
    # agent.signing; debootstrap resolves no virtual package, so the cffi backend is named too
    "python3-cryptography", "python3-cffi-backend",
)
ARCHES = ("amd64", "arm64")
BRIDGE = "fogtb0"
SUBNET = "10.213.0"  # a /24: the host side is .1, node i is .(10 + i)
PREFIX_LEN = 24
MAX_NODES = 200
NODE_PREFIX = "fog"
ROOT_MARKER = ".fog-testbed-root"
STATE_FILE = "state.json"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
BINFMT_DIR = Path("/proc/sys/fs/binfmt_misc")
# arch -> binfmt_misc entry name (qemu-user-static's /usr/lib/binfmt.d/<name>.conf registers it).
QEMU_BINFMT = {"arm64": "qemu-aarch64"}
BINFMT_CONF_DIR = Path("/usr/lib/binfmt.d")
BOOT_TIMEOUT = {"amd64": 120.0, "arm64": 600.0}  # sshd under qemu user emulation starts slowly
NSPAWN_EXIT = 3.0  # s for nspawn to reap its killed init and exit by itself before it gets SIGKILL


class TestbedError(RuntimeError):
    """A testbed step failed or cannot run here; the message is one line for the user."""


# ---------------------------------------------------------------------------------------------
# The plan: pure.


@dataclass(frozen=True)
class Node:
    """One container. `bridge`: the host bridge its `host0` is plugged into (None: the plan's).
    `uplink_address`: a site broker's address on the plan's uplink bridge, through a second link
    (`uplink0` inside, `vu-<name>` on the host), so that the link to the centre can be cut alone
    (docs/operations.md, "Sites on the testbed")."""
    name: str
    address: str
    arch: str
    bridge: Optional[str] = None
    uplink_address: Optional[str] = None


@dataclass(frozen=True)
class Plan:
    nodes: Tuple[Node, ...]
    arch: str
    bridge: str = BRIDGE
    host_address: str = f"{SUBNET}.1"
    prefix_len: int = PREFIX_LEN
    # A second bridge (sites: the centre and the site brokers' uplinks); None: one bridge only.
    uplink_bridge: Optional[str] = None
    uplink_host_address: Optional[str] = None

    def bridge_of(self, node: Node) -> str:
        return node.bridge or self.bridge

    @property
    def broker(self) -> Node:
        """The node that runs the site broker (and an agent, like every node)."""
        return self.nodes[0]


def make_plan(n: int, arch: str = "amd64", prefix: str = NODE_PREFIX, bridge: str = BRIDGE,
              subnet: str = SUBNET) -> Plan:
    """Node i is <prefix>i at <subnet>.(10 + i); the host side of the bridge is <subnet>.1.

    A second testbed beside the first (the test suite's, while a developer's is up) needs its own
    prefix (the host-side veth is vb-<name>), bridge and subnet."""
    if arch not in ARCHES:
        raise TestbedError(f"--arch {arch}: expected one of {', '.join(ARCHES)}")
    if not 1 <= n <= MAX_NODES:
        raise TestbedError(f"--nodes {n}: expected 1 to {MAX_NODES}")
    if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", prefix):
        raise TestbedError(f"node prefix {prefix!r}: expected 1 to 8 lower-case letters and digits")
    if not re.fullmatch(r"[a-z][a-z0-9]{0,14}", bridge):
        raise TestbedError(f"bridge {bridge!r}: expected an interface name of at most 15 letters and digits")
    octets = subnet.split(".")
    if len(octets) != 3 or not all(o.isdigit() and 0 <= int(o) <= 255 for o in octets):
        raise TestbedError(f"subnet {subnet!r}: expected the first three octets of a /24, e.g. {SUBNET}")
    return Plan(nodes=tuple(Node(f"{prefix}{i}", f"{subnet}.{10 + i}", arch) for i in range(1, n + 1)),
                arch=arch, bridge=bridge, host_address=f"{subnet}.1")


def cache_dir() -> Path:
    env = os.environ.get("FOG_TESTBED_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "fog-agent" / "testbed"


def root_dir(cache: Path, arch: str, suite: str = SUITE) -> Path:
    return cache / "roots" / f"{suite}-{arch}"


def run_dir(cache: Path) -> Path:
    return cache / "run"


def root_signature(arch: str, suite: str = SUITE) -> str:
    """What a cached root was built from: a root of another package list is rebuilt."""
    return f"{suite} {arch} {' '.join(sorted(ROOT_PACKAGES))}\n"


def mirror_from_sources(texts: Iterable[str]) -> Optional[str]:
    """The first Debian mirror (not the security archive) of apt's sources, one-line or deb822."""
    for text in texts:
        for line in text.splitlines():
            line = line.strip()
            m = re.match(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+\S+", line)
            if m and "security" not in m.group(1):
                return m.group(1)
            m = re.match(r"^URIs:\s*(\S+)", line)
            if m and "security" not in m.group(1):
                return m.group(1)
    return None


def debootstrap_argv(root: Path, arch: str, mirror: str, suite: str = SUITE) -> List[str]:
    if suite not in SUITES:
        raise TestbedError(f"--suite {suite}: expected one of {', '.join(SUITES)}")
    return ["debootstrap", "--variant=minbase", f"--arch={arch}", f"--include={','.join(ROOT_PACKAGES)}",
            suite, str(root), mirror]


def nspawn_argv(node: Node, machine_root: Path, bridge: str) -> List[str]:
    """Boot the node with systemd as PID 1 on its own network namespace, plugged into the bridge.

    --register=no --keep-unit: the host has no system bus and systemd is not its PID 1, so nspawn
    must neither ask machined to register the machine nor create a scope unit. A node with an
    uplink gets a second veth pair (`uplink_link(node)` on the host, `uplink0` inside), which
    `up` plugs into the uplink bridge."""
    extra = [f"--network-veth-extra={uplink_link(node)}:uplink0"] if node.uplink_address else []
    return ["systemd-nspawn", "--quiet", "--register=no", "--keep-unit", "--boot",
            f"--machine={node.name}", f"--directory={machine_root}", f"--network-bridge={bridge}",
            *extra, "--console=pipe", "--resolv-conf=off", "--timezone=off", "--link-journal=no"]


def uplink_link(node: Node) -> str:
    """The host side of a site broker's uplink veth: what `partition --uplink` takes down."""
    return f"vu-{node.name}"


def uplink_network_unit(node: Node, plan: Plan) -> str:
    """systemd-networkd's file for a site broker's second link, on the uplink bridge."""
    return (f"[Match]\nName=uplink0\n\n[Network]\nAddress={node.uplink_address}/{plan.prefix_len}\n"
            "LinkLocalAddressing=no\nIPv6AcceptRA=no\n")


def network_unit(node: Node, plan: Plan) -> str:
    """systemd-networkd's file for the container side of the veth (static: there is no DHCP)."""
    return (f"[Match]\nName=host0\n\n[Network]\nAddress={node.address}/{plan.prefix_len}\n"
            "LinkLocalAddressing=no\nIPv6AcceptRA=no\n")


def hosts_file(plan: Plan) -> str:
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback", f"{plan.host_address}\ttestbed-host"]
    if plan.uplink_host_address:
        lines.append(f"{plan.uplink_host_address}\ttestbed-host-uplink")
    lines += [f"{n.address}\t{n.name}" for n in plan.nodes]
    return "\n".join(lines) + "\n"


def _q(value: object) -> str:
    """A YAML scalar: JSON strings and numbers are valid YAML flow scalars."""
    return json.dumps(value)


def inventory_head(writer: str, key: Path, known_hosts: Path) -> List[str]:
    """The first lines of every testbed inventory: how Ansible reaches the containers (the
    testbed's own key and known-hosts file, root, the root's Python) and the cluster's name."""
    ssh_args = f"-o UserKnownHostsFile={known_hosts} -o StrictHostKeyChecking=yes -o IdentitiesOnly=yes"
    return [
        "---",
        f"# Written by {writer}; removed by `fog-agent testbed down`.",
        "all:",
        "  vars:",
        "    ansible_user: root",
        f"    ansible_ssh_private_key_file: {_q(str(key))}",
        f"    ansible_ssh_common_args: {_q(ssh_args)}",
        "    ansible_python_interpreter: /usr/bin/python3",
        "    fog_cluster: testbed",
    ]


def inventory_yaml(plan: Plan, key: Path, known_hosts: Path, passwords: Dict[str, str],
                   deb: Optional[Path]) -> str:
    """The fleet for `ansible-playbook -i <this> ansible/site.yml`.

    The first node is the site broker and also a fog node; the central group is empty (the
    collector needs PySpark and a JRE, not in the root). The broker's plain listener on the
    bridge with one password per identity: the ACL is the role's, the identity is the user name."""
    out = [
        *inventory_head("`fog-agent testbed up`", key, known_hosts),
        f"    fog_broker_host: {_q(plan.broker.address)}",
        # mosquitto role: packages are in the root; a password listener on the bridge.
        "    mosquitto_cluster: testbed",
        "    mosquitto_install_packages: false",
        "    mosquitto_tls_enabled: false",
        "    mosquitto_listener_enabled: true",
        f"    mosquitto_listener_address: {_q(plan.broker.address)}",
        "    mosquitto_listener_port: 1883",
        "    mosquitto_admin_identities: [fogctl-admin]",
        "    mosquitto_users:",
    ]
    for name in [n.name for n in plan.nodes] + ["fogctl-admin"]:
        out += [f"      - name: {_q(name)}", f"        password: {_q(passwords[name])}"]
    out += [
        # fog_agent role: the .deb (offline: its Depends are in the root).
        "    fog_agent_cluster: testbed",
        "    fog_agent_install_method: deb",
        "    fog_agent_install_packages: false",
        f"    fog_agent_mqtt_host: {_q(plan.broker.address)}",
        "    fog_agent_mqtt_port: 1883",
        "    fog_agent_mqtt_tls: false",
        "    fog_netem_enabled: false",
    ]
    if deb is not None:
        out.append(f"    fog_agent_deb_src: {_q(str(deb))}")
    out += ["  children:", "    brokers:", "      hosts:", f"        {plan.broker.name}:",
            "    central:", "      hosts: {}", "    fog_nodes:", "      hosts:"]
    for n in plan.nodes:
        out += [f"        {n.name}:", f"          ansible_host: {_q(n.address)}",
                f"          fog_agent_mqtt_password: {_q(passwords[n.name])}"]
    # The brokers group names the first node only: its address comes from its fog_nodes entry.
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# The state of a running testbed: what `down` must remove.


@dataclass
class State:
    arch: str
    bridge: Optional[str] = None
    nodes: List[Dict[str, object]] = field(default_factory=list)  # name, address, pid, mount
    inventory: Optional[str] = None
    key: Optional[str] = None
    uplink_bridge: Optional[str] = None  # sites: the centre's bridge (the nodes' entries name theirs)
    admin_password: Optional[str] = None
    binfmt_mounted: bool = False  # what up did for a foreign arch (binfmt_setup), undone by down
    binfmt_registered: Optional[str] = None
    root: Optional[str] = None  # the cached root, the overlays' lower layer (a wiped disk is made on it again)

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Optional["State"]:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        return cls(**data)


# ---------------------------------------------------------------------------------------------
# The host side.

Progress = Callable[[str], None]


def _stderr_progress(line: str) -> None:
    print(f"testbed: {line}", file=sys.stderr, flush=True)


def _run(argv: Sequence[str], what: str, timeout: float = 600.0, log: Optional[Path] = None) -> str:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(f"{what}: no result after {timeout:.0f} s ({shlex.join(argv)})") from exc
    if log is not None:
        log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["(no output)"]
        where = f"; full output in {log}" if log is not None else ""
        raise TestbedError(f"{what} failed (exit {proc.returncode}): {tail[0]}{where}")
    return proc.stdout


def _run_logged(argv: Sequence[str], what: str, log: Path, progress: Progress, timeout: float,
                every: float = 20.0) -> None:
    """A long step whose output goes to `log`; every `every` s one progress line with its last
    `I:` line (debootstrap's own steps: retrieving, validating, unpacking, configuring)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        next_line = started + every
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                now = time.monotonic()
                if now > started + timeout:
                    raise TestbedError(f"{what}: no result after {timeout:.0f} s; its output is in {log}")
                if now >= next_line:
                    next_line = now + every
                    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("I: ")]
                    progress(f"{what}: {now - started:.0f} s, {lines[-1][3:] if lines else 'starting'}")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        raise TestbedError(f"{what} failed (exit {proc.returncode}): {tail[0]}; full output in {log}")


def preflight(arch: str) -> None:
    """Refuse with one line where the testbed cannot run."""
    if os.geteuid() != 0:
        raise TestbedError("needs root (debootstrap, systemd-nspawn, a bridge and overlay mounts); run it as root")
    missing = [tool for tool in ("systemd-nspawn", "debootstrap", "ip", "ssh", "ssh-keygen", "mount", "umount")
               if shutil.which(tool) is None]
    if missing:
        raise TestbedError(f"missing {', '.join(missing)}: apt-get install systemd-container debootstrap "
                           "iproute2 openssh-client (scripts/setup.sh installs them)")
    if needs_emulation(arch):
        why = emulation_missing(arch)
        if why:
            raise TestbedError(why)


def native_arch() -> Optional[str]:
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine)


def needs_emulation(arch: str) -> bool:
    return arch != native_arch()


def emulation_missing(arch: str) -> Optional[str]:
    """Why a root of `arch` cannot run here (one line), or None: qemu-user-static's binfmt entry is
    registered, or can be (its binfmt.d file is installed and the host is Linux with binfmt_misc)."""
    name = QEMU_BINFMT.get(arch)
    if name is None:
        return f"--arch {arch}: no emulation known for it on a {native_arch()} host"
    if (BINFMT_DIR / name).exists():
        return None
    if not (BINFMT_CONF_DIR / f"{name}.conf").is_file():
        return (f"--arch {arch} on a {native_arch()} host needs qemu user emulation: apt-get install "
                f"qemu-user-static ({BINFMT_CONF_DIR / (name + '.conf')} is missing)")
    if "binfmt_misc" not in Path("/proc/filesystems").read_text():
        return f"--arch {arch}: this kernel has no binfmt_misc, so {name} cannot be registered"
    return None


@dataclass
class Binfmt:
    """What `binfmt_setup` changed on the host (and `binfmt_undo` puts back)."""
    mounted: bool = False
    registered: Optional[str] = None


def binfmt_setup(arch: str, progress: Progress) -> Binfmt:
    """Make `arch` binaries run here through qemu: mount binfmt_misc if it is not, register
    qemu-user-static's entry if it is not (its binfmt.d line, written to `register`). Only what
    was missing is done and returned, so that the undo leaves a host's own setup as it was."""
    done = Binfmt()
    if not needs_emulation(arch):
        return done
    why = emulation_missing(arch)
    if why:
        raise TestbedError(why)
    name = QEMU_BINFMT[arch]
    if not (BINFMT_DIR / "register").exists():
        _run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT_DIR)], "mounting binfmt_misc")
        done.mounted = True
        progress(f"mounted binfmt_misc on {BINFMT_DIR}")
    if not (BINFMT_DIR / name).exists():
        line = next(ln for ln in (BINFMT_CONF_DIR / f"{name}.conf").read_text().splitlines()
                    if ln.startswith(":"))
        try:
            (BINFMT_DIR / "register").write_text(line)
        except OSError as exc:
            binfmt_undo(done)
            raise TestbedError(f"registering {name} with binfmt_misc failed: {exc.strerror}") from exc
        done.registered = name
        progress(f"registered {name} with binfmt_misc")
    return done


def binfmt_undo(done: Binfmt) -> List[str]:
    removed = []
    if done.registered and (BINFMT_DIR / done.registered).exists():
        (BINFMT_DIR / done.registered).write_text("-1")
        removed.append(f"binfmt {done.registered}")
    if done.mounted and subprocess.run(["mountpoint", "-q", str(BINFMT_DIR)]).returncode == 0:
        subprocess.run(["umount", str(BINFMT_DIR)], capture_output=True)
        removed.append(f"mount {BINFMT_DIR}")
    return removed


def _apt_mirror() -> str:
    texts = []
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        if path.suffix in (".list", ".sources") or path.name == "sources.list":
            try:
                texts.append(path.read_text())
            except OSError:
                continue
    return mirror_from_sources(texts) or DEFAULT_MIRROR


def ensure_root(cache: Path, arch: str, progress: Progress, suite: str = SUITE) -> Tuple[Path, bool, float]:
    """The cached root for arch, built by debootstrap if missing. Returns (root, built, seconds)."""
    root = root_dir(cache, arch, suite)
    marker = root / ROOT_MARKER
    if marker.is_file() and marker.read_text() == root_signature(arch, suite):
        return root, False, 0.0
    started = time.monotonic()
    tmp = root.with_name(root.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    mirror = _apt_mirror()
    took = "about 3 minutes" if not needs_emulation(arch) else "10 to 45 minutes under qemu"
    progress(f"building the {suite} {arch} root with debootstrap from {mirror} ({took}, ~350 MB) ...")
    _run_logged(debootstrap_argv(tmp, arch, mirror, suite), "debootstrap", cache / f"debootstrap-{suite}-{arch}.log" if suite != SUITE else cache / f"debootstrap-{arch}.log", progress,
                timeout=3600)
    finish_root(tmp, arch, suite)
    if root.exists():
        shutil.rmtree(root)
    os.rename(tmp, root)
    return root, True, time.monotonic() - started


def finish_root(tmp: Path, arch: str, suite: str = SUITE) -> None:
    """What every node shares beyond debootstrap's packages; the marker last (a complete root)."""
    # Per-node identities are made at `up`: no shared machine id or SSH host key in the root.
    (tmp / "etc" / "machine-id").write_text("")
    for key in (tmp / "etc" / "ssh").glob("ssh_host_*"):
        key.unlink()
    # sshd and systemd-networkd start at boot (minbase enables neither networkd nor ssh by itself).
    wants = tmp / "etc" / "systemd" / "system" / "multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    for unit in ("systemd-networkd.service", "ssh.service"):
        link = wants / unit
        if not link.exists() and not link.is_symlink():
            link.symlink_to(f"/lib/systemd/system/{unit}")
    # Mosquitto's package enables it everywhere; only the brokers group runs it (the role enables it).
    (wants / "mosquitto.service").unlink(missing_ok=True)
    # apt inside a node must not try to reach a mirror: the packages are already here.
    (tmp / "etc" / "apt" / "apt.conf.d" / "99fog-testbed-offline").write_text(
        'Acquire::Languages "none";\nAPT::Get::Update::SourceListWarnings "false";\n')
    (tmp / "etc" / "apt" / "sources.list").write_text("")
    (tmp / ROOT_MARKER).write_text(root_signature(arch, suite))


def _prepare_machine(node: Node, plan: Plan, lower: Path, mdir: Path, pubkey: str) -> Path:
    """Overlay mount of the cached root with this node's identity written into its upper layer."""
    for sub in ("upper", "work", "root"):
        (mdir / sub).mkdir(parents=True, exist_ok=True)
    merged = mdir / "root"
    _run(["mount", "-t", "overlay", "overlay", "-o",
          f"lowerdir={lower},upperdir={mdir / 'upper'},workdir={mdir / 'work'}", str(merged)],
         f"overlay mount for {node.name}")
    etc = merged / "etc"
    (etc / "hostname").write_text(node.name + "\n")
    (etc / "machine-id").write_text(uuid.uuid4().hex + "\n")
    (etc / "hosts").write_text(hosts_file(plan))
    (etc / "systemd" / "network").mkdir(parents=True, exist_ok=True)
    (etc / "systemd" / "network" / "10-testbed.network").write_text(network_unit(node, plan))
    if node.uplink_address:
        (etc / "systemd" / "network" / "11-uplink.network").write_text(uplink_network_unit(node, plan))
    ssh = merged / "root" / ".ssh"
    ssh.mkdir(mode=0o700, parents=True, exist_ok=True)
    (ssh / "authorized_keys").write_text(pubkey)
    os.chmod(ssh / "authorized_keys", 0o600)
    _run(["ssh-keygen", "-q", "-A", "-f", str(merged)], f"SSH host keys for {node.name}")
    return merged


def _container_init(nspawn_pid: int, timeout: float = 60.0) -> int:
    """The container's PID 1 as the host sees it: nspawn's child."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            children = Path(f"/proc/{nspawn_pid}/task/{nspawn_pid}/children").read_text().split()
        except OSError:
            children = []
        if children:
            return int(children[0])
        time.sleep(0.2)
    raise TestbedError(f"nspawn {nspawn_pid}: no container init after {timeout:.0f} s")


def address_from_host(nspawn_pid: int, node: Node, plan_prefix_len: int) -> None:
    """Give the container's host0 its address with the host's own `ip`, inside the container's
    network namespace: under qemu user emulation systemd-networkd cannot start (netlink: "Protocol
    not supported", seen on arm64), so an emulated node would never get its network."""
    init = _container_init(nspawn_pid)
    deadline = time.monotonic() + 60.0
    while not subprocess.run(["nsenter", "-t", str(init), "-n", "ip", "link", "show", "host0"],
                             capture_output=True).returncode == 0:
        if time.monotonic() > deadline:
            raise TestbedError(f"{node.name}: no host0 in the container after 60 s")
        time.sleep(0.2)
    _run(["nsenter", "-t", str(init), "-n", "ip", "addr", "replace", f"{node.address}/{plan_prefix_len}",
          "dev", "host0"], f"{node.name}: address of host0")
    _run(["nsenter", "-t", str(init), "-n", "ip", "link", "set", "host0", "up"], f"{node.name}: host0 up")


def _host_key_line(node: Node, merged: Path) -> str:
    pub = (merged / "etc" / "ssh" / "ssh_host_ed25519_key.pub").read_text().split()
    return f"{node.address} {pub[0]} {pub[1]}\n"


def _is_nspawn(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"systemd-nspawn")
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# A node's processes as the host sees them: what a power cut ends and `down` leaves none of.
#
# Why not nspawn's process tree: the container's systemd runs in a session of its own (a signal to
# nspawn's process group misses it) and outlives nspawn (it is reparented), yet every process of
# the container runs on the node's disk, and the overlay's upper directory names that disk.


def root_upperdir(mountinfo: str) -> Optional[str]:
    """The overlay upper directory under a process's "/" (its /proc/PID/mountinfo), else None.

    The last line mounted on "/" is the root the process sees; fields after " - " are the file
    system type, the source and the superblock options (overlay's lowerdir/upperdir/workdir)."""
    upper = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) < 5 or fields[4] != "/":
            continue
        upper = None
        tail = line.split(" - ", 1)[1].split() if " - " in line else []
        if len(tail) >= 3 and tail[0] == "overlay":
            upper = next((_unescape(o[len("upperdir="):]) for o in tail[2].split(",") if o.startswith("upperdir=")),
                         None)
    return upper


def _unescape(field: str) -> str:
    """The kernel writes a space, tab, newline, comma or backslash of a path in /proc's mount
    tables as an octal escape (\\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _read(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:  # the process ended meanwhile, or /proc hides it
        return None


def _pids() -> List[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def _alive(pid: int) -> bool:
    """Running (not a zombie: an exited process that only waits for its parent to reap it; where
    the host's PID 1 does not reap orphans, such a zombie stays, but it holds nothing)."""
    stat = _read(f"/proc/{pid}/stat")
    return stat is not None and stat.rsplit(")", 1)[-1].split()[:1] not in (["Z"], ["X"])


def _is_ns_init(pid: int) -> bool:
    """PID 1 of a PID namespace below the host's (NSpid: its pid at each level, innermost last)."""
    status = _read(f"/proc/{pid}/status") or ""
    nspid = next((ln.split()[1:] for ln in status.splitlines() if ln.startswith("NSpid:")), [])
    return len(nspid) > 1 and nspid[-1] == "1"


def disks_in_use(prefix: str) -> Dict[int, str]:
    """{pid: upper directory} of the live processes whose root is an overlay with its upper
    directory under `prefix` (a node's machine directory, or a run's `machines/`). Processes of
    this process's mount namespace are skipped: the host's "/" is never a testbed disk."""
    try:
        own_mnt = os.readlink("/proc/self/ns/mnt")
    except OSError:
        own_mnt = None
    found = {}
    for pid in _pids():
        try:
            if os.readlink(f"/proc/{pid}/ns/mnt") == own_mnt:
                continue
        except OSError:
            continue
        upper = root_upperdir(_read(f"/proc/{pid}/mountinfo") or "")
        if upper is not None and upper.startswith(prefix) and _alive(pid):
            found[pid] = upper
    return found


def pids_on_disks(prefix: str) -> List[int]:
    return list(disks_in_use(prefix))


def nspawn_directories(prefix: str) -> Dict[int, str]:
    """{pid: --directory} of the live systemd-nspawn processes booting a directory under `prefix`."""
    found = {}
    for pid in _pids():
        argv = (_read(f"/proc/{pid}/cmdline") or "").split("\0")
        directory = next((a[len("--directory="):] for a in argv if a.startswith("--directory=")), "")
        if argv[0].endswith("systemd-nspawn") and directory.startswith(prefix) and _alive(pid):
            found[pid] = directory
    return found


def nspawns_under(prefix: str) -> List[int]:
    return list(nspawn_directories(prefix))


def _wait_until(done: Callable[[], bool], timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


def _sigkill(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def power_cut(prefix: str, timeout: float = 15.0) -> int:
    """End every process on the disks under `prefix` at once, then their nspawn; returns how many.

    SIGKILL to a container's init (PID 1 of its PID namespace) makes the kernel SIGKILL every other
    process of that namespace: the whole machine stops with no shutdown, like a power cut. Anything
    else on the disk (a process that entered only its mount namespace) is killed beside it. nspawn
    then reaps its init and exits by itself (given NSPAWN_EXIT s; then SIGKILL), so no init is left
    a zombie under a PID 1 that may never reap it."""
    ended: set = set()
    deadline = time.monotonic() + timeout
    while True:
        on_disk = pids_on_disks(prefix)
        inits = [pid for pid in on_disk if _is_ns_init(pid)]
        _sigkill(inits + [pid for pid in on_disk if pid not in inits])
        ended.update(on_disk)
        if on_disk:
            _wait_until(lambda: not pids_on_disks(prefix), max(0.0, deadline - time.monotonic()))
            _wait_until(lambda: not nspawns_under(prefix), min(NSPAWN_EXIT, max(0.0, deadline - time.monotonic())))
        spawners = nspawns_under(prefix)
        _sigkill(spawners)
        ended.update(spawners)
        if not on_disk and not spawners:
            return len(ended)
        if time.monotonic() > deadline:
            left = pids_on_disks(prefix) + nspawns_under(prefix)
            raise TestbedError(f"processes on {prefix} survived SIGKILL for {timeout:.0f} s: {left}")
        time.sleep(0.05)


def wait_ssh(address: str, key: Path, known_hosts: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((address, 22), timeout=1.0):
                pass
        except OSError:
            time.sleep(0.3)
            continue
        if subprocess.run(ssh_argv(address, key, known_hosts, "true"), capture_output=True,
                          timeout=30).returncode == 0:
            return
        time.sleep(0.5)
    raise TestbedError(f"{address}: sshd did not answer within {timeout:.0f} s")


def ssh_argv(address: str, key: Path, known_hosts: Path, command: str) -> List[str]:
    return ["ssh", "-q", "-i", str(key), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            "-o", f"UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=yes",
            "-o", "ConnectTimeout=5", f"root@{address}", command]


@dataclass
class UpResult:
    nodes: List[Dict[str, str]]
    arch: str
    inventory: str
    key: str
    known_hosts: str
    admin_password: str
    root_built: bool
    root_seconds: float
    seconds: float


def _password() -> str:
    return uuid.uuid4().hex


def up(n: int, arch: str = "amd64", deb: Optional[Path] = None, cache: Optional[Path] = None,
       progress: Progress = _stderr_progress, boot_timeout: Optional[float] = None, run: Optional[Path] = None,
       prefix: str = NODE_PREFIX, bridge: str = BRIDGE, subnet: str = SUBNET, suite: str = SUITE,
       plan: Optional[Plan] = None, inventory_writer: Optional[Callable[..., str]] = None) -> UpResult:
    """Boot the fleet of `make_plan(n, ...)`, or of `plan` (sites: testbed_sites.make_sites_plan),
    and write its inventory with `inventory_writer` (same arguments as `inventory_yaml`)."""
    plan = plan or make_plan(n, arch, prefix, bridge, subnet)
    inventory_writer = inventory_writer or inventory_yaml
    preflight(arch)
    cache = cache or cache_dir()
    # Absolute: the overlays' options and nspawn's --directory name it, and they are how the
    # node's processes are found later (pids_on_disks, nspawns_under).
    run = Path(os.path.abspath(run or run_dir(cache)))
    if (run / STATE_FILE).exists():
        raise TestbedError(f"a testbed is already up ({run / STATE_FILE}); run `fog-agent testbed down` first")
    started = time.monotonic()
    bridges = [(plan.bridge, plan.host_address)]
    if plan.uplink_bridge and plan.uplink_host_address:
        bridges.append((plan.uplink_bridge, plan.uplink_host_address))
    addresses = _run(["ip", "-o", "-4", "addr", "show"], "listing the host's addresses")
    for name, address in bridges:
        if Path(f"/sys/class/net/{name}").exists():
            raise TestbedError(f"the host already has an interface {name}: run `fog-agent testbed down` first")
        prefix_used = f" {address.rsplit('.', 1)[0]}."
        if prefix_used in addresses:
            raise TestbedError(f"the host already has an address in{prefix_used}0/24: pick another subnet")
    run.mkdir(parents=True, exist_ok=True)
    state = State(arch=arch)
    state_path = run / STATE_FILE
    state.save(state_path)
    try:
        # A foreign arch: qemu through binfmt_misc, before debootstrap's second stage needs it.
        emulation = binfmt_setup(arch, progress)
        state.binfmt_mounted, state.binfmt_registered = emulation.mounted, emulation.registered
        state.save(state_path)
        root, built, root_seconds = ensure_root(cache, arch, progress, suite)
        state.root = str(root)
        if not built:
            progress(f"reusing the cached root {root}")
        key = run / "id_ed25519"
        if not key.exists():
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "fog-testbed", "-f", str(key)], "ssh-keygen")
        state.key = str(key)
        pubkey = (run / "id_ed25519.pub").read_text()
        for i, (name, address) in enumerate(bridges):
            _run(["ip", "link", "add", name, "type", "bridge"], f"creating bridge {name}")
            if i == 0:
                state.bridge = name
            else:
                state.uplink_bridge = name
            state.save(state_path)
            _run(["ip", "addr", "add", f"{address}/{plan.prefix_len}", "dev", name], "bridge address")
            _run(["ip", "link", "set", name, "up"], "bridge up")
        known_hosts = run / "known_hosts"
        lines = []
        logs = run / "logs"
        logs.mkdir(exist_ok=True)
        for node in plan.nodes:
            mdir = run / "machines" / node.name
            merged = _prepare_machine(node, plan, root, mdir, pubkey)
            entry: Dict[str, object] = {"name": node.name, "address": node.address, "mount": str(merged), "pid": None}
            if node.bridge:
                entry["bridge"] = node.bridge
            if node.uplink_address:
                entry["uplink_address"] = node.uplink_address
            state.nodes.append(entry)
            state.save(state_path)
            lines.append(_host_key_line(node, merged))
            entry["pid"] = _boot(node, merged, plan.bridge_of(node), logs / f"{node.name}.console",
                                 plan.uplink_bridge)
            state.save(state_path)
            progress(f"booting {node.name} ({node.address}), nspawn pid {entry['pid']}")
            if needs_emulation(arch):
                address_from_host(int(entry["pid"]), node, plan.prefix_len)
        known_hosts.write_text("".join(lines))
        for node in plan.nodes:
            wait_ssh(node.address, key, known_hosts, boot_timeout or BOOT_TIMEOUT[arch])
            progress(f"{node.name} is up (sshd answers)")
        passwords = {name: _password() for name in [nd.name for nd in plan.nodes] + ["fogctl-admin"]}
        inv_dir = run / "inventory"
        inv_dir.mkdir(exist_ok=True)
        inventory = inv_dir / "hosts.yml"
        inventory.write_text(inventory_writer(plan, key, known_hosts, passwords,
                                              deb.resolve() if deb is not None else None))
        os.chmod(inventory, 0o600)
        state.inventory = str(inventory)
        state.admin_password = passwords["fogctl-admin"]
        state.save(state_path)
    except BaseException:
        progress("up failed: removing what it added")
        try:
            down(cache, progress=lambda line: None, run=run)
        except TestbedError as exc:  # the failure of up is the error to report; this one is a line
            progress(str(exc))
        raise
    return UpResult(nodes=[{"name": nd.name, "address": nd.address} for nd in plan.nodes], arch=arch,
                    inventory=str(inventory), key=str(key), known_hosts=str(known_hosts),
                    admin_password=passwords["fogctl-admin"], root_built=built,
                    root_seconds=round(root_seconds, 1), seconds=round(time.monotonic() - started, 1))


def _boot(node: Node, mount: Path, bridge: str, console: Path, uplink_bridge: Optional[str] = None) -> int:
    """Start nspawn on the node's disk (its console appended to `console`); returns nspawn's pid.
    A node with an uplink gets its second veth plugged into `uplink_bridge` once nspawn made it."""
    with open(console, "ab") as out:
        proc = subprocess.Popen(nspawn_argv(node, mount, bridge), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    if node.uplink_address:
        if not uplink_bridge:
            raise TestbedError(f"{node.name} has an uplink but the testbed has no uplink bridge")
        link = uplink_link(node)
        if not _wait_until(lambda: Path(f"/sys/class/net/{link}").exists(), 60.0, step=0.1):
            raise TestbedError(f"{node.name}: nspawn made no {link} within 60 s")
        _run(["ip", "link", "set", link, "master", uplink_bridge], f"plugging {link} into {uplink_bridge}")
        _run(["ip", "link", "set", link, "up"], f"{link} up")
    return proc.pid


def _mounts_under(prefix: str) -> List[str]:
    points = [_unescape(line.split()[1]) for line in Path("/proc/self/mounts").read_text().splitlines()]
    return [point for point in points if point.startswith(prefix)]


def _mounted(path: Path) -> bool:
    return str(path) in _mounts_under(str(path))


def _shut_down(machines: str, timeout: float) -> None:
    """A clean shutdown of every container of the run, all at once: SIGTERM makes nspawn ask the
    container's systemd to power off; waits up to `timeout` s for all of them."""
    running = nspawns_under(machines)
    for pid in running:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    if running:
        _wait_until(lambda: not nspawns_under(machines), timeout, step=0.2)


def leftovers(run: Path, names: Iterable[str], bridge: Optional[str], uplink_bridge: Optional[str] = None) -> List[str]:
    """What of a testbed is still on the host: processes on its disks, its nspawns, its mounts,
    the nodes' veths, its bridge. Empty after a complete `down`."""
    machines = f"{os.path.abspath(run / 'machines')}/"
    left = [f"process {pid} on a disk of {run}" for pid in pids_on_disks(machines)]
    left += [f"systemd-nspawn {pid}" for pid in nspawns_under(machines)]
    left += [f"mount {m}" for m in _mounts_under(machines)]
    left += [f"link {link}" for link in [f"vb-{n}" for n in names] + [f"vu-{n}" for n in names]
             + [b for b in (bridge, uplink_bridge) if b] if Path(f"/sys/class/net/{link}").exists()]
    return left


def down(cache: Optional[Path] = None, progress: Progress = _stderr_progress, timeout: float = 30.0,
         run: Optional[Path] = None) -> List[str]:
    """Remove everything `up` added to the host; returns what was removed. Safe to repeat.

    The containers get a clean shutdown first; whatever still runs on a disk of this run after
    `timeout` s, or was left there without its nspawn (an init outlives a killed nspawn), is then
    cut off like a power cut. Then the mounts, veths, bridge and run directory. It ends by
    checking that nothing of the testbed is left (`leftovers`), and says what is if something is."""
    run = Path(os.path.abspath(run or run_dir(cache or cache_dir())))
    machines = f"{run / 'machines'}/"
    state = State.load(run / STATE_FILE)
    removed: List[str] = []
    nodes = state.nodes if state else []
    in_use = [*disks_in_use(machines).values(), *nspawn_directories(machines).values()]
    booted = [str(nd["name"]) for nd in nodes
              if any(path.startswith(f"{Path(str(nd['mount'])).parent}/") for path in in_use)]
    _shut_down(machines, timeout)
    cut = power_cut(machines)
    for name in booted:
        removed.append(f"container {name}")
        progress(f"stopped {name}")
    if cut:
        removed.append(f"power cut: {cut} processes still running after the shutdown")
    # Mounts: those in the state, and any left under the run directory by an interrupted up.
    mounts = {str(nd["mount"]) for nd in nodes if nd.get("mount")} | set(_mounts_under(machines))
    for mount in sorted(mounts):
        if _mounted(Path(mount)):
            _run(["umount", mount], f"umount {mount}")
            removed.append(f"mount {mount}")
    # Only what this run directory's state names: without a state, nothing of this testbed was
    # made (up saves the state before it adds anything), and another testbed's bridge is not ours.
    bridge = state.bridge if state else None
    uplink_bridge = state.uplink_bridge if state else None
    for nd in nodes:
        for veth in (f"vb-{nd['name']}", f"vu-{nd['name']}"):
            if Path(f"/sys/class/net/{veth}").exists():
                subprocess.run(["ip", "link", "del", veth], capture_output=True)
                removed.append(f"veth {veth}")
    for b in (bridge, uplink_bridge):
        if b and Path(f"/sys/class/net/{b}").exists():
            _run(["ip", "link", "del", b], f"deleting bridge {b}")
            removed.append(f"bridge {b}")
    if state is not None:
        removed += binfmt_undo(Binfmt(state.binfmt_mounted, state.binfmt_registered))
    left = leftovers(run, [str(nd["name"]) for nd in nodes], bridge, uplink_bridge)
    if left:
        raise TestbedError(f"down left {', '.join(left)} (the run directory {run} is kept)")
    if run.exists():
        shutil.rmtree(run)
        removed.append(f"directory {run}")
    return removed


def build_root(arch: str = "amd64", cache: Optional[Path] = None,
               progress: Progress = _stderr_progress, suite: str = SUITE) -> Tuple[Path, bool, float]:
    """The cached root of `arch` (built if missing) without booting anything: what `make setup`
    runs so that the suite's testbed test does not debootstrap inside its time budget. A foreign
    arch's qemu registration is undone afterwards."""
    preflight(arch)
    emulation = binfmt_setup(arch, progress)
    try:
        return ensure_root(cache or cache_dir(), arch, progress, suite)
    finally:
        binfmt_undo(emulation)


def load_state(cache: Optional[Path] = None, run: Optional[Path] = None) -> Optional[State]:
    return State.load((run or run_dir(cache or cache_dir())) / STATE_FILE)


def ssh(name: str, command: str, cache: Optional[Path] = None, timeout: float = 120.0,
        check: bool = True, run: Optional[Path] = None) -> subprocess.CompletedProcess:
    """Run a shell command on a node of the running testbed."""
    run = run or run_dir(cache or cache_dir())
    state = State.load(run / STATE_FILE)
    if state is None:
        raise TestbedError("no testbed is up: run `fog-agent testbed up` first")
    match = [nd for nd in state.nodes if nd["name"] == name]
    if not match:
        raise TestbedError(f"no node {name} (nodes: {', '.join(str(nd['name']) for nd in state.nodes)})")
    proc = subprocess.run(ssh_argv(str(match[0]["address"]), run / "id_ed25519", run / "known_hosts", command),
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise TestbedError(f"{name}: `{command}` exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return proc


# ---------------------------------------------------------------------------------------------
# Faults on real nodes: what `fog-agent chaos` does to processes, done to a container.


def _node_entry(state: State, name: str) -> Dict[str, object]:
    match = [nd for nd in state.nodes if nd["name"] == name]
    if not match:
        raise TestbedError(f"no node {name} (nodes: {', '.join(str(nd['name']) for nd in state.nodes)})")
    return match[0]


def _require_state(run: Path) -> State:
    state = State.load(run / STATE_FILE)
    if state is None:
        raise TestbedError("no testbed is up: run `fog-agent testbed up` first")
    return state


@dataclass
class Cut:
    """What `kill_node` did: how many processes it sent SIGKILL to (the container's; its nspawn
    only if it did not exit by itself) and how long until none of them ran; whether the disk went
    too and how long emptying it took (deleting the files of its upper layer)."""
    processes: int
    seconds: float
    wiped: bool = False
    wipe_seconds: float = 0.0


def _machine_dir(entry: Dict[str, object]) -> Path:
    return Path(str(entry["mount"])).parent


def kill_node(name: str, run: Optional[Path] = None, wipe: bool = False) -> Cut:
    """A power cut: every process of the node's container ends at once and no shutdown runs.

    SIGKILL to the container's init takes its whole PID namespace with it, then its nspawn goes
    (`power_cut`); a signal to nspawn alone would leave the container's systemd running. The disk
    (the overlay's upper layer) stays as it was at the cut and `start_node` boots it again. With
    `wipe` the disk is lost too, as when a Pi's SD card dies: the overlay is unmounted and its
    upper layer emptied, so the next `start_node` boots a fresh machine from the root image (a
    node that is already off can be wiped too)."""
    started = time.monotonic()
    run = run or run_dir(cache_dir())
    entry = _node_entry(_require_state(run), name)
    node_dir = f"{_machine_dir(entry)}/"
    if not wipe and not (pids_on_disks(node_dir) or nspawns_under(node_dir)):
        raise TestbedError(f"{name} is not running")
    cut = Cut(processes=power_cut(node_dir), seconds=round(time.monotonic() - started, 2))
    veth = f"vb-{name}"
    if Path(f"/sys/class/net/{veth}").exists():  # gone with the container's namespace, normally
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
    if wipe:
        started = time.monotonic()
        _wipe_disk(_machine_dir(entry))
        cut.wiped, cut.wipe_seconds = True, round(time.monotonic() - started, 2)
    return cut


def _wipe_disk(machine: Path) -> None:
    """Unmount the node's overlay and empty its upper and work directories (an overlay's layers
    must not change while it is mounted): what is left is the root image alone."""
    if _mounted(machine / "root"):
        _run(["umount", str(machine / "root")], f"umount {machine / 'root'}")
    for layer in (machine / "upper", machine / "work"):
        for child in layer.iterdir() if layer.is_dir() else ():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()


def _node_of(state: State, entry: Dict[str, object]) -> Node:
    bridge, uplink = entry.get("bridge"), entry.get("uplink_address")
    return Node(str(entry["name"]), str(entry["address"]), state.arch, str(bridge) if bridge else None,
                str(uplink) if uplink else None)


def _plan_of(state: State) -> Plan:
    """The plan a running testbed was made from, as its state records it."""
    nodes = tuple(_node_of(state, nd) for nd in state.nodes)
    uplink_host = None
    if state.uplink_bridge:
        first = next((n for n in nodes if n.uplink_address), None)
        uplink_host = f"{first.uplink_address.rsplit('.', 1)[0]}.1" if first and first.uplink_address else None
    return Plan(nodes=nodes, arch=state.arch, bridge=str(state.bridge),
                host_address=f"{nodes[0].address.rsplit('.', 1)[0]}.1", uplink_bridge=state.uplink_bridge,
                uplink_host_address=uplink_host)


def _fresh_disk(state: State, node: Node, machine: Path, run: Path) -> None:
    """Make a wiped node's disk as `up` made it: the root image with the testbed's identity of the
    node on top (a new machine id and new SSH host keys, whose line in known_hosts is replaced)."""
    lower = Path(state.root) if state.root else root_dir(cache_dir(), state.arch)
    merged = _prepare_machine(node, _plan_of(state), lower, machine, (run / "id_ed25519.pub").read_text())
    known_hosts = run / "known_hosts"
    kept = [ln for ln in known_hosts.read_text().splitlines(keepends=True) if not ln.startswith(f"{node.address} ")]
    known_hosts.write_text("".join(kept) + _host_key_line(node, merged))


def start_node(name: str, run: Optional[Path] = None, boot_timeout: Optional[float] = None,
               progress: Progress = lambda line: None) -> int:
    """Boot a node that was killed (or powered off) again on its disk; returns nspawn's pid.

    One machine per disk: while any process of the node's previous boot runs (its nspawn, or
    anything on its disk) it refuses and names them; `kill_node` ends them. After a wipe the disk
    is made again first (`_fresh_disk`): what the testbed itself put there is back, what Ansible
    installed is not."""
    run = run or run_dir(cache_dir())
    state = _require_state(run)
    entry = _node_entry(state, name)
    machine = _machine_dir(entry)
    running = sorted(set(nspawns_under(f"{machine}/") + pids_on_disks(f"{machine}/")))
    if running:
        raise TestbedError(f"{name} is running (pids {', '.join(map(str, running))}); one machine per disk: "
                           f"`fog-agent testbed kill {name}` first")
    node = _node_of(state, entry)
    mount = Path(str(entry["mount"]))
    if not _mounted(mount):
        _fresh_disk(state, node, machine, run)
        progress(f"{name}: a fresh disk from the root image with the testbed's identity of the node; reinstall "
                 f"the agent: ansible-playbook -i {state.inventory} site.yml --limit {name}")
    entry["pid"] = _boot(node, mount, str(node.bridge or state.bridge), run / "logs" / f"{name}.console",
                         state.uplink_bridge)
    state.save(run / STATE_FILE)
    if needs_emulation(state.arch):
        address_from_host(int(entry["pid"]), node, PREFIX_LEN)
    wait_ssh(node.address, run / "id_ed25519", run / "known_hosts", boot_timeout or BOOT_TIMEOUT[state.arch])
    return int(entry["pid"])  # type: ignore[arg-type]


def partition(name: str, cut: bool, run: Optional[Path] = None, uplink: bool = False, silent: bool = False) -> None:
    """Cut the node off the bridge (every other node, the broker, the host) or heal it: the host
    side of its veth goes down or up; the container sees its link drop, nothing is restarted.

    `uplink`: only a site broker's link to the centre (`vu-<name>`, testbed_sites): its site's
    nodes still reach it on the site's bridge, the centre does not. `silent` (uplink only): the
    link stays up but is unplugged from the uplink bridge, so packets vanish with no carrier loss
    and no reset, as when a radio link drops beyond the site's own interface (a connect then
    waits for its SYN timeout instead of failing at once)."""
    run = run or run_dir(cache_dir())
    state = _require_state(run)
    entry = _node_entry(state, name)
    if uplink and not entry.get("uplink_address"):
        raise TestbedError(f"{name} has no uplink (only a site broker of `testbed up --sites` has one)")
    if silent and not uplink:
        raise TestbedError("a silent cut is for an uplink only: add --uplink")
    link = f"vu-{name}" if uplink else f"vb-{name}"
    what = f"{name}'s uplink" if uplink else name
    if silent:
        argv = ["ip", "link", "set", link, "nomaster"] if cut else ["ip", "link", "set", link, "master",
                                                                    str(state.uplink_bridge)]
        _run(argv, f"{'cutting' if cut else 'healing'} {what} (silent)")
        return
    _run(["ip", "link", "set", link, "down" if cut else "up"], f"{'cutting' if cut else 'healing'} {what}")
