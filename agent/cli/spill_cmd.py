"""Spill commands: the central collector, the batch analytics, and their benchmarks.

    fog-agent collector --config central.toml
    fog-agent analytics run --landing DIR --out DIR [--master URL]
    fog-agent analytics synth --landing DIR --records N [--master URL]
    fog-agent bench spill [--records N] [--batch 100] [--json]
    fog-agent bench analytics [--records 10000000] [--master local[*]] [--workdir DIR]

PySpark and matplotlib are imported inside the handlers: the Pis never install them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

EXIT_OK, EXIT_ERROR = 0, 1


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

    b = groups.bench.add_parser("spill", help="sink throughput with the spill on vs off (same run)")
    b.add_argument("--records", type=int, default=200_000)
    b.add_argument("--batch", type=int, default=100)
    b.add_argument("--reps", type=int, default=3)
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench_spill)

    ba = groups.bench.add_parser("analytics", help="the batch job over N synthetic records (default 10M)")
    ba.add_argument("--records", type=int, default=10_000_000)
    ba.add_argument("--master", default="local[*]")
    ba.add_argument("--workdir", default=None, help="where the landing zone and output go (default: temp)")
    ba.add_argument("--driver-memory", default="4g")
    ba.add_argument("--json", action="store_true")
    ba.set_defaults(func=cmd_bench_analytics)


# ---- collector ---------------------------------------------------------------------------------


def cmd_collector(args: argparse.Namespace) -> int:
    from agent.central_config import load_central_config
    from agent.collector.service import BatchScheduler, Collector
    from agent.config import resolve_password
    from agent.schema import ConfigError

    try:
        cfg = load_central_config(args.config)
        password = resolve_password(cfg.mqtt)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    scheduler = None
    if cfg.analytics.enabled:
        scheduler = BatchScheduler(cfg.collector.landing_dir, cfg.analytics.out_dir, cfg.analytics.master,
                                   cfg.analytics.schedule_seconds, cfg.analytics.trigger_files, time.time())
    coll = Collector(cfg.collector.cluster, cfg.collector.landing_dir, host=cfg.mqtt.host, port=cfg.mqtt.port,
                     client_id=cfg.collector.client_id, partial_timeout=cfg.collector.partial_timeout,
                     scheduler=scheduler, username=cfg.mqtt.username, password=password)
    # Signal handlers only ask the loop to stop; the loop owns the client and the landing zone.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: coll._stop.set())
    print(f"collector: cluster {cfg.collector.cluster}, landing {cfg.collector.landing_dir}, "
          f"broker {cfg.mqtt.host}:{cfg.mqtt.port}", file=sys.stderr)
    coll.serve_forever()
    print(json.dumps(coll.core.stats), file=sys.stderr)
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


def cmd_bench_analytics(args: argparse.Namespace) -> int:
    from agent.analytics.job import build_session, run_job
    from agent.analytics.synth import write_synthetic_landing

    work = Path(args.workdir or tempfile.mkdtemp(prefix="fog-bench-analytics-"))
    landing, out = work / "landing", work / "out"
    spark = build_session(args.master, driver_memory=args.driver_memory)
    try:
        t0 = time.monotonic()
        write_synthetic_landing(spark, landing, args.records, 1)
        t_gen = time.monotonic() - t0
        t0 = time.monotonic()
        report = run_job(spark, landing, out)
        t_job = time.monotonic() - t0
        cores = spark.sparkContext.defaultParallelism
    finally:
        spark.stop()
    size = sum(p.stat().st_size for p in landing.rglob("*.gz"))
    res = {"records": args.records, "master": args.master, "parallelism": cores,
           "generate_s": round(t_gen, 1), "job_s": round(t_job, 1),
           "records_per_s": round(args.records / t_job), "landing_bytes": size,
           "report": str(report), "plans": str(out / "plans.txt")}
    print(json.dumps(res) if args.json else "\n".join(f"{k:>14}: {v}" for k, v in res.items()))
    return EXIT_OK


# ---- spill benchmark ---------------------------------------------------------------------------


def _make_batches(n: int, batch: int) -> List[bytes]:
    try:
        from agent.runtime.taxi import TaxiGenerator

        gen = TaxiGenerator(1, "bench").record
    except ImportError:  # pragma: no cover - the runtime area not installed
        gen = lambda: {"fare_amount": 10.0, "pickup_datetime": "2013-01-01 00:00:00"}  # noqa: E731
    recs = [dict(gen(), src="bench", seq=i) for i in range(n)]
    return [json.dumps(recs[i:i + batch], separators=(",", ":")).encode() for i in range(0, n, batch)]


def _sink_run(batches: List[bytes], work: Path, mode: str) -> Tuple[float, Dict[str, Any]]:
    """One sink run: decode each batch as received, dedupe and record ids (the counting sink's
    work), and with the spill on, spool the records ('raw': the received batch as one line;
    'encode': re-encode the decoded records) while a shipper lands closed files concurrently."""
    from agent.runtime.shipper import PathShipper
    from agent.runtime.spool import Spool

    ids_path = work / f"ids-{mode}-{time.monotonic_ns()}"
    spool = stop = shipper_thread = shipper = None
    if mode != "off":
        spool = Spool(work / f"spool-{time.monotonic_ns()}", "bench", background=True,
                      rotate_bytes=1 << 20)
        shipper = PathShipper(spool, work / "landing")
        stop = threading.Event()

        def ship() -> None:
            while not stop.is_set():
                shipper.ship_once()
                stop.wait(0.05)

        shipper_thread = threading.Thread(target=ship, daemon=True)
        shipper_thread.start()
    seen: set = set()
    n = 0
    t0, c0 = time.perf_counter(), time.process_time()
    with open(ids_path, "a", buffering=1 << 16) as fh:
        for payload in batches:
            items = json.loads(payload)
            lines = []
            for r in items:
                key = (r["src"], r["seq"])
                if key in seen:
                    continue
                seen.add(key)
                lines.append(f"{key[0]} {key[1]}\n")
            fh.write("".join(lines))
            fh.flush()
            n += len(items)
            if spool is not None:
                if mode == "raw":
                    while not spool.append_lines("records", [payload + b"\n"]):
                        spool.wait_writable(0.1)
                else:
                    while spool.append_many("records", items) == 0:
                        spool.wait_writable(0.1)
    if spool is not None:
        spool.close()  # writes what is queued: part of the sink's cost
    elapsed = time.perf_counter() - t0
    extra: Dict[str, Any] = {"cpu_us_per_record": (time.process_time() - c0) / max(n, 1) * 1e6}
    if spool is not None:
        stop.set()
        shipper_thread.join()
        shipper.ship_once()
        extra.update(spool.stats)
    return n / elapsed, extra


def cmd_bench_spill(args: argparse.Namespace) -> int:
    batches = _make_batches(args.records, args.batch)
    rates: Dict[str, List[float]] = {"off": [], "raw": [], "encode": []}
    cpu: Dict[str, List[float]] = {m: [] for m in rates}
    with tempfile.TemporaryDirectory(prefix="fog-bench-spill-") as tmp:
        work = Path(tmp)
        _sink_run(batches[: max(1, len(batches) // 10)], work, "off")  # warm-up
        for _ in range(args.reps):  # interleaved, so that machine noise hits all modes alike
            for mode in rates:
                rate, extra = _sink_run(batches, work, mode)
                rates[mode].append(rate)
                cpu[mode].append(extra["cpu_us_per_record"])
        landed = sum(1 for _ in (work / "landing").rglob("*.jsonl.gz"))
    med = {m: statistics.median(v) for m, v in rates.items()}
    mcpu = {m: statistics.median(v) for m, v in cpu.items()}
    res = {
        "records": args.records, "batch": args.batch, "reps": args.reps,
        "sink_off_rps": round(med["off"]), "sink_spill_raw_rps": round(med["raw"]),
        "sink_spill_encode_rps": round(med["encode"]),
        "ratio_raw": round(med["raw"] / med["off"], 3), "ratio_encode": round(med["encode"] / med["off"], 3),
        # CPU per record (all threads: sink, spool writer, shipper): less sensitive to other load.
        "cpu_us_per_record_off": round(mcpu["off"], 1), "cpu_us_per_record_raw": round(mcpu["raw"], 1),
        "cpu_us_per_record_encode": round(mcpu["encode"], 1),
        "files_landed": landed, "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(res) if args.json else "\n".join(f"{k:>22}: {v}" for k, v in res.items()))
    return EXIT_OK
