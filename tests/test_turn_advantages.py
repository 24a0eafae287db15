"""Per-turn credit assignment: `turn_grpo` against hand-computed values, and its token masks.

The hand computations follow the formula in the estimator's docstring (and docs/algorithms.md):
returns-to-go per turn, one group baseline (the mean return), and the turn-averaged std.
"""

import math
import random

import pytest
import torch

from tamer.algorithms import ADVANTAGES, get_advantage_fn, grpo, turn_grpo
from tamer.rewards import RewardComposer, RewardConfig
from tamer.rollout.agent import AgentConfig, AgentRollout
from tamer.rollout.types import SamplingParams, Trajectory, Turn
from tamer.tasks.base import Task
from tamer.tasks.scheduler import SchedulerConfig, SchedulerTasks, Week
from tamer.trainers.batch import collate, token_turns, turn_rewards
from tests.helpers import ScriptedEngine

# Two members of one group. Tokens: A = [t0 t0 env t1 pad], B = [t0 env t1 env t2].
TURN_IDS = torch.tensor([[0, 0, -1, 1, -1],
                         [0, -1, 1, -1, 2]])
GROUP = torch.tensor([4, 4])


def test_hand_computed_example():
    # A: p = [1, 0], R = 2 (outcome 1); B: p = [-1, 0, 0], R = -1. E_A = [0, 1, 1], E_B = [0, -1, -1]:
    # the group mean of E is 0 at every turn, mu = 0.5, so D_A = [1.5, 0.5], D_B = [-1.5, -0.5, -0.5].
    # sigma^2 = ((2.25 + 0.25) / 2 + (2.25 + 0.25 + 0.25) / 3) / (2 - 1).
    sigma = math.sqrt(1.25 + 2.75 / 3)
    out = turn_grpo(torch.tensor([2.0, -1.0]), GROUP, turn_ids=TURN_IDS,
                    turn_rewards=torch.tensor([[1.0, 0.0, 0.0], [-1.0, 0.0, 0.0]]), eps=0.0)
    a, b = 1.5 / sigma, 0.5 / sigma
    expected = torch.tensor([[a, a, 0.0, b, 0.0],
                             [-a, 0.0, -b, 0.0, -b]])
    torch.testing.assert_close(out, expected)


def test_hand_computed_baseline_of_later_turns():
    # A: p = [1, 0], R = 1; B: p = [0, 0], R = 0; C: one turn, p = [0.5], R = 1.5 (outcome 1).
    # E_A = [0, 1], E_B = [0, 0], E_C = [0, 0.5] -> group mean of E = [0, 0.5]; mu = 5/6.
    # D_A = 1/6 - ([0, 1] - [0, 0.5]) = [1/6, -1/3]; D_B = -5/6 - ([0, 0] - [0, 0.5]) = [-5/6, -1/3];
    # D_C = [2/3] (one turn). Per member: 5/72, 29/72, 32/72; sigma^2 = (66/72) / (3 - 1) = 11/24.
    sigma = math.sqrt(11 / 24)
    out = turn_grpo(torch.tensor([1.0, 0.0, 1.5]), torch.tensor([1, 1, 1]), eps=0.0,
                    turn_ids=torch.tensor([[0, -1, 1], [0, 0, 1], [0, -1, -1]]),
                    turn_rewards=torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.5, 0.0]]))
    expected = torch.tensor([[1 / 6, 0.0, -1 / 3], [-5 / 6, -5 / 6, -1 / 3], [2 / 3, 0.0, 0.0]]) / sigma
    torch.testing.assert_close(out, expected)


def test_without_turn_rewards_it_is_grpo_broadcast():
    rewards = torch.tensor([1.0, 0.0, 3.0, 0.5, 2.0])
    groups = torch.tensor([0, 0, 1, 1, 1])
    turn_ids = torch.tensor([[0, -1, 1, 1, -1, 2],
                             [0, 0, 0, -1, -1, -1],
                             [-1, 0, -1, 1, -1, -1],
                             [0, 1, 2, 3, 4, -1],
                             [0, 0, 0, 0, 0, 0]])
    out = turn_grpo(rewards, groups, turn_ids=turn_ids)
    expected = grpo(rewards, groups)[:, None].expand_as(out) * (turn_ids >= 0)
    torch.testing.assert_close(out, expected)


def test_equal_totals_at_different_turns_are_scaled_not_divided_by_zero():
    # Both earn 1: A as a process reward at turn 0, B as the outcome. The totals have no spread
    # (GRPO's std is 0), but turn 1 differs: E_A = [0, 1], E_B = [0, 0], mean [0, 0.5];
    # D_A = [0, -0.5], D_B = [0, 0.5]; sigma^2 = (0.125 + 0.125) / 1.
    out = turn_grpo(torch.tensor([1.0, 1.0]), GROUP, eps=0.0,
                    turn_ids=torch.tensor([[0, 1, -1], [0, 1, -1]]),
                    turn_rewards=torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    torch.testing.assert_close(out, torch.tensor([[0.0, -1.0, 0.0], [0.0, 1.0, 0.0]]))


def test_identical_members_and_singletons_get_zero():
    out = turn_grpo(torch.tensor([1.0, 1.0, 5.0]), torch.tensor([0, 0, 1]),
                    turn_ids=torch.tensor([[0, 1], [0, 1], [0, 0]]),
                    turn_rewards=torch.tensor([[0.5, 0.0], [0.5, 0.0], [2.0, 0.0]]))
    assert torch.equal(out, torch.zeros(3, 2))


def test_row_without_policy_tokens_and_unsorted_groups():
    out = turn_grpo(torch.tensor([1.0, 0.0, 0.0]), torch.tensor([9, 2, 9]),
                    turn_ids=torch.tensor([[0, 0], [-1, -1], [0, -1]]))
    torch.testing.assert_close(out, torch.tensor([[0.7071, 0.7071], [0.0, 0.0], [-0.7071, 0.0]]),
                               atol=1e-4, rtol=0)


def test_registered_and_needs_turn_ids():
    assert get_advantage_fn("turn_grpo") is turn_grpo and "turn_grpo" in ADVANTAGES
    with pytest.raises(ValueError, match="turn_ids"):
        turn_grpo(torch.tensor([1.0, 0.0]), GROUP)


# ---------------------------------------------------------------------------------------------
# Token layout: turn ids from real multi-turn trajectories; tool output gets no advantage
# ---------------------------------------------------------------------------------------------


def _scheduler_episode(tokenizer, hasty_rate: float, seed: int) -> Trajectory:
    source = SchedulerTasks(SchedulerConfig(heldout_size=5, train_size=5, demo_hasty_rate=hasty_rate))
    task = source.split()[1][0]
    turns = source.demonstrate_turns(task, random.Random(seed))
    rollout = AgentRollout(ScriptedEngine(tokenizer, turns), tokenizer,
                           AgentConfig(max_turns=12, max_total_tokens=4000, show_tools=False))
    return rollout.run([task], SamplingParams(n=1, max_new_tokens=200))[0]


def test_token_turns_follow_the_turns_and_skip_tool_output(tokenizer):
    traj = _scheduler_episode(tokenizer, hasty_rate=0.0, seed=0)
    turns = token_turns(traj)
    assert len(turns) == len(traj.completion_ids)
    assert [t == -1 for t in turns] == [m == 0 for m in traj.loss_mask]
    # each turn's tokens are one contiguous run, in order, of the turn's length
    runs = []
    for t in turns:
        if t >= 0 and (not runs or runs[-1][0] != t):
            runs.append([t, 0])
        if t >= 0:
            runs[-1][1] += 1
    assert [r[0] for r in runs] == list(range(len(traj.turns)))
    assert [r[1] for r in runs] == [turn.generated for turn in traj.turns]
    single = Trajectory(task=traj.task, group_id=0, prompt_ids=[1], completion_ids=[5, 6, 7], loss_mask=[1, 1, 1],
                        logprobs=[0.0] * 3, text="", turns=[Turn(generated=3)])
    assert token_turns(single) == [0, 0, 0]


def test_tool_output_tokens_get_no_advantage(tokenizer):
    """End to end through collate: prompt, tool-output and padding positions carry advantage 0,
    and each turn's tokens carry that turn's hand-computed value."""
    careful = _scheduler_episode(tokenizer, hasty_rate=0.0, seed=0)  # 5 right bookings: success
    hasty = _scheduler_episode(tokenizer, hasty_rate=1.0, seed=0)  # books every request unchecked
    trajs = [careful, hasty]
    for t in trajs:
        t.group_id = 0
    composer = RewardComposer(RewardConfig(weights={"correctness": 1.0, "process": 0.5}))
    composer.score(trajs)
    week = Week.from_dict(careful.task.meta["week"])
    hasty_right = sum(r == a for r, a in zip(week.requests, week.answers))
    assert careful.info["success"] and [t.env_reward for t in careful.turns] == [0.0, 1.0] * 5
    assert [t.env_reward for t in hasty.turns] == [1.0 if r == a else -1.0 for r, a in zip(week.requests, week.answers)]
    assert careful.reward == 1.0 + 0.5 * 5 and hasty.reward == 0.5 * (2 * hasty_right - 5)

    batch = collate(trajs, torch.zeros(2), tokenizer.pad_token_id)
    advantages = turn_grpo(batch.rewards, batch.group_ids, loss_mask=batch.loss_mask, turn_ids=batch.turn_ids,
                           turn_rewards=turn_rewards(trajs, 0.5), eps=0.0)
    assert advantages.shape == batch.input_ids.shape
    off = batch.loss_mask == 0  # prompt, tool output, chat markers, padding
    assert off.any() and torch.all(advantages[off] == 0)
    # by hand, with loops: E (process reward earned before each turn), D, the pooled sigma
    p = [[0.5 * t.env_reward for t in traj.turns] for traj in trajs]
    totals = [traj.reward for traj in trajs]
    mu = sum(totals) / 2
    width = max(len(row) for row in p)
    earned = [[sum(row[:k]) for k in range(width)] for row in p]
    mean_earned = [(earned[0][k] + earned[1][k]) / 2 for k in range(width)]
    dev = [[(totals[i] - mu) - (earned[i][k] - mean_earned[k]) for k in range(len(p[i]))] for i in range(2)]
    sigma = math.sqrt(sum(sum(d * d for d in row) / len(row) for row in dev) / (2 - 1))
    assert dev[0][0] > 0 > dev[1][0]  # the successful careful run is the better one
    for row in range(2):
        for k, d in enumerate(dev[row]):
            on = batch.turn_ids[row] == k
            assert on.sum() == trajs[row].turns[k].generated
            torch.testing.assert_close(advantages[row][on], torch.full((int(on.sum()),), d / sigma))


def test_turn_rewards_are_weighted_and_padded():
    task = Task(id="t", messages=({"role": "user", "content": "x"},), answer="")
    make = lambda rewards: Trajectory(task=task, group_id=0, prompt_ids=[], completion_ids=[], loss_mask=[],  # noqa: E731
                                      logprobs=[], text="", turns=[Turn(generated=1, env_reward=r) for r in rewards])
    out = turn_rewards([make([1.0, -1.0, 0.0]), make([2.0]), make([])], 0.5)
    torch.testing.assert_close(out, torch.tensor([[0.5, -0.5, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))


def test_identical_members_get_exactly_zero_at_every_turn():
    # four members, each earning 0.05 at turn 0 and 0.9 in total: R - mu and E - mean E are exactly 0
    # (means of the values minus the group's minimum), so no rounding step is divided by the ~0 std
    rewards = torch.full((4,), 0.05 + 0.85)
    out = turn_grpo(rewards, torch.zeros(4, dtype=torch.long), turn_ids=torch.tensor([[0, -1, 1]] * 4),
                    turn_rewards=torch.tensor([[0.05, 0.0]] * 4))
    assert torch.equal(out, torch.zeros(4, 3))
