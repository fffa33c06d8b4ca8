"""The operator code of examples/sensor-minutes/pipeline.toml: one plain function.

`clean` keeps a reading `{"sensor": "s1", "t": 1764000001.5, "temp": 20.5}` (`t` in seconds)
with a sensor name, a time and a plausible temperature, as numbers, and drops anything else
(returning None drops a record; the worker counts it). The windows are built in
(agent.operators.windows:window), the file sink too.
"""


def clean(rec):
    if not isinstance(rec, dict) or not isinstance(rec.get("sensor"), str):
        return None
    try:
        t, temp = float(rec["t"]), float(rec["temp"])
    except (KeyError, TypeError, ValueError):
        return None
    if not -50.0 <= temp <= 100.0:
        return None
    return {"sensor": rec["sensor"], "t": t, "temp": temp}
