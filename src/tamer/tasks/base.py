"""Tasks: what the agent is asked to do, and how an answer is checked.

A `Task` is one prompt (chat messages) with what is needed to check an answer. A
`TaskSource` produces tasks (a built-in generator or a user's dataset) and knows how to
check a completion and, for SFT, how to demonstrate one. A `TaskPool` hands out tasks in
a seeded, resumable order.

    source = get_task_source(TaskConfig(name="arithmetic"))
    train, heldout = source.split()
    pool = TaskPool(train, seed=0)
    tasks = pool.next_batch(16)           # deterministic given (seed, position)
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tamer.registry import Registry


@dataclass(frozen=True)
class Task:
    """One thing to try. `answer` is the reference a reward function checks against."""

    id: str
    messages: tuple[dict[str, str], ...]  # chat prompt, e.g. ({"role": "user", "content": ...},)
    answer: str
    meta: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    env: str | None = None  # name of the environment that runs this task (None: single turn)


@runtime_checkable
class TaskSource(Protocol):
    """Where tasks come from. Built-ins and dataset loaders implement this."""

    name: str

    def split(self) -> tuple[list[Task], list[Task]]:
        """Disjoint (train, held-out) task lists, deterministic for a given config."""

    def demonstrate(self, task: Task, rng: random.Random) -> str:
        """A demonstration completion (assistant text) for SFT data."""


TASK_SOURCES: Registry = Registry("task")


ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(text: str) -> str | None:
    """The content of the last <answer>...</answer> in `text`, stripped; None if absent."""
    found = ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


def normalize_answer(answer: str) -> str:
    """Canonical form for comparison: trimmed, case-folded, numbers in plain form."""
    text = answer.strip().replace(",", "")
    try:
        value = float(text)
    except ValueError:
        return " ".join(text.lower().split())
    return str(int(value)) if value.is_integer() else repr(value)


def is_correct(completion: str, task: Task) -> bool:
    """True when the completion's final answer matches the task's reference."""
    got = extract_answer(completion)
    return got is not None and normalize_answer(got) == normalize_answer(task.answer)


def format_answer(answer: str) -> str:
    """The completion format every built-in demonstration uses."""
    return f"<answer>{answer}</answer>"


class TaskPool:
    """Seeded, resumable sampling without replacement within an epoch.

    The order of epoch e is a permutation drawn from Random(seed + e); `position` (epoch,
    index) is all a checkpoint needs to continue exactly where a run stopped.
    """

    def __init__(self, tasks: list[Task], seed: int = 0) -> None:
        if not tasks:
            raise ValueError("TaskPool needs at least one task")
        self.tasks = tasks
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[Task]:
        batch = []
        for _ in range(n):
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            batch.append(self.tasks[self._order[self.index]])
            self.index += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.epoch, self.index = state["seed"], state["epoch"], state["index"]
        self._order = self._permutation(self.epoch)
