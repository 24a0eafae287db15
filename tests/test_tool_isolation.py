"""Tools that can be stopped: a timed-out call is really stopped (thread isolation), or its
worker process killed and replaced with the episode rebuilt (process isolation)."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest

from tamer.rollout.agent import AgentConfig, AgentRollout
from tamer.tasks.base import Task
from tamer.tasks.calculator import CalculatorTasks
from tamer.tasks.tool_env import ToolEnvConfig, ToolEnvironment
from tamer.tools.executor import execute
from tamer.tools.parsing import ToolCall
from tamer.tools.schema import ToolSet


def spin(n: int) -> int:
    """Loop forever in Python.

    Args:
        n: ignored
    """
    x = 0
    while True:
        x += n


def stubborn(n: int) -> int:
    """Loop forever and swallow every exception, even BaseException.

    Args:
        n: ignored
    """
    while True:
        try:
            while True:
                n += 1
        except BaseException:
            pass


def _tool_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"tool-{name}" and t.is_alive()]


def test_timed_out_python_tool_is_really_stopped():
    result = execute(ToolCall("spin", {"n": 1}), ToolSet([spin]), timeout_s=0.2)
    assert result.error_kind == "timeout"
    deadline = time.monotonic() + 2.0
    while _tool_threads("spin") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _tool_threads("spin") == []  # before: the thread kept spinning for the rest of the run


class _Counter(ToolEnvironment):
    """A stateful environment: `bump` counts, `freeze` holds the GIL inside one C call."""

    def build_tools(self):
        return ToolSet([self.bump, self.freeze, stubborn])

    def on_reset(self, task):
        self.count = 0

    def bump(self, by: int) -> int:
        """Add to the counter and return it.

        Args:
            by: how much
        """
        self.count += by
        return self.count

    def freeze(self, n: int) -> int:
        """One C call that runs for minutes without releasing the GIL.

        Args:
            n: ignored
        """
        return sum(range(10**13))


def _call(name: str, **arguments) -> str:
    import json

    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


TASK = Task(id="c", messages=({"role": "user", "content": "count"},), answer="3")


def test_process_isolation_kills_a_frozen_tool_and_replays_the_episode(monkeypatch):
    from tamer.rollout import isolation

    monkeypatch.setattr(isolation, "REPLY_MARGIN_S", 0.5)
    env = isolation.IsolatedEnvironment(_Counter(ToolEnvConfig(tool_timeout_s=0.3)))
    env.reset(TASK)
    assert env.step(_call("bump", by=2)).observation == "<tool_response>2</tool_response>"
    first_worker = env.worker.pid
    started = time.monotonic()
    frozen = env.step(_call("freeze", n=1))
    assert time.monotonic() - started < 5.0  # in the trainer's own thread this would hang for minutes
    assert "error:" in frozen.observation and "stopped and restarted" in frozen.observation
    assert frozen.info["tool_errors"] == {"timeout": 1} and frozen.info["tool_calls"] == 2
    assert env.worker.pid != first_worker
    with pytest.raises(ChildProcessError):
        os.waitpid(first_worker, os.WNOHANG)  # killed and reaped
    after = env.step(_call("bump", by=1))  # the state from before the kill was rebuilt
    assert after.observation == "<tool_response>3</tool_response>" and after.info["tool_calls"] == 3
    done = env.step("<answer>3</answer>")
    assert done.done and env.worker is None  # the worker ends with its episode


def test_process_isolation_replaces_a_worker_left_with_an_unstoppable_thread(monkeypatch):
    from tamer.rollout import isolation

    env = isolation.IsolatedEnvironment(_Counter(ToolEnvConfig(tool_timeout_s=0.2)))
    env.reset(TASK)
    env.step(_call("bump", by=5))
    first_worker = env.worker.pid
    result = env.step(_call("stubborn", n=1))  # catches every ToolStopped: the thread would spin on
    assert result.info["tool_errors"] == {"timeout": 1} and env.worker.pid != first_worker
    assert env.step(_call("bump", by=1)).observation == "<tool_response>6</tool_response>"
    env.close()


def test_process_isolation_gives_the_same_episodes_as_in_process(tokenizer):
    src = CalculatorTasks()
    tasks = src.split()[1][:3]
    config = AgentConfig(max_turns=8, max_total_tokens=2000, show_tools=False)
    isolated = AgentConfig(max_turns=8, max_total_tokens=2000, show_tools=False, tool_isolation="process")
    for task in tasks:
        turns = src.demonstrate_turns(task, random.Random(0))
        here = AgentRollout(None, tokenizer, config).replay(task, turns)
        there = AgentRollout(None, tokenizer, isolated).replay(task, turns)
        assert there.completion_ids == here.completion_ids and there.loss_mask == here.loss_mask
        assert there.info == here.info and there.info["success"]


def test_tool_isolation_is_checked():
    with pytest.raises(ValueError, match="^tool_isolation: unknown tool isolation"):
        AgentConfig(tool_isolation="vm")
