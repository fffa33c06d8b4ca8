"""The commands of one call of a part, returned to its caller (h11's "events out").

A part of the instance (the scaling driver, the key groups' side, the group moves) appends the
commands it makes to its own list as it goes, and each of its entry points, marked `emits`, hands
them back in their order: the caller puts them where the call stands in its own list, so the
instance's commands of one event keep the order the parts made them in (a `Persist` before the
messages it protects: agent.instance.recovery), and no part holds another's list. An entry point
called from within another of the same part leaves its commands to the outer one: what a caller
gets does not depend on which entry point it went through. An exception drops the call's
commands, as `Instance.handle` drops those of the event it raised on.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List

from agent.instance.commands import Command

__all__ = ["Emitter", "emits"]


class Emitter:
    """A part whose entry points return their commands (`emits`)."""

    def __init__(self) -> None:
        self._cmds: List[Command] = []
        self._depth = 0

    @property
    def unreturned(self) -> int:
        """Commands made outside any entry point: none, unless a path that makes them was entered
        some other way (they would leave with a later call, out of order; the instance checker
        stops on it)."""
        return len(self._cmds)


def emits(method: Callable[..., None]) -> Callable[..., List[Command]]:
    """`method` of an `Emitter`, returning the commands its call made, in order."""

    @functools.wraps(method)
    def entry(self: Emitter, *args: Any, **kwargs: Any) -> List[Command]:
        self._depth += 1
        try:
            method(self, *args, **kwargs)
        finally:
            self._depth -= 1
            taken, outer = self._cmds, not self._depth
            if outer:
                self._cmds = []
        return taken if outer else []

    return entry
