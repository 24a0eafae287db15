"""How a forward pass runs: precision (fp32 or bf16 autocast), intra-op threads, the KV-cache keyword.

Shared by the sampler (`tamer.rollout.engine`) and the learner (`tamer.models.logprobs`), so
neither imports the other.

    with autocast("bf16"):                  # matmuls in bf16, fp32 weights (TRL's bf16=True on CPU)
        logits = model(input_ids).logits.float()
    with intra_op_threads(1): ...           # torch's thread count inside the block only
    model(..., **{cache_keyword(model): cache})
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from transformers import PreTrainedModel

PRECISIONS = ("fp32", "bf16")


def autocast(precision: str, device: torch.device | str = "cpu") -> contextlib.AbstractContextManager:
    """The context a forward pass runs in: nothing for fp32, bf16 autocast (fp32 weights) for bf16.

    This is mixed precision as `accelerate`/TRL's `bf16=True` does it: matmuls in bf16, weights,
    optimizer state and reductions in fp32. Callers take logprobs from `logits.float()`.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


@contextlib.contextmanager
def intra_op_threads(n: int):
    """torch's intra-op thread count set to `n` inside the block (0: unchanged), then restored."""
    previous = torch.get_num_threads()
    if n <= 0 or n == previous:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def cache_keyword(model: PreTrainedModel) -> str:
    """The forward() argument that takes a KV cache: `cache` in newer transformers."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model passes it through
    params = inspect.signature(inner.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
