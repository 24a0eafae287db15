"""One-query attention for the HF forward's decode steps: two batched matmuls instead of SDPA's CPU kernel.

    with decode_sdpa(configs):            # the HF engine's decode loop
        logits = model(input_ids=tokens[:, None], ...)

The engine runs the HF forward (`HFEngine` with `fast=False`, and every model `FastDecoder` does not
cover) one token per row per decode step. At that shape, with a mask (prompts of different
lengths), the CPU kernel behind `F.scaled_dot_product_attention` costs 2.3-2.5x two batched
matmuls (docs/performance.md item 15; the lean decode in `fast_forward.py` uses the same two).
transformers looks each layer's attention function up by name (`config._attn_implementation`) in
`AttentionInterface`: `decode_attention` is registered there as `NAME`, with SDPA's mask format,
and computes one-query, float32 CPU calls as `baddbmm` + softmax + `bmm`; every other call
(prompts, the learner, dropout, autocast, GPU, soft-capping, sinks, position biases) goes to
transformers' own SDPA function unchanged.

`decode_sdpa` switches the configs that name "sdpa" to `NAME` for the decode loop only and back,
so the learner's forward, the prefill and saved checkpoints keep "sdpa". Another thread that runs
the same model meanwhile gets the same attention (SDPA for every shape but one query, and the same
maths there).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "tamer_decode_sdpa"
ENABLED = True  # off: the decode loop keeps "sdpa" (benchmarks/hf_attention.py's A/B)


def decode_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, H, Q, D), key/value (B, H_kv, T, D),
    `attention_mask` as `sdpa_mask` makes it ((B, 1, Q, T) bool, True = attend, or None) or an
    additive float mask; returns ((B, Q, H, D), None), as `sdpa_attention_forward` does."""
    batch, heads, q_len, dim = query.shape
    if (q_len != 1 or dropout or query.device.type != "cpu" or query.dtype != torch.float32
            or torch.is_autocast_enabled("cpu") or key.shape[-1] != dim
            or any(kwargs.get(k) is not None for k in ("softcap", "position_bias", "s_aux", "sinks"))
            or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kv, length = key.shape[1], key.shape[2]
    group = heads // kv  # query head h reads KV head h // group (transformers' repeat_kv)
    q = query.reshape(batch * kv, group, dim)
    keys = key.reshape(batch * kv, length, dim).transpose(1, 2)  # views when B and H_kv merge (a KV cache's slice)
    values = value.reshape(batch * kv, length, value.shape[-1])
    scale = dim ** -0.5 if scaling is None else scaling
    if attention_mask is None:
        scores = torch.bmm(q, keys).mul_(scale)
    else:
        if attention_mask.dtype == torch.bool:
            bias = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
            bias.masked_fill_(~attention_mask, float("-inf"))
        else:
            bias = attention_mask.to(query.dtype)
        bias = bias.expand(batch, heads, 1, length).reshape(batch * kv, group, length)
        scores = torch.baddbmm(bias, q, keys, alpha=scale)
    out = torch.bmm(scores.softmax(-1), values)  # (B * H_kv, group, D)
    return out.view(batch, 1, heads, values.shape[-1]), None


AttentionInterface.register(NAME, decode_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def model_configs(model: nn.Module) -> list[PretrainedConfig]:
    """The distinct configs the model's modules read their attention implementation from."""
    seen: dict[int, PretrainedConfig] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            seen.setdefault(id(config), config)
    return list(seen.values())


@contextmanager
def decode_sdpa(configs: list[PretrainedConfig]) -> Iterator[None]:
    """Within the block, configs naming "sdpa" name `NAME` (each config alone: sub-configs keep theirs)."""
    switched = [c for c in configs if ENABLED and c._attn_implementation == "sdpa"]
    for config in switched:
        config._attn_implementation = {"": NAME}
    try:
        yield
    finally:
        for config in switched:
            config._attn_implementation = {"": "sdpa"}
