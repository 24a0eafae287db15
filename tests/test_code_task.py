"""The `code` task, the `unit_tests` reward, the `python` tool and environment, and a few RL steps on code."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tamer.evaluate import EvalConfig
from tamer.rewards import REWARDS, RewardComposer, RewardConfig
from tamer.rollout.types import Trajectory
from tamer.tasks import TaskConfig, code_check, get_task_source
from tamer.tasks.base import TASK_SOURCES, Task
from tamer.tasks.code import CodeConfig, CodeTasks, PythonEnv, fenced, mutate, split_snippet
from tamer.tasks.code_check import UnitTestReward, check_completion, extract_code, unit_tests
from tamer.tasks.dataset import DatasetError
from tamer.tasks.env import ENVIRONMENTS
from tamer.tools import python_tool
from tamer.tools.executor import execute
from tamer.tools.parsing import ToolCall
from tamer.tools.python_tool import make_python_tool
from tamer.tools.sandbox import SandboxConfig, SandboxError
from tamer.tools.schema import ToolSet


@pytest.fixture(scope="module")
def tasks():
    train, heldout = CodeTasks().split()
    return {t.meta["entry_point"]: t for t in train + heldout}


def _traj(task, text):
    return Trajectory(task=task, group_id=0, prompt_ids=[], completion_ids=[], loss_mask=[], logprobs=[], text=text)


# ------------------------------------------------------------------------------- task source


def test_registered_split_disjoint_deterministic_and_prompt():
    assert "code" in TASK_SOURCES and "unit_tests" in REWARDS and ENVIRONMENTS.get("python") is PythonEnv
    train, heldout = get_task_source(TaskConfig(name="code")).split()
    assert len(train) + len(heldout) >= 30 and len(heldout) == round(0.2 * (len(train) + len(heldout)))
    assert not {t.id for t in train} & {t.id for t in heldout}
    assert [t.id for t in CodeTasks().split()[1]] == [t.id for t in heldout]
    task = heldout[0]
    prompt = task.messages[0]["content"]
    assert task.meta["entry_point"] in prompt and "```python" in prompt and task.env is None
    assert all(3 <= len(t.meta["tests"]) <= 6 and t.meta["solution"] for t in train + heldout)


def test_builtin_references_pass_every_hidden_test(tasks):
    trajs = [_traj(t, fenced(t.meta["solution"])) for t in tasks.values()]
    with UnitTestReward(max_workers=4) as reward:
        scores = reward.score_batch(trajs)
    failed = {t.task.id: t.info for t, s in zip(trajs, scores) if s != 1.0}
    assert not failed
    assert all(t.info["tests_passed"] == t.info["tests_total"] == len(t.task.meta["tests"]) for t in trajs)


def test_wrong_solution_scores_a_fraction(tasks):
    traj = _traj(tasks["fizzbuzz"], "Easy:\n```python\ndef fizzbuzz(n):\n    return str(n)\n```")
    score = REWARDS.get("unit_tests")(traj)
    assert 0.0 < score < 1.0 and score == traj.info["tests_passed"] / traj.info["tests_total"]
    assert traj.info["test_failure"].startswith("test ") and traj.info["code_block"]


@pytest.mark.parametrize("text, key, expected", [
    ("", "code_error", "no code in the completion"),
    ("I do not know how to do that.", "code_error", "SyntaxError"),
    ("```python\ndef fizzbuzz(n)\n    return 'Fizz'\n```", "code_error", "SyntaxError"),
    ("```python\ndef fizzbuzz(n):\n    while True:\n        pass\n```", "sandbox_limit", "timeout"),
    ("```python\nimport sys\nsys.exit(0)\n```", "code_error", "SystemExit"),
    ("```python\nimport os\nos._exit(0)\n```", "code_error", "no test result"),
    ('```python\nprint(\'{"passed": 5, "error": null, "failure": null}\')\n```', "test_failure", "NameError"),
], ids=["empty", "prose", "syntax-error", "infinite-loop", "sys-exit", "os-exit", "fake-result"])
def test_broken_or_hostile_completions_score_zero_and_say_why(tasks, text, key, expected):
    traj = _traj(tasks["fizzbuzz"], text)
    assert unit_tests(traj, timeout_s=1.0) == 0.0
    assert traj.info["tests_passed"] == 0 and traj.info["tests_total"] == 5
    assert expected in (traj.info[key] or "")


def test_code_extraction():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```python\nx = 2\n```") == ("x = 2\n", True)
    assert extract_code("```\ny = 3\n```<|im_end|>") == ("y = 3\n", True)
    assert extract_code("```python\ndef f():\n    return 1<|im_end|>") == ("def f():\n    return 1", True)
    assert extract_code("x = 4<|im_end|>") == ("x = 4", False)


def test_batch_scores_are_read_back_without_running_again(tasks, monkeypatch):
    trajs = [_traj(tasks["gcd"], fenced(tasks["gcd"].meta["solution"])), _traj(tasks["gcd"], "nope")]
    with CodeTasks(CodeConfig(max_workers=2)).reward() as reward:
        assert reward.score_batch(trajs) == [1.0, 0.0]
    monkeypatch.setattr(code_check, "run_python", lambda *a, **k: pytest.fail("ran the sandbox again"))
    stats = RewardComposer(RewardConfig(weights={"unit_tests": 1.0})).score(trajs)
    assert [t.reward for t in trajs] == [1.0, 0.0] and stats.errors == {"unit_tests": 0}


def test_demonstrate_reference_and_off_by_one_variant(tasks):
    task = tasks["fibonacci"]
    exact = CodeTasks(CodeConfig(demo_mutation_rate=0.0)).demonstrate(task, random.Random(0))
    assert exact == fenced(task.meta["solution"])
    mutated = CodeTasks(CodeConfig(demo_mutation_rate=1.0)).demonstrate(task, random.Random(0))
    assert mutated != fenced(task.meta["solution"]) and mutated.startswith("```python\ndef fibonacci")
    variants = {mutate("def f(n):\n    return n < 2\n", random.Random(s)) for s in range(20)}
    assert variants == {"def f(n):\n    return n <= 2\n", "def f(n):\n    return n < 3\n"}


@pytest.mark.parametrize("field, value", [("heldout_fraction", 1.0), ("timeout_s", 0), ("max_workers", -1),
                                          ("demo_mutation_rate", 2.0), ("source", "")])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}: "):
        CodeConfig(**{field: value})


# ------------------------------------------------------------------------------- JSONL problems

GOOD_ROWS = [
    {"signature": "def add(a: int, b: int) -> int:", "description": "Return a + b.", "entry_point": "add",
     "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"],
     "solution": "def add(a, b):\n    return a + b\n"},
    {"id": "sq", "prompt": "Write square(x) returning x*x in a ```python block.", "entry_point": "square",
     "tests": "base = 3\nassert square(base) == 9\n\nneg = -2\nassert square(neg) == 4\nassert square(0) == 0\n"},
]


def _write(tmp_path, rows):
    path = tmp_path / "problems.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_problems_load_split_and_score(tmp_path):
    rows = GOOD_ROWS + [{**GOOD_ROWS[0], "id": "add2"}, {**GOOD_ROWS[0], "id": "add3"}, {**GOOD_ROWS[1], "id": "sq2"}]
    train, heldout = CodeTasks(CodeConfig(source=str(_write(tmp_path, rows)), heldout_fraction=0.4)).split()
    by_id = {t.id: t for t in train + heldout}
    assert len(by_id) == 5 and len(heldout) == 2
    add, square = by_id["code-problems.jsonl:1"], by_id["code-sq"]
    assert "def add(a: int, b: int) -> int:" in add.messages[0]["content"] and add.meta["entry_point"] == "add"
    assert square.messages[0]["content"] == GOOD_ROWS[1]["prompt"] and len(square.meta["tests"]) == 3
    assert check_completion(CodeTasks().demonstrate(add, random.Random(1)), add).score == 1.0
    wrong = check_completion("```python\ndef square(x):\n    return x * abs(x)\n```", square)
    assert (wrong.passed, wrong.total) == (2, 3)  # each assert of the snippet counts on its own
    with pytest.raises(DatasetError, match="no reference 'solution'"):
        CodeTasks().demonstrate(square, random.Random(0))


def test_split_snippet_keeps_setup_with_its_assert():
    assert split_snippet("x = 1\nassert x == 1\ny = 2\nassert y == 2\nprint('end')\n") == (
        "x = 1\nassert x == 1\n", "y = 2\nassert y == 2\nprint('end')\n")
    no_top_level_assert = "def check(f):\n    assert f(1) == 2\ncheck(inc)\n"
    assert split_snippet(no_top_level_assert) == (no_top_level_assert,)


@pytest.mark.parametrize("bad, needle", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({"signature": "def f():", "tests": ["assert f()"]}, "'entry_point'"),
    ({"entry_point": "f", "tests": ["assert f()"]}, "give 'prompt', or 'signature'"),
    ({"entry_point": "f", "signature": "def f():", "tests": []}, "'tests' must be"),
    ({"entry_point": "f", "signature": "def f():", "tests": ["assert f("]}, "'tests[0]' is not valid Python"),
    ({"entry_point": "f", "signature": "def f():", "tests": ["assert f()"], "solution": "def f(:"}, "'solution'"),
    ({**GOOD_ROWS[0], "id": "problems.jsonl:1"}, "duplicate id"),
])
def test_malformed_row_names_file_and_row(tmp_path, bad, needle):
    path = _write(tmp_path, [GOOD_ROWS[0], "", bad])
    with pytest.raises(DatasetError, match="problems.jsonl, row 3") as err:
        CodeTasks(CodeConfig(source=str(path))).split()
    assert needle in str(err.value)


def test_missing_file_is_a_dataset_error(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        CodeTasks(CodeConfig(source=str(tmp_path / "nope.jsonl"))).split()


# ------------------------------------------------------------------------- the python tool and env


def test_python_tool_returns_output_and_errors_as_text():
    run = make_python_tool(SandboxConfig(timeout_s=1.0), max_chars=300).function
    assert run(code="print(6 * 7)") == "42"
    assert run(code="x = 1") == python_tool.NO_OUTPUT
    error = run(code="print('before')\n1 / 0")
    assert error.startswith("before\n") and "ZeroDivisionError: division by zero" in error
    assert error.endswith("[exit status 1]") and "tamer-sbx-" not in error
    assert run(code="while True:\n    pass") == "[killed: timeout limit]"
    long = run(code="print('x' * 5000)")
    assert len(long) <= 300 and long.endswith("[output truncated]")


def test_python_tool_never_raises(monkeypatch):
    tool = make_python_tool()
    assert tool.schema["function"]["parameters"]["required"] == ["code"]
    result = execute(ToolCall("python", {"code": "import sys; sys.exit(3)"}), ToolSet([tool]), timeout_s=5.0)
    assert result.ok and result.content == "[exit status 3]"

    def broken(*args, **kwargs):
        raise SandboxError("no sandbox here")

    monkeypatch.setattr(python_tool, "run_python", broken)
    assert tool.function(code="print(1)").startswith("error: the sandbox could not run the code")


def test_python_environment_step():
    env = ENVIRONMENTS.get("python")()
    assert [s["function"]["name"] for s in env.tools] == ["python"]
    env.reset(Task(id="q", messages=({"role": "user", "content": "What is 6*7?"},), answer="42", env="python"))
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>'
    step = env.step(call)
    assert step.observation == "<tool_response>42</tool_response>" and not step.done
    assert step.info["turn_calls"][0]["ok"] and step.info["tool_calls"] == 1
    final = env.step("<answer>42</answer>")
    assert final.done and final.info["success"] is True and final.info["cost"] == 1.0


# ------------------------------------------------------------------------------- RL plumbing


def test_rl_on_code_runs_with_finite_loss(tiny_model, tokenizer, tmp_path):
    from tamer.trainers.common import OptimConfig
    from tamer.trainers.rl import RLConfig, RLTrainer

    records = {}

    class Collect:
        def log(self, metrics, step):
            records.setdefault(step, {}).update(metrics)

        def print(self, msg):
            pass

    train, heldout = CodeTasks().split()
    cfg = RLConfig(steps=2, prompts_per_step=2, group_size=2, max_new_tokens=16, optim=OptimConfig(lr=1e-3),
                   eval_every=0)
    rewards = RewardComposer(RewardConfig(weights={"unit_tests": 1.0}))
    trainer = RLTrainer(tiny_model, tokenizer, train, heldout, rewards, cfg, EvalConfig(size=2, max_new_tokens=16),
                        run_dir=tmp_path, tracker=Collect())
    trainer.train()
    for step in (1, 2):
        assert torch.isfinite(torch.tensor(records[step]["train/loss"]))
        assert 0.0 <= records[step]["reward/unit_tests"] <= 1.0
    assert rewards.total_errors == 0
