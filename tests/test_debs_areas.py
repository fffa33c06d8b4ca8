"""DEBS query 2 at the edge (foglab.operators.debs_areas: empty_taxis -> cell_profit -> top_areas,
run by the keyed state as workers run them) against the batch definition (tests/debs_reference.py,
itself checked against Spark in tests/test_debs_edge.py), on small synthetic trip sets: few taxis
and cells so that taxis' trips overlap, next pickups fall before and after window ends, fares are
zero, and profitabilities tie."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Dict, List, Optional, Tuple

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.instance.keyed_state import KeyedState
from agent.operators.builtin import OperatorContext
from foglab.operators.debs_areas import cell_profit, empty_taxis, median, merge_top_areas
from debs_reference import reference_areas
from keyed_chain import Chain, Stage

SIZE, RECENT, LATENESS, MAX_TRIP = 600_000, 300_000, 1_200_000, 1_500_000  # 10, 5, 20, 25 minutes
EPOCH = datetime(2013, 1, 1)
T0 = int((EPOCH - datetime(1970, 1, 1)).total_seconds() * 1000)
CELLS = ("1.1", "1.2", "2.1", "2.2")


def trip(taxi: str, pickup_s: int, seconds: int, pcell: str, dcell: str, fare: float, tip: float) -> Dict[str, Any]:
    fmt = "%Y-%m-%d %H:%M:%S"
    return {"medallion": taxi, "pickup_datetime": (EPOCH + timedelta(seconds=pickup_s)).strftime(fmt),
            "dropoff_datetime": (EPOCH + timedelta(seconds=pickup_s + seconds)).strftime(fmt),
            "pickup_cell": pcell, "dropoff_cell": dcell, "fare_amount": fare, "tip_amount": tip}


def stages(a: int = 1, b: int = 1) -> Chain:
    """The three stages, one instance each, as a Chain (tests/keyed_chain.py)."""
    common = {"time_field": "dropoff_datetime", "size_ms": SIZE, "lateness_ms": LATENESS, "forward": True}
    params = {"empty_taxis": dict(common, max_trip_ms=MAX_TRIP), "cell_profit": dict(common, recent_ms=RECENT),
              "top_areas": dict(common, max_trip_ms=MAX_TRIP, k=3)}
    keys = {"empty_taxis": "medallion", "cell_profit": "pickup_cell", "top_areas": "all_areas"}
    fns = {"empty_taxis": empty_taxis, "cell_profit": cell_profit, "top_areas": merge_top_areas}

    def builder(op: str):
        def build(name: str) -> KeyedState:
            built = fns[op].build(OperatorContext(name, op, "n", "map", params=dict(params[op])))
            return KeyedState(built, op, keys[op], 128)
        return build

    return Chain([Stage(builder(op), f"{op}-0") for op in ("empty_taxis", "cell_profit", "top_areas")], seed=1)


def run(trips: List[Dict[str, Any]], batch: int = 3) -> Tuple[List[Dict[str, Any]], Chain]:
    """The trips in this order through the stages, then a trip a day later that closes every window."""
    chain = stages()
    items = [("src", i, t) for i, t in enumerate(trips + [trip("flush", 86_400, 60, "9.9", "9.9", 1.0, 0.0)])]
    for i in range(0, len(items), batch):
        chain.feed("in_zone-0", items[i:i + batch])
        chain.pump(some=False)
    return [r for s, _, r in chain.out if s.startswith("top_areas#")], chain


def merge_stats(chain: Chain) -> Dict[str, Any]:
    return next(iter(chain.stages[2].insts.values())).op.stats()


def test_the_next_pickup_zero_fares_and_ties_by_hand() -> None:
    trips = [
        # window [0, 10 min): taxi a ends in 1.1 at 4:00, next picks up at 11:00 (after the end): empty
        trip("a", 60, 180, "2.2", "1.1", 10.0, 0.0),
        trip("a", 660, 300, "1.1", "2.2", 4.0, 0.0),
        # taxi b ends in 1.1 at 6:00, but picks up again at 9:00 and ends at 14:00: busy at 10:00
        trip("b", 120, 240, "2.2", "1.1", 8.0, 0.0),
        trip("b", 540, 300, "1.2", "2.1", 3.0, 0.0),
        # taxi c ends in 1.2 at 7:00 (its last trip anywhere): empty
        trip("c", 300, 120, "1.2", "1.2", 2.0, 1.0),
        # profits, from trips ending in the last 5 minutes: 1.1 median of {6, 10} = 8 (the zero
        # fare is left out); 1.2: 3 (c's trip: 2 + 1) -> 1.1: 8 / 1 = 8, 1.2: 3 / 1 = 3
        trip("d", 330, 240, "1.1", "2.1", 6.0, 0.0),
        trip("e", 300, 290, "1.1", "2.1", 9.0, 1.0),
        trip("f", 310, 200, "1.1", "2.1", 0.0, 5.0),
        # d, e, f are empty in 2.1 but nothing started there in the window's last 5 minutes
        # window [10, 20): 1.1 and 2.2 tie on profitability 4 (1.1: median of {8, 8, 4 (a's)} / g and
        # h = 8 / 2; 2.2: i's 4 / a = 4 / 1): the higher profit first
        trip("g", 700, 200, "1.1", "1.1", 8.0, 0.0),
        trip("h", 720, 200, "1.1", "1.1", 8.0, 0.0),
        trip("i", 800, 200, "2.2", "1.2", 4.0, 0.0),
    ]
    got, chain = run(trips)
    assert [w["start"] - T0 for w in got] == [0, SIZE]
    assert got[0]["areas"] == [["1.1", 8.0, 1, 8.0], ["1.2", 3.0, 1, 3.0]]
    assert got[1]["areas"] == [["1.1", 8.0, 2, 4.0], ["2.2", 4.0, 1, 4.0]]
    assert got[0]["trips"] == 6 and got[1]["trips"] == 5
    ref = reference_areas(trips + [trip("flush", 86_400, 60, "9.9", "9.9", 1.0, 0.0)], SIZE, RECENT, k=3)
    assert {w["start"]: w["areas"] for w in got} == {s: v for s, v in ref.items() if s in (T0, T0 + SIZE)}
    assert merge_stats(chain) == {}


def test_median_is_sparks_percentile() -> None:
    assert median([3.0]) == 3.0 and median([1.0, 4.0]) == 2.5 and median([4.0, 1.0, 2.0]) == 2.0
    assert median([10.94, 45.059999999999995]) == 28.0  # Spark 4.3's answer; 0.5 * a + 0.5 * b is 27.999999999999996


trip_params = st.tuples(st.sampled_from("abcd"), st.integers(0, 90), st.integers(1, 25), st.sampled_from(CELLS),
                        st.sampled_from(CELLS), st.sampled_from((0.0, 5.0, 7.5, 10.0)), st.sampled_from((0.0, 1.0, 2.5)),
                        st.integers(0, 19))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(trip_params, min_size=1, max_size=40), st.integers(1, 5))
def test_every_window_equals_the_batch_definition(params: List[Tuple[Any, ...]], batch: int) -> None:
    """Minutes of pickup and duration (ties on the minute are common), arriving out of order by up
    to the lateness (never late), in batches of 1-5."""
    seen = set()
    trips, order = [], []
    for taxi, pickup, minutes, pcell, dcell, fare, tip, jitter in params:
        if (taxi, pickup, minutes) in seen:
            continue  # the same taxi's trips with the same times: the batch order between them is arbitrary
        seen.add((taxi, pickup, minutes))
        trips.append(trip(taxi, pickup * 60, minutes * 60, pcell, dcell, fare, tip))
        order.append(pickup + minutes + jitter)  # arrival by drop-off + up to 19 minutes
    arrival = [t for _, t in sorted(zip(order, range(len(trips))))]
    got, chain = run([trips[i] for i in arrival], batch)
    ref = reference_areas(trips, SIZE, RECENT, k=3)
    starts = sorted({T0 + (p + m) * 60_000 // SIZE * SIZE for _, p, m, *_ in params})
    assert [w["start"] for w in got] == starts  # every window with a trip, in order
    for w in got:
        assert w["areas"] == ref.get(w["start"], []), w["start"] - T0
    assert merge_stats(chain) == {}
    a = next(iter(chain.stages[0].insts.values()))
    assert a.counts["late_dropped"] == 0


def test_a_decision_waits_for_the_next_trip_or_the_longest_trip() -> None:
    """Taxi a's trip ends at 5:00 in window [0, 10); its next trip (pickup 9:00, before the end)
    ends at 30:00. The decision must wait until the watermark passes 30:00, not decide at the
    window's end that a is empty."""
    op = empty_taxis.build(OperatorContext("a-0", "empty_taxis", "n", "map", params={
        "time_field": "dropoff_datetime", "size_ms": SIZE, "max_trip_ms": MAX_TRIP}))
    st_: Optional[Dict[str, Any]] = None
    _, st_ = op.on_batch("a", [trip("a", 0, 300, "1.1", "1.1", 5.0, 0.0)], st_)
    assert op.notify_at("a", st_) > T0 + SIZE + MAX_TRIP  # no later trip seen: the longest trip bounds it
    _, st_ = op.on_batch("a", [trip("a", 540, 1260, "1.2", "1.2", 5.0, 0.0)], st_)
    due = op.notify_at("a", st_)
    assert T0 + 1_800_000 < due < T0 + 1_800_001
    out, st_ = op.on_notify("a", st_, float(T0 + 1_800_000))  # not passed yet
    assert out == []
    out, st_ = op.on_notify("a", st_, due)
    assert out == [{"start": T0, "end": T0 + SIZE, "trips": 1, "empty_taxis": []}]  # busy at 10:00
