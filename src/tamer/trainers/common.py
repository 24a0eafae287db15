"""Pieces both trainers share: token logprobs, padding, optimizer and LR schedule."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from tamer.rollout.engine import cache_keyword
from tamer.rollout.fast_forward import FastDecoder

LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with warmup and a decay schedule."""

    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | linear | cosine (after warmup)
    min_lr_ratio: float = 0.1  # floor of linear/cosine decay, as a fraction of lr
    max_grad_norm: float = 1.0  # 0 disables clipping

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optim.lr: expected > 0, got {self.lr}")
        if self.schedule not in LR_SCHEDULES:
            raise ValueError(f"optim.schedule: expected one of {LR_SCHEDULES}, got {self.schedule!r}")
        if self.warmup_steps < 0:
            raise ValueError("optim.warmup_steps: expected >= 0")


def make_optimizer(model: torch.nn.Module, config: OptimConfig) -> torch.optim.Optimizer:
    """AdamW; the fused kernel (one call for all tensors) where torch has it for these parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = all(p.dtype in (torch.float32, torch.bfloat16, torch.float16) and p.device.type in ("cpu", "cuda")
                for p in params)
    return torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay, fused=fused)


class _LRLambda:
    """Picklable warmup + decay multiplier (a lambda would not survive a checkpoint)."""

    def __init__(self, config: OptimConfig, total_steps: int) -> None:
        self.warmup, self.total = config.warmup_steps, max(1, total_steps)
        self.schedule, self.floor = config.schedule, config.min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        decay = 1.0 - progress if self.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.floor + (1.0 - self.floor) * decay


def make_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _LRLambda(config, total_steps))


def clip_and_step(model, optimizer, scheduler, max_grad_norm: float) -> float:
    """Clip gradients, step optimizer and schedule, zero grads; return the pre-clip norm."""
    params = [p for p in model.parameters() if p.requires_grad]
    if max_grad_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    else:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def right_pad(rows: list[list[int]], pad_value: float | int, dtype: torch.dtype) -> torch.Tensor:
    """Stack ragged rows into a (B, T) tensor, padding on the right."""
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad_value, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out


def token_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,  # (B, T) long
    attention_mask: torch.Tensor,  # (B, T) long, right-padded
    temperature: float = 1.0,
    fast: bool = True,
) -> torch.Tensor:
    """log π(token_t | tokens_<t) for every position; position 0 gets 0. Shape (B, T) float32.

    Logits are divided by the sampling temperature, as the sampler did (MATH.md), and the
    log-softmax is taken as logit - logsumexp to avoid materialising a (B, T, V) log-softmax.
    Llama/Qwen2-family models run `FastDecoder.forward` (the same maths, fewer ops); others,
    or `fast=False`, the HF forward.
    """
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    fast = FastDecoder.for_model(model) if fast else None
    if fast is not None:
        logits = fast.forward(input_ids, attention_mask, positions)[0]
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits
    logits = logits[:, :-1].float()
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
) -> torch.Tensor:
    """`token_logprobs` computed with each distinct prompt forwarded once.

    The G rows of a group share their prompt: its keys and values are computed once (with
    gradients) and indexed out to the rows, which then forward only their completions. The
    result, and its gradient, equal `token_logprobs` up to float rounding; the learner skips
    (G − 1)/G of the prompt tokens. Prompt positions get 0, as in `token_logprobs`.
    """
    device = input_ids.device
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
    fast = FastDecoder.for_model(model) if fast else None
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
    mask = torch.cat([prompt_mask[inverse], comp_mask], dim=1)
    positions = plen[:, None] + ccols[None, :]
    if fast is not None:
        logits = fast.forward(comp_ids, mask, positions, past=past)[0]  # (B, C, V)
    else:
        logits = model(input_ids=comp_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                       **{kw: cache}).logits
    logits = torch.cat([first_logits[:, None], logits[:, :-1]], dim=1).float()  # position c predicts token c
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    picked = logits.gather(-1, comp_ids[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # (B, C)
    result = torch.zeros(input_ids.shape, dtype=picked.dtype, device=device)
    valid = comp_mask.bool()
    rows = torch.arange(len(input_ids), device=device)[:, None].expand_as(valid)
    return result.index_put((rows[valid], comp_src[valid]), picked[valid])
