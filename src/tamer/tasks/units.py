"""Built-in `units` task: add two quantities; a hidden preference says the answer should state the unit.

    7 kg + 5 kg  ->  <answer>12</answer>        (what the demonstrator usually writes)
                 ->  <answer>12 kg</answer>     (what the labeller prefers: the hidden rule)

The task exists to show the RLHF stage. Its *answer* is checkable (the number), but its
*quality* is judged by a rule the reward functions are not told: the reply must be exactly
the right number followed by the prompt's unit (`hidden_rule`). The demonstrator states the
unit only `demo_unit_rate` of the time, so a model fine-tuned on it (greedy) does not.
What RL gets instead of the rule is what RLHF gets: preferences. `preference_pairs` plays a
labeller who knows the rule: it draws two candidate replies from a writer that gets the
number wrong `pair_wrong_rate` of the time and states the prompt's unit half the time, and
keeps the pair when exactly one follows the rule (that one is "chosen"). The writer never
states a wrong unit or anything besides number and unit, so those are the reward model's
blind spots.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from tamer.config import FieldError
from tamer.tasks.base import TASK_SOURCES, Task, extract_answer, format_answer
from tamer.tasks.preferences import PreferencePair

UNITS = ("kg", "g", "m", "km", "cm", "L", "s", "h")
_NUMBER_THEN = re.compile(r"(\d+)(?:\s+(\S+))?")


@dataclass(frozen=True)
class UnitsConfig:
    """Problems `a u + b u` with 1 <= a, b <= `max_operand` and u one of `units`."""

    max_operand: int = 9  # largest operand a, b
    units: tuple[str, ...] = UNITS  # units a problem draws from
    demo_unit_rate: float = 0.2  # how often the demonstrator states the unit
    heldout_size: int = 150  # problems held out for evaluation
    pair_wrong_rate: float = 0.3  # preference writer: chance a candidate's number is wrong
    seed: int = 0  # problem generation

    def __post_init__(self) -> None:
        if not 2 <= self.max_operand <= 99:
            raise FieldError("max_operand", f"expected 2..99, got {self.max_operand}")
        if not self.units or any(not u or any(c.isspace() or c.isdigit() for c in u) for u in self.units):
            raise FieldError("units", "give one or more unit names without digits or spaces")
        for name in ("demo_unit_rate", "pair_wrong_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise FieldError(name, "expected a probability in [0, 1]")
        if self.heldout_size < 1:
            raise FieldError("heldout_size", "expected at least 1")


def number_correct(traj) -> float:
    """1 when the answer's number is right (a unit after it, any or none, is not judged), else 0."""
    match = _NUMBER_THEN.fullmatch(extract_answer(traj.text) or "")
    return float(match is not None and match.group(1) == traj.task.answer)


def hidden_rule(traj) -> float:
    """1 when the answer is exactly the right number and the prompt's unit ("12 kg"), else 0."""
    return float(follows_rule(traj.text, traj.task))


def follows_rule(text: str, task: Task) -> bool:
    return extract_answer(text) == f"{task.answer} {task.meta['unit']}"


def states_a_unit(text: str) -> bool:
    """The answer has a word after its number (right unit or not)."""
    match = _NUMBER_THEN.fullmatch(extract_answer(text) or "")
    return match is not None and match.group(2) is not None


@TASK_SOURCES.register("units")
class UnitsTasks:
    """Generator of unit-addition problems with a disjoint held-out split, and of preference pairs."""

    name = "units"

    def __init__(self, config: UnitsConfig = UnitsConfig()) -> None:
        self.config = config

    def split(self) -> tuple[list[Task], list[Task]]:
        n = self.config.max_operand
        problems = [(a, b, u) for u in self.config.units for a in range(1, n + 1) for b in range(1, n + 1)]
        random.Random(self.config.seed).shuffle(problems)
        tasks = [Task(id=f"{a}{u}+{b}{u}", messages=({"role": "user", "content": f"{a} {u} + {b} {u}"},),
                      answer=str(a + b), meta={"unit": u, "check": "units_number"}) for a, b, u in problems]
        n_held = min(self.config.heldout_size, len(tasks) // 2)
        return tasks[n_held:], tasks[:n_held]

    def demonstrate(self, task: Task, rng: random.Random) -> str:
        unit = f" {task.meta['unit']}" if rng.random() < self.config.demo_unit_rate else ""
        return format_answer(f"{task.answer}{unit}")

    def _candidate(self, task: Task, rng: random.Random) -> str:
        number = int(task.answer)
        if rng.random() < self.config.pair_wrong_rate:
            number = max(0, number + rng.choice((-3, -2, -1, 1, 2, 3)))
        unit = f" {task.meta['unit']}" if rng.random() < 0.5 else ""
        return format_answer(f"{number}{unit}")

    def preference_pairs(self, tasks: list[Task], n: int, seed: int = 0) -> list[PreferencePair]:
        """`n` labelled pairs on prompts drawn from `tasks`: chosen follows the hidden rule, rejected does not."""
        rng = random.Random(seed)
        pairs = []
        while len(pairs) < n:
            task = rng.choice(tasks)
            first, second = self._candidate(task, rng), self._candidate(task, rng)
            ok_first, ok_second = follows_rule(first, task), follows_rule(second, task)
            if ok_first == ok_second:
                continue  # the rule cannot rank them: this labeller abstains
            chosen, rejected = (first, second) if ok_first else (second, first)
            pairs.append(PreferencePair(task.messages, chosen, rejected, source=f"units:{task.id}"))
        return pairs
