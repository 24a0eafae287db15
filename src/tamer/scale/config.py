"""The `scale:` section of a run: rollout workers on Ray, learner ranks under torchrun.

    scale:
      rollout_workers: 2        # Ray actors that generate and step environments
      learner_ranks: 2          # torch.distributed ranks (torchrun), DDP by default
      learner_strategy: fsdp2   # or shard parameters, gradients and optimizer state
      ray_address: auto         # join a running cluster instead of starting a local Ray

The defaults are one process with no Ray; docs/scaling.md explains every field.
"""

from __future__ import annotations

from dataclasses import dataclass

from tamer.config import FieldError, check_name

LEARNER_STRATEGIES = ("auto", "single", "ddp", "fsdp2")
DIST_BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class ScaleConfig:
    """Where rollouts and the learner run; the defaults are one process."""

    rollout_workers: int = 0  # Ray actors generating and stepping environments; 0: in the trainer's process
    learner_ranks: int = 1  # torch.distributed learner ranks started with torchrun; 1: one process
    learner_strategy: str = "auto"  # auto (ddp when learner_ranks > 1) | single | ddp | fsdp2
    dist_backend: str = "auto"  # torch.distributed backend: auto (nccl with CUDA, else gloo) | gloo | nccl
    ray_address: str = ""  # "": start a local Ray instance; "auto" or host:port: join that cluster
    ray_cpus: int = 0  # CPUs a local Ray instance advertises; 0: rollout_workers x worker_cpus
    object_store_mb: int = 256  # object store of a local Ray instance (weights pass through it)
    worker_cpus: float = 1.0  # Ray CPUs each rollout actor reserves
    worker_gpus: float = 0.0  # Ray GPUs each rollout actor reserves (GPU placement: e.g. 1 or 0.5)
    worker_threads: int = 1  # torch intra-op threads inside each rollout actor (Ray sets 1 otherwise)
    rollout_timeout_s: float = 600.0  # a shard not back within this is lost: its actor is replaced, its groups re-run
    max_actor_restarts: int = 3  # replacements per rollout call before the run stops with an error

    def __post_init__(self) -> None:
        for name in ("rollout_workers", "ray_cpus", "object_store_mb", "max_actor_restarts"):
            if getattr(self, name) < 0:
                raise FieldError(name, f"expected >= 0, got {getattr(self, name)}")
        for name in ("learner_ranks", "worker_threads"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"expected >= 1, got {getattr(self, name)}")
        check_name("learner_strategy", self.learner_strategy, LEARNER_STRATEGIES, "learner strategy")
        check_name("dist_backend", self.dist_backend, DIST_BACKENDS, "torch.distributed backend")
        if self.learner_strategy == "single" and self.learner_ranks > 1:
            raise FieldError("learner_strategy", "single runs one learner process; use ddp or fsdp2 with "
                                                 f"learner_ranks = {self.learner_ranks}")
        if self.worker_cpus <= 0:
            raise FieldError("worker_cpus", f"expected > 0, got {self.worker_cpus}")
        if self.worker_gpus < 0:
            raise FieldError("worker_gpus", f"expected >= 0, got {self.worker_gpus}")
        if self.rollout_timeout_s <= 0:
            raise FieldError("rollout_timeout_s", f"expected > 0 seconds, got {self.rollout_timeout_s}")
        if self.object_store_mb and self.object_store_mb < 80:
            raise FieldError("object_store_mb",
                             f"Ray needs at least 80 MB (0: Ray's default), got {self.object_store_mb}")

    @property
    def strategy(self) -> str:
        """The learner strategy in force: `auto` resolved."""
        if self.learner_strategy != "auto":
            return self.learner_strategy
        return "ddp" if self.learner_ranks > 1 else "single"

    @property
    def distributed(self) -> bool:
        """Whether the learner runs as torch.distributed ranks (launched with torchrun)."""
        return self.strategy != "single"
