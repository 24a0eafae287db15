"""Sampler/learner mismatch: TIS weights and logprob-gap metrics on hand-computed batches."""

import math

import pytest
import torch

from tamer.algorithms.mismatch import logprob_gap, truncated_importance_weights

# Row 0: log-ratios 0.5, -1.0, 0.0 and a padding slot; row 1: 1.0, 0.5 and two padding slots.
LEARNER = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.2, -0.3, 0.0, 0.0]])
SAMPLER = torch.tensor([[-1.5, -1.0, -0.5, -float("inf")], [-1.2, -0.8, 5.0, float("nan")]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])


def test_token_level_weights_by_hand():
    weights, m = truncated_importance_weights(LEARNER, SAMPLER, MASK, cap=1.5)
    e = math.exp
    expected = torch.tensor([[1.5, e(-1.0), 1.0, 1.0], [1.5, 1.5, 1.0, 1.0]])  # min(e^x, 1.5); 1 off the mask
    torch.testing.assert_close(weights, expected)
    assert not weights.requires_grad
    assert m["tis_clip_frac"].item() == pytest.approx(3 / 5)  # e^0.5, e^1.0, e^0.5 exceed 1.5
    assert m["tis_weight_mean"].item() == pytest.approx((1.5 + e(-1) + 1 + 1.5 + 1.5) / 5)
    assert m["logprob_gap_mean"].item() == pytest.approx((0.5 + 1.0 + 0.0 + 1.0 + 0.5) / 5)
    assert m["logprob_gap_max"].item() == pytest.approx(1.0)
    k3 = [e(d) - 1 - d for d in (0.5, -1.0, 0.0, 1.0, 0.5)]
    assert m["kl_k3"].item() == pytest.approx(sum(k3) / 5, rel=1e-5)


def test_sequence_level_weights_by_hand():
    weights, m = truncated_importance_weights(LEARNER, SAMPLER, MASK, cap=2.0, level="sequence")
    # Row 0: Π ratio = e^(0.5 - 1.0) = e^-0.5 (under the cap); row 1: e^1.5 ≈ 4.48, capped at 2.
    expected = torch.tensor([[math.exp(-0.5)] * 3 + [1.0], [2.0, 2.0, 1.0, 1.0]])
    torch.testing.assert_close(weights, expected)
    assert m["tis_clip_frac"].item() == pytest.approx(0.5)  # one row of two


def test_equal_logprobs_give_unit_weights_and_zero_gap():
    lp = torch.randn(3, 5)
    weights, m = truncated_importance_weights(lp, lp.clone(), torch.ones(3, 5), cap=1.0)
    assert torch.equal(weights, torch.ones(3, 5))
    assert m["logprob_gap_max"].item() == 0.0 and m["kl_k3"].item() == 0.0 and m["tis_clip_frac"].item() == 0.0


def test_weights_carry_no_gradient_and_scale_the_loss():
    learner = LEARNER.clone().requires_grad_(True)
    weights, _ = truncated_importance_weights(learner, SAMPLER, MASK, cap=1.5)
    loss = (weights * -learner * MASK).sum()
    loss.backward()
    torch.testing.assert_close(learner.grad, -weights * MASK)  # the weight multiplies the gradient, untouched


def test_empty_mask_and_bad_arguments():
    assert logprob_gap(LEARNER, SAMPLER, torch.zeros_like(MASK))["logprob_gap_max"].item() == 0.0
    with pytest.raises(ValueError, match="tis_cap"):
        truncated_importance_weights(LEARNER, SAMPLER, MASK, cap=0.5)
    with pytest.raises(ValueError, match="tis_level"):
        truncated_importance_weights(LEARNER, SAMPLER, MASK, level="word")
