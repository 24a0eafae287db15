"""Advantage estimators: how much better each trajectory (or token) did than its baseline.

Outcome estimators turn one scalar reward per trajectory into one advantage per trajectory,
relative to the other members of its group (the N samples of one task); the trainer broadcasts
it to every loss-masked token. They share one call signature, take their hyperparameters as
keywords (bound once, when the trainer is built) and are chosen by name:

    fn = get_advantage_fn("grpo")
    advantages = fn(rewards, group_ids, loss_mask)  # (B,), (B,), (B, T) -> (B,) float32

Group ids need not be sorted, contiguous or equal-sized.

`turn_grpo` is the per-turn estimator for multi-turn episodes (the names in `PER_TURN`): it
also takes each token's turn index and each turn's process reward, credits every turn with the
group-relative return from it on, and returns (B, T) advantages (0 off the policy's tokens):

    advantages = fn(rewards, group_ids, loss_mask, turn_ids, turn_rewards)  # -> (B, T)

PPO's critic-based estimator is `critic_advantages`: the outcome reward placed on each row's
last generated token (optionally minus a per-token KL penalty), `gae` over the generated
tokens, then advantages whitened over the batch. `zero_spread_groups` finds groups that
teach nothing (all rewards equal), for DAPO's dynamic sampling. Formulas and sources:
docs/algorithms.md#advantage-estimators and docs/algorithms.md#ppo-with-a-critic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tamer.algorithms.losses import masked_mean
from tamer.registry import Registry

AdvantageFn = Callable[..., Tensor]  # (rewards (B,), group_ids (B,), loss_mask (B, T) | None, **hp) -> (B,)

ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")
PER_TURN = frozenset({"turn_grpo"})  # estimators that also read turn_ids and turn_rewards


def get_advantage_fn(name: str) -> AdvantageFn:
    """The outcome advantage estimator registered under `name` (KeyError lists valid names)."""
    return ADVANTAGES.get(name)


# ---------------------------------------------------------------------------------------------
# Group statistics (vectorized over arbitrary group ids)
# ---------------------------------------------------------------------------------------------


def _group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary ids to 0..G-1: returns (inverse (B,) long, G)."""
    unique_ids, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, unique_ids.numel()


def _group_sum(x: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    """Per-member sum over its group: (B,) -> (B,)."""
    sums = torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, inverse, x)
    return sums[inverse]


def _group_centered(x: Tensor, inverse: Tensor, num_groups: int, size: Tensor) -> Tensor:
    """x − its group's mean, for x (B,) or (B, K) (per column); `size` (B,) the members' group sizes.

    The mean is taken of x minus its group's minimum (equal to x − mean in exact arithmetic): a group
    of equal values gives exactly 0. Summed as they are, eight rewards of 0.95 in float32 have a mean
    one rounding step off, and GRPO's division by their ~1e-8 std turned that into advantages of
    0.056 for every member (docs/algorithms.md#grpo).
    """
    index = inverse.view(-1, *([1] * (x.dim() - 1))).expand_as(x)
    empty = torch.zeros((num_groups, *x.shape[1:]), dtype=x.dtype, device=x.device)
    shifted = x - empty.scatter_reduce(0, index, x, "amin", include_self=False)[inverse]
    mean = empty.index_add(0, inverse, shifted)[inverse] / size.view(-1, *([1] * (x.dim() - 1)))
    return shifted - mean


def _group_centered_and_size(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Each member's reward minus its group's mean (`_group_centered`), and its group's size; (B,) each."""
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    inverse, num_groups = _group_index(group_ids)
    size = _group_sum(torch.ones_like(rewards), inverse, num_groups)  # (B,)
    return _group_centered(rewards, inverse, num_groups, size), size


# ---------------------------------------------------------------------------------------------
# Outcome estimators
# ---------------------------------------------------------------------------------------------


@ADVANTAGES.register("grpo")
def grpo(
    rewards: Tensor,
    group_ids: Tensor,
    loss_mask: Tensor | None = None,
    *,
    eps: float = 1e-6,
    unbiased_std: bool = True,
) -> Tensor:
    """GRPO: (r_i - mean_group r) / (std_group r + eps).

    DeepSeekMath (Shao et al., 2024). Departs: the paper does not say which std; like the
    peer trainers we use the unbiased (Bessel) one by default (`unbiased_std=False` for the
    population std). A group of size 1 has no baseline and gets advantage 0. `loss_mask`
    is unused (the estimators share one call signature). docs/algorithms.md#grpo
    """
    rewards = rewards if rewards.is_floating_point() else rewards.float()  # (B,)
    inverse, num_groups = _group_index(group_ids)
    size = _group_sum(torch.ones_like(rewards), inverse, num_groups)  # (B,)
    centered = _group_centered(rewards, inverse, num_groups, size)  # (B,) exactly 0 for equal rewards
    # Two-pass variance: sum of squared deviations, then divide.
    sq_dev = _group_sum(centered.square(), inverse, num_groups)  # (B,)
    dof = (size - 1.0) if unbiased_std else size
    std = (sq_dev / dof.clamp(min=1.0)).sqrt()  # (B,)
    advantages = centered / (std + eps)
    return torch.where(size > 1, advantages, torch.zeros_like(advantages))


@ADVANTAGES.register("dr_grpo")
def dr_grpo(rewards: Tensor, group_ids: Tensor, loss_mask: Tensor | None = None) -> Tensor:
    """Dr. GRPO: r_i - mean_group r, no division by the std.

    "Understanding R1-Zero-like Training" (Liu et al., 2025), which shows the std division
    up-weights too-easy and too-hard questions. Departs: nothing (the paper's other change,
    the length normalization, lives in `aggregate(..., "seq-mean-token-sum-norm")`).
    docs/algorithms.md#dr_grpo
    """
    return _group_centered_and_size(rewards, group_ids)[0]


@ADVANTAGES.register("rloo")
def rloo(rewards: Tensor, group_ids: Tensor, loss_mask: Tensor | None = None) -> Tensor:
    """RLOO: r_i - mean of the other G-1 members = G/(G-1) * (r_i - mean_group r).

    "Back to Basics: Revisiting REINFORCE Style Optimization" (Ahmadian et al., 2024), after
    Kool et al. (2019). Departs: a group of size 1 has no "others" and gets advantage 0.
    docs/algorithms.md#rloo
    """
    centered, size = _group_centered_and_size(rewards, group_ids)
    scale = size / (size - 1.0).clamp(min=1.0)  # (B,) G/(G-1); value unused when G == 1
    advantages = scale * centered
    return torch.where(size > 1, advantages, torch.zeros_like(advantages))


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp(rewards: Tensor, group_ids: Tensor, loss_mask: Tensor | None = None, *, eps: float = 1e-6) -> Tensor:
    """REINFORCE++ with group baseline: r_i - mean_group r, then whitened over the batch.

    REINFORCE++ (Hu, 2025). The whitening statistics are token-weighted, as if each
    sequence's advantage were broadcast to its tokens: a sequence weighs its number of
    loss-mask tokens (weight 1 each when `loss_mask` is None). Departs: the variance is the
    (weighted) population variance and we divide by (std + eps), as OpenRLHF does up to eps.
    If every sequence has weight 0 the result is all zeros. docs/algorithms.md#reinforce_pp
    """
    centered, _ = _group_centered_and_size(rewards, group_ids)  # (B,)
    if loss_mask is None:
        weights = torch.ones_like(centered)
    else:
        weights = loss_mask.bool().sum(dim=-1).to(centered.dtype)  # (B,) tokens per sequence
    total = weights.sum()
    safe_total = total.clamp(min=1.0)
    batch_mean = (weights * centered).sum() / safe_total
    batch_var = (weights * (centered - batch_mean).square()).sum() / safe_total
    whitened = (centered - batch_mean) / (batch_var.sqrt() + eps)
    return torch.where(total > 0, whitened, torch.zeros_like(whitened))


# ---------------------------------------------------------------------------------------------
# Per-turn estimator (multi-turn episodes with per-turn rewards)
# ---------------------------------------------------------------------------------------------


@ADVANTAGES.register("turn_grpo")
def turn_grpo(
    rewards: Tensor,
    group_ids: Tensor,
    loss_mask: Tensor | None = None,
    turn_ids: Tensor | None = None,
    turn_rewards: Tensor | None = None,
    *,
    eps: float = 1e-6,
) -> Tensor:
    """Per-turn GRPO: each turn is credited with the group-relative return from that turn on.

    Inputs: `rewards` (B,) each episode's total reward R_i; `turn_ids` (B, T) long, the turn
    of each policy token (0, 1, ...) and -1 on every other position (prompt, tool output,
    chat markers, padding); `turn_rewards` (B, K) p_ik, the part of R_i earned at turn k
    (process rewards from the environment), 0 past a row's turns. The rest of R_i (the
    outcome) is earned at the end. With E_ik = Σ_{k' < k} p_ik' (earned before turn k):

        G_ik = R_i - E_ik                                   (return-to-go of turn k)
        b_gk = mean_{j in g} R_j - mean_{j in g} E_jk       (group's mean return still to come)
        D_ik = G_ik - b_gk = (R_i - μ_g) - (E_ik - mean_{j in g} E_jk)
        σ_g² = 1/(N_g - 1) Σ_{j in g} (1/n_j) Σ_{k < n_j} D_jk²    (n_j: turns of row j)
        A_it = D_i,turn(t) / (σ_g + eps)   on tokens with a turn id, 0 elsewhere.

    A turn is credited only with what is earned from it on (reward-to-go, Williams 1992), the
    per-step form of DeepSeekMath's process-supervised GRPO (Shao et al. 2024, §4.1.3). With
    no per-turn rewards, D_ik = R_i - μ_g and σ_g is GRPO's Bessel std: exactly `grpo`
    broadcast to the tokens. Departs from DeepSeekMath, which normalizes every step reward by
    the group's step mean and std and then sums them: that subtracts the mean once per
    remaining step, a penalty that grows with the episode's own future length. Here the
    baseline of turn k is the group's mean return still to come, so identical members get 0
    at every turn. σ_g pools each member's D over its turns, so a group whose members earn
    equal totals at different turns is scaled, not divided by ~0. Groups of one get 0.
    Shape (B, T). Formula and sources: docs/algorithms.md#turn_grpo.
    """
    if turn_ids is None:
        raise ValueError("turn_grpo needs turn_ids: the (B, T) turn index of every policy token")
    rewards = rewards if rewards.is_floating_point() else rewards.float()  # (B,)
    num_turns = (turn_ids.max(dim=1).values + 1).clamp(min=0)  # (B,) n_i
    width = max(int(num_turns.max()), 1)
    p = torch.zeros(len(rewards), width + 1, dtype=rewards.dtype, device=rewards.device)  # (B, K+1)
    if turn_rewards is not None:
        kept = min(turn_rewards.shape[1], width)  # a reward past a row's last token turn is never "before" one
        p[:, 1: kept + 1] = turn_rewards[:, :kept].to(rewards.dtype)
    earned = p.cumsum(dim=1)[:, :width]  # (B, K) E_ik
    inverse, num_groups = _group_index(group_ids)
    size = _group_sum(torch.ones_like(rewards), inverse, num_groups)  # (B,) N_g
    deviation = (_group_centered(rewards, inverse, num_groups, size)[:, None]  # (B, K) D_ik: R_i - μ_g
                 - _group_centered(earned, inverse, num_groups, size))  # - (E_ik - mean_j E_jk)
    valid = torch.arange(width, device=rewards.device)[None, :] < num_turns[:, None]  # (B, K)
    squares = torch.where(valid, deviation.square(), torch.zeros_like(deviation))
    per_member = squares.sum(dim=1) / valid.sum(dim=1).clamp(min=1)  # (B,)
    std = (_group_sum(per_member, inverse, num_groups) / (size - 1.0).clamp(min=1.0)).sqrt()  # (B,) σ_g
    turn_advantages = torch.where((size > 1)[:, None], deviation / (std[:, None] + eps), torch.zeros_like(deviation))
    token = torch.gather(turn_advantages, 1, turn_ids.clamp(min=0).long())  # (B, T)
    return torch.where(turn_ids >= 0, token, torch.zeros_like(token))


# ---------------------------------------------------------------------------------------------
# Critic-based (PPO) and data filtering
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def gae(
    token_rewards: Tensor,
    values: Tensor,
    loss_mask: Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation over the loss-masked tokens of each row.

    GAE (Schulman et al., 2016): δ_t = r_t + γ V_{t+1} - V_t, Â_t = δ_t + γλ Â_{t+1},
    returns = Â + V, V after the last masked token = 0. Departs: the steps of a row are its
    masked-in tokens only; in multi-turn rows the tool-output tokens (mask 0) between turns
    are skipped, so the step after a turn's last token is the next turn's first token.
    Rewards and values at mask-0 positions are ignored (put rewards on generated tokens).
    Outputs are 0 at mask-0 positions and carry no gradient (they are targets).

    Shapes: token_rewards, values, loss_mask (B, T) -> (advantages, returns) (B, T).
    docs/algorithms.md#gae
    """
    mask = loss_mask.bool()  # (B, T)
    rewards = token_rewards.to(values.dtype)
    advantages = torch.zeros_like(values)  # (B, T)
    next_value = torch.zeros_like(values[:, 0])  # (B,) V of the next masked step
    next_advantage = torch.zeros_like(values[:, 0])  # (B,) Â of the next masked step
    # A backward scan over T, vectorized over rows; a mask-0 column leaves the carry as is.
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage_t = delta + gamma * lam * next_advantage
        on = mask[:, t]
        advantages[:, t] = torch.where(on, advantage_t, torch.zeros_like(advantage_t))
        next_value = torch.where(on, values[:, t], next_value)
        next_advantage = torch.where(on, advantage_t, next_advantage)
    returns = torch.where(mask, advantages + values, torch.zeros_like(values))
    return advantages, returns


def outcome_token_rewards(rewards: Tensor, loss_mask: Tensor) -> Tensor:
    """(B,) outcome rewards placed on each row's last generated token: (B, T), 0 elsewhere.

    docs/algorithms.md#reward-placement. A row with no generated token gets nothing.
    """
    mask = loss_mask.bool()
    last = (mask * torch.arange(mask.shape[1], device=mask.device)[None, :]).argmax(dim=1)  # (B,)
    token_rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    token_rewards[torch.arange(len(rewards), device=mask.device), last] = rewards.float()
    return token_rewards * mask


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """(x − mean) / (std + eps) over the masked entries (population std); 0 where mask is 0.

    docs/algorithms.md#whitening.
    """
    mean = masked_mean(x, mask)
    std = masked_mean((x - mean) ** 2, mask).sqrt()
    return torch.where(mask.bool(), (x - mean) / (std + eps), torch.zeros_like(x))


@torch.no_grad()
def critic_advantages(
    rewards: Tensor,
    values: Tensor,
    loss_mask: Tensor,
    *,
    gamma: float,
    lam: float,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """PPO's advantages and value targets from outcome rewards and the critic's values.

    The outcome reward goes on each row's last generated token; with `kl` (per-token k1, (B, T))
    and `kl_coef` = β every generated token also gets −β·k1 (classic RLHF-PPO puts the KL in
    the reward, not the loss); `gae` then gives per-token advantages and returns; advantages are
    whitened over the batch's generated tokens, as PPO implementations do (returns are not).

    Shapes: rewards (B,); values, loss_mask, kl (B, T) -> (advantages, returns) (B, T).
    docs/algorithms.md#ppo-with-a-critic
    """
    mask = loss_mask.float()
    token_rewards = outcome_token_rewards(rewards, mask)
    if kl is not None and kl_coef > 0:
        token_rewards = token_rewards - kl_coef * kl * mask
    advantages, returns = gae(token_rewards, values, mask, gamma=gamma, lam=lam)
    return whiten(advantages, mask), returns


def zero_spread_groups(rewards: Tensor, group_ids: Tensor, *, atol: float = 1e-8) -> Tensor:
    """(B,) bool: True for members of groups whose rewards are all equal (within `atol`).

    Such groups have zero advantage under every group-relative estimator; DAPO's dynamic
    sampling (Yu et al., 2025) drops them and samples more. A group of size 1 counts as
    zero-spread.
    """
    rewards = rewards if rewards.is_floating_point() else rewards.float()  # (B,)
    inverse, num_groups = _group_index(group_ids)
    empty = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
    group_max = empty.scatter_reduce(0, inverse, rewards, "amax", include_self=False)
    group_min = empty.scatter_reduce(0, inverse, rewards, "amin", include_self=False)
    return (group_max - group_min)[inverse] <= atol
