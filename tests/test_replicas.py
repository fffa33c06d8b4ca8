"""The standby copy of a keyed instance's state (agent.node.replicas), sans-IO: the host's shipper,
the standby's store over a lossy channel, and the acks the worker holds until the copy has them.
Files in tmp_path only; no broker."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.node.loopevents import Puback
from agent.instance.keyed_state import KeyedState
from agent.node.replicas import (PART_BYTES, WINDOW, Replication, ReplicaStore, Shipper, choose_standby, open_saved)
from agent.operators import OperatorContext
from agent.operators.keyed import keyed_count


def _state(groups: int = 16) -> KeyedState:
    ks = KeyedState(keyed_count(OperatorContext("cnt-a", "cnt", "n1", "map", params={})), "cnt", "k", groups)
    ks.replicated_acks = True
    return ks


def test_the_standby_is_the_next_node_after_the_host_and_stays_while_eligible() -> None:
    assert choose_standby("b", ["a", "b", "c", "d"], None) == "c"
    assert choose_standby("d", ["a", "b", "d"], None) == "a"  # wraps around
    assert choose_standby("b", ["a", "b", "c"], "a") == "a"  # kept: a new one costs a snapshot
    assert choose_standby("b", ["b", "c"], "a") == "c"  # gone: the next one
    assert choose_standby("b", ["b"], "a") is None  # alone: no copy


def test_inputs_are_acked_only_once_the_standby_holds_their_save(tmp_path: Path) -> None:
    ks, path = _state(), tmp_path / "i.keyed.json"
    ks.apply("src", [("src", j, {"k": f"k{j % 5}"}) for j in range(10)], 0)
    assert ks.lowest_unsaved() == 0
    ks.save(path)
    assert ks.lowest_unsaved() == 0  # saved, not copied: held
    first = ks.saved_token()
    ks.apply("src", [("src", j, {"k": "k1"}) for j in range(10, 20)], 1)
    ks.save(path)
    second = ks.saved_token()
    assert first < second
    ks.replicated(*first)
    assert ks.lowest_unsaved() == 1  # the first save's input may go, not the second's
    ks.replicated(*second)
    assert ks.lowest_unsaved() is None
    off = _state()  # without a standby: the save alone releases them, as before
    off.replicated_acks = False
    off.apply("src", [("src", 0, {"k": "a"})], 0)
    off.save(tmp_path / "j.keyed.json")
    assert off.lowest_unsaved() is None


def test_a_restored_state_holds_every_input_until_its_first_save_is_copied(tmp_path: Path) -> None:
    ks, path = _state(), tmp_path / "i.keyed.json"
    ks.apply("src", [("src", j, {"k": "a"}) for j in range(5)], 0)
    ks.save(path)
    again = _state()
    again.restore(KeyedState.load(path) or {})
    again.hold_until_replicated()
    assert again.dirty and again.lowest_unsaved() == 0
    again.save(path)
    assert again.lowest_unsaved() == 0
    again.replicated(*again.saved_token())
    assert again.lowest_unsaved() is None


def _pump(sh: Shipper, store: ReplicaStore, path: Path, host: str, rng: random.Random, now: float,
          loss: float) -> Optional[Tuple[int, int]]:
    """One request and its reply between the shipper and the store; each message may be lost."""
    saved = open_saved(path)
    if saved is None:
        return None
    with saved:
        bodies = list(sh.requests(saved, now))
    reply = None
    for body in bodies:
        if rng.random() < loss:
            continue
        reply = store.apply(host, json.loads(json.dumps(body)))  # as on the wire
    if not bodies:
        return None
    if reply is None or rng.random() < loss:
        sh.timed_out(now + 1e6)  # never answered
        return None
    return sh.answered(reply)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), loss=st.sampled_from([0.0, 0.2, 0.5]))
def test_over_a_lossy_channel_the_copy_is_the_state_the_acks_claim(tmp_path_factory: Any, seed: int, loss: float) -> None:
    """Random batches and saves (logs and snapshots), a channel that loses requests and replies,
    a standby that changes: whenever the shipper tells the worker a token, the standby's copy
    loads to exactly the state of that save; at the end, once the channel is quiet, to the last."""
    rng = random.Random(seed)
    d = tmp_path_factory.mktemp("r")
    path = d / "host" / "i.keyed.json"
    path.parent.mkdir()
    stores = {n: ReplicaStore(d / n / "replicas") for n in ("s1", "s2")}
    ks, sh = _state(), Shipper("i")
    sh.set_standby("s1")
    at_save: Dict[Tuple[int, int], Dict[str, Any]] = {}
    n = 0
    for step in range(30):
        for _ in range(rng.randint(1, 3)):
            ks.apply("src", [("src", j, {"k": f"k{rng.randint(0, 40)}"}) for j in range(n, n + 7)], step)
            n += 7
        if rng.random() < 0.2:
            ks._full_next = True  # a snapshot now and then, as the log grows
        ks.save(path)
        at_save[ks.saved_token()] = KeyedState.load(path) or {}
        if rng.random() < 0.1:
            sh.set_standby("s2" if sh.standby == "s1" else "s1")
        token = _pump(sh, stores[str(sh.standby)], path, "host", rng, float(step), loss)
        if token is not None:
            copy = KeyedState.load(stores[str(sh.standby)].root / "i.keyed.json")
            assert copy == at_save[max(t for t in at_save if t <= token)], (token, step)
            ks.replicated(*token)
    for _ in range(20):  # the channel quiet: the standby catches up with the last save
        _pump(sh, stores[str(sh.standby)], path, "host", rng, 1e9, 0.0)
    assert sh.held == ks.saved_token()
    assert KeyedState.load(stores[str(sh.standby)].root / "i.keyed.json") == KeyedState.load(path)
    ks.replicated(*sh.held)
    assert ks.lowest_unsaved() is None


def test_the_standby_refuses_what_its_host_did_not_send_in_order(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path / "replicas")
    snap = b'{"format":2,"gen":3,"operator":"cnt","key_groups":16,"groups":{}}'
    import hashlib

    part = {"op": "replica", "instance": "cnt-a", "gen": 3, "part": 0, "parts": 1, "size": len(snap),
            "sha256": hashlib.sha256(snap).hexdigest(), "data": base64.b64encode(snap).decode()}
    assert store.apply("n1", part) == {"ok": True, "instance": "cnt-a", "gen": 3, "log": 0}
    line = base64.b64encode(b'{"gen":3,"applied":{}}\n').decode()
    append = {"op": "replica", "instance": "cnt-a", "gen": 3, "offset": 0, "data": line}
    assert store.apply("n2", append)["ok"] is False  # another node's copy: only its host writes it
    assert store.apply("n1", dict(append, offset=5))["ok"] is False  # not where the copy ends
    assert store.apply("n1", dict(append, gen=4))["ok"] is False  # another generation: snapshot first
    assert store.apply("n1", append)["ok"] is True
    assert store.apply("n1", append)["ok"] is False  # the same range again: already held
    for bad in (dict(part, instance="../etc/x"), dict(part, sha256="0" * 64), dict(part, size=10 ** 9),
                dict(part, data="!!"), dict(append, data=base64.b64encode(b"x" * (PART_BYTES + 1)).decode()),
                dict(part, gen=True), dict(part, parts=2)):
        assert store.apply("n1", bad)["ok"] is False, bad
    assert not list(tmp_path.glob("etc*")) and store.instances() == {"cnt-a": "n1"}
    installed = tmp_path / "state"
    with pytest.raises(ValueError):  # another operator's state: not installed, and the copy goes
        store.install("cnt-a", installed, "other", 16)
    assert store.instances() == {}


def test_a_rehome_on_the_standby_installs_its_copy_as_the_instances_state(tmp_path: Path) -> None:
    host, standby = tmp_path / "host", tmp_path / "standby"
    host.mkdir()
    ks = _state()
    ks.apply("src", [("src", j, {"k": f"k{j % 9}"}) for j in range(50)], 0)
    ks.save(host / "cnt-a.keyed.json")
    ks.apply("src", [("src", j, {"k": "k1"}) for j in range(50, 60)], 1)
    ks.save(host / "cnt-a.keyed.json")
    sent: List[Tuple[str, Dict[str, Any]]] = []
    told: List[Tuple[str, int, int]] = []
    rep = Replication("host", host)
    store = ReplicaStore(standby / "replicas")
    rep.saved("cnt-a", *ks.saved_token())

    def publish(node: str, body: Dict[str, Any], correlation: Optional[str]) -> bool:
        sent.append((node, body))
        answer = store.apply("host", body)
        if correlation is not None:
            assert answer is not None
            rep.on_reply(correlation, node, answer, 0.0, publish, lambda *a: told.append(a))
        return True

    assert rep.tick(0.0, ["host", "standby"], publish, lambda *a: told.append(a)) is True  # a standby chosen
    assert rep.standby_of("cnt-a") == "standby"
    assert told[-1] == ("cnt-a", *ks.saved_token())  # snapshot, then the log: all of it held
    assert [b.get("offset", "snap") for _, b in sent] == ["snap", 0]
    what = store.install("cnt-a", standby / "state", "cnt", 16)
    assert what is not None and "from host" in what
    assert KeyedState.load(standby / "state" / "cnt-a.keyed.json") == KeyedState.load(host / "cnt-a.keyed.json")
    assert store.instances() == {}  # the copy became the state
    alone = Replication("solo", host)  # no other node: acked on the save alone, counted
    alone.saved("cnt-a", *ks.saved_token())
    got: List[Any] = []
    alone.tick(0.0, ["solo"], publish, lambda *a: got.append(a))
    assert got == [("cnt-a", *ks.saved_token())] and alone.counts["replica_local_only"] == 1


KEYED = ("[pipeline]\nname = \"p\"\n[[operator]]\nname = \"src\"\nkind = \"source\"\n"
         "function = \"agent.operators.taxi:source\"\n[[operator]]\nname = \"cnt\"\nkind = \"map\"\n"
         "function = \"agent.operators.keyed:keyed_count\"\nkey = \"k\"\nkey_groups = 16\n[[operator]]\n"
         "name = \"sink\"\nkind = \"sink\"\nfunction = \"agent.operators.builtin:counting_sink\"\n")


def test_only_a_rehome_placed_on_its_standby_installs_the_copy_and_our_hosted_record_names_the_standby(
        tmp_path: Path) -> None:
    """Replication.install_copy, what the daemon calls when it starts an instance here: our copy
    becomes the state of a re-home (restart, an epoch floor) that names us its standby, not of
    a spawn, of a re-home meant for another standby or of a drain's hand-over (it ships its own
    state); with_standby, what our hosted record says of each of our keyed instances."""
    from agent.instance.spec import InstanceSpec
    from agent.mqtt.settings import BrokerSpec

    host, standby = tmp_path / "host", tmp_path / "standby"
    host.mkdir()
    ks = _state()
    ks.apply("src", [("src", j, {"k": f"k{j % 9}"}) for j in range(20)], 0)
    ks.save(host / "cnt-a.keyed.json")
    rep, ours = Replication("host", host), Replication("standby", standby)
    rep.saved("cnt-a", *ks.saved_token())

    def publish(node: str, body: Dict[str, Any], correlation: Optional[str]) -> bool:
        answer = ours.store.apply("host", body)
        if correlation is not None:
            rep.on_reply(correlation, node, answer or {}, 0.0, publish, lambda *a: None)
        return True

    rep.tick(0.0, ["host", "standby"], publish, lambda *a: None)
    assert rep.with_standby({"instance": "cnt-a", "extra": {"standby": "old", "x": 1}}) == \
        {"instance": "cnt-a", "extra": {"standby": "standby", "x": 1}}
    assert rep.with_standby({"instance": "cnt-b", "extra": {"standby": "old"}}) == {"instance": "cnt-b", "extra": {}}

    def job(restart: bool = True, **extra: Any) -> InstanceSpec:
        extra = {"min_epoch": 1_800_000_000, "standby": "standby", **extra}
        return InstanceSpec("cnt-a", "cnt", "standby", "c", "p", KEYED, BrokerSpec("h", 1), restart=restart,
                            extra={k: v for k, v in extra.items() if v is not None})

    counters: Dict[str, int] = {}
    for not_ours in (job(restart=False), job(min_epoch=None), job(standby="n7"), job(handover_keyed={"t": 1})):
        ours.install_copy(not_ours, counters)
    assert ours.store.instances() == {"cnt-a": "host"} and counters == {}  # the copy stays a copy
    ours.install_copy(job(), counters)
    assert counters == {"replicas_installed": 1} and ours.store.instances() == {}
    assert KeyedState.load(standby / "cnt-a.keyed.json") == KeyedState.load(host / "cnt-a.keyed.json")


def _big_save(d: Path, snapshot_bytes: int, log_bytes: int, gen: int = 1) -> Path:
    """A keyed instance's files of about these sizes (the store copies bytes; only the snapshot's
    first bytes and each log line's generation are read on the host)."""
    d.mkdir(parents=True, exist_ok=True)
    path = d / "cnt-a.keyed.json"
    path.write_bytes(b'{"format":2,"gen":%d,"pad":"' % gen + b"s" * snapshot_bytes + b'"}')
    line = b'{"gen":%d,"applied":{},"pad":"' % gen + b"l" * 5000 + b'"}\n'
    path.with_name(path.name + ".log").write_bytes(line * max(0, log_bytes // len(line)))
    return path


def _copy_peak(tmp_path: Path, snapshot_bytes: int, log_bytes: int) -> int:
    """The traced peak of the host's replication and the standby's store copying one save whole
    (snapshot, then the log), the requests encoded and decoded as on the wire."""
    import tracemalloc

    from agent.node import rpc

    host = _big_save(tmp_path / f"host{snapshot_bytes}", snapshot_bytes, log_bytes)
    store = ReplicaStore(tmp_path / f"standby{snapshot_bytes}" / "replicas")
    rep, told = Replication("host", host.parent), []
    log_size = host.with_name(host.name + ".log").stat().st_size
    rep.saved("cnt-a", 1, log_size)

    replies: List[Tuple[str, str, Dict[str, Any]]] = []

    def publish(node: str, body: Dict[str, Any], correlation: Optional[str]) -> bool:
        answer = store.apply("host", rpc.decode_request(rpc.encode(body)))
        if correlation is not None:
            replies.append((correlation, node, answer or {}))  # it comes back later, as from the broker
        return True

    tracemalloc.start()
    try:
        rep.tick(0.0, ["host", "standby"], publish, lambda *a: told.append(a))
        while replies:
            rep.on_reply(*replies.pop(0), 0.0, publish, lambda *a: told.append(a))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert told[-1] == ("cnt-a", 1, log_size)  # all of it held, in order
    for a, b in ((host, store.root / "cnt-a.keyed.json"), (host.with_name(host.name + ".log"),
                                                          store.root / "cnt-a.keyed.json.log")):
        assert a.read_bytes() == b.read_bytes()
    return peak


def test_a_copy_holds_a_few_parts_in_memory_whatever_the_states_size(tmp_path: Path) -> None:
    """Host and standby read, encode, stage and hash a snapshot a part at a time and the log a
    range at a time: the peak does not grow with the state (it was several times the state)."""
    small = _copy_peak(tmp_path, 256 << 10, 256 << 10)
    large = _copy_peak(tmp_path, 6 << 20, 3 << 20)
    assert large < 2 * PART_BYTES * 4 + (256 << 10), (small, large)  # a few parts' worth, not 9 MB
    assert large < small + (128 << 10), (small, large)


def test_snapshot_parts_wait_for_the_brokers_ack_at_most_window_at_a_time(tmp_path: Path) -> None:
    host = _big_save(tmp_path / "host", 5 * PART_BYTES + 100, 0)
    store = ReplicaStore(tmp_path / "standby" / "replicas")
    rep, told, sent = Replication("host", host.parent), [], []
    rep.saved("cnt-a", 1, 0)

    def publish(node: str, body: Dict[str, Any], correlation: Optional[str]) -> int:
        sent.append((body["part"], correlation))
        answer = store.apply("host", json.loads(json.dumps(body)))
        if correlation is not None:
            rep.on_reply(correlation, node, answer or {}, 1.0, publish, lambda *a: told.append(a))
        return 100 + len(sent)  # the message id the broker acks later

    tell = lambda *a: told.append(a)  # noqa: E731
    rep.tick(0.0, ["host", "standby"], publish, tell)
    assert [p for p, _ in sent] == list(range(WINDOW))  # then nothing until an ack
    rep.tick(0.1, ["host", "standby"], publish, tell)
    assert len(sent) == WINDOW and rep.waits_for(101) and not rep.waits_for(99)
    rep.published(99, 0.2, publish)  # another publication's ack: nothing moves
    assert len(sent) == WINDOW
    rep.published(101, 0.2, publish)
    assert [p for p, _ in sent] == list(range(WINDOW + 1))
    while len(sent) < 6:
        rep.published(100 + len(sent) - WINDOW + 1, 0.3, publish)
    assert [p for p, _ in sent] == [0, 1, 2, 3, 4, 5]
    assert [c is not None for _, c in sent] == [False] * 5 + [True]  # the last one asks for the reply
    assert told == [("cnt-a", 1, 0)] and store.root.joinpath("cnt-a.keyed.json").read_bytes() == host.read_bytes()
    # acks that never come (a lost connection): the copy times out and starts again from part 0
    rep.saved("cnt-a", 2, 0)
    _big_save(tmp_path / "host", 3 * PART_BYTES, 0, gen=2)
    sent.clear()
    rep.tick(10.0, ["host", "standby"], publish, tell)
    assert [p for p, _ in sent] == [0, 1]
    rep.tick(10.0 + 16, ["host", "standby"], publish, tell)
    assert rep.counts["replica_timeouts"] == 1 and [p for p, _ in sent] == [0, 1, 0, 1]


def test_the_standby_stages_a_snapshot_on_disk_in_any_order_of_its_parts(tmp_path: Path) -> None:
    import hashlib

    snap = b'{"format":2,"gen":4,"pad":"' + bytes(range(97, 123)) * 20000 + b'"}'
    parts = -(-len(snap) // PART_BYTES)
    bodies = [{"op": "replica", "instance": "cnt-a", "gen": 4, "part": i, "parts": parts, "size": len(snap),
               "sha256": hashlib.sha256(snap).hexdigest(),
               "data": base64.b64encode(snap[i * PART_BYTES:(i + 1) * PART_BYTES]).decode()} for i in range(parts)]
    store = ReplicaStore(tmp_path / "replicas")
    other = dict(bodies[1], sha256="1" * 64)  # a part of another snapshot: staging starts again
    assert store.apply("n1", other) is None
    for body in [bodies[2], bodies[0], bodies[2]] + bodies[3:] + [bodies[1]]:  # out of order, one twice
        answer = store.apply("n1", body)
    assert answer == {"ok": True, "instance": "cnt-a", "gen": 4, "log": 0}
    assert (tmp_path / "replicas" / "cnt-a.keyed.json").read_bytes() == snap
    assert not (tmp_path / "replicas" / "cnt-a.keyed.json.part").exists()
    short = dict(bodies[0], data=base64.b64encode(snap[:100]).decode())  # not its share of the size
    assert store.apply("n1", short)["ok"] is False
    wrong = [dict(b, sha256="2" * 64) for b in bodies]  # the parts, under another digest: refused whole
    answers = [store.apply("n1", b) for b in wrong]
    assert answers[-1]["ok"] is False and "sha256" in answers[-1]["error"]
    assert (tmp_path / "replicas" / "cnt-a.keyed.json").read_bytes() == snap  # the copy held stays
    store.apply("n1", bodies[0])
    store.forget("cnt-a")
    assert list((tmp_path / "replicas").iterdir()) == []


def test_the_log_sent_is_the_whole_lines_of_the_snapshots_generation(tmp_path: Path) -> None:
    path = tmp_path / "i.keyed.json"
    path.write_bytes(b'{"format":2,"gen":7,"x":1}')
    lines = [b'{"gen":7,"a":%d}\n' % i for i in range(3)]
    log = path.with_name(path.name + ".log")
    log.write_bytes(b"".join(lines) + b'{"gen":7,"torn"')  # a torn last line is not sent
    whole = b"".join(lines)
    with open_saved(path) as saved:
        assert saved.gen == 7 and saved.size == path.stat().st_size
        assert saved.log_range(0, PART_BYTES) == whole
        assert saved.log_range(5, 10) == whole[5:15] and saved.log_range(len(whole), 10) == b""
    log.write_bytes(b'{"gen":6,"old":1}\n' + b"".join(lines))  # the previous generation's lines left
    with open_saved(path) as saved:
        assert saved.log_range(0, PART_BYTES) == b""
    log.write_bytes(b"".join(lines))
    sh = Shipper("i", standby="s", held=(7, 0), wanted=(7, len(whole)))
    saved = open_saved(path)
    assert saved is not None
    path.with_name("new").write_bytes(b'{"format":2,"gen":8,"x":1}')
    path.with_name("new").replace(path)  # a newer snapshot after ours was opened: the log may be its
    with saved:
        assert len(sh.requests(saved, 0.0)) == 0 and sh.inflight is None
    with open_saved(path) as saved:  # the next turn: the newer save, from a snapshot
        sh.held = None
        assert [b["gen"] for b in sh.requests(saved, 0.0)] == [8]


def test_the_daemon_sends_the_next_part_on_the_brokers_puback(tmp_path: Path) -> None:
    """The agent's side: its publish gives the part's message id, and the PUBACK event releases
    the next part; nothing else is needed for a snapshot of many parts to go out whole."""
    from types import SimpleNamespace

    from agent import topics
    from agent.config import load_agent_config
    from agent.node.daemon import Agent

    conf = tmp_path / "n1.toml"
    conf.write_text(f'[agent]\nnode = "n1"\ncluster = "c"\nstate_dir = "{tmp_path}/state"\n[mqtt]\nhost = "h"\nport = 1\n')
    agent = Agent(load_agent_config(conf), warm_worker=False)
    sent: List[Tuple[str, bytes, int]] = []

    class Client:
        def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, properties: Any = None) -> Any:
            sent.append((topic, payload, len(sent) + 1))
            return SimpleNamespace(rc=0, mid=len(sent))

    agent.bus.client = Client()
    agent.bus.connected = True
    agent.core.view.online["n2"] = True
    host = _big_save(tmp_path / "state", 5 * PART_BYTES, 0)
    agent.core.replication.saved("cnt-a", 1, 0)
    now = agent.clock()
    agent.core._replicate(now)
    peer = topics.agent_peer("c", "n2", "n1")

    def parts() -> List[Tuple[int, int]]:
        return [(json.loads(p)["part"], mid) for t, p, mid in sent if t == peer]

    assert [p for p, _ in parts()] == list(range(WINDOW))
    agent.core._replicate(now + 1)
    assert len(parts()) == WINDOW  # nothing more before an ack
    n = -(-host.stat().st_size // PART_BYTES)
    while len(parts()) < n:
        agent._dispatch(Puback(parts()[len(parts()) - WINDOW][1]), now + 1)
    agent._dispatch(Puback(parts()[-2][1]), now + 1)
    agent._dispatch(Puback(parts()[-1][1]), now + 1)
    store = ReplicaStore(tmp_path / "standby")
    answers = [store.apply("n1", json.loads(p)) for t, p, _ in sent if t == peer]
    assert [p for p, _ in parts()] == list(range(n)) and n > WINDOW
    assert answers[-1] == {"ok": True, "instance": "cnt-a", "gen": 1, "log": 0}
    assert (store.root / "cnt-a.keyed.json").read_bytes() == host.read_bytes()


def test_the_standby_says_which_key_groups_each_copy_owns_as_of_the_save_it_holds(tmp_path: Path) -> None:
    """The groups a keyed instance owns go with each save (the snapshot's head, a log line when
    they change) and the standby reads them from what it holds (`ReplicaStore.owned`, per host):
    a re-home of a node lost before its retained state showed a move takes a copy's groups from
    there (agent.node.rehome, `standby_groups`). Without them a copy that had taken its share was
    re-homed owning none and its groups' windows started over at their old owner."""
    path = tmp_path / "host" / "i.keyed.json"
    path.parent.mkdir()
    store, ks, sh = ReplicaStore(tmp_path / "s" / "replicas"), _state(), Shipper("i")
    sh.set_standby("s")
    rng = random.Random(0)

    def copy_now() -> None:
        ks.replicated(*_pump(sh, store, path, "host", rng, 0.0, 0.0))  # type: ignore[misc]

    ks.owned = {g: 0 for g in range(16)}
    ks.apply("src", [("src", j, {"k": f"k{j}"}) for j in range(8)], 0)
    ks.save(path)  # the first save: a snapshot
    copy_now()
    assert store.owned({"host"}) == {"i": [[0, 15, 0]]}
    ks.owned = {g: 0 for g in range(8)}  # groups 8-15 handed out
    ks.apply("src", [("src", 8, {"k": "k0"})], 1)
    ks.save(path)  # a log line
    copy_now()
    assert store.owned({"host"}) == {"i": [[0, 7, 0]]}
    ks.apply("src", [("src", 9, {"k": "k1"})], 2)
    ks.save(path)  # a line without a change of ownership keeps it
    ks.owned = {**{g: 0 for g in range(8)}, 12: 3}  # group 12 back at version 3
    ks.save(path)
    copy_now()
    assert store.owned({"host"}) == {"i": [[0, 7, 0], [12, 12, 3]]}
    assert ReplicaStore(store.root).owned({"host"}) == {"i": [[0, 7, 0], [12, 12, 3]]}  # read back from its files
    assert (KeyedState.load(path) or {})["owned"] == [[0, 7, 0], [12, 12, 3]]
    ks._full_next = True
    ks.owned = {g: 1 for g in range(4)}
    ks.save(path)  # a new snapshot says it in its head
    copy_now()
    assert store.owned({"host"}) == {"i": [[0, 3, 1]]}
    assert store.owned({"other"}) == {} and store.hosts() == {"host"}  # only the copies of the hosts asked
    store.forget("i")
    assert store.owned({"host"}) == {}
