"""Find the tool calls in an assistant turn. Parsers are pluggable and never raise.

    parser = PARSERS.get("hermes")()
    result = parser.parse('Let me see. <tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>')
    result.calls        # [ToolCall(name="add", arguments={"a": 1, "b": 2})]
    result.errors       # []   e.g. ["invalid_json: Expecting value (char 0)"]
    result.final_text   # "Let me see. "   (the text outside tool-call blocks)
    result.items        # calls and errors, in the order they appear in the text

A policy's text is untrusted and often broken mid-training, so a parser reports what it
could not read as an error entry ("kind: message") instead of raising; the environment
answers each one, so the agent learns what went wrong.

To support another format, write a class with `parse(text) -> ParseResult` and register
it in `PARSERS`; `call_from_payload` turns one decoded JSON call into a `ToolCall` or an
error entry. The tool-call formats of other model families (Llama 3.1 JSON, Mistral, plain
JSON), with how each renders tool results back, live in `tamer.tools.formats`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tamer.registry import Registry
from tamer.tools.schema import json_type


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str | None = None  # the call's id when the format carries one (Mistral), echoed with its result


@dataclass
class ParseResult:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # "kind: message", one per unreadable call
    final_text: str = ""  # the text outside tool-call blocks
    items: list[ToolCall | str] = field(default_factory=list)  # calls and errors in text order

    @property
    def has_calls(self) -> bool:
        """True when the turn tried to call a tool, successfully or not."""
        return bool(self.items)


@runtime_checkable
class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParseResult: ...


PARSERS: Registry = Registry("tool-call parser")


@PARSERS.register("hermes")
class HermesToolParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Hermes and Qwen models emit.

    Several blocks per turn are allowed. `arguments` may be a JSON object or a JSON-encoded
    string of one (some models double-encode); a missing `arguments` means no arguments.
    Error kinds: invalid_json, not_object, missing_name, bad_arguments, unterminated_tag.
    """

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def parse(self, text: str) -> ParseResult:
        result = ParseResult()
        outside: list[str] = []
        pos = 0
        while (start := text.find(self.open_tag, pos)) != -1:
            outside.append(text[pos:start])
            body_start = start + len(self.open_tag)
            end = text.find(self.close_tag, body_start)
            reopen = text.find(self.open_tag, body_start)
            if end == -1 or (reopen != -1 and reopen < end):
                # An unclosed block (often a generation cut off by the token budget) runs
                # to the next opening tag or to the end; later blocks are still read.
                stop = len(text) if reopen == -1 else reopen
                self._add(result, f"unterminated_tag: {self.open_tag} without {self.close_tag}")
                pos = stop
                continue
            self._add(result, self.parse_block(text[body_start:end]))
            pos = end + len(self.close_tag)
        outside.append(text[pos:])
        result.final_text = "".join(outside)
        return result

    @staticmethod
    def _add(result: ParseResult, item: ToolCall | str) -> None:
        (result.calls if isinstance(item, ToolCall) else result.errors).append(item)
        result.items.append(item)

    @staticmethod
    def parse_block(body: str) -> ToolCall | str:
        """One block's JSON -> a ToolCall, or an error string "kind: message"."""
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as exc:
            return f"invalid_json: {exc.msg} (char {exc.pos})"
        except RecursionError:  # `[[[[...` thousands deep: json recurses per level
            return "invalid_json: nested too deeply"
        return call_from_payload(payload)


def call_from_payload(payload: Any, argument_keys: tuple[str, ...] = ("arguments",)) -> ToolCall | str:
    """One decoded JSON call -> a ToolCall, or an error string "kind: message".

    The arguments are read from the first of `argument_keys` present (Llama 3.1 names them
    "parameters"); a string of JSON is decoded once more, a missing value means none.
    """
    if not isinstance(payload, dict):
        return f"not_object: expected a JSON object, got {json_type(payload)}"
    name = payload.get("name")
    if not isinstance(name, str) or not name.strip():
        return "missing_name: the call has no \"name\" string"
    key = next((k for k in argument_keys if k in payload), argument_keys[0])
    arguments = payload.get(key, {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return f"bad_arguments: \"{key}\" is a string but not valid JSON ({exc.msg})"
        except RecursionError:
            return f"bad_arguments: \"{key}\" is nested too deeply"
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return f"bad_arguments: \"{key}\" must be a JSON object, got {json_type(arguments)}"
    call_id = payload.get("id")
    return ToolCall(name=name.strip(), arguments=arguments, id=call_id if isinstance(call_id, str) else None)
