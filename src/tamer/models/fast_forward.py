"""A lean forward for Llama-family decoders: the same maths as transformers, fewer ops.

At ~1M parameters a decode step is bound by per-operation overhead, not by FLOPs: the HF
forward runs a module tree, rotary tables recomputed from `inv_freq`, transformers' mask
creation and a growing cache per token. `FastDecoder` runs the same computation with plain
torch ops:

* embedding, `F.rms_norm`, one fused QKV matmul (+ bias for Qwen2), one fused gate/up
  matmul, gated MLP, final norm, tied or untied `lm_head`, and the variants of Qwen3, Mistral,
  Gemma and Gemma2 (`fast_arch`: q/k norms, sliding windows, (1 + w) norms, GeGLU, embedding
  scale, sandwich norms, soft-capping);
* RoPE from cos/sin tables precomputed once (the same float32 values HF computes per call,
  scaled RoPE included), applied to queries and keys in one go;
* a KV buffer preallocated for prompt + completion and written in place (`KVBuffer`);
* `scaled_dot_product_attention` with a boolean mask built here (left padding, holes of
  assembled multi-turn prefixes) and GQA by packing a decode step's query heads per KV head;
* prefill returns only the last position's logits.

`FastDecoder.for_model(model)` returns None for anything it cannot prove equal to HF
(`fast_arch.unsupported_reason` says why: another architecture, dynamic RoPE, another
activation, attention dropout, wrapped or biased projections); the engine and the learner then
keep the HF forward. The fused
weights are a snapshot: the engine calls `refresh()` at every `generate`, so it never samples
from stale weights. In float32, decode's matmuls run on weights packed once per `generate` for
its row count, the layouts torch's own CPU inductor uses for frozen linears: MKL's packed GEMM on
Intel CPUs (`MKL_PACKED`; 1.5-2.6x faster than `F.linear` at decode's 32 rows of the 20M
benchmark model on an Intel Xeon, slower on an AMD EPYC) and oneDNN's on AMD ones
(`ONEDNN_PACKED`; 0.57-0.69 of the unpacked matmul time there, weights read from memory).
`models/decode_linear.py` gives the HF forward's decode the same packing. `forward()` is the
differentiable variant for the learner: it reads the live parameters (no snapshot) and returns
every position's logits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from tamer.memory import available_mb, cpu_vendor
from tamer.models.fast_arch import (  # noqa: F401 - unsupported_reason is re-exported: part of this API
    Arch,
    Unsupported,
    activate,
    attend,
    norm_eps,
    read_arch,
    rms_norm,
    softcap,
    unsupported_reason,
    window_mask,
)
from tamer.models.replay import DecodeRecord, Replay, replayed


def _cpu_bf16_autocast(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16)


class _CpuBf16Linear(torch.autograd.Function):
    """`F.linear` under CPU bf16 autocast, with a backward laid out for the CPU's bf16 GEMM.

    CPU bf16 matmuls are fast only when exactly one operand is stored transposed: on an AVX2
    machine (no bf16 units) `mm(A, B)` runs at 12-24 GFLOP/s that way and at 1-3 GFLOP/s when
    both are row-major, which is what autograd's input gradient of a linear, `grad @ W`, is
    (measured: 62 vs 7 ms at 1100x512x128). The forward is autocast's own computation (bf16
    operands, `mm`/`addmm` on `W.t()`, bf16 output: bitwise the same); the backward computes
    the same bf16 products with `W` passed as a transposed view of a transposed copy (a
    bf16 copy of the weight, small next to the activations), and returns gradients in the
    dtypes of the inputs, as autocast's casts do. Only the summation order of the input
    gradient can differ from autocast's.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        xb, wb = x.to(torch.bfloat16), weight.to(torch.bfloat16)
        x2 = xb.reshape(-1, xb.shape[-1])
        out = torch.mm(x2, wb.t()) if bias is None else torch.addmm(bias.to(torch.bfloat16), x2, wb.t())
        ctx.save_for_backward(x2, wb)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.in_shape = x.shape
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x2, wb = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        g = grad.reshape(-1, grad.shape[-1]).to(torch.bfloat16)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = torch.mm(g, wb.t().contiguous().t()).view(ctx.in_shape).to(x_dtype)
        if ctx.needs_input_grad[1]:
            gw = torch.mm(g.t(), x2).to(w_dtype)  # g.t() is the transposed operand already
        if b_dtype is not None and ctx.needs_input_grad[2]:
            gb = g.sum(0).to(b_dtype)
        return gx, gw, gb


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, through `_CpuBf16Linear` when CPU bf16 autocast is on and autograd records."""
    if torch.is_grad_enabled() and _cpu_bf16_autocast(x) and (x.requires_grad or weight.requires_grad):
        return _CpuBf16Linear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


# MKL's packed sgemm (`cblas_sgemm_pack`): torch ships it as the ops its CPU inductor uses for
# frozen float32 linears. Absent from builds without MKL (then decode keeps `F.linear`).
MKL_PACKED_AVAILABLE = torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
# Whether decode packs its weights: on Intel CPUs only. Measured with benchmarks/packed_decode.py
# (the 20M benchmark step, packed / unpacked, 12 alternated pairs): 0.89 on an Intel Xeon (AMX),
# 1.05 on an AMD EPYC (AVX-512), whose generation phase took 0.69 s packed against 0.61 s plain
# (docs/performance.md). Set it to True or False to override.
MKL_PACKED = MKL_PACKED_AVAILABLE and cpu_vendor() == "GenuineIntel"
# oneDNN's packed (blocked) weight layout, the one torch's CPU inductor uses where MKL's packed GEMM
# does not apply (`_reorder_linear_weight` + `_linear_pointwise`). Absent from builds without oneDNN.
ONEDNN_PACKED_AVAILABLE = (torch.backends.mkldnn.is_available()
                           and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                           and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
# Whether decode packs its weights for oneDNN: on AMD CPUs (Intel ones take MKL's packing above). Measured
# on an AMD EPYC (AVX-512): the 20M benchmark model's decode matmuls at 32 rows, weights cold (read from
# memory, as a decode step reads them), 1.40-1.44 ms per layer against 2.04-2.55 ms for the unpacked layouts
# decode used (benchmarks/decode_matmul.py), and the 20M step with benchmarks/packed_decode.py --switch onednn
# (docs/performance.md, item 17 of "What tamer does to be fast"). Set it to True or False to override.
ONEDNN_PACKED = ONEDNN_PACKED_AVAILABLE and not MKL_PACKED and cpu_vendor() == "AuthenticAMD"
# Whether unpacked float32 decode runs the MLP on transposed activations (W_gu @ h.T, then the down
# projection on act.T as a view): with the weight as the left operand the few-row matmuls run
# faster. Measured with benchmarks/packed_decode.py --switch mlp_transposed on an AMD EPYC (the 20M
# benchmark step, on / off, 12 alternated pairs): generation 0.66 vs 0.77 s, step ratio 0.94
# (docs/performance.md, item 13 of "What tamer does to be fast"). Set it to False to compare.
MLP_TRANSPOSED = True
# Smaller weights stay on `F.linear`: at 1M parameters (128 x 1024 at most) packing them at every
# `generate` costs about what their faster decode matmuls save (measured: 0.057 vs 0.055 s per
# generate of the 1m benchmark model, packed vs not).
PACK_MIN_WEIGHTS = 1 << 18


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, known: torch.Tensor | None
            ) -> torch.Tensor:
    """`linear(x, weight, bias)`, or its already known value `known` with the linear layer's backward
    (`replay.replayed`: the learner reusing the sampler's projection outputs)."""
    return linear(x, weight, bias) if known is None else replayed.apply(x, weight, bias, known)


class Pack(NamedTuple):
    """A decode weight packed for a row count: MKL's packed GEMM layout, or oneDNN's (`onednn`)."""

    weight: torch.Tensor
    onednn: bool


def packing() -> bool:
    """Whether float32 CPU decode packs its weights here (`MKL_PACKED` or `ONEDNN_PACKED`, and no autocast)."""
    return (MKL_PACKED or ONEDNN_PACKED) and not torch.is_autocast_enabled("cpu")


def room_for_packs(mb: float) -> bool:
    """Whether `mb` of packed weights fit: at least twice that available (`tamer.memory.available_mb`), or
    unknown. A large float32 model keeps `F.linear` rather than doubling its weights' memory."""
    free_mb = available_mb()
    return free_mb is None or free_mb >= 2 * mb


def pack_weight(weight: torch.Tensor, rows: int) -> Pack:
    """`weight` (out, in) packed for `rows`-row matmuls: MKL's layout where `MKL_PACKED`, else oneDNN's."""
    if MKL_PACKED:
        return Pack(torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows), False)
    return Pack(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows), True)


def grouped_bias(allowed: torch.Tensor, kv: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    """(B·H_kv, group, T) additive attention mask from `allowed` (B, T) bool: 0 where a key may be attended,
    -inf elsewhere, one (row, KV head) pair per batch entry with its `group` query heads as rows (decode's
    one-query attention as batched matmuls)."""
    batch, keys = allowed.shape
    bias = torch.zeros(batch, keys, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
    return bias[:, None, None, :].expand(batch, kv, group, keys).reshape(batch * kv, group, keys)


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: Pack | None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for 2-D `x`; on `packed` (weight packed for x's row count) when given;
    into `out` (contiguous) when given.

    Same products, another blocking: outputs differ from `F.linear`'s by summation order only.
    """
    if packed is not None:
        y = (torch.ops.mkldnn._linear_pointwise(x, packed.weight, bias, "none", [], "") if packed.onednn
             else torch.ops.mkl._mkl_linear(x, packed.weight, weight, bias, x.shape[0]))
        return y if out is None else out.copy_(y)
    if out is None:
        return F.linear(x, weight, bias)
    return torch.mm(x, weight.t(), out=out) if bias is None else torch.addmm(bias, x, weight.t(), out=out)


def _cat(parts: list[torch.Tensor], out: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.cat of `parts` (detached) in `dtype` (default: theirs), into `out` when it still fits."""
    parts = [p.detach() for p in parts]
    dtype = dtype or parts[0].dtype
    rows = sum(p.shape[0] for p in parts)
    if (out is None or out.shape != (rows, *parts[0].shape[1:]) or out.dtype != dtype
            or out.device != parts[0].device):
        out = torch.empty((rows, *parts[0].shape[1:]), dtype=dtype, device=parts[0].device)
    start = 0
    for part in parts:  # copy_ casts in place: no full-precision concatenation first
        out[start:start + part.shape[0]].copy_(part)
        start += part.shape[0]
    return out


def _as(weight: torch.Tensor | None, dtype: torch.dtype | None, out: torch.Tensor | None) -> torch.Tensor | None:
    """`weight` itself (no dtype), else a detached copy in `dtype`, into `out` when it fits."""
    if weight is None or dtype is None or weight.dtype == dtype:
        return weight
    return _cat([weight], out, dtype)


class KVBuffer:
    """Per-layer keys/values (B, H_kv, capacity, D), filled up to `length` and written in place.

    `layers[i].keys` / `.values` are views of the filled part, as in a transformers cache
    (`PrefixStore.extract` reads them).
    """

    class _Layer:
        __slots__ = ("buffer", "keys", "values")

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int) -> None:
        self.k, self.v, self.length = keys, values, length

    @property
    def layers(self) -> list[KVBuffer._Layer]:
        out = []
        for k, v in zip(self.k, self.v):
            layer = KVBuffer._Layer()
            layer.keys, layer.values = k[:, :, :self.length], v[:, :, :self.length]
            out.append(layer)
        return out


class Layer(NamedTuple):
    """One decoder layer's weights. Norms are (weight, eps); the projections fused (prefill/decode
    snapshot) or tuples of the live (q, k, v) and (gate, up) parameters (learner)."""

    ln1: tuple  # norm before attention
    qkv_w: torch.Tensor | tuple
    qkv_b: torch.Tensor | tuple | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    ln2: tuple  # norm before the MLP (Gemma2: pre_feedforward_layernorm)
    gu_w: torch.Tensor | tuple
    down_w: torch.Tensor
    q_norm: tuple | None = None  # Qwen3
    k_norm: tuple | None = None
    post_attn: tuple | None = None  # Gemma2: after attention, before the residual add
    post_ffn: tuple | None = None  # Gemma2: after the MLP


class FastDecoder:
    """Prefill and one-token decode for a supported HF causal LM (see the module docstring)."""

    def __init__(self, model: nn.Module, arch: Arch | None = None) -> None:
        self.model = model
        self.arch = arch or read_arch(model)
        config = model.config
        inner = model.model
        attn0 = inner.layers[0].self_attn
        self.num_heads = config.num_attention_heads
        self.num_kv = config.num_key_value_heads
        self.head_dim = attn0.head_dim
        self.scaling = attn0.scaling
        self.final_eps = norm_eps(inner.norm)
        self.inv_freq = inner.rotary_emb.inv_freq.detach().float().cpu()
        self._table: torch.Tensor | None = None
        self.layers: list[Layer] | None = None  # weights for prefill/decode, fused ones copied by refresh()
        self.head: torch.Tensor | None = None
        self._pack_mb = 0.0  # MB of this snapshot's weights decode packs (0: packing does not apply)
        self._packs: dict[int, tuple | None] = {}  # decode rows -> packed weights of this snapshot
        self._tables(min(max(int(config.max_position_embeddings), 64), 4096))  # grows on demand

    @classmethod
    def for_model(cls, model: nn.Module) -> FastDecoder | None:
        try:
            return cls(model, read_arch(model))
        except Unsupported:
            return None

    # ------------------------------------------------------------------ weights
    def _layer(self, layer: nn.Module, qkv_w, qkv_b, gu_w) -> Layer:
        a, m = layer.self_attn, layer.mlp
        norm = lambda module: (module.weight, norm_eps(module))  # noqa: E731
        sandwich = self.arch.sandwich
        return Layer(norm(layer.input_layernorm), qkv_w, qkv_b, a.o_proj.weight, a.o_proj.bias,
                     norm(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm), gu_w,
                     m.down_proj.weight, norm(a.q_norm) if self.arch.qk_norm else None,
                     norm(a.k_norm) if self.arch.qk_norm else None,
                     norm(layer.post_attention_layernorm) if sandwich else None,
                     norm(layer.post_feedforward_layernorm) if sandwich else None)

    @torch.inference_mode()
    def refresh(self, matmul_dtype: torch.dtype | None = None) -> None:
        """Copy the current weights into the fused QKV and gate/up buffers (and take the rest by reference).

        Called by the engine at every `generate`: a fused optimizer step changes parameters in
        place without bumping their version counters, so staleness cannot be detected cheaply;
        the copy is about 1 ms at 1M parameters and tens of ms at 20M, into buffers reused
        across calls (no new allocation).

        `matmul_dtype` (the engine passes bf16 under bf16 autocast): the projection and head
        weights are stored in it, so autocast finds them already cast instead of casting every
        weight at every decode step. Autocast would compute the same bf16 copy (a rounding of
        each value), so the outputs are bitwise the same; embeddings and norms stay as they are.
        """
        inner = self.model.model
        old = self.layers
        dtype = matmul_dtype
        layers = []
        for i, layer in enumerate(inner.layers):
            a, m = layer.self_attn, layer.mlp
            prev = old[i] if old is not None and len(old) == len(inner.layers) else Layer(*(None,) * 8)
            qkv_w = _cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], prev.qkv_w, dtype)
            qkv_b = (None if a.q_proj.bias is None
                     else _cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias], prev.qkv_b, dtype))
            gu_w = _cat([m.gate_proj.weight, m.up_proj.weight], prev.gu_w, dtype)
            fused = self._layer(layer, qkv_w, qkv_b, gu_w)
            layers.append(fused._replace(o_w=_as(fused.o_w, dtype, prev.o_w), o_b=_as(fused.o_b, dtype, prev.o_b),
                                         down_w=_as(fused.down_w, dtype, prev.down_w)))
        self.layers = layers
        self.embed = inner.embed_tokens.weight
        self.norm = (inner.norm.weight, self.final_eps)
        self.head = _as(self.model.get_output_embeddings().weight, dtype, self.head)
        self._pack_mb = self._packable_mb()
        self._packs = {}

    def _packable_mb(self) -> float:
        """MB of the snapshot's weights that decode would pack: float32 CPU weights (`packing()`), each of at
        least `PACK_MIN_WEIGHTS` elements, when gate/up (the largest) is; else 0."""
        if not (packing() and self.head.device.type == "cpu" and self.head.dtype == torch.float32
                and max(layer.gu_w.numel() for layer in self.layers) >= PACK_MIN_WEIGHTS):
            return 0.0
        weights = [w for layer in self.layers for w in (layer.qkv_w, layer.o_w, layer.gu_w, layer.down_w)]
        return sum(w.numel() for w in [*weights, self.head] if w.numel() >= PACK_MIN_WEIGHTS) * 4 / 2**20

    def release(self) -> None:
        """Drop the packed weights (the engine calls it when a `generate` ends: they are rebuilt from the
        next snapshot anyway, and freed here they do not sit in memory beside the learner's activations)."""
        self._packs = {}

    def _packed(self, rows: int) -> tuple[list[tuple], torch.Tensor] | None:
        """Each layer's (qkv, o, gate/up, down) weights and the head's, packed for `rows`-row matmuls.

        Built at the first decode step of a `generate` (about 1 ms per million weights, and as much
        memory as the weights packed; a decode step of the 20M benchmark model saves ~4 ms) and kept until
        `release` or `refresh`. None where packing does not apply (`_packable_mb` is 0, or autocast
        is on: packed matmuls would bypass it), and when the
        machine has less than twice the packs' size available (`tamer.memory.available_mb`: a
        large float32 model keeps `F.linear` rather than doubling its weights' memory).
        """
        if not self._pack_mb or not packing():
            return None
        if rows not in self._packs:
            def pack(w: torch.Tensor) -> Pack | None:
                return pack_weight(w, rows) if w.numel() >= PACK_MIN_WEIGHTS else None
            self._packs[rows] = None if not room_for_packs(self._pack_mb) else (
                [(pack(layer.qkv_w), pack(layer.o_w), pack(layer.gu_w), pack(layer.down_w)) for layer in self.layers],
                pack(self.head))
        return self._packs[rows]

    def _tables(self, size: int) -> None:
        """RoPE table (size, 2, D) in float32: cos and sign-folded sin of positions × inv_freq, as HF
        computes them (times HF's `attention_scaling`). With sin_signed = (-sin, sin) over the two
        halves, HF's `x * cos + rotate_half(x) * sin` is `x * cos + roll(x, D/2) * sin_signed`,
        exactly (a sign flip is exact), in fewer ops."""
        if self._table is not None and self._table.shape[0] >= size:
            return
        with torch.inference_mode(False), torch.no_grad():
            freqs = torch.arange(size, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos() * self.arch.rope_scale, emb.sin() * self.arch.rope_scale
            half = sin.shape[-1] // 2
            sin[:, :half] = -sin[:, :half]
            device = self._table.device if self._table is not None else self.inv_freq.device
            self._table = torch.stack([cos, sin], dim=1).to(device)

    def _rope_tables(self, positions: torch.Tensor, device: torch.device, *, size: int | None = None) -> torch.Tensor:
        """(…, 2, D): cos and signed sin at `positions`; `size` = a known bound on the positions (no sync)."""
        self._tables(size if size is not None else int(positions.max()) + 1)
        if self._table.device != device:
            with torch.inference_mode(False):
                self._table = self._table.to(device)
        return self._table[positions]

    # ------------------------------------------------------------------ pieces
    def _rope(self, x: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
        """x (…, H, D); cs (…, 2, D) from `_rope_tables`, broadcast over the heads."""
        cos, sin = cs.unsqueeze(-3).unbind(-2)
        return x * cos + torch.roll(x, self.head_dim // 2, dims=-1) * sin

    def _norm(self, x: torch.Tensor, norm: tuple) -> torch.Tensor:
        return rms_norm(x, norm, self.arch.norm_offset)

    def _embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        embed = self.model.model.embed_tokens
        x = F.embedding(ids, weight, embed.padding_idx)
        return x * embed.embed_scale.to(weight.dtype) if self.arch.embed_scale else x

    def _qk(self, qk: torch.Tensor, layer: Layer, cs: torch.Tensor) -> torch.Tensor:
        """Queries then keys (…, H + H_kv, D): Qwen3's per-head norms, then RoPE."""
        if self.arch.qk_norm:
            q, k = qk.split([self.num_heads, qk.shape[-2] - self.num_heads], dim=-2)
            qk = torch.cat([self._norm(q, layer.q_norm), self._norm(k, layer.k_norm)], dim=-2)
        return self._rope(qk, cs)

    def _residual(self, x: torch.Tensor, out: torch.Tensor, post: tuple | None) -> torch.Tensor:
        return x + (out if post is None else self._norm(out, post))

    # ------------------------------------------------------------------ learner (differentiable)
    def _live_layers(self) -> list[Layer]:
        """The layers' live parameters (gradients flow), unfused: (q, k, v) and (gate, up) as tuples.

        The learner runs two large forwards per step, so a fused copy saves little there and its
        torch.cat (and the split in backward) would cost a copy of the weights every forward.
        """
        out = []
        for layer in self.model.model.layers:
            a, m = layer.self_attn, layer.mlp
            out.append(self._layer(layer, (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight),
                                   (a.q_proj.bias, a.k_proj.bias, a.v_proj.bias),
                                   (m.gate_proj.weight, m.up_proj.weight)))
        return out

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, *, past: list | None = None,
                return_kv: bool = False, last_only: bool = False, replay: Replay | None = None
                ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """Logits (B, S, V) of `ids` (B, S) with the live weights (autograd records it).

        `mask` (B, C + S) marks real positions of the optional `past` [(keys, values)
        (B, H_kv, C, D)] followed by the new tokens, `positions` (B, S) their RoPE positions.
        With `return_kv`, also every layer's (keys, values) of past + new tokens; with
        `last_only`, only the last position's logits (B, 1, V). When the model has HF's gradient
        checkpointing on and is training, each layer's activations are recomputed in backward.
        `replay` (rows of the sampler's `DecodeRecord`s for exactly these `ids`, `replay.py`): the
        projections return the recorded outputs instead of computing them; it is ignored (the
        projections computed) unless `replay_applies`.
        """
        inner = self.model.model
        checkpoint = self._checkpointed()
        known, head = (None, None)
        if replay is not None and self.replay_applies(replay, ids, checkpoint, last_only):
            known, head = replay.gather(ids.shape[1])
        x = self._embed(ids, inner.embed_tokens.weight)
        kvs: list = []
        sink = (lambda i, k, v: kvs.append((k, v))) if return_kv else None
        x = self._layers(x, self._live_layers(), mask, positions, past, sink, checkpoint=checkpoint, known=known)
        if last_only:
            x = x[:, -1:]
        x = self._norm(x, (inner.norm.weight, self.final_eps))
        return softcap(project(x, self.model.get_output_embeddings().weight, None, head),
                       self.arch.final_softcap), kvs or None

    def replay_applies(self, replay: Replay, ids: torch.Tensor, checkpoint: list[bool] | None = None,
                       last_only: bool = False) -> bool:
        """Whether `replay` can stand in for this forward's projections: recorded from this very model, one
        row per row of `ids` and columns for all of them, float32 weights without autocast (the record
        is float32), no recomputation in backward (checkpointed layers), every position's logits."""
        weight = self.model.model.embed_tokens.weight
        return (replay.model is self.model and len(replay) == ids.shape[0] and replay.fits(ids.shape[1])
                and weight.dtype == torch.float32 and not torch.is_autocast_enabled(weight.device.type)
                and checkpoint is None and not last_only)

    def _checkpointed(self) -> list[bool] | None:
        """Per layer, whether HF would recompute it in backward (its gradient checkpointing flags)."""
        inner = self.model.model
        if not self.model.training:
            return None
        flags = [bool(getattr(layer, "gradient_checkpointing", getattr(inner, "gradient_checkpointing", False)))
                 for layer in inner.layers]
        return flags if any(flags) else None

    def _attention_masks(self, mask: torch.Tensor, cached: int, seq: int) -> dict[int | None, torch.Tensor]:
        """Per window size, (B, 1, S, C + S) bool: causal, real keys only, within the window; a
        padding query attends to itself (finite outputs)."""
        device = mask.device
        rows = torch.arange(seq, device=device)
        causal = torch.arange(cached + seq, device=device)[None, :] <= (cached + rows)[:, None]  # (S, C + S)
        allowed = {}
        for window in set(self.arch.windows):
            near = window_mask(cached + seq, cached + rows, window)
            allowed[window] = mask.bool()[:, None, :] & (causal if near is None else causal & near)[None]
            allowed[window][:, rows, cached + rows] = True
            allowed[window] = allowed[window][:, None]
        return allowed

    def _block(self, x, layer: Layer, allowed, cs, past_k, past_v, known: dict | None = None):
        """One decoder layer over x (B, S, hidden) -> (x, keys, values) of past + new tokens; `known`: this
        layer's recorded projection outputs (`replay.KINDS`, live weights only)."""
        batch, seq = x.shape[:2]
        heads, kv, d = self.num_heads, self.num_kv, self.head_dim
        known = known or {}
        h = self._norm(x, layer.ln1)
        if isinstance(layer.qkv_w, tuple):  # live, unfused weights (learner)
            outs = known["qkv"].split([heads * d, kv * d, kv * d], dim=-1) if known else (None,) * 3
            q, k, v = (project(h, w, b, y).view(batch, seq, -1, d) for w, b, y in zip(layer.qkv_w, layer.qkv_b, outs))
            qk = self._qk(torch.cat([q, k], dim=2), layer, cs)
        else:
            qkv = linear(h, layer.qkv_w, layer.qkv_b).view(batch, seq, heads + 2 * kv, d)
            qk, v = self._qk(qkv[:, :, :heads + kv], layer, cs), qkv[:, :, heads + kv:]
        q, k = (t.transpose(1, 2) for t in qk.split([heads, kv], dim=2))  # split: one backward, no zero-filled slices
        v = v.transpose(1, 2)
        if past_k is not None:
            k, v = torch.cat([past_k.to(k.dtype), k], dim=2), torch.cat([past_v.to(v.dtype), v], dim=2)
        attn = attend(q, k, v, allowed, self.scaling, self.arch.attn_softcap)
        x = self._residual(x, project(attn.transpose(1, 2).reshape(batch, seq, heads * d), layer.o_w, layer.o_b,
                                      known.get("o")), layer.post_attn)
        h = self._norm(x, layer.ln2)
        if isinstance(layer.gu_w, tuple):
            outs = known["gu"].chunk(2, dim=-1) if known else (None, None)
            gate, up = (project(h, w, None, y) for w, y in zip(layer.gu_w, outs))
        else:
            gate, up = linear(h, layer.gu_w).chunk(2, dim=-1)
        out = project(activate(gate, self.arch.act) * up, layer.down_w, None, known.get("down"))
        return self._residual(x, out, layer.post_ffn), k, v

    def _layers(self, x, layers, mask, positions, past, sink=None, *, extra: int = 0,
                checkpoint: list[bool] | None = None, known: list[dict] | None = None):
        """The decoder layers over x (B, S, hidden); `sink(i, keys, values)` receives each layer's KV
        (past + new), `extra` = positions the caller will decode after these (sizes the RoPE table),
        `checkpoint[i]` = recompute layer i's activations in backward instead of keeping them,
        `known[i]` = layer i's recorded projection outputs (`_block`)."""
        cached = 0 if past is None else past[0][0].shape[2]
        masks = self._attention_masks(mask, cached, x.shape[1])
        cs = self._rope_tables(positions, x.device, size=None if extra == 0 else int(positions.max()) + extra + 1)
        cs = cs.to(x.dtype)  # HF rounds cos/sin to the hidden states' dtype (bf16 weights)
        for i, layer in enumerate(layers):
            args = (x, layer, masks[self.arch.windows[i]], cs) + ((None, None) if past is None else past[i])
            if checkpoint is not None and checkpoint[i] and torch.is_grad_enabled():
                x, k, v = torch.utils.checkpoint.checkpoint(self._block, *args, use_reentrant=False)
            else:
                x, k, v = self._block(*args, None if known is None else known[i])
            if sink is not None:
                sink(i, k, v)
        return x

    # ------------------------------------------------------------------ prefill / decode
    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, *, past: list | None = None,
                repeat: int = 1, extra: int = 0) -> tuple[torch.Tensor, KVBuffer]:
        """Forward `ids` (B, S) after an optional `past` [(keys, values) (B, H_kv, C, D)] per layer.

        `mask` (B, C + S) marks real positions (0 = padding or hole), `positions` (B, S) the
        RoPE positions of the new tokens. Returns the last position's logits (B·repeat, V) and a
        `KVBuffer` of B·repeat rows (each row `repeat` times) with room for `extra` more positions.
        """
        if self.layers is None:
            self.refresh()
        batch, total = ids.shape[0], mask.shape[1]
        keys, values = [], []

        def into_buffers(i, k, v):  # each layer's KV straight into its preallocated buffer
            for src, out in ((k, keys), (v, values)):
                buf = src.new_empty(batch * repeat, self.num_kv, total + extra, self.head_dim)
                buf[:, :, :total] = src.repeat_interleave(repeat, dim=0) if repeat > 1 else src
                out.append(buf)
        x = self._layers(self._embed(ids, self.embed), self.layers, mask, positions, past, into_buffers, extra=extra)
        logits = softcap(F.linear(self._norm(x[:, -1], self.norm), self.head), self.arch.final_softcap)
        if repeat > 1:
            logits = logits.repeat_interleave(repeat, dim=0)
        return logits, KVBuffer(keys, values, total)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVBuffer, key_mask: torch.Tensor,
               record: DecodeRecord | None = None) -> torch.Tensor:
        """One token per row: `tokens` (B,), `positions` (B,); `key_mask` (B, capacity) bool.

        The token's keys/values go to column `cache.length`; returns its logits (B, V). With `record`
        (`replay.DecodeRecord` of B rows), every projection writes its output into the record's slot
        for step `record.step` (then advanced), for the learner to reuse; the residual adds are then
        not fused into the output and down projections (their outputs are what is kept).
        """
        batch = tokens.shape[0]
        col = cache.length
        end = col + 1
        heads, kv, d = self.num_heads, self.num_kv, self.head_dim
        group = heads // kv
        x = self._embed(tokens, self.embed)  # (B, hidden)
        cs = self._rope_tables(positions, tokens.device, size=0).to(x.dtype)  # prefill sized the table
        # Attention of one query per head, as two batched matmuls over (row, KV head) pairs with the
        # `group` query heads of a KV head as that pair's rows (GQA without repeating keys). At decode
        # sizes this is ~2.5x faster than scaled_dot_product_attention's CPU kernel (measured: 74 vs
        # 217 us at B=32, 2 KV heads, D=32, 60 keys), whose blocking pays off only for long queries.
        # The mask becomes an additive bias, built once per step (per window size) and shared by the
        # layers. `fuse` is off under autocast, which would run these matmuls (and the residual addmm
        # below) in bf16 where HF's attention and float32 residual stream do not, and with bf16
        # weights, whose residual adds HF rounds separately: SDPA and plain adds there.
        fuse = x.dtype == torch.float32 and not torch.is_autocast_enabled(x.device.type)
        packs, head = self._packed(batch) or (None, None)
        masks = {}
        for window in set(self.arch.windows):
            near = window_mask(end, torch.tensor([col], device=x.device), window)
            masks[window] = key_mask[:, :end] if near is None else key_mask[:, :end] & near
        if fuse:
            masks = {w: grouped_bias(m, kv, group, x.dtype) for w, m in masks.items()}
        else:
            masks = {w: m[:, None, None, :] for w, m in masks.items()}  # (B, 1, 1, T): shared by every head
        plain = not self.arch.sandwich  # residual adds fused into the matmuls (addmm: x + a @ W.T)
        for i, layer in enumerate(self.layers):
            p_qkv, p_o, p_gu, p_down = packs[i] if packs is not None else (None,) * 4
            h = self._norm(x, layer.ln1)
            qkv = dense(h, layer.qkv_w, layer.qkv_b, p_qkv, record and record.at(i, "qkv"))
            qkv = qkv.view(batch, heads + 2 * kv, d)
            qk = self._qk(qkv[:, :heads + kv], layer, cs)
            kb, vb = cache.k[i], cache.v[i]
            kb[:, :, col] = qk[:, heads:]
            vb[:, :, col] = qkv[:, heads + kv:]
            mask = masks[self.arch.windows[i]]
            if fuse:
                q = qk[:, :heads].reshape(batch * kv, group, d)
                keys = kb[:, :, :end].reshape(batch * kv, end, d)  # views: B and H_kv merge without a copy
                if self.arch.attn_softcap is None:
                    scores = torch.baddbmm(mask, q, keys.transpose(1, 2), alpha=self.scaling)
                else:
                    scores = softcap(torch.bmm(q, keys.transpose(1, 2)) * self.scaling, self.arch.attn_softcap) + mask
                attn = torch.bmm(scores.softmax(-1), vb[:, :, :end].reshape(batch * kv, end, d))
            else:
                q = qk[:, :heads].reshape(batch, kv, group, d)
                attn = attend(q, kb[:, :, :end], vb[:, :, :end], mask, self.scaling, self.arch.attn_softcap)
            attn = attn.reshape(batch, heads * d)
            if fuse and plain and layer.o_b is None and p_o is None and record is None:
                x = torch.addmm(x, attn, layer.o_w.t())
            else:
                out = dense(attn, layer.o_w, layer.o_b, p_o, record and record.at(i, "o"))
                x = self._residual(x, out, layer.post_attn)
            h = self._norm(x, layer.ln2)
            if fuse and plain and MLP_TRANSPOSED and p_gu is None and p_down is None:
                # The MLP on transposed activations: (2I, B) = W_gu @ h.T, so that the weights are the
                # left operand, and the down projection reads act.T as a transposed view; the same
                # products as `F.linear`, faster at few rows (MLP_TRANSPOSED's comment).
                gu = torch.mm(layer.gu_w, h.t(), **({} if record is None else {"out": record.gu_at(i)}))
                inter = layer.down_w.shape[1]
                act = activate(gu[:inter], self.arch.act) * gu[inter:]
                if record is None:
                    x = torch.addmm(x, act.t(), layer.down_w.t())
                else:
                    x = x + torch.mm(act.t(), layer.down_w.t(), out=record.at(i, "down"))
            else:
                gu = dense(h, layer.gu_w, None, p_gu, record and record.at(i, "gu"))
                gate, up = gu.chunk(2, dim=-1)
                act = activate(gate, self.arch.act) * up
                if fuse and plain and p_down is None and record is None:
                    x = torch.addmm(x, act, layer.down_w.t())
                else:
                    out = dense(act, layer.down_w, None, p_down, record and record.at(i, "down"))
                    x = self._residual(x, out, layer.post_ffn)
        cache.length = end
        logits = dense(self._norm(x, self.norm), self.head, None, head, record and record.at(0, "logits"))
        if record is not None:
            record.step += 1
        return softcap(logits, self.arch.final_softcap)
