"""Config plumbing: YAML files and `--set key=value` overrides onto frozen dataclasses.

Each layer owns one frozen dataclass (`TinyModelConfig`, `RLConfig`, ...). A run's
config nests them; this module turns plain data into those dataclasses and checks
every value before any work starts. Errors name the field by its dotted path:

    ConfigError: rl.lr: expected a number, got 'fast'
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value is missing, unknown or of the wrong type; the message names the field."""


def _convert(value: Any, hint: Any, path: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(value, arg, path)
            except ConfigError:
                continue
        raise ConfigError(f"{path}: {value!r} does not fit {hint}")
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, path)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        kt, vt = args or (Any, Any)
        return {_convert(k, kt, f"{path}.{k}"): _convert(v, vt, f"{path}.{k}") for k, v in value.items()}
    if origin in (tuple, list):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        item = args[0] if args else Any
        return origin(_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value))
    return _scalar(value, hint, path)


def _scalar(value: Any, hint: Any, path: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if hint in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        try:
            number = float(value) if hint is float else int(str(value), 0) if isinstance(value, str) else value
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: expected {'an integer' if hint is int else 'a number'}, got {value!r}") from None
        if hint is int and (not isinstance(number, int) or isinstance(number, bool)):
            if isinstance(number, float) and number.is_integer():
                return int(number)
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return number
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return str(value)
    return value


def from_dict(cls: type[T], data: dict[str, Any] | None, path: str = "") -> T:
    """Build dataclass `cls` from `data`, checking names and types; errors name the field."""
    if data is None:
        data = {}
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(f"{where}{unknown[0]}: unknown field; valid fields: {', '.join(sorted(fields))}")
    kwargs = {name: _convert(value, hints[name], f"{path}.{name}" if path else name) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        message = str(err)
        # __post_init__ messages name their field from the layer's root; add the prefix.
        if path and not message.startswith(path.split(".")[0]):
            message = f"{path}.{message}"
        raise ConfigError(message) from None


def to_dict(config: Any) -> dict[str, Any]:
    """Plain data (for YAML/JSON) from a config dataclass."""
    return dataclasses.asdict(config)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["rl.lr=1e-5", "task.name=arithmetic"]` -> nested dict, values parsed as YAML."""
    nested: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw else ""
        node = nested
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {part} is not a section")
        node[parts[-1]] = value
    return nested


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; `override` wins."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None,
                preset: list[str] | None = None) -> T:
    """A `cls` config: defaults < `preset` (key=value) < YAML file < `overrides` (key=value)."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
    data = merge(merge(parse_overrides(preset or []), data), parse_overrides(overrides or []))
    return from_dict(cls, with_defaults(cls(), data))


def with_defaults(default: Any, data: dict[str, Any]) -> dict[str, Any]:
    """`data` laid over the fields of the config instance `default`, section by section.

    Setting one field of a section keeps the root's defaults for its other fields
    (RunConfig's `rl.optim.lr`, not RLConfig's class default). Only config sections merge:
    a mapping-valued field (`reward.weights`) is replaced as a whole.
    """
    out: dict[str, Any] = {f.name: getattr(default, f.name) for f in dataclasses.fields(default)}
    for key, value in data.items():
        current = out.get(key)
        if dataclasses.is_dataclass(current) and isinstance(value, dict):
            out[key] = with_defaults(current, value)
        else:
            out[key] = value
    return out
