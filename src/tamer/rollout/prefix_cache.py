"""Reuse of the KV cache across the turns of multi-turn episodes (automatic prefix caching).

A multi-turn rollout sends each episode back to the engine as its whole history: prompt,
every sampled turn, every tool reply. Prefilling that history again at every turn costs
more than the turn's own decoding. `PrefixStore` keeps, for every sequence of the last
`generate` call, the keys and values of the tokens the model has already seen; a prompt
that extends a stored sequence is prefilled only from where the stored part ends.

The engine interface does not change: prompts are still whole token lists (as vLLM's
automatic prefix caching takes them), and a miss simply prefills everything. Entries live
until the next call, and `clear()` (on new weights) drops them.

Layout of a batch built from entries (row i, `c_i` cached positions, `s_i` new tokens):

    cache : [pad ... pad | cached_i (c_i) ]           width C = max c_i
    input :                [pad ... pad | new_i (s_i)] width S = max s_i
    mask  : [0 ........ 0 | 1 ....... 1 | 0 ... 0 | 1 ....... 1]

Positions come from the mask's running count, so they continue exactly where the cached
part ends; masked holes are never attended to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class PrefixEntry:
    """The KV of `tokens` for one sequence: per layer a (heads, len(tokens), head_dim) pair."""

    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class PrefixStore:
    """Per-sequence KV of the previous call, looked up by token prefix."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, ...], PrefixEntry] = {}
        self._lengths: set[int] = set()
        self.hits = 0  # prompts served from the store (for tests and metrics)
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._lengths.clear()

    def replace(self, entries: list[PrefixEntry]) -> None:
        """Keep exactly `entries` (the sequences of the call that just ran)."""
        self.clear()
        for entry in entries:
            if entry.tokens:
                self._entries[entry.tokens] = entry
                self._lengths.add(len(entry.tokens))

    def match(self, prompt: list[int]) -> PrefixEntry | None:
        """The longest stored sequence that is a proper prefix of `prompt`, or None."""
        for length in sorted((n for n in self._lengths if n < len(prompt)), reverse=True):
            entry = self._entries.get(tuple(prompt[:length]))
            if entry is not None:
                return entry
        return None

    def note_hits(self, hits: list[PrefixEntry]) -> None:
        self.hits += len(hits)
        self.reused_tokens += sum(len(h.tokens) for h in hits)

    def assemble(self, prompts: list[list[int]], entries: list[PrefixEntry], pad_id: int, device: torch.device
                 ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cache, input_ids (B, S), full attention mask (B, C + S), input positions (B, S)) for `prompts`.

        Every prompt must extend its entry (`entries[i].tokens` a proper prefix of `prompts[i]`).
        """
        cached = [len(e.tokens) for e in entries]
        new = [p[c:] for p, c in zip(prompts, cached)]
        width_c, width_s, batch = max(cached), max(len(n) for n in new), len(prompts)
        mask = torch.zeros(batch, width_c + width_s, dtype=torch.long)
        ids = torch.full((batch, width_s), pad_id, dtype=torch.long)
        for row, (c, tokens) in enumerate(zip(cached, new)):
            mask[row, width_c - c:width_c] = 1
            mask[row, width_c + width_s - len(tokens):] = 1
            ids[row, width_s - len(tokens):] = torch.tensor(tokens, dtype=torch.long)
        layers = []
        for layer in range(len(entries[0].keys)):
            k0 = entries[0].keys[layer]
            keys = k0.new_zeros(batch, k0.shape[0], width_c, k0.shape[-1])
            values = torch.zeros_like(keys)
            for row, (entry, c) in enumerate(zip(entries, cached)):
                keys[row, :, width_c - c:] = entry.keys[layer]
                values[row, :, width_c - c:] = entry.values[layer]
            layers.append((keys.to(device), values.to(device)))
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, width_c:]
        return DynamicCache(layers), ids.to(device), mask.to(device), positions.to(device)

    @staticmethod
    def extract(cache: DynamicCache, prompts: list[list[int]], prompt_mask: torch.Tensor, tokens: torch.Tensor,
                lengths: list[int], rows_per_prompt: int) -> list[PrefixEntry]:
        """Entries for every row after decoding: its prompt plus all but its last sampled token.

        `prompt_mask` (B, W) marks the real positions of the first W cache columns; generated
        token k of a row sits at column W + k (it is in the cache once it was fed back, which
        every token but a row's last one was).
        """
        width = prompt_mask.shape[1]
        entries = []
        layer_kv = [(layer.keys, layer.values) for layer in cache.layers]
        for row in range(tokens.shape[0]):
            fed = max(0, lengths[row] - 1)
            keep = torch.cat([prompt_mask[row].bool(), torch.ones(fed, dtype=torch.bool, device=prompt_mask.device)])
            seq = tuple(prompts[row // rows_per_prompt]) + tuple(tokens[row, :fed].tolist())
            entries.append(PrefixEntry(seq, [k[row, :, :width + fed][:, keep].clone() for k, _ in layer_kv],
                                       [v[row, :, :width + fed][:, keep].clone() for _, v in layer_kv]))
        return entries
