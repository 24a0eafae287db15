"""Tools: schema generation, tool-call parsing, execution with every error path, ToolEnvironment."""

from __future__ import annotations

import json
import time

import pytest

from tamer.tasks.base import Task
from tamer.tasks.tool_env import ToolEnvConfig, ToolEnvironment
from tamer.tools.executor import ERROR_KINDS, execute, malformed, to_text, truncate
from tamer.tools.parsing import PARSERS, HermesToolParser, ToolCall
from tamer.tools.schema import Tool, ToolSchemaError, ToolSet, tool


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


def multiply(x: float, y: float = 1.0) -> float:
    """Multiply two numbers.

    Args:
        x: A factor.
        y: Another factor.
    """
    return x * y


def fail(message: str) -> str:
    """Always raise.

    Args:
        message: What to raise with.
    """
    raise RuntimeError(message)


def slow(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "done"


def lookup(city: str, units: list[str] | None = None) -> dict:
    """Weather for a city.

    Args:
        city: The city name.
        units: Units to report in.
    """
    return {"city": city, "temp": 21, "units": units}


TOOLS = ToolSet([add, multiply, fail, slow, lookup])


# -- schema -------------------------------------------------------------------------------

def test_schema_types_required_and_descriptions():
    schema = Tool.from_function(add).schema
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "add" and fn["description"] == "Add two integers."
    assert fn["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first addend."}
    assert fn["parameters"]["required"] == ["a", "b"]
    assert "return" not in fn
    params = Tool.from_function(multiply).parameters
    assert params["properties"]["x"]["type"] == "number" and params["required"] == ["x"]
    units = Tool.from_function(lookup).parameters["properties"]["units"]
    assert units["type"] == "array" and units["items"] == {"type": "string"} and units["nullable"]


def test_name_override_decorator_and_toolset_order():
    renamed = Tool.from_function(add, name="plus")
    assert renamed.name == "plus" and renamed.schema["function"]["name"] == "plus"
    decorated = tool(name="times")(multiply)
    assert isinstance(decorated, Tool) and decorated.name == "times"
    assert [s["function"]["name"] for s in TOOLS.schemas()] == ["add", "multiply", "fail", "slow", "lookup"]
    with pytest.raises(ToolSchemaError, match="already present"):
        ToolSet([add, add])


def test_schema_errors_name_the_function():
    def no_hints(a):
        """Nothing.

        Args:
            a: a thing.
        """

    def no_docstring(a: int):
        pass

    for fn in (no_hints, no_docstring):
        with pytest.raises(ToolSchemaError, match=fn.__name__):
            Tool.from_function(fn)


# -- parsing ------------------------------------------------------------------------------

PARSER = PARSERS.get("hermes")()


def test_parse_one_call_and_final_text():
    result = PARSER.parse('Let me add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> ok')
    assert result.calls == [ToolCall("add", {"a": 1, "b": 2})]
    assert result.errors == [] and result.final_text == "Let me add.  ok"


def test_parse_several_calls_and_string_arguments():
    text = ('<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>\n'
            '<tool_call>\n{"name": "multiply", "arguments": "{\\"x\\": 2.5}"}\n</tool_call>'
            '<tool_call>{"name":"lookup"}</tool_call>')
    result = PARSER.parse(text)
    assert result.calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("multiply", {"x": 2.5}),
                            ToolCall("lookup", {})]
    assert result.errors == [] and result.final_text == "\n"


def test_no_call_is_plain_text():
    result = PARSER.parse("<answer>42</answer>")
    assert not result.has_calls and result.final_text == "<answer>42</answer>"


@pytest.mark.parametrize("body, kind", [
    ('{"name": "add", "arguments": {"a": 1}', "invalid_json"),
    ("[1, 2]", "not_object"),
    ('{"arguments": {}}', "missing_name"),
    ('{"name": "", "arguments": {}}', "missing_name"),
    ('{"name": "add", "arguments": [1, 2]}', "bad_arguments"),
    ('{"name": "add", "arguments": "{oops"}', "bad_arguments"),
    ('{"name": "add", "arguments": "[1]"}', "bad_arguments"),
    ("[" * 100_000, "invalid_json"),
])
def test_malformed_blocks_are_errors_not_exceptions(body, kind):
    result = PARSER.parse(f"<tool_call>{body}</tool_call>")
    assert result.calls == [] and len(result.errors) == 1
    assert result.errors[0].startswith(f"{kind}: ")


def test_unterminated_tags_keep_later_calls_in_order():
    text = '<tool_call>{"name":"add"<tool_call>{"name":"add","arguments":{"a":1,"b":1}}</tool_call><tool_call>{"na'
    result = PARSER.parse(text)
    assert [type(i).__name__ for i in result.items] == ["str", "ToolCall", "str"]
    assert all(e.startswith("unterminated_tag") for e in result.errors)
    assert isinstance(HermesToolParser(), type(PARSER))


# -- executor -----------------------------------------------------------------------------

def test_execute_ok_converts_results_to_text():
    result = execute(ToolCall("add", {"a": 2, "b": 3}), TOOLS, 1.0)
    assert (result.name, result.ok, result.content, result.error_kind) == ("add", True, "5", None)
    assert 0 <= result.seconds < 0.5
    result = execute(ToolCall("lookup", {"city": "Oslo", "units": ["C"]}), TOOLS, 1.0)
    assert result.content == '{"city":"Oslo","temp":21,"units":["C"]}'
    assert to_text("plain") == "plain" and to_text(None) == "null" and to_text(object()).startswith("<object")


def test_unknown_tool():
    result = execute(ToolCall("serch", {}), ToolSet([add, multiply]), 1.0)
    assert not result.ok and result.error_kind == "unknown_tool"
    assert result.content == "error: unknown tool 'serch' (available: add, multiply)"


@pytest.mark.parametrize("arguments, needle", [
    ({"a": 1}, "missing required argument 'b'"),
    ({"a": 1, "b": 2, "c": 3}, "unexpected argument 'c'"),
    ({"a": "1", "b": 2}, "'a' must be integer, got string"),
    ({"a": True, "b": 2}, "'a' must be integer, got boolean"),
    ({"a": 1.5, "b": 2}, "'a' must be integer, got number"),
])
def test_bad_arguments(arguments, needle):
    result = execute(ToolCall("add", arguments), TOOLS, 1.0)
    assert not result.ok and result.error_kind == "bad_arguments"
    assert needle in result.content and "Usage: add(a: integer, b: integer)" in result.content


def test_bad_arguments_accepts_ints_for_numbers_and_null_for_nullable():
    assert execute(ToolCall("multiply", {"x": 2}), TOOLS, 1.0).content == "2.0"
    assert execute(ToolCall("lookup", {"city": "Rome", "units": None}), TOOLS, 1.0).ok


def test_raising_tool_shows_type_and_message_only():
    result = execute(ToolCall("fail", {"message": "boom"}), TOOLS, 1.0)
    assert (result.ok, result.error_kind, result.content) == (False, "tool_raised", "error: RuntimeError: boom")


def test_timeout():
    started = time.perf_counter()
    result = execute(ToolCall("slow", {"seconds": 2.0}), TOOLS, timeout_s=0.2)
    assert time.perf_counter() - started < 1.0
    assert result.error_kind == "timeout" and "timed out after 0.2 s" in result.content
    assert result.seconds >= 0.2


def test_malformed_and_truncation():
    result = malformed("invalid_json: Expecting value (char 0)")
    assert result.error_kind == "malformed_call" and result.content.startswith("error: malformed tool call")
    assert set(ERROR_KINDS) == {"malformed_call", "unknown_tool", "bad_arguments", "tool_raised", "timeout"}
    assert truncate("x" * 10, 4) == "xxxx...[truncated 6 chars]"
    long = execute(ToolCall("fail", {"message": "y" * 5000}), TOOLS, 1.0, max_chars=100)
    assert long.content.endswith("...[truncated 4921 chars]")  # 21 chars of "error: RuntimeError: " + 5000 - 100


# -- ToolEnvironment ----------------------------------------------------------------------

class AddEnv(ToolEnvironment):
    def build_tools(self) -> ToolSet:
        return ToolSet([add, self.secret])

    def on_reset(self, task: Task) -> None:
        self.value = int(task.meta["secret"])

    def secret(self) -> int:
        """The task's secret number."""
        return self.value


TASK = Task(id="t", messages=({"role": "user", "content": "secret+1?"},), answer="8", meta={"secret": 7}, env="add")


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_environment_runs_calls_and_counts():
    env = AddEnv()
    assert env.reset(TASK) == ""
    assert [s["function"]["name"] for s in env.tools] == ["add", "secret"]
    first = env.step("thinking " + call("secret") + call("nope") + "<tool_call>{bad}</tool_call>")
    assert not first.done
    assert first.observation == ("<tool_response>7</tool_response>\n"
                                 "<tool_response>error: unknown tool 'nope' (available: add, secret)</tool_response>\n"
                                 "<tool_response>error: malformed tool call (invalid_json: Expecting property name "
                                 "enclosed in double quotes (char 1))</tool_response>")
    assert first.info["tool_calls"] == 3
    assert first.info["tool_errors"] == {"unknown_tool": 1, "malformed_call": 1}
    assert [c["name"] for c in first.info["turn_calls"]] == ["secret", "nope", ""]
    assert first.info["turn_calls"][0]["ok"] and first.info["turn_calls"][1]["error_kind"] == "unknown_tool"
    second = env.step(call("add", a=7, b=1))
    assert second.observation == "<tool_response>8</tool_response>" and second.info["tool_calls"] == 4
    final = env.step("<answer>8</answer>")
    assert final.done and final.observation is None
    assert final.info["success"] is True and final.info["cost"] == 4.0 and final.info["turn_calls"] == []
    assert env.reset(TASK) == "" and env.tool_calls == 0 and env.tool_errors == {}


def test_environment_limits_calls_per_turn_and_never_raises():
    env = AddEnv(ToolEnvConfig(max_tool_calls_per_turn=2))
    env.reset(TASK)
    result = env.step(call("secret") * 5)
    assert result.observation.count("<tool_response>") == 3
    assert "2 more" not in result.observation and "3 more were not run" in result.observation
    assert result.info["tool_calls"] == 2 and result.info["tool_calls_skipped"] == 3
    for junk in ["", "<tool_call>", "</tool_call>", "<tool_call></tool_call>", "\x00" * 10, "<tool_call>{}"]:
        env.step(junk)
    assert env.step("<answer>9</answer>").info["success"] is False


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="^parser: unknown tool-call format"):
        ToolEnvConfig(parser="nope")
    with pytest.raises(ValueError, match="^max_tool_calls_per_turn: "):
        ToolEnvConfig(max_tool_calls_per_turn=0)
    with pytest.raises(ValueError, match="^tool_timeout_s: "):
        ToolEnvConfig(tool_timeout_s=0)


def test_bound_method_schemas_are_parsed_once_and_not_shared_mutably():
    class Shop:
        def __init__(self, stock: int) -> None:
            self.stock = stock

        def buy(self, item: str, count: int) -> str:
            """Buy items.

            Args:
                item: What to buy.
                count: How many.
            """
            return f"{count} {item} of {self.stock}"

    first, second = Tool.from_function(Shop(1).buy), Tool.from_function(Shop(2).buy, name="purchase")
    assert first.schema["function"]["name"] == "buy" and second.schema["function"]["name"] == "purchase"
    assert first.parameters == second.parameters and "self" not in first.parameters["properties"]
    first.schema["function"]["description"] = "changed"  # one tool's copy, not the cache
    assert Tool.from_function(Shop(3).buy).schema["function"]["description"] == "Buy items."
    assert second.function(item="pen", count=2) == "2 pen of 2"
