"""The HF forward's decode steps on packed weights: the lean decode's packing for every other model.

    with packed_linears(model, rows):     # the HF engine's decode loop
        logits = model(input_ids=tokens[:, None], ...)

`FastDecoder` packs its float32 weights once per `generate` for decode's row count where that is
faster (`fast_forward.MKL_PACKED` on Intel CPUs, `ONEDNN_PACKED` on AMD ones; docs/performance.md
item 17 and the MKL packing before it). Models it does not cover (LoRA adapters, other
architectures) decode with the HF forward; `packed_linears` gives their `nn.Linear` layers the
same packing for the decode loop only: each trained float32 CPU `nn.Linear` of at least
`fast_forward.PACK_MIN_WEIGHTS` weights is packed on entry and runs `fast_forward.dense` on its
pack for inputs of `rows` rows without autograd (any other input takes `F.linear`); on exit the
packs are dropped and the layers are plain again, so the prefill, the learner and saved
checkpoints never see them. Frozen weights (`requires_grad` off: a LoRA model's base layers) are
not packed: a trained weight's pack takes memory its gradient of the step before freed (the same
size, kept by the allocator), so it adds nothing to the step's peak, where a frozen weight's
would add its full size to the sampler's (measured on the Qwen2.5-0.5B shape with LoRA: peak RSS
4,572 MB packed against the plan's 3,241; tests/test_real_shapes.py). Nothing is packed under
autocast, where packing does not apply, or when the machine has less memory available than twice
the packs' size.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from tamer.models import fast_forward as ff


def packable_linear(module: nn.Module) -> bool:
    """Whether `packed_linears` packs `module` (where packing is on): a trained float32 CPU `nn.Linear` of
    at least `fast_forward.PACK_MIN_WEIGHTS` weights whose forward is its class's own."""
    weight = getattr(module, "weight", None)
    return (type(module) is nn.Linear and "forward" not in module.__dict__ and weight.requires_grad
            and weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.numel() >= ff.PACK_MIN_WEIGHTS)


class _PackedForward:
    """`nn.Linear.forward` of `module` on `pack` for inputs of `rows` rows (one token per row)."""

    def __init__(self, module: nn.Linear, pack: ff.Pack, rows: int) -> None:
        self.module, self.pack, self.rows = module, pack, rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        if (x.numel() != self.rows * m.in_features or x.dtype != torch.float32 or torch.is_grad_enabled()
                or torch.is_autocast_enabled("cpu")):  # not a decode step's input: as without packing
            return F.linear(x, m.weight, m.bias)
        y = ff.dense(x.reshape(self.rows, m.in_features).contiguous(), m.weight, m.bias, self.pack)
        return y.view(*x.shape[:-1], m.out_features)


@contextmanager
def packed_linears(model: nn.Module, rows: int) -> Iterator[int]:
    """Within the block, `model`'s packable `nn.Linear` layers run on weights packed for `rows` rows;
    yields how many were packed (0 where packing does not apply)."""
    layers = [m for m in model.modules() if packable_linear(m)] if ff.packing() else []
    if layers and not ff.room_for_packs(sum(m.weight.numel() for m in layers) * 4 / 2**20):
        layers = []
    for m in layers:
        m.forward = _PackedForward(m, ff.pack_weight(m.weight, rows), rows)
    try:
        yield len(layers)
    finally:
        for m in layers:
            del m.forward
