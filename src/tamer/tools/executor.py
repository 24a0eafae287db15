"""Run one parsed tool call against a ToolSet, and turn whatever happens into text.

    result = execute(ToolCall("add", {"a": 1, "b": 2}), tools, timeout_s=5.0)
    result.ok, result.content          # True, "3"
    execute(ToolCall("serch", {}), tools, 5.0).content
    # "error: unknown tool 'serch' (available: add, multiply)"

`execute` never raises: every failure becomes a `ToolResult` with `ok=False`, an
`error_kind` and, as `content`, the error text the agent is shown, so the agent can
correct itself and reward functions can count mistakes by kind:

    malformed_call  the text in a <tool_call> block could not be read (see `malformed`)
    unknown_tool    no tool of that name
    bad_arguments   missing or unexpected argument names, or JSON types unlike the schema's
    tool_raised     the function raised; the agent sees `ExcType: message`, never a traceback
    timeout         the function ran past `timeout_s`

Timeouts: the function runs in a daemon worker thread that we stop waiting for after
`timeout_s`, and then stop: `tamer.tools.stopper` raises `ToolStopped` inside it, so a tool
stuck in a Python loop ends within milliseconds instead of spinning (and taking the GIL) for
the rest of the run. A call blocked inside a single C function cannot be stopped that way
until the function returns; for tools that may do that, run episodes with
`agent.tool_isolation=process` (tamer.rollout.isolation: a worker process that is killed and
replaced), and run untrusted code through `tamer.tools.sandbox`.
"""

from __future__ import annotations

import inspect
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

from tamer.tools.parsing import ToolCall
from tamer.tools.schema import Tool, ToolSet, json_type, matches_type
from tamer.tools.stopper import ToolStopped, stop_thread

ERROR_KINDS = ("malformed_call", "unknown_tool", "bad_arguments", "tool_raised", "timeout")


@dataclass
class ToolResult:
    name: str  # the tool called ("" for a malformed call)
    ok: bool
    content: str  # what the agent sees: the result as text, or "error: ..."
    error_kind: str | None = None  # one of ERROR_KINDS when not ok
    seconds: float = 0.0  # wall time spent in the function


def execute(call: ToolCall, tools: ToolSet, timeout_s: float, max_chars: int = 2000) -> ToolResult:
    """Check `call` against `tools`, run it with a timeout, and return its result as text."""
    if call.name not in tools:
        available = ", ".join(tools) or "none"
        message = f"unknown tool '{call.name}' (available: {available})"
        return _error(call.name, "unknown_tool", message, max_chars)
    tool = tools[call.name]
    problem = check_arguments(tool, call.arguments)
    if problem is not None:
        message = f"bad arguments for '{tool.name}': {problem}. Usage: {usage(tool)}"
        return _error(tool.name, "bad_arguments", message, max_chars)
    started = time.perf_counter()
    outcome, value = _run_with_timeout(tool, call.arguments, timeout_s)
    seconds = time.perf_counter() - started
    if outcome == "timeout":
        message = f"tool '{tool.name}' timed out after {timeout_s:g} s"
        return _error(tool.name, "timeout", message, max_chars, seconds)
    if outcome == "raised":
        return _error(tool.name, "tool_raised", describe(value), max_chars, seconds)
    return ToolResult(tool.name, True, truncate(to_text(value), max_chars), None, seconds)


def malformed(error: str, max_chars: int = 2000) -> ToolResult:
    """The result for a block the parser could not read (`error` is its "kind: message")."""
    return _error("", "malformed_call", f"malformed tool call ({error})", max_chars)


def _error(name: str, kind: str, message: str, max_chars: int, seconds: float = 0.0) -> ToolResult:
    return ToolResult(name, False, truncate(f"error: {message}", max_chars), kind, seconds)


def check_arguments(tool: Tool, arguments: dict[str, Any]) -> str | None:
    """What is wrong with `arguments` for `tool`, in words the agent can act on; None if fine."""
    try:
        params = inspect.signature(tool.function).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature; let the call decide
        return None
    named = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    problems = [f"missing required argument '{n}'" for n, p in named.items()
                if p.default is p.empty and n not in arguments]
    if not takes_kwargs:
        problems += [f"unexpected argument '{n}'" for n in arguments if n not in named]
    properties = tool.parameters.get("properties", {})
    for arg, value in arguments.items():
        if arg in properties:
            problem = _check_value(arg, value, properties[arg])
            if problem:
                problems.append(problem)
    return "; ".join(problems) or None


def _check_value(arg: str, value: Any, spec: dict) -> str | None:
    """Basic JSON-type (and enum) check of one argument against its schema entry."""
    if value is None and spec.get("nullable"):
        return None
    expected = spec.get("type")
    allowed = expected if isinstance(expected, list) else [expected] if expected else []
    if allowed and not any(matches_type(value, t) for t in allowed):
        return f"'{arg}' must be {' or '.join(allowed)}, got {json_type(value)}"
    if "enum" in spec and value not in spec["enum"]:
        return f"'{arg}' must be one of {json.dumps(spec['enum'])}"
    return None


def usage(tool: Tool) -> str:
    """A one-line signature from the schema, e.g. `add(a: integer, b: integer)`."""
    params = tool.parameters
    required = set(params.get("required", []))
    parts = []
    for arg, spec in params.get("properties", {}).items():
        kind = spec.get("type", "any")
        kind = "|".join(kind) if isinstance(kind, list) else kind
        parts.append(f"{arg}: {kind}" + ("" if arg in required else " (optional)"))
    return f"{tool.name}({', '.join(parts)})"


def _run_with_timeout(tool: Tool, arguments: dict[str, Any], timeout_s: float) -> tuple[str, Any]:
    """("returned", value), ("raised", exception) or ("timeout", None)."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = tool.function(**arguments)
        except ToolStopped:
            pass  # stopped after its timeout: nobody waits for this result any more
        except BaseException as exc:
            box["error"] = exc
        finally:
            done.set()

    worker = threading.Thread(target=target, name=f"tool-{tool.name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        stop_thread(worker, done)  # really stop it: a spinning thread would slow the trainer (GIL)
        return "timeout", None
    if "error" in box:
        return "raised", box["error"]
    return "returned", box.get("value")


def to_text(value: Any) -> str:
    """Strings as they are; anything else as compact JSON, or `str()` if not JSON-able."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError):
        return _safe_str(value)


def describe(exc: BaseException) -> str:
    """`ExcType: message`, the one line about a failure the agent is shown."""
    message = _safe_str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _safe_str(value: Any) -> str:
    # A tool's return value or exception is arbitrary code; even its __str__ may raise.
    try:
        return str(value)
    except Exception:
        return f"<unprintable {type(value).__name__}>"


def truncate(text: str, max_chars: int) -> str:
    """The first `max_chars` characters, with a marker saying how many were cut."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}...[truncated {len(text) - max_chars} chars]"
