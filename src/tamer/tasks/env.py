"""The environment protocol: what a multi-turn agent talks to.

One environment instance serves one trajectory. The rollout loop calls

    first = env.reset(task)                  # optional extra text for the first user turn ("" if none)
    result = env.step(assistant_text)        # the policy's whole turn, as text
    result.observation                       # what the environment answers (a tool message), or None
    result.reward, result.done, result.info  # per-turn (process) reward, end flag, facts

until `done` or the rollout's turn/token budget runs out. `info` of the last step holds the
outcome facts reward functions read (e.g. "success", "cost", "optimal_cost").
Environments register by name in `ENVIRONMENTS` so configs and the CLI can pick them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tamer.registry import Registry
from tamer.tasks.base import Task


@dataclass
class StepResult:
    # The environment's reply: text (rendered as one tool message), a list of message dicts
    # ({"role": "tool", "content", "tool_call_id"?}: one per tool call), or None.
    observation: str | list[dict[str, str]] | None
    reward: float = 0.0  # per-turn (process) reward
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    def reset(self, task: Task) -> str: ...

    def step(self, action: str) -> StepResult: ...


class BaseEnvironment:
    """Convenience base: the protocol's methods and tool schemas (none here)."""

    tools: list[dict] = []

    def reset(self, task: Task) -> str:
        raise NotImplementedError

    def step(self, action: str) -> StepResult:
        raise NotImplementedError


ENVIRONMENTS: Registry = Registry("environment")
