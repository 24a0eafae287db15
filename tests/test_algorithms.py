"""Math tier: hand-computed cases for tamer.algorithms (advantages, losses, KL, aggregation).

Every expected number is a literal worked out by hand in the comment beside it.
"""

from __future__ import annotations

import math

import pytest
import torch

from tamer.algorithms import (
    ADVANTAGES,
    AGGREGATIONS,
    KL_ESTIMATORS,
    PER_TURN,
    POLICY_LOSSES,
    aggregate,
    critic_advantages,
    gae,
    get_advantage_fn,
    get_policy_loss_fn,
    kl_penalty,
    masked_mean,
    outcome_token_rewards,
    value_loss,
    whiten,
    zero_spread_groups,
)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32),
        torch.as_tensor(expected, dtype=torch.float32),
        atol=atol,
        rtol=0,
    )


# Three groups, interleaved, unsorted, non-contiguous ids, sizes 4 / 2 / 1:
#   group 7: rewards [1, 0, 0, 1]   group 5: [0, 3]   group 3: [2]
IDS = torch.tensor([7, 5, 7, 3, 7, 5, 7])
REWARDS = torch.tensor([1.0, 0.0, 0.0, 2.0, 0.0, 3.0, 1.0])


# ---------------------------------------------------------------------------------------------
# Registries
# ---------------------------------------------------------------------------------------------


def test_registries_list_names_and_reject_unknown():
    assert ADVANTAGES.names() == ["dr_grpo", "grpo", "reinforce_pp", "rloo", "turn_grpo"]
    assert POLICY_LOSSES.names() == ["gspo", "ppo"]
    assert get_advantage_fn("grpo") is ADVANTAGES.get("grpo")
    with pytest.raises(KeyError, match="valid names: dr_grpo, grpo"):
        get_advantage_fn("nope")
    with pytest.raises(KeyError, match="valid names: gspo, ppo"):
        get_policy_loss_fn("nope")


def test_one_call_signature_and_hyperparameters_bound_from_same_named_fields():
    from types import SimpleNamespace

    from tamer.algorithms import bind

    for name in ADVANTAGES:  # every estimator takes (rewards, group_ids, loss_mask); per-turn ones also turns
        if name in PER_TURN:
            turns = torch.zeros(7, 3, dtype=torch.long)
            assert get_advantage_fn(name)(REWARDS, IDS, torch.ones(7, 3), turns, None).shape == (7, 3)
            continue
        assert get_advantage_fn(name)(REWARDS, IDS, torch.ones(7, 3)).shape == (7,)
    with pytest.raises(TypeError):  # no keyword is silently ignored
        get_advantage_fn("dr_grpo")(REWARDS, IDS, eps=1e-6)
    source = SimpleNamespace(eps=0.5, clip_eps_high=0.28, gspo_eps_low=1e-3, unrelated=1)
    assert bind(get_advantage_fn("grpo"), source).keywords == {"eps": 0.5}
    assert bind(get_advantage_fn("rloo"), source).keywords == {}
    assert bind(get_policy_loss_fn("ppo"), source).keywords == {"clip_eps_high": 0.28}
    assert bind(get_policy_loss_fn("gspo"), source).keywords == {"gspo_eps_low": 1e-3}


# ---------------------------------------------------------------------------------------------
# Outcome advantages
# ---------------------------------------------------------------------------------------------


def test_grpo_unbiased_std():
    # group 7: mean .5, unbiased std sqrt((4 * .25) / 3) = .57735 -> ±.5/.57735 = ±.866025
    # group 5: mean 1.5, unbiased std sqrt((2.25 + 2.25) / 1) = 2.12132 -> ±.707107
    # group 3: size 1 -> 0
    adv = get_advantage_fn("grpo")(REWARDS, IDS)
    close(adv, [0.866025, -0.707107, -0.866025, 0.0, -0.866025, 0.707107, 0.866025])


def test_grpo_population_std():
    # group 7: population std .5 -> ±1;  group 5: population std 1.5 -> ±1
    adv = get_advantage_fn("grpo")(REWARDS, IDS, unbiased_std=False)
    close(adv, [1.0, -1.0, -1.0, 0.0, -1.0, 1.0, 1.0])


def test_grpo_equal_rewards_give_zero_not_nan():
    # std 0 -> 0 / (0 + eps) = 0
    adv = get_advantage_fn("grpo")(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0]))
    close(adv, [0.0, 0.0, 0.0])


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_equal_rewards_give_exactly_zero_whatever_their_rounding(name):
    # eight float32 rewards of 0.95 (or of 1 + 3 x 0.1) summed in order have a mean one rounding step
    # off; divided by the group's ~1e-8 std that gave every member of the 0.95 group 0.056 (and -0.106
    # for 1.3) before the mean was taken of the rewards minus the group's minimum. Group 2: [0, 1] x 4,
    # centered +-0.5, so the batch mean REINFORCE++ subtracts is exactly 0 too.
    rewards = torch.tensor([0.95] * 8 + [1.0 + 3 * 0.1] * 8 + [0.0, 1.0] * 4)
    ids = torch.tensor([0] * 8 + [1] * 8 + [2] * 8)
    adv = get_advantage_fn(name)(rewards, ids)
    assert torch.equal(adv[:16], torch.zeros(16))
    assert bool((adv[16:] != 0).all())


def test_dr_grpo():
    # r - group mean: group 7 mean .5, group 5 mean 1.5, group 3 mean 2
    adv = get_advantage_fn("dr_grpo")(REWARDS, IDS)
    close(adv, [0.5, -1.5, -0.5, 0.0, -0.5, 1.5, 0.5])


def test_rloo():
    # group 7: a 1 sees others [0, 0, 1] mean 1/3 -> 2/3; a 0 sees [1, 0, 1] mean 2/3 -> -2/3
    # group 5: 0 - 3 = -3, 3 - 0 = 3; group 3: size 1 -> 0
    adv = get_advantage_fn("rloo")(REWARDS, IDS)
    close(adv, [2 / 3, -3.0, -2 / 3, 0.0, -2 / 3, 3.0, 2 / 3])


def test_reinforce_pp_token_weighted_whitening():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    ids = torch.tensor([0, 0, 1, 1])
    # group-centered: [.5, -.5, 0, 0]; token weights (mask row sums) [3, 1, 2, 2], total 8
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 1, 1]])
    # mean = (3*.5 - .5) / 8 = .125
    # var = (3*.375² + .625² + 2*.125² + 2*.125²) / 8 = (.421875 + .390625 + .0625) / 8 = .109375
    # std = .330719 -> [.375/.330719, -.625/.330719, -.125/.330719, same]
    adv = get_advantage_fn("reinforce_pp")(rewards, ids, loss_mask=mask)
    close(adv, [1.133893, -1.889822, -0.377964, -0.377964])
    # no mask: weights 1 -> mean 0, var (.25 + .25) / 4 = .125, std .353553
    adv = get_advantage_fn("reinforce_pp")(rewards, ids)
    close(adv, [1.414214, -1.414214, 0.0, 0.0])


def _loop_reference(rewards, ids, name):
    out = []
    for i in range(len(rewards)):
        group = [rewards[j] for j in range(len(rewards)) if ids[j] == ids[i]]
        n, mean = len(group), sum(group) / len(group)
        if name == "dr_grpo":
            out.append(rewards[i] - mean)
        elif n == 1:
            out.append(0.0)
        elif name == "rloo":
            out.append(rewards[i] - (sum(group) - rewards[i]) / (n - 1))
        else:  # grpo
            std = math.sqrt(sum((r - mean) ** 2 for r in group) / (n - 1))
            out.append((rewards[i] - mean) / (std + 1e-6))
    return out


@pytest.mark.parametrize("name", ["grpo", "rloo", "dr_grpo"])
def test_vectorized_matches_loop(name):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 9, (40,), generator=gen) * 3 + 11  # sparse, unsorted ids
    rewards = torch.randint(0, 3, (40,), generator=gen).float() + torch.rand(40, generator=gen)
    expected = _loop_reference(rewards.tolist(), ids.tolist(), name)
    close(get_advantage_fn(name)(rewards, ids), expected, atol=1e-4)


def test_zero_spread_groups():
    # group 0 all 1 -> True; group 1 [0, 1] -> False; group 2 singleton -> True
    rewards = torch.tensor([1.0, 0.0, 1.0, 5.0, 1.0])
    ids = torch.tensor([0, 1, 0, 2, 1])
    assert zero_spread_groups(rewards, ids).tolist() == [True, False, True, True, False]


# ---------------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------------


def test_gae_multi_turn_mask_gap():
    # row 0: mask [1, 1, 0, 1, 0] -- a tool-output token at 2 between turns, padding at 4.
    # Steps are positions 0, 1, 3; junk (9, 7) at mask-0 positions must be ignored.
    # γ = .9, λ = .8, γλ = .72
    # pos 3: δ = 1 + 0 - .6 = .4;              A = .4;                       R = 1.0
    # pos 1: δ = 0 + .9*.6 - .4 = .14;         A = .14 + .72*.4 = .428;      R = .828
    # pos 0: δ = 0 + .9*.4 - .5 = -.14;        A = -.14 + .72*.428 = .16816; R = .66816
    # row 1: all masked out -> zeros
    rewards = torch.tensor([[0.0, 0.0, 9.0, 1.0, 9.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    values = torch.tensor([[0.5, 0.4, 7.0, 0.6, 7.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.16816, 0.428, 0.0, 0.4, 0.0], [0.0] * 5])
    close(ret, [[0.66816, 0.828, 0.0, 1.0, 0.0], [0.0] * 5])


def test_gae_matches_per_row_loop():
    gen = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(4, 9, generator=gen), torch.randn(4, 9, generator=gen)
    mask = torch.rand(4, 9, generator=gen) > 0.4
    gamma, lam = 0.95, 0.9
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    for b in range(4):
        steps = mask[b].nonzero().flatten().tolist()
        next_v, next_a = 0.0, 0.0
        expected = torch.zeros(9)
        for t in reversed(steps):
            next_a = rewards[b, t] + gamma * next_v - values[b, t] + gamma * lam * next_a
            next_v = values[b, t]
            expected[t] = next_a
        close(adv[b], expected)
        close(ret[b], torch.where(mask[b], expected + values[b], 0.0))


# ---------------------------------------------------------------------------------------------
# Policy losses
# ---------------------------------------------------------------------------------------------


def _logs(ratios):
    return torch.log(torch.tensor(ratios))


def test_ppo_clipped_and_unclipped_tokens():
    # ε_low = ε_high = .2; ratios per row [1.5, .5, 1.1]
    # A = +1: 1.5 -> min(1.5, 1.2) = 1.2 clipped; .5 -> min(.5, .8) = .5; 1.1 -> 1.1
    # A = -1: 1.5 -> min(-1.5, -1.2) = -1.5; .5 -> min(-.5, -.8) = -.8 clipped; 1.1 -> -1.1
    old = torch.zeros(2, 3)
    logprobs = _logs([[1.5, 0.5, 1.1], [1.5, 0.5, 1.1]])
    mask = torch.ones(2, 3)
    loss, m = get_policy_loss_fn("ppo")(logprobs, old, torch.tensor([1.0, -1.0]), mask)
    close(loss, [[-1.2, -0.5, -1.1], [1.5, 0.8, 1.1]])
    close(m["clip_frac"], 2 / 6)
    close(m["ratio_mean"], (1.5 + 0.5 + 1.1) / 3)
    # approx_kl = mean of k3 = (ρ - 1) - log ρ over the 6 tokens (both rows equal):
    # 1.5: .5 - .405465 = .094535; .5: -.5 + .693147 = .193147; 1.1: .1 - .095310 = .004690
    close(m["approx_kl"], (0.094535 + 0.193147 + 0.004690) / 3)
    assert all(not v.requires_grad for v in m.values())


def test_ppo_clip_higher_asymmetry():
    # ρ = 1.25, A = +1: ε_high .28 -> 1.25 (not clipped); ε_high .2 -> 1.2 (clipped)
    # ρ = .75, A = -1: ε_low .2 -> min(-.75, -.8) = -.8 (clipped) under both
    logprobs, old, mask = _logs([[1.25], [0.75]]), torch.zeros(2, 1), torch.ones(2, 1)
    adv = torch.tensor([1.0, -1.0])
    fn = get_policy_loss_fn("ppo")
    loss, m = fn(logprobs, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28)
    close(loss, [[-1.25], [0.8]])
    close(m["clip_frac"], 0.5)
    loss, m = fn(logprobs, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2)
    close(loss, [[-1.2], [0.8]])
    close(m["clip_frac"], 1.0)


def test_ppo_dual_clip():
    # c = 3. A = -1: ρ = 5 -> loss 5 bounded to 3; ρ = 2 -> 2 (under 3)
    # A = +1, ρ = 5 -> -1.2 (dual clip only touches A < 0)
    logprobs = _logs([[5.0, 2.0], [5.0, 1.0]])
    old, mask = torch.zeros(2, 2), torch.ones(2, 2)
    adv = torch.tensor([-1.0, 1.0])
    loss, m = get_policy_loss_fn("ppo")(logprobs, old, adv, mask, dual_clip_c=3.0)
    close(loss, [[3.0, 2.0], [-1.2, -1.0]])
    close(m["dual_clip_frac"], 0.25)
    loss, _ = get_policy_loss_fn("ppo")(logprobs, old, adv, mask)
    close(loss, [[5.0, 2.0], [-1.2, -1.0]])
    with pytest.raises(ValueError, match="dual_clip_c"):
        get_policy_loss_fn("ppo")(logprobs, old, adv, mask, dual_clip_c=0.5)


def test_ppo_token_level_advantages():
    # (B, T) advantages are used as given: ρ = 1 -> loss = -A
    adv = torch.tensor([[0.5, -2.0, 3.0]])
    loss, _ = get_policy_loss_fn("ppo")(torch.zeros(1, 3), torch.zeros(1, 3), adv, torch.ones(1, 3))
    close(loss, [[-0.5, 2.0, -3.0]])


def test_gspo_sequence_ratio_and_own_eps():
    # row 0: log ratios [.001, .003] -> mean .002 -> s = 1.002002 > 1 + 4e-4; A = +1
    #        -> clipped: loss -1.0004 on both tokens
    # row 1: log ratios [-1e-4, 1e-4, junk 5 at a masked position] -> mean 0 -> s = 1;
    #        A = -1 -> loss 1.0 on the two masked-in tokens, 0 on the third
    # gspo has its own ε (gspo_eps_*): the token ratios' clip_eps_* are not among its parameters.
    logprobs = torch.tensor([[0.001, 0.003, 0.0], [-1e-4, 1e-4, 5.0]], dtype=torch.float64)
    old = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    adv = torch.tensor([1.0, -1.0])
    loss, m = get_policy_loss_fn("gspo")(logprobs, old, adv, mask)
    close(loss, [[-1.0004, -1.0004, 0.0], [1.0, 1.0, 0.0]], atol=1e-7)
    close(m["clip_frac"], 0.5)
    close(m["ratio_mean"], (2 * 1.002002 + 2 * 1.0) / 4)


@pytest.mark.parametrize("name", ["ppo", "gspo"])
def test_gradient_at_ratio_one_is_minus_advantage(name):
    # old = logprobs.detach(): ρ = 1 in value, and d loss_t / d logprob_t = -A_t per token
    # (for gspo: d s_{i,t} / d logprob_t = s_i = 1). Masked-out tokens get gradient 0.
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -0.9]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([0.7, -1.3])
    loss, m = get_policy_loss_fn(name)(logprobs, logprobs.detach(), adv, mask)
    close(loss, [[-0.7, -0.7, 0.0], [1.3, 1.3, 1.3]])
    close(m["ratio_mean"], 1.0)
    close(m["clip_frac"], 0.0)
    loss.sum().backward()
    close(logprobs.grad, [[-0.7, -0.7, 0.0], [1.3, 1.3, 1.3]])


@pytest.mark.parametrize("name", ["ppo", "gspo"])
def test_masked_out_logprobs_change_nothing(name):
    gen = torch.Generator().manual_seed(2)
    old = -torch.rand(3, 5, generator=gen)
    base = old + 0.1 * torch.randn(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 0, 1, 0], [0, 0, 0, 0, 0]])
    adv = torch.tensor([1.0, -0.5, 2.0])
    results = []
    for junk in (0.0, float("-inf"), 50.0):
        logprobs = torch.where(mask.bool(), base, torch.tensor(junk)).requires_grad_(True)
        loss_matrix, metrics = get_policy_loss_fn(name)(logprobs, old, adv, mask)
        loss = aggregate(loss_matrix, mask, "seq-mean-token-mean")
        loss.backward()
        results.append((loss_matrix.detach(), loss.detach(), logprobs.grad, metrics))
    for loss_matrix, loss, grad, metrics in results[1:]:
        close(loss_matrix, results[0][0])
        close(loss, results[0][1])
        close(grad, results[0][2])
        for key in metrics:
            close(metrics[key], results[0][3][key])
    assert torch.isfinite(results[1][2]).all()


# ---------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------

AGG_LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [7.0, 8.0, 9.0]])
AGG_MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # row 2 is empty


def test_aggregate_modes_with_empty_row():
    # token-mean: (1 + 2 + 4) / 3 = 2.333333
    close(aggregate(AGG_LOSS, AGG_MASK, "token-mean"), 7 / 3)
    # seq-mean-token-mean: rows 1.5 and 4; empty row excluded -> 2.75
    close(aggregate(AGG_LOSS, AGG_MASK, "seq-mean-token-mean"), 2.75)
    # seq-mean-token-sum-norm, C = T = 3: sums 3 and 4 -> 1 and 1.333333 -> 1.166667
    close(aggregate(AGG_LOSS, AGG_MASK, "seq-mean-token-sum-norm"), 7 / 6)
    # C = 2: 1.5 and 2 -> 1.75
    close(aggregate(AGG_LOSS, AGG_MASK, "seq-mean-token-sum-norm", constant=2), 1.75)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregate_all_rows_empty_is_zero_with_graph(mode):
    loss_matrix = torch.randn(2, 3, requires_grad=True)
    loss = aggregate(loss_matrix, torch.zeros(2, 3), mode)
    assert loss.item() == 0.0
    loss.backward()
    close(loss_matrix.grad, torch.zeros(2, 3))


def test_aggregate_unknown_mode():
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-mean"):
        aggregate(AGG_LOSS, AGG_MASK, "sum")


def test_masked_mean():
    x = torch.tensor([[1.0, float("nan")], [3.0, 5.0]])
    mask = torch.tensor([[1, 0], [1, 1]])
    close(masked_mean(x, mask), 3.0)  # (1 + 3 + 5) / 3
    close(masked_mean(x, mask, dim=-1), [1.0, 4.0])
    close(masked_mean(x, torch.zeros(2, 2)), 0.0)


# ---------------------------------------------------------------------------------------------
# Value loss
# ---------------------------------------------------------------------------------------------


def test_value_loss_clipping():
    # ε = .2
    # t0: V .3, V_old .8, R 0: (V-R)² = .09; clip -> .6, .36 -> max .36 (clipped)
    # t1: V .5, V_old .5, R 1: .25 both                      -> .25
    # t2: V 2, V_old 1, R 2:   0; clip -> 1.2, .64            -> .64 (clipped)
    # t3: masked out (junk)
    # loss = .5 * (.36 + .25 + .64) / 3 = .208333; clip frac 2/3
    values = torch.tensor([[0.3, 0.5, 2.0, 100.0]], requires_grad=True)
    old_values = torch.tensor([[0.8, 0.5, 1.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 2.0, -100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, m = value_loss(values, old_values, returns, mask, clip_eps=0.2)
    close(loss, 0.208333)
    close(m["value_clip_frac"], 2 / 3)
    loss.backward()
    # only t1 (unclipped branch) has gradient: .5 * 2 * (.5 - 1) / 3 = -.166667
    close(values.grad, [[0.0, -1 / 6, 0.0, 0.0]])
    # unclipped: .5 * (.09 + .25 + 0) / 3 = .056667
    loss, m = value_loss(values, old_values, returns, mask, clip_eps=None)
    close(loss, 0.056667)
    close(m["value_clip_frac"], 0.0)


# ---------------------------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------------------------


def test_kl_values():
    # token 0: π .5, π_ref .25 -> log r = log .5 = -.693147
    #   k1 = .693147; k2 = .5 * .480453 = .240227; k3 = (.5 - 1) + .693147 = .193147
    # token 1: π .2, π_ref .4 -> log r = log 2 = .693147
    #   k1 = -.693147 (negative); k2 = .240227; k3 = (2 - 1) - .693147 = .306853
    logprobs = torch.log(torch.tensor([[0.5, 0.2]]))
    ref = torch.log(torch.tensor([[0.25, 0.4]]))
    close(kl_penalty(logprobs, ref, "k1"), [[0.693147, -0.693147]])
    close(kl_penalty(logprobs, ref, "k2"), [[0.240227, 0.240227]])
    close(kl_penalty(logprobs, ref, "k3"), [[0.193147, 0.306853]])


def test_k3_nonnegative_and_finite():
    gen = torch.Generator().manual_seed(3)
    logprobs = 10 * torch.randn(64, 16, generator=gen)
    ref = 10 * torch.randn(64, 16, generator=gen)
    k3 = kl_penalty(logprobs, ref, "k3")
    assert (k3 >= 0).all()
    # log r = 100 is clamped to 20: k3 = e^20 - 1 - 20, finite
    extreme = kl_penalty(torch.tensor([0.0]), torch.tensor([100.0]), "k3")
    assert extreme.item() == pytest.approx(math.exp(20) - 21, rel=1e-6)
    assert torch.isfinite(extreme).all()


def test_kl_unknown_kind():
    assert KL_ESTIMATORS == ("k1", "k2", "k3")
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


# ---------------------------------------------------------------------------------------------
# PPO's critic-based advantages
# ---------------------------------------------------------------------------------------------


def test_outcome_reward_goes_on_the_last_generated_token():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]])
    placed = outcome_token_rewards(torch.tensor([2.0, -1.0, 5.0]), mask)
    close(placed, [[0, 0, 0, 0, 2.0, 0], [0, 0, 0, -1.0, 0, 0], [0] * 6])


def test_whiten_uses_masked_population_std():
    x = torch.tensor([[1.0, 3.0, 100.0], [5.0, 7.0, -100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # masked values 1, 3, 5, 7: mean 4, population std sqrt(5)
    close(whiten(x, mask, eps=0.0), [[-3 / 5 ** 0.5, -1 / 5 ** 0.5, 0.0], [1 / 5 ** 0.5, 3 / 5 ** 0.5, 0.0]], atol=1e-6)


def test_critic_advantages_by_hand():
    # One row, tokens 1..2 generated, reward 1 on token 2, values V1 = 0.5, V2 = 0.25, γ = 1, λ = 0.5.
    # δ2 = 1 − 0.25 = 0.75; δ1 = 0 + 0.25 − 0.5 = −0.25; Â2 = 0.75; Â1 = −0.25 + 0.5·0.75 = 0.125.
    # returns = Â + V: 0.625, 1.0. KL in reward (β = 0.1, k1 = [0.2, 0.4]) subtracts 0.02, 0.04 first.
    values = torch.tensor([[0.0, 0.5, 0.25]])
    mask = torch.tensor([[0, 1, 1]])
    adv, ret = critic_advantages(torch.tensor([1.0]), values, mask, gamma=1.0, lam=0.5)
    close(ret, [[0.0, 0.625, 1.0]])
    raw = torch.tensor([0.125, 0.75])
    close(adv, [[0.0, *((raw - raw.mean()) / (raw.std(unbiased=False) + 1e-6)).tolist()]], atol=1e-6)
    kl = torch.tensor([[9.0, 0.2, 0.4]])  # position 0 is not generated: its KL is ignored
    _, ret_kl = critic_advantages(torch.tensor([1.0]), values, mask, gamma=1.0, lam=0.5, kl=kl, kl_coef=0.1)
    # δ2 = 0.96 − 0.25 = 0.71; δ1 = −0.02 + 0.25 − 0.5 = −0.27; Â1 = −0.27 + 0.355 = 0.085
    close(ret_kl, [[0.0, 0.585, 0.96]], atol=1e-6)
