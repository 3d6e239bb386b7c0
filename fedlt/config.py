"""TOML configuration read into frozen dataclasses, validated at load with every problem reported at once.

A config section is a dataclass whose fields carry their limits (`setting(...)`); `parse_section` checks
unknown keys (with a did-you-mean), types (a bool is not an int here) and limits, and collects problems
instead of stopping at the first, so a user fixes a file in one pass.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import tomllib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from fedlt.errors import ConfigError

T = TypeVar("T")


def setting(
    default: Any,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    choices: Sequence[str] | Callable[[], Sequence[str]] | None = None,
    doc: str = "",
) -> Any:
    """A dataclass field with the limits `parse_section` enforces; `choices` may be a function, asked at
    each check (the privacy layers installed: `fedlt.aggregation.layer_names`)."""
    limits = {
        "ge": ge,
        "gt": gt,
        "le": le,
        "choices": choices if callable(choices) else tuple(choices or ()) or None,
        "doc": doc,
    }
    return dataclasses.field(default=default, metadata=limits)


def resolve(base_dir: Path, value: str) -> Path:
    """Relative paths in a config file are relative to the file, so a folder of configs can move."""
    p = Path(value)
    return p if p.is_absolute() else base_dir / p


def read_toml(path: str | Path) -> dict[str, Any]:
    """The parsed file, or a ConfigError naming the file and the syntax problem."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(path, ["no such file"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, [f"not valid TOML: {exc}"]) from None


def parse_section(cls: type[T], table: Mapping[str, Any], where: str, problems: list[str]) -> T:
    """Build `cls` from `table`, appending every problem to `problems` (and keeping defaults where wrong)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for key in table:
        if key not in fields:
            problems.append(f"{_at(where, key)}: unknown setting{_did_you_mean(key, fields)}")
    values: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in table:
            continue
        value = _check_value(hints[name], table[name], _at(where, name), f.metadata, problems)
        if value is not _INVALID:
            values[name] = value
    return cls(**values)


def as_table(obj: Any) -> dict[str, Any]:
    """A dataclass tree as plain dicts; a section with `to_table` decides its own form."""
    if hasattr(obj, "to_table"):
        return obj.to_table()
    return {
        f.name: as_table(v) if dataclasses.is_dataclass(v := getattr(obj, f.name)) else v
        for f in dataclasses.fields(obj)
    }


def as_toml(obj: Any) -> str:
    """A dataclass tree written back as TOML, so a run folder records exactly what ran."""
    return render_toml(as_table(obj))


def render_toml(tree: Mapping[str, Any]) -> str:
    scalars, tables = _split(tree)
    lines = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in scalars.items()]
    lines += _tables(tables, prefix="")
    return "\n".join(lines).lstrip("\n") + "\n"


_INVALID = object()
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _check_value(hint: Any, value: Any, where: str, limits: Mapping[str, Any], problems: list[str]):
    expected, optional = _unwrap_optional(hint)
    if hasattr(expected, "from_table"):
        if not isinstance(value, Mapping):
            problems.append(f"{where}: expected a table, got {_kind(value)}")
            return _INVALID
        return expected.from_table(value, where, problems)
    if typing.get_origin(expected) is tuple:
        return _check_tuple(expected, value, where, problems)
    if dataclasses.is_dataclass(expected):
        if not isinstance(value, Mapping):
            problems.append(f"{where}: expected a table, got {_kind(value)}")
            return _INVALID
        return parse_section(expected, value, where, problems)
    if optional and value is None:
        return None
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if (expected is int and isinstance(value, bool)) or not isinstance(value, expected):
        problems.append(f"{where}: expected {expected.__name__}, got {_kind(value)} {value!r}")
        return _INVALID
    message = _limit_problem(value, limits)
    if message:
        problems.append(f"{where}: {message}")
        return _INVALID
    return value


def _check_tuple(expected: Any, value: Any, where: str, problems: list[str]):
    """`tuple[T, ...]` settings are TOML arrays whose items are all T (a bool is not an int here either)."""
    item = typing.get_args(expected)[0]
    if item is float and isinstance(value, list):  # as for a float setting, an integer is a float here
        value = [float(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in value]
    if not isinstance(value, list) or not all(
        isinstance(v, item) and not (item is int and isinstance(v, bool)) for v in value
    ):
        problems.append(f"{where}: expected a list of {item.__name__}, got {value!r}")
        return _INVALID
    return tuple(value)


def _limit_problem(value: Any, limits: Mapping[str, Any]) -> str | None:
    choices = limits.get("choices")
    choices = choices() if callable(choices) else choices
    if choices and value not in choices:
        return f"must be one of {', '.join(map(repr, choices))}, got {value!r}"
    if limits.get("ge") is not None and value < limits["ge"]:
        return f"must be >= {limits['ge']}, got {value!r}"
    if limits.get("gt") is not None and value <= limits["gt"]:
        return f"must be > {limits['gt']}, got {value!r}"
    if limits.get("le") is not None and value > limits["le"]:
        return f"must be <= {limits['le']}, got {value!r}"
    return None


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


def _at(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _did_you_mean(key: str, known: Sequence[str] | Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(known))})"


def _kind(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}.get(
        type(value), type(value).__name__
    )


def _split(d: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    scalars = {k: v for k, v in d.items() if not isinstance(v, Mapping) and v is not None}
    tables = {k: v for k, v in d.items() if isinstance(v, Mapping)}
    return scalars, tables


def _tables(tables: Mapping[str, Any], prefix: str) -> list[str]:
    lines: list[str] = []
    for name, table in tables.items():
        scalars, sub = _split(table)
        header = f"{prefix}{_toml_key(name)}"
        if scalars or not sub:  # a table holding only tables needs no header of its own
            lines += ["", f"[{header}]"] + [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in scalars.items()]
        lines += _tables(sub, prefix=f"{header}.")
    return lines


def _toml_key(key: str) -> str:
    """A bare key where TOML allows one, else a quoted one (a table column named `amount (EUR)`)."""
    return key if _BARE_KEY.fullmatch(key) else _toml_value(key)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):  # JSON's escapes are TOML's, but for DEL, which TOML wants escaped too
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, Mapping):  # a table inside an array: inline
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return repr(v)
