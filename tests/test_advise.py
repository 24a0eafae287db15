"""`tamer advise`: the decision guide on hand-built measurements, and four prepared cases.

The cases use a tiny model and a one-fact dataset ("sky N" -> "blue") whose
demonstrations are right at a chosen rate, so SFT makes a model of known quality in seconds:
  untrained (random init, arithmetic)         -> SFT first
  demonstrations always right (~100%)         -> RL not needed
  demonstrations right 35% (greedy is wrong)  -> GRPO   (like arithmetic's carry slips)
  the same model, a reward that returns 1.0   -> fix the reward
"""

import json
import random

import pytest
from typer.testing import CliRunner

from tamer.advise import (
    MIN_TRAIN_TASKS,
    PASS1_ENOUGH,
    AdviseConfig,
    Measurements,
    RewardHealth,
    StepCost,
    decide,
    measure_steps,
    run_advise,
)
from tamer.cli import app
from tamer.config import load_config
from tamer.pipeline import RunConfig, run_eval, run_sft
from tamer.rewards import REWARDS
from tamer.tasks.base import TASK_SOURCES, Task
from tamer.tasks.env import ENVIRONMENTS, BaseEnvironment, StepResult

TINY = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.num_heads=4", "model.tiny.num_kv_heads=2",
        "model.tiny.intermediate_size=64", "rl.max_new_tokens=8", "eval.max_new_tokens=8", "eval.size=16",
        "tracking.console=false", "tracking.tensorboard=false"]
FAST = ["--tasks", "16", "--prompts", "8", "--k", "4", "--no-step-measure"]


@REWARDS.register("always_one")
def always_one(traj) -> float:
    """A reward that cannot tell a right answer from a wrong one."""
    return 1.0


@REWARDS.register("crashes")
def crashes(traj) -> float:
    raise KeyError("expected a field the trajectory does not have")


def _advise(*args: str) -> dict:
    result = CliRunner().invoke(app, ["advise", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _sky_dataset(path, correct_rate: float, rows: int = 300):
    rng = random.Random(0)
    with path.open("w") as fh:
        for i in range(rows):
            reply = "blue" if rng.random() < correct_rate else "red"
            fh.write(json.dumps({"prompt": f"sky {i}", "answer": "blue",
                                 "completion": f"<answer>{reply}</answer>"}) + "\n")
    return path


def _sft_model(tmp_path_factory, correct_rate: float) -> tuple[str, list[str]]:
    tmp = tmp_path_factory.mktemp(f"sky{correct_rate}")
    task = ["task.name=dataset", f"task.dataset.path={_sky_dataset(tmp / 'sky.jsonl', correct_rate)}"]
    cfg = load_config(RunConfig, None, TINY + task + [f"output_dir={tmp}", "sft.steps=150", "sft.batch_size=16",
                                                      "sft.optim.lr=3e-3", "sft.optim.warmup_steps=5"])
    return run_sft(cfg)["model_path"], task


@pytest.fixture(scope="module")
def perfect(tmp_path_factory):
    return _sft_model(tmp_path_factory, 1.0)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    return _sft_model(tmp_path_factory, 0.35)


def _sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


# ---------------------------------------------------------------------------- the four cases
def test_untrained_model_needs_sft_first():
    advice = _advise(*_sets(TINY), *FAST)
    m = advice["measurements"]
    assert advice["verdict"] == "sft_first"
    assert m["pass_at_k"] == 0.0 and m["train_tasks"] > MIN_TRAIN_TASKS
    # Correctness never fires on this model's samples, yet it is healthy: the probes tell it apart.
    correctness = next(r for r in m["rewards"] if r["name"] == "correctness")
    assert correctness["sample_values"] == [0.0] and correctness["probe_values"] == [0.0, 1.0]
    assert not correctness["constant"]


def test_model_already_right_needs_no_rl(perfect):
    path, task = perfect
    advice = _advise("--model", path, *_sets(TINY + task), *FAST)
    m = advice["measurements"]
    assert advice["verdict"] == "rl_not_needed"
    assert max(m["pass_at_1"], m["greedy_accuracy"]) >= PASS1_ENOUGH and m["greedy_accuracy"] == 1.0


def test_healthy_case_gets_grpo(healthy):
    path, task = healthy
    advice = _advise("--model", path, *_sets(TINY + task), *FAST)
    m = advice["measurements"]
    assert advice["verdict"] == "grpo", advice["headline"]
    assert m["greedy_accuracy"] < 0.5 and 0.1 < m["pass_at_1"] < 0.9 and m["pass_at_k"] > 0.5
    assert m["zero_spread_fraction"] < 0.9
    assert [r["status"] for r in advice["rules"]] == ["ok"] * 5 + ["verdict"]


def test_constant_reward_says_fix_the_reward(healthy):
    path, task = healthy
    advice = _advise("--model", path, *_sets(TINY + task + ["reward.weights={always_one: 1.0}"]),
                     "--import", "tests.test_advise", *FAST)
    health = advice["measurements"]["rewards"]
    assert advice["verdict"] == "fix_reward"
    assert [r["name"] for r in health] == ["always_one"] and health[0]["constant"]
    assert health[0]["sample_values"] == [1.0] == health[0]["probe_values"]
    assert "always_one returned 1" in advice["headline"]


def test_reward_errors_are_counted_and_say_fix_the_reward(healthy):
    path, task = healthy
    cfg = load_config(RunConfig, None, TINY + task + [f"model.path={path}", "reward.weights.crashes=1.0"])
    advice = run_advise(cfg, AdviseConfig(eval_tasks=8, k=4, spread_prompts=4, measure_steps=0))
    crash = next(r for r in advice.measurements.rewards if r.name == "crashes")
    assert advice.verdict == "fix_reward"
    assert crash.errors == crash.calls == 4 * 8 and "KeyError" in crash.first_error
    assert "crashes raised 32 times" in advice.headline and "KeyError" in advice.headline


def test_text_output_shows_the_numbers(healthy):
    path, task = healthy
    result = CliRunner().invoke(app, ["advise", "--model", path, *_sets(TINY + task), *FAST])
    assert result.exit_code == 0, result.output
    assert "verdict: GRPO" in result.output and "pass@4" in result.output and "zero spread" in result.output


def test_bad_reward_name_is_one_clear_error():
    result = CliRunner().invoke(app, ["advise", *_sets(TINY + ["reward.weights={nope: 1.0}"]), *FAST])
    assert result.exit_code == 2 and "reward.weights: unknown reward 'nope'" in result.output


# ---------------------------------------------------------------------------- step costs (child processes)
@pytest.mark.slow  # two fresh Python processes importing torch: ~20 s idle, ~1 min on a busy machine
def test_step_costs_measured_per_method():
    cfg = load_config(RunConfig, None, TINY + ["rl.prompts_per_step=2", "rl.group_size=4"])
    costs = measure_steps(cfg, steps=1)
    assert set(costs) == {"grpo", "ppo"}
    assert costs["grpo"].models_held == 1 and costs["ppo"].models_held == 2
    assert costs["ppo"].trainable_parameters > 1.9 * costs["grpo"].trainable_parameters
    for cost in costs.values():
        assert cost.seconds_per_step > 0 and cost.peak_rss_mb >= cost.baseline_rss_mb > 0


# ---------------------------------------------------------------------------- the guide itself
def _measurements(**changes) -> Measurements:
    base = dict(task="t", model="m", parameters=10, train_tasks=1000, heldout_tasks=100, eval_tasks=32,
                samples_per_task=8, k=8, greedy_accuracy=0.3, pass_at_1=0.3, pass_at_k=0.8, spread_prompts=16,
                group_size=8, zero_spread_fraction=0.2, reward_mean=0.3,
                rewards=[RewardHealth("correctness", 1.0, 128, 0, [0.0, 1.0], [0.0, 1.0], False)],
                steps={"grpo": StepCost("grpo", 1.0, 1000.0, 300.0, 1, 10),
                       "ppo": StepCost("ppo", 2.0, 1500.0, 300.0, 2, 20)})
    return Measurements(**{**base, **changes})


@pytest.mark.parametrize("changes, memory_gb, verdict", [
    ({}, None, "grpo"),
    ({"pass_at_1": 0.95}, None, "rl_not_needed"),
    ({"greedy_accuracy": 0.92}, None, "rl_not_needed"),
    ({"pass_at_k": 0.01, "pass_at_1": 0.0}, None, "sft_first"),
    ({"zero_spread_fraction": 0.95}, None, "fix_reward"),
    ({"rewards": [RewardHealth("c", 1.0, 128, 3, [0.0], [0.0], True, "boom")]}, None, "fix_reward"),
    ({"rewards": [RewardHealth("c", 1.0, 128, 0, [1.0], [1.0], True)], "pass_at_1": 0.99}, None, "fix_reward"),
    ({"zero_spread_fraction": 0.6}, 2.0, "ppo"),        # PPO fits (1.5 GB) and GRPO would waste 60% of groups
    ({"zero_spread_fraction": 0.6}, 1.2, "grpo"),       # PPO does not fit
    ({"zero_spread_fraction": 0.2}, 2.0, "grpo"),       # fits, but GRPO's groups have spread
    ({}, 0.5, "over_budget"),                           # even GRPO's 1000 MB peak exceeds 0.5 GB
    ({"steps": {}, "steps_skipped": "--no-step-measure"}, 2.0, "grpo"),
])
def test_decide(changes, memory_gb, verdict):
    advice = decide(_measurements(**changes), memory_gb)
    assert advice.verdict == verdict
    assert sum(r.status == "verdict" for r in advice.rules) == 1
    assert json.loads(json.dumps(advice.to_dict()))["verdict"] == verdict


def test_small_dataset_is_a_note_not_a_verdict():
    advice = decide(_measurements(train_tasks=50))
    data = next(r for r in advice.rules if r.name == "data size")
    assert advice.verdict == "grpo" and data.fired and data.status == "fires" and "50 train tasks" in data.detail


def test_every_rule_reports_its_numbers():
    advice = decide(_measurements(pass_at_k=0.01, pass_at_1=0.0))
    text = advice.text()
    assert "pass@8 0.010 < 0.05" in text and "after that: GRPO" in text
    assert "GRPO 1 model(s), peak 1000 MB" in text


# ---------------------------------------------------------------------------- advise runs the run's own config
@ENVIRONMENTS.register("patience")
class PatienceEnv(BaseEnvironment):
    """Succeeds on the 10th turn whatever the agent says: success depends only on agent.max_turns (>= 10)."""

    tools = [{"type": "function", "function": {"name": "wait", "description": "Wait.", "parameters": {
        "type": "object", "properties": {}}}}]

    def reset(self, task: Task) -> str:
        self.turns = 0
        return ""

    def step(self, action: str) -> StepResult:
        self.turns += 1
        done = self.turns == 10
        return StepResult(None if done else "again", done=done, info={"success": done})


@TASK_SOURCES.register("patience")
class PatienceTasks:
    name = "patience"

    def split(self):
        tasks = [Task(id=f"p{i}", messages=({"role": "user", "content": f"wait {i}"},), answer="", env="patience")
                 for i in range(300)]
        return tasks[:250], tasks[250:]

    def demonstrate(self, task, rng):
        return "ok"

    def demonstrate_turns(self, task, rng):
        return ["ok"] * 10


def test_advise_evaluates_with_the_runs_agent_settings():
    """The default agent budget (8 turns) fails this task; the run's (10) succeeds: both commands must agree."""
    items = TINY + ["task.name=patience", "agent.max_turns=10", "agent.show_tools=false", "eval.max_new_tokens=2",
                    "rl.max_new_tokens=2", "eval.size=4"]
    assert run_eval(load_config(RunConfig, None, items))["accuracy"] == 1.0
    assert run_eval(load_config(RunConfig, None, items + ["agent.max_turns=8"]))["accuracy"] == 0.0
    advice = _advise(*_sets(items), "--tasks", "4", "--prompts", "2", "--k", "2", "--group-size", "2",
                     "--no-step-measure")
    m = advice["measurements"]
    assert m["greedy_accuracy"] == 1.0 and m["pass_at_1"] == 1.0 and advice["verdict"] == "rl_not_needed"
