"""The HF forward's decode steps on packed weights (models/decode_linear.py): in the engine (same samples as
unpacked, packed for the decode loop only, LoRA's base layers included) and each fallback to `F.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

import tamer.models.decode_linear as dl
from tamer.models import LoraConfig, apply_lora
from tamer.models import fast_forward as ff
from tamer.rollout.engine import HFEngine
from tamer.rollout.types import SamplingParams

SIZE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [14, 15, 16], [20, 21, 22, 23, 24, 25]]


def _pack_with(backend: str | None, monkeypatch) -> None:
    """Packing with `backend` ("mkl", "onednn"; None: off) on any CPU, every weight large enough."""
    if backend and not getattr(ff, f"{backend.upper()}_PACKED_AVAILABLE"):
        pytest.skip(f"torch built without {backend}")
    monkeypatch.setattr(ff, "MKL_PACKED", backend == "mkl")
    monkeypatch.setattr(ff, "ONEDNN_PACKED", backend == "onednn")
    monkeypatch.setattr(ff, "PACK_MIN_WEIGHTS", 0)


def _plain(model) -> bool:
    return all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize(("backend", "lora"), [("onednn", False), ("mkl", False), ("onednn", True)])
def test_engine_samples_the_same_packed_and_not(backend, lora, monkeypatch):
    """Decode with every trained `nn.Linear` packed (with LoRA: the adapters, here large enough, and not
    the frozen base layers and head) samples the tokens of the unpacked HF decode with the same
    logprobs (summation order apart); the layers are packed for the decode loop only and plain after."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SIZE)).eval()
    if lora:
        model = apply_lora(model, LoraConfig(r=4, seed=1))
        for p in model.parameters():  # adapters away from their zero start, so that they change the samples
            if p.requires_grad:
                p.data.normal_(0, 0.05)
    engine = HFEngine(model, 0, fast=False)
    assert engine.fast is None
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.requires_grad]
    frozen = [m for m in model.modules() if type(m) is torch.nn.Linear and not m.weight.requires_grad]
    assert len(frozen) == (15 if lora else 0) and linears  # LoRA: 2 x 7 base projections and the head
    packed, calls = [], []
    original = dl.packed_linears

    def spy(module, rows):
        context = original(module, rows)
        count = context.__enter__()
        packed.append((rows, count, [type(m.__dict__.get("forward")).__name__ for m in linears]))
        assert all("forward" not in m.__dict__ for m in frozen)

        class Exit:
            def __enter__(self):
                return count

            def __exit__(self, *exc):
                return context.__exit__(*exc)
        return Exit()
    monkeypatch.setattr("tamer.rollout.engine.packed_linears", spy)
    dense = ff.dense
    monkeypatch.setattr(ff, "dense",
                        lambda x, w, b, pack, out=None: calls.append(pack.onednn) or dense(x, w, b, pack, out))
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=3)
    _pack_with(backend, monkeypatch)
    on = engine.generate(PROMPTS, params)
    assert _plain(model)  # the learner, the prefill and saved checkpoints see plain layers
    assert [(rows, count) for rows, count, _ in packed] == [(len(PROMPTS) * params.n, len(linears))]
    assert set(packed[0][2]) == {"_PackedForward"}
    # 9 decode steps (no stop token given) x every linear, all on packs of this backend
    assert len(calls) == 9 * len(linears) and set(calls) == {backend == "onednn"}
    _pack_with(None, monkeypatch)
    off = engine.generate(PROMPTS, params)
    assert packed[-1][1] == 0 and len(calls) == 9 * len(linears)  # packing off: nothing packed
    for group_on, group_off in zip(on, off):
        for a, b in zip(group_on, group_off):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5)


def test_other_inputs_take_f_linear(monkeypatch):
    """Another row count or autograd (a learner sharing the module meanwhile): `F.linear`, bitwise; too
    small or frozen a weight, autocast or too little memory: nothing packed."""
    backend = "onednn" if ff.ONEDNN_PACKED_AVAILABLE else "mkl"
    _pack_with(backend, monkeypatch)
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    x3, x5 = torch.randn(3, 1, 16), torch.randn(5, 16)
    with dl.packed_linears(layer, rows=3) as count:
        assert count == 1
        with torch.no_grad():
            torch.testing.assert_close(layer(x3), F.linear(x3, layer.weight, layer.bias), atol=1e-6, rtol=1e-6)
            assert torch.equal(layer(x5), F.linear(x5, layer.weight, layer.bias))
        y = layer(x3)  # grad enabled: F.linear, and the gradient reaches the weight
        assert torch.equal(y, F.linear(x3, layer.weight, layer.bias))
        y.sum().backward()
        assert layer.weight.grad is not None
    assert _plain(layer)
    monkeypatch.setattr(ff, "PACK_MIN_WEIGHTS", 16 * 8 + 1)
    with dl.packed_linears(layer, rows=3) as count:
        assert count == 0
    monkeypatch.setattr(ff, "PACK_MIN_WEIGHTS", 0)
    layer.requires_grad_(False)  # frozen: its pack would add to the sampler's peak memory
    with dl.packed_linears(layer, rows=3) as count:
        assert count == 0
    layer.requires_grad_(True)
    monkeypatch.setattr(ff, "PACK_MIN_WEIGHTS", 0)
    with torch.autocast("cpu", dtype=torch.bfloat16), dl.packed_linears(layer, rows=3) as count:
        assert count == 0
    monkeypatch.setattr(ff, "available_mb", lambda: 0.0)
    with dl.packed_linears(layer, rows=3) as count:
        assert count == 0
    assert _plain(layer)
