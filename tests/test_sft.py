"""SFT: padding-free packed batches (trainers/packed.py) give the padded loss and gradients."""

from __future__ import annotations

import pytest
import torch

from tamer.models import TinyModelConfig, build_tiny_model
from tamer.trainers.common import OptimConfig
from tamer.trainers.packed import pack, packed_loss
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


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_packed_loss_and_gradients_equal_padded(tokenizer, arch):
    model = build_tiny_model(tokenizer, TinyModelConfig(arch=arch, hidden_size=64, num_layers=2, num_heads=4,
                                                        num_kv_heads=2, intermediate_size=128,
                                                        tie_word_embeddings=arch == "qwen2")).train()
    examples = _examples()
    params = list(model.parameters())
    padded = sft_loss(model, collate(examples, tokenizer.pad_token_id))
    g_padded = torch.autograd.grad(padded, params)
    packed = packed_loss(model, pack(examples))
    g_packed = torch.autograd.grad(packed, params)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_packed, g_padded):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_trainer_padding_free_follows_the_padded_run(tokenizer):
    """Three optimizer steps from the same init and data order: the same losses and weights either way."""
    data = _examples(12, seed=1)
    results = []
    for padding_free in (True, False):
        model = build_tiny_model(tokenizer, TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                                            intermediate_size=64))
        trainer = SFTTrainer(model, tokenizer, data, SFTConfig(steps=3, batch_size=5, log_every=1,
                                                               padding_free=padding_free, optim=OptimConfig(lr=1e-3)))
        assert (trainer.fast is not None) == padding_free
        losses = []
        trainer.train(type("T", (), {"log": lambda self, m, step, losses=losses: losses.append(m["sft/loss"])})())
        results.append((losses, torch.cat([p.detach().flatten() for p in model.parameters()])))
    (loss_a, w_a), (loss_b, w_b) = results
    assert len(loss_a) == 3
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
