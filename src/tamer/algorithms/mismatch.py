"""Sampler/learner mismatch: how far the engine's logprobs are from the learner's, and TIS.

A separate inference engine (vLLM, or the same model under bf16) does not compute exactly the
learner's probabilities: its kernels, precision and batching differ. The trajectories were then
sampled from π_sampler, while the loss's π_old is the learner's π_learner at the same weights.
Truncated importance sampling (TIS; Yao et al., 2025, "Your Efficient RL Framework Secretly
Brings You Off-Policy RL Training") reweights each token's loss by the capped ratio

    w_t = min(π_learner(o_t) / π_sampler(o_t), C)        (detached; no gradient flows through w)

so the update is again an estimate under the learner's own distribution, with the cap bounding
the variance. The sequence level uses one weight per row, min(Π_t ratio_t, C).

    weights, metrics = truncated_importance_weights(learner_old, sampler, loss_mask, cap=2.0)
    loss_matrix = weights * loss_matrix                  # before `aggregate`

Shapes: logprobs and loss_mask (B, T); weights (B, T) float32, 1.0 where loss_mask is 0.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tamer.algorithms.losses import masked_mean

TIS_LEVELS = ("token", "sequence")


def _masked_log_ratio(learner_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log π_learner - log π_sampler in float32, 0 where `mask` is unset (padding may hold inf). (B, T)"""
    diff = learner_logprobs.float() - sampler_logprobs.float()
    return torch.where(mask, diff, torch.zeros_like(diff))


def logprob_gap(learner_logprobs: Tensor, sampler_logprobs: Tensor, loss_mask: Tensor) -> dict[str, Tensor]:
    """|log π_learner - log π_sampler| over the masked tokens: mean and max (detached scalars).

    Also the k3 estimate of KL(π_sampler || π_learner) on the sampler's own tokens,
    (r - 1) - log r with r = π_learner / π_sampler: unbiased and >= 0.
    """
    mask = loss_mask.bool()
    with torch.no_grad():
        diff = _masked_log_ratio(learner_logprobs, sampler_logprobs, mask)  # (B, T)
        gap = diff.abs()
        k3 = torch.expm1(diff.clamp(max=20.0)) - diff
        return {
            "logprob_gap_mean": masked_mean(gap, mask),
            "logprob_gap_max": gap.max() if mask.any() else gap.new_zeros(()),
            "kl_k3": masked_mean(k3, mask),
        }


def truncated_importance_weights(
    learner_logprobs: Tensor,
    sampler_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    cap: float = 2.0,
    level: str = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """TIS weights min(π_learner / π_sampler, cap) per token (or per sequence), and mismatch metrics.

    `learner_logprobs` are the learner's logprobs of the sampled tokens at the weights that
    sampled them (π_old recomputed by a learner forward; on-policy, the current logprobs
    detached). Returns the (B, T) weights, detached, 1.0 where `loss_mask` is 0, and metrics
    logprob_gap_mean, logprob_gap_max, kl_k3, tis_weight_mean and tis_clip_frac (the share of
    masked tokens, or of rows at the sequence level, whose ratio exceeded the cap).
    """
    if cap < 1.0:
        raise ValueError(f"tis_cap: expected >= 1 (a cap below 1 would down-weight every token), got {cap}")
    if level not in TIS_LEVELS:
        raise ValueError(f"tis_level: expected one of {', '.join(TIS_LEVELS)}, got {level!r}")
    mask = loss_mask.bool()  # (B, T)
    metrics = logprob_gap(learner_logprobs, sampler_logprobs, loss_mask)
    with torch.no_grad():
        log_ratio = _masked_log_ratio(learner_logprobs, sampler_logprobs, mask)  # (B, T)
        log_cap = math.log(cap)
        if level == "sequence":
            seq = log_ratio.sum(-1, keepdim=True)  # (B, 1) log Π_t ratio_t
            clipped = (seq > log_cap).expand_as(mask)  # (B, T)
            weights = torch.exp(seq.clamp(max=log_cap)).expand_as(log_ratio)  # (B, T)
            rows = mask.any(-1)
            metrics["tis_clip_frac"] = masked_mean(clipped[:, 0].float(), rows)
        else:
            clipped = log_ratio > log_cap
            weights = torch.exp(log_ratio.clamp(max=log_cap))  # (B, T); exp(min(x, log C)) = min(e^x, C)
            metrics["tis_clip_frac"] = masked_mean(clipped.float(), mask)
        weights = torch.where(mask, weights, torch.ones_like(weights))
        metrics["tis_weight_mean"] = masked_mean(weights, mask)
    return weights, metrics
