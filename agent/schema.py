"""Typed loading of TOML tables into frozen dataclasses, with errors that name file and key.

Why a tiny schema layer of our own: operators edit these files by hand on a Pi over SSH, and the
one thing they need from an error is *where* (file, key path) and *what was expected*. Unknown keys
are errors because a misspelt key silently falling back to a default is the classic way an
experiment runs with the wrong parameters and nobody notices.

A dataclass field is described by its type annotation plus optional `metadata`:
  - `check`: a callable `(value) -> str | None` returning what was expected when the value is bad;
  - `key`: the TOML key when it differs from the field name (e.g. `operator` for `operators`).
Supported annotations: bool, int, float, str, Optional[X], Literal[...], Tuple[Dataclass, ...],
Dict[str, Any] (free-form tables such as operator params), nested dataclasses, and Union[float, str]
style unions of scalars (for values like `capacity = 500` or `capacity = "calibrate"`).
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Type, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on the Pi OS Python
    import tomli as tomllib

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration file is unreadable or does not match its schema.

    `str(err)` is the one-line message shown to the operator:
    `agent.toml: [mqtt].port: expected an integer 1-65535, got "abc"`.
    """

    def __init__(self, file: str, key: str, expected: str, got: Any = dataclasses.MISSING):
        self.file, self.key, self.expected, self.got = file, key, expected, got
        msg = f"{file}: {key}: {expected}" if key else f"{file}: {expected}"
        if got is not dataclasses.MISSING:
            msg += f", got {_show(got)}"
        super().__init__(msg)


def _show(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return repr(value)


def key_path(section: str, key: str) -> str:
    """Render a key the way TOML users read it: `[mqtt].port`, `[[operator]][2].name`."""
    return f"[{section}].{key}" if section else key


def read_toml(path: Path) -> Dict[str, Any]:
    name = path.name
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(str(path), "", "file not found") from None
    except OSError as exc:
        raise ConfigError(str(path), "", f"cannot read file ({exc.strerror})") from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(name, "", "expected UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(name, "", f"invalid TOML ({exc})") from None


def load_dataclass(cls: Type[T], data: Mapping[str, Any], file: str, section: str = "") -> T:
    """Build `cls` from a TOML table; every problem raises ConfigError naming file and key."""
    if not isinstance(data, Mapping):
        raise ConfigError(file, f"[{section}]" if section else "", "expected a table", data)
    fields = {f.metadata.get("key", f.name): f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        allowed = ", ".join(sorted(fields))
        raise ConfigError(file, key_path(section, unknown[0]), f"unknown key (allowed: {allowed})")
    hints = typing.get_type_hints(cls)
    kwargs: Dict[str, Any] = {}
    for key, f in fields.items():
        path = key_path(section, key)
        if key not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
                raise ConfigError(file, path, "missing required key")
            continue
        check: Optional[Callable[[Any], Optional[str]]] = f.metadata.get("check")
        try:
            value = _convert(hints[f.name], data[key], file, path, section, key)
        except ConfigError:
            # Say the whole expectation ("an integer 1-65535"), not only the type.
            if getattr(check, "expected", None):
                raise ConfigError(file, path, check.expected, data[key]) from None  # type: ignore[union-attr]
            raise
        if check is not None and value is not None:
            expected = check(value)
            if expected:
                raise ConfigError(file, path, expected, data[key])
        kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except ValueError as exc:  # cross-field validation in __post_init__
        raise ConfigError(file, f"[{section}]" if section else "", str(exc)) from None


_SCALAR_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def _convert(tp: Any, value: Any, file: str, path: str, section: str, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin is typing.Union:
        options = [a for a in args if a is not type(None)]
        if value is None and len(options) < len(args):
            return None
        for option in options:
            if _matches(option, value):
                return _convert(option, value, file, path, section, key)
        names = " or ".join(_describe(o) for o in options)
        raise ConfigError(file, path, f"expected {names}", value)
    if origin is typing.Literal:
        if value not in args:
            choices = ", ".join(_show(a) for a in args)
            raise ConfigError(file, path, f"expected one of {choices}", value)
        return value
    if origin in (tuple, list) and args and dataclasses.is_dataclass(args[0]):
        if not isinstance(value, list):
            raise ConfigError(file, path, "expected an array of tables", value)
        sub = key if not section else f"{section}.{key}"
        return tuple(load_dataclass(args[0], item, file, f"{sub}[{i}]") for i, item in enumerate(value))
    if origin in (tuple, list):
        if not isinstance(value, list):
            raise ConfigError(file, path, f"expected an array of {_describe(args[0])}", value)
        return tuple(_convert(args[0], v, file, f"{path}[{i}]", section, key) for i, v in enumerate(value))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(file, path, "expected a table", value)
        return dict(value)
    if dataclasses.is_dataclass(tp):
        sub = key if not section else f"{section}.{key}"
        return load_dataclass(tp, value, file, sub)
    if not _matches(tp, value):
        raise ConfigError(file, path, f"expected {_describe(tp)}", value)
    return float(value) if tp is float else value


def _matches(tp: Any, value: Any) -> bool:
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if typing.get_origin(tp) is typing.Literal:
        return value in typing.get_args(tp)
    if dataclasses.is_dataclass(tp) or typing.get_origin(tp) is dict:
        return isinstance(value, dict)
    return True


def _describe(tp: Any) -> str:
    if tp in _SCALAR_NAMES:
        return _SCALAR_NAMES[tp]
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(_show(a) for a in typing.get_args(tp))
    return "a table"


# Reusable checks for field metadata -------------------------------------------------------------


def _check(expected: str, ok: Callable[[Any], bool]) -> Callable[[Any], Optional[str]]:
    def check(v: Any) -> Optional[str]:
        return None if ok(v) else expected

    check.expected = expected  # type: ignore[attr-defined]
    return check


def in_range(lo: float, hi: float, kind: str = "a number") -> Callable[[Any], Optional[str]]:
    return _check(f"expected {kind} {_fmt(lo)}-{_fmt(hi)}", lambda v: lo <= v <= hi)


def positive(kind: str = "a number") -> Callable[[Any], Optional[str]]:
    return _check(f"expected {kind} > 0", lambda v: v > 0)


def non_negative(kind: str = "a number") -> Callable[[Any], Optional[str]]:
    return _check(f"expected {kind} >= 0", lambda v: v >= 0)


def identifier(v: Any) -> Optional[str]:
    """Names that end up in MQTT topics: no wildcards, no separators, not empty."""
    ok = bool(v) and all(c.isalnum() or c in "-_." for c in v)
    return None if ok else "expected a name of letters, digits, '-', '_' or '.'"


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
