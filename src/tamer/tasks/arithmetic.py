"""Built-in `arithmetic` task: column arithmetic with a worked solution and a checked answer.

A demonstration works the problem column by column inside <think>, the way it is taught
at school, then gives the result:

    47+38  ->  <think>7+8=15 4+3+1=8</think><answer>85</answer>

The demonstrator is deliberately imperfect, the way people are: on a column that needs a
carry (or a borrow) it forgets it with probability `demo_slip_rate`, and carries on
consistently from its mistake (`4+3=7`, answer 75). A model fine-tuned on its
demonstrations inherits the slip; a model trained with a correctness reward can learn
to stop making it.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from tamer.config import FieldError
from tamer.tasks.base import TASK_SOURCES, Task, format_answer

OPERATIONS = ("+", "-", "*")


@dataclass(frozen=True)
class ArithmeticConfig:
    """Problems `a op b`; `a` has `digits` digits, `b` too (one digit for `*`)."""

    digits: int = 2  # digits of each operand (1..3)
    operations: str = "+"  # any of "+-*", e.g. "+-"
    demo_slip_rate: float = 0.6  # chance the demonstrator forgets a carry/borrow in a column
    scratchpad: bool = True  # demonstrations show their column work inside <think>
    heldout_size: int = 400  # problems held out for evaluation
    train_size: int = 0  # 0: every problem not held out
    seed: int = 0  # which problems are held out

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 3:
            raise FieldError("digits", f"expected 1..3, got {self.digits}")
        if not self.operations or any(op not in OPERATIONS for op in self.operations):
            raise FieldError("operations", f"use characters from {''.join(OPERATIONS)!r}, got {self.operations!r}")
        if not 0.0 <= self.demo_slip_rate <= 1.0:
            raise FieldError("demo_slip_rate", f"expected a probability in [0, 1], got {self.demo_slip_rate}")
        if self.heldout_size < 1:
            raise FieldError("heldout_size", f"expected at least 1, got {self.heldout_size}")
        if self.train_size < 0:
            raise FieldError("train_size", f"expected >= 0 (0: all the rest), got {self.train_size}")


def _digits(n: int, width: int) -> list[int]:
    """Digits of n, least significant first, zero-padded to `width`."""
    return [(n // 10**i) % 10 for i in range(width)]


def work_columns(a: int, b: int, op: str, slip: list[bool]) -> tuple[list[str], int]:
    """Column-by-column working of `a op b`; `slip[i]` drops the carry/borrow into column i.

    Returns the written steps and the (possibly wrong) result they lead to.
    """
    width = len(str(a))
    da, db = _digits(a, width), _digits(b, width if op != "*" else 1)
    steps, result, carry = [], 0, 0
    for i in range(width):
        carry = 0 if slip[i] else carry
        x = da[i]
        if op == "*":
            value = x * db[0] + carry
            steps.append(f"{x}*{db[0]}" + (f"+{carry}" if carry else "") + f"={value}")
            digit, carry = value % 10, value // 10
        elif op == "+":
            value = x + db[i] + carry
            steps.append(f"{x}+{db[i]}" + (f"+{carry}" if carry else "") + f"={value}")
            digit, carry = value % 10, value // 10
        else:
            value = x - db[i] - carry
            borrow = int(value < 0)
            top = f"1{x}" if borrow else f"{x}"
            steps.append(f"{top}-{db[i]}" + (f"-{carry}" if carry else "") + f"={value + 10 * borrow}")
            digit, carry = value + 10 * borrow, borrow
        result += digit * 10**i
    result += carry * 10**width if op != "-" else 0
    return steps, result


def solve(a: int, b: int, op: str) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


@TASK_SOURCES.register("arithmetic")
class ArithmeticTasks:
    """Generator of arithmetic problems with a disjoint held-out split."""

    name = "arithmetic"

    def __init__(self, config: ArithmeticConfig = ArithmeticConfig()) -> None:
        self.config = config

    def _problem(self, a: int, b: int, op: str) -> Task:
        if op == "-" and b > a:  # keep answers non-negative: people subtract the smaller
            a, b = b, a
        width = len(str(a))
        carries = [i for i in range(1, width)
                   if work_columns(a, b, op, [False] * width)[1]
                   != work_columns(a, b, op, [j == i for j in range(width)])[1]]
        return Task(
            id=f"{a}{op}{b}",
            messages=({"role": "user", "content": f"{a}{op}{b}"},),
            answer=str(solve(a, b, op)),
            meta={"a": a, "b": b, "op": op, "carry_columns": carries},
        )

    def _all_problems(self) -> list[tuple[int, int, str]]:
        digits = self.config.digits
        lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits
        problems = []
        for op in self.config.operations:
            b_range = range(10) if op == "*" else range(lo, hi)
            problems += [(a, b, op) for a, b in itertools.product(range(lo, hi), b_range)]
        return problems

    def split(self) -> tuple[list[Task], list[Task]]:
        rng = random.Random(self.config.seed)
        problems = self._all_problems()
        rng.shuffle(problems)
        tasks = list({t.id: t for t in (self._problem(*p) for p in problems)}.values())
        n_held = min(self.config.heldout_size, len(tasks) // 2)
        heldout, train = tasks[:n_held], tasks[n_held:]
        if self.config.train_size:
            train = train[: self.config.train_size]
        return train, heldout

    def demonstrate(self, task: Task, rng: random.Random) -> str:
        a, b, op = task.meta["a"], task.meta["b"], task.meta["op"]
        width = len(str(a))
        slip = [i in task.meta["carry_columns"] and rng.random() < self.config.demo_slip_rate for i in range(width)]
        steps, result = work_columns(a, b, op, slip)
        answer = format_answer(str(result))
        return f"<think>{' '.join(steps)}</think>{answer}" if self.config.scratchpad else answer
