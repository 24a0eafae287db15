"""The lean forward on Llama-3 RoPE, Qwen3, Mistral and Gemma/Gemma2 configs equals the HF forward;
everything else provably takes the HF forward; gradient checkpointing leaves gradients unchanged.

Models are built from transformers' own config classes at tiny sizes, fp32; norm weights are
perturbed so that a wrong norm formula shows.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from tamer.models import shared_prefix_logprobs, token_logprobs
from tamer.models.fast_forward import FastDecoder, unsupported_reason
from tamer.rollout.engine import HFEngine, _left_pad, preallocate
from tamer.rollout.types import SamplingParams
from tests.helpers import assert_learner_matches_hf

VOCAB, PAD = 101, 0
SIZE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0}
SUPPORTED = {
    "llama3_rope": lambda: LlamaConfig(**SIZE, rope_parameters=LLAMA3_ROPE),
    "linear_rope": lambda: LlamaConfig(**SIZE, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                "rope_theta": 1e4}),
    "yarn_rope": lambda: LlamaConfig(**SIZE, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                              "original_max_position_embeddings": 64}),
    "qwen3": lambda: Qwen3Config(**SIZE, head_dim=16),
    "qwen3_sliding": lambda: Qwen3Config(**SIZE, head_dim=24, use_sliding_window=True, sliding_window=5,
                                         max_window_layers=1),
    "qwen2_sliding": lambda: Qwen2Config(**SIZE, use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "mistral": lambda: MistralConfig(**SIZE),  # window 4096: longer than any sequence here
    "mistral_window": lambda: MistralConfig(**SIZE, sliding_window=5),
    "mistral_no_window": lambda: MistralConfig(**SIZE, sliding_window=None),
    "gemma": lambda: GemmaConfig(**SIZE, head_dim=16),
    # Small caps, so that soft-capping changes the result at these sizes.
    "gemma2": lambda: Gemma2Config(**SIZE, head_dim=16, query_pre_attn_scalar=24, sliding_window=5,
                                   attn_logit_softcapping=0.5, final_logit_softcapping=2.0),
}
UNSUPPORTED = {
    "dynamic_rope": lambda: LlamaConfig(**SIZE, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                 "rope_theta": 1e4}),
    "exact_gelu": lambda: LlamaConfig(**SIZE, hidden_act="gelu"),
    "mlp_bias": lambda: LlamaConfig(**SIZE, mlp_bias=True),
    "gemma3": lambda: Gemma3TextConfig(**SIZE, head_dim=16, sliding_window=5),
}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [14, 15, 16], [20, 21, 22, 23, 24, 25]]
ROWS = [PROMPTS[0] + [30, 31, 32, 33], PROMPTS[0] + [34, 35], PROMPTS[2] + [40, 41, 42, 43, 44, 45, 46],
        PROMPTS[2] + [47]]


def build(name: str) -> torch.nn.Module:
    config = (SUPPORTED | UNSUPPORTED)[name]()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for key, param in model.named_parameters():
                if "norm" in key:  # HF inits norms to 1 (or Gemma's 0): make the formula matter
                    param.add_(0.3 * torch.randn_like(param))
    return model


def _right_padded(rows):
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
    return ids, torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])


def test_every_supported_config_takes_the_fast_path():
    for name in SUPPORTED:
        assert unsupported_reason(build(name)) is None, name
    arch = FastDecoder.for_model(build("gemma2")).arch
    assert arch.windows == (5, None) and arch.attn_softcap == 0.5 and arch.final_softcap == 2.0 and arch.sandwich
    assert FastDecoder.for_model(build("yarn_rope")).arch.rope_scale > 1.0
    assert FastDecoder.for_model(build("qwen3_sliding")).arch.windows == (None, 5)  # layers past max_window_layers
    assert FastDecoder.for_model(build("mistral_window")).arch.windows == (5, 5)


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_logits_equal_hf_left_and_right_padded(name):
    model = build(name)
    fast = FastDecoder.for_model(model)
    for ids, mask in (_left_pad(ROWS, PAD), _right_padded(ROWS)):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            ours = fast.forward(ids, mask, positions)[0]
            theirs = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        valid = mask.bool()
        torch.testing.assert_close(ours[valid], theirs[valid], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_learner_logprobs_and_gradients_equal_hf(name, monkeypatch):
    model = build(name).train()
    ids, mask = _right_padded(ROWS)
    plen, index = torch.tensor([9, 9, 6, 6]), torch.tensor([0, 0, 1, 1])

    valid = mask.bool()
    valid[:, 0] = False
    assert_learner_matches_hf(model, ids, mask, plen, index, monkeypatch, valid)


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_prefill_and_decode_with_kv_cache_equal_hf(name):
    model = build(name)
    fast = FastDecoder.for_model(model)
    ids, mask = _left_pad(PROMPTS, PAD)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    n, extra = 2, 8  # 9-token prompts + 8 steps: past the 5-token windows
    with torch.inference_mode():
        cache = DynamicCache()
        ref = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    cache=cache).logits[:, -1]
        logits, kv = fast.prefill(ids, mask, positions, repeat=n, extra=extra)
        torch.testing.assert_close(logits, ref.repeat_interleave(n, 0), atol=1e-5, rtol=1e-5)
        cache.batch_repeat_interleave(n)
        preallocate(cache, extra)
        full = torch.ones(len(PROMPTS) * n, ids.shape[1] + extra, dtype=torch.long)
        full[:, :ids.shape[1]] = mask.repeat_interleave(n, 0)
        last = positions[:, -1].repeat_interleave(n, 0)
        generator = torch.Generator().manual_seed(0)
        for step in range(extra - 1):
            tokens = torch.randint(1, VOCAB, (len(last),), generator=generator)
            last = last + 1
            ref = model(input_ids=tokens[:, None], attention_mask=full[:, :ids.shape[1] + step + 1],
                        position_ids=last[:, None], use_cache=True, cache=cache).logits[:, -1]
            torch.testing.assert_close(fast.decode(tokens, last, kv, full.bool()), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_engine_samples_what_the_hf_path_samples(name):
    """Same seed, same tokens and sampling logprobs; then a second turn that reuses the first's KV."""
    model = build(name)
    fast, plain = HFEngine(model, PAD), HFEngine(model, PAD, fast=False)
    assert fast.fast is not None and plain.fast is None
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=4, reuse_prefix=True)
    ours, theirs = fast.generate(PROMPTS, params), plain.generate(PROMPTS, params)
    for engine_out in (ours, theirs):
        assert len(engine_out) == len(PROMPTS)
    _assert_same(ours, theirs)
    second = [PROMPTS[0] + ours[0][0].token_ids + [50, 51], PROMPTS[2] + ours[2][1].token_ids + [52]]
    theirs_second = [PROMPTS[0] + theirs[0][0].token_ids + [50, 51], PROMPTS[2] + theirs[2][1].token_ids + [52]]
    assert second == theirs_second
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=6, seed=5, reuse_prefix=True)
    _assert_same(fast.generate(second, params), plain.generate(second, params))
    assert fast.prefix_store.hits >= 2 and plain.prefix_store.hits >= 2


def _assert_same(ours, theirs):
    for group_a, group_b in zip(ours, theirs):
        for a, b in zip(group_a, group_b):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_configs_take_the_hf_forward(name):
    """No lean forward: the engine and the learner run the HF forward, and give its results."""
    model = build(name)
    assert unsupported_reason(model) is not None and FastDecoder.for_model(model) is None
    engine = HFEngine(model, PAD)
    assert engine.fast is None
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=1)
    _assert_same(engine.generate(PROMPTS, params), HFEngine(model, PAD, fast=False).generate(PROMPTS, params))
    ids, mask = _right_padded(ROWS)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        lp = token_logprobs(model, ids, mask)
    valid = mask.bool()[:, 1:]
    torch.testing.assert_close(lp[:, 1:][valid], expected[valid], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["qwen3", "gemma2", "dynamic_rope"])  # two lean forwards, one HF forward
def test_gradient_checkpointing_gives_the_same_gradients(name):
    """Same logprobs and gradients; fewer activations kept for backward (the recompute really happens)."""
    ids, mask = _right_padded(ROWS)
    plen, index = torch.tensor([9, 9, 6, 6]), torch.tensor([0, 0, 1, 1])
    results, saved = [], []
    for checkpointing in (False, True):
        model = build(name).train()
        if checkpointing:
            model.activation_checkpointing_enable()
            assert model.is_activation_checkpointing
        grads, kept = [], [0]

        def pack(t, kept=kept):
            kept[0] += t.numel()
            return t
        forwards = (lambda model=model: token_logprobs(model, ids, mask),
                    lambda model=model: shared_prefix_logprobs(model, ids, mask, plen, index))
        for fn in forwards:
            model.zero_grad()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                lp = fn()
            (lp * mask).sum().backward()
            grads.append((lp.detach(), [p.grad.clone() for p in model.parameters()]))
        results.append(grads)
        saved.append(kept[0])
    assert saved[1] < 0.7 * saved[0]
    for (lp_a, grads_a), (lp_b, grads_b) in zip(*results):
        torch.testing.assert_close(lp_a, lp_b, atol=1e-6, rtol=1e-6)
        for ga, gb in zip(grads_a, grads_b):
            torch.testing.assert_close(ga, gb, atol=1e-6, rtol=1e-5)


def test_model_gradient_checkpointing_trains_to_the_same_weights(tmp_path, monkeypatch):
    """`model.gradient_checkpointing=true` through build_policy: two RL steps land on the same weights."""
    from tamer.evaluate import EvalConfig
    from tamer.models import TinyModelConfig
    from tamer.pipeline import ModelConfig, build_policy
    from tamer.rewards import RewardComposer, RewardConfig
    from tamer.tasks import ArithmeticTasks
    from tamer.trainers.common import OptimConfig
    from tamer.trainers.rl import RLConfig, RLTrainer

    tiny = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    train, held = ArithmeticTasks().split()
    rewards = RewardComposer(RewardConfig(weights={"correctness": 1.0, "length": 1.0},
                                          params={"length": {"max_tokens": 8}}))
    weights, recomputed = [], []
    checkpoint = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint",
                        lambda *a, **k: recomputed.append(1) or checkpoint(*a, **k))
    for checkpointing in (False, True):
        model, tokenizer = build_policy(ModelConfig(tiny=tiny, gradient_checkpointing=checkpointing))
        assert model.is_activation_checkpointing == checkpointing
        cfg = RLConfig(steps=2, prompts_per_step=2, group_size=4, max_new_tokens=8, optim=OptimConfig(lr=1e-3),
                       eval_every=0)
        RLTrainer(model, tokenizer, train, held, rewards, cfg, EvalConfig(size=2, max_new_tokens=4),
                  run_dir=tmp_path / str(checkpointing)).train()
        weights.append([p.detach().clone() for p in model.parameters()])
        assert bool(recomputed) == checkpointing  # the learner's layers were recomputed in backward
    for a, b in zip(*weights):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama3_rope", "qwen3", "mistral_window", "gemma", "gemma2"])
def test_bf16_weights_follow_the_hf_forward(name):
    """`model.dtype=bfloat16`: cos/sin, norms and residual adds rounded where HF rounds them, so the
    lean forward and sampler give the HF forward's results (bitwise on the CPU measured)."""
    model = build(name).to(torch.bfloat16)
    ids, mask = _right_padded(ROWS)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ours = FastDecoder.for_model(model).forward(ids, mask, positions)[0]
        theirs = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    assert ours.dtype == theirs.dtype == torch.bfloat16
    torch.testing.assert_close(ours[mask.bool()], theirs[mask.bool()], atol=1e-2, rtol=1e-2)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3)
    _assert_same_tokens(HFEngine(model, PAD).generate(PROMPTS, params),
                        HFEngine(model, PAD, fast=False).generate(PROMPTS, params))


def _assert_same_tokens(ours, theirs, atol=1e-2):
    for group_a, group_b in zip(ours, theirs):
        for a, b in zip(group_a, group_b):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=atol, rtol=0.0)


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_packed_sft_loss_equals_the_padded_hf_loss_or_falls_back(name):
    """The padding-free SFT loss follows each family's forward (q/k norms, GeGLU, embedding scale, soft-capped
    logits); configs it does not cover (sliding windows in use, soft-capped scores) are refused and train padded."""
    from tamer.trainers.packed import pack, packable, packed_loss
    from tamer.trainers.sft import Example, collate, sft_loss

    model = build(name).train()
    examples = [Example(row[:len(p)], row[len(p):]) for p, row in zip([PROMPTS[0]] * 2 + [PROMPTS[2]] * 2, ROWS)]
    fast = FastDecoder.for_model(model)
    if not packable(fast):
        assert any(w is not None for w in fast.arch.windows) or fast.arch.attn_softcap is not None
        return
    params = [p for p in model.parameters() if p.requires_grad]
    padded = sft_loss(model, collate(examples, PAD))  # the HF forward on right-padded rows
    g_padded = torch.autograd.grad(padded, params)
    packed = packed_loss(model, pack(examples), fast)
    g_packed = torch.autograd.grad(packed, params)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_packed, g_padded):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_rms_norm_backward_by_hand():
    """The learner's RMSNorm (`_RMSNorm`): forward bitwise `F.rms_norm`, backward = the derivation in
    docs/algorithms.md#rmsnorm-backward, by hand on x = (3, 4), w = (1, 2), eps 0, g = (1, 1):
    r = 1/sqrt(12.5), so r² = 0.08; ∂L/∂x = r·((1, 2) − 5.5·r²·(3, 4)) = r·(−0.32, 0.24); ∂L/∂w = (3r, 4r)."""
    import torch.nn.functional as F

    from tamer.models.fast_arch import _RMSNorm, rms_norm
    x = torch.tensor([[3.0, 4.0]], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    _RMSNorm.apply(x, w, 0.0).sum().backward()
    r = 12.5 ** -0.5
    assert torch.allclose(x.grad, torch.tensor([[-0.32 * r, 0.24 * r]], dtype=torch.float64), atol=1e-15)
    assert torch.allclose(w.grad, torch.tensor([3 * r, 4 * r], dtype=torch.float64), atol=1e-15)
    assert abs(float((x.grad * x.detach()).sum())) < 1e-15  # scale invariance at eps 0: ∂L/∂x ⟂ x

    gen = torch.Generator().manual_seed(0)
    x64 = torch.randn(3, 5, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    w64 = torch.randn(8, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: _RMSNorm.apply(a, b, 1e-6), (x64, w64))

    # float32: the forward is F.rms_norm's bit for bit; the gradients match autograd's within rounding
    xs, ws = x64.detach().float().requires_grad_(), w64.detach().float().requires_grad_()
    xr, wr = xs.detach().clone().requires_grad_(), ws.detach().clone().requires_grad_()
    ours, ref = rms_norm(xs, (ws, 1e-6), offset=False), F.rms_norm(xr, (8,), wr, 1e-6)
    assert ours.grad_fn is not None and "RMSNorm" in type(ours.grad_fn).__name__ and torch.equal(ours, ref)
    g = torch.randn(3, 5, 8, generator=gen)
    ours.backward(g)
    ref.backward(g)
    assert torch.allclose(xs.grad, xr.grad, atol=1e-6) and torch.allclose(ws.grad, wr.grad, atol=1e-5)
    with torch.no_grad():  # without autograd, torch's own op
        assert torch.equal(rms_norm(xs, (ws, 1e-6), offset=False), ref)
