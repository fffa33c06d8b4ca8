"""agent.node.pins on its own: which workers are told they are pinned, when a pin ends, and what a
release takes away, decided without a daemon, a broker or a clock."""

from __future__ import annotations

from agent.node.pins import Pins

WORKERS = [("p.a.0", "p", "a", True), ("p.a.1", "p", "a", False), ("q.a.0", "q", "a", True), ("p.b.0", "p", "b", True)]


def test_a_pin_of_one_pipeline_tells_only_its_active_workers_once() -> None:
    pins = Pins()
    assert pins.pin(100.0, "p", "a", 30.0) == "p/a" and pins.until("p/a") == 130.0
    pinned, send = pins.apply(WORKERS)
    assert pinned == ["p.a.0", "p.a.1"]  # the starting one is pinned too, told once it is active
    assert send == [("p.a.0", True)]
    pins.delivered("p.a.0", True)
    assert pins.apply(WORKERS)[1] == [] and pins.flagged("p.a.0") and not pins.flagged("p.a.1")
    started = [(i, p, o, True) for i, p, o, _ in WORKERS]
    assert pins.apply(started)[1] == [("p.a.1", True)]


def test_a_pin_without_a_pipeline_holds_the_operator_everywhere_until_released() -> None:
    pins = Pins()
    assert pins.pin(100.0, None, "a", None) == "/a" and pins.until("/a") is None
    assert pins.apply(WORKERS)[0] == ["p.a.0", "p.a.1", "q.a.0"]
    assert pins.expire(1e12) == []  # no end of its own
    for inst, flag in pins.apply(WORKERS)[1]:
        pins.delivered(inst, flag)
    assert pins.release(None, "a") == "/a" and not pins
    pinned, send = pins.apply(WORKERS)
    assert pinned == [] and send == [("p.a.0", False), ("q.a.0", False)]  # the unpinned flag is sent


def test_a_release_naming_a_pipeline_leaves_the_pins_of_others() -> None:
    pins = Pins()
    pins.pin(0.0, "p", "a", None)
    pins.pin(0.0, "q", "a", None)
    pins.pin(0.0, None, "b", None)
    pins.release("p", "a")
    assert pins.listed() == [{"pipeline": None, "operator": "b", "until": None},
                             {"pipeline": "q", "operator": "a", "until": None}]
    pins.release(None, "a")
    assert [p["operator"] for p in pins.listed()] == ["b"]


def test_a_pin_expires_at_its_time_and_not_before() -> None:
    pins = Pins({"p/a": {"pipeline": "p", "operator": "a", "until": 130.0}})
    assert pins.expire(129.999) == [] and pins.pin_of("p", "a") is not None
    assert pins.expire(130.0) == ["p/a"] and pins.pin_of("p", "a") is None and not pins


def test_a_new_process_of_a_pinned_instance_is_told_again() -> None:
    pins = Pins()
    pins.pin(0.0, "p", "a", None)
    pins.delivered("p.a.0", True)
    pins.forget("p.a.0")  # its worker exited: the next one starts unpinned
    assert pins.apply(WORKERS)[1] == [("p.a.0", True)]
