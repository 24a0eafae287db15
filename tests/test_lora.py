"""LoRA through peft: config checks, training only the adapter, the adapter-free reference,
adapter checkpoints and resume, LoRA model directories, export --merge, PPO's critic adapter."""

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from tamer.checkpoint import CheckpointError, load_weights, save_checkpoint
from tamer.cli import app
from tamer.config import ConfigError, load_config
from tamer.evaluate import EvalConfig
from tamer.models import (
    AdapterFreeView,
    LoraConfig,
    LoraError,
    ModelConfig,
    adapter_parameters,
    apply_lora,
    fold_adapter,
    is_lora,
    load_model,
    save_model,
    token_logprobs,
)
from tamer.models.fast_arch import unsupported_reason
from tamer.models.lora import merged_state_dict
from tamer.pipeline import RunConfig, build_policy
from tamer.rewards import RewardComposer, RewardConfig
from tamer.tasks import ArithmeticTasks
from tamer.trainers.common import OptimConfig
from tamer.trainers.critic import CriticConfig
from tamer.trainers.rl import AlgorithmConfig, RLConfig, RLTrainer
from tamer.trainers.sft import SFTConfig, SFTTrainer, collate, demonstrations, sft_loss

from .conftest import TINY

LORA = LoraConfig(r=4, alpha=8.0)


def _trainer(model, tokenizer, tmp_path, **overrides):
    algorithm = overrides.pop("algorithm", AlgorithmConfig(kl_coef=0.1))
    cfg = RLConfig(**{"steps": 3, "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 8,
                      "optim": OptimConfig(lr=1e-2), "eval_every": 0, "algorithm": algorithm, **overrides})
    train, held = ArithmeticTasks().split()
    rewards = RewardComposer(RewardConfig(weights={"correctness": 1.0, "length": 1.0},
                                          params={"length": {"max_tokens": 8}}))
    return RLTrainer(model, tokenizer, train, held, rewards, cfg, EvalConfig(size=4, max_new_tokens=4),
                     run_dir=tmp_path)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def _ids(tokenizer):
    return torch.tensor([tokenizer("12+34=<answer>46</answer>")["input_ids"]])


# ---------------------------------------------------------------------------- config
@pytest.mark.parametrize("override, message", [
    ("model.lora.r=-1", "model.lora.r: expected >= 0"),
    ("model.lora.alpha=0", "model.lora.alpha: expected > 0"),
    ("model.lora.dropout=1.0", "model.lora.dropout: expected a value in [0, 1)"),
    ("model.lora.target_modules=[]", "model.lora.target_modules: expected a non-empty list"),
    ("model.lora.target_modules=[all-linear, q_proj]", "model.lora.target_modules: 'all-linear' stands alone"),
])
def test_config_errors_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(")", r"\)")):
        load_config(RunConfig, [], [override])


def test_r_zero_is_full_finetuning_and_unknown_targets_are_named(tokenizer, tiny_model):
    model, _ = build_policy(ModelConfig(tiny=TINY))
    assert not is_lora(model)
    with pytest.raises(LoraError, match="model.lora.target_modules: no linear layer named 'qkv'"):
        apply_lora(tiny_model, LoraConfig(r=2, target_modules=("qkv",)))


# ---------------------------------------------------------------------------- training
def test_rl_trains_only_the_adapter_and_the_reference_is_the_base(tokenizer, tiny_model, tmp_path):
    base = copy.deepcopy(tiny_model)
    model = apply_lora(tiny_model, LORA)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapter = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert frozen and adapter and all(".lora_" in n for n in adapter)
    trainer = _trainer(model, tokenizer, tmp_path)
    assert isinstance(trainer.ref_model, AdapterFreeView) and trainer.held_models() == [model]
    assert trainer.trainable_parameters() == sum(p.numel() for p in adapter.values())
    trajectories, _ = trainer.collect(1)
    batch = trainer.make_batch(trajectories)
    # π_ref is the model the adapter started from: the base, as a plain transformers model computes it.
    mask = batch.loss_mask
    expected = token_logprobs(base, batch.input_ids, batch.attention_mask) * mask
    torch.testing.assert_close(batch.ref_logprobs * mask, expected, atol=1e-5, rtol=0)
    surrogate_before = _surrogate(trainer, batch)
    # A LoRA model takes the HF forward (the lean one refuses wrapped projections) for sampling and
    # learning alike: the learner's logprobs are the sampler's.
    assert unsupported_reason(model) is not None
    metrics = trainer.update(batch, 1)
    assert metrics["train/sampler_logprob_gap"] < 1e-5
    assert _surrogate(trainer, batch) > surrogate_before  # the step raised Σ A·log π on its own batch
    trainer.step = 1
    trainer.train()
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), f"{name} (base) changed"
    assert sum(not torch.equal(p, adapter[n]) for n, p in model.named_parameters() if n in adapter) == len(adapter)
    after = trainer._no_grad_logprobs(trainer.ref_model, batch)
    torch.testing.assert_close(after, batch.ref_logprobs, atol=1e-6, rtol=0)  # the reference did not move
    policy = trainer._no_grad_logprobs(model, batch)
    assert (policy - after).abs().max() > 1e-3  # while the policy did


def _surrogate(trainer, batch) -> float:
    with torch.no_grad():
        logprobs = trainer._no_grad_logprobs(trainer.model, batch)
    advantages = batch.advantages[:, None] if batch.advantages.dim() == 1 else batch.advantages
    return float((advantages * logprobs * batch.loss_mask).sum())


def test_sft_loss_decreases_with_lora(tokenizer, tiny_model, tmp_path):
    model = apply_lora(tiny_model, LoraConfig(r=8, alpha=16.0))
    source = ArithmeticTasks()
    data = demonstrations(source, source.split()[0][:64], tokenizer, seed=0)
    batch = collate(data[:32], tokenizer.pad_token_id)
    with torch.no_grad():
        before = float(sft_loss(model, batch))
    SFTTrainer(model, tokenizer, data, SFTConfig(steps=40, batch_size=16, optim=OptimConfig(lr=1e-2)),
               run_dir=tmp_path).train()
    with torch.no_grad():
        assert float(sft_loss(model, batch)) < before - 0.2  # 5.56 -> 5.24 measured (frozen random head)


# ---------------------------------------------------------------------------- checkpoints
def test_adapter_checkpoint_and_exact_resume(tokenizer, tmp_path):
    def fresh():
        model, _ = build_policy(ModelConfig(tiny=TINY, lora=LORA))
        return model

    straight = _trainer(fresh(), tokenizer, tmp_path / "a")
    straight.train()
    first = _trainer(fresh(), tokenizer, tmp_path / "b", steps=2, checkpoint_every=2)
    first.train()
    ckpt = tmp_path / "b" / "checkpoints" / "step-000002"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    resumed = _trainer(fresh(), tokenizer, tmp_path / "b")
    assert resumed.resume(ckpt) == 2
    resumed.train()
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)


def test_adapter_checkpoint_into_a_full_model_is_one_error(tokenizer, tiny_model, tmp_path):
    model = apply_lora(copy.deepcopy(tiny_model), LORA)
    path = save_checkpoint(tmp_path, 1, model=model)
    with pytest.raises(CheckpointError, match="holds a LoRA adapter but the model has none"):
        load_weights(path, tiny_model)
    full = save_checkpoint(tmp_path / "full", 1, model=tiny_model)
    with pytest.raises(CheckpointError, match="holds no LoRA adapter"):
        load_weights(full, model)


# ---------------------------------------------------------------------------- model directories, export
def _trained_lora(tokenizer, tiny_model):
    model = apply_lora(tiny_model, LORA)
    with torch.no_grad():
        for p in adapter_parameters(model):
            p.normal_(0, 0.05)  # an adapter that changes the logits
    return model


def test_lora_model_dir_loads_merged_and_export_merge_is_plain_transformers(tokenizer, tiny_model, tmp_path):
    model = _trained_lora(tokenizer, tiny_model)
    ids = _ids(tokenizer)
    expected = _logits(model, ids)
    save_model(model, tokenizer, tmp_path / "run" / "model")
    saved = tmp_path / "run" / "model"
    assert (saved / "adapter_model.safetensors").is_file() and (saved / "base" / "config.json").is_file()
    assert not (saved / "config.json").exists()
    loaded, _ = load_model(saved)
    assert not is_lora(loaded)
    torch.testing.assert_close(_logits(loaded, ids), expected, atol=1e-5, rtol=0)
    result = CliRunner().invoke(app, ["export", "--merge", str(saved), "-o", str(tmp_path / "merged")])
    assert result.exit_code == 0, result.output
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    torch.testing.assert_close(_logits(plain, ids), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(merged_state_dict(model)["model.layers.0.self_attn.q_proj.weight"],
                               plain.model.layers[0].self_attn.q_proj.weight, atol=1e-6, rtol=0)


def test_a_separate_sampler_gets_the_merged_model(tokenizer, tiny_model, tmp_path):
    """What vLLM is given for a LoRA policy: a plain model directory and weight syncs under the
    plain names, both with the adapter merged (the vLLM tier checks the sampled logprobs)."""
    from tamer.models.lora import save_merged_model
    from tamer.rollout.vllm.sync import named_weights

    model = _trained_lora(tokenizer, tiny_model)
    ids = _ids(tokenizer)
    expected = _logits(model, ids)
    plain = AutoModelForCausalLM.from_pretrained(save_merged_model(model, tokenizer, tmp_path / "m"),
                                                 local_files_only=True)
    torch.testing.assert_close(_logits(plain, ids), expected, atol=1e-5, rtol=0)
    pushed = dict(named_weights(model))
    reference = plain.state_dict()
    assert set(pushed) == set(reference) | {"lm_head.weight"}
    for name, tensor in pushed.items():
        torch.testing.assert_close(tensor, reference.get(name, plain.lm_head.weight), atol=1e-6, rtol=0)
    assert is_lora(model)  # the policy itself is untouched


def test_export_without_merge_is_a_base_and_an_adapter_for_peft(tokenizer, tiny_model, tmp_path):
    from peft import PeftModel

    model = _trained_lora(tokenizer, tiny_model)
    ids = _ids(tokenizer)
    save_model(model, tokenizer, tmp_path / "model")
    result = CliRunner().invoke(app, ["export", str(tmp_path / "model"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "base", local_files_only=True)
    assert json.loads((tmp_path / "out" / "adapter" / "adapter_config.json").read_text())["r"] == LORA.r
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "out" / "adapter"))
    torch.testing.assert_close(_logits(peft_model, ids), _logits(model, ids), atol=1e-5, rtol=0)


def test_export_errors_are_one_line(tokenizer, tiny_model, tmp_path):
    result = CliRunner().invoke(app, ["export", "--merge", str(tmp_path / "nothing"), "-o", str(tmp_path / "o")])
    assert result.exit_code == 2 and "no such model directory" in result.output
    save_model(tiny_model, tokenizer, tmp_path / "plain")
    result = CliRunner().invoke(app, ["export", str(tmp_path / "plain"), "-o", str(tmp_path / "o")])
    assert result.exit_code == 2 and "not a LoRA model directory" in result.output


def test_lora_on_a_saved_base_records_it_and_chains(tokenizer, tiny_model, tmp_path):
    save_model(tiny_model, tokenizer, tmp_path / "base")
    model, _ = build_policy(ModelConfig(path=str(tmp_path / "base"), lora=LORA))
    with torch.no_grad():
        for p in adapter_parameters(model):
            p.normal_(0, 0.05)
    save_model(model, tokenizer, tmp_path / "sft")
    assert not (tmp_path / "sft" / "base").exists()  # the base is named, not copied
    # A second LoRA phase on the first one's directory: its base is the first adapter merged.
    second, _ = build_policy(ModelConfig(path=str(tmp_path / "sft"), lora=LORA))
    ids = _ids(tokenizer)
    torch.testing.assert_close(_logits(second, ids), _logits(model, ids), atol=1e-5, rtol=0)
    with torch.no_grad():
        for p in adapter_parameters(second):
            p.normal_(0, 0.05)
    save_model(second, tokenizer, tmp_path / "rl")
    loaded, _ = load_model(tmp_path / "rl")
    torch.testing.assert_close(_logits(loaded, ids), _logits(second, ids), atol=1e-5, rtol=0)


def test_fold_adapter_makes_the_trained_model_the_reference(tokenizer, tiny_model):
    model = _trained_lora(tokenizer, tiny_model)
    ids = _ids(tokenizer)
    before = _logits(model, ids)
    folded = fold_adapter(model, LORA)
    assert is_lora(folded) and folded is not model
    torch.testing.assert_close(_logits(folded, ids), before, atol=1e-5, rtol=0)
    torch.testing.assert_close(_logits(AdapterFreeView(folded), ids), before, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- PPO's critic
@pytest.mark.parametrize("critic", [CriticConfig(adapter=True), CriticConfig(shared=False)])
def test_ppo_critic_with_a_lora_policy(tokenizer, tiny_model, tmp_path, critic):
    model = apply_lora(tiny_model, LORA)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" not in n}
    trainer = _trainer(model, tokenizer, tmp_path, steps=2, critic=critic,
                       algorithm=AlgorithmConfig(advantage="gae"), group_size=2)
    policy_adapter = [p.detach().clone() for p in adapter_parameters(model)]
    trainer.train()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert any(not torch.equal(a, b) for a, b in zip(policy_adapter, adapter_parameters(model), strict=True))
    assert list(model.active_adapters) == ["default"]
    if critic.adapter:
        assert trainer.held_models() == [model]  # one copy of the base weights
        critic_adapter = adapter_parameters(model, "critic")
        assert critic_adapter and any(bool(p.abs().max() > 0) for n, p in model.named_parameters()
                                      if ".lora_B.critic." in n)
        state = trainer.advantage.state_dict()
        assert set(state["model"]) == {"head", "adapter"} and state["model"]["adapter"]
        trainer.advantage.load_state_dict(state)
    else:
        assert len(trainer.held_models()) == 2


def test_critic_adapter_needs_a_lora_policy(tokenizer, tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="rl.critic.adapter: needs a LoRA policy"):
        _trainer(tiny_model, tokenizer, tmp_path, critic=CriticConfig(adapter=True),
                 algorithm=AlgorithmConfig(advantage="gae"))
    with pytest.raises(ConfigError, match="rl.critic.adapter: the critic has its own adapter or shares"):
        load_config(RunConfig, [], ["rl.critic.adapter=true", "rl.critic.shared=true"])


# ---------------------------------------------------------------------------- the CLI, end to end
def test_cli_sft_then_rl_with_lora_then_export(tmp_path):
    out = tmp_path / "run"
    common = ["--set", "model.tiny.hidden_size=32", "--set", "model.tiny.num_layers=1", "--set", "model.lora.r=4",
              "--set", "eval.size=4", "--set", "eval.max_new_tokens=4", "--set", "tracking.tensorboard=false",
              "-o", str(out)]
    runner = CliRunner()
    result = runner.invoke(app, ["sft", "--set", "sft.steps=2", "--set", "sft.batch_size=4", *common])
    assert result.exit_code == 0, result.output
    assert (out / "sft" / "model" / "adapter_model.safetensors").is_file()
    result = runner.invoke(app, ["train", "--model", str(out / "sft" / "model"), "--set", "rl.steps=1",
                                 "--set", "rl.prompts_per_step=2", "--set", "rl.group_size=2",
                                 "--set", "rl.max_new_tokens=4", "--set", "rl.algorithm.kl_coef=0.1", *common])
    assert result.exit_code == 0, result.output
    adapter = json.loads((out / "rl" / "model" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str((out / "sft" / "model").resolve())  # chained, not copied
    result = runner.invoke(app, ["export", "--merge", str(out / "rl" / "model"), "-o", str(tmp_path / "merged")])
    assert result.exit_code == 0, result.output
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True) is not None
