"""Off-policy by k and seeding that does not depend on how groups are split (fast tier).

Math: the behaviour weight on hand-computed cases. Sampling: per-trajectory seeds give a row
the same tokens in any batch; `Rollout(seeding="trajectory")` returns the same trajectories
for one call or for the groups split over calls; concurrent environment steps change nothing.
Loop: max_staleness=0 is the synchronous loop; k=1 keeps staleness <= 1 and is reproducible.
"""

import dataclasses
import math

import pytest
import torch

from tamer.algorithms import behaviour_weights
from tamer.config import ConfigError, load_config
from tamer.models import build_tiny_model, stop_token_ids
from tamer.pipeline import RunConfig, make_trainer
from tamer.rollout.agent import AgentConfig
from tamer.rollout.engine import HFEngine
from tamer.rollout.runner import Rollout
from tamer.rollout.types import SamplingParams, trajectory_seed
from tamer.tasks import ArithmeticTasks
from tests.scale_envs import echo_tasks

LOG = math.log


# ---------------------------------------------------------------------------- the behaviour weight
def _case():
    prox = torch.tensor([[LOG(1.0), LOG(3.0), LOG(0.5), 0.0]])
    behav = torch.tensor([[LOG(0.5), LOG(1.0), LOG(1.0), 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    return prox, behav, mask  # ratios 2, 3, 0.5 on the masked tokens


def test_truncated_weight_hand_computed():
    w, m = behaviour_weights(*_case(), behaviour_weight="truncate", behaviour_weight_cap=2.5)
    assert torch.allclose(w, torch.tensor([[2.0, 2.5, 0.5, 0.0]]), atol=1e-6)
    assert m["ratio_mean"].item() == pytest.approx(5.5 / 3, abs=1e-6)
    assert m["ratio_max"].item() == pytest.approx(3.0, abs=1e-6)
    assert m["ratio_min"].item() == pytest.approx(0.5, abs=1e-6)
    assert m["capped_frac"].item() == pytest.approx(1 / 3)
    assert m["weight_mean"].item() == pytest.approx(5.0 / 3, abs=1e-6)


def test_masked_weight_drops_tokens_past_the_cap():
    w, m = behaviour_weights(*_case(), behaviour_weight="mask", behaviour_weight_cap=2.5)
    assert torch.allclose(w, torch.tensor([[2.0, 0.0, 0.5, 0.0]]), atol=1e-6)
    assert m["weight_mean"].item() == pytest.approx(2.5 / 3, abs=1e-6)


def test_weight_off_is_one_on_masked_tokens_and_never_has_a_gradient():
    prox, behav, mask = _case()
    prox.requires_grad_(True)
    w, _ = behaviour_weights(prox, behav, mask, behaviour_weight="off")
    assert torch.equal(w, mask) and not w.requires_grad


def test_weight_of_an_empty_mask_is_zero_and_bad_arguments_raise():
    w, m = behaviour_weights(torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1, 3))
    assert torch.equal(w, torch.zeros(1, 3)) and m["ratio_max"].item() == 0.0
    with pytest.raises(ValueError, match="behaviour_weight"):
        behaviour_weights(*_case(), behaviour_weight="clip")
    with pytest.raises(ValueError, match="cap"):
        behaviour_weights(*_case(), behaviour_weight_cap=0.0)


# ---------------------------------------------------------------------------- seeding
def test_trajectory_seed_is_a_function_of_the_trajectory_only():
    seeds = {trajectory_seed(7, g, k) for g in range(50) for k in range(8)}
    assert len(seeds) == 400 and all(0 <= s < 2**63 for s in seeds)
    assert trajectory_seed(7, 3, 1) == trajectory_seed(7, 3, 1) != trajectory_seed(8, 3, 1)


def test_row_seeds_give_a_row_the_same_tokens_in_any_batch(tiny_model, tokenizer):
    engine = HFEngine(tiny_model, tokenizer.pad_token_id)
    prompts = [tokenizer("12+7=")["input_ids"], tokenizer("3*40-1=")["input_ids"], tokenizer("9=")["input_ids"]]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=1)
    seeds = tuple(range(100, 106))
    whole = engine.generate(prompts, dataclasses.replace(params, row_seeds=seeds))
    alone = engine.generate(prompts[1:2], dataclasses.replace(params, row_seeds=seeds[2:4]))
    assert [o.token_ids for o in whole[1]] == [o.token_ids for o in alone[0]]
    for a, b in zip(whole[1], alone[0]):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    with pytest.raises(ValueError, match="row_seeds"):
        engine.generate(prompts, dataclasses.replace(params, row_seeds=seeds[:3]))


def _split_equal(rollout, tasks, params):
    whole = rollout.run(tasks, params, group_offset=3)
    parts = rollout.run(tasks[:2], params, group_offset=3) + rollout.run(tasks[2:], params, group_offset=5)
    assert len(whole) == len(parts) == len(tasks) * params.n
    for a, b in zip(whole, parts):
        assert (a.group_id, a.completion_ids, a.loss_mask) == (b.group_id, b.completion_ids, b.loss_mask)
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) < 1e-5
    return whole


def test_trajectory_seeding_single_turn_does_not_depend_on_the_split(tiny_model, tokenizer):
    tasks = ArithmeticTasks().split()[0][:5]
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, stop_token_ids=stop_token_ids(tokenizer), seed=4)
    trajs = _split_equal(Rollout(HFEngine(tiny_model, tokenizer.pad_token_id), tokenizer, seeding="trajectory"),
                         tasks, params)
    assert len({tuple(t.completion_ids) for t in trajs}) > 3  # really sampled


def test_trajectory_seeding_multi_turn_does_not_depend_on_the_split(tiny_model, tokenizer):
    tasks = echo_tasks(4)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, stop_token_ids=stop_token_ids(tokenizer), seed=4)
    rollout = Rollout(HFEngine(tiny_model, tokenizer.pad_token_id), tokenizer, AgentConfig(max_turns=3),
                      seeding="trajectory")
    trajs = _split_equal(rollout, tasks, params)
    assert all(len(t.turns) == 3 and 0 in t.loss_mask for t in trajs)  # multi-turn: environment tokens in there


def test_concurrent_environment_steps_give_the_same_episodes(tiny_model, tokenizer):
    tasks = echo_tasks(3, answer="0.01")
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, stop_token_ids=stop_token_ids(tokenizer), seed=2)
    runs = [Rollout(HFEngine(tiny_model, tokenizer.pad_token_id), tokenizer, AgentConfig(max_turns=3, env_threads=n)
                    ).run(tasks, params) for n in (1, 4)]
    assert [(t.completion_ids, t.loss_mask, t.logprobs) for t in runs[0]] == \
           [(t.completion_ids, t.loss_mask, t.logprobs) for t in runs[1]]


# ---------------------------------------------------------------------------- the loop
TINY_SET = [f"model.tiny.{k}={v}" for k, v in dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                                    intermediate_size=64).items()]


def _steps(tokenizer, *overrides, steps=3):
    cfg = load_config(RunConfig, [], TINY_SET + ["rl.prompts_per_step=4", "rl.group_size=4", "rl.max_new_tokens=8",
                                                 "rl.eval_every=0", "rl.optim.lr=3e-3", f"rl.steps={steps}",
                                                 # a dense reward: spread in every group, so updates happen
                                                 "reward.weights={correctness: 1.0, length: 1.0}",
                                                 "reward.params={length: {max_tokens: 8}}", *overrides])
    model = build_tiny_model(tokenizer, cfg.model.tiny)
    trainer = make_trainer(cfg, model, tokenizer)
    try:
        return [trainer.train_step() for _ in range(steps)], model
    finally:
        trainer.close()


def _numbers(metrics):
    return [{k: v for k, v in m.items() if not (k.startswith("time/") or k.endswith("_s"))} for m in metrics]


def test_max_staleness_zero_is_the_synchronous_loop_bit_for_bit(tokenizer):
    default, model_a = _steps(tokenizer)
    zero, model_b = _steps(tokenizer, "rl.max_staleness=0")
    assert _numbers(default) == _numbers(zero)
    assert all(torch.equal(a, b) for a, b in zip(model_a.parameters(), model_b.parameters()))
    assert not any(k.startswith("async/") for k in default[0])


def test_staleness_one_is_bounded_reproducible_and_weighted(tokenizer):
    first, model_a = _steps(tokenizer, "rl.max_staleness=1", "rl.mini_batches=2", steps=4)
    again, model_b = _steps(tokenizer, "rl.max_staleness=1", "rl.mini_batches=2", steps=4)
    assert [m["async/staleness"] for m in first] == [0.0, 1.0, 1.0, 1.0]
    assert [m["async/policy_version"] for m in first] == [0.0, 0.0, 1.0, 2.0]
    assert all(m["async/staleness_frac/1"] + m["async/staleness_frac/0"] == 1.0 for m in first)
    assert _numbers(first) == _numbers(again)  # the version each batch uses is fixed, not a race
    assert all(torch.equal(a, b) for a, b in zip(model_a.parameters(), model_b.parameters()))
    assert any(m["offpolicy/ratio_max"] != pytest.approx(1.0, abs=1e-4) for m in first[1:])  # stale: weights != 1


def test_scale_and_offpolicy_fields_are_checked():
    for item, field in [("rl.max_staleness=-1", "rl.max_staleness"), ("rl.sampling_seed=per-row", "rl.sampling_seed"),
                        ("rl.algorithm.behaviour_weight=clip", "rl.algorithm.behaviour_weight"),
                        ("rl.algorithm.behaviour_weight_cap=0", "rl.algorithm.behaviour_weight_cap"),
                        ("scale.learner_ranks=0", "scale.learner_ranks"),
                        ("scale.learner_strategy=zero3", "scale.learner_strategy"),
                        ("scale.rollout_workers=-1", "scale.rollout_workers"),
                        ("scale.rollout_timeout_s=0", "scale.rollout_timeout_s"),
                        ("agent.env_threads=0", "agent.env_threads")]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(RunConfig, [], [item])
    with pytest.raises(ConfigError, match="learner_strategy"):
        load_config(RunConfig, [], ["scale.learner_strategy=single", "scale.learner_ranks=2"])
    with pytest.raises(ConfigError, match="critic.shared"):
        load_config(RunConfig, [], ["scale.learner_ranks=2", "rl.algorithm.advantage=gae", "rl.critic.shared=true"])
    cfg = load_config(RunConfig, [], ["scale.learner_ranks=2"])
    assert cfg.scale.strategy == "ddp" and cfg.scale.distributed
    assert not load_config(RunConfig, [], []).scale.distributed
