"""agent.node.rehoming on its own: when a lost node's instances are re-homed, what a failed re-home
leaves to try again, and which copy of an identity stays, decided on given statuses, records and
times without a daemon or a broker."""

from __future__ import annotations

from typing import Any, Dict

from agent.control.records import GENERATION_KEY, PipelineRecord
from agent.instance.spec import InstanceSpec
from agent.mqtt.settings import BrokerSpec
from agent.node import rehome, rehoming
from agent.node.rehoming import REHOMED_KEPT, Rehoming


def spec(instance: str) -> InstanceSpec:
    return InstanceSpec(instance, "work", "n9", "c", "p", "", BrokerSpec("h", 1))


def test_a_node_is_lost_after_dead_after_seconds_offline_once_and_again_after_it_came_back() -> None:
    r = Rehoming("me")
    r.on_status("n9", False, True, 10.0)
    r.on_status("n9", False, False, 12.0)  # the same status again: still offline since 10
    r.on_status("n3", False, True, 11.0)
    r.on_status("me", False, True, 11.0)  # our own Will: never re-homed by ourselves
    assert r.lost(14.999, 5.0) == [] and r.lost(15.0, 5.0) == [("n9", 10.0)]
    assert r.lost(16.0, 5.0) == [("n3", 11.0), ("n9", 10.0)]
    r.planned("n9")
    assert r.lost(100.0, 5.0) == [("n3", 11.0)]
    r.on_status("n9", True, False, 50.0)
    assert r.online_since["n9"] == 50.0 and "n9" not in r.offline_since and "n9" not in r.rehomed
    r.on_status("n9", True, True, 60.0)
    assert r.online_since["n9"] == 50.0  # not a new coming back
    r.on_status("n9", False, True, 70.0)
    assert r.lost(75.0, 5.0) == [("n3", 11.0), ("n9", 70.0)]  # lost again: planned again


def test_a_claim_lasts_until_a_node_lists_the_instance_or_its_time_is_over() -> None:
    r = Rehoming("me")
    r.claim("p.a.0", 10.0)
    r.claim("p.b.0", 10.0)
    r.claim("p.c.0", 20.0)
    r.drop_claims(39.999, 30.0, {"p.b.0"})
    assert r.claims == {"p.a.0": 10.0, "p.c.0": 20.0}
    r.drop_claims(40.0, 30.0, set())
    assert r.claims == {"p.c.0": 20.0}


def test_a_failed_rehome_leaves_the_record_is_kept_to_try_again_and_unplans_its_node() -> None:
    r = Rehoming("me")
    r.planned("n9")
    r.claim("p.a.0", 1.0)
    record = {"p.a.0": 100.0, "p.b.0": 100.0}
    assert r.failed("n9", spec("p.a.0"), record) is True
    assert record == {"p.b.0": 100.0} and r.claims == {} and "n9" not in r.rehomed
    assert r.retry == {"p.a.0": ("n9", spec("p.a.0"))}
    assert r.failed("n9", spec("p.z.0"), record) is False  # not in the record: nothing to publish
    r.retry = {f"p.x.{i}": ("n9", spec(f"p.x.{i}")) for i in range(REHOMED_KEPT)}
    r.failed("n9", spec("p.y.0"), {})
    assert len(r.retry) == REHOMED_KEPT and "p.y.0" not in r.retry  # bounded


def test_a_failed_rehome_is_tried_again_once_its_node_has_been_back_a_while_and_runs_it_nowhere() -> None:
    r = Rehoming("me")
    for inst in ("p.a.0", "p.b.0", "p.c.0"):
        r.failed("n9", spec(inst), {})
    r.failed("n8", spec("p.d.0"), {})
    r.online_since["n9"] = 100.0
    online = {"n9": True, "n8": False}
    assert r.retries(102.999, {"p.b.0"}, online, 3.0) == []
    assert sorted(r.retry) == ["p.a.0", "p.c.0"]  # b runs somewhere; d's node is offline: its next plan
    assert r.retries(103.0, set(), online, 3.0) == [("n9", spec("p.a.0")), ("n9", spec("p.c.0"))]
    assert r.retry == {}


def test_the_copy_of_the_latest_rehome_stays_and_an_older_one_stands_down() -> None:
    records = {"n2": {"p.a.0": 1000.0, "p.b.0": 1000.0}, "me": {"p.c.0": 3000.0}, "n5": {"p.a.0": 2000.0}}
    floors: Dict[str, Any] = {"p.a.0": 1500, "p.b.0": 1000, "p.c.0": 3000, "p.d.0": 1, "p.e.0": "1000"}
    online = {"n2": True, "n5": False}
    assert rehoming.rehomed_here("me", floors, records, online) == {"p.a.0", "p.b.0", "p.c.0"}
    assert rehoming.rehomed_here("me", floors, records, dict(online, n5=True)) == {"p.b.0", "p.c.0"}


def test_an_instance_rehomed_elsewhere_after_we_hosted_it_was_taken_over() -> None:
    records = {"n2": {"p.a.0": 200.0, "p.b.0": 50.0, "p.c.0": 300.0}, "me": {"p.d.0": 900.0}}
    since = {"p.a.0": 100.0, "p.b.0": 100.0, "p.d.0": 100.0}  # p.c.0: not hosted here (0)
    assert rehoming.taken_over("me", records, since) == {"p.a.0"}


def test_what_the_lost_node_said_counts_only_when_it_is_the_lost_one() -> None:
    local = {"p.a.0": {"state": "idle", "groups": [1, 2], "handed": []}}
    fleet = {"me": {"instances": [{"id": "p.x.0", "stats": {"state": "idle"}}]},
             "n2": {"instances": [{"id": "p.b.0", "stats": {"state": "departing", "groups": [3], "expecting": [4]}}]},
             "n9": {"instances": [{"id": "p.c.0", "stats": {"state": "idle", "groups": [5], "handed": [[6, "p.b.0"]]}},
                                  "junk"]}}
    online = {"n2": True, "n9": False}
    assert rehoming.listed_elsewhere("me", fleet, online) == {"p.b.0"}
    assert rehoming.in_state("me", local, fleet, online, ("idle",)) == {"p.a.0"}
    assert rehoming.in_state("me", local, fleet, online, ("idle",), lost="n9") == {"p.a.0", "p.c.0"}
    assert rehoming.in_state("me", local, fleet, online, ("departing", "terminated")) == {"p.b.0"}
    assert rehoming.lost_groups("me", local, fleet, online, "n9") == {"p.a.0": [1, 2], "p.b.0": [3], "p.c.0": [5]}
    assert rehoming.lost_moves("me", local, fleet, online, "n9", "handed") == {"p.c.0": [[6, "p.b.0"]]}
    assert rehoming.lost_moves("me", local, fleet, online, "n2", "expecting") == {"p.b.0": [4]}


def test_the_rehomed_record_keeps_the_newest_entries() -> None:
    record = {f"old.{i}": float(i) for i in range(REHOMED_KEPT)}
    got = rehoming.with_plan(record, ["new.0", "new.1"], 5000.0)
    assert len(got) == REHOMED_KEPT and got["new.0"] == got["new.1"] == 5000.0
    assert "old.0" not in got and "old.1" not in got and "old.2" in got


def test_the_fleets_reports_are_the_plans_inputs_of_the_lost_node() -> None:
    local = {"p.a.0": {"state": "idle", "groups": [1]}}
    fleet = {"n2": {"instances": [{"id": "p.b.0", "stats": {"state": "departing", "redirected": [[3, "x", "y", 1]]}}]},
             "n9": {"instances": [{"id": "p.c.0", "stats": {"state": "idle", "expecting": [2],
                                                            "lock": {"intent": "duplicate"}}}]}}
    online = {"n2": True, "n9": False}
    got = rehoming.plan_inputs("me", local, fleet, online, "n9")
    assert got == {"departing": {"p.b.0"}, "idle": {"p.a.0", "p.c.0"}, "groups": {"p.a.0": [1]}, "handed": {},
                   "expecting": {"p.c.0": [2]}, "redirected": {"p.b.0": [[3, "x", "y", 1]]},
                   "intents": {"p.c.0": "duplicate"}}
    other = rehoming.plan_inputs("me", local, fleet, online, "n8")  # what n9 said counts for n9's plan only
    assert other["idle"] == {"p.a.0"} and other["expecting"] == {} and other["intents"] == {}


def test_the_standby_groups_come_from_the_standby_the_hosted_record_names_ours_or_an_online_nodes() -> None:
    def hosted(instance: str, standby: Any) -> Dict[str, Any]:
        return {"instance": instance, "extra": {"standby": standby}}

    lost = [hosted("p.a.0", "me"), hosted("p.b.0", "n2"), hosted("p.c.0", "n3"), hosted("p.d.0", "n2"),
            hosted("p.e.0", None)]
    fleet = {"n2": {"standby_groups": {"p.b.0": [[0, 4]], "p.d.0": "junk", "p.a.0": [[9, 9]]}},
             "n3": {"standby_groups": {"p.c.0": [[5, 6]]}}}
    got = rehoming.standby_groups("me", "n9", {"n9": lost}, {"p.a.0": [[1, 2]]}, fleet, {"n2": True, "n3": False})
    assert got == {"p.a.0": [[1, 2]], "p.b.0": [[0, 4]]}  # n3 is offline; a value that is no list is skipped


def test_a_failed_rehome_tried_again_gets_a_new_epoch_floor_in_its_spec_and_our_record() -> None:
    r = Rehoming("me")
    record: Dict[str, float] = {}
    old = InstanceSpec("p.a.0", "work", "n9", "c", "p", "", BrokerSpec("h", 1), extra={"min_epoch": 900, "k": 1})
    again = r.again(old, 1000.7, record)
    assert again.extra == {"min_epoch": 1000, "k": 1} and record == {"p.a.0": 1000.0} and old.extra["min_epoch"] == 900
    ahead = InstanceSpec("p.b.0", "work", "n9", "c", "p", "", BrokerSpec("h", 1), extra={"min_epoch": 5000})
    assert r.again(ahead, 1000.7, record).extra["min_epoch"] == 5000 and record["p.b.0"] == 5000.0  # never lower


PIPE = """
[pipeline]
name = "p"
[[operator]]
name = "source"
kind = "source"
function = "agent.operators.taxi:source"
[[operator]]
name = "mid"
function = "agent.operators.builtin:identity"
[[operator]]
name = "sink"
kind = "sink"
function = "agent.operators.builtin:counting_sink"
"""


def test_a_lost_nodes_plan_starts_what_its_pipelines_record_allows_with_the_admins_text() -> None:
    def hosted(instance: str, operator: str, generation: str, **extra: Any) -> Dict[str, Any]:
        return {"instance": instance, "operator": operator, "pipeline": "p", "pipeline_toml": PIPE, "node": "x",
                "cluster": "c", "keeper": instance.startswith("p."), "extra": {GENERATION_KEY: generation, **extra}}

    by_node = {"n1": [hosted("p.source.0", "source", "g1")],
               "n9": [hosted("p.mid.0", "mid", "g1"), hosted("mid-b", "mid", "g0"), hosted("mid-c", "mid", "g1", creator="p.mid.0")],
               "n3": [hosted("p.sink.0", "sink", "g1")]}
    fleet = {"n9": {"instances": [{"id": "mid-c", "stats": {"state": "idle"}}]}}
    deployed = {"p": PipelineRecord("deployed", "g1")}
    plan = rehome.plan_lost("me", "n9", by_node, fleet, {"n1": True, "n3": True, "n9": False}, {},
                            {"p.source.0", "p.sink.0"}, 7000, {}, deployed, {"p": "ADMIN"})
    assert plan.planned == ("mid-b", "mid-c", "p.mid.0")  # our re-homed record names them all
    assert [i for i, _ in plan.skipped] == ["mid-b"]  # left over from another deploy
    assert [d["instance"] for d in plan.start] == ["mid-c", "p.mid.0"]
    assert all(d["pipeline_toml"] == "ADMIN" and d["extra"]["min_epoch"] == 7000 for d in plan.start)
    assert plan.idle == ("mid-c",) and plan.told == ("p.mid.0",)  # an idle copy, as n9 said, and its creator
    assert rehome.plan_lost("me", "n9", by_node, fleet, {"n1": True}, {}, set(), 7000, {}, {}, {}).skipped == ()
    gone = {"p": PipelineRecord("undeployed", "g1")}
    assert rehome.plan_lost("me", "n9", by_node, fleet, {}, {}, set(), 1, {}, gone, {"p": "ADMIN"}).start == ()
