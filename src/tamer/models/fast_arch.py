"""Which Hugging Face decoders the lean forward (`fast_forward.FastDecoder`) runs, and how.

    arch = read_arch(model)            # an `Arch`, or raises `Unsupported("why")`
    unsupported_reason(model)          # the reason as a string, or None

Covered, each checked against the HF forward in `tests/test_fast_arch.py`:

    llama, qwen2, mistral   RMSNorm (w · x̂), SiLU-gated MLP; Qwen2's QKV bias
    qwen3                   + an RMSNorm over each query and key head before RoPE
    gemma                   (1 + w) · x̂ norms in float32, GeGLU (tanh GELU), embeddings × √hidden
    gemma2                  + norms after attention and after the MLP, soft-capped attention
                            scores and logits, sliding-window layers

RoPE types whose frequencies are fixed at load time: default, linear, llama3 (the Llama 3.1
scaling) and yarn (with HF's `attention_scaling` of cos and sin). Sliding windows (Mistral,
Gemma2's alternate layers, Qwen's `layer_types`) are masked as HF masks them: the query at
column q sees keys at columns > q - window, so sequences shorter than the window attend fully.
Anything else is refused and the HF forward runs: dynamic or longrope RoPE (frequencies that
change with the sequence length), partial rotary dimensions, other activations, attention
dropout, MLP biases, and wrapped or hooked modules (adapters, quantized linears).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

MODELS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
          "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM"}
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
GEMMA = ("gemma", "gemma2")


class Unsupported(Exception):
    """The model is not one `FastDecoder` can prove equal to the HF forward (the message says why)."""


@dataclass(frozen=True)
class Arch:
    """The switches of one decoder family (see the module docstring)."""

    act: str  # "silu" or "gelu_tanh", the MLP's gate activation
    norm_offset: bool  # Gemma: norms compute (1 + w) · x̂ in float32; else w · x̂
    qk_norm: bool  # Qwen3: RMSNorm of each query/key head before RoPE
    sandwich: bool  # Gemma2: a norm after attention and one after the MLP, before the residual adds
    embed_scale: bool  # Gemma: embeddings multiplied by the module's `embed_scale` (√hidden)
    attn_softcap: float | None  # Gemma2: scores → cap · tanh(scores / cap) before the mask
    final_softcap: float | None  # Gemma2: the same on the logits
    windows: tuple[int | None, ...]  # per layer: sliding window in columns, None = full attention
    rope_scale: float  # HF's attention_scaling: multiplies cos and sin (1.0 but for yarn)


def unsupported_reason(model: nn.Module) -> str | None:
    """Why `model` cannot take the fast path, or None if it can."""
    try:
        read_arch(model)
    except Unsupported as why:
        return str(why)
    return None


def read_arch(model: nn.Module) -> Arch:
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in MODELS or type(model).__name__ != MODELS[kind]:
        raise Unsupported(f"architecture {kind!r} ({type(model).__name__})")
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) != 0.0:
        raise Unsupported("attention dropout")
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        raise Unsupported("pretraining_tp")
    inner = model.model
    rope_scale = _check_rope(inner, inner.layers[0].self_attn.head_dim)
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:
        raise Unsupported("lm_head")
    embed = inner.embed_tokens
    scaled = kind in GEMMA and type(embed).__name__.endswith("ScaledWordEmbedding") and hasattr(embed, "embed_scale")
    if type(embed) is not nn.Embedding and not scaled:
        raise Unsupported("embedding")
    # The one hook tolerated: HF's checkpointing makes embedding outputs require grad (no change of value).
    if embed._forward_pre_hooks or any(getattr(h, "__name__", "") != "make_inputs_require_grads"
                                       for h in embed._forward_hooks.values()) or head._forward_hooks:
        raise Unsupported("hooks")
    acts = set()
    for layer in inner.layers:
        _check_layer(layer, config, kind)
        acts.add(_activation(layer.mlp.act_fn))
    _check_norm(inner.norm, config.hidden_size, kind)
    if len(acts) != 1 or None in acts:
        raise Unsupported(f"activation {getattr(config, 'hidden_activation', None) or config.hidden_act!r}")
    return Arch(act=acts.pop(), norm_offset=kind in GEMMA, qk_norm=kind == "qwen3", sandwich=kind == "gemma2",
                embed_scale=scaled,
                attn_softcap=getattr(config, "attn_logit_softcapping", None) if kind == "gemma2" else None,
                final_softcap=getattr(config, "final_logit_softcapping", None) if kind == "gemma2" else None,
                windows=tuple(_window(config, kind, i, layer.self_attn) for i, layer in enumerate(inner.layers)),
                rope_scale=rope_scale)


def _check_rope(inner: nn.Module, head_dim: int) -> float:
    rotary = getattr(inner, "rotary_emb", None)
    rope_type = getattr(rotary, "rope_type", None)
    if rotary is None or not isinstance(rope_type, str) or rope_type not in STATIC_ROPE:
        raise Unsupported(f"rope {rope_type!r}")
    if 2 * rotary.inv_freq.numel() != head_dim:
        raise Unsupported("partial rotary dimensions")
    return float(rotary.attention_scaling)


def _activation(act: nn.Module) -> str | None:
    """"silu" or "gelu_tanh" when `act` computes exactly F.silu / F.gelu(approximate="tanh")."""
    if type(act) is nn.SiLU or type(act).__name__ == "SiLUActivation":
        return "silu"
    inner = getattr(act, "act", None)
    if type(act).__name__ == "GELUTanh" and isinstance(inner, functools.partial) and \
            inner.keywords == {"approximate": "tanh"}:
        return "gelu_tanh"
    return None


def _window(config, kind: str, index: int, attn: nn.Module) -> int | None:
    """The sliding window HF's mask applies at layer `index` (None: full attention)."""
    if kind == "mistral":  # one window for every layer, when the config has one
        window = getattr(config, "sliding_window", None)
    else:
        types = getattr(config, "layer_types", None) or []
        window = config.sliding_window if index < len(types) and types[index] == "sliding_attention" else None
    if getattr(attn, "sliding_window", window) != window:
        raise Unsupported("sliding window of the attention module differs from the config's")
    return window


NORMS = {"gemma2": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                    "post_feedforward_layernorm")}


def _check_layer(layer: nn.Module, config, kind: str) -> None:
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if any(type(m) is not nn.Linear for m in linears):
        raise Unsupported("wrapped projections")
    if mlp.gate_proj.bias is not None or mlp.up_proj.bias is not None or mlp.down_proj.bias is not None:
        raise Unsupported("MLP bias")
    if not ((attn.q_proj.bias is None) == (attn.k_proj.bias is None) == (attn.v_proj.bias is None)):
        raise Unsupported("mixed QKV bias")
    if attn.q_proj.out_features != config.num_attention_heads * attn.head_dim:
        raise Unsupported("query width")
    for name in NORMS.get(kind, ("input_layernorm", "post_attention_layernorm")):
        _check_norm(getattr(layer, name), config.hidden_size, kind)
    if kind == "qwen3":
        for norm in (attn.q_norm, attn.k_norm):
            _check_norm(norm, attn.head_dim, kind)
    if any(m._forward_hooks or m._forward_pre_hooks for m in (layer, attn, mlp, *linears)):
        raise Unsupported("hooks")


def _check_norm(norm: nn.Module, width: int, kind: str) -> None:
    gemma_style = type(norm).__name__.startswith("Gemma")
    if gemma_style != (kind in GEMMA) or norm_eps(norm) is None or norm.weight.shape != (width,) or \
            norm._forward_hooks or norm._forward_pre_hooks:
        raise Unsupported("norm")


def norm_eps(norm: nn.Module) -> float | None:
    """The epsilon of an HF RMSNorm (`variance_epsilon` in Llama's, `eps` in Gemma's)."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if eps is not None else None


# ---------------------------------------------------------------------------- the variant ops
class _RMSNorm(torch.autograd.Function):
    """`F.rms_norm(x, (D,), w, eps)` for float32 `x` and `w`, with a backward in fewer passes over x.

    Forward: torch's own composite ops in its order, so the output is bitwise `F.rms_norm`'s:
    r = rsqrt(mean(x²) + eps), x̂ = x · r, y = x̂ · w. Backward (g = ∂L/∂y; docs/algorithms.md#rmsnorm-backward):
    ∂L/∂w = Σ_rows g · x̂ and ∂L/∂x = r · (g·w − x̂ · mean(g·w·x̂)), 7 passes where autograd's
    backward of the composite takes ~11 (pow, mean, rsqrt, two products and their sums).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))
        xhat = x * r
        ctx.save_for_backward(xhat, weight, r)
        return xhat * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        xhat, weight, r = ctx.saved_tensors
        gw = grad * weight
        gx = torch.addcmul(gw, xhat, (gw * xhat).mean(-1, keepdim=True), value=-1).mul_(r)
        gweight = (grad * xhat).reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        return gx, gweight, None


def rms_norm(x: torch.Tensor, norm: tuple[torch.Tensor, float], offset: bool) -> torch.Tensor:
    """HF's RMSNorm of `x` with `norm` = (weight, eps): w · x̂, or Gemma's (1 + w) · x̂ in float32."""
    weight, eps = norm
    if offset:
        return F.rms_norm(x.float(), (x.shape[-1],), 1.0 + weight.float(), eps).type_as(x)
    if x.dtype != torch.float32:  # HF normalises in float32, rounds to x's dtype, then scales (bf16 weights)
        return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    if torch.is_grad_enabled() and weight.dtype == torch.float32 and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def activate(gate: torch.Tensor, act: str) -> torch.Tensor:
    return F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap · tanh(x / cap), in HF's order of operations (identity for None)."""
    return x if cap is None else torch.tanh(x / cap) * cap


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
           cap: float | None) -> torch.Tensor:
    """Attention of q (B, H, S, D) over k, v (B, H_kv, T, D) where `allowed` (bool, broadcastable
    to (B, H, S, T)). Without soft-capping, SDPA; with it, HF's eager computation (scores
    capped before the mask, softmax in float32)."""
    gqa = q.shape[1] != k.shape[1]
    if cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    if gqa:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = softcap(torch.matmul(q, k.transpose(-1, -2)) * scale, cap).masked_fill(~allowed, float("-inf"))
    return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v)


def window_mask(keys: int, queries: torch.Tensor, window: int | None) -> torch.Tensor | None:
    """(S, keys) bool: key column > query column - window, HF's sliding-window overlay (None: no window)."""
    if window is None:
        return None
    return torch.arange(keys, device=queries.device)[None, :] > (queries[:, None] - window)
