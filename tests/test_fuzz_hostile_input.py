"""Hostile input (issue #10): the inbox decoder, the FIFO channel and every protocol core take any
bytes or any message from any sender without crashing, and a rejected message leaves the state
unchanged (docs/hostile-input.md).

Three kinds of tests: the seeded fuzzer (`foglab.sim.fuzz`) on every target with a small budget
(the 100,000-input run is `fog-agent bench fuzz`); tests that show the fuzzer can fail (injected
faults are reported); regression tests for each defect the fuzzer found, each failing without its
fix. Hypothesis adds unseeded-shape coverage of the decoders and the channel.
"""

from __future__ import annotations

import json
import random
from typing import Any, List

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.protocol.errors import RemoteProtocolError
from agent.protocol.gme_base import message_from_dict, two_groups
from agent.protocol.gme_fgme import Req
from agent.protocol.gme_ra1 import Ra1Ack, Ra1Node, Ra1Req
from agent.protocol.gme_ra2 import Ra2Ack, Ra2Node, Ra2Req
from agent.protocol.messages import from_dict, from_json
from agent.protocol.scaling import ScalingCore
from agent.dataplane.channel import Inbound
from agent.dataplane.envelope import Envelope, Kind, MalformedEnvelope, decode, encode
from foglab.sim import fuzz

BUDGET = 1200  # inputs per target here: ~1 s each on a loaded 2-core machine


def _deeper(n: int, f: Any, *args: Any) -> Any:
    """Call f n stack frames deeper (a worker re-encodes a record deeper than it decoded it)."""
    return _deeper(n - 1, f, *args) if n else f(*args)


# ---- the fuzzer on every target --------------------------------------------------------------------


@pytest.mark.parametrize("name", fuzz.TARGETS)
def test_fuzzer_finds_no_crash(name: str) -> None:
    stats = fuzz.run_target(fuzz.make_target(name), BUDGET, seed=11)
    assert stats.inputs == BUDGET
    assert stats.crashes == 0, [f.to_dict() for f in stats.failures]
    assert stats.accepted + stats.rejected == BUDGET
    # both paths of the property are exercised, not just one
    assert stats.accepted > BUDGET // 20
    if name == "channel":
        assert stats.extra["dropped"] > 0 and stats.extra["gaps_skipped"] > 0
    else:
        assert stats.rejected > BUDGET // 20
    if name in ("scaling_core", "guarded", "fgme", "ra1", "ra2"):
        assert stats.extra["core_rejected"] > BUDGET // 10  # rejected by the core, not the codec


def test_fuzzer_is_deterministic_per_seed() -> None:
    a = fuzz.run_target(fuzz.make_target("guarded"), 300, seed=5)
    b = fuzz.run_target(fuzz.make_target("guarded"), 300, seed=5)
    c = fuzz.run_target(fuzz.make_target("guarded"), 300, seed=6)
    assert (a.accepted, a.rejected, a.extra) == (b.accepted, b.rejected, b.extra)
    assert (a.accepted, a.rejected, a.extra) != (c.accepted, c.rejected, c.extra)


def test_run_all_splits_the_budget_over_every_target() -> None:
    res = fuzz.run_all(len(fuzz.TARGETS) * 40 + 3, seed=1)
    assert [r.target for r in res] == list(fuzz.TARGETS)
    assert sum(r.inputs for r in res) == len(fuzz.TARGETS) * 40 + 3
    assert all(r.crashes == 0 for r in res)


# ---- the fuzzer can fail ---------------------------------------------------------------------------


class _MutatesThenRaises(ScalingCore):
    """Injected fault: records the sender in its tables before rejecting the message."""

    def handle(self, message: Any) -> List[Any]:
        if message.stage != self.stage + 1 and message.stage != self.stage - 1:
            self.succs.add(message.sender)
        return super().handle(message)


def test_fuzzer_reports_state_changed_on_error() -> None:
    target = fuzz.ScalingCoreTarget(core_cls=_MutatesThenRaises)
    stats = fuzz.run_target(target, 300, seed=2)
    assert stats.crashes > 0
    assert {f.kind for f in stats.failures} == {"state_changed_on_error"}
    assert "_MutatesThenRaises" in stats.failures[0].error


def test_fuzzer_reports_a_decoder_that_raises_something_else() -> None:
    def decode_keyerror(raw: Any) -> Envelope:
        env = decode(raw)  # MalformedEnvelope passes through: documented
        if env.kind is Kind.ACK:
            raise KeyError("ack")  # the injected defect
        return env

    stats = fuzz.run_target(fuzz.EnvelopeTarget(decoder=decode_keyerror), 400, seed=3)
    assert stats.crashes > 0
    f = stats.failures[0]
    assert f.kind == "crash" and f.error.startswith("KeyError") and "decode_keyerror" in f.trace


class _AckCountsStrangers(Ra1Node):
    """Injected fault: the pre-fix RA1 (any sender accepted), plus a crash on a big clock."""

    def receive(self, message: Any) -> List[Any]:
        if getattr(message, "sn", 0) > 10**6:
            raise OverflowError("clock too large")
        return super().receive(message)


def test_fuzzer_reports_a_crashing_gme_node() -> None:
    stats = fuzz.run_target(fuzz.GmeNodeTarget("ra1", node_cls=_AckCountsStrangers), 600, seed=4)
    assert any(f.kind == "crash" and "OverflowError" in f.error for f in stats.failures)


class _Hangs(fuzz.Target):
    name = "hangs"

    def one(self, rng: random.Random) -> bool:
        if rng.random() < 0.5:
            while True:
                pass
        return True


def test_fuzzer_reports_a_hang() -> None:
    stats = fuzz.run_target(_Hangs(), 4, seed=0, hang_seconds=0.1)
    assert stats.crashes > 0 and {f.kind for f in stats.failures} == {"hang"}


def test_replay_reproduces_one_input() -> None:
    stats = fuzz.run_target(fuzz.make_target("scaling_core"), 50, seed=9)
    assert stats.crashes == 0
    # every index replays on its own (no state carried between inputs)
    assert fuzz.replay("scaling_core", 9, 17) in (True, False)


# ---- regressions: defects the fuzzer found (each test fails without its fix) -----------------------


@pytest.mark.parametrize("raw", [
    b'[1,"\\ud800",0,1,"a",[0,1]]',  # an escaped lone surrogate as sender
    b'[1,"\xed\xa0\x80",0,1,"a",[0,1]]',  # a surrogate encoded in (invalid) UTF-8 bytes
    b'[1,"a",0,1,"d",[["\\udfff",1,{}]]]',  # in a record's source id
    '[1,"a",0,1,"a",[0,1]]'.encode("utf-16"),  # not UTF-8 at all
])
def test_envelope_that_cannot_be_encoded_again_is_malformed(raw: bytes) -> None:
    """Was: accepted, then the worker's ack to that sender died in encode (UnicodeEncodeError)."""
    with pytest.raises(MalformedEnvelope):
        decode(raw)


def test_envelope_surrogate_pair_is_still_accepted() -> None:
    env = decode(b'[1,"\\ud83d\\ude00",0,1,"a",[0,1]]')
    assert env.sender == "\U0001F600" and decode(encode(env)) == env


def test_envelope_accepted_nesting_can_be_encoded_deeper() -> None:
    """Was: a record nested ~950 deep decoded, and re-encoding it a few frames deeper (the worker
    forwarding it) raised RecursionError. Now decode keeps a margin of stack frames."""
    for depth in range(800, 1001, 4):
        raw = b'[1,"a",0,1,"d",[["s",1,' + b"[" * depth + b"]" * depth + b"]]]"
        try:
            env = decode(raw)
        except MalformedEnvelope:
            continue
        _deeper(50, encode, env)  # must not raise


def test_scaling_codec_quotes_deep_values_without_recursion() -> None:
    """Was: the error message repr()'d a deeply nested value: RecursionError, not RemoteProtocolError."""
    v: Any = []
    for _ in range(1200):
        v = [v]
    with pytest.raises(RemoteProtocolError):
        _deeper(5, from_dict, {"type": v})
    with pytest.raises(RemoteProtocolError):
        _deeper(5, from_dict, {"type": "start", "sender": v, "stage": 1, "succs": [], "preds": []})


@pytest.mark.parametrize("value, module", [
    ([], "gme_fgme"),  # not an object: was AttributeError
    ("req", "gme_ra1"),
    ({"kind": "req", "sender": 1, "clock": "x", "epoch": 0}, "gme_fgme"),  # was TypeError in the core
    ({"kind": "req", "sender": [1], "clock": 1, "epoch": 0}, "gme_fgme"),  # unhashable sender
    ({"kind": "req", "sender": 1, "clock": 1.5, "epoch": 0}, "gme_fgme"),
    ({"kind": "req", "sender": 1, "clock": True, "epoch": 0}, "gme_fgme"),
    ({"kind": "ack", "sender": 1, "renew": 0, "end": False, "epoch": 0}, "gme_fgme"),
    ({"kind": "req", "sender": 1, "clock": 1, "epoch": 0, "extra": 1}, "gme_fgme"),
    ({"kind": "ack", "sender": 1, "k": 1, "vf": [None, 1]}, "gme_ra2"),
    ({"kind": "req", "sender": 1, "forum": 0, "sn": -1}, "gme_ra1"),
    ({"kind": ["req"], "sender": 1}, "gme_ra1"),
])
def test_gme_codec_rejects_any_defect_with_remote_protocol_error(value: Any, module: str) -> None:
    with pytest.raises(RemoteProtocolError):
        message_from_dict(value, module)


def test_gme_codec_round_trips_valid_messages() -> None:
    for m, module in ((Req(3, 7, 2), "gme_fgme"), (Req("s1i0", 7, 2), "gme_fgme"),
                      (Ra1Req(1, 0, 4), "gme_ra1"), (Ra2Req(2, 1, 3, 1, (0, 1, 0, 0)), "gme_ra2")):
        assert message_from_dict(json.loads(json.dumps(m.to_dict())), module) == m


def _ra_nodes(cls: Any) -> Any:
    groups = two_groups((2, 2))
    nodes = [cls(i, groups) for i in sorted(groups)]
    nodes[0].request()
    return nodes[0]


@pytest.mark.parametrize("msg", [Ra1Req(0, 1, 5), Ra1Req(9, 1, 5), Ra1Ack(9, 1), Ra1Ack(-1, 1)])
def test_ra1_rejects_itself_and_strangers_state_unchanged(msg: Any) -> None:
    """Was: answered itself or a stranger; a stranger's Ack counted towards the entry."""
    node = _ra_nodes(Ra1Node)
    before = fuzz.fingerprint(node)
    with pytest.raises(RemoteProtocolError):
        node.receive(msg)
    assert fuzz.fingerprint(node) == before


@pytest.mark.parametrize("msg", [
    Ra2Req(2, 1, 1, 1, (0, 0, 0, 0, 0, 0, 0, 0, 9)),  # VF longer than the system: was IndexError mid-merge
    Ra2Ack(2, 1, (0,)),  # shorter: was IndexError
    Ra2Req(9, 1, 1, 1, (0, 0, 0, 0)),  # stranger: was IndexError on VSN
    Ra2Req(-1, 1, 1, 1, (0, 0, 0, 0)),  # negative id: silently bumped the last node's counter
    Ra2Ack(0, 1, (0, 0, 0, 0)),  # itself
])
def test_ra2_rejects_bad_vectors_itself_and_strangers_state_unchanged(msg: Any) -> None:
    node = _ra_nodes(Ra2Node)
    before = fuzz.fingerprint(node)
    with pytest.raises(RemoteProtocolError):
        node.receive(msg)
    assert fuzz.fingerprint(node) == before


def _guarded_pair() -> Any:
    from foglab.sim.guarded_check import build_guarded

    return build_guarded((2, 2)).cores


def test_guarded_rejects_lock_message_from_itself() -> None:
    """Was: accepted; the lock node joined itself as a competitor and sent itself an Ack."""
    from agent.protocol.guarded import LockMessage

    core = _guarded_pair()["s1i0"]
    before = fuzz.fingerprint(core)
    with pytest.raises(RemoteProtocolError):
        core.handle(LockMessage("s1i0", 0, Req("s1i0", 1, 1)))
    assert fuzz.fingerprint(core) == before


def test_guarded_rejects_lock_message_from_departed_instance() -> None:
    """Was: ValueError (a crash of the worker) when a departed instance's lock message arrived."""
    from agent.protocol.guarded import LockMessage

    core = _guarded_pair()["s0i0"]
    node = core.locks[0]
    node.sync(set())  # s1i0, s1i1 leave ...
    node._drop("s1i1")  # ... and s1i1's exit arrived: it is gone
    before = fuzz.fingerprint(core)
    with pytest.raises(RemoteProtocolError):
        core.handle(LockMessage("s1i1", 0, Req("s1i1", 1, 1)))
    assert fuzz.fingerprint(core) == before


def test_guarded_rejects_lock_message_after_termination() -> None:
    from agent.protocol.guarded import LockMessage
    from agent.protocol.scaling import InstanceState

    core = _guarded_pair()["s1i1"]
    core.state = InstanceState.TERMINATED
    before = fuzz.fingerprint(core)
    with pytest.raises(RemoteProtocolError):
        core.handle(LockMessage("s0i0", 0, Req("s0i0", 1, 1)))
    assert fuzz.fingerprint(core) == before


# ---- hypothesis: shapes the seeded generators do not aim at ----------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=6) | st.dictionaries(st.text(max_size=6), kids, max_size=6),
    max_leaves=30,
)
_HYP = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_HYP
@given(st.binary(max_size=200))
def test_hypothesis_decode_any_bytes(raw: bytes) -> None:
    try:
        env = decode(raw)
    except MalformedEnvelope:
        return
    assert decode(encode(env)).sender == env.sender


@_HYP
@given(st.tuples(st.sampled_from([1, 2, "1"]), _JSON, _JSON, _JSON, st.sampled_from(["d", "a", "p", "x"]), _JSON))
def test_hypothesis_decode_any_envelope_shape(fields: Any) -> None:
    raw = json.dumps(list(fields)).encode()
    try:
        env = decode(raw)
    except MalformedEnvelope:
        return
    assert encode(decode(encode(env))) == encode(env)


_FIELDS = ["type", "sender", "stage", "round", "new_instances", "succs", "preds", "seq", "count"]


@_HYP
@given(st.dictionaries(st.sampled_from(_FIELDS), _JSON | st.sampled_from(["start", "duplication", "deletion_ack"])))
def test_hypothesis_scaling_codec_any_dict(d: Any) -> None:
    try:
        m = from_dict(d)
    except RemoteProtocolError:
        return
    assert from_json(m.to_json()) == m


@_HYP
@given(st.sampled_from(["gme_fgme", "gme_ra1", "gme_ra2"]),
       st.dictionaries(st.sampled_from(["kind", "sender", "clock", "epoch", "renew", "end", "forum", "sn", "k", "vf"]),
                       _JSON | st.sampled_from(["req", "ack", "end", "start"])))
def test_hypothesis_gme_codec_any_dict(module: str, d: Any) -> None:
    try:
        m = message_from_dict(d, module)
    except RemoteProtocolError:
        return
    fuzz._check_gme_message(m, module)  # accepted: fields of the types the cores compare


@_HYP
@given(st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 2), st.integers(1, 8)), max_size=40),
       st.sampled_from([2, 10_000]))
def test_hypothesis_channel_any_order(script: Any, max_pending: int) -> None:
    inbound = Inbound(max_pending=max_pending)
    last: dict = {}
    seen = set()
    for s, e, q in script:
        for o in inbound.receive(Envelope(s, e, q, Kind.ACK, (0, 0))):
            key = (o.sender, o.epoch, o.seq)
            assert key not in seen
            seen.add(key)
            assert last.get(o.sender, (-1, 0)) < (o.epoch, o.seq)
            last[o.sender] = (o.epoch, o.seq)
    assert inbound.stats.delivered == len(seen)


# ---- the worker side ---------------------------------------------------------------------------------


def test_worker_logs_protocol_messages_it_cannot_handle_once_per_sender(caplog: Any) -> None:
    """Counted every time, logged once per sender (was: one warning per message, so a hostile
    or misconfigured peer could flood the log)."""
    from agent.instance.core import Instance
    from agent.instance.intake import Intake

    w = object.__new__(Instance)  # only the fields _on_protocol uses: no broker, no process
    w.stats = {"protocol_in": 0, "protocol_errors": 0}
    w.scaling = None
    w.ctx = {}
    w.intake = Intake("c", "n1", "op-0", False, True, w.stats, w.ctx)
    body = {"type": "deletion", "sender": "x", "stage": 0, "round": 1}
    with caplog.at_level("WARNING", logger="agent.instance.worker"):
        for sender in ("x", "x", "x", "y"):
            Instance._on_protocol(w, Envelope(sender, 0, 1, Kind.PROTO, body))
    assert w.stats["protocol_errors"] == 4
    assert len([r for r in caplog.records if "scaling is off" in r.getMessage()]) == 2


# ---- bus input of the agent and fogctl (issue #20) ---------------------------------------------------


def test_bus_targets_are_registered_and_run_through_the_cli(capsys: Any) -> None:
    """Every parser of bus input has a target, and `fog-agent bench fuzz --each N` runs N each."""
    from foglab.cli.fuzz_cmd import run_bench

    assert set(fuzz.BUS_TARGETS) <= set(fuzz.TARGETS)
    assert {"rpc_request", "rpc_reply", "node_state", "hosted", "rehomed", "latency_record",
            "latency_probe", "events", "fogctl_views", "daemon"} == set(fuzz.BUS_TARGETS)
    import argparse

    args = argparse.Namespace(inputs=1, each=40, seed=3, target=["rpc_request", "latency_probe"],
                              hang_seconds=5.0, json=True)
    assert run_bench(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(t["target"], t["inputs"], t["crashes"]) for t in doc["targets"]] == [
        ("rpc_request", 40, 0), ("latency_probe", 40, 0)]


@pytest.mark.parametrize("body", [
    {"op": "scale", "operator": "x", "delta": [], "instances": ["a"]},  # found by the fuzzer: TypeError
    {"op": "scale", "operator": "x", "delta": [True], "instances": ["a"]},
    {"op": "scale", "operator": "x", "delta": 1, "pipeline": ["p"]},
    {"op": "scale", "operator": ["x"], "delta": 1},
])
def test_a_scale_request_with_wrong_types_is_a_request_error(body: Any) -> None:
    from agent.control.rpc_schema import RequestError, parse_request

    with pytest.raises(RequestError):
        parse_request(body)


def test_fogctl_shows_a_hostile_state_as_an_error_row() -> None:
    from agent.fogctl import views
    from agent.control.fleet import Fleet, state_decisions

    msgs = {"fog/c/agents/n9/state": b"[" * 100_000, "fog/c/agents/n9/status": b"online",
            "fog/c/agents/n8/state": b'{"node": "n8", "slots": 2, "instances": {"a": [1]}, "measure": []}',
            "fog/c/latency/n9": b"{" * 100_000}
    fleet = Fleet.from_messages("c", msgs)
    assert "nested deeper" in (fleet.node("n9").error or "")
    _, text = views.status(fleet, 0.0)
    assert "bad state" in [line for line in text.splitlines() if line.startswith("n9")][0]
    assert state_decisions("c", "fog/c/agents/n9/state", msgs["fog/c/agents/n9/state"]) == []
    views.latency(fleet)
    # retained pipelines that are TOML but not pipelines, or too deep for the TOML parser
    for text in (b"operator = 5", b"operator = 'abc'", b"a = " + b"[" * 100_000, b"[[operator]]\nname = 3"):
        f = Fleet.from_messages("c", dict(msgs, **{"fog/c/pipelines/p": text}))
        views.pipelines(f)
        views.status(f, 0.0)


@pytest.mark.parametrize("ts", [2.0**63, 1e300, -1e300])
def test_an_event_at_a_time_no_clock_shows_still_renders(ts: float) -> None:
    """Found by the events target: `fogctl watch` ended with OverflowError on such an event."""
    from agent import events
    from agent.fogctl.views import event_line

    ev = events.parse(json.dumps({"v": 1, "ts": ts, "node": "n1", "type": "spawned", "detail": {}}).encode())
    assert event_line(ev).startswith("ts=") and "n1 - spawned" in event_line(ev)


class _DaemonForgetsOnRefusal(fuzz.DaemonTarget):
    """Injected fault: the daemon drops what it knew of a node before refusing its message."""

    def prepare(self, seed: int) -> None:
        super().prepare(seed)
        core, original = self.core, self.core._bad

        def bad(what: str, sender: Any, exc: Any) -> None:
            core.view.fleet.pop("n2", None)
            original(what, sender, exc)

        core._bad = bad


def test_the_daemon_target_reports_state_changed_on_refusal() -> None:
    stats = fuzz.run_target(_DaemonForgetsOnRefusal(), 300, seed=2)
    assert stats.crashes > 0 and {f.kind for f in stats.failures} == {"state_changed_on_error"}


@pytest.mark.parametrize("field, value", [
    ("extra", 1),  # found by the daemon target: AttributeError, and the requester got no reply
    ("extra", [1]), ("extra", "x"), ("succs", 1), ("preds", [1]), ("keeper", "yes"), ("instance", 5),
    ("pipeline_toml", ["x"]), ("heartbeat_period", "1"), ("broker", 3),
])
def test_a_spawn_with_a_field_of_the_wrong_type_is_refused_with_a_reply(field: str, value: Any) -> None:
    target = fuzz.DaemonTarget()
    target.prepare(0)
    core = target.core
    spec = dict(fuzz._bus_corpus_spec(), **{field: value})
    topic = "fog/c/agents/me/rpc/adm"
    msg = type("M", (), {"topic": topic, "payload": json.dumps({"op": "spawn", "spec": spec}).encode(),
                         "retain": False, "properties": None})()
    core._on_message(msg, 1.0)  # no exception
    replies = [json.loads(p) for t, p in core.bus.client.published if t == "fog/c/replies/adm/me"]
    assert len(replies) == 1 and replies[0]["ok"] is False, replies
    assert field in replies[0]["error"], replies[0]
    target._dir.cleanup()
