"""Algorithm variants through the trainer, on constructed batches: each one must change the loss.

At μ = 1 the ratio is 1 and every clipping variant is a no-op, so these runs use μ = 2 (the
loss reads the batch's old logprobs) and set old logprobs = learner logprobs − log ρ with a
chosen ρ per token. Expected losses are computed by hand from that ρ and the advantages.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tamer.evaluate import EvalConfig
from tamer.rewards import RewardComposer, RewardConfig
from tamer.rollout.types import Trajectory
from tamer.tasks import ArithmeticTasks
from tamer.trainers.batch import collate
from tamer.trainers.common import OptimConfig
from tamer.trainers.rl import AlgorithmConfig, RLConfig, RLTrainer

TASKS = ArithmeticTasks().split()


def _trainer(model, tokenizer, tmp_path, **algorithm) -> RLTrainer:
    cfg = RLConfig(steps=1, prompts_per_step=2, group_size=2, max_new_tokens=8, ppo_epochs=2, eval_every=0,
                   optim=OptimConfig(lr=1e-3), algorithm=AlgorithmConfig(**algorithm))
    rewards = RewardComposer(RewardConfig(weights={"length": 1.0}))
    return RLTrainer(model, tokenizer, *TASKS, rewards, cfg, EvalConfig(size=2), run_dir=tmp_path)


def _trajectory(tokenizer, group: int, completion: str) -> Trajectory:
    prompt = tokenizer("<|im_start|>user\n1+2<|im_end|>\n<|im_start|>assistant\n",
                       add_special_tokens=False)["input_ids"]
    ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    return Trajectory(task=TASKS[0][group], group_id=group, prompt_ids=prompt, completion_ids=ids,
                      loss_mask=[1] * len(ids), logprobs=[0.0] * len(ids), text=completion)


def _batch(trainer, tokenizer, log_ratio: list[list[float]], advantages: list[float]):
    """Two rows of 4 generated tokens; old logprobs set so that ρ_{i,t} = exp(log_ratio[i][t])."""
    trajs = [_trajectory(tokenizer, 0, "abcd"), _trajectory(tokenizer, 1, "wxyz")]
    batch = collate(trajs, torch.tensor(advantages), tokenizer.pad_token_id)
    with torch.no_grad():
        logprobs = trainer._logprobs(trainer.model, batch)
    shift = torch.zeros_like(logprobs)
    shift[batch.loss_mask.bool()] = torch.tensor(log_ratio, dtype=torch.float32).flatten()
    batch.old_logprobs = (logprobs - shift) * batch.loss_mask
    return batch


def _loss(trainer, batch) -> float:
    return trainer.loss(batch)[0].item()


def test_gspo_ratio_is_one_per_sequence(tiny_model, tokenizer, tmp_path):
    # Row 0: token ratios far outside 1 ± 0.2 but mean log ratio 0: s = 1, nothing clipped.
    # Row 1: mean log ratio 0.01: s ≈ 1.01 > 1 + 1e-3, clipped (A > 0).
    log_ratio = [[0.5, -0.5, 0.3, -0.3], [0.01, 0.02, 0.0, 0.01]]
    advantages = [1.0, 0.5]
    gspo = _trainer(tiny_model, tokenizer, tmp_path, policy_loss="gspo", gspo_eps_low=1e-3, gspo_eps_high=1e-3)
    batch = _batch(gspo, tokenizer, log_ratio, advantages)
    # Hand: s_i = exp(mean_t log ρ_{i,t}), clipped to [1 − 1e-3, 1 + 1e-3]; loss = −min(s A, clip(s) A), token-mean.
    expected = []
    for row, a in zip(log_ratio, advantages):
        s = math.exp(sum(row) / len(row))
        expected += [-min(s * a, min(max(s, 1 - 1e-3), 1 + 1e-3) * a)] * len(row)
    assert _loss(gspo, batch) == pytest.approx(sum(expected) / len(expected), abs=1e-6)
    # Token ratios (ppo) give another loss on the same batch: the variant is not a no-op.
    ppo = _trainer(tiny_model, tokenizer, tmp_path)
    token_loss = sum(-min(math.exp(r) * a, min(max(math.exp(r), 0.8), 1.2) * a)
                     for row, a in zip(log_ratio, advantages) for r in row) / 8
    assert _loss(ppo, batch) == pytest.approx(token_loss, abs=1e-6)
    assert abs(_loss(gspo, batch) - _loss(ppo, batch)) > 0.01


def test_dual_clip_bounds_negative_advantages_with_large_ratios(tiny_model, tokenizer, tmp_path):
    log_ratio = [[2.0] * 4, [2.0] * 4]  # ρ = e² ≈ 7.39, far above 1 + ε
    advantages = [-1.0, 1.0]
    plain = _trainer(tiny_model, tokenizer, tmp_path)
    dual = _trainer(tiny_model, tokenizer, tmp_path, dual_clip_c=3.0)
    batch = _batch(plain, tokenizer, log_ratio, advantages)
    rho = math.exp(2.0)
    # A = −1: plain −min(−ρ, −1.2) = ρ; dual clip bounds it by −c·A = 3. A = +1: −min(ρ, 1.2) = −1.2 either way.
    assert _loss(plain, batch) == pytest.approx((4 * rho + 4 * -1.2) / 8, rel=1e-5)
    assert _loss(dual, batch) == pytest.approx((4 * 3.0 + 4 * -1.2) / 8, rel=1e-5)
    assert dual.loss(batch)[1]["train/dual_clip_frac"] == pytest.approx(0.5)


def test_clip_higher_is_asymmetric(tiny_model, tokenizer, tmp_path):
    log_ratio = [[math.log(1.25)] * 4, [math.log(0.75)] * 4]
    advantages = [1.0, -1.0]
    symmetric = _trainer(tiny_model, tokenizer, tmp_path)  # ε_low = ε_high = 0.2
    higher = _trainer(tiny_model, tokenizer, tmp_path, clip_eps_high=0.28)  # DAPO
    batch = _batch(symmetric, tokenizer, log_ratio, advantages)
    # Row 0 (A = +1, ρ = 1.25): clipped at 1.2 when symmetric, not with ε_high = 0.28.
    # Row 1 (A = −1, ρ = 0.75): −min(−0.75, −0.8) = 0.8 in both (the low side is unchanged).
    assert _loss(symmetric, batch) == pytest.approx((4 * -1.2 + 4 * 0.8) / 8, rel=1e-5)
    assert _loss(higher, batch) == pytest.approx((4 * -1.25 + 4 * 0.8) / 8, rel=1e-5)
    assert symmetric.loss(batch)[1]["train/clip_frac"] == pytest.approx(1.0)
    assert higher.loss(batch)[1]["train/clip_frac"] == pytest.approx(0.5)


@pytest.mark.parametrize("mode", ["off", "drop", "refill"])
def test_dynamic_sampling_drops_zero_spread_groups(tiny_model, tokenizer, tmp_path, mode):
    trainer = _trainer(tiny_model, tokenizer, tmp_path, dynamic_sampling=mode)
    rounds = []

    def rollout(tasks, params, group_offset=0):  # round 1: group 0 all alike, group 1 spread; then spread
        rounds.append(len(tasks))
        lengths = [["ab", "ab"], ["ab", "abcd"]] if len(rounds) == 1 else [["a", "abc"]] * len(tasks)
        return [_trajectory(tokenizer, group_offset + j, text) for j in range(len(tasks)) for text in lengths[j]]

    trainer.rollout.run = rollout
    kept, metrics = trainer.collect(step=1)
    groups = sorted({t.group_id for t in kept})
    if mode == "off":
        assert groups == [0, 1] and rounds == [2]
    elif mode == "drop":
        assert groups == [1] and rounds == [2] and metrics["rollout/kept"] == 2
    else:  # refill samples one more group to make up the dropped one
        assert groups == [1, 2] and rounds == [2, 1] and metrics["rollout/trajectories"] == 6
    assert metrics["rollout/zero_spread_frac"] == pytest.approx(2 / metrics["rollout/trajectories"])


def test_truncated_importance_sampling_reweights_the_loss(tiny_model, tokenizer, tmp_path):
    """On-policy (μ = 1) with an engine whose logprobs differ: TIS multiplies each token's loss by
    min(π_learner / π_sampler, cap); without it the sampler's logprobs only feed metrics."""
    log_ratio = [[math.log(3.0)] * 4, [math.log(0.5)] * 4]  # π_learner / π_sampler per token
    advantages = [1.0, 1.0]
    plain = _trainer(tiny_model, tokenizer, tmp_path)
    plain.config = dataclasses.replace(plain.config, ppo_epochs=1)  # on-policy: ρ = 1 in value
    tis = _trainer(tiny_model, tokenizer, tmp_path)
    tis.config = dataclasses.replace(tis.config, ppo_epochs=1, tis_cap=2.0)
    batch = _batch(plain, tokenizer, log_ratio, advantages)
    batch.sampler_logprobs = batch.old_logprobs
    assert _loss(plain, batch) == pytest.approx(-1.0, rel=1e-5)
    assert _loss(tis, batch) == pytest.approx((4 * -2.0 + 4 * -0.5) / 8, rel=1e-5)  # weights min(3, 2), 0.5
    metrics = tis.loss(batch)[1]
    assert metrics["mismatch/tis_clip_frac"] == pytest.approx(0.5)
    assert metrics["mismatch/logprob_gap_max"] == pytest.approx(math.log(3.0), rel=1e-4)
