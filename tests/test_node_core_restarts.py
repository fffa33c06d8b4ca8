"""agent.node.restarts on its own: when a crashed worker starts again and which ones start
together, decided on a given time line without a daemon, a broker or a process."""

from __future__ import annotations

from typing import List

from agent.instance.spec import InstanceSpec
from agent.mqtt.settings import BrokerSpec
from agent.node import chains
from agent.node.restarts import MAX_RESTARTS, RESTART_BACKOFF_MAX, RESTART_WINDOW, Exit, Restarts, exit_of


def spec(instance: str) -> InstanceSpec:
    return InstanceSpec(instance, instance.split(".")[1], "me", "c", "p", "", BrokerSpec("h", 1))


def test_the_first_crashes_in_the_window_restart_at_once_the_next_ones_back_off_doubling() -> None:
    r = Restarts()
    delays: List[float] = []
    for k in range(MAX_RESTARTS + 6):
        again, crashes, delay = r.on_crash(spec("p.work.0"), 10.0 + k)
        assert again.restart and again.instance == "p.work.0" and crashes == k + 1
        delays.append(delay)
    assert delays == [0.0] * MAX_RESTARTS + [2.0, 4.0, 8.0, 16.0, RESTART_BACKOFF_MAX, RESTART_BACKOFF_MAX]


def test_crashes_older_than_the_window_no_longer_count() -> None:
    r = Restarts()
    for k in range(MAX_RESTARTS):
        assert r.on_crash(spec("p.work.0"), float(k))[2] == 0.0
    assert r.on_crash(spec("p.work.0"), 2.0 + RESTART_WINDOW)[1:] == (1, 0.0)  # 0, 1 and 2 are out
    assert r.on_crash(spec("p.other.0"), 3.0)[1:] == (1, 0.0)  # per instance


def test_a_delayed_restart_is_due_at_its_time_once_and_not_after_it_was_forgotten() -> None:
    r = Restarts()
    for k in range(MAX_RESTARTS + 1):
        r.on_crash(spec("p.work.0"), 100.0)
        r.on_crash(spec("p.gone.0"), 100.0)
    assert sorted(r.delayed) == ["p.gone.0", "p.work.0"]
    assert r.due(101.999) == []
    r.forget("p.gone.0")  # undeployed meanwhile
    due = r.due(102.0)
    assert [s.instance for s in due] == ["p.work.0"] and due[0].restart
    assert r.due(200.0) == [] and r.delayed == {}


def test_the_members_of_a_chain_are_held_and_start_together_upstream_first() -> None:
    r = Restarts()
    a, b, c = chains.with_chain([spec("p.a.0"), spec("p.b.0"), spec("p.c.0")])
    assert not r.hold(spec("p.alone.0"))  # no chain: started at once by the daemon
    assert r.hold(c) and r.hold(a)
    groups = r.take()
    assert [[s.instance for s in g] for g in groups] == [["p.a.0", "p.c.0"]]  # b did not die: a chain of two
    assert chains.chain_of(groups[0][0]) == ("p.a.0", "p.c.0")
    assert r.take() == []
    assert r.hold(b)
    assert [[s.instance for s in g] for g in r.take()] == [["p.b.0"]] and chains.chain_of(b) != ()


def end(**facts: bool) -> Exit:
    base = dict(clean=False, crashed=False, said_final=False, bad_spec=False, stopping=False, handing_over=False,
                fenced=False, undeployed=False, chained=False, asked_to_stop=False, placing=False)
    return exit_of(**dict(base, **facts))


def test_a_crash_restarts_here_unless_the_agent_stops_it_was_fenced_undeployed_or_still_placed() -> None:
    assert end(crashed=True) == Exit("crash", final=False, handover=False, restart=True)
    assert end(crashed=True, stopping=True) == Exit("shutdown", False, False, False)
    assert end(crashed=True, fenced=True) == Exit("crash", False, False, False)  # another node runs it
    assert end(crashed=True, undeployed=True) == Exit("undeploy", False, False, False)
    assert end(crashed=True, placing=True) == Exit("crash", False, False, False)  # its spawn goes elsewhere


def test_a_clean_or_announced_final_exit_is_a_scale_in_and_a_bad_spec_is_gone_for_good() -> None:
    assert end(clean=True) == Exit("scale_in", False, False, False)
    assert end(said_final=True) == Exit("scale_in", True, False, False)  # even if it needed SIGTERM
    assert end(bad_spec=True) == Exit("crash", final=True, handover=False, restart=False)


def test_a_keeper_stopped_by_a_drain_moves_unless_it_left_for_good_or_the_agent_stops() -> None:
    assert end(clean=True, handing_over=True) == Exit("handover", False, True, False)
    assert end(crashed=True, handing_over=True) == Exit("handover", False, True, False)  # moves, not restarted
    assert end(said_final=True, handing_over=True) == Exit("scale_in", True, False, False)
    assert end(clean=True, handing_over=True, stopping=True) == Exit("shutdown", False, False, False)


def test_a_chain_member_stopped_with_its_chain_starts_again_one_asked_to_stop_does_not() -> None:
    assert end(clean=True, chained=True) == Exit("scale_in", False, False, True)
    assert end(clean=True, chained=True, asked_to_stop=True) == Exit("scale_in", False, False, False)
    assert end(chained=True, said_final=True) == Exit("scale_in", True, False, False)
