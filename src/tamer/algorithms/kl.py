"""Per-token KL estimators between the policy and a frozen reference.

Schulman, "Approximating KL divergence" (2020), http://joschu.net/blog/kl-approx.html.
Samples come from π_θ; with log r = ref_logprobs - logprobs:

    k1 = -log r               unbiased, high variance, can be negative
    k2 = ½ (log r)²           low variance, biased
    k3 = (r - 1) - log r      unbiased, always >= 0 (GRPO's β·KL loss term)

    kl = kl_penalty(logprobs, ref_logprobs, "k3")  # (B, T); the caller applies loss_mask

Nothing is masked here: positions outside the loss mask hold whatever the inputs give.
docs/algorithms.md#kl-estimators has the formulas and when each is a loss or a reward term.
"""

from __future__ import annotations

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")

# exp(20) ≈ 4.9e8: far beyond any ratio that matters, well inside float32 (and bf16) range.
_LOG_RATIO_CLAMP = 20.0


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(π_θ || π_ref): (B, T), (B, T) -> (B, T).

    For k3 the log-ratio is clamped to [-20, 20] before exp so one wild token cannot make
    the loss inf; the value is then k3 of the clamped log-ratio (still >= 0), and tokens
    beyond the clamp get no gradient. k1 and k2 are not clamped (no exp, nothing overflows).
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; valid names: {', '.join(KL_ESTIMATORS)}")
    log_ratio = ref_logprobs - logprobs  # (B, T) log r
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    log_ratio = log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    # expm1 keeps (r - 1) exact for r near 1, where k3 ≈ ½ (log r)² is tiny.
    return torch.expm1(log_ratio) - log_ratio
