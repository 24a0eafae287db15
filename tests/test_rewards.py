"""Rewards tier: built-in functions, weighted composition, error isolation."""

from tamer.rewards import REWARDS, RewardComposer, RewardConfig, answer_format, correctness, length_penalty
from tamer.rollout.types import Trajectory
from tamer.tasks.base import Task


def _traj(text, answer="85", n=5, finish="stop"):
    task = Task(id="t", messages=({"role": "user", "content": "47+38"},), answer=answer)
    return Trajectory(task=task, group_id=0, prompt_ids=[1], completion_ids=[0] * n, loss_mask=[1] * n,
                      logprobs=[0.0] * n, text=text, finish_reason=finish)


def test_builtin_rewards():
    good = _traj("<think>x</think><answer>85</answer><|im_end|>")
    assert correctness(good) == 1.0 and answer_format(good) == 1.0
    assert correctness(_traj("<answer>84</answer>")) == 0.0
    assert answer_format(_traj("<answer>85</answer> trailing")) == 0.0
    assert answer_format(_traj("<answer>85</answer>", finish="length")) == 0.0
    assert length_penalty(_traj("", n=64), max_tokens=128) == -0.5
    assert length_penalty(_traj("", n=64, finish="length"), max_tokens=128, truncation_penalty=1.0) == -1.5


def test_weighted_composition_and_metrics():
    composer = RewardComposer(RewardConfig(weights={"correctness": 1.0, "format": 0.5}))
    trajs = [_traj("<answer>85</answer>"), _traj("<answer>1</answer> x")]
    stats = composer.score(trajs)
    assert [t.reward for t in trajs] == [1.5, 0.0]
    assert stats.metrics()["reward/correctness"] == 0.5 and stats.metrics()["reward/mean"] == 0.75


@REWARDS.register("flaky")
def flaky(traj):
    if "boom" in traj.text:
        raise RuntimeError("reward backend down")
    return 1.0


@REWARDS.register("nan")
def nan_reward(traj):
    return float("nan")


def test_raising_reward_is_recorded_and_scored_default():
    composer = RewardComposer(RewardConfig(weights={"flaky": 2.0}, default_on_error=-0.25))
    trajs = [_traj("fine"), _traj("boom"), _traj("boom")]
    stats = composer.score(trajs)
    assert [t.reward for t in trajs] == [2.0, -0.5, -0.5]
    assert stats.errors == {"flaky": 2} and composer.total_errors == 2
    assert "RuntimeError: reward backend down" in stats.first_traceback


def test_nan_reward_counts_as_error():
    composer = RewardComposer(RewardConfig(weights={"nan": 1.0}))
    stats = composer.score([_traj("x")])
    assert stats.errors == {"nan": 1}


def test_reward_params_must_name_a_used_function():
    import pytest

    with pytest.raises(ValueError, match="^params.length: no such function"):
        RewardConfig(weights={"correctness": 1.0}, params={"length": {"max_tokens": 3}})
