"""Held-out evaluation: greedy accuracy, pass@k, completion length.

    report = evaluate(rollout, heldout, EvalConfig(pass_k=4), stop_ids)
    report.metrics()   # {"eval/accuracy": ..., "eval/pass@4": ..., "eval/mean_length": ...}

Accuracy is the `correctness` reward (exact answer match, or an environment's verdict).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from math import comb

from tamer.config import FieldError
from tamer.progress import progress_task
from tamer.rewards import correctness
from tamer.rollout.runner import Rollout
from tamer.rollout.types import SamplingParams, Trajectory
from tamer.tasks.base import Task, TaskSource, is_correct


@dataclass(frozen=True)
class EvalConfig:
    """What to measure on the held-out tasks."""

    size: int = 400  # held-out tasks used (0: all)
    max_new_tokens: int = 32  # tokens per reply (per turn for agent tasks)
    pass_k: int = 0  # k of pass@k; 0 disables pass@k sampling
    pass_n: int = 8  # samples per task for pass@k (n >= k)
    temperature: float = 1.0  # for pass@k samples (accuracy is greedy)
    seed: int = 1234  # sampling seed of the pass@k samples

    def __post_init__(self) -> None:
        for name in ("size", "pass_k"):
            if getattr(self, name) < 0:
                raise FieldError(name, f"expected >= 0, got {getattr(self, name)}")
        if self.max_new_tokens < 1:
            raise FieldError("max_new_tokens", f"expected >= 1, got {self.max_new_tokens}")
        if self.pass_k and self.pass_n < self.pass_k:
            raise FieldError("pass_n", f"must be >= pass_k ({self.pass_k}), got {self.pass_n}")
        if self.temperature <= 0:
            raise FieldError("temperature", f"expected > 0 (pass@k samples), got {self.temperature}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


@dataclass
class EvalReport:
    accuracy: float
    mean_length: float
    pass_k: dict[int, float] = field(default_factory=dict)
    num_tasks: int = 0
    agent: dict[str, float] = field(default_factory=dict)  # tool-using tasks: see agent_metrics
    trajectories: list[Trajectory] = field(default_factory=list, repr=False)

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        out = {f"{prefix}/accuracy": self.accuracy, f"{prefix}/mean_length": self.mean_length}
        out.update({f"{prefix}/pass@{k}": v for k, v in self.pass_k.items()})
        out.update({f"{prefix}/{k}": v for k, v in self.agent.items()})
        return out


def agent_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """Success rate, tool calls, cost over the optimum (successful episodes) and tool error rate."""
    n = len(trajs)
    calls = sum(t.num_tool_calls for t in trajs)
    ratios = [t.info["cost"] / t.info["optimal_cost"] for t in trajs
              if t.info.get("success") and t.info.get("cost") is not None and t.info.get("optimal_cost")]
    return {"success_rate": sum(bool(t.info.get("success")) for t in trajs) / n,
            "mean_tool_calls": calls / n,
            "mean_cost_ratio": sum(ratios) / len(ratios) if ratios else float("nan"),
            "error_rate": sum(t.num_errors for t in trajs) / calls if calls else 0.0,
            "mean_turns": sum(len(t.turns) for t in trajs) / n}


def evaluate(rollout: Rollout, tasks: list[Task], config: EvalConfig, stop_ids: tuple[int, ...]) -> EvalReport:
    tasks = tasks[: config.size] if config.size else tasks
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=config.max_new_tokens, stop_token_ids=stop_ids)
    # Chunks as large as the engine's own batches: progress to show, the same batches as one call.
    chunk = getattr(rollout.engine, "max_batch", len(tasks)) or len(tasks)
    trajs: list[Trajectory] = []
    with progress_task("eval", len(tasks)) as advance:
        for start in range(0, len(tasks), chunk):
            trajs += rollout.run(tasks[start:start + chunk], greedy, group_offset=start)
            advance(len(tasks[start:start + chunk]))
    accuracy = sum(correctness(t) for t in trajs) / len(trajs)
    mean_length = sum(t.num_generated for t in trajs) / len(trajs)
    report = EvalReport(accuracy, mean_length, num_tasks=len(tasks), trajectories=trajs)
    if tasks[0].env is not None:
        report.agent = agent_metrics(trajs)
    if config.pass_k:
        sampled = SamplingParams(n=config.pass_n, temperature=config.temperature,
                                 max_new_tokens=config.max_new_tokens, stop_token_ids=stop_ids, seed=config.seed)
        samples = rollout.run(tasks, sampled)
        correct = [0] * len(tasks)
        for t in samples:
            correct[t.group_id] += int(correctness(t) > 0)
        for k in sorted({1, config.pass_k}):
            report.pass_k[k] = sum(pass_at_k(config.pass_n, c, k) for c in correct) / len(tasks)
    return report


def demonstrator_accuracy(source: TaskSource, tasks: list[Task], seed: int = 0) -> float:
    """Accuracy of the task's demonstrator on `tasks` (what SFT data is worth)."""
    rng = random.Random(seed)
    return sum(is_correct(source.demonstrate(t, rng), t) for t in tasks) / len(tasks)
