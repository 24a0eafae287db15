"""Turn tasks into trajectories: encode prompts, sample groups, record tokens and logprobs.

`Rollout.run(tasks, params)` returns `params.n` trajectories per task, grouped: trajectory
k of task j has `group_id = group_offset + j`. Tasks that name an environment run as multi-turn episodes
through `AgentRollout`; the others take a single-turn path (one `generate` call per batch).

Seeding: `seeding="batch"` (the default) samples each generate call from one random stream
seeded with `params.seed`; `seeding="trajectory"` gives every trajectory its own stream,
seeded from (params.seed, group_id, sample index) (`trajectory_seed`), so its tokens do not
depend on how groups are split over calls or workers (`tamer.scale.RayRollout` relies on it).

Runners with this interface (`run`, `sync_weights`, `metrics`) are interchangeable in the trainer.
"""

from __future__ import annotations

import dataclasses
import time

from transformers import PreTrainedTokenizerBase

from tamer.models import encode_chat
from tamer.rollout.agent import AgentConfig, AgentRollout
from tamer.rollout.engine import GenerationEngine
from tamer.rollout.types import SamplingParams, Trajectory, Turn, trajectory_seed
from tamer.tasks.base import Task

SEEDINGS = ("batch", "trajectory")


class Rollout:
    """Samples completions for tasks through a generation engine.

    Tasks that name an environment (`task.env`) run as multi-turn episodes through
    `AgentRollout`; the others take the single-turn fast path.
    """

    def __init__(self, engine: GenerationEngine, tokenizer: PreTrainedTokenizerBase,
                 agent: AgentConfig = AgentConfig(), seeding: str = "batch") -> None:
        if seeding not in SEEDINGS:
            raise ValueError(f"seeding: expected one of {', '.join(SEEDINGS)}, got {seeding!r}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.seeding = seeding
        self.agent = AgentRollout(engine, tokenizer, agent, seeding=seeding)
        self._prompt_cache: dict[str, list[int]] = {}

    def sync_weights(self, model, version: int = 0) -> None:
        """Sample from `model`'s current weights from now on (`version`: the learner's step count)."""
        self.engine.sync_weights(model)

    def metrics(self) -> dict[str, float]:
        """Counters of the last `run` calls (a distributed runner's restarts); none in process."""
        return {}

    def encode(self, task: Task) -> list[int]:
        ids = self._prompt_cache.get(task.id)
        if ids is None:
            ids = encode_chat(self.tokenizer, task.messages)
            self._prompt_cache[task.id] = ids
        return ids

    def run(self, tasks: list[Task], params: SamplingParams, group_offset: int = 0) -> list[Trajectory]:
        with_env = [t.env is not None for t in tasks]
        if all(with_env):  # the learner reuses activations of single-turn completions only
            return self.agent.run(tasks, dataclasses.replace(params, keep_activations=False), group_offset)
        if any(with_env):
            raise ValueError("a batch mixes environment tasks and single-turn tasks; use one kind per run")
        prompts = [self.encode(t) for t in tasks]
        if self.seeding == "trajectory":
            params = dataclasses.replace(params, row_seeds=tuple(
                trajectory_seed(params.seed, group_offset + j, k) for j in range(len(tasks)) for k in range(params.n)))
        start = time.perf_counter()
        outputs = self.engine.generate(prompts, params)
        seconds = (time.perf_counter() - start) / max(1, len(tasks) * params.n)
        trajectories = []
        for j, (task, prompt, samples) in enumerate(zip(tasks, prompts, outputs)):
            for out in samples:
                trajectories.append(Trajectory(
                    task=task,
                    group_id=group_offset + j,
                    prompt_ids=prompt,
                    completion_ids=list(out.token_ids),
                    loss_mask=[1] * len(out.token_ids),
                    logprobs=list(out.logprobs),
                    text=self.tokenizer.decode(out.token_ids, skip_special_tokens=False),
                    finish_reason=out.finish_reason,
                    turns=[Turn(generated=len(out.token_ids), seconds=seconds)],
                    weight_version=out.weight_version,
                    activations=out.activations,
                ))
        return trajectories

