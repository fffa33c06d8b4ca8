"""The `--json` shapes of the lab's `fog-agent` commands: one JSON Schema (draft 2020-12) each.

The node's commands keep theirs in agent/cli/schemas.py, which lists these too where the lab is
installed (`foglab.cli.json_schemas()`); `fog-agent schema COMMAND` prints one, docs/measurement.md
("JSON output") shows them as tables generated from here, and tests/test_lab_json_shapes.py checks
each against its command's output. Names are as typed after `fog-agent` ("dev status", "bench fuzz").

Conventions, fogctl's (agent/fogctl/schemas.py): a key listed is printed unless its row says
"optional"; an object the command builds in one expression has no other key. Two kinds of
document are open instead, and their description says so: those a run fills in as it goes, with
keys that depend on the pipeline or on how far the run got (`demo`, `chaos`, `bench dataplane`,
the testbed's verdicts: the keys listed are those every finished run prints), and per-phase or
per-target figures a benchmark copies as it measured them (an open object in its row).
"""

from __future__ import annotations

from typing import Any, Dict

from agent.fogctl.schemas import (BOOL, DIALECT, INT, NUM, S, _d, _list, _map, _null, _obj, _open)

__all__ = ["SCHEMAS"]

MEDIAN_MAX = _obj({"median": _null(NUM, "seconds; null: no value"), "max": _null(NUM), "n": INT},
                  description="seconds, over n values")
RATIO = _obj({"median": _null(NUM), "max": _null(NUM)})
DROPPED = _null(INT, "messages the broker dropped in the run; null: its $SYS counter was not read")
LOST_ID = dict(_list({"type": ["string", "integer"]}, "[source instance, record number]"), minItems=2, maxItems=2)
VERDICT_COUNTS = {  # the record-id accounting of agent.testing / foglab.tools.verify
    "records_in": _d(INT, "records the source generated"), "records_expected": INT,
    "records_out": _d(INT, "records the sink recorded"), "lost": INT,
    "duplicated": _d(INT, "duplicated and unexpected ids"),
    "lost_sample": _list(LOST_ID, "the first five lost ids"),
}
PIPELINE_VERDICT = {
    "generated": INT, "expected": INT, "received": INT, "lost": INT, "duplicated": INT, "unexpected": INT,
    "lost_sample": _list(LOST_ID, "the first five lost ids"), "ok": _d(BOOL, "every record exactly once"),
}
DEV_NODE = {"node": S, "pid": _null(INT, "null: not running"), "config": _d(S, "its agent.toml"), "log": S}
DEV_REPORT = {
    "state": {"enum": ["up", "already-up"]}, "seconds": _d(NUM, "to bring it up"), "dir": S,
    "broker": _d(S, "host:port"), "port": INT, "cluster": S, "broker_pid": _null(INT),
    "fogctl_config": S, "env_file": _d(S, "DIR/env, for `. DIR/env`"),
    "nodes": _list(_obj(DEV_NODE), "n1..nN"),
}
GME_COMMON = {
    "algorithm": {"enum": ["2fgme", "ra1", "ra2"]},
    "damping": _null(BOOL, "2-FGME's DEVIATIONS 4 and 5; null for RA1/RA2"),
    "nodes": INT, "entries_per_node": INT, "cs_entries": INT, "messages": INT,
    "messages_per_entry": _null(NUM), "latency_ms_mean": _null(NUM, "request -> CS entry"), "latency_ms_p95": NUM,
    "safety_violations": _d(INT, "must be 0"), "unserved_requests": _d(INT, "must be 0"),
}
FUZZ_TARGET = _obj({
    "target": S, "inputs": INT, "accepted": INT, "rejected": _d(INT, "refused with the documented error"),
    "crashes": _d(INT, "must be 0"), "seconds": NUM, "inputs_per_s": NUM,
    "extra": _map(INT, "per-target counters"),
    "failures": _list(_obj({"target": S, "index": _d(INT, "the input's number (replay)"),
                            "kind": _d(S, "crash, hang or a property violated"), "error": S, "input": S,
                            "trace": S})),
})
SCENARIO_STEP = _obj({"suite": _d(S, "Debian release"), "step": S, "ok": _null(BOOL, "null: skipped"),
                      "seconds": NUM, "detail": S})
FAULT = _open("a fault: {t, kind, target, recovery_s, ...} (foglab.tools.chaos.Fault)")

CHAOS_RUN = _obj({
    "seed": INT, "duration": NUM, "min_faults": INT, "min_records": INT, "load_cap_s": NUM,
    "faults_enabled": _list(S), "coordination": {"enum": ["ack", "fgme"]}, "fgme_damping": BOOL,
    "spill_ack": {"enum": ["written", "landed"]},
    "workdir": S, "load_s": _d(NUM, "seconds of load"), "settled": _d(BOOL, "the sink went quiet, every operator back"),
    "settle_s": NUM, "final_instances": _map(INT, "operator -> instances at the end"),
    "back_to_size": BOOL, "protocol_messages": INT, "restarts": INT, "scale_outs": INT, "scale_ins": INT,
    "agent_exit_codes": _open("node -> exit status"),
    "faults": _list(FAULT, "in the order injected"), "faults_injected": INT,
    "all_recovered": BOOL, "recovery_s": RATIO, **VERDICT_COUNTS, "wall_s": NUM,
    "ok": _d(BOOL, "no record lost or duplicated, every fault recovered, back to size"),
}, closed=False, description="one run; more keys per pipeline and per outcome (load_incomplete, windows, "
                             "ingest_stats, locks_held_at_end, ...)")

_SHAPES: Dict[str, Dict[str, Any]] = {
    # ---- dev fleet (lab/foglab/tools/devfleet.py) ----
    "dev up": _obj(DEV_REPORT),
    "dev status": _obj(dict(
        {k: v for k, v in DEV_REPORT.items() if k != "seconds"},
        state={"enum": ["up", "partly up", "stopped"]},
        nodes=_list(_obj(dict(DEV_NODE, status=_d(S, "fogctl's view: online, offline, unknown; stopped: no process"))),
                    "n1..nN"),
        error=_d(S, "why fogctl could not read the fleet")), optional=("error",)),
    "dev down": _obj({
        "dir": S, "stopped": _list(S, "agents, then the broker"), "killed": _list(S, "needed SIGKILL"),
        "left": _list(INT, "processes still there (never: an error instead)"), "pids": _list(INT),
        "purged": _d(BOOL, "--purge removed DIR"), "note": _d(S, "no dev fleet here: nothing to stop"),
    }, optional=("note",)),
    # ---- simulators and checkers ----
    "simulate scaling": _obj({
        "seed": INT, "steps": INT, "operators": INT, "pipelines": INT, "delays": _list(INT, "[min, max] steps"),
        "load": {"enum": ["brownian", "sinusoidal", "monotonic"]}, "baseline": {"enum": ["decentralized", "centralized"]},
        "r_secure": BOOL, "initial_instances": INT, "final_instances": INT,
        "accuracy_mean": _d(NUM, "instances / ideal, mean over steps"), "ideal_throughput_pct_mean": NUM,
        "messages_total": INT, "rounds_started": INT, "drain_steps": INT,
        "lost_records": NUM, "delayed_records": NUM,
        "stale_route_deliveries": _d(INT, "must be 0"), "inconsistent_views_at_quiescence": _d(INT, "must be 0"),
        "protocol_errors": _d(INT, "must be 0"), "messages_to_terminated": _d(INT, "must be 0"),
        "rounds_open_at_end": _d(INT, "must be 0"),
    }),
    "simulate gme": _obj(dict(
        GME_COMMON,
        messages_by_kind=_map(INT, "req, ack, end, ..."),
        occupancy=_map(_obj({"max_in_cs": INT, "max_requesting": INT, "mean_in_cs": NUM, "mean_requesting": NUM}),
                       "group -> CS occupancy"),
        simulated_ms=NUM, sent_per_s=_list(INT, "messages sent per simulated second"),
        send_wait_ms_max=_list(NUM, "per node"))),
    "bench gme": _obj(dict(
        GME_COMMON, think_ms=NUM, cs_ms=NUM, procs=INT, broker_dropped=DROPPED, peak_rss_mb=NUM, wall_s=NUM,
        timed_out=_d(BOOL, "--timeout ended the run (exit 3)"), errors=_list(S),
        timeline=_list(_open("{t_s, sent, inbox_max, delay_ms_mean}"), "per second"),
        node_states=_list(_open("a node's state"), "with timed_out: every node's state")),
        optional=("node_states",)),
    "bench gme-check": _obj({
        "algorithm": {"enum": ["2fgme", "ra1", "ra2"]}, "damping": _null(BOOL), "groups": _list(INT),
        "requests": {"type": ["integer", "array"], "items": INT, "description": "one count for every node, or one per node"},
        "fault": _null(S), "verdict": {"enum": ["ok", "violation"]},
        "reduction": BOOL, "symmetry": BOOL, "merge_dead": BOOL, "hash_states": BOOL, "compiled": _d(BOOL, "--fast"),
        "sweep": BOOL, "fingerprints_held_peak": _null(INT, "--fast only"), "collision_bound": _null(NUM),
        "states": INT, "transitions": INT, "terminal_states": INT, "full_expansions": INT, "local_states": INT,
        "safety_violations": INT, "deadlocks": INT, "protocol_errors": INT,
        "cpu_s": NUM, "wall_s": NUM, "peak_rss_mb": NUM,
        "first_failure": _null(S, "what failed first"), "trace": _list(S, "the last 40 moves to the first failure"),
    }),
    "simulate instance": _obj({
        "ok": BOOL, "states": INT, "terminal_states": INT, "schedules": INT, "steps": INT, "seconds": NUM,
        "seed": _null(INT, "null with --depth"), "handover": _open("key-group hand-over counters (--keyed)"),
        "violation": _null(_obj({"kind": S, "detail": S, "trace": _list(S, "the moves that led to it")}),
                           "the first violation"),
    }),
    "simulate policies": _obj({
        "seeds": INT, "days": NUM,
        "config": _obj({"period": NUM, "cooldown": NUM, "stop_seconds": NUM}),
        "summary": _map(_map(_obj({"mean": NUM, "sd": NUM}), "metric -> mean, sd over the seeds"),
                        "policy -> SPEC metrics (agent/metrics_spec.py)"),
        "runs": _map(_list(_open("the SPEC metrics of one seed, with seed and operations")), "policy -> runs"),
        "bound": _list(_obj({"max_changes": INT, "cost": NUM}), "the clairvoyant bound (with threshold)"),
        "forecast_bound": _list(_obj({"max_changes": INT, "cost": NUM}), "with --pareto"),
    }),
    # ---- benchmarks ----
    "bench fuzz": _obj({
        "seed": INT, "inputs": INT, "crashes": _d(INT, "exit 1 when not 0"), "seconds": NUM, "inputs_per_s": NUM,
        "targets": _list(FUZZ_TARGET, "in the order run"),
    }),
    "bench spill": _obj({
        "records": INT, "batch": INT, "reps": INT, "ack": {"enum": ["written", "landed"]},
        "sink_off_rps": _d(INT, "records/s, median"),
        "sink_spill_rps": INT, "ratio": _d(NUM, "spill on / off"),
        "all_off_rps": _list(INT), "all_on_rps": _list(INT),
        "cpu_us_per_record_off": NUM, "cpu_us_per_record_on": NUM,
        "sink_thread_us_per_record_off": NUM, "sink_thread_us_per_record_on": NUM,
        "cpu_ratio": _d(NUM, "off CPU / on CPU"),
        "ack_ms_p50_off": _d(NUM, "ms from a batch fed to the ack covering it"), "ack_ms_p50_on": NUM,
        "ack_ms_p99_off": NUM, "ack_ms_p99_on": NUM,
        "files_landed": INT, "gzip_engine": S, "cpus": INT,
        "load_avg_1m": NUM,
    }),
    "bench analytics": _obj({
        "records": INT, "master": S, "parallelism": INT, "generate_s": NUM, "job_s": NUM, "records_per_s": INT,
        "landing_bytes": INT, "report": _d(S, "the job's report file"), "plans": _d(S, "the query plans file"),
    }),
    "bench policies": _obj({
        "workdir": S,
        "rows": _list(_obj({
            "policy": S, "mode": {"enum": ["simulated", "live"]},
            "instance_ops": _d(INT, "instances started and stopped"), "records_lost": _d(INT, "exit 1 when not 0"),
        }, closed=False, description="the SPEC metrics (agent/metrics_spec.py) and, live: consolidation, decisions, "
                                     "records_*, node_minutes, site_actions, latency_s, series, ..."),
            "per policy: the simulation on the same trace, then its live run(s)"),
    }),
    "bench rescale": _obj({
        "rate": NUM, "workdir": S,
        **{mode: _obj({"decision_to_first_record_s": MEDIAN_MAX,
                       "breakdown_median_s": _open("the median of each part of a rescale"),
                       "scale_outs": INT, "records": INT, "lost": INT, "duplicated": INT,
                       "start_to_ready_s": MEDIAN_MAX}, description=f"workers {mode}")
           for mode in ("warm", "cold")},
    }),
    "bench spawn": _obj({
        "burst": INT, "rounds": INT, "workdir": S,
        **{mode: _obj({"start_to_ready_s": MEDIAN_MAX, "each": _list(NUM, "seconds, each start"),
                       "forked_starts": INT}) for mode in ("forked", "cold")},
        "cold_over_forked": RATIO,
    }),
    "bench move": _obj({
        "runs": _list(_open("one move: kind, per_node, first_downstream_s, moved_to, lost, duplicated, ..."),
                      "in the order run"),
        "summary": _map(_obj({"all_moved_s_median": _null(NUM), "all_moved_s": _list(_null(NUM)), "lost": INT,
                              "duplicated": INT}), "kind/format (drain/shared, rehome/per_node, ...) -> figures"),
        "workdir": S,
    }),
    "bench dataplane": _obj({
        "batch_size": INT, "record": {"enum": ["taxi", "tiny"]}, "seconds": NUM, "window": INT, "raw_window": INT,
        "mqtt": {"enum": ["5", "3.1.1"]}, "max_instances": _null(INT),
        "dropped": _map(NUM, "phase -> messages the broker dropped (must be 0)"),
        "raw_1proc": _open("records_per_s, payload_bytes, cpu_ms_per_batch, ..."), "raw_2proc": _open("the same"),
        "raw_1proc_encoding": _open("the same, encoding each batch"),
        "pipeline": _open("records_per_s, cpu_ms_per_batch, count_check, ..."),
        "ratio": _d(NUM, "pipeline / one-process raw (goal >= 0.5)"), "ratio_vs_raw_2proc": NUM,
        "ratio_vs_encoding_producer": NUM, "rss_mb": _open("idle_worker, python_paho_baseline"),
        "chained": _open("--chain"), "chained_tail": _open("--chain"), "alternating": _open("--rounds"),
        "rescale": _open("--rescale-cycles"), "error": _d(S, "the run failed (exit 1): the figures so far"),
    }, optional=("raw_1proc", "raw_2proc", "raw_1proc_encoding", "pipeline", "ratio", "ratio_vs_raw_2proc",
                 "ratio_vs_encoding_producer", "rss_mb", "chained", "chained_tail", "alternating", "rescale",
                 "error"), closed=False, description="filled phase by phase; after a failure, what was measured "
                                                     "and error"),
    "bench keyed": _obj({
        "seconds": NUM, "batch_size": INT, "keys": INT,
        **{name: _obj(dict({"records_per_s": NUM, "outputs_per_s": NUM, "state_saves_per_s": NUM,
                            "state_file_bytes": INT, "keys_held": _null(INT)},
                           **({"ratio_vs_stateless": _null(NUM)} if name != "stateless_map" else {})))
           for name in ("stateless_map", "keyed_count", "keyed_window")},
    }),
    "bench handover": {"oneOf": [
        _obj({"rounds": INT, "records_after_redirect": INT, "max_chunk": _d(INT, "bytes"),
              "sizes": _list(_obj({
                  "state_bytes": INT, "wire_bytes": INT, "chunks": INT, "keys_moved": INT,
                  "ms_per_group_median": NUM, "ms_per_group_max": NUM, "snapshot_ms_median": NUM,
                  "install_ms_median": NUM, "snapshot_cpu_ms_median": NUM, "install_cpu_ms_median": NUM,
                  "baseline_empty_ms_median": NUM, "ratio_vs_empty": _null(NUM), "mb_per_s": _null(NUM),
              }), "one per state size")}, description="over a broker, in-process"),
        _obj({"live": {"const": True}, "rounds": INT, "groups": INT, "workdir": S,
              "sizes": _list(_open("state_bytes_nominal, stateful and stateless runs, summary")),
              "exactly_once": _d(BOOL, "every run's verdict (exit 3 when false)")},
             description="--live: real agents"),
    ]},
    "bench fleet": _obj({
        "runs": _list(_open("one fleet size: nodes, kinds, per-node messages and bytes, agent_cpu_pct, "
                            "agent_rss_mb, broker_cpu_pct, fogctl_status_s, deploy_s, ..."), "by nodes"),
        "model": _open("per quantity, the fitted model (two runs or more)"),
        "extrapolated": _open("the model at 1000 nodes"),
    }, optional=("model", "extrapolated")),
    # ---- demo and chaos ----
    "demo": _obj({
        "workdir": S, "pipeline": S, "pipeline_path": S, "scale_outs": INT, "scale_ins": INT,
        "scaling_by_operator": _open("operator -> scale-outs and scale-ins"),
        "max_instances": _map(INT, "operator -> most instances at once"),
        "final_instances": _map(INT, "operator -> instances at the end"),
        "protocol_messages": INT, "malformed": INT, "sends_to_terminated": INT,
        "handover": _obj({"messages": INT, "bytes": INT}, description="key groups that moved"),
        "keyed_late": _map(INT, "records keyed operators judged late, windows closed incomplete"),
        "broker_dropped": DROPPED, "decision_to_first_record_s": MEDIAN_MAX,
        "rescale_by_operator": _open("operator -> its rescale split (round, hand-over, first record)"),
        "memory_mb": _map(_obj({"n": INT, "rss_peak_mb": NUM, "pss_peak_mb": NUM, "uss_peak_mb": NUM}),
                          "process kind (agent, forkserver, worker:<operators>, broker, driver) -> the largest "
                          "peak of one process of the kind"),
        "operator_roles": _map({"enum": ["source", "stateless", "keyed", "sink", "?"]}, "operator -> its role"),
        "agent_exit_codes": _open("node -> exit status"), **VERDICT_COUNTS,
        "duration_s": NUM, "ok": _d(BOOL, "every record exactly once (exit 3 when false)"),
        "samples": _list(_obj({"t": NUM, "input_rate": NUM, "output_rate": NUM,
                               "instances": _map(INT, "operator -> instances")}), "one per second"),
        "plot": _null(S, "the PNG; null without matplotlib"),
        "analytics": _open("the analytics step's result (not with --no-analytics)"),
    }, optional=("analytics",)),
    "chaos": {"oneOf": [CHAOS_RUN, dict(_list(CHAOS_RUN), minItems=2, description="--runs N: one per run")]},
    # ---- testbed (docs/operations.md) ----
    "testbed up": _obj({
        "nodes": _list(_open("name, address, ... of a container")), "arch": S, "inventory": _d(S, "Ansible inventory"),
        "key": _d(S, "ssh key"), "known_hosts": S, "admin_password": _d(S, "the fleet's fogctl-admin password"),
        "root_built": BOOL, "root_seconds": NUM, "seconds": NUM,
    }),
    "testbed root": _obj({"root": S, "arch": {"enum": ["amd64", "arm64"]}, "suite": S, "built": BOOL, "seconds": NUM}),
    "testbed down": _obj({"removed": _list(S, "what up had added to the host")}),
    "testbed systemd": _list(_obj({"name": S, "ok": BOOL, "detail": _open("what the check saw")}),
                             "one per check, in order"),
    "testbed pipeline": _obj({
        "nodes": _list(S), "sink_dir": S, "during": _null(_open("--during: the command, when it ran, its exit")),
        "duration_s": NUM, "peak_rate": NUM, "nodes_per_operator": _map(_list(S), "operator -> nodes seen hosting it"),
        "max_instances": _open("operator -> most instances at once"), "files_per_node": _open("node -> sink files"),
        "files_on_several_nodes": _map(_list(S), "sink file -> the nodes it was found on (must be empty)"),
        **PIPELINE_VERDICT, "seconds": NUM,
    }),
    "testbed upgrade": _obj({
        "ok": _d(BOOL, "every record exactly once and every node upgraded"), "new_version": S,
        "upgrades": _list(_open("one node's upgrade")), "nodes_upgraded": INT, "upgrade_ok": BOOL,
    }, closed=False, description="`testbed pipeline`'s verdict, and the upgrade's"),
    "testbed scenarios": _obj({"ok": BOOL, "steps": _list(SCENARIO_STEP, "per release: converge, idempotence, verify"),
                               "gates": _map(_list(NUM), "release -> health gate seconds per node")}),
    "testbed arm64": _obj({
        "node": S, "root_built": BOOL, "root_s": NUM, "timings": _open("seconds per step"),
        "ok": _d(BOOL, "aarch64, arm64 package, agent running, the pipeline exactly once"),
    }, closed=False, description="more keys as far as the run got: uname_m, dpkg_arch, package, pipeline, ..."),
    "testbed uplink-cut": _obj({
        "cut_site": S, "cut_broker": S, "cut_kind": {"enum": ["silent", "link down"]}, "cut_seconds": NUM,
        "cut_at_s": NUM, "duration_s": NUM, "rate": NUM, "backlog_landed_after_heal_s": _null(NUM),
        "all_landed_after_heal_s": _null(NUM), "started_utc": S, "cut_utc": S, "healed_utc": S,
        "recorded_at_cut": _open("site -> records"), "recorded_at_heal": _open("site -> records"),
        "files_landed": INT, "spool_cap_bytes": INT, "spool_files_left": _d(INT, "files still in the spools after landing"),
        "landing": _map(_obj({"expected": INT, "landed": _d(INT, "distinct expected ids landed"), "lost": INT,
                               "duplicated": INT, "unexpected": INT,
                               "lost_sample": _list(LOST_ID, "the first lost ids")}),
                         "site -> its records at the centre"),
        "sites": _open("site -> its figures and pipeline verdict"), "samples": _list(_open("one per sample")),
        "checks": _list(_obj({"name": S, "ok": BOOL, "detail": S}), "the verdict's checks"),
        "ok": _d(BOOL, "every check"),
        "seconds": NUM, "kept": S,
    }),
}
_SHAPES["chaos --testbed"] = _obj({
    **{k: v for k, v in _SHAPES["testbed pipeline"]["properties"].items()},
    "testbed_faults": _list(_open("a fault on a container: kind, node, its timings")),
    "dead_after": _null(S, "the agents' dead_after as the testbed's agent.toml has it"), "seed": INT,
    "faults_injected": INT,
}, closed=False, description="`testbed pipeline`'s verdict with the faults injected")

SCHEMAS: Dict[str, Dict[str, Any]] = {
    name: {"$schema": DIALECT, "title": f"fog-agent {name} --json", **shape}
    for name, shape in _SHAPES.items()
}
