"""Key groups: the unit in which keyed records are routed and keyed state is kept (docs/operators.md,
"Keyed state"; docs/design.md section 8).

Rules of this file: every mapping key -> group -> instance in the project is computed here, so
that the predecessors' routing and the keyed operator's state agree on where a key lives.

- A key is the value of the routing field of a record (`key = "field"` on the operator before the
  keyed one); a record that is not a dict, or lacks the field, has the key None.
- group = crc32(str(key)) mod `groups`. Not Python's `hash()`: it is salted per process, and
  every process on every node must compute the same group.
- `groups` is fixed per keyed operator (`key_groups`, default 128) for the life of a deployment:
  the groups, not the keys, are what moves when instances come and go.
- The groups are dealt over the instances in sorted name order: group g belongs to
  sorted(instances)[g mod n]. Every predecessor sees the same instance set (the paper's succs),
  so all of them send a key to the same instance.
"""

from __future__ import annotations

import zlib
from typing import Any, Iterable, Optional, Sequence, Set

__all__ = ["DEFAULT_GROUPS", "MAX_GROUPS", "key_group", "record_key", "owner", "groups_of"]

DEFAULT_GROUPS = 128
MAX_GROUPS = 65536


def key_group(key: Any, groups: int = DEFAULT_GROUPS) -> int:
    """The group of `key`: stable across processes and machines."""
    return zlib.crc32(str(key).encode()) % groups


def record_key(record: Any, field: Optional[str]) -> Any:
    """The key of a record for the routing field `field` (None: not a dict, or no such field)."""
    if field is None or not isinstance(record, dict):
        return None
    return record.get(field)


def owner(group: int, instances: Sequence[str]) -> str:
    """The instance that owns `group` among `instances` (any order; sorted here)."""
    ordered = sorted(set(instances))
    if not ordered:
        raise ValueError("no instances to own key groups")
    return ordered[group % len(ordered)]


def groups_of(instance: str, instances: Iterable[str], groups: int = DEFAULT_GROUPS) -> Set[int]:
    """Every group `instance` owns among `instances` (empty if it is not one of them)."""
    ordered = sorted(set(instances))
    if instance not in ordered:
        return set()
    i, n = ordered.index(instance), len(ordered)
    return set(range(i, groups, n))
