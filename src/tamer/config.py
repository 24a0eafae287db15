"""Config plumbing: YAML files and `--set key=value` overrides onto frozen dataclasses.

Each layer owns one frozen dataclass (`OptimConfig`, `RLConfig`, ...); a run's config nests
them. There is one way to load one, used by every command:

    config = load_config(RunConfig, ["configs/demo-calculator.yaml", "mine.yaml"], ["rl.steps=50"])

Layers, last wins: the dataclass defaults, then each YAML file in order, then each override.
- A section (a nested config dataclass) merges: `rl: {steps: 5}` keeps the other `rl` fields.
- A mapping-valued field (`reward.weights`) given whole replaces the mapping:
  `--set 'reward.weights={mine: 1.0}'` trains on `mine` only. A dotted key sets one entry:
  `--set reward.weights.format=0.2` keeps the other weights.
- Relative paths in fields marked `PATH` (dataset files) resolve against the YAML file that
  names them, not the current directory.
- `plugins` (modules or .py files) are imported before the values are checked, so the names
  they register (tasks, environments, rewards) are valid names.

Every value is checked before any work starts. A field's own check names only itself
(`raise FieldError("lr", "expected > 0")`); the loader adds the full dotted path:

    ConfigError: rl.optim.lr: expected > 0, got -1.0

Field documentation is the `# comment` on the field's line; `field_help` reads it (that is
what `tamer config show` prints next to each value).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")

# Field metadata: the value is a file path; relative paths in a YAML file resolve against it.
PATH = {"path": True}


class _Loader(yaml.SafeLoader):
    """YAML with YAML 1.2's booleans: only true/false are booleans, so `off`, `no`, `on` stay
    strings (`rl.algorithm.dynamic_sampling: off`); boolean fields accept those words too."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


class ConfigError(ValueError):
    """A config value is missing, unknown or of the wrong type; the message names the field's full path."""


class FieldError(ValueError):
    """Raised by a config dataclass's own checks; names only the field (the loader adds the path)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def check_name(field: str, value: str, valid: Iterable[str], kind: str) -> None:
    """FieldError unless `value` is one of `valid` (a registry's names or a tuple of choices)."""
    names = list(valid)
    if value not in names:
        raise FieldError(field, f"unknown {kind} {value!r}; valid: {', '.join(names)}")


# ---------------------------------------------------------------------------- plain data -> dataclass
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
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off", "1", "0"):
            return value.lower() in ("true", "yes", "on", "1")
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if hint in (int, float):
        return _number(value, hint, path)
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return str(value)
    return value


def _number(value: Any, hint: type, path: str) -> int | float:
    kind = "an integer" if hint is int else "a number"
    if isinstance(value, bool):
        raise ConfigError(f"{path}: expected {kind}, got {value!r}")
    try:
        number = float(value) if hint is float else int(str(value), 0) if isinstance(value, str) else value
    except (TypeError, ValueError):
        raise ConfigError(f"{path}: expected {kind}, got {value!r}") from None
    if hint is int and not isinstance(number, int):
        if isinstance(number, float) and number.is_integer():
            return int(number)
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    return number


def from_dict(cls: type[T], data: dict[str, Any] | None, path: str = "") -> T:
    """Build dataclass `cls` from plain data, checking names, types and each layer's own checks."""
    if data is None:
        data = {}
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    _check_known(data, fields, path)
    kwargs = {name: _convert(value, hints[name], _join(path, name)) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except FieldError as err:
        raise ConfigError(f"{_join(path, err.field)}: {err.message}") from None
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{path or 'config'}: {err}") from None


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _check_known(data: dict, fields: Iterable[str], path: str) -> None:
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{_join(path, unknown[0])}: unknown field; valid fields: {', '.join(sorted(fields))}")


def to_dict(config: Any) -> dict[str, Any]:
    """Plain data (for YAML/JSON) from a config dataclass."""
    return dataclasses.asdict(config)


# ---------------------------------------------------------------------------- layers
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_mapping(hint: Any) -> bool:
    return typing.get_origin(hint) is dict or hint is dict


def apply_mapping(cls: type, data: dict[str, Any], layer: dict[str, Any], *, path: str = "",
                  base_dir: Path | None = None) -> dict[str, Any]:
    """`layer` (one YAML file's content) laid over `data`: sections merge, every other value replaces."""
    if not isinstance(layer, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {layer!r}")
    hints, fields = _field_types(cls), {f.name: f for f in dataclasses.fields(cls)}
    _check_known(layer, fields, path)
    out = dict(data)
    for key, value in layer.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            out[key] = apply_mapping(hint, out.get(key) or {}, value, path=_join(path, key), base_dir=base_dir)
        else:
            out[key] = _resolve_path(fields[key], value, base_dir)
    return out


def _resolve_path(field: dataclasses.Field, value: Any, base_dir: Path | None) -> Any:
    meta = field.metadata
    if base_dir is None or not meta.get("path") or not isinstance(value, str) or not value:
        return value
    if value in meta.get("keywords", ()) or Path(value).is_absolute():
        return value
    return str(base_dir / value)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`"rl.optim.lr=1e-5"` -> (["rl", "optim", "lr"], 1e-5); the value is parsed as YAML."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value")
    key, raw = item.split("=", 1)
    keys = [k for k in key.strip().split(".")]
    if not all(keys):
        raise ConfigError(f"--set {item!r}: empty name in {key!r}")
    try:
        value = yaml_load(raw) if raw else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {key}: not a valid value: {err}") from None
    return keys, value


def apply_override(cls: type, data: dict[str, Any], keys: list[str], value: Any, path: str = "") -> dict[str, Any]:
    """Set one dotted key: sections are walked, a key inside a mapping field sets one entry."""
    name, rest = keys[0], keys[1:]
    hints = _field_types(cls)
    _check_known({name: None}, hints, path)
    out, hint = dict(data), hints[name]
    if not rest:
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            return apply_mapping(cls, out, {name: value}, path=path)
        out[name] = value
    elif dataclasses.is_dataclass(hint):
        out[name] = apply_override(hint, out.get(name) or {}, rest, value, _join(path, name))
    elif _is_mapping(hint):
        out[name] = _set_in(out.get(name) or {}, rest, value)
    else:
        raise ConfigError(f"{_join(path, name)}: not a section or a mapping, cannot set {'.'.join(rest)!r} in it")
    return out


def _set_in(mapping: dict, keys: list[str], value: Any) -> dict:
    out = dict(mapping)
    if len(keys) == 1:
        out[keys[0]] = value
    else:
        inner = out.get(keys[0])
        out[keys[0]] = _set_in(inner if isinstance(inner, dict) else {}, keys[1:], value)
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML file's top-level mapping; a missing or malformed file is a ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return data


def load_config(cls: type[T], files: Sequence[str | Path] | str | Path | None = (),
                overrides: Sequence[str] | None = (), *, plugins: Sequence[str] = ()) -> T:
    """A checked `cls`: its defaults, then each YAML file, then each `key=value` override.

    `plugins` (and a `plugins` field in the config, when `cls` has one) are imported before the
    values are checked.
    """
    if files is None or isinstance(files, (str, Path)):
        files = [] if files is None else [files]
    data = to_dict(cls())
    for file in files:
        data = apply_mapping(cls, data, read_yaml(file), base_dir=Path(file).resolve().parent)
    for item in overrides or ():
        data = apply_override(cls, data, *parse_override(item))
    if plugins:
        data["plugins"] = list(data.get("plugins") or ()) + [p for p in plugins if p not in (data.get("plugins") or ())]
    import_plugins(data.get("plugins") or ())
    return from_dict(cls, data)


# ---------------------------------------------------------------------------- plugins
def import_plugins(names: Iterable[str]) -> list[types.ModuleType]:
    """Import each module name (or .py file) so that what it registers can be named in a config."""
    modules = []
    for name in names:
        try:
            modules.append(_import_one(str(name)))
        except Exception as err:  # a plugin's own error, reported with its name, not a traceback
            raise ConfigError(f"plugins: cannot import {name!r}: {type(err).__name__}: {err}") from None
    return modules


def _import_one(name: str) -> types.ModuleType:
    if name.endswith(".py"):
        path = Path(name).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no such file {path}")
        module_name = f"tamer_plugin_{path.stem}"
        if module_name in sys.modules:
            return sys.modules[module_name]
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
        return module
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # as `python -m` does: the user's modules next to them
    return importlib.import_module(name)


# ---------------------------------------------------------------------------- documentation
def field_help(cls: type) -> dict[str, str]:
    """Each field's one-line help: the `# comment` written on the field's line(s) in the class body."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments.setdefault(tok.start[0], tok.string.lstrip("#").strip())
    body = ast.parse(textwrap.dedent(source)).body[0].body
    out = {}
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            lines = range(node.lineno, (node.end_lineno or node.lineno) + 1)
            text = " ".join(comments[i] for i in lines if i in comments)
            if text:
                out[node.target.id] = text
    return out


def describe(config: Any, indent: int = 0) -> list[str]:
    """`config` as YAML lines, each field followed by its help comment (valid YAML, loads back)."""
    helps = field_help(type(config))
    pad = "  " * indent
    lines = []
    for f in dataclasses.fields(config):
        value, note = getattr(config, f.name), helps.get(f.name, "")
        comment = f"  # {note}" if note else ""
        if dataclasses.is_dataclass(value):
            doc = (inspect.getdoc(type(value)) or "").splitlines()
            head = note or (doc[0] if doc else "")
            lines.append(f"{pad}{f.name}:" + (f"  # {head}" if head else ""))
            lines.extend(describe(value, indent + 1))
        else:
            plain = list(value) if isinstance(value, tuple) else value
            text = yaml.safe_dump(plain, default_flow_style=True, width=10_000).strip()
            text = text[:-4].rstrip() if text.endswith("\n...") else text.removesuffix("...").strip()
            lines.append(f"{pad}{f.name}: {text}{comment}")
    return lines
