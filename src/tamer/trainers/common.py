"""Pieces both trainers share: padding, seeding, the optimizer and its LR schedule."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import torch

from tamer.config import FieldError, check_name

LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with warmup and a decay schedule."""

    lr: float = 1e-4  # peak learning rate (after warmup)
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW's moment decay rates
    warmup_steps: int = 0  # optimizer steps of linear warmup from lr/warmup_steps to lr
    schedule: str = "constant"  # constant | linear | cosine (after warmup)
    min_lr_ratio: float = 0.1  # floor of linear/cosine decay, as a fraction of lr
    max_grad_norm: float = 1.0  # clip the global gradient norm to this; 0 disables clipping

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise FieldError("lr", f"expected > 0, got {self.lr}")
        check_name("schedule", self.schedule, LR_SCHEDULES, "schedule")
        if self.warmup_steps < 0:
            raise FieldError("warmup_steps", f"expected >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise FieldError("min_lr_ratio", f"expected a fraction in [0, 1], got {self.min_lr_ratio}")
        if self.max_grad_norm < 0:
            raise FieldError("max_grad_norm", f"expected >= 0 (0 disables clipping), got {self.max_grad_norm}")


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
