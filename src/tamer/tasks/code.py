"""Built-in `code` task: write a function from its signature; the reward is the share of hidden tests passed.

    source = CodeTasks(CodeConfig())                # 41 built-in problems; or CodeConfig(source="mine.jsonl")
    train, heldout = source.split()
    train[0].messages[0]["content"]                 # the signature and docstring, "reply in a ```python block"
    source.demonstrate(train[0], rng)               # the reference solution in a ```python block
    with source.reward() as reward:                 # UnitTestReward: completions checked on a SandboxPool
        reward.score_batch(trajectories)

Reward with `unit_tests` (in `tamer.rewards.REWARDS`): the fraction of the task's hidden tests
that the completion's code passes; how it is checked, and what it cannot stop, is in
tamer/tasks/code_check.py. Tasks keep in `meta` the `entry_point`, the hidden `tests` (each
counted on its own), the reference `solution` and the sandbox `timeout_s`.

User problems (`CodeConfig(source="mine.jsonl")`), one JSON object per line:

    {"signature": "def add(a: int, b: int) -> int:", "description": "Return a + b.", "entry_point": "add",
     "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"], "solution": "def add(a, b):\\n    return a + b\\n"}

`prompt` may replace `signature` and `description` (it is used verbatim as the user message);
`tests` may be one string, a test snippet whose top-level asserts each count (with the statements
before them as their setup); `solution` (needed only to demonstrate) and `id` are optional. A
malformed row raises `DatasetError` naming the file and the row, before any training starts.

This module also registers the `python` environment: the sandboxed `python` tool
(tamer.tools.python_tool) for tasks answered with a final <answer>. It lives here rather than
in tamer/tools because environments import tools, not the other way round.
"""

from __future__ import annotations

import ast
import dataclasses
import random
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tamer.tasks.base import TASK_SOURCES, Task
from tamer.tasks.code_check import UnitTestReward
from tamer.tasks.code_config import CodeConfig
from tamer.tasks.code_problems import PROBLEMS
from tamer.tasks.dataset import DatasetError, iter_jsonl
from tamer.tasks.env import ENVIRONMENTS
from tamer.tasks.tool_env import ToolEnvironment
from tamer.tools.python_tool import TOOL_SANDBOX, make_python_tool
from tamer.tools.schema import ToolSet

PROMPT = ('Write this Python function:\n\n{signature}\n    """{description}"""\n\n'
          "Reply with the complete function in a ```python code block.")


@dataclass(frozen=True)
class Problem:
    """One problem, as read from a row (built in or the user's)."""

    id: str
    prompt: str  # the user message
    entry_point: str  # the function the tests call
    tests: tuple[str, ...]  # each one counted on its own
    solution: str | None = None  # a reference that passes every test


# ---------------------------------------------------------------- problems: built in or from JSONL


def load_problems(path: str | Path) -> list[Problem]:
    """Problems from a JSONL file; a malformed row raises DatasetError naming the file and row."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    problems: list[Problem] = []
    seen: set[str] = set()
    for number, row in iter_jsonl(path):
        problem = parse_problem(row, f"{path}, row {number}", f"{path.name}:{number}")
        if problem.id in seen:
            raise DatasetError(f"{path}, row {number}: duplicate id {problem.id!r}")
        seen.add(problem.id)
        problems.append(problem)
    if not problems:
        raise DatasetError(f"{path}: no problems in the file")
    return problems


def parse_problem(row: Any, where: str, default_id: str) -> Problem:
    """One row (a dict) as a Problem; `where` ("file, row N") starts every error message."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    entry_point = row.get("entry_point")
    if not isinstance(entry_point, str) or not entry_point.isidentifier():
        raise DatasetError(f"{where}: 'entry_point' must name the function to test, got {entry_point!r}")
    solution = row.get("solution")
    if solution is not None:
        if not isinstance(solution, str) or not solution.strip():
            raise DatasetError(f"{where}: 'solution' must be Python source text")
        _check_syntax(solution, where, "solution")
    return Problem(str(row.get("id", default_id)), _prompt(row, where), entry_point,
                   _tests(row.get("tests"), where), solution)


def _prompt(row: dict, where: str) -> str:
    if row.get("prompt") is not None:
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise DatasetError(f"{where}: 'prompt' must be non-empty text")
        return row["prompt"]
    signature, description = row.get("signature"), row.get("description", "")
    if not isinstance(signature, str) or not signature.strip():
        raise DatasetError(f"{where}: give 'prompt', or 'signature' and 'description'")
    if not isinstance(description, str):
        raise DatasetError(f"{where}: 'description' must be text")
    body = textwrap.indent(description.strip(), "    ").lstrip()
    return PROMPT.format(signature=signature.strip(), description=body)


def _tests(value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, str) and value.strip():
        tests = split_snippet(value, where)
    elif isinstance(value, list) and value and all(isinstance(t, str) and t.strip() for t in value):
        tests = tuple(value)
    else:
        raise DatasetError(f"{where}: 'tests' must be a non-empty list of assert statements, or one test snippet")
    for i, test in enumerate(tests):
        _check_syntax(test, where, f"tests[{i}]")
    return tests


def split_snippet(snippet: str, where: str = "tests") -> tuple[str, ...]:
    """One test per top-level assert, each with the statements since the previous one as its
    setup; a snippet without top-level asserts (e.g. `def check(): ...; check()`) is one test."""
    tree = _check_syntax(snippet, where, "tests")
    lines = snippet.splitlines(keepends=True)
    ends = [node.end_lineno for node in tree.body if isinstance(node, ast.Assert)]
    if not ends:
        return (snippet,)
    starts = [0] + ends[:-1]
    ends[-1] = len(lines)  # whatever follows the last assert belongs to it
    return tuple("".join(lines[start:end]) for start, end in zip(starts, ends))


def _check_syntax(source: str, where: str, field_name: str) -> ast.Module:
    try:
        return ast.parse(source)
    except SyntaxError as err:
        raise DatasetError(f"{where}: {field_name!r} is not valid Python (line {err.lineno}: {err.msg})") from None


def builtin_problems() -> list[Problem]:
    return [parse_problem(row, f"built-in problem {row['entry_point']}", row["entry_point"]) for row in PROBLEMS]


# --------------------------------------------------------------------------------- the task source


@TASK_SOURCES.register("code")
class CodeTasks:
    """Function-writing problems (built in or yours) with a disjoint held-out split."""

    name = "code"

    def __init__(self, config: CodeConfig = CodeConfig()) -> None:
        self.config = config

    def problems(self) -> list[Problem]:
        return builtin_problems() if self.config.source == "builtin" else load_problems(self.config.source)

    def split(self) -> tuple[list[Task], list[Task]]:
        tasks = [self._task(p) for p in self.problems()]
        order = list(range(len(tasks)))
        random.Random(self.config.seed).shuffle(order)
        n_held = max(1, round(len(tasks) * self.config.heldout_fraction))
        if n_held >= len(tasks):
            raise DatasetError(f"{self.config.source}: {len(tasks)} problems are too few to hold some out")
        return [tasks[i] for i in order[n_held:]], [tasks[i] for i in order[:n_held]]

    def _task(self, problem: Problem) -> Task:
        meta = {"entry_point": problem.entry_point, "tests": list(problem.tests), "solution": problem.solution,
                "timeout_s": self.config.timeout_s, "check": "unit_tests"}
        return Task(id=f"code-{problem.id}", messages=({"role": "user", "content": problem.prompt},),
                    answer=problem.solution or "", meta=meta)

    def demonstrate(self, task: Task, rng: random.Random) -> str:
        """The reference solution in a ```python block; with probability `demo_mutation_rate` an
        off-by-one variant (a constant +1, or < and <= swapped), for RL to improve on."""
        solution = task.meta.get("solution")
        if not solution:
            raise DatasetError(f"task {task.id}: no reference 'solution' to demonstrate")
        if rng.random() < self.config.demo_mutation_rate:
            solution = mutate(solution, rng)
        return fenced(solution)

    def reward(self) -> UnitTestReward:
        """A pooled `unit_tests` reward sized by this config (close it, or use it as a context manager)."""
        return UnitTestReward(self.config.max_workers or None, timeout_s=self.config.timeout_s)


def fenced(code: str) -> str:
    return f"```python\n{code.rstrip()}\n```"


_SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}


def mutate(code: str, rng: random.Random) -> str:
    """One off-by-one change: an int constant +1, or a comparison's strictness flipped."""
    tree = ast.parse(code)
    sites: list[tuple[ast.AST, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            sites.append((node, -1))
        elif isinstance(node, ast.Compare):
            sites += [(node, i) for i, op in enumerate(node.ops) if type(op) in _SWAPS]
    if not sites:
        return code
    node, index = rng.choice(sites)
    if index < 0:
        node.value += 1
    else:
        node.ops[index] = _SWAPS[type(node.ops[index])]()
    return ast.unparse(tree) + "\n"


# ------------------------------------------------------------------------ the `python` environment


@ENVIRONMENTS.register("python")
class PythonEnv(ToolEnvironment):
    """Offers the sandboxed `python` tool; success is a final <answer> equal to the task's answer."""

    def build_tools(self) -> ToolSet:
        # The sandbox's deadline falls inside the executor's, so a slow program's partial output
        # still reaches the agent instead of a bare "timed out".
        timeout = min(TOOL_SANDBOX.timeout_s, 0.6 * self.config.tool_timeout_s)
        config = dataclasses.replace(TOOL_SANDBOX, timeout_s=timeout)
        return ToolSet([make_python_tool(config, max(100, self.config.max_result_chars))])
