"""Environments and a task source for the scaling tests and benchmark (a plugin module).

Imported by the tests and, through `plugins=("tests.scale_envs",)`, inside Ray rollout actors.

* `echo_turns`: always answers (a short observation) and ends after `TURNS` turns, so every
  episode is multi-turn whatever an untrained model says; each step sleeps `task.answer`
  seconds when that is a number (a deliberately slow tool).
* `crash_once`: the first step in a process whose marker file (`task.answer`) does not exist
  yet creates it and kills the process: a rollout actor dying mid-step, once.
"""

from __future__ import annotations

import os
import time

from tamer.tasks import TASK_SOURCES
from tamer.tasks.base import Task
from tamer.tasks.env import ENVIRONMENTS, BaseEnvironment, StepResult

TURNS = 3


@ENVIRONMENTS.register("echo_turns")
class EchoTurns(BaseEnvironment):
    def reset(self, task: Task) -> str:
        self.turns, self.delay = 0, _seconds(task.answer)
        return ""

    def step(self, action: str) -> StepResult:
        if self.delay:
            time.sleep(self.delay)
        self.turns += 1
        done = self.turns >= TURNS
        return StepResult(None if done else f"got {len(action)}", done=done, info={"success": done})


@ENVIRONMENTS.register("crash_once")
class CrashOnce(EchoTurns):
    def reset(self, task: Task) -> str:
        self.marker = task.answer
        return super().reset(Task(id=task.id, messages=task.messages, answer="", env=task.env))

    def step(self, action: str) -> StepResult:
        if not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(1)  # the actor's process dies mid-rollout
        return super().step(action)


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def echo_tasks(n: int, env: str = "echo_turns", answer: str = "") -> list[Task]:
    return [Task(id=f"e{i}", messages=({"role": "user", "content": f"say {i}"},), answer=answer, env=env)
            for i in range(n)]


@TASK_SOURCES.register("echo_turns")
class EchoTurnsTasks:
    """Multi-turn episodes; the tool sleeps TAMER_TEST_TOOL_S seconds per call (default 0)."""

    name = "echo_turns"

    def split(self):
        tasks = echo_tasks(300, answer=os.environ.get("TAMER_TEST_TOOL_S", ""))
        return tasks[:250], tasks[250:]

    def demonstrate(self, task, rng):
        return "ok"
