"""Padding-free SFT batches and their loss on the lean Llama/Qwen2 forward.

    batch = pack(examples)                       # all tokens of the batch in one row, no padding
    loss = packed_loss(model, batch)             # == the padded masked-mean cross-entropy

`pack` concatenates the examples' tokens (N in all, shortest sequence first) with RoPE
positions reset at every sequence start, and lists the M positions whose next token is learned
with those tokens as targets. When every sequence of the batch starts with the same K tokens
(a system prompt, the tool schemas an agent prompt renders), those K tokens are packed once:
causal attention makes their activations the same in every sequence, so the shared prefix's
token-wise work is done once instead of B times and its gradient is the sum over the sequences
that attend to it (autograd sums the repeated gathers). `packed_loss` runs every token-wise
part of the model (embedding, norms, q/k/v, output and MLP projections) on the packed tokens
only; attention alone is laid out as rows, each sequence whole (the shared prefix gathered into
every row), right-padded, with a causal kernel: a right-padded row's real queries only ever see
its own earlier (real) keys, so no mask is needed and nothing crosses sequences. Rows go to the
attention kernel in groups of sequences of similar length, each padded to its own longest and
holding at most `ATTENTION_TOKENS` padded tokens (`attention_groups`): few calls for many short
sequences, little padding for long ones (measured, `benchmarks/sft_attention_groups.py`: the
arithmetic preset's 32 sequences of ~45 tokens train 7% faster per step in one call than in 8
groups of 4; fewer, larger calls were never slower at the trip planner's shapes;
docs/performance.md). The last layer keeps only the M selected positions after its attention
(the rest of the network is token-wise), and logits and the log-softmax are taken at those M
positions only. The loss and its gradient equal the padded
computation's up to float rounding (tests/test_sft.py).

Models the lean forward does not support (`FastDecoder.for_model` is None) take the padded HF
path in `trainers/sft.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tamer.models.fast_arch import activate, softcap
from tamer.models.fast_forward import FastDecoder, linear

ATTENTION_TOKENS = 4096  # padded tokens per attention call (sequences sorted by length, so a group pads little)
# A shared prefix is packed once only when that removes at least this share of the batch's tokens: the
# gathers it needs in attention cost more than a few tokens save (trip planner batches sharing 1.2% of
# their tokens trained ~13% slower shared; tool schemas, ~80% of the tokens, 1.6x faster; docs/performance.md).
MIN_SHARED_FRACTION = 0.1


def shared_prefix(sequences: list[list[int]]) -> int:
    """Length of the token prefix common to all `sequences`, leaving every sequence at least one token of its own."""
    if len(sequences) < 2:
        return 0
    first, limit = sequences[0], min(len(s) for s in sequences) - 1
    k = 0
    while k < limit and all(s[k] == first[k] for s in sequences):
        k += 1
    return k


def prefix_to_share(sequences: list[list[int]]) -> int:
    """`shared_prefix` where packing it once saves at least MIN_SHARED_FRACTION of the tokens, else 0."""
    k = shared_prefix(sequences)
    return k if k * (len(sequences) - 1) >= MIN_SHARED_FRACTION * sum(len(s) for s in sequences) else 0


def attention_groups(lengths: list[int], budget: int | None = None) -> list[range]:
    """Split sequences sorted by length (ascending) into consecutive groups of at most `budget` padded
    tokens each (rows x the group's longest; a sequence longer than `budget` is a group of its own)."""
    budget = ATTENTION_TOKENS if budget is None else budget
    groups, first = [], 0
    for i, n in enumerate(lengths):
        if i > first and (i - first + 1) * n > budget:
            groups.append(range(first, i))
            first = i
    return groups + [range(first, len(lengths))] if lengths else groups


def pack(examples: list, pad_id: int = 0, share_prefix: bool = True) -> dict:
    """Concatenate `examples` (prompt_ids, completion_ids, completion_mask) into one padding-free batch.

    Sequences go shortest first (the loss, a mean over learned tokens, does not depend on order);
    with `share_prefix` the tokens all sequences start with come once, first (`prefix_to_share`). Returns tensors
    input_ids (N,), positions (N,) (RoPE positions within each sequence), lengths (B,), select
    (M,): the packed index of every position whose next token is learned (a shared position may
    appear once per sequence), targets (M,): those tokens; `shared`: the shared prefix length;
    `groups`: the attention layout, per group of `attention_groups` (rows, width, source
    (the packed tokens of its rows, in row order; None when that is every packed token), slot
    (their places in a (rows, width) layout), take (the places of the packed tokens this group's
    output provides, in packed order)).
    """
    rows = sorted(((e.prompt_ids + e.completion_ids,
                    [0] * len(e.prompt_ids) + list(e.completion_mask or [1] * len(e.completion_ids)))
                   for e in examples), key=lambda r: len(r[0]))
    k = prefix_to_share([seq for seq, _ in rows]) if share_prefix else 0
    ids, positions, starts = list(rows[0][0][:k]), list(range(k)), []
    for seq, _ in rows:  # each sequence's own tokens, after the shared prefix
        starts.append(len(ids) - k)  # packed index of (sequence, position p >= k) = start + p
        ids.extend(seq[k:])
        positions.extend(range(k, len(seq)))
    where = lambda i, p: p if p < k else starts[i] + p  # noqa: E731
    select, targets = [], []
    for i, (seq, learned) in enumerate(rows):
        for t in range(1, len(seq)):
            if learned[t]:
                select.append(where(i, t - 1))
                targets.append(seq[t])
    as_long = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    groups = []
    for members in attention_groups([len(seq) for seq, _ in rows]):
        first, lengths = members[0], [len(rows[i][0]) for i in members]
        width = max(lengths)
        slot = as_long([r * width + p for r, n in enumerate(lengths) for p in range(n)])
        if k == 0:  # the group's tokens are one contiguous run of the packed row, in row order
            whole = len(members) == len(rows)  # then no slice (its backward would zero-fill a full-size gradient)
            source, take = None if whole else slice(starts[first], starts[members[-1]] + lengths[-1]), slot
        else:
            source = as_long([where(i, p) for i in members for p in range(len(rows[i][0]))])
            take = as_long(list(range(k)) * (first == 0)  # the prefix's output from the first row
                           + [r * width + p for r, n in enumerate(lengths) for p in range(k, n)])
        groups.append((len(lengths), width, source, slot, take))
    return {"input_ids": as_long(ids), "positions": as_long(positions),
            "lengths": as_long([len(seq) for seq, _ in rows]), "select": as_long(select),
            "targets": as_long(targets), "shared": k, "groups": groups}


def packable(fast: FastDecoder | None) -> bool:
    """The packed path covers full causal attention without score soft-capping (every window None)."""
    return fast is not None and all(w is None for w in fast.arch.windows) and fast.arch.attn_softcap is None


def packed_logits(fast: FastDecoder, batch: dict) -> torch.Tensor:
    """Logits (M, V) at `batch["select"]` with the live weights (autograd records them)."""
    device = fast.model.model.embed_tokens.weight.device
    ids, positions, lengths, select = (batch[k].to(device) for k in ("input_ids", "positions", "lengths", "select"))
    to = lambda t: t if t is None or isinstance(t, slice) else t.to(device)  # noqa: E731
    groups = [(rows, width, to(source), to(slot), to(take)) for rows, width, source, slot, take in batch["groups"]]
    d, heads = fast.head_dim, fast.num_heads
    x = fast._embed(ids, fast.model.model.embed_tokens.weight)  # (N, hidden)
    cs = fast._rope_tables(positions, device, size=int(lengths.max())).to(x.dtype)  # (N, 2, D)
    layers = fast._live_layers()
    for i, layer in enumerate(layers):
        h = fast._norm(x, layer.ln1)
        q, k, v = (linear(h, w, b).view(len(ids), -1, d) for w, b in zip(layer.qkv_w, layer.qkv_b))
        q, k = fast._qk(torch.cat([q, k], dim=1), layer, cs).split([heads, fast.num_kv], dim=1)
        attn = _cat_once([_group_attention(fast, q, k, v, g) for g in groups])  # (N, H·D)
        if i == len(layers) - 1:  # last layer: only the positions with a loss go on
            x, attn = x[select], attn[select]
        x = fast._residual(x, linear(attn, layer.o_w, layer.o_b), layer.post_attn)
        h = fast._norm(x, layer.ln2)
        gate, up = (linear(h, w) for w in layer.gu_w)
        x = fast._residual(x, linear(activate(gate, fast.arch.act) * up, layer.down_w), layer.post_ffn)
    x = fast._norm(x, (fast.model.model.norm.weight, fast.final_eps))
    return softcap(linear(x, fast.model.get_output_embeddings().weight), fast.arch.final_softcap)


def _group_attention(fast: FastDecoder, q, k, v, group) -> torch.Tensor:
    """Causal attention of one group's rows (q (N, H, D), k/v (N, H_kv, D) packed) -> (n, H·D) for the packed
    tokens the group provides, in packed order."""
    rows, width, source, slot, take = group
    padded = [t.new_zeros(rows * width, t.shape[1], t.shape[2]).index_copy(0, slot, t if source is None else t[source])
              .view(rows, width, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v)]  # (b, H, T, D)
    out = F.scaled_dot_product_attention(*padded, is_causal=True, scale=fast.scaling,
                                         enable_gqa=fast.num_heads != fast.num_kv)
    return out.transpose(1, 2).reshape(rows * width, -1).index_select(0, take)


def _cat_once(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat, without its copy (and its backward) when there is one part."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def packed_loss(model, batch: dict, fast: FastDecoder | None = None) -> torch.Tensor:
    """Mean cross-entropy over the learned tokens of a `pack`ed batch (`model` must take the lean forward)."""
    fast = fast or FastDecoder.for_model(model)
    if not packable(fast):
        raise ValueError(f"packed_loss: {type(model).__name__} has no lean forward; use the padded sft_loss")
    if len(batch["targets"]) == 0:
        return model.model.embed_tokens.weight.sum() * 0.0
    logits = packed_logits(fast, batch).float()  # (M, V)
    return F.cross_entropy(logits, batch["targets"].to(logits.device))
