"""The HF forward's one-query decode attention (models/decode_attention.py): by hand, against transformers'
SDPA function, and in the engine (same samples with it on and off, switched for the decode loop only)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import tamer.models.decode_attention as da
from tamer.models import LoraConfig, apply_lora
from tamer.rollout.engine import HFEngine
from tamer.rollout.types import SamplingParams


class _Layer(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True
        self.eval()


def test_one_query_by_hand():
    """Two query heads on one KV head, two keys, the first masked out for batch row 0 only."""
    q = torch.tensor([[[[1.0, 0.0]], [[0.0, 2.0]]]])  # (1, 2 heads, 1, 2)
    q = torch.cat([q, q])  # two batch rows
    k = torch.tensor([[[[1.0, 1.0], [3.0, 0.0]]]]).expand(2, 1, 2, 2)
    v = torch.tensor([[[[10.0, 0.0], [0.0, 20.0]]]]).expand(2, 1, 2, 2)
    mask = torch.tensor([[False, True], [True, True]])[:, None, None, :]
    out, weights = da.decode_attention(_Layer(2), q, k, v, mask, scaling=1.0)
    assert weights is None and out.shape == (2, 1, 2, 2)
    # row 0 sees only key 1: both heads return v[1]
    torch.testing.assert_close(out[0, 0], torch.tensor([[0.0, 20.0], [0.0, 20.0]]))
    # row 1, head 0: scores q.k = (1, 3); head 1: (2, 0)
    p0 = torch.softmax(torch.tensor([1.0, 3.0]), 0)
    p1 = torch.softmax(torch.tensor([2.0, 0.0]), 0)
    torch.testing.assert_close(out[1, 0, 0], p0[0] * v[1, 0, 0] + p0[1] * v[1, 0, 1])
    torch.testing.assert_close(out[1, 0, 1], p1[0] * v[1, 0, 0] + p1[1] * v[1, 0, 1])
    # scaling defaults to 1/sqrt(D)
    default, _ = da.decode_attention(_Layer(2), q, k, v, mask)
    scaled, _ = da.decode_attention(_Layer(2), q, k, v, mask, scaling=1 / math.sqrt(2))
    torch.testing.assert_close(default, scaled)


def _inputs(batch=5, heads=4, kv=2, dim=8, length=7, q_len=1, capacity=11):
    torch.manual_seed(0)
    q = torch.randn(batch, q_len, heads, dim).transpose(1, 2)  # the layout HF's attention modules pass
    keys, values = torch.randn(batch, kv, capacity, dim), torch.randn(batch, kv, capacity, dim)
    mask = torch.ones(batch, 1, q_len, length, dtype=torch.bool)
    mask[::2, ..., :3] = False  # left padding in every other row
    return q, keys[:, :, :length], values[:, :, :length], mask  # keys/values: views of a KV cache's buffers


@pytest.mark.parametrize("kind", ["bool", "float", "none"])
def test_one_query_equals_transformers_sdpa(kind):
    q, k, v, mask = _inputs()
    if kind == "float":
        mask = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    elif kind == "none":
        mask = None
    layer = _Layer(2)
    ours, _ = da.decode_attention(layer, q, k, v, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=0.3)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def test_every_other_call_is_transformers_sdpa():
    """Several queries (prompts, the learner), dropout and bf16 autocast go to SDPA unchanged."""
    layer = _Layer(2)
    q, k, v, mask = _inputs(q_len=3, length=7)
    assert torch.equal(da.decode_attention(layer, q, k, v, mask)[0], sdpa_attention_forward(layer, q, k, v, mask)[0])
    q, k, v, mask = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(da.decode_attention(layer, q, k, v, mask)[0],
                           sdpa_attention_forward(layer, q, k, v, mask)[0])
    assert torch.equal(da.decode_attention(layer, q.double(), k.double(), v.double(), mask)[0],
                       sdpa_attention_forward(layer, q.double(), k.double(), v.double(), mask)[0])


SIZE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
CONFIGS = {
    "llama": lambda: LlamaConfig(**SIZE),
    "gemma3_sliding": lambda: Gemma3TextConfig(**SIZE, head_dim=16, sliding_window=5),  # windows in the mask
    "gemma2_eager": lambda: Gemma2Config(**SIZE, head_dim=16),  # no SDPA in transformers: left as it is
    "llama_lora": lambda: LlamaConfig(**SIZE),  # adapters: the lean forward refuses it, the HF forward runs
}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [14, 15, 16], [20, 21, 22, 23, 24, 25]]  # left-padded rows


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_engine_samples_the_same_with_it_on_and_off(name, monkeypatch):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()
    if name == "llama_lora":
        model = apply_lora(model, LoraConfig(r=4, seed=1))
        for p in model.parameters():  # adapters away from their zero start, so that they change the samples
            if p.requires_grad:
                p.data.normal_(0, 0.05)
    before = model.config._attn_implementation
    assert before == ("eager" if name == "gemma2_eager" else "sdpa")
    engine = HFEngine(model, 0, fast=name == "llama_lora")  # LoRA: the engine's own choice is the HF forward
    assert engine.fast is None
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[1].shape[2])  # query length
        return da.decode_attention(*args, **kwargs)
    monkeypatch.setitem(AttentionInterface._global_mapping, da.NAME, counted)
    seen = []
    decode = engine._decode
    monkeypatch.setattr(engine, "_decode", lambda *a, **kw: seen.append(model.config._attn_implementation)
                        or decode(*a, **kw))
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=4)
    on = engine.generate(PROMPTS, params)
    assert model.config._attn_implementation == before  # the learner and checkpoints keep theirs
    assert seen == [da.NAME if before == "sdpa" else before]
    # every decode step's layers (2 x 11 steps: no stop token given), and only they, came here
    assert calls == ([1] * 2 * 11 if before == "sdpa" else [])
    monkeypatch.setattr(da, "ENABLED", False)
    off = engine.generate(PROMPTS, params)
    assert seen[-1] == before
    for group_on, group_off in zip(on, off):
        for a, b in zip(group_on, group_off):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5)
