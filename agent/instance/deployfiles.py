"""An instance's files on its node belong to one deploy of its pipeline.

Why: instance ids repeat across deploys of a pipeline under the same name (a keeper is
`<pipeline>.<operator>.<k>`; a copy is named from its creator's id, incarnation and round), and
so do the record ids of a replayable source. The files a node keeps for an instance (its protocol
state, route memory and keyed state; a source's position and ingest log; a sink's ids and spool)
outlive an undeploy. Read by the same id in a later deploy they made it the old instance: a copy
re-homed onto a node where its namesake had run took that incarnation's "terminated" and exited
at start, and the records routed to it were never acked (`fog-agent chaos --testbed`: 191 lost);
a sink took the old ids as seen and dropped the new records that carry them.

So a node stamps each instance's files with the deploy's generation (`extra["generation"]`,
agent.node.deploy) in `<state_dir>/<instance>.generation`, and before an instance reads anything,
files stamped with another generation are put out of its way (`claim`): its memory is deleted,
its spool (records that may not have left the node yet) is renamed so that the shipper still
ships it and the new sink does not read it. Files without a stamp (written before stamps, or by
an instance whose spec carries no generation) are kept: an agent upgraded under a running deploy
must not lose that deploy's state.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Optional

from agent.files import write_atomic

__all__ = ["STATE_FILES", "SINK_FILES", "claim", "claim_spec", "forget"]

log = logging.getLogger(__name__)

# <state_dir>/<instance>.<name>: Worker.state_path, routes (agent.dataplane.sticky), keyed state
# (Worker.keyed_path, agent.node.statexfer)
STATE_FILES = ("state.json", "routes.json", "routes.log", "keyed.json", "keyed.json.log", "keyed.handover")
# <sink_dir>/<instance>.<name>: a source's position and ingest log, a sink's ids
SINK_FILES = ("source.json", "ingest.log", "ids")
STAMP = "generation"
# A generation is `<ms hex>-<6 hex>` (agent.control.records.new_generation); it comes with a spec
# from the bus and ends up in a directory name: letters, digits, `-` and `_` only, bounded.
GENERATION = re.compile(r"[0-9A-Za-z_-]{1,64}")


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def claim(instance: str, generation: str, state_dir: Path, sink_dir: Path,
          spill_dir: Optional[Path] = None) -> Optional[str]:
    """Make the instance's files those of deploy `generation`; returns the other generation whose
    files were put away, or None. A no-op without a generation. Call it before anything of the
    instance is read (the worker: once it holds the identity lock)."""
    if not generation or not GENERATION.fullmatch(generation):
        return None
    stamp = Path(state_dir) / f"{instance}.{STAMP}"
    try:
        old: Optional[str] = stamp.read_text()[:100].strip()
    except FileNotFoundError:
        old = None
    if old == generation:
        return None
    put_away = old if old and GENERATION.fullmatch(old) else None
    if put_away:
        for name in STATE_FILES:
            _unlink(Path(state_dir) / f"{instance}.{name}")
        for name in SINK_FILES:
            _unlink(Path(sink_dir) / f"{instance}.{name}")
        spool = Path(spill_dir) / instance if spill_dir is not None else None
        if spool is not None and spool.is_dir():
            spool.rename(spool.with_name(f"{instance}~{put_away}"))  # still shipped (SpoolDirs reads every */closed)
        log.info("files of %s from an earlier deploy of its pipeline (generation %s) put away: this is "
                    "deploy %s", instance, put_away, generation, extra={"instance": instance})
    stamp.parent.mkdir(parents=True, exist_ok=True)  # the agent claims before the worker makes it
    write_atomic(stamp, generation + "\n")
    return put_away


def claim_spec(spec: Any) -> Optional[str]:
    """`claim` for an instance spec (agent.instance.spec.InstanceSpec): its state and sink
    directories, its spool's directory when it spills."""
    extra = spec.extra or {}
    generation = extra.get("generation")
    spill = extra.get("spill")
    spill_dir = spill.get("dir") if isinstance(spill, dict) else None
    return claim(spec.instance, generation if isinstance(generation, str) else "", Path(spec.state_dir),
                 Path(extra.get("sink_dir") or spec.state_dir), Path(spill_dir) if spill_dir else None)


def forget(instance: str, state_dir: Path) -> None:
    """The instance left this node: its memory and its stamp go (its sink files and spool stay,
    for the verifier and the shipper)."""
    for name in STATE_FILES + (STAMP,):
        _unlink(Path(state_dir) / f"{instance}.{name}")
