"""`fog-agent testbed up|down|ssh|kill|start|...`: a fleet of systemd-nspawn Debian containers on this machine."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Dict


def register(groups: Any) -> None:
    p = groups.root.add_parser(
        "testbed", help="boot a fleet of Debian containers (systemd as PID 1, sshd, an Ansible inventory)")
    sub = p.add_subparsers(dest="testbed_command", metavar="ACTION")
    p.set_defaults(func=lambda args: (p.print_help(sys.stderr), 2)[1])

    up = sub.add_parser("up", help="build or reuse the cached root, boot N containers, write the inventory")
    up.add_argument("--nodes", type=int, default=2, help="number of containers (default 2); with --sites, per site")
    up.add_argument("--sites", type=int, default=None,
                    help="boot S sites of --nodes nodes (the first of each runs the site broker) and a central "
                         "node (central broker and collector) on a bridge of its own, reached by each site "
                         "broker through an uplink that `partition --uplink` cuts alone")
    up.add_argument("--arch", choices=("amd64", "arm64"), default="amd64",
                    help="architecture of the root (arm64 needs qemu-user-static and binfmt_misc)")
    up.add_argument("--deb", type=Path, default=None,
                    help="the .deb the inventory installs (fog_agent_deb_src); else pass it to ansible-playbook")
    up.add_argument("--json", action="store_true", help="print the result as JSON")
    up.set_defaults(func=up_cmd)

    root = sub.add_parser("root", help="build the cached Debian root if it is missing (what `make setup` runs), "
                          "boot nothing")
    root.add_argument("--arch", choices=("amd64", "arm64"), default="amd64",
                      help="architecture of the root (arm64: qemu-user-static; 10 to 45 minutes)")
    root.add_argument("--suite", choices=("bookworm", "trixie"), default="bookworm",
                      help="Debian release of the root (Debian 12 bookworm, the Pi's; 13 trixie)")
    root.add_argument("--json", action="store_true", help="print the result as JSON")
    root.set_defaults(func=root_cmd)

    down = sub.add_parser("down", help="stop the containers and remove everything up added to the host")
    down.add_argument("--arm64", action="store_true", help="the node of `testbed arm64 --keep-up` instead")
    down.add_argument("--json", action="store_true", help="print what was removed as JSON")
    down.set_defaults(func=down_cmd)

    sd = sub.add_parser("systemd", help="check fog-agent.service live on a node: readiness, reload, journal "
                        "priorities, watchdog, restarts (about 2 minutes)")
    sd.add_argument("node", help="node name, e.g. fog2 (the agent must be installed and running)")
    sd.add_argument("--checks", default="ready,reload,journal_priority,watchdog,restart_keeps_retrying",
                    help="comma-separated checks, in order (default: all)")
    sd.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    sd.set_defaults(func=systemd_cmd)

    pl = sub.add_parser("pipeline", help="deploy a taxi pipeline with a load step on the fleet, follow where "
                        "its instances run, undeploy, verify every record exactly once")
    pl.add_argument("--duration", type=float, default=60.0, help="seconds of source load (default 60)")
    pl.add_argument("--rate", type=float, default=500.0, help="records/s of the load step (default 500)")
    pl.add_argument("--keep", type=Path, default=None,
                    help="copy the collected source positions and sink ids (and the pipeline) into this directory")
    pl.add_argument("--during", default=None, metavar="CMD",
                    help="a shell command run on the host while the pipeline runs (e.g. a rolling ansible-playbook); "
                         "the verdict waits for it")
    pl.add_argument("--during-at", type=float, default=10.0, help="seconds after the deploy to start --during")
    pl.add_argument("--json", action="store_true", help="print the verdict as JSON")
    pl.set_defaults(func=pipeline_cmd)

    upg = sub.add_parser("upgrade", help="while the pipeline runs, apt-get install a newer build of the package on "
                         "each node in turn; verdict: every record, every node upgraded")
    upg.add_argument("--deb", type=Path, required=True,
                     help="the newer package (or, with --as-version, the package to relabel as a newer one)")
    upg.add_argument("--as-version", default=None, metavar="VERSION",
                     help="relabel --deb as this later Debian version (same wheels), e.g. 0.2.0+up1")
    upg.add_argument("--nodes", default=None, help="comma-separated nodes to upgrade, in order (default: all)")
    upg.add_argument("--duration", type=float, default=90.0, help="seconds of source load (default 90)")
    upg.add_argument("--rate", type=float, default=300.0, help="records/s of the load step (default 300)")
    upg.add_argument("--at", type=float, default=15.0, help="seconds after the deploy to start upgrading")
    upg.add_argument("--json", action="store_true", help="print the verdict as JSON")
    upg.set_defaults(func=upgrade_cmd)

    sc = sub.add_parser("scenarios", help="per Debian release: boot a small testbed, run site.yml (converge), "
                        "again (idempotence: changed=0), verify the agents, tear down; a pass/fail table")
    sc.add_argument("--deb", type=Path, required=True, help="the package the role installs (build-deb.sh --out)")
    sc.add_argument("--distros", default="bookworm,trixie",
                    help="comma-separated Debian releases (default bookworm,trixie; roots built once if missing)")
    sc.add_argument("--nodes", type=int, default=2, help="nodes per testbed (default 2: a broker node and one more)")
    sc.add_argument("--json", action="store_true", help="print the report as JSON")
    sc.set_defaults(func=scenarios_cmd)

    arm = sub.add_parser("arm64", help="boot one arm64 node under qemu, install the .deb, run the agent and a "
                         "short pipeline through it, verify, remove it (a testbed of its own)")
    arm.add_argument("--deb", type=Path, required=True, help="the package (Architecture: all)")
    arm.add_argument("--duration", type=float, default=40.0, help="seconds of source load (default 40)")
    arm.add_argument("--rate", type=float, default=60.0, help="records/s of the load step (default 60)")
    arm.add_argument("--keep-up", action="store_true", help="leave the node running (remove it with "
                     "`fog-agent testbed down --arm64`)")
    arm.add_argument("--json", action="store_true", help="print the verdict as JSON")
    arm.set_defaults(func=arm64_cmd)

    kill = sub.add_parser("kill", help="power cut: every process of a node's container ends at once, no shutdown "
                          "(its disk stays as it was at the cut; `start` boots it)")
    kill.add_argument("node")
    kill.add_argument("--wipe", action="store_true",
                      help="lose the disk too (a dead SD card): `start` then boots a fresh machine from the root "
                      "image; run the playbook for the node again to reinstall the agent")
    kill.set_defaults(func=fault_cmd, fault="kill")
    start = sub.add_parser("start", help="boot a killed node again on its disk (refused while any process of its "
                           "previous boot runs: one machine per disk)")
    start.add_argument("node")
    start.set_defaults(func=fault_cmd, fault="start")
    part = sub.add_parser("partition", help="cut a node off the bridge (its veth down) for --seconds, or --heal")
    part.add_argument("node")
    group = part.add_mutually_exclusive_group(required=True)
    group.add_argument("--seconds", type=float, help="cut, wait, heal")
    group.add_argument("--cut", action="store_true", help="cut and return")
    group.add_argument("--heal", action="store_true", help="heal a cut node")
    part.add_argument("--uplink", action="store_true",
                      help="only a site broker's link to the centre (`up --sites`): its site keeps its broker")
    part.add_argument("--silent", action="store_true",
                      help="with --uplink: unplug the link instead of taking it down (no carrier loss: packets vanish)")
    part.set_defaults(func=fault_cmd, fault="partition")

    cut = sub.add_parser("uplink-cut", help="sites testbed: a pipeline on each site, one site's uplink cut for "
                         "--cut-seconds, healed; verdict: every record of every site landed once at the centre")
    cut.add_argument("--cut-seconds", type=float, default=300.0, help="length of the cut (default 300)")
    cut.add_argument("--site", default=None, help="the site whose uplink is cut (default: the first)")
    cut.add_argument("--cut-at", type=float, default=40.0, help="seconds after the deploy to cut (default 40)")
    cut.add_argument("--after", type=float, default=60.0,
                     help="seconds the sources keep running after the heal (default 60)")
    cut.add_argument("--rate", type=float, default=200.0, help="records/s of each site's load step (default 200)")
    cut.add_argument("--land-timeout", type=float, default=600.0,
                     help="seconds to wait for the spill to land after the pipelines ended (default 600)")
    cut.add_argument("--silent", action="store_true",
                     help="a silent cut: the uplink stays up but packets vanish (see `partition --silent`)")
    cut.add_argument("--json", action="store_true", help="print the summary as JSON")
    cut.set_defaults(func=uplink_cut_cmd)

    ssh = sub.add_parser("ssh", help="run a command on a node (as root, with the fleet's key)")
    ssh.add_argument("node", help="node name, e.g. fog1")
    ssh.add_argument("cmd", nargs=argparse.REMAINDER, help="the command (a shell line)")
    ssh.set_defaults(func=ssh_cmd)


def up_cmd(args: argparse.Namespace) -> int:
    from foglab.tools import testbed

    try:
        if args.sites is not None:
            from foglab.tools import testbed_sites

            result, layout = testbed_sites.up_sites(args.sites, args.nodes, deb=args.deb, arch=args.arch)
            if not args.json:
                for site in layout.sites:
                    print(f"{site.name}: {', '.join(site.nodes)} (broker {site.broker}, bridge identity {site.identity})")
                print(f"central: {layout.central}")
        else:
            result = testbed.up(args.nodes, args.arch, deb=args.deb)
    except testbed.TestbedError as exc:
        print(f"testbed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(asdict(result), indent=1))
    else:
        for node in result.nodes:
            print(f"{node['name']}\t{node['address']}")
        print(f"inventory: {result.inventory}")
        print(f"ssh: fog-agent testbed ssh {result.nodes[0]['name']} CMD   (key {result.key})")
        root = f"built in {result.root_seconds:.0f} s" if result.root_built else "cached"
        print(f"up in {result.seconds:.1f} s (root {root})")
    return 0


def root_cmd(args: argparse.Namespace) -> int:
    from foglab.tools import testbed

    try:
        root, built, seconds = testbed.build_root(args.arch, suite=args.suite)
    except testbed.TestbedError as exc:
        print(f"testbed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"root": str(root), "arch": args.arch, "suite": args.suite, "built": built, "seconds": round(seconds, 1)}))
    else:
        print(f"{root}: " + (f"built in {seconds:.0f} s" if built else "cached"))
    return 0


def down_cmd(args: argparse.Namespace) -> int:
    from foglab.tools import testbed

    try:
        if args.arm64:
            from foglab.tools.testbed_arm64 import run_dir

            removed = testbed.down(run=run_dir())
        else:
            removed = testbed.down()
    except testbed.TestbedError as exc:
        print(f"testbed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"removed": removed}, indent=1))
    else:
        print("\n".join(removed) if removed else "nothing to remove")
    return 0


def ssh_cmd(args: argparse.Namespace) -> int:
    from foglab.tools import testbed

    try:
        proc = testbed.ssh(args.node, " ".join(args.cmd), check=False, timeout=3600)
    except testbed.TestbedError as exc:
        print(f"testbed: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    return proc.returncode


def systemd_cmd(args: argparse.Namespace) -> int:
    from foglab.tools import testbed, testbed_systemd

    def sh(line: str) -> "tuple[int, str]":
        proc = testbed.ssh(args.node, line, check=False)
        return proc.returncode, proc.stdout + proc.stderr

    names = [n for n in args.checks.split(",") if n]
    unknown = [n for n in names if n not in testbed_systemd.CHECKS]
    if unknown:
        print(f"testbed: unknown check {', '.join(unknown)} (known: {', '.join(testbed_systemd.CHECKS)})",
              file=sys.stderr)
        return 2
    try:
        checks = testbed_systemd.run_checks(sh, names)
    except (testbed.TestbedError, RuntimeError, TimeoutError) as exc:
        print(f"testbed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=1))
    else:
        for c in checks:
            print(f"{'ok  ' if c.ok else 'FAIL'} {c.name}: {json.dumps(c.detail)}")
    return 0 if all(c.ok for c in checks) else 1


def pipeline_cmd(args: argparse.Namespace) -> int:
    from foglab.tools import testbed, testbed_pipeline

    try:
        summary = testbed_pipeline.run_pipeline(args.duration, args.rate, keep=args.keep, during=args.during,
                                               during_at=args.during_at)
    except testbed.TestbedError as exc:
        print(f"testbed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        for key, value in summary.items():
            print(f"{key:20} {value}")
        print("verdict              " + ("OK: every record exactly once" if summary["ok"] else "FAILED"))
    return 0 if summary["ok"] else 1


def _verdict(run: Callable[[], Dict[str, Any]], as_json: bool) -> int:
    """Run a testbed experiment; print its summary (or JSON) and the verdict; exit 0 only if ok."""
    from foglab.tools import testbed

    try:
        summary = run()
    except testbed.TestbedError as exc:
        print(f"testbed: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(summary, indent=1, default=str))
    else:
        for key, value in summary.items():
            print(f"{key:20} {value}")
        print("verdict              " + ("OK" if summary["ok"] else "FAILED"))
    return 0 if summary["ok"] else 1


def upgrade_cmd(args: argparse.Namespace) -> int:
    import tempfile

    from foglab.tools import testbed_upgrade

    def run() -> Dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="fog-upgrade-") as tmp:
            deb = args.deb.resolve()
            if args.as_version:
                deb = testbed_upgrade.relabel_deb(deb, args.as_version, Path(tmp))
            nodes = [n for n in args.nodes.split(",") if n] if args.nodes else None
            return testbed_upgrade.run_upgrade(deb, nodes, args.duration, args.rate, args.at)

    return _verdict(run, args.json)


def scenarios_cmd(args: argparse.Namespace) -> int:
    from foglab.tools import testbed, testbed_scenarios

    try:
        report = testbed_scenarios.run_scenarios(
            args.deb.resolve(), [d for d in args.distros.split(",") if d], nodes=args.nodes,
            progress=lambda line: print(f"testbed: {line}", file=sys.stderr, flush=True))
    except testbed.TestbedError as exc:
        print(f"testbed: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report.to_dict(), indent=1) if args.json else testbed_scenarios.table(report))
    return 0 if report.ok else 1


def arm64_cmd(args: argparse.Namespace) -> int:
    from foglab.tools import testbed_arm64

    return _verdict(lambda: testbed_arm64.arm64_check(args.deb.resolve(), args.duration, args.rate,
                                                      keep_up=args.keep_up), args.json)


def fault_cmd(args: argparse.Namespace) -> int:
    import time

    from foglab.tools import testbed

    try:
        if args.fault == "kill":
            cut = testbed.kill_node(args.node, wipe=args.wipe)
            print(f"{args.node}: power cut, {cut.processes} processes ended in {cut.seconds:.1f} s"
                  + (f"; disk wiped in {cut.wipe_seconds:.1f} s (`start` boots a fresh machine)" if cut.wiped
                     else "; disk kept"))
        elif args.fault == "start":
            pid = testbed.start_node(args.node, progress=lambda line: print(f"testbed: {line}", file=sys.stderr))
            print(f"{args.node}: booted (nspawn pid {pid}), sshd answers")
        elif args.heal:
            testbed.partition(args.node, cut=False, uplink=args.uplink, silent=args.silent)
            print(f"{args.node}: healed")
        else:
            testbed.partition(args.node, cut=True, uplink=args.uplink, silent=args.silent)
            print(f"{args.node}: {'uplink ' if args.uplink else ''}cut off")
            if args.seconds is not None:
                try:
                    time.sleep(args.seconds)
                finally:
                    testbed.partition(args.node, cut=False, uplink=args.uplink, silent=args.silent)
                print(f"{args.node}: healed after {args.seconds:g} s")
    except testbed.TestbedError as exc:
        print(f"testbed: {exc}", file=sys.stderr)
        return 1
    return 0


def uplink_cut_cmd(args: argparse.Namespace) -> int:
    from foglab.tools import testbed, testbed_uplink

    try:
        summary = testbed_uplink.run_uplink_cut(cut_seconds=args.cut_seconds, site=args.site, cut_at=args.cut_at,
                                                after=args.after, rate=args.rate, land_timeout=args.land_timeout,
                                                silent=args.silent)
    except (testbed.TestbedError, ValueError) as exc:
        print(f"testbed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary, indent=1, default=str))
    else:
        print(testbed_uplink.table(summary))
    return 0 if summary["ok"] else 1
