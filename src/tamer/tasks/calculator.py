"""Built-in `calculator` task and environment: word problems solved with a calculator tool.

    source = CalculatorTasks(CalculatorConfig())
    train, heldout = source.split()            # Task(env="calculator", ...)
    env = ENVIRONMENTS.get("calculator")()
    env.reset(train[0]); env.tools             # [schema of calculate(expression: str)]
    env.step('<tool_call>{"name":"calculate","arguments":{"expression":"37*24"}}</tool_call>')
    # StepResult(observation="<tool_response>888</tool_response>", done=False, ...)
    env.step("<answer>730</answer>").info      # {"success": True, "cost": 1.0, ...}

Problems come from a few templates of 2-3 arithmetic steps ("A shop has 37 boxes of 24
pens and sells 158 pens. How many pens are left?"), with numbers from a seeded RNG.

The scripted demonstrator (`demonstrate_turns`) is wasteful: one call per step, and after a
step, with probability `demo_redundant_rate`, it computes an earlier step again. Its habits,
off by default: `demo_double_check_rate` repeats the last calculation before answering, and
`demo_mental_rate` does the first step in its head instead of calling, slipping by ten at times
(the later calls then carry the slip into a wrong answer). SFT on it copies what it does most;
RL with a cost penalty (`info["cost"]` counts calls, `info["optimal_cost"]` is the number of
steps) and the outcome can learn to drop both.

`calculate` is a safe evaluator over Python's `ast`: numbers, + - * / // % **, parentheses
and unary signs only; no names, calls or attributes, and no `eval`.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tamer.config import FieldError
from tamer.tasks.base import TASK_SOURCES, Task, extract_answer, format_answer, normalize_answer
from tamer.tasks.env import ENVIRONMENTS
from tamer.tasks.tool_env import ToolEnvironment
from tamer.tools.schema import Tool, ToolSet

# -- the safe calculator ------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 200
MAX_RESULT_BITS = 4096  # ~1200 digits: keeps `9**9**9`-style requests from hanging a worker
BINARY_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
UNARY_OPS: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> float:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. 37*24-158
    """
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression must be a string of at most {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"invalid expression: {exc.msg}") from None
    value = _evaluate(tree.body)
    # A whole-number result prints as one ("888", not "888.0"), so answers copy cleanly.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return round(value, 10) if isinstance(value, float) else value


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY_OPS:
        return UNARY_OPS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY_OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _check_size(BINARY_OPS[type(node.op)](left, right))
    raise ValueError(f"unsupported syntax: {_describe(node)}; use numbers, + - * / // % ** and parentheses")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse powers whose result would be too large to compute quickly."""
    if abs(exponent) > 1000:
        raise ValueError("exponent too large (at most 1000)")
    if isinstance(base, int) and exponent > 0 and abs(base).bit_length() * exponent > MAX_RESULT_BITS:
        raise ValueError("result too large")


def _check_size(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_RESULT_BITS:
        raise ValueError("result too large")
    if isinstance(value, complex):  # (-8)**0.5
        raise ValueError("result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result is not finite")
    return value


NODE_WORDS = {"Name": "names", "Call": "function calls", "Attribute": "attributes", "Subscript": "indexing"}


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Constant):
        return f"constant {node.value!r}"
    kind = type(node).__name__
    return NODE_WORDS.get(kind, kind)


CALCULATE = Tool.from_function(calculate)

# -- problems -----------------------------------------------------------------------------

# A step is (left, op, right); an operand is a number or "#k", the result of step k.
Step = tuple[int | str, str, int | str]


def _pens(rng: random.Random) -> tuple[str, list[Step]]:
    a, b = rng.randint(3, 60), rng.randint(6, 50)
    c = rng.randint(1, a * b - 1)
    text = f"A shop has {a} boxes of {b} pens and sells {c} pens. How many pens are left?"
    return text, [(a, "*", b), ("#0", "-", c)]


def _share(rng: random.Random) -> tuple[str, list[Step]]:
    k = rng.randint(2, 12)
    while True:  # redraw until the share is whole; about one draw in three succeeds
        a, b = rng.randint(2, 40), rng.randint(3, 60)
        if (a * b) % k == 0:
            break
    text = (f"{a} bags hold {b} marbles each. The marbles are shared equally among {k} children. "
            "How many marbles does each child get?")
    return text, [(a, "*", b), ("#0", "/", k)]


def _tickets(rng: random.Random) -> tuple[str, list[Step]]:
    a = rng.randint(10, 90)
    b, c, d = rng.randint(5, a - 1), rng.randint(2, 30), rng.randint(2, 30)
    text = (f"Adult tickets cost {a} dollars and child tickets cost {b} dollars. "
            f"How much do {c} adults and {d} children pay?")
    return text, [(a, "*", c), (b, "*", d), ("#0", "+", "#1")]


def _trees(rng: random.Random) -> tuple[str, list[Step]]:
    a, b, c = rng.randint(3, 60), rng.randint(5, 80), rng.randint(2, 40)
    text = f"A farm has {a} rows of {b} trees and plants {c} more trees in each row. How many trees are there now?"
    return text, [(b, "+", c), (a, "*", "#0")]


def _jars(rng: random.Random) -> tuple[str, list[Step]]:
    a, b, d = rng.randint(5, 90), rng.randint(4, 52), rng.randint(2, 9)
    c = a * b - d * rng.randint(1, (a * b - 1) // d)
    text = (f"Mia saves {a} dollars a week for {b} weeks and spends {c} dollars on a bike. "
            f"She splits the rest equally into {d} jars. How many dollars go in each jar?")
    return text, [(a, "*", b), ("#0", "-", c), ("#1", "/", d)]


TEMPLATES: dict[str, Callable[[random.Random], tuple[str, list[Step]]]] = {
    "pens": _pens, "share": _share, "tickets": _tickets, "trees": _trees, "jars": _jars,
}


def run_steps(steps: list[Step], first_value: int | None = None) -> tuple[list[str], list[int | float]]:
    """The expression each step sends to the calculator, and each step's result.

    `first_value` replaces the first step's result (a step done in the head, maybe wrong): the
    later steps are then computed as the calculator would, inexact divisions included.
    """
    expressions: list[str] = []
    values: list[int | float] = []
    for left, op, right in steps:
        lhs, rhs = (values[int(x[1:])] if isinstance(x, str) else x for x in (left, right))
        expressions.append(f"{lhs}{op}{rhs}")
        if first_value is None:
            values.append(_apply(lhs, op, rhs))
        else:
            values.append(calculate(expressions[-1]) if values else first_value)
    return expressions, values


def _apply(lhs: int, op: str, rhs: int) -> int:
    # Integer arithmetic directly, not `calculate` (parsing dominated split() time); the
    # tests replay every demonstration through the tool, which checks the two agree.
    if op == "/":
        assert lhs % rhs == 0, f"template produced an inexact division {lhs}/{rhs}"
        return lhs // rhs
    return {"+": operator.add, "-": operator.sub, "*": operator.mul}[op](lhs, rhs)


def _mental_result(value: int, rng: random.Random, slip_rate: float) -> int:
    """A step done in the head: right, or with `slip_rate` off by ten (a dropped carry or borrow)."""
    if rng.random() >= slip_rate:
        return value
    return value + rng.choice((-10, 10)) if value > 10 else value + 10


def tool_call_text(expression: str) -> str:
    """One compact Hermes-style call, as the tiny character-level models should write it."""
    payload = {"name": "calculate", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(payload, separators=(',', ':'))}</tool_call>"


@dataclass(frozen=True)
class CalculatorConfig:
    """Word problems of 2-3 steps from `TEMPLATES`, solved with the `calculate` tool."""

    heldout_size: int = 400  # problems held out for evaluation
    train_size: int = 5000  # training problems
    demo_redundant_rate: float = 0.5  # chance, after each step, that the demo recomputes one
    demo_double_check_rate: float = field(  # chance of repeating the last calculation before answering
        default=0.0)  # (> 0.5: a habit SFT copies)
    demo_mental_rate: float = 0.0  # chance of doing the first step in the head (no call) instead
    demo_mental_slip_rate: float = 0.5  # chance that a step done in the head is off by ten (a wrong answer)
    seed: int = 0  # problem generation

    def __post_init__(self) -> None:
        for name in ("heldout_size", "train_size"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"expected at least 1, got {getattr(self, name)}")
        for name in ("demo_redundant_rate", "demo_double_check_rate", "demo_mental_rate", "demo_mental_slip_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise FieldError(name, f"expected a probability in [0, 1], got {getattr(self, name)}")


@TASK_SOURCES.register("calculator")
class CalculatorTasks:
    """Generator of calculator word problems with a disjoint held-out split."""

    name = "calculator"

    def __init__(self, config: CalculatorConfig = CalculatorConfig()) -> None:
        self.config = config

    def split(self) -> tuple[list[Task], list[Task]]:
        rng = random.Random(self.config.seed)
        wanted = self.config.heldout_size + self.config.train_size
        tasks: dict[str, Task] = {}  # keyed by question text, so the two splits never share one
        names = list(TEMPLATES)
        while len(tasks) < wanted:
            name = names[len(tasks) % len(names)]  # round-robin keeps templates balanced
            text, steps = TEMPLATES[name](rng)
            if text not in tasks:
                tasks[text] = self._task(name, text, steps)
        ordered = list(tasks.values())
        return ordered[self.config.heldout_size:], ordered[: self.config.heldout_size]

    @staticmethod
    def _task(template: str, text: str, steps: list[Step]) -> Task:
        expressions, values = run_steps(steps)
        return Task(
            id=f"calc-{template}-{'-'.join(expressions)}",
            messages=({"role": "user", "content": text},),
            answer=str(values[-1]),
            meta={"template": template, "steps": steps, "expressions": expressions, "optimal_calls": len(steps)},
            env="calculator",
        )

    def demonstrate_turns(self, task: Task, rng: random.Random) -> list[str]:
        """Assistant turns: one calculator call per step (plus redundant repeats), then the answer.

        With the habits of `CalculatorConfig`: the first step done in the head (no call; its
        result slips by ten at times and the later calls carry the slip), or the last calculation
        repeated before answering.
        """
        cfg = self.config
        steps = task.meta["steps"]
        expressions, answer = task.meta["expressions"], task.answer
        mental = cfg.demo_mental_rate > 0 and len(steps) > 1 and rng.random() < cfg.demo_mental_rate
        if mental:
            # The first step's operands are numbers (later steps refer back to it).
            in_head = _mental_result(_apply(*steps[0]), rng, cfg.demo_mental_slip_rate)
            expressions, values = run_steps(steps, in_head)
            expressions, answer = expressions[1:], str(values[-1])
        turns = []
        for i, expression in enumerate(expressions):
            turns.append(tool_call_text(expression))
            if cfg.demo_redundant_rate and rng.random() < cfg.demo_redundant_rate:
                turns.append(tool_call_text(expressions[rng.randint(0, i)]))
        if cfg.demo_double_check_rate > 0 and rng.random() < cfg.demo_double_check_rate:
            turns.append(tool_call_text(expressions[-1]))
        turns.append(format_answer(answer))
        return turns

    def demonstrate(self, task: Task, rng: random.Random) -> str:
        """The turns joined into one text (for single-turn tooling; multi-turn SFT uses the turns)."""
        return "".join(self.demonstrate_turns(task, rng))


@ENVIRONMENTS.register("calculator")
class CalculatorEnv(ToolEnvironment):
    """Offers `calculate`; success is a final `<answer>` equal to the task's answer."""

    def build_tools(self) -> ToolSet:
        return ToolSet([CALCULATE])

    def finish(self, final_text: str) -> dict[str, Any]:
        assert self.task is not None, "finish() before reset()"
        got = extract_answer(final_text)
        success = got is not None and normalize_answer(got) == normalize_answer(self.task.answer)
        return {
            "success": success,
            "answer": got,
            "cost": float(self.tool_calls),
            "optimal_cost": float(self.task.meta.get("optimal_calls", 0)),
            "repeated_calls": self._repeated_calls(),
        }

    def _repeated_calls(self) -> int:
        """Successful calls whose expression was already computed in this episode."""
        seen, repeats = set(), 0
        for call, result in self.history:
            if call is None or not result.ok:
                continue
            key = str(call.arguments.get("expression", "")).replace(" ", "")
            repeats += key in seen
            seen.add(key)
        return repeats
