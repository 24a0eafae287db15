"""The learner's forward: log π(token_t | tokens_<t) for every position of a batch.

    logprobs = token_logprobs(model, input_ids, attention_mask, temperature)          # (B, T)
    logprobs = shared_prefix_logprobs(model, input_ids, attention_mask, prompt_lengths,
                                      prefix_index, temperature)                       # the same, each prompt once

Llama/Qwen2-family models run `FastDecoder.forward` (the same maths, fewer ops); others the
HF forward. Logits are divided by the sampling temperature, as the sampler's were
(docs/algorithms.md#temperature).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from tamer.models.fast_forward import FastDecoder
from tamer.models.precision import cache_keyword
from tamer.models.replay import Replay


def token_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,  # (B, T) long
    attention_mask: torch.Tensor,  # (B, T) long, right-padded
    temperature: float = 1.0,
    fast: bool = True,
) -> torch.Tensor:
    """log π(token_t | tokens_<t) for every position; position 0 gets 0. Shape (B, T) float32.

    Logits are divided by the sampling temperature, as the sampler did (docs/algorithms.md#temperature), and the
    log-softmax is taken as logit - logsumexp to avoid materialising a (B, T, V) log-softmax.
    Models `FastDecoder` covers (Llama, Qwen2/3, Mistral, Gemma/Gemma2) run its `forward` (the
    same maths, fewer ops); others the HF forward.
    """
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    if input_ids.shape[1] < 2:
        return torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    # The last column's logits would predict past the sequence and no earlier position reads its keys
    # (causal): it is not forwarded.
    ids, mask, positions = input_ids[:, :-1], attention_mask[:, :-1], positions[:, :-1]
    fast = FastDecoder.for_model(model) if fast else None  # fast=False: the HF forward
    if fast is not None:
        logits = fast.forward(ids, mask, positions)[0]
    else:
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    logits = logits.float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    targets = input_ids[:, 1:]
    picked = logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def shared_prefix_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,  # (B, T) long, right-padded: prompt then completion
    attention_mask: torch.Tensor,  # (B, T) long
    prompt_lengths: torch.Tensor,  # (B,) long
    prefix_index: torch.Tensor,  # (B,) long: rows with the same index have the same prompt
    temperature: float = 1.0,
    fast: bool = True,
    replay: Replay | None = None,
) -> torch.Tensor:
    """`token_logprobs` computed with each distinct prompt forwarded once.

    The G rows of a group share their prompt: its keys and values are computed once (with
    gradients) and indexed out to the rows, which then forward only their completions. The
    result, and its gradient, equal `token_logprobs` up to float rounding; the learner skips
    (G − 1)/G of the prompt tokens. Prompt positions get 0 (`token_logprobs` gives their real
    logprobs there; no loss reads them). docs/algorithms.md#shared-prompt-prefix

    `replay`: the sampler's projection outputs for these rows' completions (`tamer.models.replay`);
    the lean forward returns them instead of recomputing the completions' projections (the
    prompts are computed either way), when `FastDecoder.replay_applies`. The rows then run in the
    record's row order (`Replay.order`: its outputs are read in place, no gather) and come back in
    the caller's.
    """
    device = input_ids.device
    if replay is not None and len(replay) == len(input_ids):
        order = replay.order()
        if not bool((order == torch.arange(len(order))).all()):
            rows = order.to(device)
            out = shared_prefix_logprobs(model, input_ids[rows], attention_mask[rows], prompt_lengths[rows.cpu()],
                                         prefix_index[rows.cpu()], temperature, fast, replay[order])
            return out.index_select(0, torch.argsort(rows))
    uniq, inverse = torch.unique(prefix_index, return_inverse=True)  # (U,), (B,)
    # One row per distinct prompt (any: rows with the same index have the same prompt).
    first = torch.zeros(len(uniq), dtype=torch.long, device=device).scatter_(0, inverse, torch.arange(len(inverse)))
    plen = prompt_lengths.to(device)
    width = int(plen[first].max())
    # Prompts left-padded to `width`, so that every completion starts at the same column.
    cols = torch.arange(width, device=device)
    shift = (width - plen[first])[:, None]  # (U, 1)
    src = (cols[None, :] - shift).clamp(min=0)
    prompt_mask = (cols[None, :] >= shift).long()  # (U, P)
    prompt_ids = input_ids[first].gather(1, src) * prompt_mask
    prompt_pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    fast = FastDecoder.for_model(model) if fast else None  # fast=False: the HF forward
    if fast is None and model.training and torch.is_grad_enabled() and \
            any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        # HF's checkpointed layers drop the KV cache (use_cache=False), so the prompt cannot be shared.
        completion = torch.arange(input_ids.shape[1], device=device)[None, :] >= prompt_lengths.to(device)[:, None]
        return (token_logprobs(model, input_ids, attention_mask, temperature, fast=False)
                * (completion & attention_mask.bool()))
    if fast is not None:
        out_logits, kvs = fast.forward(prompt_ids, prompt_mask, prompt_pos, return_kv=True, last_only=True)
        past = [(k[inverse], v[inverse]) for k, v in kvs]  # the prompt's KV, one copy per row
    else:
        kw = cache_keyword(model)
        cache = DynamicCache()
        out_logits = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=prompt_pos, use_cache=True,
                           logits_to_keep=1, **{kw: cache}).logits
        for layer in cache.layers:  # the prompt's KV, one copy per row (differentiable indexing)
            layer.keys, layer.values = layer.keys[inverse], layer.values[inverse]
    first_logits = out_logits[:, -1][inverse]  # (B, V): predicts each row's first completion token
    # Completions, right-padded from column 0.
    lengths = attention_mask.sum(-1)
    comp_len = lengths - plen  # (B,)
    width_c = int(comp_len.max())
    ccols = torch.arange(width_c, device=device)
    comp_mask = (ccols[None, :] < comp_len[:, None]).long()  # (B, C)
    comp_src = (plen[:, None] + ccols[None, :]).clamp(max=input_ids.shape[1] - 1)
    comp_ids = input_ids.gather(1, comp_src) * comp_mask
    # Columns 0..C-2 are forwarded: the last one's logits would predict past every completion, and no
    # earlier position reads its keys (causal), so its forward is skipped.
    fed = width_c - 1
    logits = first_logits[:, None]  # (B, 1, V): predicts completion token 0
    if fed > 0:
        mask = torch.cat([prompt_mask[inverse], comp_mask[:, :fed]], dim=1)
        positions = plen[:, None] + ccols[None, :fed]
        if fast is not None:
            rest = fast.forward(comp_ids[:, :fed], mask, positions, past=past, replay=replay)[0]  # (B, C-1, V)
        else:
            rest = model(input_ids=comp_ids[:, :fed], attention_mask=mask, position_ids=positions, use_cache=True,
                         **{kw: cache}).logits
        logits = torch.cat([logits, rest], dim=1)
    logits = logits.float()  # position c predicts completion token c
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    picked = logits.gather(-1, comp_ids[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # (B, C)
    result = torch.zeros(input_ids.shape, dtype=picked.dtype, device=device)
    valid = comp_mask.bool()
    rows = torch.arange(len(input_ids), device=device)[:, None].expand_as(valid)
    return result.index_put((rows[valid], comp_src[valid]), picked[valid])
