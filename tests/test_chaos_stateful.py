"""`fog-agent chaos --pipeline stateful` on real processes: a keyed 10-minute window per pickup cell
(foglab.tools.chaos.STATEFUL_PIPELINE) under kill -9 of its instance and of the agent hosting it,
verified window by window against the fault-free reference regenerated from the seeded source
(foglab.tools.verify.verify_windows). Nothing is mocked.

About 60-90 s on the shared 2-core machine: a fleet's start and deploy (~25 s), 30 s of load, the
settle and the clean stop that ships the spilled windows."""

from __future__ import annotations

from pathlib import Path

import pytest

from foglab.tools.chaos import ChaosConfig, run_chaos

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_a_keyed_window_under_kill_worker_kill_agent_and_node_loss_equals_the_fault_free_run(tmp_path: Path) -> None:
    """1. kill -9 of the window's instance: restarted from its saved state and input position,
    its saved outputs sent again (the sink drops the copies by id); 2. kill -9 of its agent: the
    workers drain, the restarted agent re-adopts them; 3. the window's node lost (every process
    killed at once, away past dead_after): the window is re-homed on its standby, which holds a
    copy of its saved state (agent.node.replicas); without it, about half the windows went missing.
    Then every window of the reference is at the sink once, with the same content, and no other."""
    cfg = ChaosConfig(duration=30.0, seed=3, workdir=tmp_path, pipeline="stateful", rehoming=True,
                      schedule=[(7.0, "kill-worker", "chaos.cells.0"), (15.0, "kill-agent", "@chaos.cells.0"),
                                (22.0, "kill-node", "@chaos.cells.0")])
    summary = run_chaos(cfg, live=False)
    assert [(f["kind"], f["recovery_s"] is not None) for f in summary["faults"]] == [
        ("kill-worker", True), ("kill-agent", True), ("kill-node", True)], summary["faults"]
    assert "chaos.cells.0" in summary["faults"][2]["detail"]["instances"]  # the window's node
    assert summary["faults"][0]["target"] == "chaos.cells.0"
    assert summary["settled"], (summary["settle_s"], summary["holding_at_end"])
    w = summary["windows"]
    assert w["expected"] > 1000, w  # ~3 h of pickup time: ~17 windows of ~100 cells each
    assert (w["missing"], w["extra"], w["duplicated"], w["differing"], w["unread"]) == (0, 0, 0, 0, 0), w
    assert w["received"] == w["expected"]
    assert summary["restarts"] >= 1, summary  # the instance really was restarted
    assert summary["ok"], summary


def test_a_keyed_window_scaling_out_and_in_equals_the_fault_free_run(tmp_path: Path) -> None:
    """`--pipeline stateful-scaling`: the window scales out under the load's peak and back in
    (the decentralized policy), its key groups moving with their state between its instances
    (docs/operators.md, "Key groups that move"); one kill -9 of its keeper in the middle. Every
    window of the fault-free reference is at the sink once, with the same content, and no other."""
    cfg = ChaosConfig(duration=30.0, seed=1, workdir=tmp_path, pipeline="stateful-scaling",
                      schedule=[(12.0, "kill-worker", "chaos.cells.0")])
    summary = run_chaos(cfg, live=False)
    assert summary["scale_outs"] >= 1 and summary["scale_ins"] >= 1, summary
    assert summary["settled"], (summary["settle_s"], summary["holding_at_end"])
    w = summary["windows"]
    assert w["expected"] > 1000, w
    assert (w["missing"], w["extra"], w["duplicated"], w["differing"], w["unread"]) == (0, 0, 0, 0, 0), w
    assert summary["ok"], summary
