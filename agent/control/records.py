"""The pipeline record on `pipelines/<name>` (admin-written, docs/security.md): a deployed pipeline's
TOML text stamped with its generation, or the tombstone an undeploy leaves; and the rule by which an
agent keeps or forgets an instance of a pipeline (`stale_reason`, docs/fogctl.md "Deploy and
undeploy").

Why in agent/control: the deployer writes these records, the daemon judges its instances by them,
and fogctl shows them; none of those may import the others.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass
from typing import Any, Optional

GENERATION_KEY = "generation"  # in InstanceSpec.extra
_GENERATION_LINE = re.compile(r"# fog-generation: ([0-9A-Za-z_.-]{1,64})\r?$")
_TOMBSTONE_LINE = re.compile(r"# fog-undeployed: ([0-9A-Za-z_.-]{1,64})\r?$")


@dataclass(frozen=True)
class PipelineRecord:
    """What the retained `pipelines/<name>` says: "deployed" (TOML text) or "undeployed" (a
    tombstone), with the generation it names (None: written by a tool without generations)."""

    state: str
    generation: Optional[str] = None
    # The admin's signature line of a deployed record (agent.signing), None when unsigned.
    signature: Optional[Any] = None


def new_generation(wall: Optional[float] = None) -> str:
    """A fresh generation id: milliseconds (hex, so later deploys sort later) + 24 random bits."""
    return f"{int((time.time() if wall is None else wall) * 1000):x}-{secrets.token_hex(3)}"


def stamp(text: str, generation: str, signature: Optional[Any] = None) -> str:
    """The record of a deploy: the TOML text with a first comment line naming its generation and,
    when the deployer signs (agent.signing.Signature), a second one carrying the admin's signature
    (comments, so every reader that loads the TOML reads the same pipeline)."""
    signed = f"{signature.line()}\n" if signature is not None else ""
    return f"# fog-generation: {generation}\n{signed}{text}"


def tombstone(name: str, generation: Optional[str]) -> bytes:
    """The record an undeploy (or a rolled-back deploy) leaves: not TOML of a pipeline, and not
    empty (an empty retained message deletes the record, and with it what agents that were away
    need to learn: forget this pipeline's instances)."""
    return (f"# fog-undeployed: {generation or '-'}\n# pipeline {name} was undeployed at "
            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}: agents forget its instances\n").encode()


def parse_record(payload: bytes) -> Optional[PipelineRecord]:
    """The record a retained payload holds; None for an empty payload (no record)."""
    if not payload:
        return None
    first = payload[:200].split(b"\n", 1)[0].decode("utf-8", "replace")
    m = _TOMBSTONE_LINE.match(first)
    if m is not None or first.startswith("# fog-undeployed:"):
        gen = m.group(1) if m is not None else None
        return PipelineRecord("undeployed", None if gen == "-" else gen)
    m = _GENERATION_LINE.match(first)
    if m is None:
        return PipelineRecord("deployed")
    from agent.signing import Signature

    second = payload[:600].split(b"\n", 2)
    sig = Signature.from_line(second[1].decode("utf-8", "replace")) if len(second) > 2 else None
    return PipelineRecord("deployed", m.group(1), sig)


def deployed_text(payload: bytes) -> Optional[str]:
    """The pipeline text an admin deployed, as the deployer put it in the keepers' specs (the
    record without its generation line); None for a tombstone, an empty or a non-UTF-8 record."""
    record = parse_record(payload)
    if record is None or record.state != "deployed":
        return None
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        return None
    first, sep, rest = text.partition("\n")
    if not (sep and _GENERATION_LINE.match(first)):
        return text
    if record.signature is not None:  # the signature line is the record's, not the pipeline's
        rest = rest.partition("\n")[2]
    return rest


def spec_generation(spec: Any) -> Optional[str]:
    """The generation an InstanceSpec (or its request dict) belongs to, None before generations."""
    extra = spec.get("extra") if isinstance(spec, dict) else getattr(spec, "extra", None)
    gen = extra.get(GENERATION_KEY) if isinstance(extra, dict) else None
    return gen if isinstance(gen, str) and gen else None


def stale_reason(generation: Optional[str], record: Optional[PipelineRecord]) -> Optional[str]:
    """Why an instance of generation `generation` must not run (or be re-adopted), or None.

    - a tombstone: the pipeline was undeployed;
    - a deployed record of another generation: the instance is left over from an earlier deploy;
    - no record at all: None, the instance is kept. Why: a broker without persistence loses
      every retained record when it restarts, also those of pipelines that run; refusing then
      would turn a broker restart plus an agent restart into an outage of that agent's part of
      every pipeline (its neighbours' routes stall). An undeploy does not depend on the record
      surviving: it makes each agent forget the specs at once (`stop` with `forget`, answered
      after the files are gone), and the tombstone reaches agents that were away. What is left
      (an agent away during the undeploy AND a broker that lost the tombstone meanwhile) shows
      in the agents' states, and `fogctl undeploy --force NAME` stops it.
    A spec or record without a generation (written before generations) is judged by the
    record's state only."""
    if record is None:
        return None
    if record.state == "undeployed":
        return "its pipeline was undeployed"
    if generation and record.generation and generation != record.generation:
        return f"it belongs to deploy {generation}, the deployed one is {record.generation}"
    return None
