"""Off-policy by k: a thread samples the batches of later steps while the learner trains.

With `rl.max_staleness: k > 0` the trainer takes each step's scored trajectories from a
`Producer` instead of collecting them itself:

    producer = Producer(trainer, start_step=1)
    trajectories, metrics = producer.take(step)      # blocks until the batch of `step` is ready
    ...update...
    producer.publish(step, trainer.model)            # weights after `step` updates (version `step`)

The batch of step s is sampled with the weights of version max(s - 1 - k, first), exactly, so a run is
reproducible whatever the timing, and its staleness (the learner's version minus the sampler's,
s - 1 - version) is at most k. The queue between the thread and the learner holds at most k
batches. Each trajectory carries its `policy_version`; the loss uses the recomputed π_prox and
the behaviour weight π_prox/π_behav (tamer.algorithms.offpolicy).

The producer samples on its own copy of the weights (a second in-process engine, or the Ray
actors of `RayRollout`); evaluation stays on the learner's current weights. Metrics per step:
`async/staleness`, `async/staleness_frac/{d}` (a histogram over d = 0..k), and the seconds the
producer spent generating and idle and the learner waited (`async/*_s`).
"""

from __future__ import annotations

import contextlib
import copy
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tamer.rollout.engine import HFEngine
from tamer.rollout.runner import Rollout
from tamer.rollout.types import Trajectory


@dataclass
class _Item:
    step: int
    version: int
    trajectories: list[Trajectory]
    metrics: dict[str, float]
    pool_state: dict  # the task pool after this batch was drawn (what a checkpoint at `step` saves)
    timings: dict[str, float] = field(default_factory=dict)
    idle_s: float = 0.0


class Producer:
    """The sampling thread of an off-policy-by-k run (see the module docstring)."""

    def __init__(self, trainer: Any, start_step: int) -> None:
        self.trainer, self.k = trainer, trainer.config.max_staleness
        self.queue: queue.Queue[_Item | BaseException] = queue.Queue(maxsize=self.k)
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.first_version = trainer.step
        self.cond = threading.Condition()
        self.stopped = False
        self.pool_after = trainer.pool.state_dict()
        self.sampler = copy.deepcopy(trainer.model).eval()  # the weights being sampled from
        if trainer.rollout is trainer.local_rollout:  # in process: a second engine on the copy
            engine = trainer.engine
            engine = HFEngine(self.sampler, trainer.tokenizer.pad_token_id, max_batch=engine.max_batch,
                              precision=engine.precision, threads=engine.threads)
            self.rollout = Rollout(engine, trainer.tokenizer, trainer.local_rollout.agent.config,
                                   seeding=trainer.config.sampling_seed)
        else:  # Ray actors (or another runner): the copy is what gets pushed to them
            self.rollout = trainer.rollout
        self.publish(trainer.step, trainer.model)
        self.thread = threading.Thread(target=self._loop, args=(start_step,), name="producer", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ the learner's side
    def publish(self, version: int, model: torch.nn.Module) -> None:
        """Weights after `version` updates (a copy: the learner keeps changing `model`)."""
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        with self.cond:
            self.snapshots[version] = state
            self.cond.notify_all()

    def take(self, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        """The scored batch of `step` (blocks until the thread has it) and its metrics."""
        start = time.perf_counter()
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        waited = time.perf_counter() - start
        assert item.step == step, f"producer out of order: batch of step {item.step} for step {step}"
        self.pool_after = item.pool_state
        staleness = (step - 1) - item.version
        metrics = dict(item.metrics)
        metrics.update({f"time/{k}_s": v for k, v in item.timings.items()})
        metrics.update({"async/staleness": float(staleness), "async/policy_version": float(item.version),
                        "async/learner_idle_s": waited, "async/producer_idle_s": item.idle_s,
                        "async/producer_generate_s": sum(item.timings.values())})
        metrics.update({f"async/staleness_frac/{d}": float(d == staleness) for d in range(self.k + 1)})
        return item.trajectories, metrics

    def pool_state(self) -> dict:
        """The task pool as of the last batch taken: a checkpoint resumes drawing after it."""
        return self.pool_after

    def close(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        while self.thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self.queue.get_nowait()  # unblock a pending put
            self.thread.join(timeout=0.1)

    # ------------------------------------------------------------------ the thread
    def _loop(self, step: int) -> None:
        try:
            while step <= self.trainer.config.steps:
                idle = time.perf_counter()
                version = self._weights_for(step)
                if version is None:
                    return
                idle = time.perf_counter() - idle
                timings: dict[str, float] = {}
                trajs, metrics = self.trainer.collect(step, self.rollout, version, timings)
                item = _Item(step, version, trajs, metrics, self.trainer.pool.state_dict(), timings, idle)
                put = time.perf_counter()
                while not self._put(item):
                    if self.stopped:
                        return
                item.idle_s += time.perf_counter() - put
                step += 1
        except BaseException as err:
            self.queue.put(err)

    def _put(self, item: _Item) -> bool:
        try:
            self.queue.put(item, timeout=0.2)
            return True
        except queue.Full:
            return False

    def _weights_for(self, step: int) -> int | None:
        """Wait for version max(step - 1 - k, first) and load it into the sampler; None once stopped."""
        target = max(step - 1 - self.k, self.first_version)
        with self.cond:
            self.cond.wait_for(lambda: self.stopped or target in self.snapshots)
            if self.stopped:
                return None
            state = self.snapshots[target]
            for old in [v for v in self.snapshots if v < target]:
                del self.snapshots[old]
        with torch.no_grad():
            self.sampler.load_state_dict(state)
        self.rollout.sync_weights(self.sampler, target)
        return target
