"""A base class for environments where the agent calls Python tools before it answers.

A subclass supplies the tools (usually bound methods that read per-task state) and judges
the final answer:

    @ENVIRONMENTS.register("lookup")
    class LookupEnv(ToolEnvironment):
        def build_tools(self) -> ToolSet:
            return ToolSet([self.lookup])

        def on_reset(self, task: Task) -> None:
            self.table = task.meta["table"]

        def lookup(self, key: str) -> str:
            '''Look a key up in the table.

            Args:
                key: The key to look up.
            '''
            return self.table[key]

        def finish(self, final_text: str) -> dict:
            return {"success": is_correct(final_text, self.task), "cost": float(self.tool_calls)}

Each `step(action_text)` parses the turn in the tool-call format (`ToolEnvConfig.parser`, or
the model's format set by the rollout through `use_tool_format`; see `tamer.tools.formats`).
A turn with tool calls (or unreadable attempts at one) runs them, at most
`max_tool_calls_per_turn`, and answers with one result per call, in the order of the calls,
errors included; in the default Hermes format, one block per call:

    <tool_response>888</tool_response>
    <tool_response>error: unknown tool 'serch' (available: calculate)</tool_response>

A turn without any is the final answer: the episode ends and `finish(final_text)` says how
it went. `info` always carries the running counters rollouts and rewards read:
"tool_calls" (int, all attempts so far), "tool_errors" ({error_kind: count}),
"tool_calls_skipped" (calls past the per-turn limit, not run), "turns", and "turn_calls"
(this step's calls: {"name", "arguments", "ok", "error_kind", "seconds"}).

`step` does not raise for any agent text: parse and tool failures become error responses.
A subclass's own hooks (`on_reset`, `finish`) could still raise; the rollout loop catches
exceptions from an environment and ends that trajectory rather than the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tamer.config import FieldError, check_name
from tamer.tasks.base import Task, is_correct
from tamer.tasks.env import BaseEnvironment, StepResult
from tamer.tools.executor import ToolResult, execute, malformed
from tamer.tools.formats import TOOL_FORMATS, ToolFormat, make_format
from tamer.tools.parsing import ToolCall
from tamer.tools.schema import ToolSet


@dataclass(frozen=True)
class ToolEnvConfig:
    """How tool calls are read and run."""

    max_tool_calls_per_turn: int = 4  # calls past this in one turn are not run
    tool_timeout_s: float = 5.0  # wall-clock limit per call
    max_result_chars: int = 2000  # longer results are cut, with a marker
    parser: str = "hermes"  # tool-call format, a name in tamer.tools.formats.TOOL_FORMATS (the rollout's wins)

    def __post_init__(self) -> None:
        if self.max_tool_calls_per_turn < 1:
            raise FieldError("max_tool_calls_per_turn", f"expected at least 1, got {self.max_tool_calls_per_turn}")
        if not self.tool_timeout_s > 0:
            raise FieldError("tool_timeout_s", f"expected a positive number of seconds, got {self.tool_timeout_s}")
        if self.max_result_chars < 1:
            raise FieldError("max_result_chars", f"expected at least 1, got {self.max_result_chars}")
        check_name("parser", self.parser, TOOL_FORMATS.names(), "tool-call format")


class ToolEnvironment(BaseEnvironment):
    """Runs the agent's tool calls until it answers without one. See the module docstring."""

    def __init__(self, config: ToolEnvConfig | None = None) -> None:
        self.config = config or ToolEnvConfig()
        self.format: ToolFormat = make_format(self.config.parser)
        self.toolset = self.build_tools()
        self.task: Task | None = None
        self._reset_counters()

    # -- hooks for subclasses -------------------------------------------------------------

    def build_tools(self) -> ToolSet:
        """The tools this environment offers; called once, in __init__."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_tools()")

    def on_reset(self, task: Task) -> None:
        """Set up per-task state (the task itself is already in `self.task`)."""

    def finish(self, final_text: str) -> dict[str, Any]:
        """Judge the final answer; the dict is merged into the last step's `info`."""
        assert self.task is not None, "finish() before reset()"
        return {"success": is_correct(final_text, self.task), "cost": float(self.tool_calls)}

    # -- the Environment protocol ---------------------------------------------------------

    @property
    def tools(self) -> list[dict]:  # type: ignore[override]
        """Schemas for the chat template's `tools=`."""
        return self.toolset.schemas()

    def use_tool_format(self, tool_format: ToolFormat) -> None:
        """Parse turns and answer in `tool_format` (the rollout sets its model's format)."""
        self.format = tool_format

    def reset(self, task: Task) -> str:
        self.task = task
        self._reset_counters()
        self.on_reset(task)
        return ""

    def step_deadline(self, action: str) -> float:
        """Seconds `action`'s tool calls may take in all (process isolation kills a worker past it)."""
        calls = min(len(self.format.parse(action).items), self.config.max_tool_calls_per_turn)
        return max(1, calls) * self.config.tool_timeout_s

    def record_killed_turn(self, action: str, message: str, kind: str) -> StepResult:
        """The turn whose worker had to be killed (tamer.rollout.isolation): each of its calls
        is answered and counted as a `kind` error."""
        self.turns += 1
        items = self.format.parse(action).items[: self.config.max_tool_calls_per_turn] or [""]
        results, records = [], []
        for item in items:
            name = item.name if isinstance(item, ToolCall) else ""
            result = ToolResult(name, False, f"error: {message}", kind)
            self.tool_calls += 1
            self.tool_errors[kind] = self.tool_errors.get(kind, 0) + 1
            self.history.append((item if isinstance(item, ToolCall) else None, result))
            records.append({"name": name, "arguments": dict(item.arguments) if isinstance(item, ToolCall) else {},
                            "ok": False, "error_kind": kind, "seconds": 0.0})
            results.append((item if isinstance(item, ToolCall) else None, result.content))
        observation = self.format.observation(results)
        return StepResult(observation, done=False, info=self._info(records))

    def step(self, action: str) -> StepResult:
        self.turns += 1
        parsed = self.format.parse(action)
        if not parsed.items:
            return StepResult(None, done=True, info={**self._info([]), **self.finish(parsed.final_text)})
        limit = self.config.max_tool_calls_per_turn
        turn_calls = [self._run(item) for item in parsed.items[:limit]]
        results = [(item if isinstance(item, ToolCall) else None, result.content)
                   for item, (result, _) in zip(parsed.items, turn_calls)]
        skipped = len(parsed.items) - limit
        if skipped > 0:
            self.tool_calls_skipped += skipped
            results.append((None, f"error: at most {limit} tool calls run per turn; {skipped} more were not run"))
        return StepResult(self.format.observation(results), done=False,
                          info=self._info([record for _, record in turn_calls]))

    # -- internals ------------------------------------------------------------------------

    def _run(self, item: ToolCall | str) -> tuple[ToolResult, dict[str, Any]]:
        max_chars = self.config.max_result_chars
        if isinstance(item, str):  # a block the parser could not read
            result, arguments = malformed(item, max_chars), {}
        else:
            result = execute(item, self.toolset, self.config.tool_timeout_s, max_chars)
            arguments = dict(item.arguments)  # a tool must not be able to edit the record
        self.tool_calls += 1
        self.history.append((item if isinstance(item, ToolCall) else None, result))
        if not result.ok:
            self.tool_errors[result.error_kind] = self.tool_errors.get(result.error_kind, 0) + 1
        record = {"name": result.name, "arguments": arguments, "ok": result.ok,
                  "error_kind": result.error_kind, "seconds": result.seconds}
        return result, record

    def _reset_counters(self) -> None:
        self.turns = 0
        self.tool_calls = 0
        self.tool_calls_skipped = 0
        self.tool_errors: dict[str, int] = {}
        # Every attempt this episode, in order (None for an unreadable one), for `finish`.
        self.history: list[tuple[ToolCall | None, ToolResult]] = []

    def _info(self, turn_calls: list[dict[str, Any]]) -> dict[str, Any]:
        return {"tool_calls": self.tool_calls, "tool_errors": dict(self.tool_errors),
                "tool_calls_skipped": self.tool_calls_skipped, "turns": self.turns,
                "turn_calls": turn_calls}
