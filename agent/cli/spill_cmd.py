"""Spill commands: the central collector and the batch analytics.

    fog-agent collector --config central.toml
    fog-agent analytics run --landing DIR --out DIR [--master URL]
    fog-agent analytics synth --landing DIR --records N [--master URL]

PySpark and matplotlib are imported inside the handlers: the Pis never install them.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_ERROR = 0, 1
EXIT_CONFIG = 78  # EX_CONFIG: fog-collector.service does not restart (RestartPreventExitStatus=78)


def register(groups: Any) -> None:
    p = groups.root.add_parser("collector", help="receive spilled files over MQTT and land them "
                                                 "(kind/date/node), run the batch job on schedule")
    p.add_argument("--config", required=True, help="central.toml (see examples/central.toml)")
    p.set_defaults(func=cmd_collector)

    a = groups.root.add_parser("analytics", help="PySpark batch jobs over a landing zone")
    sub = a.add_subparsers(dest="analytics_command", metavar="ACTION")
    a.set_defaults(func=lambda args, a=a: (a.print_help(sys.stderr), 2)[1])
    r = sub.add_parser("run", help="DEBS 2015 queries, elasticity report, accounting: Parquet + report.md")
    r.add_argument("--landing", required=True, help="landing zone (kind=/date=/node= directories)")
    r.add_argument("--out", required=True, help="output directory (Parquet tables, report.md, PNGs)")
    r.add_argument("--master", default="local[*]", help="Spark master URL (default local[*])")
    r.add_argument("--period", type=float, default=5.0, help="metrics sampling period in seconds")
    r.set_defaults(func=cmd_analytics_run)
    s = sub.add_parser("synth", help="write N synthetic DEBS 2015 records into a landing zone, with Spark")
    s.add_argument("--landing", required=True)
    s.add_argument("--records", type=int, default=1_000_000)
    s.add_argument("--master", default="local[*]")
    s.add_argument("--seed", type=int, default=1)
    s.set_defaults(func=cmd_analytics_synth)



# ---- collector ---------------------------------------------------------------------------------


def cmd_collector(args: argparse.Namespace) -> int:
    from agent.central_config import load_central_config
    from agent.collector.service import BatchScheduler, Collector
    from agent.config import check_tls, resolve_password
    from agent.identity import IdentityError, identity
    from agent.schema import ConfigError

    try:
        cfg = load_central_config(args.config)
        password = resolve_password(cfg.mqtt)
        check_tls(cfg.mqtt, cfg.source)  # a bad CA/cert/key: one line now, not paho's traceback later
        tls = cfg.mqtt.tls
        who = identity(cfg.mqtt.username if tls is None or tls.cert_file is None else None,
                       tls.cert_file if tls else None, cfg.collector.client_id)
    except (ConfigError, IdentityError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    scheduler = None
    if cfg.analytics.enabled:
        scheduler = BatchScheduler(cfg.collector.landing_dir, cfg.analytics.out_dir, cfg.analytics.master,
                                   cfg.analytics.schedule_seconds, cfg.analytics.trigger_files, time.time())
    coll = Collector(cfg.collector.cluster, cfg.collector.landing_dir, host=cfg.mqtt.host, port=cfg.mqtt.port,
                     client_id=cfg.collector.client_id, partial_timeout=cfg.collector.partial_timeout,
                     scheduler=scheduler, username=cfg.mqtt.username, password=password, tls=cfg.mqtt.tls)
    # Signal handlers only ask the loop to stop; the loop owns the client and the landing zone.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: coll._stop.set())
    # The identity the broker will see (docs/security.md): it must be on mosquitto_collector_identities,
    # else the broker accepts the connection and the subscription and delivers nothing.
    print(f"collector: cluster {cfg.collector.cluster}, landing {cfg.collector.landing_dir}, "
          f"broker {cfg.mqtt.host}:{cfg.mqtt.port} {'TLS' if tls else 'plain'}, identity {who}", file=sys.stderr)
    coll.serve_forever()
    print(json.dumps({**coll.core.stats, "bad_messages": coll.bad_messages}), file=sys.stderr)
    return EXIT_OK


# ---- analytics ---------------------------------------------------------------------------------


def cmd_analytics_run(args: argparse.Namespace) -> int:
    from agent.analytics.job import run

    if not Path(args.landing).is_dir():
        print(f"error: landing zone {args.landing} does not exist", file=sys.stderr)
        return EXIT_ERROR
    t0 = time.monotonic()
    report = run(args.landing, args.out, args.master, args.period)
    print(f"report: {report} ({time.monotonic() - t0:.1f} s)")
    return EXIT_OK


def cmd_analytics_synth(args: argparse.Namespace) -> int:
    from agent.analytics.job import build_session
    from agent.analytics.synth import write_synthetic_landing

    spark = build_session(args.master)
    try:
        t0 = time.monotonic()
        write_synthetic_landing(spark, args.landing, args.records, args.seed)
        print(f"{args.records} records in {time.monotonic() - t0:.1f} s -> {args.landing}")
    finally:
        spark.stop()
    return EXIT_OK
