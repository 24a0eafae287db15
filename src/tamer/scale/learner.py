"""The learner strategy: one process, DDP or FSDP2 ranks, behind one small interface.

The trainer never branches on the strategy; it asks its `Learner` for

* `wrap(model, make_forward)` -> `Wrapped`: the module the loss runs through (DDP around the
  logprob forward; FSDP2 around a sharded copy of the model) and the module whose parameters
  the optimizer steps;
* `local(mini)`: this rank's row shard of a mini-batch (every rank takes a contiguous slice);
* `all_reduce_sum`: loss denominators and metrics summed over ranks, so that N ranks take
  exactly the step one rank takes on the whole mini-batch, whatever each rank's token count;
* `pad_micro_batches`: every rank runs the same number of forward/backward passes (FSDP2
  all-gathers in every forward; a rank with fewer micro-batches runs zero-weight ones);
* `grad_scale`: DDP and FSDP2 average gradients over ranks; the loss is multiplied by the
  world size to turn that average back into the sum the global denominator expects;
* `publish(wrapped, model)`: after an update, the full weights back into the plain model the
  sampler, evaluation and checkpoints read (FSDP2 only; DDP shares the parameters);
* `checkpoint_optimizer` / `load_module_state`: full (unsharded) state dicts for checkpoints,
  written by rank 0 (`torch.distributed.checkpoint.state_dict`).

`Learner()` is the single-process strategy: every call is the identity, so today's loop runs
bit for bit. `DistributedLearner` needs `torch.distributed` initialised (torchrun sets the
environment; `init_distributed` joins). Formulas: docs/scaling.md#distributed-learner.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tamer.stopping import stop_requested
from tamer.trainers.batch import Batch


@dataclass
class Wrapped:
    """What a strategy made of a model: the module the loss calls and the one the optimizer steps."""

    forward: nn.Module  # called with a micro-batch; DDP's wrapper, or the forward module itself
    module: nn.Module  # the parameters the optimizer owns (under fsdp2: a sharded copy)


class Learner:
    """One process: the identity everywhere (the default; today's loop bit for bit)."""

    strategy = "single"
    rank = 0
    world = 1
    grad_scale = 1.0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wrap(self, model: nn.Module, make_forward: Callable[[nn.Module], nn.Module]) -> Wrapped:
        forward = make_forward(model)
        return Wrapped(forward, model)

    def local(self, mini: Batch) -> Batch:
        """This rank's rows of `mini` (a rank without rows gets one row of zero weight)."""
        return mini

    def all_reduce_sum(self, value: float) -> float:
        return value

    def all_reduce_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return sums

    def pad_micro_batches(self, micros: list[Batch], spare: Batch) -> list[Batch]:
        """`micros`, padded on every rank to the largest count with zero-weight rows of `spare`."""
        return micros

    def accumulate(self, wrapped: Wrapped, last: bool):
        """Context for one micro-batch's backward: gradient sync only on the last (DDP)."""
        return contextlib.nullcontext()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (pickled)."""
        return obj

    def publish(self, wrapped: Wrapped, model: nn.Module) -> None:
        """Copy the learner's weights into `model` (the sampler's, evaluation's, checkpoints')."""

    def checkpoint_optimizer(self, wrapped: Wrapped, optimizer: torch.optim.Optimizer, gather: bool = True) -> Any:
        """`optimizer`, or under FSDP2 a stand-in whose `state_dict()` is the full state (gathered now,
        collectively, unless `gather=False`) and whose `load_state_dict` shards a full state back."""
        return optimizer

    def module_state(self, wrapped: Wrapped) -> dict:
        """The full state dict of the learner's module (collective under FSDP2; complete on rank 0)."""
        return wrapped.module.state_dict()

    def load_module_state(self, wrapped: Wrapped, state: dict) -> None:
        """Load a full state dict into the learner's module (collective under FSDP2)."""
        wrapped.module.load_state_dict(state)

    def barrier(self) -> None:
        pass

    def should_stop(self) -> bool:
        """Whether to checkpoint and stop after this step (a stop signal; under torchrun rank 0 decides)."""
        return stop_requested()


class _FixedOptimizerState:
    """A full optimizer state gathered on every rank at once, for `save_checkpoint` on rank 0;
    loading sets the full state into the sharded optimizer (every rank reads the checkpoint)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, state: dict | None) -> None:
        self.module, self.optimizer, self.state = module, optimizer, state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.module, self.optimizer, state, options=StateDictOptions(full_state_dict=True))


class DistributedLearner(Learner):
    """DDP or FSDP2 over the initialised default process group; every rank runs the same loop."""

    def __init__(self, strategy: str) -> None:
        if strategy not in ("ddp", "fsdp2"):
            raise ValueError(f"strategy: expected ddp or fsdp2, got {strategy!r}")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; launch the ranks with torchrun")
        self.strategy = strategy
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.grad_scale = float(self.world)  # both average gradients over ranks; we want their sum
        self.device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
            else torch.device("cpu")

    # ------------------------------------------------------------------ wrapping
    def wrap(self, model: nn.Module, make_forward: Callable[[nn.Module], nn.Module]) -> Wrapped:
        if self.strategy == "ddp":
            forward = make_forward(model)  # DDP broadcasts rank 0's parameters and buffers here
            ids = [self.device.index] if self.device.type == "cuda" else None
            return Wrapped(nn.parallel.DistributedDataParallel(forward, device_ids=ids), model)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        sharded = copy.deepcopy(model)  # `model` stays whole: the sampler and checkpoints read it
        for p in sharded.parameters():
            dist.broadcast(p.data, src=0)  # fully_shard slices what each rank has: make it rank 0's
        mesh = init_device_mesh(self.device.type, (self.world,))
        for layer in _decoder_layers(sharded):
            fully_shard(layer, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        return Wrapped(make_forward(sharded), sharded)

    def local(self, mini: Batch) -> Batch:
        rows = torch.arange(len(mini)).tensor_split(self.world)[self.rank]
        return mini.select(rows) if len(rows) else zero_weight(mini.select([0]))

    # ------------------------------------------------------------------ collectives
    def all_reduce_sum(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t.item())

    def all_reduce_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        keys = sorted(sums)
        t = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist()))

    def pad_micro_batches(self, micros: list[Batch], spare: Batch) -> list[Batch]:
        count = torch.tensor([len(micros)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return micros + [zero_weight(spare.select([0]))] * (int(count.item()) - len(micros))

    def accumulate(self, wrapped: Wrapped, last: bool):
        if self.strategy == "ddp" and not last:
            return wrapped.forward.no_sync()
        return contextlib.nullcontext()

    def broadcast(self, obj: Any) -> Any:
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()

    def should_stop(self) -> bool:
        from tamer.scale.launch import stop_file_requested

        return bool(self.broadcast(stop_requested() or stop_file_requested() if self.is_main else None))

    # ------------------------------------------------------------------ weights and checkpoints
    def publish(self, wrapped: Wrapped, model: nn.Module) -> None:
        if self.strategy != "fsdp2":
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(wrapped.module, options=StateDictOptions(full_state_dict=True))
        with torch.no_grad():
            model.load_state_dict(state, strict=False)  # tied copies (lm_head) may be left out

    def checkpoint_optimizer(self, wrapped: Wrapped, optimizer: torch.optim.Optimizer, gather: bool = True) -> Any:
        if self.strategy != "fsdp2":
            return optimizer  # DDP: every rank's optimizer state is the same
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        state = get_optimizer_state_dict(wrapped.module, optimizer, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True)) if gather else None
        return _FixedOptimizerState(wrapped.module, optimizer, state)

    def module_state(self, wrapped: Wrapped) -> dict:
        if self.strategy != "fsdp2":
            return wrapped.module.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(wrapped.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_module_state(self, wrapped: Wrapped, state: dict) -> None:
        if self.strategy != "fsdp2":
            wrapped.module.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(wrapped.module, state, options=StateDictOptions(full_state_dict=True))


def zero_weight(batch: Batch) -> Batch:
    """`batch` with an all-zero loss mask: its forward and backward run, its loss and gradient are 0."""
    batch.loss_mask = torch.zeros_like(batch.loss_mask)
    return batch


class CallModule(nn.Module):
    """`fn(model, *args)` as a module's forward, so DDP's hooks see the loss's forward whatever
    `fn` runs inside (the trainer's logprob forward, lean or HF)."""

    def __init__(self, model: nn.Module, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, *args: Any) -> torch.Tensor:
        return self.fn(self.model, *args)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 shards one by one (HF causal LMs and the critic's trunk)."""
    for path in ("model.layers", "layers", "trunk.layers", "transformer.h", "gpt_neox.layers"):
        node: Any = model
        for part in path.split("."):
            node = getattr(node, part, None)
        if isinstance(node, nn.ModuleList):
            return list(node)
    return []


def init_distributed(backend: str = "auto", timeout_s: float = 1800.0) -> None:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR in the environment)."""
    if dist.is_initialized():
        return
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def make_learner(strategy: str) -> Learner:
    """The learner for a resolved strategy name (`ScaleConfig.strategy`)."""
    return Learner() if strategy == "single" else DistributedLearner(strategy)
