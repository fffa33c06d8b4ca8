"""Two operators for temperature sensors, the worked example of docs/operators.md.

Readings arrive from the sensors over MQTT (`agent.operators.taxi:mqtt_source`) as JSON objects
`{"sensor": "s1", "celsius": 21.5}`; the pipeline is examples/operators/pipeline.toml:

    mqtt_source -> to_fahrenheit (map and filter; key = "sensor") -> sensor_stats (keyed) -> mqtt_sink

- `to_fahrenheit` adds `fahrenheit` (rounded to `params.digits`, default 1) and drops a reading
  without a numeric `celsius` or without a `sensor` (None = filtered: the worker counts it);
- `sensor_stats` keeps, per sensor, how many readings it saw and the highest temperature, and
  emits each reading with `count` and `max_f` added. `key = "sensor"` on the operator BEFORE it
  sends all readings of one sensor to the same instance of `sensor_stats`.
"""

from __future__ import annotations

from typing import Any, Dict, List

from agent.operators import Operator, OperatorContext, Param, record_map


@record_map
def to_fahrenheit(rec: Any, params: Dict[str, Any]) -> Any:
    """A map that is also a filter: returning None drops the record."""
    if not isinstance(rec, dict) or not isinstance(rec.get("sensor"), str):
        return None
    c = rec.get("celsius")
    if isinstance(c, bool) or not isinstance(c, (int, float)):
        return None
    return {"sensor": rec["sensor"], "celsius": c, "fahrenheit": round(c * 9 / 5 + 32, params.get("digits", 1))}


# Checked by `fog-agent check-config` (optional): a misspelt or wrong-typed param is an error there.
to_fahrenheit.params_schema = {"digits": Param("integer", min=0, max=6)}  # type: ignore[attr-defined]


class SensorStats(Operator):
    """Per-sensor state in this instance's memory. It is not handed over when the operator's
    instance count changes (key groups then move), so the pipeline fixes the count at one."""

    def __init__(self, ctx: OperatorContext) -> None:
        self.count: Dict[str, int] = {}
        self.max_f: Dict[str, float] = {}

    def process(self, items: List[Any]) -> List[Any]:
        out = []
        for src, seq, rec in items:  # keep (src, seq): the record's id, end to end
            s = rec["sensor"]
            self.count[s] = self.count.get(s, 0) + 1
            self.max_f[s] = max(self.max_f.get(s, rec["fahrenheit"]), rec["fahrenheit"])
            out.append((src, seq, dict(rec, count=self.count[s], max_f=self.max_f[s])))
        return out

    def stats(self) -> Dict[str, Any]:
        return {"sensors": len(self.count)}


class _Factory:
    """What the pipeline names: an object with `build(ctx) -> Operator`, called once per instance."""

    params_schema: Dict[str, Param] = {}  # takes no params

    def build(self, ctx: OperatorContext) -> Operator:
        return SensorStats(ctx)


sensor_stats = _Factory()
