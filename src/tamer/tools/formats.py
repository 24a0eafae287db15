"""Tool-call formats of model families: how a model writes its calls, how results go back.

    fmt = resolve_format("", tokenizer)          # "" detects the format from the chat template
    fmt = make_format("llama3_json", tokenizer)   # or by name (`agent.tool_format`)
    parsed = fmt.parse(assistant_text)            # ParseResult: calls, errors, final_text, items
    fmt.observation([(call, "42"), (None, "error: ...")])  # what the environment answers
    fmt.format_calls([ToolCall("add", {"a": 1})])           # the text a model of the family writes

Formats (names in `TOOL_FORMATS`):

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block per call
                 (Hermes, Qwen2.5, Qwen3). Results: one `<tool_response>` block per call.
    llama3_json  the turn is {"name": ..., "parameters": {...}}, optionally after <|python_tag|>;
                 several calls separated by ";" (Llama 3.1-3.3 JSON tool calling). Results:
                 one `ipython` message per call.
    mistral      [TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": "..."}] (tokenizer v3),
                 or [TOOL_CALLS]name[ARGS]{...} (v11). Results: one message per call with its
                 `tool_call_id` ([TOOL_RESULTS] {"content": ..., "call_id": ...}[/TOOL_RESULTS]).
    json         the turn is a bare JSON object {"name": ..., "arguments": {...}} or a list of
                 them. Results: one tool message per call. Never detected: set it by name.

A parser never raises: what it cannot read becomes an error entry ("kind: message") that the
environment answers, so the agent sees what went wrong (`tamer.tools.parsing`).

An observation is either one string (rendered as one tool message) or a list of message dicts
({"role": "tool", "content": ..., "tool_call_id"?}); the rollout renders either through the
tokenizer's chat template, so the tokens after an assistant turn are exactly the template's.
`hermes` answers with one string of `<tool_response>` blocks unless the chat template wraps
tool messages in `<tool_response>` itself (Qwen2.5), in which case it sends one message per call.

`detect_format(template)` recognises a family by its markers; a template without any (a base
model, tamer's tiny ChatML template mentions `<tool_call>`) falls back to `hermes`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any, ClassVar

from transformers import PreTrainedTokenizerBase

from tamer.registry import Registry
from tamer.tools.parsing import PARSERS, ParseResult, ToolCall, ToolCallParser, call_from_payload

TOOL_FORMATS: Registry = Registry("tool-call format")
DEFAULT_FORMAT = "hermes"

Observation = str | list[dict[str, str]]
Result = tuple[ToolCall | None, str]  # the call (None for an unreadable one) and its result text


class ToolFormat:
    """A family's tool-call convention: parse model text, render results, write calls."""

    name: ClassVar[str]
    text_before_calls: ClassVar[bool] = True  # may a turn say something before its calls?
    keep_tokens: ClassVar[tuple[str, ...]] = ()  # special tokens the parser must see in decoded text
    markers: ClassVar[tuple[str, ...]] = ()  # chat-template substrings that identify the family

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        self.tokenizer = tokenizer

    def parse(self, text: str) -> ParseResult:
        raise NotImplementedError

    def format_calls(self, calls: list[ToolCall]) -> str:
        """The assistant text that makes these calls, as the family's chat template writes it."""
        raise NotImplementedError

    def observation(self, results: list[Result]) -> Observation:
        """The environment's answer to one turn's calls: one tool message per call."""
        return [_tool_message(content) for _, content in results]

    def convert(self, text: str) -> str:
        """A turn written in the Hermes format (tamer's demonstrators), rewritten in this one.

        Text without calls, or with a block that does not parse, is returned unchanged; text
        around the calls is kept before them where the format allows it, else dropped.
        """
        parsed = HERMES_PARSER.parse(text)
        if not parsed.items or parsed.errors:
            return text
        prefix = parsed.final_text.strip() if self.text_before_calls else ""
        return (prefix + "\n" if prefix else "") + self.format_calls(parsed.calls)


def _tool_message(content: str, call_id: str | None = None) -> dict[str, str]:
    message = {"role": "tool", "content": content}
    if call_id is not None:
        message["tool_call_id"] = call_id
    return message


def _add(result: ParseResult, item: ToolCall | str) -> None:
    (result.calls if isinstance(item, ToolCall) else result.errors).append(item)
    result.items.append(item)


def _decode_json(text: str, pos: int) -> tuple[Any, int] | str:
    """One JSON value at `pos` -> (value, end), or an error string."""
    try:
        return json.JSONDecoder().raw_decode(text, pos)
    except json.JSONDecodeError as exc:
        return f"invalid_json: {exc.msg} (char {exc.pos - pos})"
    except RecursionError:  # `[[[[...` thousands deep: json recurses per level
        return "invalid_json: nested too deeply"


def _dumps(value: Any) -> str:
    """JSON as chat templates' `tojson` writes it (", " and ": " separators, unicode kept)."""
    return json.dumps(value, ensure_ascii=False)


HERMES_PARSER: ToolCallParser = PARSERS.get("hermes")()


@TOOL_FORMATS.register("hermes")
class HermesFormat(ToolFormat):
    """`<tool_call>` blocks of JSON; see `tamer.tools.parsing.HermesToolParser`."""

    name = "hermes"
    markers = ("<tool_call>",)

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        super().__init__(tokenizer)
        self.template_wraps = tokenizer is not None and _template_wraps_tool_responses(tokenizer)

    def parse(self, text: str) -> ParseResult:
        return HERMES_PARSER.parse(text)

    def format_calls(self, calls: list[ToolCall]) -> str:
        blocks = [f"<tool_call>\n{_dumps({'name': c.name, 'arguments': c.arguments})}\n</tool_call>" for c in calls]
        return "\n".join(blocks)

    def observation(self, results: list[Result]) -> Observation:
        if self.template_wraps:  # the template adds <tool_response> around each tool message
            return super().observation(results)
        return "\n".join(f"<tool_response>{content}</tool_response>" for _, content in results)

    def convert(self, text: str) -> str:
        return text  # demonstrations are written in this format already


def _template_wraps_tool_responses(tokenizer: PreTrainedTokenizerBase) -> bool:
    """True when the chat template renders a tool message inside <tool_response> tags itself."""
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    try:
        with_tool = tokenizer.apply_chat_template(base + [_tool_message("r")], tokenize=False)
        without = tokenizer.apply_chat_template(base, tokenize=False)
    except Exception:
        return False
    return with_tool.count("<tool_response>") > without.count("<tool_response>")


@TOOL_FORMATS.register("llama3_json")
class Llama3JsonFormat(ToolFormat):
    """Llama 3.1 JSON tool calling: the whole turn is `{"name": ..., "parameters": {...}}`.

    A leading `<|python_tag|>` is allowed (Llama 3.2 and later often emit it); several calls
    are separated by ";". A turn that does not start with "{" (after the tag) is a final
    answer. Text after the last call is ignored. Built-in tools (`brave_search.call(...)`)
    are not supported: they come back as `not_json` errors.
    """

    name = "llama3_json"
    text_before_calls = False
    keep_tokens = ("<|python_tag|>",)
    markers = ("<|python_tag|>", "<|start_header_id|>ipython")
    tag = "<|python_tag|>"
    argument_keys = ("parameters", "arguments")

    def parse(self, text: str) -> ParseResult:
        body = text.strip()
        tagged = body.startswith(self.tag)
        if tagged:
            body = body[len(self.tag):].lstrip()
        if not body.startswith("{"):
            result = ParseResult(final_text=text)
            if tagged:
                _add(result, f"not_json: {self.tag} must be followed by a JSON tool call")
            return result
        return _json_sequence(body, self.argument_keys, separator=";")

    def format_calls(self, calls: list[ToolCall]) -> str:
        return "; ".join(_dumps({"name": c.name, "parameters": c.arguments}) for c in calls)


def _json_sequence(body: str, argument_keys: tuple[str, ...], separator: str) -> ParseResult:
    """Calls as JSON objects (or lists of them) from the start of `body`, `separator`-separated."""
    result = ParseResult()
    pos = 0
    while pos < len(body) and body[pos] in "{[":
        decoded = _decode_json(body, pos)
        if isinstance(decoded, str):  # the rest cannot be read: one error for it
            _add(result, decoded)
            return result
        value, pos = decoded
        for payload in value if isinstance(value, list) else [value]:
            _add(result, call_from_payload(payload, argument_keys))
        if isinstance(value, list) and not value:
            _add(result, "empty: an empty list of calls")
        rest = body[pos:].lstrip()
        rest = rest[1:].lstrip() if rest.startswith(separator) else rest
        pos = len(body) - len(rest)
    result.final_text = body[pos:]
    return result


@TOOL_FORMATS.register("mistral")
class MistralFormat(ToolFormat):
    """Mistral's `[TOOL_CALLS]` control token, then the calls.

    Tokenizer v3 (Mistral 7B v0.3, Mixtral 8x22B, Nemo): a JSON list of
    {"name", "arguments", "id"}; v11 (Small 3.2, Devstral): `name[ARGS]{...}` per call, each
    after its own `[TOOL_CALLS]`. Text before the first `[TOOL_CALLS]` is the turn's content.
    Each result is sent with its call's id (`tool_call_id`), as Mistral requires.
    """

    name = "mistral"
    keep_tokens = ("[TOOL_CALLS]", "[ARGS]")
    markers = ("[TOOL_CALLS]",)
    tag = "[TOOL_CALLS]"

    def parse(self, text: str) -> ParseResult:
        start = text.find(self.tag)
        if start == -1:
            return ParseResult(final_text=text)
        result = ParseResult(final_text=text[:start])
        for segment in text[start + len(self.tag):].split(self.tag):
            body = segment.strip()
            if body.startswith(("[", "{")):  # v3: a JSON list of calls
                for item in _json_sequence(body, ("arguments",), separator=",").items:
                    _add(result, item)
            elif body:  # v11: name[ARGS]{...}
                _add(result, self._named_call(body))
            else:
                _add(result, f"empty: {self.tag} without a call")
        return result

    @staticmethod
    def _named_call(body: str) -> ToolCall | str:
        if "[ARGS]" in body:
            name, _, args = body.partition("[ARGS]")
        else:
            brace = body.find("{")
            if brace == -1:
                return "invalid_json: no arguments object after the tool name"
            name, args = body[:brace], body[brace:]
        decoded = _decode_json(args.strip(), 0)
        if isinstance(decoded, str):
            return decoded
        return call_from_payload({"name": name.strip(), "arguments": decoded[0]})

    def format_calls(self, calls: list[ToolCall]) -> str:
        items = [{"name": c.name, "arguments": c.arguments, "id": c.id or _call_id(c, i)} for i, c in enumerate(calls)]
        return f"{self.tag} {_dumps(items)}"

    def observation(self, results: list[Result]) -> Observation:
        return [_tool_message(content, call.id if call is not None else None) for call, content in results]


def _call_id(call: ToolCall, index: int) -> str:
    """A deterministic 9-character alphanumeric id (Mistral's length) for a call without one."""
    return hashlib.sha1(f"{index}:{call.name}:{_dumps(call.arguments)}".encode()).hexdigest()[:9]


@TOOL_FORMATS.register("json")
class PlainJsonFormat(ToolFormat):
    """The turn is a JSON object {"name": ..., "arguments": {...}} or a list of them.

    For models prompted to answer in JSON without a tool-call convention of their own. A turn
    that does not start with "{" or "[" is a final answer.
    """

    name = "json"
    text_before_calls = False

    def parse(self, text: str) -> ParseResult:
        body = text.strip()
        if not body.startswith(("{", "[")):
            return ParseResult(final_text=text)
        return _json_sequence(body, ("arguments", "parameters"), separator=";")

    def format_calls(self, calls: list[ToolCall]) -> str:
        items = [{"name": c.name, "arguments": c.arguments} for c in calls]
        return _dumps(items[0] if len(items) == 1 else items)


# ---------------------------------------------------------------------------- choosing one
def chat_template_text(tokenizer: PreTrainedTokenizerBase) -> str:
    """The tokenizer's chat template(s) as one string ("" if it has none)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(template.values()) if isinstance(template, dict) else template


def detect_format(template: str) -> str | None:
    """The format whose markers the chat template contains (most specific first), or None."""
    for name in ("mistral", "llama3_json", "hermes"):
        if any(marker in template for marker in TOOL_FORMATS.get(name).markers):
            return name
    return None


def make_format(name: str, tokenizer: PreTrainedTokenizerBase | None = None) -> ToolFormat:
    """The format `name` (a key of `TOOL_FORMATS`), set up for `tokenizer`'s chat template."""
    return TOOL_FORMATS.get(name)(tokenizer)


def resolve_format(name: str, tokenizer: PreTrainedTokenizerBase) -> ToolFormat:
    """`name`, or when empty the format detected from the chat template (else `hermes`)."""
    return make_format(name or detect_format(chat_template_text(tokenizer)) or DEFAULT_FORMAT, tokenizer)


def turn_decoder(tokenizer: PreTrainedTokenizerBase, fmt: ToolFormat) -> Callable[[list[int]], str]:
    """Decode a sampled turn without special tokens except the format's own markers.

    `[TOOL_CALLS]` and `<|python_tag|>` are special tokens in their families' tokenizers, so
    `skip_special_tokens=True` alone would erase the very marker the parser looks for.
    """
    vocab = tokenizer.get_vocab()
    keep = {vocab[t]: t for t in fmt.keep_tokens if t in vocab}

    def decode(ids: list[int]) -> str:
        parts, start = [], 0
        for i, token in enumerate(ids):
            if token in keep:
                parts += [tokenizer.decode(ids[start:i], skip_special_tokens=True), keep[token]]
                start = i + 1
        parts.append(tokenizer.decode(ids[start:], skip_special_tokens=True))
        return "".join(parts)
    return decode
