"""Raw dicts to typed dataclasses: every key checked against the schema, values coerced to
the field's type; an unknown key or a bad value is a `ConfigError` naming the key path and the
closest valid key."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Union

from gptforge.config.schema import Config
from gptforge.errors import ConfigError

# ------------------------------------------------------------------------ typed build


def suggest_key(name: str, options: typing.Iterable[str], prefix: str) -> str:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f" (did you mean {prefix}{match[0]}?)" if match else ""


def _is_optional(tp: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return True, args[0]
    return False, tp


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    optional, inner = _is_optional(tp)
    if value is None:
        if optional:
            return None
        raise _Blank()
    tp = inner
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a section (mapping), got {value!r}")
        return build_section(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{path}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                as_float = float(value)
            except ValueError:
                as_float = None
            if as_float is not None and as_float.is_integer():
                return int(as_float)
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return str(value)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):  # '949,50,1' style
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            if item_tp in (int, str, float) and not isinstance(value, dict):
                value = [value]
            else:
                raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return {str(k): _coerce(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    raise ConfigError(f"{path}: unsupported type {_type_name(tp)}")  # pragma: no cover


class _Blank(Exception):
    """A blank value for a non-optional key: the default applies (reference semantics)."""


def build_section(cls: type, data: dict, path: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in hints:
            sub = f"{path}." if path else ""
            what = "section" if not path else "key"
            raise ConfigError(f"{sub}{key}: unknown {what}{suggest_key(str(key), names, sub)}")
        try:
            kwargs[key] = _coerce(value, hints[key], f"{path}.{key}" if path else key)
        except _Blank:
            continue
    return cls(**kwargs)


def build_config(raw: dict[str, Any]) -> Config:
    """Typed `Config` from a canonical raw dict (no derivation)."""
    raw = dict(raw)
    raw.pop("_base_", None)
    return build_section(Config, raw, "")
