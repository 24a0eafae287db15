"""The units task (hidden preference rule), its labeller, and the RLHF demo end to end (tiny settings)."""

import json
import random

import pytest
from typer.testing import CliRunner

from tamer.cli import app, load_run_config
from tamer.config import ConfigError
from tamer.rewards import REWARDS, correctness
from tamer.rollout.types import Trajectory
from tamer.tasks import TaskConfig, UnitsConfig, UnitsTasks, get_task_source
from tamer.tasks.units import follows_rule, states_a_unit


def _traj(task, text):
    return Trajectory(task=task, group_id=0, prompt_ids=[], completion_ids=[], loss_mask=[], logprobs=[], text=text)


def test_units_task_checks_the_number_and_hides_the_rule():
    train, heldout = get_task_source(TaskConfig(name="units")).split()
    assert len(heldout) == 150 and len(train) == 9 * 9 * 8 - 150
    assert not {t.id for t in train} & {t.id for t in heldout}
    task = next(t for t in train if t.id == "7kg+5kg")
    assert task.messages[0]["content"] == "7 kg + 5 kg" and task.answer == "12"
    cases = {"<answer>12</answer><|im_end|>": (1.0, 0.0, False), "<answer>12 kg</answer>": (1.0, 1.0, True),
             "<answer>12 L</answer>": (1.0, 0.0, True), "<answer>13 kg</answer>": (0.0, 0.0, True),
             "<answer>12 kg kg</answer>": (0.0, 0.0, False), "12 kg": (0.0, 0.0, False)}
    for text, (number, rule, unit) in cases.items():
        traj = _traj(task, text)
        assert (correctness(traj), REWARDS.get("units_rule")(traj), states_a_unit(text)) == (number, rule, unit), text


def test_demonstrator_rarely_states_the_unit():
    source = UnitsTasks(UnitsConfig(demo_unit_rate=0.2))
    train, _ = source.split()
    rng = random.Random(0)
    demos = [(t, source.demonstrate(t, rng)) for t in train]
    rate = sum(follows_rule(d, t) for t, d in demos) / len(demos)
    assert 0.15 < rate < 0.25
    assert all(correctness(_traj(t, d)) == 1.0 for t, d in demos)  # always the right number


def test_labeller_prefers_the_hidden_rule_and_never_writes_a_wrong_unit():
    source = UnitsTasks()
    train, _ = source.split()
    pairs = source.preference_pairs(train, 400, seed=3)
    assert pairs == source.preference_pairs(train, 400, seed=3)  # deterministic
    by_id = {t.id: t for t in train}
    kinds = set()
    for p in pairs:
        task = by_id[p.source.removeprefix("units:")]
        assert follows_rule(p.chosen, task) and not follows_rule(p.rejected, task)
        unit = f" {task.meta['unit']}</answer>"
        assert not states_a_unit(p.rejected) or p.rejected.endswith(unit)
        kinds.add((correctness(_traj(task, p.rejected)) == 1.0, states_a_unit(p.rejected)))
    assert kinds == {(True, False), (False, True), (False, False)}  # right-no-unit, wrong-with-unit, wrong-no-unit


def test_demo_config_layers_and_errors(tmp_path):
    run = load_run_config(None, ["preference.kl_coef=0.3", "rl.steps=7"], preset="demo-preference")
    assert run.task.name == "units" and run.rl.steps == 7 and run.preference.kl_coef == 0.3
    user = tmp_path / "mine.yaml"
    user.write_text("rl: {steps: 9}\npreference: {variants: [ppo]}\n")
    run = load_run_config([str(user)], [], preset="demo-preference")
    assert run.rl.steps == 9 and run.preference.variants == ("ppo",) and run.sft.steps > 1  # the preset's other fields
    with pytest.raises(ConfigError, match="preference.variants: unknown variant 'dpo'"):
        load_run_config(None, ["preference.variants=[dpo]"], preset="demo-preference")
    with pytest.raises(ConfigError, match="preference.pairs: unknown field"):
        load_run_config(None, ["preference.pairs=3"], preset="demo-preference")


TINY = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
        "sft.steps=30", "sft.batch_size=16", "rm.steps=10", "rm.batch_size=8", "rm.eval_every=5",
        "rl.steps=2", "rl.prompts_per_step=4", "rl.group_size=4", "rl.max_new_tokens=8", "rl.eval_every=1",
        "eval.size=8", "eval.max_new_tokens=8", "tracking.tensorboard=false", "tracking.console=false",
        "preference.train_pairs=64", "preference.heldout_pairs=16", "preference.kl_samples=4"]


def test_preference_demo_end_to_end_tiny(tmp_path):
    args = ["demo", "--env", "preference", "-o", str(tmp_path)] + [a for s in TINY for a in ("--set", s)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "grpo_kl curve" in result.output and "reward model: held-out pair accuracy" in result.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["runs"]) == {"grpo", "grpo_kl", "ppo"}
    for run in summary["runs"].values():
        assert [p["step"] for p in run["curve"]] == [0, 1, 2] and run["reward_errors"] == 0
        assert run["curve"][0] == summary["sft"]  # every variant starts from the same SFT model
        assert abs(run["curve"][0]["kl_to_sft"]) < 1e-4  # KL of the SFT model to itself
        assert (len(run["examples"]) == 6
                and (tmp_path / run["model_path"].split(str(tmp_path))[-1].lstrip("/")).is_dir())
    assert summary["rm"]["heldout_pairs"] == 16 and (tmp_path / "rlhf.png").is_file()
    assert len(summary["rm"]["probe"]) == 8 and "prompt" in summary["rm"]["probe"]  # the prompt and 7 replies
    assert len((tmp_path / "preferences.jsonl").read_text().splitlines()) == 64
    assert (tmp_path / "rm" / "model" / "config.json").is_file()
