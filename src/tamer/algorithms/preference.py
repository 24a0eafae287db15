"""Preference losses and metrics for reward models: Bradley–Terry, pairwise accuracy, calibration.

A reward model r(x, y) scores a prompt x with a reply y. Bradley–Terry (1952) models a
labeller's choice between two replies as

    P(y_c ≻ y_r | x) = σ(r(x, y_c) − r(x, y_r))

and the reward model is fit by maximising the likelihood of the recorded choices
(Ouyang et al., 2022, eq. 1; Stiennon et al., 2020). With a margin m ≥ 0 per pair
(Llama 2, Touvron et al., 2023, eq. 2) the loss asks the chosen reply to win by at least m:

    loss = −log σ(r_c − r_r − m)

Rewards are identified only up to an additive constant; `center_coef` adds
c · mean((r_c + r_r)²) to pin their mean near 0 (TRL's `center_rewards_coefficient`,
Eisenstein et al., 2023), which keeps scores comparable across checkpoints.

    loss, metrics = bradley_terry_loss(chosen_rewards, rejected_rewards, margins)
    report = calibration(chosen_rewards - rejected_rewards, bins=10)   # accuracy, ECE, per-bin rows

Pure functions over tensors: no I/O, no config objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor


def bradley_terry_loss(
    chosen_rewards: Tensor,  # (B,) float
    rejected_rewards: Tensor,  # (B,) float
    margins: Tensor | None = None,  # (B,) float, >= 0; None: no margin
    center_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean of −log σ(r_c − r_r − m) over the pairs, plus c · mean((r_c + r_r)²).

    Returns the scalar loss and detached metrics: pairwise accuracy (r_c > r_r; ties count
    as wrong), the mean reward gap r_c − r_r, and the mean reward.
    """
    if chosen_rewards.shape != rejected_rewards.shape or chosen_rewards.dim() != 1:
        raise ValueError(f"chosen and rejected rewards must be two (B,) tensors, got "
                         f"{tuple(chosen_rewards.shape)} and {tuple(rejected_rewards.shape)}")
    gap = chosen_rewards.float() - rejected_rewards.float()  # (B,)
    target = gap if margins is None else gap - margins.to(gap)
    loss = -F.logsigmoid(target).mean()  # logsigmoid: stable for large |gap|
    if center_coef:
        loss = loss + center_coef * (chosen_rewards.float() + rejected_rewards.float()).square().mean()
    metrics = {"accuracy": (gap > 0).float().mean().detach(), "reward_gap": gap.mean().detach(),
               "reward_mean": 0.5 * (chosen_rewards.float() + rejected_rewards.float()).mean().detach()}
    return loss, metrics


@dataclass
class CalibrationBin:
    """Pairs whose predicted confidence fell in [low, high)."""

    low: float
    high: float
    count: int
    confidence: float  # mean predicted P(the reply the model prefers is the chosen one)
    accuracy: float  # fraction of those pairs the model got right


@dataclass
class CalibrationReport:
    """How far the model's predicted win probabilities are from its observed accuracy."""

    accuracy: float  # pairwise accuracy: fraction with r_c > r_r
    ece: float  # expected calibration error: Σ_bins (n_b / N) |accuracy_b − confidence_b|
    mean_confidence: float
    bins: list[CalibrationBin] = field(default_factory=list)

    def metrics(self, prefix: str = "rm_eval") -> dict[str, float]:
        return {f"{prefix}/accuracy": self.accuracy, f"{prefix}/ece": self.ece,
                f"{prefix}/mean_confidence": self.mean_confidence}


def calibration(reward_gaps: Tensor, bins: int = 10) -> CalibrationReport:
    """Pairwise accuracy and calibration of P(chosen ≻ rejected) = σ(r_c − r_r).

    Every held-out pair's label is "chosen wins", so the question a calibration curve asks
    is: when the model is p-confident about a pair, is it right a fraction p of the time?
    The model prefers the chosen reply when the gap is positive (confidence σ(gap)) and the
    rejected one otherwise (confidence σ(−gap)); confidence = σ(|gap|) ∈ [0.5, 1], binned
    uniformly over [0.5, 1]. A tie (gap exactly 0) counts as wrong at confidence 0.5.
    (Scoring each pair in both orders gives the same bins mirrored about 0.5.)
    """
    if reward_gaps.numel() == 0:
        raise ValueError("calibration needs at least one pair")
    if bins < 1:
        raise ValueError(f"bins: expected >= 1, got {bins}")
    gaps = reward_gaps.detach().float().flatten()
    correct = (gaps > 0).float()  # (N,)
    confidence = torch.sigmoid(gaps.abs())  # (N,) in [0.5, 1)
    index = ((confidence - 0.5) * 2 * bins).long().clamp(0, bins - 1)  # (N,)
    rows, ece = [], 0.0
    for b in range(bins):
        member = index == b
        n = int(member.sum())
        low, high = 0.5 + b / (2 * bins), 0.5 + (b + 1) / (2 * bins)
        if n == 0:
            rows.append(CalibrationBin(low, high, 0, float("nan"), float("nan")))
            continue
        conf, acc = float(confidence[member].mean()), float(correct[member].mean())
        ece += n / len(gaps) * abs(acc - conf)
        rows.append(CalibrationBin(low, high, n, conf, acc))
    return CalibrationReport(float(correct.mean()), ece, float(confidence.mean()), rows)
