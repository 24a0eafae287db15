"""FastDecoder (models/fast_forward.py) computes what the HF forward computes, or is not used."""

import pytest
import torch
from transformers import DynamicCache

from tamer.models import TinyModelConfig, build_tiny_model, fast_forward, token_logprobs
from tamer.models.fast_forward import FastDecoder, linear, unsupported_reason
from tamer.rollout.engine import HFEngine, _left_pad, preallocate
from tamer.rollout.types import SamplingParams
from tests.helpers import assert_learner_matches_hf, hf_only

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24]]


ROPES = {  # RoPE variants with fixed frequencies, as Llama 3 and yarn-scaled checkpoints ship them
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8, "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
}


def _model(tokenizer, arch, **overrides):
    rope = overrides.pop("rope", None)
    config = dict(arch=arch, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                  tie_word_embeddings=arch == "qwen2")
    config.update(overrides)
    if rope is None:
        return build_tiny_model(tokenizer, TinyModelConfig(**config)).eval()
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    hf = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     rope_parameters=ROPES[rope], pad_token_id=tokenizer.pad_token_id)
    return AutoModelForCausalLM.from_config(hf).eval()


@pytest.mark.parametrize("arch", ["qwen2", "llama", "llama3", "yarn", "linear"])
def test_prefill_and_decode_logits_equal_hf(tokenizer, arch):
    """Also for scaled RoPE (positions beyond `original_max_position_embeddings` = 8 hit the scaling)."""
    model = _model(tokenizer, arch) if arch in ("qwen2", "llama") else _model(tokenizer, "llama", rope=arch)
    assert unsupported_reason(model) is None
    fast = FastDecoder.for_model(model)
    ids, mask = _left_pad(PROMPTS, tokenizer.pad_token_id)  # left padding of different widths
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    n, extra = 2, 6
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
            tokens = torch.randint(0, len(tokenizer), (len(last),), generator=generator)
            last = last + 1
            ref = model(input_ids=tokens[:, None], attention_mask=full[:, :ids.shape[1] + step + 1],
                        position_ids=last[:, None], use_cache=True, cache=cache).logits[:, -1]
            torch.testing.assert_close(fast.decode(tokens, last, kv, full.bool()), ref, atol=1e-5, rtol=1e-5)
        for ours, theirs in zip(kv.layers, cache.layers):  # what the prefix store keeps
            torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ours.values, theirs.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_same_seed_same_tokens_as_hf_path(tokenizer, arch, temperature, precision):
    """Also under bf16 autocast: the residual stream stays float32 as in HF (no bf16 addmm)."""
    model = _model(tokenizer, arch)
    params = SamplingParams(n=3, temperature=temperature, max_new_tokens=12, seed=4)
    fast = HFEngine(model, tokenizer.pad_token_id, precision=precision)
    plain = HFEngine(model, tokenizer.pad_token_id, fast=False, precision=precision)
    assert fast.fast is not None and plain.fast is None
    ours, theirs = fast.generate(PROMPTS, params), plain.generate(PROMPTS, params)
    for group_a, group_b in zip(ours, theirs):
        for a, b in zip(group_a, group_b):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_bf16_snapshot_is_bitwise_autocast_of_fp32_snapshot(tokenizer, arch):
    """refresh(bf16) stores the matmul weights cast once; under bf16 autocast the logits are bitwise
    those of the fp32 snapshot that autocast casts at every call (qwen2: with q/k/v biases, tied head)."""
    model = _model(tokenizer, arch)
    cast, plain = FastDecoder.for_model(model), FastDecoder.for_model(model)
    cast.refresh(torch.bfloat16)
    plain.refresh()
    layer = cast.layers[0]
    assert {layer.qkv_w.dtype, layer.o_w.dtype, layer.gu_w.dtype, layer.down_w.dtype, cast.head.dtype} == {
        torch.bfloat16}
    assert (layer.qkv_b is None) == (arch == "llama") and (layer.qkv_b is None or layer.qkv_b.dtype == torch.bfloat16)
    assert cast.embed.dtype == layer.ln1[0].dtype == cast.norm[0].dtype == torch.float32  # outside the matmuls
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32  # the model is untouched
    ids, mask = _left_pad(PROMPTS, tokenizer.pad_token_id)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    full = torch.ones(len(PROMPTS), ids.shape[1] + 4, dtype=torch.bool)
    full[:, :ids.shape[1]] = mask.bool()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        (a, kv_a), (b, kv_b) = (fast.prefill(ids, mask, positions, extra=4) for fast in (cast, plain))
        assert torch.equal(a, b)
        last = positions[:, -1]
        for token in range(3):
            last = last + 1
            tokens = torch.full((len(PROMPTS),), 30 + token)
            assert torch.equal(cast.decode(tokens, last, kv_a, full), plain.decode(tokens, last, kv_b, full))
    cast.refresh()  # back to fp32: the live weights by reference again
    assert cast.layers[0].o_w is model.model.layers[0].self_attn.o_proj.weight


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_decode_mlp_on_transposed_activations_equals_the_row_major_one(tokenizer, arch, monkeypatch):
    """`MLP_TRANSPOSED` (the default): the float32 decode MLP runs as W_gu @ h.T with the activation
    on (I, B); same logits and KV as with it off (and as HF, test above), over several decode steps."""
    model = _model(tokenizer, arch)
    shapes = []
    original = fast_forward.activate
    monkeypatch.setattr(fast_forward, "activate", lambda x, act: shapes.append(tuple(x.shape)) or original(x, act))
    ids, mask = _left_pad(PROMPTS, tokenizer.pad_token_id)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    full = torch.ones(len(PROMPTS), ids.shape[1] + 5, dtype=torch.bool)
    full[:, :ids.shape[1]] = mask.bool()
    runs = {}
    for transposed in (True, False):
        monkeypatch.setattr(fast_forward, "MLP_TRANSPOSED", transposed)
        fast = FastDecoder.for_model(model)
        with torch.inference_mode():
            _, kv = fast.prefill(ids, mask, positions, extra=5)
            shapes.clear()
            last, out = positions[:, -1], []
            for token in range(4):
                last = last + 1
                out.append(fast.decode(torch.full((len(PROMPTS),), 30 + token), last, kv, full))
        runs[transposed] = (torch.stack(out), kv)
        assert set(shapes) == {(128, len(PROMPTS)) if transposed else (len(PROMPTS), 128)}
    torch.testing.assert_close(runs[True][0], runs[False][0], atol=1e-6, rtol=1e-6)
    for a, b in zip(runs[True][1].layers, runs[False][1].layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-6, rtol=1e-6)


def _pack_with(backend: str, monkeypatch) -> None:
    """Decode packs every weight with `backend` ("mkl" or "onednn"), on any CPU vendor; skips without it."""
    if not getattr(fast_forward, f"{backend.upper()}_PACKED_AVAILABLE"):
        pytest.skip(f"torch built without {backend}")
    monkeypatch.setattr(fast_forward, "MKL_PACKED", backend == "mkl")
    monkeypatch.setattr(fast_forward, "ONEDNN_PACKED", backend == "onednn")
    monkeypatch.setattr(fast_forward, "PACK_MIN_WEIGHTS", 0)


@pytest.mark.parametrize(("arch", "backend"), [("qwen2", "mkl"), ("llama", "mkl"), ("qwen2", "onednn"),
                                               ("llama", "onednn")])
def test_packed_decode_matches_hf(tokenizer, arch, backend, monkeypatch):
    """Decode on MKL- or oneDNN-packed weights (every weight packed here): HF's logits up to summation
    order, the same sampled tokens; packed once per `generate` and row count, released when it ends;
    none in bf16."""
    _pack_with(backend, monkeypatch)
    built = []
    original = FastDecoder._packed

    def spy(self, rows):
        built.append((rows, original(self, rows)))
        return built[-1][1]
    monkeypatch.setattr(FastDecoder, "_packed", spy)
    model = _model(tokenizer, arch)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=2)
    engine, plain = HFEngine(model, tokenizer.pad_token_id), HFEngine(model, tokenizer.pad_token_id, fast=False)
    ours, theirs = engine.generate(PROMPTS, params), plain.generate(PROMPTS, params)
    assert {rows for rows, _ in built} == {len(PROMPTS) * params.n} and len({id(got) for _, got in built}) == 1
    packs, head = built[0][1]
    assert head is not None and all(p is not None for layer in packs for p in layer)
    assert all(p.onednn is (backend == "onednn") for p in [head, *(p for layer in packs for p in layer)])
    assert engine.fast._packs == {}  # released with the generate
    for group_a, group_b in zip(ours, theirs):
        for a, b in zip(group_a, group_b):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5)
    built.clear()
    HFEngine(model, tokenizer.pad_token_id, precision="bf16").generate(PROMPTS, params)
    assert built and all(got is None for _, got in built)
    built.clear()
    monkeypatch.setattr(fast_forward, "available_mb", lambda: 0.0)  # no memory to spare: F.linear, same tokens
    again = engine.generate(PROMPTS, params)
    assert built and all(got is None for _, got in built)
    assert [o.token_ids for g in again for o in g] == [o.token_ids for g in theirs for o in g]
    built.clear()
    monkeypatch.setattr(fast_forward, "available_mb", lambda: None)  # unknown (not Linux): packed
    monkeypatch.setattr(fast_forward, "PACK_MIN_WEIGHTS", 1 << 40)  # too small to pack: F.linear as before
    engine.generate(PROMPTS, params)
    assert built and all(got is None for _, got in built)


def test_available_memory_reads_meminfo_and_the_cgroup_limit(tmp_path):
    from tamer.memory import available_mb
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    2097152 kB\n")
    assert available_mb(meminfo, tmp_path / "none") == 2048.0
    (tmp_path / "memory.max").write_text(str(3 * 2**30) + "\n")
    (tmp_path / "memory.current").write_text(str(2 * 2**30) + "\n")
    assert available_mb(meminfo, tmp_path) == 1024.0  # the container's limit is the tighter
    (tmp_path / "memory.max").write_text("max\n")
    assert available_mb(meminfo, tmp_path) == 2048.0
    assert available_mb(tmp_path / "missing", tmp_path / "none") is None


def test_cpu_vendor_and_the_packing_default(tmp_path):
    """`cpu_vendor` reads /proc/cpuinfo's vendor_id; decode packs its weights by default on Intel CPUs
    only (docs/performance.md: packed decode measured faster on an Intel Xeon, slower on an AMD EPYC)."""
    from tamer.memory import cpu_vendor
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n\n"
                       "processor\t: 1\nvendor_id\t: AuthenticAMD\n")
    assert cpu_vendor(cpuinfo) == "AuthenticAMD"
    cpuinfo.write_text("processor\t: 0\nBogoMIPS\t: 50.00\n")  # an aarch64 cpuinfo: no vendor_id
    assert cpu_vendor(cpuinfo) is None and cpu_vendor(tmp_path / "missing") is None
    intel, amd = cpu_vendor() == "GenuineIntel", cpu_vendor() == "AuthenticAMD"
    assert fast_forward.MKL_PACKED is (fast_forward.MKL_PACKED_AVAILABLE and intel)
    assert fast_forward.ONEDNN_PACKED is (fast_forward.ONEDNN_PACKED_AVAILABLE and not intel and amd)


@pytest.mark.parametrize(("precision", "pack"), [("fp32", None), ("fp32", "mkl"), ("fp32", "onednn"),
                                            ("bf16", None)])
def test_snapshot_follows_weight_updates(tokenizer, precision, pack, monkeypatch):
    """Fused weights are a snapshot; an optimizer step (in place) must be seen by the next generate.
    Under bf16 every snapshot weight is a copy, the ones taken by reference in fp32 included; packed
    weights (`pack`: all of them, MKL's or oneDNN's layout) are copies too."""
    if pack:
        _pack_with(pack, monkeypatch)
    else:  # the plain snapshot, on any CPU
        monkeypatch.setattr(fast_forward, "MKL_PACKED", False)
        monkeypatch.setattr(fast_forward, "ONEDNN_PACKED", False)
    model = _model(tokenizer, "qwen2")
    engine = HFEngine(model, tokenizer.pad_token_id, precision=precision)
    plain = HFEngine(model, tokenizer.pad_token_id, fast=False, precision=precision)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=1)
    engine.generate(PROMPTS, params)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
    model(input_ids=torch.tensor([PROMPTS[0]])).logits.sum().backward()
    optimizer.step()
    engine.sync_weights(model)
    a, b = engine.generate(PROMPTS, params), plain.generate(PROMPTS, params)
    assert [o.token_ids for g in a for o in g] == [o.token_ids for g in b for o in g]
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(3.0)  # in place, no sync_weights
        model.model.layers[1].mlp.down_proj.weight.mul_(2.0)
    a, b = engine.generate(PROMPTS, params), plain.generate(PROMPTS, params)
    torch.testing.assert_close(torch.tensor([o.logprobs for g in a for o in g]),
                               torch.tensor([o.logprobs for g in b for o in g]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "llama3", "yarn"])
def test_learner_logprobs_and_gradients_equal_hf(tokenizer, arch, monkeypatch):
    model = (_model(tokenizer, arch) if arch in ("qwen2", "llama") else _model(tokenizer, "llama", rope=arch)).train()
    prompt = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    rows = [prompt[0] + [30, 31, 32], prompt[0] + [33, 34], prompt[1] + [40, 41, 42, 43], prompt[1] + [44]]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    plen, index = torch.tensor([4, 4, 6, 6]), torch.tensor([0, 0, 1, 1])

    assert_learner_matches_hf(model, ids, mask, plen, index, monkeypatch, mask.bool())


@pytest.mark.parametrize("change", ["dropout", "mlp_bias"])
def test_unsupported_config_falls_back_to_hf(tokenizer, change):
    """More unsupported configurations, built from their configs, in tests/test_fast_arch.py."""
    model = _model(tokenizer, "llama" if change == "mlp_bias" else "qwen2")
    config = model.config
    if change == "dropout":
        config.attention_dropout = 0.1
    else:
        config.mlp_bias = True
        model.model.layers[0].mlp.up_proj.bias = torch.nn.Parameter(torch.zeros(config.intermediate_size))
    assert unsupported_reason(model) is not None and FastDecoder.for_model(model) is None
    engine = HFEngine(model, tokenizer.pad_token_id)
    assert engine.fast is None
    out = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=3))
    assert len(out[0][0].token_ids) == 3


@pytest.mark.parametrize("bias", [False, True])
def test_cpu_bf16_linear_is_autocast_linear(bias):
    """Forward bitwise autocast's; gradients those of autocast's bf16 products (only summation order may differ)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 150, 96, generator=generator, requires_grad=True)
    w = torch.randn(64, 96, generator=generator, requires_grad=True)
    b = torch.randn(64, generator=generator, requires_grad=True) if bias else None
    grad = torch.randn(2, 150, 64, generator=generator)
    results = []
    for fn in (torch.nn.functional.linear, linear):
        for t in (x, w, b):
            if t is not None:
                t.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(x, w, b)
        y.backward(grad)
        results.append([y.detach(), x.grad, w.grad] + ([b.grad] if bias else []))
    (y_ref, *grads_ref), (y, *grads) = results
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref)
    for ours, ref, t in zip(grads, grads_ref, (x, w, b)):
        assert ours.dtype == t.dtype == torch.float32
        torch.testing.assert_close(ours, ref, atol=0.0, rtol=1e-2)  # bf16 has 8 significant bits
    # Only where autocast would record a bf16 linear: plain F.linear otherwise (no grad, no autocast).
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(linear(x, w, b), torch.nn.functional.linear(x, w, b))
    assert torch.equal(linear(x, w, b), torch.nn.functional.linear(x, w, b))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_learner_under_bf16_autocast_matches_hf(tokenizer, arch, monkeypatch):
    """The learner's bf16 path (FastDecoder.forward + `_CpuBf16Linear`) against HF under the same autocast."""
    model = _model(tokenizer, arch).train()
    rows = [[5, 6, 7, 8, 30, 31, 32], [5, 6, 7, 8, 33, 34, 0], [9, 10, 11, 12, 13, 14, 40]]
    ids = torch.tensor(rows)
    mask = torch.tensor([[1] * 7, [1] * 6 + [0], [1] * 7])

    def run():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp = token_logprobs(model, ids, mask)
        (lp * mask).sum().backward()
        return lp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    lp_fast, grad_fast = run()
    hf_only(monkeypatch)
    lp_hf, grad_hf = run()
    valid = mask.bool()
    valid[:, 0] = False
    torch.testing.assert_close(lp_fast[valid], lp_hf[valid], atol=1e-5, rtol=1e-5)  # the same forward kernels
    # bf16 rounding of differently ordered sums (measured 0.25%; bf16 vs fp32 itself is ~0.5%)
    assert float((grad_fast - grad_hf).norm() / grad_hf.norm()) < 0.01
