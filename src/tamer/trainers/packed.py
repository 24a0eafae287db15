"""Padding-free SFT batches and their loss on the lean Llama/Qwen2 forward.

    batch = pack(examples)                       # all tokens of the batch in one row, no padding
    loss = packed_loss(model, batch)             # == the padded masked-mean cross-entropy

`pack` concatenates the examples' tokens (N in all, shortest sequence first) with RoPE
positions reset at every sequence start, and lists the M positions whose next token is learned
with those tokens as targets. `packed_loss` runs every token-wise part of the model (embedding,
norms, q/k/v, output and MLP projections) on the N real tokens only; attention alone is laid
out as rows, right-padded, with a causal kernel: a right-padded row's real queries only ever
see its own earlier (real) keys, so no mask is needed and nothing crosses sequences. Rows go
to the attention kernel in groups of `ATTENTION_GROUP` sequences of similar length, each group
padded to its own longest (measured: ~25% less attention time than one (B, T_max) call for the
trip planner's batches of 16 sequences of 230-500 tokens). The
last layer keeps only the M selected positions after its attention (the rest of the network
is token-wise), and logits and the log-softmax are taken at those M positions only. The loss
and its gradient equal the padded computation's up to float rounding (tests/test_sft.py).

Models the lean forward does not support (`FastDecoder.for_model` is None) take the padded HF
path in `trainers/sft.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tamer.models.fast_arch import activate, softcap
from tamer.models.fast_forward import FastDecoder, linear

ATTENTION_GROUP = 4  # sequences per attention call (sorted by length, so each group pads little)


def pack(examples: list, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Concatenate `examples` (prompt_ids, completion_ids, completion_mask) into one padding-free batch.

    Sequences go shortest first (the loss, a mean over learned tokens, does not depend on order).
    Returns input_ids (N,), positions (N,) restarting at 0 per sequence, lengths (B,), select (M,):
    the packed index of every position whose next token is learned, and targets (M,): those tokens.
    """
    ids, positions, lengths, select, targets = [], [], [], [], []
    offset = 0
    for e in sorted(examples, key=lambda e: len(e.prompt_ids) + len(e.completion_ids)):
        seq = e.prompt_ids + e.completion_ids
        learned = [0] * len(e.prompt_ids) + list(e.completion_mask or [1] * len(e.completion_ids))
        ids.extend(seq)
        positions.extend(range(len(seq)))
        lengths.append(len(seq))
        for t in range(1, len(seq)):
            if learned[t]:
                select.append(offset + t - 1)
                targets.append(seq[t])
        offset += len(seq)
    as_long = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    return {"input_ids": as_long(ids), "positions": as_long(positions), "lengths": as_long(lengths),
            "select": as_long(select), "targets": as_long(targets)}


def packable(fast: FastDecoder | None) -> bool:
    """The packed path covers full causal attention without score soft-capping (every window None)."""
    return fast is not None and all(w is None for w in fast.arch.windows) and fast.arch.attn_softcap is None


def packed_logits(fast: FastDecoder, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits (M, V) at `batch["select"]` with the live weights (autograd records them)."""
    ids, positions, lengths, select = (batch[k] for k in ("input_ids", "positions", "lengths", "select"))
    device = fast.model.model.embed_tokens.weight.device
    ids, positions, lengths, select = ids.to(device), positions.to(device), lengths.to(device), select.to(device)
    groups = _attention_groups(lengths.tolist(), positions)
    d, heads = fast.head_dim, fast.num_heads
    x = fast._embed(ids, fast.model.model.embed_tokens.weight)  # (N, hidden)
    cs = fast._rope_tables(positions, device, size=int(lengths.max())).to(x.dtype)  # (N, 2, D)
    layers = fast._live_layers()
    for i, layer in enumerate(layers):
        h = fast._norm(x, layer.ln1)
        q, k, v = (linear(h, w, b).view(len(ids), -1, d) for w, b in zip(layer.qkv_w, layer.qkv_b))
        qk = fast._qk(torch.cat([q, k], dim=1), layer, cs)
        q, k = qk[:, :heads], qk[:, heads:]
        attn = torch.cat([_group_attention(fast, q, k, v, g) for g in groups])  # (N, H·D)
        if i == len(layers) - 1:  # last layer: only the positions with a loss go on
            x, attn = x[select], attn[select]
        x = fast._residual(x, linear(attn, layer.o_w, layer.o_b), layer.post_attn)
        h = fast._norm(x, layer.ln2)
        gate, up = (linear(h, w) for w in layer.gu_w)
        x = fast._residual(x, linear(activate(gate, fast.arch.act) * up, layer.down_w), layer.post_ffn)
    x = fast._norm(x, (fast.model.model.norm.weight, fast.final_eps))
    return softcap(linear(x, fast.model.get_output_embeddings().weight), fast.arch.final_softcap)


def _attention_groups(lengths: list[int], positions: torch.Tensor) -> list[tuple[int, int, int, int, torch.Tensor]]:
    """(first token, end token, rows, width, slot (n,)) per group of ATTENTION_GROUP consecutive sequences;
    slot = row * width + position places each of the group's tokens in its (rows, width) layout."""
    groups, start = [], 0
    for first in range(0, len(lengths), ATTENTION_GROUP):
        part = lengths[first:first + ATTENTION_GROUP]
        end, width = start + sum(part), max(part)
        row = torch.repeat_interleave(torch.arange(len(part), device=positions.device),
                                      torch.tensor(part, device=positions.device))
        groups.append((start, end, len(part), width, row * width + positions[start:end]))
        start = end
    return groups


def _group_attention(fast: FastDecoder, q, k, v, group) -> torch.Tensor:
    """Causal attention of one group's tokens (q (N, H, D), k/v (N, H_kv, D) sliced to the group) -> (n, H·D)."""
    start, end, rows, width, slot = group
    padded = [t[start:end].new_zeros(rows * width, t.shape[1], t.shape[2]).index_copy(0, slot, t[start:end])
              .view(rows, width, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v)]  # (b, H, T, D)
    out = F.scaled_dot_product_attention(*padded, is_causal=True, scale=fast.scaling,
                                         enable_gqa=fast.num_heads != fast.num_kv)
    return out.transpose(1, 2).reshape(rows * width, -1).index_select(0, slot)


def packed_loss(model, batch: dict[str, torch.Tensor], fast: FastDecoder | None = None) -> torch.Tensor:
    """Mean cross-entropy over the learned tokens of a `pack`ed batch (`model` must take the lean forward)."""
    fast = fast or FastDecoder.for_model(model)
    if not packable(fast):
        raise ValueError(f"packed_loss: {type(model).__name__} has no lean forward; use the padded sft_loss")
    if len(batch["targets"]) == 0:
        return model.model.embed_tokens.weight.sum() * 0.0
    logits = packed_logits(fast, batch).float()  # (M, V)
    return F.cross_entropy(logits, batch["targets"].to(logits.device))
