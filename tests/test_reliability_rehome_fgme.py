"""The chaos fault paths of docs/reliability.md that need a node lost for good (re-homing) or
2-FGME locks, on real processes (`foglab.tools.chaos`). A file apart from test_reliability.py only
so that the test processes share the slow chaos runs evenly; the same accounting decides.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from foglab.tools.chaos import ChaosConfig, run_chaos
from test_reliability import assert_nothing_lost

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_a_node_lost_in_the_middle_of_a_duplication_is_rehomed_and_nothing_is_lost(tmp_path: Path) -> None:
    """Power loss of the node hosting every keeper (agent and workers killed at once, nothing
    drains) 9 s into the ramp-up, while in_zone's keeper is in a duplication round, with
    re-homing on (`dead_after` 6 s): after the bound, the survivors restart each of its
    instances elsewhere with the same identity; the node comes back and forgets them.

    The copy of the interrupted round runs on another node and never got its Start: the
    re-homed keeper knows nothing of the round, so the copy's idle ping is answered with a probe
    and the copy is adopted (announced again, then started). Before that fix the copy stayed
    idle with batches routed to it and 639 records never reached the sink (2 runs of 3). In the
    run that found the copy-id re-use, the re-homed keeper's new copy stalled (206 records).

    Then a partition of the node now hosting the keepers for 34 s: its Will fires (15-20 s into
    the cut), its instances are re-homed 6 s later while the originals still run, and on heal its workers wait for their agent
    (fencing) instead of taking their sessions back: before, both incarnations took each
    session from each other ~60 times, and a run lost 188 records and recorded 185 twice.
    The cut lasts until all of them run elsewhere (`partition_until_rehomed`): at load ~18 the
    last re-homed worker was not up 7 s after the re-homing began, and a heal at 34 s sharp
    came before it (3 runs of 3 at load 45-50). A copy an in_zone copy asked for just before the
    cut, started only after the re-home plan was made, stayed idle for ever when its re-homed
    creator's policy scaled in before the copy's first idle ping; a re-homed instance's policy
    now waits LATE_COPY (40 s) before a scale-in, which the settle waits for: ~80-100 s."""
    cfg = ChaosConfig(duration=70.0, seed=5, workdir=tmp_path, partition=(34.0, 34.0), partition_until_rehomed=True,
                      schedule=[(5.0, "kill-worker", "chaos.in_zone.0"), (9.0, "kill-node", "@chaos.source.0"),
                                (28.0, "partition", "@chaos.source.0")])
    summary = run_chaos(cfg, live=False)
    lost_node = summary["faults"][1]["detail"]
    assert "chaos.source.0" in lost_node["instances"] and lost_node["rehomed_after_s"] is not None, lost_node
    cut = summary["faults"][2]["detail"]
    assert cut["offline_after_s"] is not None, cut  # the Will fired
    assert "chaos.source.0" in cut["active_elsewhere_at_heal"], cut  # re-homed while the original ran
    assert_nothing_lost(summary, 3)


def test_fgme_locks_survive_broker_kills_crashes_and_a_partition(tmp_path: Path) -> None:
    """coordination = "fgme": every round runs inside 2-FGME locks whose messages travel on the
    exactly-once links (agent.instance.recovery.ReliableLinks). A kill -9 of the in_zone keeper
    (a lock holder or requester while in_zone scales), a SIGKILLed broker (what it held since
    its last autosave is lost), kill -9 of the agent hosting the keepers, a broker restart and
    a short partition, during a load that makes in_zone scale out and back: nothing lost,
    nothing twice, every fault recovered from, rounds under the locks did run, and at the end no
    instance holds or waits for a lock or is still in a round (each worker's own view, as
    `fogctl locks` reads it). ~90 s: a real fleet through five faults."""
    kinds = ["kill-worker", "kill-broker", "restart-broker", "partition", "kill-agent"]
    # each fault as soon as the fleet recovered from the last one (a slow recovery under load
    # must not push the last fault past the load's end)
    cfg = ChaosConfig(duration=50.0, seed=5, workdir=tmp_path, coordination="fgme", partition=(4.0, 6.0),
                      faults=tuple(kinds),
                      schedule=[(4.0, "kill-worker", "chaos.in_zone.0"), (6.0, "kill-broker", None),
                                (8.0, "restart-broker", None), (10.0, "partition", "@chaos.source.0"),
                                (12.0, "kill-agent", "@chaos.in_zone.0")])
    summary = run_chaos(cfg, live=False)
    assert [f["kind"] for f in summary["faults"]] == kinds, summary["faults"]
    assert_nothing_lost(summary, 5)
    assert summary["coordination"] == "fgme"
    assert summary["scale_outs"] >= 1 and summary["scale_ins"] >= 1, summary
    assert summary["lock_messages"] > 0, summary  # the rounds did take the locks
    assert summary["locks_held_at_end"] == [] and summary["in_round_at_end"] == [], summary
    assert summary["ok"], summary
