"""The scaling simulator: determinism, protocol correctness under delays, paper-like behaviour."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agent.cli.main import main
from agent.protocol.scaling import ScalingCore
from foglab.sim.scaling_sim import SimConfig, simulate

REQUIRED = {"steps", "operators", "final_instances", "messages_total", "accuracy_mean",
            "ideal_throughput_pct_mean", "lost_records", "stale_route_deliveries",
            "inconsistent_views_at_quiescence"}


def _clean(s):
    return (s["stale_route_deliveries"], s["inconsistent_views_at_quiescence"], s["protocol_errors"],
            s["messages_to_terminated"], s["rounds_open_at_end"], s["lost_records"])


def test_same_seed_same_run_byte_for_byte(capsys):
    outs = []
    for _ in range(2):
        assert main(["simulate", "scaling", "--seed", "7", "--steps", "120", "--delays", "1-3", "--json"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    data = json.loads(outs[0])
    assert REQUIRED <= set(data)
    assert main(["simulate", "scaling", "--seed", "8", "--steps", "120", "--delays", "1-3", "--json"]) == 0
    assert capsys.readouterr().out != outs[0]


def test_same_seed_same_series_in_a_fresh_process(tmp_path):
    files = []
    for k in range(2):
        f = tmp_path / f"run{k}.csv"
        subprocess.run([sys.executable, "-m", "agent", "simulate", "scaling", "--seed", "3", "--steps",
                        "80", "--csv", str(f)], check=True, capture_output=True)
        files.append(f.read_bytes())
    assert files[0] == files[1] and len(files[0]) > 1000


@pytest.mark.parametrize("baseline", ["decentralized", "centralized"])
@pytest.mark.parametrize("delays", [(1, 1), (1, 4)])
def test_protocol_stays_correct_in_long_runs(baseline, delays):
    res = simulate(SimConfig(seed=11, steps=200, baseline=baseline, delay_min=delays[0], delay_max=delays[1]))
    s = res.summary()
    assert _clean(s) == (0, 0, 0, 0, 0, 0.0), s
    assert s["rounds_started"] > 20  # the protocol really ran
    assert s["messages_total"] > 0


def test_instances_follow_the_load():
    res = simulate(SimConfig(seed=1, steps=200))
    s = res.summary()
    assert 0.8 < s["accuracy_mean"] < 1.25, s
    assert s["ideal_throughput_pct_mean"] > 95.0, s
    # instances track the ideal count: strongly correlated over the run
    n, ideal = res.instances[20:], res.ideal[20:]
    mn, mi = sum(n) / len(n), sum(ideal) / len(ideal)
    cov = sum((a - mn) * (b - mi) for a, b in zip(n, ideal))
    var = (sum((a - mn) ** 2 for a in n) * sum((b - mi) ** 2 for b in ideal)) ** 0.5
    assert cov / var > 0.9


def test_monotonic_load_gives_superlinear_message_growth():
    """Fig. 3.6: messages per duplication grow with the neighbour count, so total traffic is
    quadratic in the number of instances when the load (hence the instance count) grows."""
    res = simulate(SimConfig(seed=2, steps=200, load="monotonic"))
    assert _clean(res.summary())[:5] == (0, 0, 0, 0, 0)
    per_step = res.messages
    first, last = sum(per_step[20:70]), sum(per_step[150:200])
    n_first, n_last = sum(res.instances[20:70]), sum(res.instances[150:200])
    assert n_last > 2 * n_first
    # messages grew faster than instances (quadratic, not linear)
    assert last / first > 1.5 * (n_last / n_first), (first, last, n_first, n_last)


def test_r_secure_improves_throughput_on_average():
    plain, secure = [], []
    for seed in range(6):
        plain.append(simulate(SimConfig(seed=seed, steps=150)).summary())
        secure.append(simulate(SimConfig(seed=seed, steps=150, r_secure=True)).summary())
    mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    assert mean(secure, "ideal_throughput_pct_mean") >= mean(plain, "ideal_throughput_pct_mean")
    assert mean(secure, "delayed_records") < mean(plain, "delayed_records")


def test_wrapper_core_can_be_injected():
    seen = []

    class Counting(ScalingCore):
        def start_round(self, decision, new_ids=None):
            seen.append(decision.action)
            return super().start_round(decision, new_ids)

    res = simulate(SimConfig(seed=4, steps=60), core_cls=Counting)
    assert len(seen) == res.rounds_started > 0


def test_plot_is_written(tmp_path, capsys):
    png = tmp_path / "run.png"
    assert main(["simulate", "scaling", "--steps", "40", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
