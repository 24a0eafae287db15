"""Tools: a Python function plus the JSON schema a chat template shows the model.

The schema is built by `transformers.utils.get_json_schema` from the function's type hints
and Google-style docstring, so a tool is written once, as an ordinary typed function:

    def add(a: int, b: int) -> int:
        '''Add two integers.

        Args:
            a: The first addend.
            b: The second addend.
        '''
        return a + b

    tools = ToolSet([Tool.from_function(add)])        # or decorate `add` with @tool
    tools["add"].function(a=1, b=2)                   # 3
    tokenizer.apply_chat_template(messages, tools=tools.schemas())

Schemas follow the Hugging Face chat-template format:
`{"type": "function", "function": {"name", "description", "parameters": {...}}}`.
Bound methods work too (`self` is left out), which lets an environment expose tools that
read its per-task state.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from transformers.utils import get_json_schema

# JSON schema type name -> the Python types `json.loads` produces for it. bool is excluded
# from the numeric types explicitly by `json_type`, since it subclasses int.
JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,), "null": (type(None),),
}


def json_type(value: Any) -> str:
    """The JSON type name of a decoded JSON value ("integer" for 3, "number" for 3.5)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    for name, types in JSON_TYPES.items():
        if isinstance(value, types):
            return name
    return type(value).__name__


def matches_type(value: Any, expected: str) -> bool:
    """True when `value` is of JSON type `expected`; unknown type names accept anything."""
    if expected not in JSON_TYPES:
        return True
    if isinstance(value, bool):
        return expected == "boolean"
    return isinstance(value, JSON_TYPES[expected])


class ToolSchemaError(ValueError):
    """A function could not be turned into a tool (missing type hint or docstring entry)."""


@dataclass(frozen=True)
class Tool:
    """A callable the agent may invoke by `name`, with the schema the model is shown."""

    name: str
    function: Callable[..., Any]
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ToolSchemaError(f"Tool.name: expected a non-empty string, got {self.name!r}")
        if not callable(self.function):
            raise ToolSchemaError(f"Tool.function: {self.name!r} is not callable")
        declared = self.schema.get("function", {}).get("name")
        if declared != self.name:
            raise ToolSchemaError(f"Tool.schema: names {declared!r}, but the tool is {self.name!r}")

    @classmethod
    def from_function(cls, fn: Callable[..., Any], name: str | None = None) -> Tool:
        """Build a tool from a typed function with a Google-style docstring."""
        schema = copy.deepcopy(_function_schema(fn))
        if name is not None:
            schema["function"]["name"] = name
        return cls(name=schema["function"]["name"], function=fn, schema=schema)

    @property
    def parameters(self) -> dict:
        """The JSON schema of the arguments: {"type": "object", "properties", "required"}."""
        return self.schema["function"].get("parameters", {"type": "object", "properties": {}})


def _function_schema(fn: Callable[..., Any]) -> dict:
    """The schema of `fn`, parsed once per underlying function (bound methods share it).

    Environments build their tools per episode from bound methods; parsing the docstring
    every time cost more than running the episode's tools.
    """
    key = getattr(fn, "__func__", fn)
    try:
        cached = _SCHEMA_CACHE.get(key)
    except TypeError:  # an unhashable callable: no caching
        key, cached = None, None
    if cached is not None:
        return cached
    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # transformers raises plain Exception subclasses
        raise ToolSchemaError(
            f"cannot make a tool of {getattr(fn, '__name__', repr(fn))!r}: {exc}. A tool needs a type hint on "
            "every argument and a Google-style docstring with a description and an 'Args:' entry per argument"
        ) from exc
    # Most chat templates ignore the return type; leaving it out keeps prompts short,
    # which matters for the character-level tiny models.
    schema = {**schema, "function": {k: v for k, v in schema["function"].items() if k != "return"}}
    if key is not None:
        _SCHEMA_CACHE[key] = schema
    return schema


# Parsed schemas by function object; weak keys, so a cached function can still be collected.
_SCHEMA_CACHE: weakref.WeakKeyDictionary[Callable[..., Any], dict] = weakref.WeakKeyDictionary()


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """Decorator: `@tool` or `@tool(name="search")` turns a function into a `Tool`."""
    if fn is None:
        return lambda f: Tool.from_function(f, name=name)
    return Tool.from_function(fn, name=name)


class ToolSet(Mapping[str, Tool]):
    """An ordered name -> Tool mapping; the order is the order the model sees the schemas in."""

    def __init__(self, tools: Iterable[Tool | Callable[..., Any]] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for item in tools:
            self.add(item)

    def add(self, item: Tool | Callable[..., Any]) -> Tool:
        """Add a Tool, or a plain function (converted with `Tool.from_function`)."""
        new = item if isinstance(item, Tool) else Tool.from_function(item)
        if new.name in self._tools:
            raise ToolSchemaError(f"ToolSet: tool {new.name!r} is already present")
        self._tools[new.name] = new
        return new

    def schemas(self) -> list[dict]:
        """The schema list to pass as `tools=` to `apply_chat_template`."""
        return [t.schema for t in self._tools.values()]

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tools)

    def __len__(self) -> int:
        return len(self._tools)

    def __repr__(self) -> str:
        return f"ToolSet({', '.join(self._tools)})"
