"""Rollouts on Ray actors, with the interface of `tamer.rollout.runner.Rollout`.

    rollout = RayRollout(spec, workers=2)                 # starts 2 actors (ray.init first)
    rollout.sync_weights(model, version=step)             # one ray.put per version, pushed to every actor
    trajectories = rollout.run(tasks, params, group_offset)   # the same list Rollout.run returns

Whole groups are sharded over the actors (contiguous slices of `tasks`, so results come back in
group order); each actor holds its own tokenizer, environments and generation engine (an
`HFEngine` on a copy of the model, or what `WorkerSpec.engine_factory` builds: the vLLM engine
plugs in there, built inside the actor so its process and GPU are the actor's). Actors always
seed per trajectory (`Rollout(seeding="trajectory")`): trajectory k of group g draws the same
tokens whichever actor runs it, so N actors return what one process with
`rl.sampling_seed: trajectory` returns.

Weights: `sync_weights` puts the state dict in the object store once per version and every
actor loads it (`set_weights`) before its next shard. Inside an actor, one turn's environment
steps run concurrently (`agent.env_threads`) and torch uses `worker_threads` intra-op threads
(Ray would otherwise leave it at 1 thread: OMP_NUM_THREADS = num_cpus).

Faults: a shard not back within `timeout_s`, or whose actor died, is detected; the actor is
killed and replaced (it gets the current weights) and the shard re-run, up to `max_restarts`
per call. `metrics()` counts them (`scale/actor_restarts`, `scale/groups_rerun`).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tamer.errors import RunError
from tamer.rollout.agent import AgentConfig
from tamer.rollout.types import SamplingParams, Trajectory
from tamer.tasks.base import Task


class RolloutWorkerError(RunError):
    """Rollout actors kept failing (more restarts than allowed in one call)."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a rollout actor builds: the model's architecture (weights arrive per version), tokenizer, agent."""

    model_config: Any  # the transformers config of the policy
    tokenizer: Any  # a (picklable) tokenizer
    dtype: str = "float32"  # parameter dtype of the actor's model copy
    agent: AgentConfig = field(default_factory=AgentConfig)
    max_batch: int = 256  # HFEngine: sequences generated at once
    precision: str = "fp32"  # HFEngine: fp32 | bf16 autocast
    engine_threads: int = 0  # HFEngine: intra-op threads while generating (0: the actor's)
    torch_threads: int = 1  # torch.set_num_threads in the actor
    plugins: tuple[str, ...] = ()  # modules imported in the actor first (user environments, rewards)
    sys_path: tuple[str, ...] = ()  # the driver's import path, so the same modules import
    # engine_factory(model, tokenizer) -> GenerationEngine, called inside the actor; None: HFEngine.
    engine_factory: Callable[[Any, Any], Any] | None = None


class RolloutWorker:
    """One actor's state: a model copy, an engine and a `Rollout` (run as a Ray actor by `RayRollout`)."""

    def __init__(self, spec: WorkerSpec) -> None:
        sys.path[:0] = [p for p in spec.sys_path if p not in sys.path]
        torch.set_num_threads(spec.torch_threads)
        from transformers import AutoModelForCausalLM

        from tamer.config import import_plugins
        from tamer.rollout.engine import HFEngine
        from tamer.rollout.runner import Rollout

        import_plugins(spec.plugins)
        with torch.device("cpu"):
            self.model = AutoModelForCausalLM.from_config(spec.model_config, dtype=getattr(torch, spec.dtype)).eval()
        if spec.engine_factory is not None:
            engine = spec.engine_factory(self.model, spec.tokenizer)
        else:
            engine = HFEngine(self.model, spec.tokenizer.pad_token_id, max_batch=spec.max_batch,
                              precision=spec.precision, threads=spec.engine_threads)
        self.rollout = Rollout(engine, spec.tokenizer, spec.agent, seeding="trajectory")
        self.version = -1

    def set_weights(self, version: int, state: dict[str, torch.Tensor]) -> int:
        with torch.no_grad():
            self.model.load_state_dict(state, strict=False)  # tied copies may be absent
        self.rollout.sync_weights(self.model, version)
        self.version = version
        return version

    def run(self, tasks: list[Task], params: SamplingParams, group_offset: int) -> tuple[int, list[Trajectory]]:
        """The shard's trajectories and the weight version that sampled them."""
        return self.version, self.rollout.run(tasks, params, group_offset)

    def pid(self) -> int:
        import os

        return os.getpid()


def start_ray(address: str = "", num_cpus: int = 0, object_store_mb: int = 256) -> bool:
    """Join a running cluster (`address`) or start a local instance; True if this call started it."""
    try:
        import ray
    except ImportError as err:
        raise RunError('scale.rollout_workers needs Ray: pip install "tamer[scale]"') from err

    if ray.is_initialized():
        return False
    common = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
    if address:
        ray.init(address=address, **common)
        return False
    ray.init(num_cpus=num_cpus or None, object_store_memory=object_store_mb * 2**20 if object_store_mb else None,
             **common)
    return True


class RayRollout:
    """`Rollout.run` over N Ray actors (see the module docstring)."""

    engine = None  # no engine in this process (evaluation chunks follow the tasks)

    def __init__(self, spec: WorkerSpec, workers: int, *, cpus: float = 1.0, gpus: float = 0.0,
                 timeout_s: float = 600.0, max_restarts: int = 3, owns_ray: bool = False) -> None:
        import ray

        if workers < 1:
            raise ValueError(f"workers: expected >= 1, got {workers}")
        self.spec, self.timeout_s, self.max_restarts, self.owns_ray = spec, timeout_s, max_restarts, owns_ray
        self._actor_cls = ray.remote(num_cpus=cpus, num_gpus=gpus, max_restarts=0)(RolloutWorker)
        self.actors = [self._actor_cls.remote(spec) for _ in range(workers)]
        self.version, self._weights = -1, None
        self._counts = {"scale/actor_restarts": 0.0, "scale/groups_rerun": 0.0}

    @classmethod
    def from_run(cls, config, model, tokenizer) -> RayRollout:
        """Start (or join) Ray and the actors a run's config asks for (`config.scale`)."""
        scale = config.scale
        owns = start_ray(scale.ray_address, scale.ray_cpus or math.ceil(scale.rollout_workers * scale.worker_cpus),
                         scale.object_store_mb)
        spec = WorkerSpec(model.config, tokenizer, dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
                          agent=config.agent, max_batch=config.rl.generation_batch, precision=config.rl.precision,
                          engine_threads=config.rl.rollout_threads, torch_threads=scale.worker_threads,
                          plugins=tuple(config.plugins), sys_path=tuple(p for p in sys.path if p))
        return cls(spec, scale.rollout_workers, cpus=scale.worker_cpus, gpus=scale.worker_gpus,
                   timeout_s=scale.rollout_timeout_s, max_restarts=scale.max_actor_restarts, owns_ray=owns)

    # ------------------------------------------------------------------ weights
    def sync_weights(self, model: torch.nn.Module, version: int = 0) -> None:
        """Push `model`'s weights to every actor, once per `version`."""
        import ray

        if version == self.version and self._weights is not None:
            return
        state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        self._weights = ray.put(state)
        self.version = version
        ray.get([a.set_weights.remote(version, self._weights) for a in self.actors], timeout=self.timeout_s)

    # ------------------------------------------------------------------ rollouts
    def run(self, tasks: list[Task], params: SamplingParams, group_offset: int = 0) -> list[Trajectory]:
        """`params.n` trajectories per task in group order, exactly as `Rollout.run` returns them."""
        import ray

        if not tasks:
            return []
        splits = torch.arange(len(tasks)).tensor_split(len(self.actors))
        bounds = [(int(b[0]), int(b[-1]) + 1) for b in splits if len(b)]
        results: list[list[Trajectory] | None] = [None] * len(bounds)
        pending = {self._submit(i, i, bounds[i], tasks, params, group_offset): (i, i) for i in range(len(bounds))}
        deadlines = {ref: time.monotonic() + self.timeout_s for ref in pending}
        restarts = 0
        while pending:
            wait = max(0.0, min(deadlines[r] for r in pending) - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
            lost = []
            for ref in ready:
                shard, actor = pending.pop(ref)
                try:
                    _, results[shard] = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
                        ray.exceptions.ObjectLostError):
                    lost.append((shard, actor))
            now = time.monotonic()
            for ref in [r for r in pending if deadlines[r] <= now and r not in ready]:
                lost.append(pending.pop(ref))  # hung: treated as lost
            for shard, actor in lost:
                restarts += 1
                self._replace(actor)  # even when giving up: the next call must not meet a dead or hung actor
                if restarts > self.max_restarts:
                    raise RolloutWorkerError(f"rollout actors failed {restarts} times in one rollout call "
                                             f"(scale.max_actor_restarts = {self.max_restarts})")
                start, end = bounds[shard]
                self._counts["scale/groups_rerun"] += end - start
                ref = self._submit(shard, actor, bounds[shard], tasks, params, group_offset)
                pending[ref], deadlines[ref] = (shard, actor), time.monotonic() + self.timeout_s
        return [t for shard in results for t in shard]

    def _submit(self, shard: int, actor: int, bounds: tuple[int, int], tasks, params, group_offset):
        start, end = bounds
        return self.actors[actor].run.remote(tasks[start:end], params, group_offset + start)

    def _replace(self, index: int) -> None:
        """Kill actor `index` (dead or hung) and start a fresh one with the current weights."""
        import ray

        ray.kill(self.actors[index], no_restart=True)
        self.actors[index] = self._actor_cls.remote(self.spec)
        if self._weights is not None:
            self.actors[index].set_weights.remote(self.version, self._weights)
        self._counts["scale/actor_restarts"] += 1

    def metrics(self) -> dict[str, float]:
        """Restarts and re-run groups since the last call (logged with each step)."""
        out = {**self._counts, "scale/rollout_workers": float(len(self.actors))}
        self._counts = dict.fromkeys(self._counts, 0.0)
        return out

    def close(self) -> None:
        """Stop the actors (and the local Ray instance this rollout started)."""
        import ray

        if not ray.is_initialized():
            return
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self.owns_ray:
            ray.shutdown()
