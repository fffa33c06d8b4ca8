"""agent.instance.groups.GroupRouting alone: an idle copy's Redirects wait for its Start's table."""

from __future__ import annotations

from agent.dataplane.owners import GroupTable
from agent.dataplane.routing import Router
from agent.instance.groups import GroupRouting


def test_redirects_before_the_start_are_held_in_order_bounded_and_handed_back_with_the_table() -> None:
    routing = GroupRouting(True)
    router = Router((), key="k", groups=4, table=None)
    for i in range(6):
        routing.hold(f"p{i}", {"n": i}, limit=4)
    creator = GroupTable.dealt(("s-0", "s-1"), 4)
    field = routing.start_field(Router(("s-0", "s-1"), key="k", groups=4, table=creator))
    waiting = routing.from_start(router, field, ("s-0", "s-1"), {})
    assert waiting == [(f"p{i}", {"n": i}) for i in range(4)]
    assert router.table is not None and router.table.to_wire() == creator.to_wire()
    assert routing.from_start(router, field, ("s-0", "s-1"), {}) == []  # handed back once


def test_an_instance_routing_by_no_table_sends_and_takes_none() -> None:
    routing = GroupRouting(False)
    router = Router(("s-0",), key=None, groups=4, table=None)
    assert routing.start_field(router) is None
    assert routing.from_start(router, {"table": None}, ("s-0",), {}) is None and router.table is None
