"""Agent tier: multi-turn rollouts, token identity, tool-output masks, error paths, agent rewards."""

import dataclasses
import random
import time

import pytest
import torch

from tamer.evaluate import agent_metrics
from tamer.rewards import cost_penalty, steps_penalty, tool_success
from tamer.rollout.agent import AgentConfig, AgentRollout, ToolMessageRenderer
from tamer.rollout.engine import HFEngine
from tamer.rollout.types import SamplingParams
from tamer.tasks import CalculatorTasks, TripPlannerTasks
from tamer.tasks.base import Task
from tamer.tasks.env import ENVIRONMENTS, StepResult
from tamer.tasks.tool_env import ToolEnvConfig, ToolEnvironment
from tamer.tools.schema import ToolSet
from tamer.trainers.batch import collate
from tests.helpers import ScriptedEngine


def _check_layout(traj, tokenizer):
    """Generated spans have mask 1; everything between them is the rendered tool message (mask 0)."""
    assert len(traj.completion_ids) == len(traj.loss_mask) == len(traj.logprobs)
    for i, m in enumerate(traj.loss_mask):
        if m == 0:
            assert traj.logprobs[i] == 0.0
    masked_out = [t for t, m in zip(traj.completion_ids, traj.loss_mask) if m == 0]
    text = tokenizer.decode(masked_out)
    assert text.count("<|im_start|>tool") == sum(1 for t in traj.turns if t.tool_results)


def test_multi_turn_sampled_tokens_are_trained_tokens(tokenizer, tiny_model):
    """Over several turns with a real model: the batch holds exactly the sampled tokens, masks right."""
    calc = CalculatorTasks()
    tasks = calc.split()[1][:3]
    captured = []
    engine = HFEngine(tiny_model, tokenizer.pad_token_id)
    original = engine.generate

    def spy(prompts, params):
        outs = original(prompts, params)
        captured.append((prompts, outs))
        return outs

    engine.generate = spy
    rollout = AgentRollout(engine, tokenizer, AgentConfig(max_turns=3, max_total_tokens=400, show_tools=False))
    trajs = rollout.run(tasks, SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=3))
    batch = collate(trajs, torch.zeros(len(trajs)), tokenizer.pad_token_id)
    sampled = [o.token_ids for _, outs in captured for group in outs for o in group]
    for row, traj in enumerate(trajs):
        p = len(traj.prompt_ids)
        generated = [t for t, m in zip(traj.completion_ids, traj.loss_mask) if m == 1]
        # every generated span is one of the engine's outputs, in order
        spans, cur = [], []
        for t, m in zip(traj.completion_ids, traj.loss_mask):
            if m == 1:
                cur.append(t)
            elif cur:
                spans.append(cur)
                cur = []
        if cur:
            spans.append(cur)
        assert all(span in sampled for span in spans)
        assert sum(len(s) for s in spans) == len(generated)
        assert batch.input_ids[row, p:p + len(traj.completion_ids)].tolist() == traj.completion_ids
        assert batch.loss_mask[row, p:p + len(traj.completion_ids)].tolist() == [float(m) for m in traj.loss_mask]


def test_scripted_multi_turn_masks_and_identity(tokenizer):
    src = CalculatorTasks()
    task = src.split()[1][0]
    turns = src.demonstrate_turns(task, random.Random(0))
    engine = ScriptedEngine(tokenizer, turns)
    rollout = AgentRollout(engine, tokenizer, AgentConfig(max_turns=10, max_total_tokens=2000, show_tools=False))
    traj = rollout.run([task], SamplingParams(n=1, max_new_tokens=200))[0]
    assert traj.info["success"] is True and len(traj.turns) == len(turns)
    _check_layout(traj, tokenizer)
    generated_text = tokenizer.decode([t for t, m in zip(traj.completion_ids, traj.loss_mask) if m == 1])
    assert generated_text == "".join(t + "<|im_end|>" for t in turns)
    # the tool outputs are in the completion, but every one of their tokens is masked out
    render = ToolMessageRenderer(tokenizer)
    first_obs = render(traj.turns[0].tool_results[0])
    start = traj.loss_mask.index(0)
    assert traj.completion_ids[start:start + len(first_obs)] == first_obs
    assert traj.loss_mask[start:start + len(first_obs)] == [0] * len(first_obs)


def test_replay_matches_sampled_layout(tokenizer):
    src = TripPlannerTasks()
    task = src.split()[1][0]
    turns = src.demonstrate_turns(task, random.Random(1))
    config = AgentConfig(max_turns=10, max_total_tokens=3000, show_tools=False)
    replayed = AgentRollout(None, tokenizer, config).replay(task, turns)
    sampled = AgentRollout(ScriptedEngine(tokenizer, turns), tokenizer, config).run(
        [task], SamplingParams(n=1, max_new_tokens=200))[0]
    assert replayed.completion_ids == sampled.completion_ids and replayed.loss_mask == sampled.loss_mask
    assert replayed.info["success"] and replayed.info["cost_ratio"] >= 1.0


class _Faulty(ToolEnvironment):
    def build_tools(self):
        return ToolSet([self.add, self.boom, self.slow])

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: first
            b: second
        """
        return a + b

    def boom(self, x: int) -> int:
        """Always fails.

        Args:
            x: anything
        """
        raise RuntimeError("tool exploded")

    def slow(self, x: int) -> int:
        """Sleeps too long.

        Args:
            x: anything
        """
        time.sleep(1.0)
        return x


ENVIRONMENTS.register("test_faulty")(lambda: _Faulty(ToolEnvConfig(tool_timeout_s=0.1)))


@pytest.mark.parametrize("turn, kind", [
    ('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', "malformed_call"),
    ('<tool_call>{"name": "sub", "arguments": {"a": 1, "b": 2}}</tool_call>', "unknown_tool"),
    ('<tool_call>{"name": "add", "arguments": {"a": "one"}}</tool_call>', "bad_arguments"),
    ('<tool_call>{"name": "boom", "arguments": {"x": 1}}</tool_call>', "tool_raised"),
    ('<tool_call>{"name": "slow", "arguments": {"x": 1}}</tool_call>', "timeout"),
])
def test_error_paths_become_observations_and_metrics(tokenizer, turn, kind):
    task = Task(id="f", messages=({"role": "user", "content": "go"},), answer="3", env="test_faulty")
    engine = ScriptedEngine(tokenizer, [turn, "<answer>3</answer>"])
    traj = AgentRollout(engine, tokenizer, AgentConfig(max_turns=4, show_tools=True)).run(
        [task], SamplingParams(max_new_tokens=100))[0]
    assert traj.turns[0].errors == [kind]
    assert "error" in traj.turns[0].tool_results[0]
    assert traj.info["success"] is True  # the run went on to the answer
    assert traj.num_errors == 1 and tool_success(traj) == 0.0
    assert agent_metrics([traj])["error_rate"] == 1.0


def test_environment_that_raises_ends_only_its_episode(tokenizer):
    class Broken:
        tools = []

        def reset(self, task):
            return ""

        def step(self, action):
            raise ValueError("env bug")

    task = Task(id="b", messages=({"role": "user", "content": "go"},), answer="", env="x")
    rollout = AgentRollout(ScriptedEngine(tokenizer, ["hi"]), tokenizer, env_factory=lambda t: Broken())
    trajs = rollout.run([task], SamplingParams(n=2, max_new_tokens=10))
    assert all(t.info["env_error"] == "ValueError: env bug" and t.info["success"] is False for t in trajs)


def test_budget_limits_end_episodes(tokenizer):
    src = CalculatorTasks()
    task = src.split()[1][0]
    loop = ['<tool_call>{"name":"calculate","arguments":{"expression":"1+1"}}</tool_call>']
    traj = AgentRollout(ScriptedEngine(tokenizer, loop), tokenizer, AgentConfig(max_turns=3, show_tools=False)).run(
        [task], SamplingParams(max_new_tokens=100))[0]
    assert len(traj.turns) == 3 and traj.finish_reason == "length" and not traj.info.get("success")


def test_agent_rewards_on_trip_outcome(tokenizer):
    src = TripPlannerTasks()
    task = src.split()[1][2]
    turns = src.demonstrate_turns(task, random.Random(5))
    traj = AgentRollout(None, tokenizer, AgentConfig(show_tools=False)).replay(task, turns)
    assert steps_penalty(traj, per_call=0.1, free_calls=4) == pytest.approx(-0.1 * (len(turns) - 4))
    assert cost_penalty(traj) == pytest.approx(-(traj.info["cost"] / traj.info["optimal_cost"] - 1))
    assert tool_success(traj) == 1.0


def test_trip_planner_demo_end_to_end_small(tmp_path):
    import json

    from typer.testing import CliRunner

    from tamer.cli import app

    out = tmp_path / "trip"
    args = ["demo", "--env", "trip_planner", "-o", str(out),
            "--set", "task.trip_planner.world.train_size=24", "--set", "task.trip_planner.world.heldout_size=4",
            "--set", "model.tiny.hidden_size=32", "--set", "model.tiny.num_layers=1",
            "--set", "model.tiny.intermediate_size=64",
            "--set", "sft.steps=3", "--set", "sft.batch_size=4", "--set", "rl.steps=1",
            "--set", "rl.prompts_per_step=2", "--set", "rl.group_size=2", "--set", "rl.max_new_tokens=8",
            "--set", "eval.size=4", "--set", "eval.max_new_tokens=8", "--set", "tracking.tensorboard=false"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    for who in ("demonstrator", "sft", "rl"):
        assert set(summary[who]) == {"success_rate", "mean_tool_calls", "mean_cost_ratio", "error_rate"}
    assert summary["demonstrator"]["success_rate"] == 1.0 and summary["demonstrator"]["mean_tool_calls"] >= 4


class _Chatty:
    """An environment that answers every turn and never ends the episode itself."""

    def reset(self, task):
        self.turn = 0
        return ""

    def step(self, action):
        self.turn += 1
        return StepResult(f"reply {self.turn}: {action[:5]}", done=False, info={})


class _NoReuse:
    """The plain path: the same engine with prefix reuse switched off."""

    def __init__(self, engine):
        self.engine = engine

    def sync_weights(self, model):
        self.engine.sync_weights(model)

    def generate(self, prompts, params):
        return self.engine.generate(prompts, dataclasses.replace(params, reuse_prefix=False))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_prefix_reuse_across_turns_matches_full_prefill(tokenizer, tiny_model, temperature):
    """Later turns prefill only their new tokens; tokens and logprobs equal the full-prefill path."""
    tasks = [Task(id=f"t{i}", messages=({"role": "user", "content": "hi " * (i + 1)},), answer="", env="chatty")
             for i in range(3)]
    config = AgentConfig(max_turns=4, max_total_tokens=400, show_tools=False)
    params = SamplingParams(n=2, temperature=temperature, max_new_tokens=9, seed=5)
    engine = HFEngine(tiny_model, tokenizer.pad_token_id, max_batch=4)  # several chunks per turn
    reused = AgentRollout(engine, tokenizer, config, env_factory=lambda task: _Chatty()).run(tasks, params)
    plain = AgentRollout(_NoReuse(HFEngine(tiny_model, tokenizer.pad_token_id, max_batch=4)), tokenizer, config,
                         env_factory=lambda task: _Chatty()).run(tasks, params)
    assert engine.prefix_store.hits == 3 * 6  # turns 2-4 of all 6 episodes came from the store
    for a, b in zip(reused, plain):
        assert len(a.turns) == 4 and a.completion_ids == b.completion_ids and a.loss_mask == b.loss_mask
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    engine.sync_weights(tiny_model)  # new weights: nothing stale survives
    assert len(engine.prefix_store) == 0


def test_demo_table_shows_missing_figures_as_a_dash():
    from tamer.cli import _fmt

    assert [_fmt(v) for v in (None, float("nan"), 0.975, 10, "x")] == ["-", "-", "0.975", "10", "x"]
