"""Generation engines: prompts in as token ids, sampled token ids and logprobs out.

`GenerationEngine` is the interface a rollout needs; `HFEngine` implements it on any
`transformers` causal LM with its own decode loop, so that it can

* prefill a shared prompt once and reuse its KV cache for all `n` samples of a group,
* return the sampling logprobs (at the sampling temperature) alongside every token,
* stop each sequence at its own stop tokens and stop decoding once every one is done.

A vLLM engine on GPU plugs in behind the same `generate` call.
"""

from __future__ import annotations

import inspect
from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel

from tamer.rollout.types import GenerationOutput, SamplingParams


class GenerationEngine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[GenerationOutput]]:
        """For each prompt, `params.n` sampled continuations."""

    def sync_weights(self, model: PreTrainedModel) -> None:
        """Make the engine sample from the learner's current weights."""


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    return ids, mask


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from `logits` (B, V); return (tokens, logprobs) (B,).

    Logprobs are those of the distribution actually sampled from (after temperature and
    top-p), which is what π_old means for the learner.
    """
    logits = logits.float()
    if params.greedy:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        logprobs = _top_p_filter(logprobs, params.top_p)
    tokens = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def _top_p_filter(logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_lp, order = logprobs.sort(dim=-1, descending=True)
    cumulative = sorted_lp.exp().cumsum(dim=-1)
    drop = cumulative - sorted_lp.exp() > top_p  # keep the smallest set whose mass reaches top_p
    sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logprobs, float("-inf")).scatter(-1, order, sorted_lp)
    return torch.log_softmax(filtered, dim=-1)


def cache_keyword(model: PreTrainedModel) -> str:
    """The forward() argument that takes a KV cache: `cache` in newer transformers."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class HFEngine:
    """Batched sampling with a KV cache on a `transformers` model (CPU or GPU)."""

    def __init__(self, model: PreTrainedModel, pad_token_id: int, *, max_batch: int = 256) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.max_batch = max_batch
        self._cache_kw = cache_keyword(model)

    def sync_weights(self, model: PreTrainedModel) -> None:
        self.model = model  # same process: the learner's module is the sampler's

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[GenerationOutput]]:
        generator = torch.Generator().manual_seed(params.seed)
        per_chunk = max(1, self.max_batch // params.n)
        outputs: list[list[GenerationOutput]] = []
        for start in range(0, len(prompts), per_chunk):
            outputs.extend(self._generate_chunk(prompts[start:start + per_chunk], params, generator))
        return outputs

    @torch.inference_mode()
    def _generate_chunk(
        self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator
    ) -> list[list[GenerationOutput]]:
        was_training = self.model.training
        self.model.eval()
        device = next(self.model.parameters()).device
        ids, mask = _left_pad(prompts, self.pad_token_id)
        ids, mask = ids.to(device), mask.to(device)
        # Prefill each distinct prompt once, then copy its cache for the n samples.
        cache = DynamicCache()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        logits = out.logits[:, -1, :]
        if params.n > 1:
            cache.batch_repeat_interleave(params.n)
            logits = logits.repeat_interleave(params.n, dim=0)
            mask = mask.repeat_interleave(params.n, dim=0)
            positions = positions.repeat_interleave(params.n, dim=0)
        tokens, logprobs = self._decode(logits, cache, mask, positions[:, -1], params, generator)
        self.model.train(was_training)
        return self._collect(tokens, logprobs, len(prompts), params)

    def _decode(self, logits, cache, mask, last_pos, params, generator):
        batch = logits.shape[0]
        stop = torch.tensor(params.stop_token_ids or [-1], device=logits.device)
        done = torch.zeros(batch, dtype=torch.bool, device=logits.device)
        all_tokens, all_logprobs = [], []
        for step in range(params.max_new_tokens):
            tokens, logprobs = sample_tokens(logits, params, generator)
            tokens = tokens.masked_fill(done, self.pad_token_id)
            all_tokens.append(tokens)
            all_logprobs.append(logprobs.masked_fill(done, 0.0))
            done = done | torch.isin(tokens, stop)
            if bool(done.all()) or step == params.max_new_tokens - 1:
                break
            mask = torch.cat([mask, (~done).long()[:, None]], dim=1)
            last_pos = last_pos + 1
            out = self.model(input_ids=tokens[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                             use_cache=True, **{self._cache_kw: cache})
            logits = out.logits[:, -1, :]
        return torch.stack(all_tokens, 1).cpu(), torch.stack(all_logprobs, 1).float().cpu()

    def _collect(self, tokens, logprobs, num_prompts, params) -> list[list[GenerationOutput]]:
        stops = set(params.stop_token_ids)
        results: list[list[GenerationOutput]] = [[] for _ in range(num_prompts)]
        for row in range(tokens.shape[0]):
            ids, lps = tokens[row].tolist(), logprobs[row].tolist()
            end = next((i + 1 for i, t in enumerate(ids) if t in stops), None)
            finish = "stop" if end is not None else "length"
            end = end or len(ids)
            results[row // params.n].append(GenerationOutput(ids[:end], lps[:end], finish))
        return results
