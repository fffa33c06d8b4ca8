"""pipeline.toml offline, with the harness (agent.testing): no broker, no agent, milliseconds.

    python -m pytest examples/sensor-minutes      # from the checkout
"""

from pathlib import Path

from agent.testing import run_pipeline

PIPELINE = Path(__file__).with_name("pipeline.toml")
T0 = 1764000000  # a minute's start, in seconds
READINGS = [
    {"sensor": "s1", "t": T0 + 1, "temp": 20.0},
    {"sensor": "s2", "t": T0 + 2, "temp": 18.0},
    {"sensor": "s1", "t": T0 + 30, "temp": "n/a"},   # dropped by clean
    {"sensor": "s1", "t": T0 + 31, "temp": 23.0},
    {"sensor": "s1", "t": T0 + 61, "temp": 21.0},
    {"sensor": "s2", "t": T0 + 66, "temp": 17.0},    # 5 s past the first minute: it closes
]
FIRST_MINUTE = [
    {"key": "s1", "start": T0 * 1000, "end": (T0 + 60) * 1000, "mean_temp": 21.5, "max_temp": 23.0},
    {"key": "s2", "start": T0 * 1000, "end": (T0 + 60) * 1000, "mean_temp": 18.0, "max_temp": 18.0},
]


def test_one_minute_mean_and_max_per_sensor(tmp_path):
    h = run_pipeline(PIPELINE, READINGS, state_dir=tmp_path, allowed=["mysensors"], end=False)
    assert sorted(h.records(), key=lambda r: r["key"]) == FIRST_MINUTE


def test_a_crash_and_a_scale_out_change_no_window(tmp_path):
    # end=True: the input is bounded, so every open window fires at its end (the second minute too)
    calm = run_pipeline(PIPELINE, READINGS, state_dir=tmp_path / "calm", allowed=["mysensors"])
    rough = run_pipeline(PIPELINE, READINGS, state_dir=tmp_path / "rough", allowed=["mysensors"],
                         at={2: ["scale_out"], 4: ["crash"]})
    assert len(calm.records()) == 4
    assert rough.sink.by_id == calm.sink.by_id   # the same window records under the same ids
