"""The learner reuses the sampler's projection outputs instead of recomputing them.

    record = DecodeRecord.for_decode(fast, rows, steps)     # the engine, before its decode loop
    fast.decode(tokens, positions, cache, key_mask, record=record)   # writes column `record.step`
    rows = Replay([record], index)                           # per batch row: (record, row in it)
    fast.forward(ids, mask, positions, past=past, replay=rows.gather(width))   # the learner

On-policy with one optimizer step per batch (μ = 1, one mini-batch), the learner's forward over
the completions runs the very weights the sampler just ran over the very same tokens: every
projection (q/k/v, output, gate/up, down, the head) would recompute, in another summation order,
the product the decode step already computed. `DecodeRecord` keeps those products, one column
per decode step, and `replayed` puts them in the learner's graph: its forward returns the
recorded output, its backward is the linear layer's (dx = g W, dW = gᵀ x, db = Σ g) with the
learner's own recomputed input x. Everything between the projections (norms, RoPE, attention,
the gated activation, residual adds) is recomputed by the learner as usual, so the gradient is
the one of the recomputed forward up to float rounding (docs/algorithms.md#replayed-projections).

The trainer decides when this is valid (tamer.trainers.rl: on-policy, in-process sampler on the
learner's own module, no weight change in between); `FastDecoder.forward` also checks that the
record came from the model it runs.
"""

from __future__ import annotations

import torch

KINDS = ("qkv", "o", "gu", "down")  # per layer, in the decode step's order; then the head's logits


class replayed(torch.autograd.Function):  # noqa: N801 - used like a function: replayed.apply(x, w, b, y)
    """`F.linear(x, weight, bias)` whose value `y` is already known: forward returns `y`, backward is
    the linear layer's (gradients for x, weight and bias; none for y)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return y.view_as(y)  # a view: autograd attaches its history to the view, not to the record

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = torch.mm(g, weight).view(x.shape)
        if ctx.needs_input_grad[1]:
            gw = torch.mm(g.t(), x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.sum(0)
        return gx, gw, gb, None


class DecodeRecord:
    """One generate chunk's projection outputs: per layer `KINDS` as (steps, rows, width) and the head's
    logits (before soft-capping); step k is written by the k-th decode step (the k-th completion token
    fed), each projection straight into its slot (`at`: contiguous, the matmul's `out`)."""

    def __init__(self, model, layers: list[dict[str, torch.Tensor]], logits: torch.Tensor) -> None:
        self.model, self.layers, self.logits = model, layers, logits
        self.step = 0
        self.used = False  # set when a learner forward has taken outputs from it
        self.gu_transposed: set[int] = set()  # layers whose gate/up went in as (2I, rows) per step (`gu_at`)

    @staticmethod
    def widths(fast) -> dict[str, int]:
        heads, kv, d = fast.num_heads, fast.num_kv, fast.head_dim
        inner = fast.model.model
        hidden, inter = inner.embed_tokens.weight.shape[1], inner.layers[0].mlp.down_proj.weight.shape[1]
        return {"qkv": (heads + 2 * kv) * d, "o": hidden, "gu": 2 * inter, "down": hidden}

    @classmethod
    def nbytes(cls, fast, rows: int, steps: int) -> int:
        per_token = sum(cls.widths(fast).values()) * len(fast.model.model.layers) + fast.model.config.vocab_size
        return rows * steps * per_token * 4

    @classmethod
    def for_decode(cls, fast, rows: int, steps: int, device: torch.device | str = "cpu") -> DecodeRecord:
        """Float32 buffers for `rows` sequences of up to `steps` fed tokens (normal tensors, so the learner
        can put them in its graph although the engine writes them under inference mode)."""
        with torch.inference_mode(False):
            new = lambda width: torch.empty(steps, rows, width, device=device)  # noqa: E731
            layers = [{kind: new(width) for kind, width in cls.widths(fast).items()} for _ in fast.model.model.layers]
            logits = new(fast.model.get_output_embeddings().weight.shape[0])
        return cls(fast.model, layers, logits)

    def at(self, layer: int, kind: str) -> torch.Tensor:
        """The current decode step's (rows, width) slot of `kind` ("logits": the head's, `layer` ignored)."""
        return (self.logits if kind == "logits" else self.layers[layer][kind])[self.step]

    def gu_at(self, layer: int) -> torch.Tensor:
        """The current step's gate/up slot laid out (2I, rows), for a decode that computes W_gu @ h.T."""
        self.gu_transposed.add(layer)
        slot = self.layers[layer]["gu"][self.step]
        return slot.view(slot.shape[1], slot.shape[0])

    def rows(self, layer: int, kind: str, width: int, rows: torch.Tensor | None) -> torch.Tensor:
        """Layer `layer`'s `kind` ("logits": the head's) over the first `width` steps as (rows, width, ·): a
        strided view when `rows` is None (all, in order), else those rows gathered along the record's
        own row dimension (the fast, contiguous gather)."""
        buf = self.logits if kind == "logits" else self.layers[layer][kind]
        if kind == "gu" and layer in self.gu_transposed:  # written (steps, 2I, rows): copied row-major, as
            steps, count, inter2 = buf.shape  # element-wise work on a view with the rows innermost is slow
            out = buf.view(steps, inter2, count)[:width].permute(2, 0, 1)
            return out.contiguous() if rows is None else out.index_select(0, rows)
        out = buf[:width]
        return (out if rows is None else out.index_select(1, rows)).transpose(0, 1)

    def finish(self) -> None:
        """Zero the steps no decode step wrote (the last sampled token is never fed): finite values where
        the learner's masked positions read them."""
        for buffers in (*self.layers, {"logits": self.logits}):
            for buf in buffers.values():
                buf[self.step:].zero_()


class Replay:
    """A batch's rows of one or more `DecodeRecord`s: `index` (B, 2) = (record number, row in it) per row.

    `Replay[index]` selects rows (as `Batch.select` does for tensors); `gather(width)` lays the rows'
    first `width` columns out as the learner's completion forward reads them."""

    def __init__(self, records: list[DecodeRecord], index: torch.Tensor) -> None:
        self.records, self.index = records, index

    def __getitem__(self, rows) -> Replay:
        return Replay(self.records, self.index[torch.as_tensor(rows, dtype=torch.long)])

    def __len__(self) -> int:
        return len(self.index)

    @property
    def model(self):
        return self.records[0].model

    def fits(self, width: int) -> bool:
        return all(width <= r.logits.shape[0] for r in self.records)

    def order(self) -> torch.Tensor:
        """The permutation that sorts these rows by (record, row): `gather` is copy-free when they are one
        record's rows, all of them, in that order (the learner puts its micro-batch in this order)."""
        return torch.argsort(self.index[:, 0] * (int(self.index[:, 1].max()) + 1) + self.index[:, 1])

    def gather(self, width: int) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
        """(per layer {kind: (B, width, ·)}, logits (B, width, V)) in this object's row order: strided views
        of the record when the rows are all of one record's in order, else gathered copies."""
        for record in self.records:
            record.used = True

        def take(layer: int, kind: str) -> torch.Tensor:
            parts = []
            for number, record in enumerate(self.records):
                rows = self.index[:, 1][self.index[:, 0] == number]
                whole = len(self.records) == 1 and len(rows) == record.logits.shape[1] and bool(
                    (rows == torch.arange(len(rows))).all())
                parts.append(record.rows(layer, kind, width, None if whole else rows.to(record.logits.device)))
            if len(parts) == 1:
                return parts[0]
            out = torch.cat(parts)  # rows grouped by record: put them back in batch order
            order = torch.cat([(self.index[:, 0] == n).nonzero().squeeze(1) for n in range(len(self.records))])
            return out.index_select(0, torch.argsort(order).to(out.device))
        layers = [{kind: take(i, kind) for kind in KINDS} for i in range(len(self.records[0].layers))]
        return layers, take(0, "logits")

    @classmethod
    def of(cls, refs: list) -> Replay | None:
        """From per-row `(record, row)` references (`GenerationOutput.activations`); None if any row has none."""
        if not refs or any(ref is None for ref in refs):
            return None
        records: list[DecodeRecord] = []
        numbers = {}
        index = []
        for record, row in refs:
            if id(record) not in numbers:
                numbers[id(record)] = len(records)
                records.append(record)
            index.append((numbers[id(record)], row))
        return cls(records, torch.tensor(index, dtype=torch.long))
