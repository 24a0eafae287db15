"""SFT: padding-free packed batches (trainers/packed.py) give the padded loss and gradients."""

from __future__ import annotations

import pytest
import torch

from tamer.models import TinyModelConfig, build_tiny_model
from tamer.trainers import packed as packed_module
from tamer.trainers.common import OptimConfig
from tamer.trainers.packed import attention_groups, pack, packed_loss, shared_prefix
from tamer.trainers.sft import Example, SFTConfig, SFTTrainer, collate, sft_loss


def _examples(n: int = 9, seed: int = 0) -> list[Example]:
    """Varied lengths (several attention groups), completion masks with holes (tool output not learned)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(5, 200, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        completion = torch.randint(5, 200, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
        mask = None if i % 3 == 0 else [0 if 3 <= t < 6 else 1 for t in range(len(completion))]
        out.append(Example(prompt, completion, mask))
    return out


def test_pack_by_hand():
    a = Example([1, 2, 3], [4, 5], None)  # learns 4 (after 3) and 5 (after 4)
    b = Example([7], [8, 9, 10], [1, 0, 1])  # learns 8 (after 7) and 10 (after 9); 9 is tool output
    batch = pack([a, b])  # sorted by length: b (4 tokens) first, then a (5)
    assert batch["input_ids"].tolist() == [7, 8, 9, 10, 1, 2, 3, 4, 5]
    assert batch["positions"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4]
    assert batch["lengths"].tolist() == [4, 5]
    assert batch["select"].tolist() == [0, 2, 6, 7]
    assert batch["targets"].tolist() == [8, 10, 4, 5]
    assert batch["shared"] == 0


def test_attention_groups_by_hand():
    """Consecutive groups of at most `budget` padded tokens (rows x the group's longest, lengths ascending)."""
    # 2 x 4 = 8 fits 12; 3 x 5 = 15 does not; 2 x 10 = 20 does not: 10 goes alone
    assert attention_groups([3, 4, 5, 10], budget=12) == [range(0, 2), range(2, 3), range(3, 4)]
    assert attention_groups([20], budget=12) == [range(0, 1)]  # longer than the budget: a group of its own
    assert attention_groups([44] * 32, budget=1024) == [range(0, 23), range(23, 32)]
    assert attention_groups([240] * 16, budget=1024) == [range(i, i + 4) for i in range(0, 16, 4)]
    assert attention_groups([]) == []


def test_pack_shared_prefix_by_hand():
    """Both sequences start with 1 2: packed once, gathered into both attention rows, learned targets kept."""
    a = Example([1, 2, 3], [4, 5], None)  # 1 2 3 4 5: learns 4 (after 3), 5 (after 4)
    b = Example([1, 2], [6, 7], [1, 0])  # 1 2 6 7: learns 6 (after 2); 7 is tool output
    batch = pack([a, b], share_prefix=True)
    assert batch["shared"] == 2
    # prefix 1 2, then b's own tokens (shorter first) 6 7, then a's 3 4 5
    assert batch["input_ids"].tolist() == [1, 2, 6, 7, 3, 4, 5]
    assert batch["positions"].tolist() == [0, 1, 2, 3, 2, 3, 4]
    assert batch["select"].tolist() == [1, 4, 5]  # b: after 2 (shared index 1); a: after 3 (4), after 4 (5)
    assert batch["targets"].tolist() == [6, 4, 5]
    ((rows, width, source, slot, take),) = batch["groups"]
    assert (rows, width) == (2, 5)
    assert source.tolist() == [0, 1, 2, 3, 0, 1, 4, 5, 6]  # row b then row a, the prefix in both
    assert slot.tolist() == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert take.tolist() == [0, 1, 2, 3, 7, 8, 9]  # the prefix from row b, then b's and a's own tokens
    assert pack([a, b], share_prefix=False)["input_ids"].tolist() == [1, 2, 6, 7, 1, 2, 3, 4, 5]
    # a sequence keeps at least one token of its own; one sequence shares nothing
    assert pack([a, Example([1, 2, 3], [4], None)])["shared"] == 3 and pack([a])["shared"] == 0
    # a prefix saving under MIN_SHARED_FRACTION of the tokens is not worth its gathers: 1 of 22 tokens
    long = Example([1, 2, 3], list(range(20, 37)), None)
    assert shared_prefix([[1, 2, 3, 4], [1, 5]]) == 1 and pack([long, Example([1], [9], None)])["shared"] == 0


def _with_system_prompt(examples: list[Example], length: int = 17) -> list[Example]:
    system = list(range(210, 210 + length))
    return [Example(system + e.prompt_ids, e.completion_ids, e.completion_mask) for e in examples]


@pytest.mark.parametrize("arch,system,budget", [("qwen2", 0, 1024), ("llama", 0, 64), ("qwen2", 17, 64),
                                                ("llama", 17, 1024)])
def test_packed_loss_and_gradients_equal_padded(tokenizer, arch, system, budget, monkeypatch):
    """`system`: every example starts with the same tokens (a system prompt), packed once; `budget`: padded
    tokens per attention group (64: several groups, 1024: one)."""
    monkeypatch.setattr(packed_module, "ATTENTION_TOKENS", budget)
    model = build_tiny_model(tokenizer, TinyModelConfig(arch=arch, hidden_size=64, num_layers=2, num_heads=4,
                                                        num_kv_heads=2, intermediate_size=128,
                                                        tie_word_embeddings=arch == "qwen2")).train()
    examples = _with_system_prompt(_examples(), system) if system else _examples()
    params = list(model.parameters())
    padded = sft_loss(model, collate(examples, tokenizer.pad_token_id))
    g_padded = torch.autograd.grad(padded, params)
    batch = pack(examples)
    assert batch["shared"] == system and len(batch["input_ids"]) == sum(
        len(e.prompt_ids) + len(e.completion_ids) for e in examples) - system * (len(examples) - 1)
    assert (len(batch["groups"]) > 1) == (budget == 64)
    packed = packed_loss(model, batch)
    g_packed = torch.autograd.grad(packed, params)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_packed, g_padded):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_trainer_padding_free_follows_the_padded_run(tokenizer):
    """Three optimizer steps from the same init and data order: the same losses and weights either way."""
    data = _with_system_prompt(_examples(12, seed=1))
    results = []
    for padding_free, share_prefix in ((True, True), (True, False), (False, False)):
        model = build_tiny_model(tokenizer, TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                                            intermediate_size=64))
        trainer = SFTTrainer(model, tokenizer, data, SFTConfig(steps=3, batch_size=5, log_every=1,
                                                               padding_free=padding_free, share_prefix=share_prefix,
                                                               optim=OptimConfig(lr=1e-3)))
        assert (trainer.fast is not None) == padding_free
        losses = []
        trainer.train(type("T", (), {"log": lambda self, m, step, losses=losses: losses.append(m["sft/loss"])})())
        results.append((losses, torch.cat([p.detach().flatten() for p in model.parameters()])))
    (loss_a, w_a), *others = results
    assert len(loss_a) == 3
    for loss_b, w_b in others:
        torch.testing.assert_close(torch.tensor(loss_a), torch.tensor(loss_b), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w_a, w_b, atol=1e-5, rtol=1e-4)


def test_unsupported_model_trains_padded(tokenizer):
    model = build_tiny_model(tokenizer, TinyModelConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                                        intermediate_size=64))
    model.config.attention_dropout = 0.1  # the lean forward refuses dropout: HF forward, padded batches
    trainer = SFTTrainer(model, tokenizer, _examples(4), SFTConfig(steps=2, batch_size=2))
    assert trainer.fast is None
    assert torch.isfinite(torch.tensor(trainer.train()))
    with pytest.raises(ValueError, match="no lean forward|packed path"):
        packed_loss(model, pack(_examples(2)))
