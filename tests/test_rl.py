"""End-to-end tier: a few RL steps on the tiny model, resume, algorithm variants, CLI errors."""

import json

import pytest
import torch
from typer.testing import CliRunner

from tamer.cli import app
from tamer.evaluate import EvalConfig
from tamer.rewards import REWARDS, RewardComposer, RewardConfig
from tamer.tasks import ArithmeticTasks
from tamer.tracking import Tracker, read_metrics
from tamer.trainers.common import OptimConfig
from tamer.trainers.rl import AlgorithmConfig, RLConfig, RLTrainer

EVAL = EvalConfig(size=8, max_new_tokens=8)


@REWARDS.register("broken")
def broken(traj):
    raise KeyError("missing field")


def _trainer(model, tokenizer, tmp_path, tracker=None, **overrides):
    algorithm = overrides.pop("algorithm", AlgorithmConfig())
    cfg = RLConfig(**{"steps": 3, "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 8,
                      "optim": OptimConfig(lr=1e-3), "eval_every": 0, "algorithm": algorithm, **overrides})
    train, held = ArithmeticTasks().split()
    # A dense reward (length) guarantees spread within groups even for an untrained model.
    rewards = RewardComposer(RewardConfig(weights={"correctness": 1.0, "length": 1.0},
                                          params={"length": {"max_tokens": 8}}))
    return RLTrainer(model, tokenizer, train, held, rewards, cfg, EVAL, run_dir=tmp_path, tracker=tracker)


class _Collect:
    def __init__(self):
        self.records = {}

    def log(self, metrics, step):
        self.records.setdefault(step, {}).update(metrics)

    def print(self, msg):
        pass


def test_few_steps_finite_loss_and_parameters_move(tiny_model, tokenizer, tmp_path):
    before = [p.detach().clone() for p in tiny_model.parameters()]
    log = _Collect()
    final = _trainer(tiny_model, tokenizer, tmp_path, log).train()
    assert set(log.records) == {1, 2, 3} and "eval/accuracy" in final
    for step in (1, 2, 3):
        assert torch.isfinite(torch.tensor(log.records[step]["train/loss"]))
        assert log.records[step]["rollout/trajectories"] == 16
    moved = sum(not torch.equal(a, b) for a, b in zip(before, tiny_model.parameters()))
    assert moved == len(before)


@pytest.mark.parametrize("algorithm", [
    AlgorithmConfig(advantage="dr_grpo", aggregation="seq-mean-token-sum-norm"),
    AlgorithmConfig(advantage="rloo", aggregation="seq-mean-token-mean"),
    AlgorithmConfig(advantage="reinforce_pp", clip_eps_high=0.28, dual_clip_c=3.0),
    AlgorithmConfig(policy_loss="gspo"),
    AlgorithmConfig(kl_coef=0.1, kl_estimator="k3"),
    AlgorithmConfig(dynamic_sampling="refill"),
])
def test_algorithm_variants_train(tiny_model, tokenizer, tmp_path, algorithm):
    log = _Collect()
    trainer = _trainer(tiny_model, tokenizer, tmp_path, log, steps=2, ppo_epochs=2, mini_batches=2, algorithm=algorithm)
    assert (trainer.ref_model is not None) == (algorithm.kl_coef > 0)
    trainer.train()
    for step in (1, 2):
        assert torch.isfinite(torch.tensor(log.records[step]["train/loss"]))
        if algorithm.kl_coef > 0:
            assert log.records[step]["train/kl"] >= 0.0
        else:
            assert "train/kl" not in log.records[step]


def test_dynamic_sampling_drop_keeps_only_groups_with_spread(tiny_model, tokenizer, tmp_path):
    trainer = _trainer(tiny_model, tokenizer, tmp_path, algorithm=AlgorithmConfig(dynamic_sampling="drop"))
    kept, metrics = trainer.collect(step=1)
    by_group = {}
    for t in kept:
        by_group.setdefault(t.group_id, set()).add(t.reward)
    assert all(len(r) > 1 for r in by_group.values())
    assert metrics["rollout/kept"] == len(kept)


def _metrics_after(model, tokenizer, run_dir, steps):
    with Tracker(run_dir, console=False, tensorboard=False) as tracker:
        _trainer(model, tokenizer, run_dir, tracker, steps=steps, checkpoint_every=2).train()
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}


def test_resume_matches_uninterrupted_run(tokenizer, tmp_path):
    from tamer.models import build_tiny_model
    from tests.conftest import TINY

    full = _metrics_after(build_tiny_model(tokenizer, TINY), tokenizer, tmp_path / "full", steps=4)
    _metrics_after(build_tiny_model(tokenizer, TINY), tokenizer, tmp_path / "part", steps=2)  # "crash" after step 2
    with Tracker(tmp_path / "part", console=False, tensorboard=False, append=True) as tracker:
        trainer = _trainer(build_tiny_model(tokenizer, TINY), tokenizer, tmp_path / "part", tracker, steps=4,
                           checkpoint_every=2)
        assert trainer.resume(tmp_path / "part" / "checkpoints" / "step-000002") == 2
        trainer.train()
    resumed = {r["step"]: r for r in read_metrics(tmp_path / "part" / "metrics.jsonl")}
    for step in (3, 4):
        for key in ("reward/mean", "train/loss", "train/grad_norm", "rollout/mean_length"):
            assert resumed[step][key] == pytest.approx(full[step][key], rel=1e-5, abs=1e-6), (step, key)


runner = CliRunner()


def test_cli_bad_config_fails_before_work(tmp_path):
    result = runner.invoke(app, ["train", "--set", "rl.optim.lr=abc", "-o", str(tmp_path)])
    assert result.exit_code == 2 and "rl.optim.lr" in result.output
    assert not any(tmp_path.iterdir())  # nothing was started


def test_cli_bad_dataset_names_file_and_row(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n')
    result = runner.invoke(app, ["sft", "--set", "task.name=dataset", "--set", f"task.dataset.path={data}",
                                 "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "d.jsonl, row 2" in result.output


def test_cli_demo_end_to_end_small(tmp_path):
    out = tmp_path / "demo"
    args = ["demo", "-o", str(out), "--set", "model.tiny.hidden_size=32", "--set", "model.tiny.num_layers=1",
            "--set", "model.tiny.intermediate_size=64", "--set", "sft.steps=10", "--set", "rl.steps=2",
            "--set", "rl.prompts_per_step=2", "--set", "rl.group_size=2", "--set", "eval.size=6",
            "--set", "rl.eval_every=1", "--set", "tracking.tensorboard=false"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    for key in ("demonstrator_accuracy", "sft_accuracy", "rl_accuracy"):
        assert 0.0 <= summary[key] <= 1.0
    assert summary["rl_steps"] == 2 and summary["seconds"] > 0
    assert (out / "reward_accuracy.png").stat().st_size > 0
    assert (out / "rl" / "model" / "config.json").is_file()


@pytest.mark.parametrize("shared", [False, True])
def test_ppo_with_critic_trains(tiny_model, tokenizer, tmp_path, shared):
    from tamer.trainers.critic import CriticConfig

    log = _Collect()
    trainer = _trainer(tiny_model, tokenizer, tmp_path, log, steps=2, ppo_epochs=2,
                       algorithm=AlgorithmConfig(advantage="gae"),
                       critic=CriticConfig(shared=shared, kl_in_reward=0.05))
    head_before = trainer.advantage.model.head.weight.detach().clone()
    trainer.train()
    assert trainer.ref_model is not None  # KL in the reward needs the reference
    for step in (1, 2):
        assert torch.isfinite(torch.tensor(log.records[step]["critic/value_loss"]))
        assert torch.isfinite(torch.tensor(log.records[step]["train/loss"]))
    assert not torch.equal(head_before, trainer.advantage.model.head.weight)
    separate = {id(p) for p in trainer.advantage.model.trunk.parameters()} & {id(p) for p in tiny_model.parameters()}
    assert bool(separate) == shared


def test_raising_reward_is_logged_once_and_training_goes_on(tiny_model, tokenizer, tmp_path):
    class Log(_Collect):
        printed: list = []

        def print(self, msg):
            self.printed.append(msg)

    train, held = ArithmeticTasks().split()
    rewards = RewardComposer(RewardConfig(weights={"length": 1.0, "broken": 1.0}))
    cfg = RLConfig(steps=2, prompts_per_step=2, group_size=2, max_new_tokens=4, eval_every=0)
    log = Log()
    RLTrainer(tiny_model, tokenizer, train, held, rewards, cfg, EVAL, run_dir=tmp_path, tracker=log).train()
    assert len(log.printed) == 1 and "KeyError: 'missing field'" in log.printed[0]
    assert log.records[2]["reward/errors_total"] == 8


def test_critic_value_of_a_token_is_read_before_the_token(tiny_model):
    """V(s_t) must not depend on token t (it is the baseline of that action), only on tokens < t."""
    from tamer.trainers.critic import ValueModel

    critic = ValueModel(tiny_model.get_decoder(), tiny_model.config.hidden_size)
    torch.nn.init.normal_(critic.head.weight)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    changed = ids.clone()
    changed[0, 3] = 42
    mask = torch.ones_like(ids)
    with torch.no_grad():
        a, b = critic(ids, mask), critic(changed, mask)
    assert a[0, 0] == 0 and torch.equal(a[0, :4], b[0, :4])  # positions <= 3 have not read token 3
    assert not torch.equal(a[0, 4], b[0, 4])


def test_zero_advantage_rows_by_hand():
    from types import SimpleNamespace

    from tamer.trainers.rl import zero_advantage_rows
    # (B,) advantages: exactly 0 (either sign) only; a tiny non-zero value keeps its row
    rows = zero_advantage_rows(SimpleNamespace(advantages=torch.tensor([0.0, 0.5, -0.0, 1e-30]), loss_mask=None))
    assert rows.tolist() == [True, False, True, False]
    # (B, T): row 0's only non-zero value sits off the loss mask; row 1 has one on it; row 2 none
    adv = torch.tensor([[0.0, 0.0, 3.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert zero_advantage_rows(SimpleNamespace(advantages=adv, loss_mask=mask)).tolist() == [True, False, True]


def _update_with(model, tokenizer, run_dir, batches, monkeypatch, **overrides):
    """Run `trainer.update` on each batch of `batches(trainer)`; return (trainer, per update: rows the loss saw,
    the gradients handed to the optimizer, metrics with the token counts)."""
    from tamer.trainers import rl as rl_module
    trainer = _trainer(model, tokenizer, run_dir, reuse_sampler_activations=False, **overrides)
    seen, grads = [], []
    loss = trainer.loss
    trainer.loss = lambda micro: seen.append(len(micro)) or loss(micro)
    step = rl_module.clip_and_step
    monkeypatch.setattr(rl_module, "clip_and_step", lambda module, *args: grads.append(
        [p.grad.clone() for p in module.parameters()]) or step(module, *args))
    out = []
    for i, batch in enumerate(batches(trainer)):
        seen.clear()
        metrics = trainer.update(batch, i + 1) | trainer._token_counts(batch)
        out.append((sum(seen), grads[-1], metrics))
    return trainer, out


def test_zero_advantage_rows_are_left_out_with_the_same_update(tiny_model, tokenizer, tmp_path, monkeypatch):
    """beta = 0: a row with A = 0 adds exactly 0 to the gradient, so the learner leaves it out: fewer rows
    forwarded, the same gradients and losses; ratio metrics are over the rows run (on-policy: 1)."""
    import copy
    trajs, _ = _trainer(copy.deepcopy(tiny_model), tokenizer, tmp_path / "collect",
                        reuse_sampler_activations=False).collect(1)

    def batches(trainer):
        batch = trainer.make_batch(trajs)
        batch.advantages = torch.linspace(-1.0, 1.0, len(batch))  # none 0 (an untrained model's rewards tie)
        batch.advantages[batch.group_ids == batch.group_ids[0]] = 0.0  # one group teaches nothing
        return [batch]
    runs = {skip: _update_with(copy.deepcopy(tiny_model), tokenizer, tmp_path / str(skip), batches, monkeypatch,
                               skip_zero_advantage=skip)[1][0] for skip in (True, False)}
    zero = int((trajs[0].group_id == torch.tensor([t.group_id for t in trajs])).sum())
    assert zero == 4
    (rows, grads, metrics), (all_rows, all_grads, all_metrics) = runs[True], runs[False]
    assert (rows, all_rows) == (16 - zero, 16)
    assert (metrics["tokens/learner_rows_skipped"], all_metrics["tokens/learner_rows_skipped"]) == (zero, 0)
    assert metrics["tokens/learner"] < all_metrics["tokens/learner"]
    for g, h in zip(grads, all_grads):
        torch.testing.assert_close(g, h, atol=1e-7, rtol=1e-5)
    assert any(bool(g.abs().max() > 0) for g in grads)
    for key in ("train/policy_loss", "train/loss", "train/ratio_mean", "train/clip_frac", "train/grad_norm"):
        assert metrics[key] == pytest.approx(all_metrics[key], rel=1e-5, abs=1e-7), key
    assert metrics["train/ratio_mean"] == pytest.approx(1.0)


def test_a_batch_of_zero_advantages_forwards_nothing_and_still_steps(tiny_model, tokenizer, tmp_path, monkeypatch):
    """Every row left out: no forward, and the optimizer still steps on zero gradients (Adam's momentum from
    the step before moves the weights, as it does when the zero gradients are computed)."""
    import copy
    trajs, _ = _trainer(copy.deepcopy(tiny_model), tokenizer, tmp_path / "collect",
                        reuse_sampler_activations=False).collect(1)

    def batches(trainer):
        live, dead = trainer.make_batch(trajs), trainer.make_batch(trajs)
        live.advantages = torch.linspace(-1.0, 1.0, len(live))
        dead.advantages.zero_()
        return [live, dead]
    weights, rows = {}, {}
    for skip in (True, False):
        model = copy.deepcopy(tiny_model)
        _, out = _update_with(model, tokenizer, tmp_path / str(skip), batches, monkeypatch, skip_zero_advantage=skip)
        rows[skip] = [r for r, _, _ in out]
        assert all(bool((g == 0).all()) for g in out[1][1]) and any(bool((g != 0).any()) for g in out[0][1])
        weights[skip] = [p.detach().clone() for p in model.parameters()]
    assert rows[True][1] == 0 and rows[False][1] == 16
    for a, b in zip(weights[True], weights[False]):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)
    assert any(not torch.equal(a, b) for a, b in zip(weights[True], tiny_model.parameters()))


def test_zero_advantage_rows_are_kept_where_they_have_a_gradient(tiny_model, tokenizer, tmp_path):
    assert _trainer(tiny_model, tokenizer, tmp_path).skips_zero_advantage
    assert _trainer(tiny_model, tokenizer, tmp_path, algorithm=AlgorithmConfig(policy_loss="gspo")).skips_zero_advantage
    assert not _trainer(tiny_model, tokenizer, tmp_path, algorithm=AlgorithmConfig(kl_coef=0.1)).skips_zero_advantage
    assert not _trainer(tiny_model, tokenizer, tmp_path, skip_zero_advantage=False).skips_zero_advantage
