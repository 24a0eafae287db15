"""Saved rollouts: what a training step writes, strict JSON, token texts, gaps and advantages, resume."""

from __future__ import annotations

import io
import json
import random

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from tamer.cli import app
from tamer.evaluate import EvalConfig
from tamer.models import save_model
from tamer.rewards import RewardComposer, RewardConfig
from tamer.rollout.agent import AgentConfig, AgentRollout
from tamer.rollout_log import (
    RolloutLogConfig,
    TokenTexts,
    dumps,
    logprob_gaps,
    per_row_advantage,
    read_rollouts,
    select_groups,
    trajectory_record,
)
from tamer.tasks import ArithmeticTasks, TaskConfig, get_task_source
from tamer.tracking import Tracker, read_metrics
from tamer.trainers.common import OptimConfig
from tamer.trainers.rl import RLConfig, RLTrainer
from tamer.transcripts import episode_panel


def _train(model, tokenizer, run_dir, rollout_log, steps=3, append=False, resume_from=None):
    cfg = RLConfig(steps=steps, prompts_per_step=4, group_size=4, max_new_tokens=8, optim=OptimConfig(lr=1e-3),
                   eval_every=2, checkpoint_every=2)
    train, held = ArithmeticTasks().split()
    rewards = RewardComposer(RewardConfig(weights={"correctness": 1.0, "length": 1.0},
                                          params={"length": {"max_tokens": 8}}))
    with Tracker(run_dir, console=False, tensorboard=False, append=append) as tracker:
        trainer = RLTrainer(model, tokenizer, train, held, rewards, cfg, EvalConfig(size=5, max_new_tokens=8),
                            run_dir=run_dir, tracker=tracker, rollout_log=rollout_log)
        if resume_from is not None:
            tracker.truncate_after(trainer.resume(resume_from))
        trainer.train()
    return read_metrics(run_dir)


def test_training_step_saves_sampled_groups_and_evals_without_changing_training(tokenizer, tmp_path):
    from tamer.models import build_tiny_model
    from tests.conftest import TINY

    logged = _train(build_tiny_model(tokenizer, TINY), tokenizer, tmp_path / "on", RolloutLogConfig(groups_per_step=2))
    plain = _train(build_tiny_model(tokenizer, TINY), tokenizer, tmp_path / "off", None)
    for a, b in zip(logged, plain):  # recording draws no random numbers and changes no weights
        for key in ("reward/mean", "train/loss", "train/grad_norm", "eval/accuracy"):
            assert a.get(key) == b.get(key), key
    assert not (tmp_path / "off" / "rollouts.jsonl").exists()
    records = read_rollouts(tmp_path / "on")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1] * 8 + [2] * 8 + [3] * 8
    for step in (1, 2, 3):
        groups = {r["group"] for r in train if r["step"] == step}
        assert groups == select_groups(list(range(4)), 2, seed=0, step=step) and len(groups) == 2
        for g in groups:
            assert sorted(r["sample"] for r in train if r["step"] == step and r["group"] == g) == [0, 1, 2, 3]
    evals = [r for r in records if r["kind"] == "eval"]
    assert sorted({r["step"] for r in evals}) == [0, 2, 3] and len(evals) == 3 * 5  # start, every 2, the end
    assert all(r["advantage"] is None and r["logprob_gap"] is None for r in evals)
    assert all(r["logprob_gap"] < 1e-4 for r in train)  # one fp32 module samples and learns
    step1 = [r for r in train if r["step"] == 1]
    assert sum(r["num_generated"] for r in step1) == sum(sum(r["loss_mask"]) for r in step1)


def test_every_and_disabled(tiny_model, tokenizer, tmp_path):
    _train(tiny_model, tokenizer, tmp_path / "a", RolloutLogConfig(groups_per_step=1, every=2, eval_episodes=2))
    records = read_rollouts(tmp_path / "a")
    assert [r["step"] for r in records if r["kind"] == "train"] == [2] * 4
    assert len([r for r in records if r["kind"] == "eval"]) == 3 * 2
    _train(tiny_model, tokenizer, tmp_path / "b", RolloutLogConfig(enabled=False))
    assert not (tmp_path / "b" / "rollouts.jsonl").exists()
    with pytest.raises(ValueError, match="^every: "):
        RolloutLogConfig(every=0)


def test_resume_drops_the_rollouts_after_the_checkpoint(tokenizer, tmp_path):
    from tamer.models import build_tiny_model
    from tests.conftest import TINY

    config = RolloutLogConfig(groups_per_step=1)
    full = tmp_path / "full"
    _train(build_tiny_model(tokenizer, TINY), tokenizer, full, config, steps=4)
    part = tmp_path / "part"
    _train(build_tiny_model(tokenizer, TINY), tokenizer, part, config, steps=3)  # "crashed" after step 3
    _train(build_tiny_model(tokenizer, TINY), tokenizer, part, config, steps=4, append=True,
           resume_from=part / "checkpoints" / "step-000002")
    key = lambda r: (r["kind"], r["step"], r["group"], r["sample"], r["completion"])  # noqa: E731
    assert sorted(map(key, read_rollouts(part))) == sorted(map(key, read_rollouts(full)))


def test_strict_json_and_torn_last_line(tmp_path):
    line = dumps({"a": float("nan"), "b": [float("inf"), 1.5], "c": torch.tensor(2.0), "d": (1, 2)})
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}")) == \
        {"a": None, "b": [None, 1.5], "c": 2.0, "d": [1, 2]}
    path = tmp_path / "rollouts.jsonl"
    path.write_text(line + "\n" + '{"kind": "tr')
    assert len(read_rollouts(tmp_path)) == 1


def test_token_texts_join_to_the_decoded_text(tokenizer):
    ids = tokenizer("é<answer>7</answer>", add_special_tokens=False)["input_ids"]
    texts = TokenTexts(tokenizer)(ids)
    assert texts[:2] == ["", "é"]  # a two-byte character shows on the token that completes it
    assert "".join(texts) == tokenizer.decode(ids) and len(texts) == len(ids)


def test_advantages_and_gaps_by_hand():
    adv = torch.tensor([[0.0, 2.0, 4.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    assert per_row_advantage(adv, mask) == pytest.approx([3.0, 2.0 / 3.0])
    assert per_row_advantage(torch.tensor([0.5, -0.5]), mask) == [0.5, -0.5]

    class T:  # the fields logprob_gaps reads
        def __init__(self, prompt, mask, logprobs):
            self.prompt_ids, self.loss_mask, self.logprobs = prompt, mask, logprobs

    learner = torch.tensor([[0.0, 0.0, -1.0, -2.0, -0.5]])  # prompt of 2, then completion tokens 0..2
    (gap,) = logprob_gaps(learner, [T([1, 2], [1, 0, 1], [-1.5, 0.0, -0.25])])
    assert gap == pytest.approx(((0.5 + 0.25) / 2, 0.5))


def test_eval_show_prints_episodes_with_reward_breakdown(tiny_model, tokenizer, tmp_path):
    save_model(tiny_model, tokenizer, tmp_path / "model")
    args = ["eval", "--model", str(tmp_path / "model"), "--set", "eval.size=3", "--set", "eval.max_new_tokens=6"]
    result = CliRunner().invoke(app, [*args, "--show", "2"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "episode 1" in out and "episode 2" in out and "episode 3" not in out
    assert "correctness 0 x 1" in out and "format 0 x 0.1" in out and "assistant (turn 1)" in out
    result = CliRunner().invoke(app, [*args, "--show", "1", "--json"])
    data = json.loads(result.stdout)
    assert len(data["episodes"]) == 1 and data["episodes"][0]["task"]["answer"]


def test_episode_panel_shows_tool_calls_results_and_errors(tokenizer):
    source = get_task_source(TaskConfig(name="calculator"))
    task = source.split()[1][0]
    traj = AgentRollout(None, tokenizer, AgentConfig(max_turns=8, max_total_tokens=2048)).replay(
        task, ['<tool_call>{"name": "calculate", "arguments": {"expression": "1+"}}</tool_call>',
               *source.demonstrate_turns(task, random.Random(0))])
    record = trajectory_record(traj, TokenTexts(tokenizer), kind="eval", step=0)
    out = io.StringIO()
    Console(file=out, width=200).print(episode_panel(1, record))
    text = out.getvalue()
    assert '-> calculate({"expression": "1+"})' in text and "error:" in text and "<- " in text
    assert "finish: stop" in text and "success: True" in text


def test_tensorboard_gets_the_rollouts_as_a_text_table(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    record = {"kind": "train", "step": 3, "group": 1, "sample": 0, "reward": 1.0, "rewards": {"correctness": 1.0},
              "advantage": 0.5, "logprob_gap": 0.0, "truncated": False, "num_tool_calls": 0, "num_errors": 0,
              "completion": "<answer>85</answer>",
              "task": {"messages": [{"role": "user", "content": "47+38"}], "answer": "85"}}
    with Tracker(tmp_path, console=False) as tracker:
        tracker.log_rollouts([record], step=3)
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    (event,) = events.Tensors("rollouts/train/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 3 and "| 1 | 0 | 47+38 | 1.000 | 0.500 | False | <answer>85</answer> |" in text
    assert read_rollouts(tmp_path)[0]["completion"] == "<answer>85</answer>"
