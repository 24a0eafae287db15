"""Generation engines: prompts in as token ids, sampled token ids and logprobs out.

`GenerationEngine` is the interface a rollout needs; `HFEngine` implements it on any
`transformers` causal LM with its own decode loop, so that it can

* prefill a shared prompt once and reuse its KV cache for all `n` samples of a group,
* return the sampling logprobs (at the sampling temperature) alongside every token,
* stop each sequence at its own stop tokens and stop decoding once every one is done,
* decode without per-step copies: the KV cache and the attention mask are allocated once
  for the whole completion and written in place (transformers' `DynamicCache` concatenates,
  copying the whole cache at every step; measurements in docs/performance.md),
* run under bf16 autocast (`precision="bf16"`) with the fp32 weights left as they are,
* on Llama, Qwen2/3, Mistral and Gemma/Gemma2 models, run prefill and decode through
  `FastDecoder` (`models/fast_forward.py`: the same maths as the HF forward with plain torch
  ops, fused QKV and gate/up weights, precomputed RoPE tables, its own masks; coverage in
  `models/fast_arch.py`); any other model, or `fast=False`, goes through the HF forward,
* optionally decode with its own intra-op thread count (`threads`, default: the process's),
  for hosts where rollouts share the CPU with other work (off by default: docs/performance.md).

A vLLM engine on GPU plugs in behind the same `generate` call.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from tamer.memory import available_mb, keep_freed_memory
from tamer.models.decode_attention import decode_sdpa, model_configs
from tamer.models.decode_linear import packed_linears
from tamer.models.fast_forward import FastDecoder
from tamer.models.precision import autocast, cache_keyword, intra_op_threads
from tamer.models.replay import DecodeRecord
from tamer.rollout.prefix_cache import PrefixEntry, PrefixStore
from tamer.rollout.types import GenerationOutput, SamplingParams


class GenerationEngine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[GenerationOutput]]:
        """For each prompt, `params.n` sampled continuations."""

    def sync_weights(self, model: PreTrainedModel) -> None:
        """Make the engine sample from the learner's current weights."""


class _InPlaceLayer(DynamicLayer):
    """One layer's KV cache with room for `capacity` positions, grown by writing in place.

    `keys`/`values` are views of the filled part, so attention never reads unused slots.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        super().__init__()
        b, h, length, _ = keys.shape
        self._keys = keys.new_empty(b, h, capacity, keys.shape[-1])
        self._values = values.new_empty(b, h, capacity, values.shape[-1])
        self._keys[:, :, :length] = keys
        self._values[:, :, :length] = values
        self.device, self.is_initialized, self.length = keys.device, True, length
        self.keys, self.values = self._keys[:, :, :length], self._values[:, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        self._keys[:, :, self.length:end] = key_states
        self._values[:, :, self.length:end] = value_states
        self.length = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values


def preallocate(cache: DynamicCache, extra: int) -> DynamicCache:
    """Give every layer of a prefilled `cache` room for `extra` more positions (in place)."""
    cache.layers = [_InPlaceLayer(layer.keys, layer.values, layer.keys.shape[-2] + extra) for layer in cache.layers]
    return cache


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    return ids, mask


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from `logits` (B, V); return (tokens, logprobs) (B,).

    Logprobs are those of the distribution actually sampled from (after temperature and
    top-p), which is what π_old means for the learner. `uniforms` (B, 1), when given, are the
    rows' draws (per-row streams, `SamplingParams.row_seeds`); else they come from `generator`.
    """
    logits = logits.float()
    if params.greedy:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    logprobs = torch.log_softmax(logits / params.temperature if params.temperature != 1.0 else logits, dim=-1)
    if params.top_p < 1.0:
        logprobs = _top_p_filter(logprobs, params.top_p)
    tokens = _inverse_cdf_sample(logprobs.exp(), generator, uniforms)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def row_uniforms(row_seeds: tuple[int, ...] | list[int], steps: int) -> torch.Tensor:
    """(rows, steps) float32 draws, row r from its own generator seeded with `row_seeds[r]`."""
    return torch.stack([torch.rand(steps, generator=torch.Generator().manual_seed(s)) for s in row_seeds])


def _inverse_cdf_sample(probs: torch.Tensor, generator: torch.Generator | None,
                        u: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of `probs` (B, V): the first index whose cumulative mass exceeds u · total.

    The same distribution as `torch.multinomial(probs, 1)` with one uniform draw per row; on CPU
    multinomial draws an exponential per vocabulary entry (about 6x slower at a 269-token
    vocabulary, once per decode step). Zero-probability tokens are never chosen.
    """
    cdf = probs.cumsum(-1)
    if u is None:
        u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=cdf.dtype)
    else:
        u = u.to(device=probs.device, dtype=cdf.dtype)
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    return tokens.clamp_(max=probs.shape[-1] - 1)


def _top_p_filter(logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_lp, order = logprobs.sort(dim=-1, descending=True)
    cumulative = sorted_lp.exp().cumsum(dim=-1)
    drop = cumulative - sorted_lp.exp() > top_p  # keep the smallest set whose mass reaches top_p
    sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logprobs, float("-inf")).scatter(-1, order, sorted_lp)
    return torch.log_softmax(filtered, dim=-1)


class HFEngine:
    """Batched sampling with a KV cache on a `transformers` model (CPU or GPU)."""

    def __init__(self, model: PreTrainedModel, pad_token_id: int, *, max_batch: int = 256,
                 precision: str = "fp32", fast: bool = True, threads: int = 0) -> None:
        autocast(precision)  # validates the name
        keep_freed_memory()  # freed tensors' memory reused, not faulted in again at every call (tamer.memory)
        if threads < 0:
            raise ValueError(f"threads: expected >= 0 (0 = the process's setting), got {threads}")
        self.threads = threads
        self.pad_token_id = pad_token_id
        self.max_batch = max_batch
        self.precision = precision
        self.use_fast = fast
        self.prefix_store = PrefixStore()  # KV of the last call's sequences (params.reuse_prefix)
        self._set_model(model)

    def _set_model(self, model: PreTrainedModel) -> None:
        self.model = model
        self._cache_kw = cache_keyword(model)
        # The lean forward, or None (unsupported model, or fast=False): then the HF forward runs.
        # It snapshots fused weights and refreshes them whenever a parameter has changed.
        self.fast = FastDecoder.for_model(model) if self.use_fast else None
        # The HF forward's decode steps take tamer's one-query attention (models/decode_attention.py).
        self._configs = model_configs(model) if self.fast is None else []

    def sync_weights(self, model: PreTrainedModel) -> None:
        if model is not self.model:  # same process: the learner's module is the sampler's
            self._set_model(model)
        self.prefix_store.clear()  # cached keys and values belong to the old weights

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[GenerationOutput]]:
        generator = torch.Generator().manual_seed(params.seed)
        if params.row_seeds and len(params.row_seeds) != len(prompts) * params.n:
            raise ValueError(f"row_seeds: expected {len(prompts) * params.n} (prompts x n), "
                             f"got {len(params.row_seeds)}")
        per_chunk = max(1, self.max_batch // params.n)
        outputs: list[list[GenerationOutput]] = []
        entries: list[PrefixEntry] | None = [] if params.reuse_prefix else None
        with intra_op_threads(self.threads):
            if self.fast is not None:
                # The current weights, fused; under bf16 autocast stored in bf16 once per call
                # rather than cast by autocast at every decode step (see FastDecoder.refresh).
                self.fast.refresh(torch.bfloat16 if self.precision == "bf16" else None)
            try:
                for start in range(0, len(prompts), per_chunk):
                    seeds = params.row_seeds[start * params.n:(start + per_chunk) * params.n]
                    outputs.extend(self._generate_chunk(prompts[start:start + per_chunk], params, generator, entries,
                                                        seeds))
            finally:
                if self.fast is not None:
                    self.fast.release()
        self.prefix_store.replace(entries or [])
        return outputs

    @torch.inference_mode()
    def _generate_chunk(
        self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator,
        entries: list[PrefixEntry] | None = None, row_seeds: tuple[int, ...] = (),
    ) -> list[list[GenerationOutput]]:
        was_training = self.model.training
        self.model.eval()
        device = next(self.model.parameters()).device
        hits = [self.prefix_store.match(p) for p in prompts] if entries is not None and params.n == 1 else []
        with autocast(self.precision, device):
            if hits and all(hit is not None for hit in hits):
                # Multi-turn: only the tokens after each sequence's cached part are prefilled.
                cache, ids, mask, positions = self.prefix_store.assemble(prompts, hits, self.pad_token_id, device)
                self.prefix_store.note_hits(hits)
            else:
                ids, mask = _left_pad(prompts, self.pad_token_id)
                ids, mask = ids.to(device), mask.to(device)
                cache, positions = DynamicCache(), (mask.cumsum(-1) - 1).clamp(min=0)
            row_mask = mask.repeat_interleave(params.n, dim=0) if params.n > 1 else mask  # one row per sample
            record = self._record(row_mask.shape[0], params)
            if self.fast is not None:
                cache, logits, step_fn = self._fast_prefill(cache, ids, mask, row_mask, positions, params, record)
            else:
                cache, logits, step_fn = self._hf_prefill(cache, ids, mask, row_mask, positions, params)
            mask = row_mask
            if params.n > 1:
                positions = positions.repeat_interleave(params.n, dim=0)
            uniforms = row_uniforms(row_seeds, params.max_new_tokens) if row_seeds else None
            packed = packed_linears(self.model, mask.shape[0]) if self.fast is None else contextlib.nullcontext()
            with decode_sdpa(self._configs), packed:
                tokens, logprobs = self._decode(logits, step_fn, mask, positions[:, -1], params, generator, uniforms)
        self.model.train(was_training)
        outputs = self._collect(tokens, logprobs, len(prompts), params)
        if record is not None:
            record.finish()
            for row, out in enumerate(o for group in outputs for o in group):
                out.activations = (record, row)
        if entries is not None:
            lengths = [len(o.token_ids) for group in outputs for o in group]
            entries.extend(PrefixStore.extract(cache, prompts, mask, tokens, lengths, params.n))
        return outputs

    def _hf_prefill(self, cache: DynamicCache, ids, mask, row_mask, positions, params):
        """Prefill each distinct prompt once with the HF forward, then copy its cache for the n samples."""
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        logits = out.logits[:, -1, :]
        if params.n > 1:
            cache.batch_repeat_interleave(params.n)
            logits = logits.repeat_interleave(params.n, dim=0)
        preallocate(cache, params.max_new_tokens)
        full = torch.ones(logits.shape[0], mask.shape[1] + params.max_new_tokens, dtype=mask.dtype, device=mask.device)
        full[:, :mask.shape[1]] = row_mask
        width = mask.shape[1]

        def step(tokens, pos, k):  # k-th fed token: attends to the first width + k + 1 columns
            return self.model(input_ids=tokens[:, None], attention_mask=full[:, :width + k + 1],
                              position_ids=pos[:, None], use_cache=True, **{self._cache_kw: cache}).logits[:, -1, :]
        return cache, logits, step

    def _record(self, rows: int, params: SamplingParams) -> DecodeRecord | None:
        """A `DecodeRecord` for this chunk's decode when `params.keep_activations` asks and it applies: the
        lean float32 decode (no autocast, float32 weights) and buffers within a quarter of the memory
        still available (else the learner recomputes, as without it)."""
        if not params.keep_activations or self.fast is None or self.precision != "fp32" \
                or self.model.get_output_embeddings().weight.dtype != torch.float32:
            return None
        steps = params.max_new_tokens  # one column per completion token (the last one's stays zero: never fed)
        available = available_mb()
        if available is not None and DecodeRecord.nbytes(self.fast, rows, steps) > available * 2**20 / 4:
            return None
        return DecodeRecord.for_decode(self.fast, rows, steps, self.model.get_output_embeddings().weight.device)

    def _fast_prefill(self, cache: DynamicCache, ids, mask, row_mask, positions, params,
                      record: DecodeRecord | None = None):
        """The same with `FastDecoder`: KV buffers for prompt + completion, the prompt's rows repeated n times;
        `record`: each decode step's projection outputs kept (`FastDecoder.decode`)."""
        past = [(layer.keys, layer.values) for layer in cache.layers] if cache.layers else None
        logits, kv = self.fast.prefill(ids, mask, positions, past=past, repeat=params.n, extra=params.max_new_tokens)
        key_mask = torch.ones(logits.shape[0], mask.shape[1] + params.max_new_tokens, dtype=torch.bool,
                              device=mask.device)
        key_mask[:, :mask.shape[1]] = row_mask.bool()

        def step(tokens, pos, k):
            return self.fast.decode(tokens, pos, kv, key_mask, record)
        return kv, logits, step

    def _decode(self, logits, step_fn, prompt_mask, last_pos, params, generator, uniforms=None):
        """Sample up to max_new_tokens per row; `step_fn(tokens, positions, k)` feeds the k-th tokens back.

        Rows that are done keep being fed (their tokens are pads and are thrown away), as HF
        generate does.
        """
        batch = prompt_mask.shape[0]
        stop = torch.tensor(params.stop_token_ids or [-1], device=logits.device)
        done = torch.zeros(batch, dtype=torch.bool, device=logits.device)
        tokens_out = torch.full((batch, params.max_new_tokens), self.pad_token_id, dtype=torch.long,
                                device=logits.device)
        logprobs_out = torch.zeros(batch, params.max_new_tokens, dtype=torch.float32, device=logits.device)
        steps = params.max_new_tokens
        for step in range(params.max_new_tokens):
            u = None if uniforms is None else uniforms[:, step:step + 1]
            tokens, logprobs = sample_tokens(logits, params, generator, u)
            tokens = tokens.masked_fill(done, self.pad_token_id)
            tokens_out[:, step] = tokens
            logprobs_out[:, step] = logprobs.masked_fill(done, 0.0)
            done = done | (tokens[:, None] == stop[None, :]).any(-1)
            if step == params.max_new_tokens - 1 or bool(done.all()):
                steps = step + 1
                break
            last_pos = last_pos + 1
            logits = step_fn(tokens, last_pos, step)
        return tokens_out[:, :steps].cpu(), logprobs_out[:, :steps].cpu()

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
