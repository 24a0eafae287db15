"""Off-policy by k steps: the behaviour-policy importance weight of decoupled PPO.

When the sampler runs up to k steps ahead of the learner (`rl.max_staleness: k`), a trajectory
was drawn from an older policy π_behav, not from π_prox, the policy the update's ratio is taken
against (the learner's weights at the start of the step, recomputed). Decoupled PPO (Hilton et
al., 2021, "Batch size-invariance for policy optimization"; used off-policy by AReaL, Fu et al.,
2025) keeps PPO's clip around π_prox and moves the correction for the old sampler into a
separate, detached weight per token:

    L_t = w_t · ppo_t(π_θ / π_prox, A),     w_t = π_prox(o_t) / π_behav(o_t)  (no gradient)

An unbounded w_t has unbounded variance; it is capped (truncated importance sampling, TIS:
Ionides, 2008; in LLM RL Yao et al., 2025) or tokens past the cap are dropped (masked, MIS):

    truncate: w_t = min(ρ_t, C)          mask: w_t = ρ_t · 1[ρ_t ≤ C]          off: w_t = 1

    weights, metrics = behaviour_weights(prox_logprobs, behaviour_logprobs, loss_mask,
                                         behaviour_weight="truncate", behaviour_weight_cap=2.0)
    loss_matrix = loss_matrix * weights            # before aggregation

docs/algorithms.md#off-policy-by-k.
"""

from __future__ import annotations

import torch
from torch import Tensor

BEHAVIOUR_WEIGHTS = ("truncate", "mask", "off")

_LOG_RATIO_CLAMP = 20.0  # exp(20) is far past any cap


def behaviour_weights(
    prox_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    behaviour_weight: str = "truncate",
    behaviour_weight_cap: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token weights π_prox/π_behav, capped or masked at C; 0 where `loss_mask` is 0.

    Shapes: all (B, T). Returns detached (B, T) weights and scalar metrics over the masked
    tokens: ratio_mean, ratio_max, ratio_min (before the cap), capped_frac (tokens past C),
    weight_mean (after it).
    """
    if behaviour_weight not in BEHAVIOUR_WEIGHTS:
        raise ValueError(f"behaviour_weight: expected one of {', '.join(BEHAVIOUR_WEIGHTS)}, got {behaviour_weight!r}")
    if behaviour_weight_cap <= 0:
        raise ValueError(f"behaviour_weight_cap must be > 0, got {behaviour_weight_cap}")
    mask = loss_mask.bool()  # (B, T)
    with torch.no_grad():
        log_ratio = torch.where(mask, prox_logprobs - behaviour_logprobs, torch.zeros_like(prox_logprobs))
        ratio = log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP).exp()  # (B, T)
        capped = ratio > behaviour_weight_cap
        if behaviour_weight == "truncate":
            weights = ratio.clamp(max=behaviour_weight_cap)
        elif behaviour_weight == "mask":
            weights = torch.where(capped, torch.zeros_like(ratio), ratio)
        else:
            weights = torch.ones_like(ratio)
        weights = torch.where(mask, weights, torch.zeros_like(weights))
        n = mask.sum().clamp(min=1)
        inf = torch.tensor(float("inf"), dtype=ratio.dtype, device=ratio.device)
        empty = not bool(mask.any())
        metrics = {
            "ratio_mean": torch.where(mask, ratio, 0.0).sum() / n,
            "ratio_max": torch.tensor(0.0) if empty else torch.where(mask, ratio, -inf).max(),
            "ratio_min": torch.tensor(0.0) if empty else torch.where(mask, ratio, inf).min(),
            "capped_frac": (capped & mask).sum() / n,
            "weight_mean": weights.sum() / n,
        }
    return weights, metrics
