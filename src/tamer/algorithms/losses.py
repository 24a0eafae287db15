"""Policy and value losses: per-token surrogates, and how a loss matrix becomes a scalar.

A policy loss maps per-token logprobs to a (B, T) loss matrix (0 where loss_mask == 0) plus
detached scalar metrics; `aggregate` then reduces it in one of the papers' ways. The two
steps are separate because the choice of aggregation is itself an algorithm choice
(GRPO vs DAPO vs Dr. GRPO):

    fn = get_policy_loss_fn("ppo")
    loss_matrix, metrics = fn(logprobs, old_logprobs, advantages, loss_mask, clip_eps_low=0.2, clip_eps_high=0.28)
    loss = aggregate(loss_matrix, loss_mask, "token-mean")

Each loss takes its own hyperparameters as keywords; the trainer binds them once from the
config fields of the same names (`rl.algorithm.clip_eps_high`, `rl.algorithm.gspo_eps_low`).
Masking uses `torch.where`, never multiplication, so inf/NaN logprobs at padding positions
reach neither the loss nor the gradient. Formulas and sources: docs/algorithms.md#policy-losses
and docs/algorithms.md#aggregation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tamer.algorithms.kl import kl_penalty
from tamer.registry import Registry

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]

POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# Bound on |logprobs - old_logprobs| before exp: exp(20) ≈ 4.9e8 is already fully clipped.
_LOG_RATIO_CLAMP = 20.0


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered under `name` (KeyError lists valid names)."""
    return POLICY_LOSSES.get(name)


# ---------------------------------------------------------------------------------------------
# Masking helpers
# ---------------------------------------------------------------------------------------------


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over positions where mask (0/1 or bool) is set; 0 where nothing is set.

    dim=None reduces everything to a scalar; otherwise reduces `dim`. Masked-out entries
    of x may be inf or NaN: they are selected away, not multiplied by 0.
    """
    mask = mask.bool()
    total = torch.where(mask, x, torch.zeros_like(x))
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    total = total.sum() if dim is None else total.sum(dim=dim)
    return total / count.clamp(min=1).to(total.dtype)


def _masked_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log ρ = logprobs - old_logprobs, 0 at masked-out positions, clamped to ±20. (B, T)"""
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    return log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def _broadcast_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    """(B,) or (B, T) advantages -> (B, T), detached (advantages are constants)."""
    advantages = advantages.detach().to(like.dtype)
    return advantages.unsqueeze(-1).expand_as(like) if advantages.dim() == 1 else advantages


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor]:
    """-min(ρA, clip(ρ, 1-ε_low, 1+ε_high)A) and where the clipped branch won. (B, T) each."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _ratio_metrics(
    ratio: Tensor, log_ratio: Tensor, is_clipped: Tensor, mask: Tensor
) -> dict[str, Tensor]:
    """Detached scalars every ratio-based loss reports."""
    with torch.no_grad():
        # approx_kl: k3 estimate of KL(π_old || π_θ) on samples from π_old, i.e.
        # (ρ - 1) - log ρ; unbiased and >= 0 (see kl.py).
        approx_kl = kl_penalty(torch.zeros_like(log_ratio), log_ratio, "k3")
        return {
            "clip_frac": masked_mean(is_clipped.to(ratio.dtype), mask),
            "ratio_mean": masked_mean(ratio, mask),
            "approx_kl": masked_mean(approx_kl, mask),
        }


# ---------------------------------------------------------------------------------------------
# Policy losses
# ---------------------------------------------------------------------------------------------


@POLICY_LOSSES.register("ppo")
def ppo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate, per token: -min(ρA, clip(ρ, 1-ε_low, 1+ε_high)A).

    PPO (Schulman et al., 2017); also GRPO's loss (Shao et al., 2024) and DAPO's with
    clip-higher ε_high = 0.28 (Yu et al., 2025). Dual clip (Ye et al., 2020, "Mastering
    Complex Control in MOBA Games"): for A < 0 the loss is also bounded by -c·A, c > 1.
    Departs: log ρ is clamped to ±20 before exp (those ratios are clipped anyway).

    Shapes: logprobs, old_logprobs, loss_mask (B, T); advantages (B,) or (B, T).
    Returns the (B, T) loss matrix (0 where loss_mask == 0) and detached metrics
    clip_frac, ratio_mean, approx_kl (plus dual_clip_frac when dual clip is on).
    docs/algorithms.md#ppo, #clip-higher, #dual-clip
    """
    mask = loss_mask.bool()  # (B, T)
    advantages = _broadcast_advantages(advantages, logprobs)  # (B, T)
    log_ratio = _masked_log_ratio(logprobs, old_logprobs, mask)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    losses, is_clipped = _clipped_surrogate(ratio, advantages, clip_eps_low, clip_eps_high)
    metrics = _ratio_metrics(ratio, log_ratio, is_clipped, mask)
    if dual_clip_c is not None:
        if dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
        bound = -dual_clip_c * advantages  # (B, T) positive where A < 0
        is_dual = (advantages < 0) & (losses > bound)
        losses = torch.where(is_dual, bound, losses)
        metrics["dual_clip_frac"] = masked_mean(is_dual.to(ratio.dtype), mask).detach()
    return torch.where(mask, losses, torch.zeros_like(losses)), metrics


@POLICY_LOSSES.register("gspo")
def gspo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    gspo_eps_low: float = 3e-4,
    gspo_eps_high: float = 4e-4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: one importance ratio per sequence, s_i = exp(mean_t (logprobs - old_logprobs)).

    Group Sequence Policy Optimization (Zheng et al., 2025), in its token-level form
    ("GSPO-token"): s_{i,t} = sg[s_i] · π_θ(o_t) / sg[π_θ(o_t)], equal to s_i in value and
    in gradient for sequence-level advantages, and also defined for (B, T) advantages.
    Clipped with GSPO's own small ε (paper: 3e-4 / 4e-4), under their own names: the token
    ratios' clip_eps_* and dual_clip_c do not apply. Departs: the mean log-ratio is clamped to
    ±20 before exp. docs/algorithms.md#gspo
    """
    mask = loss_mask.bool()  # (B, T)
    advantages = _broadcast_advantages(advantages, logprobs)  # (B, T)
    log_ratio = _masked_log_ratio(logprobs, old_logprobs, mask)  # (B, T)
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1)  # (B,) log s_i
    token_logprobs = torch.where(mask, logprobs, torch.zeros_like(logprobs))  # (B, T)
    log_ratio_token = (
        seq_log_ratio.detach().unsqueeze(-1) + token_logprobs - token_logprobs.detach()
    )  # (B, T) log s_{i,t}, value log s_i
    ratio = torch.exp(log_ratio_token)  # (B, T)
    losses, is_clipped = _clipped_surrogate(ratio, advantages, gspo_eps_low, gspo_eps_high)
    metrics = _ratio_metrics(ratio, log_ratio, is_clipped, mask)
    return torch.where(mask, losses, torch.zeros_like(losses)), metrics


# ---------------------------------------------------------------------------------------------
# Aggregation and the critic's loss
# ---------------------------------------------------------------------------------------------


def aggregate(
    loss_matrix: Tensor, loss_mask: Tensor, mode: str, *, constant: float | None = None
) -> Tensor:
    """Reduce a (B, T) loss matrix to a scalar over the loss-masked tokens.

    token-mean:              Σ_{i,t} L / Σ_i |o_i|                  (DAPO)
    seq-mean-token-mean:     mean_i (Σ_t L_i / |o_i|)                (original GRPO)
    seq-mean-token-sum-norm: mean_i (Σ_t L_i / C), C = `constant` or T (Dr. GRPO)

    Rows with no masked token contribute 0 and are left out of the sequence means; if every
    row is empty the result is a 0 that still carries the graph (backward works).
    docs/algorithms.md#aggregation
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; valid modes: {', '.join(AGGREGATIONS)}")
    mask = loss_mask.bool()  # (B, T)
    if mode == "token-mean":
        return masked_mean(loss_matrix, mask)
    if mode == "seq-mean-token-mean":
        per_seq = masked_mean(loss_matrix, mask, dim=-1)  # (B,)
    else:
        norm = float(loss_matrix.shape[-1]) if constant is None else float(constant)
        if norm <= 0:
            raise ValueError(f"constant must be > 0, got {constant}")
        per_seq = torch.where(mask, loss_matrix, torch.zeros_like(loss_matrix)).sum(-1) / norm
    nonempty = mask.any(dim=-1)  # (B,)
    return masked_mean(per_seq, nonempty)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    loss_mask: Tensor,
    *,
    clip_eps: float | None = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's critic loss: ½·max((V - R)², (clip(V, V_old ± ε) - R)²), masked token-mean.

    PPO (Schulman et al., 2017), value clipping as in OpenAI baselines' ppo2.
    clip_eps=None gives the plain ½(V - R)². Shapes: all (B, T). Metric value_clip_frac:
    fraction of masked tokens where the clipped term was the larger one. docs/algorithms.md#value-loss
    """
    mask = loss_mask.bool()  # (B, T)
    returns = returns.detach()
    unclipped = (values - returns).square()  # (B, T)
    if clip_eps is None:
        losses, is_clipped = unclipped, torch.zeros_like(mask)
    else:
        old_values = old_values.detach()
        clipped_values = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        clipped = (clipped_values - returns).square()  # (B, T)
        losses, is_clipped = torch.maximum(unclipped, clipped), clipped > unclipped
    loss = 0.5 * masked_mean(losses, mask)
    metrics = {"value_clip_frac": masked_mean(is_clipped.to(values.dtype), mask).detach()}
    return loss, metrics
