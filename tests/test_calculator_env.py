"""The built-in calculator task: safe evaluator, split, demonstrator replayed through the env."""

from __future__ import annotations

import random

import pytest

from tamer.tasks.base import TASK_SOURCES
from tamer.tasks.calculator import CalculatorConfig, CalculatorEnv, CalculatorTasks, calculate, tool_call_text
from tamer.tasks.env import ENVIRONMENTS

SMALL = CalculatorConfig(heldout_size=300, train_size=400)


@pytest.fixture(scope="module")
def split():
    return CalculatorTasks(SMALL).split()


@pytest.mark.parametrize("expression, value", [
    ("37*24-158", 730), ("(2+3)*4", 20), ("-5+2", -3), ("10/4", 2.5), ("888/4", 222),
    ("17//5", 3), ("17%5", 2), ("2**10", 1024), ("1.5*2", 3), (" 3 + 4 ", 7),
])
def test_calculate_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, needle", [
    ("__import__('os')", "function calls"),
    ("(1).real", "attributes"),
    ("().__class__", "attributes"),
    ("x+1", "names"),
    ("[1][0]", "indexing"),
    ("[1, 2]", "List"),
    ("True+1", "constant True"),
    ("'a'*3", "constant 'a'"),
    ("2**100000", "exponent too large"),
    ("9**9**9", "exponent too large"),
    ("99999**999", "result too large"),
    ("(-8)**0.5", "not a real number"),
    ("1e308*10", "not finite"),
    ("1+", "invalid expression"),
    ("1" * 300, "at most 200 characters"),
])
def test_calculate_rejects_unsafe_or_huge(expression, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        calculate(expression)


def test_registered_and_split_disjoint_deterministic(split):
    assert "calculator" in TASK_SOURCES and ENVIRONMENTS.get("calculator") is CalculatorEnv
    train, heldout = split
    assert len(heldout) == 300 and len(train) == 400
    assert not {t.id for t in train} & {t.id for t in heldout}
    assert not {t.messages[0]["content"] for t in train} & {t.messages[0]["content"] for t in heldout}
    again_train, again_heldout = CalculatorTasks(SMALL).split()
    assert ([t.id for t in again_heldout] == [t.id for t in heldout]
            and [t.id for t in again_train] == [t.id for t in train])
    assert all(t.env == "calculator" for t in train + heldout)
    assert {t.meta["template"] for t in heldout} == {"pens", "share", "tickets", "trees", "jars"}
    assert {t.meta["optimal_calls"] for t in heldout} == {2, 3}


def test_default_heldout_is_large_enough():
    assert CalculatorConfig().heldout_size >= 300
    with pytest.raises(ValueError, match="^demo_redundant_rate: expected a probability"):
        CalculatorConfig(demo_redundant_rate=1.5)


def test_demonstrations_replayed_through_env_succeed(split):
    source, rng = CalculatorTasks(SMALL), random.Random(0)
    env = CalculatorEnv()
    redundant = 0
    for task in split[1][:50]:
        turns = source.demonstrate_turns(task, rng)
        assert turns[-1] == f"<answer>{task.answer}</answer>"
        assert all(t.startswith('<tool_call>{"name":"calculate","arguments":{"expression":"') for t in turns[:-1])
        assert " " not in "".join(turns[:-1])  # compact JSON for the character-level models
        env.reset(task)
        for turn in turns[:-1]:
            result = env.step(turn)
            assert not result.done and result.observation.startswith("<tool_response>")
            assert "error" not in result.observation
        final = env.step(turns[-1])
        assert final.done and final.info["success"], (task.id, turns)
        assert final.info["cost"] == len(turns) - 1 >= final.info["optimal_cost"]
        assert final.info["repeated_calls"] == len(turns) - 1 - task.meta["optimal_calls"]
        assert final.info["tool_errors"] == {}
        redundant += final.info["repeated_calls"]
    assert redundant > 0  # the demonstrator is wasteful some of the time
    assert source.demonstrate(task, random.Random(1)).endswith(f"<answer>{task.answer}</answer>")


def test_demonstrator_habits_first_step_in_the_head_and_double_check(split):
    """The habits SFT copies: the first step done in the head (its slip carried through the later
    calls into a wrong answer, which the env scores as a failure) and the last call repeated."""
    tasks = split[1][:40]
    always_slips = CalculatorTasks(CalculatorConfig(heldout_size=300, train_size=400, demo_redundant_rate=0.0,
                                                    demo_mental_rate=1.0, demo_mental_slip_rate=1.0))
    env, rng, wrong = CalculatorEnv(), random.Random(0), 0
    for task in tasks:
        turns = always_slips.demonstrate_turns(task, rng)
        calls = turns[:-1]
        assert len(calls) == task.meta["optimal_calls"] - 1  # no call for the first step
        assert tool_call_text(task.meta["expressions"][0]) not in calls
        env.reset(task)
        for turn in calls:
            assert "error" not in env.step(turn).observation
        last_result = env.step(calls[-1]).observation  # the demonstrator answers its last result
        answer = turns[-1].removeprefix("<answer>").removesuffix("</answer>")
        assert last_result == f"<tool_response>{answer}</tool_response>"
        env.reset(task)
        for turn in calls:
            env.step(turn)
        final = env.step(turns[-1])
        wrong += not final.info["success"]
    assert wrong >= len(tasks) // 2  # a slip in the first step usually survives to the answer
    checks = CalculatorTasks(CalculatorConfig(heldout_size=300, train_size=400, demo_redundant_rate=0.0,
                                              demo_double_check_rate=1.0))
    for task in tasks:
        turns = checks.demonstrate_turns(task, rng)
        assert turns[-3] == turns[-2] == tool_call_text(task.meta["expressions"][-1])
        assert len(turns) == task.meta["optimal_calls"] + 2 and turns[-1] == f"<answer>{task.answer}</answer>"


def test_env_wrong_answer_and_tool_errors(split):
    task = split[1][0]
    env = CalculatorEnv()
    env.reset(task)
    assert [s["function"]["name"] for s in env.tools] == ["calculate"]
    bad = env.step(tool_call_text("__import__('os').system('true')"))
    assert bad.observation == ("<tool_response>error: ValueError: unsupported syntax: function calls; "
                               "use numbers, + - * / // % ** and parentheses</tool_response>")
    assert bad.info["tool_errors"] == {"tool_raised": 1}
    zero = env.step(tool_call_text("1/0"))
    assert zero.observation == "<tool_response>error: ZeroDivisionError: division by zero</tool_response>"
    final = env.step("I think it is <answer>-1</answer>")
    assert final.done and final.info["success"] is False and final.info["answer"] == "-1"
    env.reset(task)
    assert env.step("no answer at all").info["success"] is False


def test_tool_schemas_render_in_the_chat_template(tokenizer, split):
    task, env = split[1][0], CalculatorEnv()
    env.reset(task)
    prompt = tokenizer.apply_chat_template(list(task.messages), tools=env.tools, tokenize=False,
                                           add_generation_prompt=True)
    assert '"name": "calculate"' in prompt and task.messages[0]["content"] in prompt
    turn = tool_call_text(task.meta["expressions"][0])
    ids = tokenizer(turn, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == turn and len(ids) == len(turn) - len("<tool_call></tool_call>") + 2
