"""Reward functions and their weighted composition.

A reward function reads one finished `Trajectory` and returns a float. Functions register
by name; a `RewardConfig` picks them with weights. A function that raises never stops
training: its score becomes `default_on_error`, and the error is counted and its first
traceback kept for the log.

    composer = RewardComposer(RewardConfig(weights={"correctness": 1.0, "format": 0.1}))
    stats = composer.score(trajectories)      # sets traj.reward and traj.rewards
    stats.metrics()                           # {"reward/correctness": ..., "reward/errors": ...}

Your own function: register it, then name it in `weights` (from the CLI: put the module in
`plugins:` or pass `--import my_rewards`, so the name is known before the config is checked):

    @REWARDS.register("mine")
    def mine(traj: Trajectory) -> float: ...

Batch rewards (a learned reward model, an LLM judge) score a whole scoring pass at once:
they register a class whose constructor takes the function's `reward.params` and whose
instances have `score_batch(trajectories) -> list[float | Exception]` (see `BatchReward`).
The composer builds each once and calls `score_batch` once per pass; an Exception item is
that trajectory's error, counted and scored `default_on_error` like a raising function.
"""

from __future__ import annotations

import inspect
import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tamer.config import ConfigError, FieldError, check_name
from tamer.registry import Registry
from tamer.rollout.types import Trajectory
from tamer.tasks.base import ANSWER_RE, is_correct

RewardFn = Callable[..., float]
REWARDS: Registry[RewardFn] = Registry("reward")


@REWARDS.register("correctness")
def correctness(traj: Trajectory) -> float:
    """1 when the final answer matches the task's reference, else 0.

    Environments judge the outcome themselves (`info["success"]`); tasks whose answers are
    checked by a reward function (meta "check", e.g. unit tests) count a full score as correct.
    """
    if "success" in traj.info:
        return float(traj.info["success"])
    if "check" in traj.task.meta:
        return float(REWARDS.get(traj.task.meta["check"])(traj) >= 1.0)
    return float(is_correct(traj.text, traj.task))


@REWARDS.register("format")
def answer_format(traj: Trajectory) -> float:
    """1 for exactly one <answer>...</answer> that ends the reply, else 0."""
    text = traj.text.replace("<|im_end|>", "").rstrip()
    matches = list(ANSWER_RE.finditer(text))
    return float(len(matches) == 1 and matches[0].end() == len(text) and not traj.truncated)


@REWARDS.register("length")
def length_penalty(traj: Trajectory, *, max_tokens: int = 256, truncation_penalty: float = 1.0) -> float:
    """−(generated tokens / max_tokens); a truncated reply also pays `truncation_penalty`."""
    return -traj.num_generated / max_tokens - (truncation_penalty if traj.truncated else 0.0)


# ---------------------------------------------------------------- agent rewards
@REWARDS.register("tool_success")
def tool_success(traj: Trajectory) -> float:
    """Fraction of tool calls that ran without error (1.0 when no tool was called)."""
    calls = sum(len(t.tool_calls) for t in traj.turns) or traj.info.get("tool_calls", 0)
    errors = sum(len(t.errors) for t in traj.turns)
    return 1.0 - errors / calls if calls else 1.0


@REWARDS.register("steps")
def steps_penalty(traj: Trajectory, *, per_call: float = 0.05, free_calls: int = 0) -> float:
    """−per_call for every tool call beyond `free_calls` (fewer steps for the same outcome is better)."""
    return -per_call * max(0, traj.num_tool_calls - free_calls)


@REWARDS.register("cost")
def cost_penalty(traj: Trajectory, *, scale: float = 1.0) -> float:
    """−scale·(cost/optimal_cost − 1) as the environment reports it; 0 without a costed outcome."""
    cost, optimal = traj.info.get("cost"), traj.info.get("optimal_cost")
    if cost is None or not optimal:
        return 0.0
    return -scale * (cost / optimal - 1.0)


@REWARDS.register("process")
def process_reward(traj: Trajectory) -> float:
    """Sum of the per-turn (process) rewards the environment gave."""
    return sum(t.env_reward for t in traj.turns)


# Rewards whose modules are costly or sit with their task: registered by name here, imported on
# first use. The code task's (the fraction of hidden unit tests passed) needs the sandbox; the
# units task's check (its number) and its hidden preference rule (number + unit); the learned
# rewards (a trained reward model, an LLM judge) are batch rewards, classes built once from their
# reward.params (see BatchReward below).
for _name, _target in {"unit_tests": "tamer.tasks.code_check:unit_tests",
                       "units_number": "tamer.tasks.units:number_correct",
                       "units_rule": "tamer.tasks.units:hidden_rule",
                       "reward_model": "tamer.learned_rewards.reward_model:RewardModelReward",
                       "judge": "tamer.learned_rewards.judge:JudgeReward"}.items():
    REWARDS.register_lazy(_name, _target)


@runtime_checkable
class BatchReward(Protocol):
    """A reward scored a batch at a time (one model forward per batch, not per trajectory)."""

    def score_batch(self, trajectories: list[Trajectory]) -> list[float | Exception]:
        """One value per trajectory, in order; an Exception marks one the function could not score."""


@dataclass(frozen=True)
class RewardConfig:
    """Which reward functions to use, with weights and per-function keyword arguments."""

    weights: dict[str, float] = field(default_factory=lambda: {"correctness": 1.0, "format": 0.1})  # name -> weight
    params: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> keyword arguments of that function
    default_on_error: float = 0.0  # score given when a function raises or returns NaN

    def __post_init__(self) -> None:
        if not self.weights:
            raise FieldError("weights", "name at least one reward function")
        for name in self.weights:
            check_name("weights", name, REWARDS.names(), "reward")
        for name in self.params:
            if name not in self.weights:
                raise FieldError(f"params.{name}", "no such function in reward.weights")
        for name in self.weights:  # keyword arguments each function (or batch reward class) accepts
            fn = REWARDS.get(name)
            if not isinstance(fn, type) and hasattr(fn, "score_batch"):  # registered already built
                if self.params.get(name):
                    raise FieldError(f"params.{name}", f"{name!r} was registered already built; it takes no params")
                continue
            try:
                inspect.signature(fn).bind(*(() if isinstance(fn, type) else (None,)), **self.params.get(name, {}))
            except TypeError as err:
                raise FieldError(f"params.{name}", f"{err} (the parameters of {name!r})") from None


@dataclass
class RewardStats:
    """What one scoring pass saw: per-function means and errors."""

    means: dict[str, float]
    errors: dict[str, int]
    first_traceback: str | None
    total_mean: float

    def metrics(self) -> dict[str, float]:
        out = {f"reward/{k}": v for k, v in self.means.items()}
        out["reward/mean"] = self.total_mean
        out["reward/errors"] = float(sum(self.errors.values()))
        return out


class RewardComposer:
    """Weighted sum of reward functions with error isolation."""

    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        self.functions = {name: self._build(name, REWARDS.get(name)) for name in config.weights}
        self.total_errors = 0
        self.errors_by_name = {name: 0 for name in self.functions}  # cumulative, per function
        self.first_traceback: str | None = None

    def _build(self, name: str, fn: Any) -> Any:
        """A batch reward class is built once, with its `reward.params` as keyword arguments."""
        if not isinstance(fn, type):
            if isinstance(fn, BatchReward) and self.config.params.get(name):
                raise ConfigError(f"reward.params.{name}: {name!r} was passed already built; it takes no params")
            return fn
        try:
            return fn(**self.config.params.get(name, {}))
        except (TypeError, ValueError) as err:
            raise ConfigError(f"reward.params.{name}: {err}") from None

    def _call(self, name: str, traj: Trajectory) -> tuple[float, str | None]:
        try:
            value = float(self.functions[name](traj, **self.config.params.get(name, {})))
        except Exception:
            return self.config.default_on_error, traceback.format_exc()
        if math.isnan(value):
            return self.config.default_on_error, f"reward function {name!r} returned NaN"
        return value, None

    def breakdown(self, traj: Trajectory) -> tuple[float, dict[str, float]]:
        """(weighted total, unweighted score per function) of one trajectory; counts nothing, changes nothing."""
        scores = {name: self._column(name, [traj])[0][0] for name in self.functions}
        return sum(self.config.weights[n] * v for n, v in scores.items()), scores

    def _call_batch(self, name: str, trajs: list[Trajectory]) -> list[tuple[float, str | None]]:
        try:
            values = list(self.functions[name].score_batch(trajs))
            if len(values) != len(trajs):
                raise ValueError(f"score_batch returned {len(values)} values for {len(trajs)} trajectories")
        except Exception:
            return [(self.config.default_on_error, traceback.format_exc())] * len(trajs)
        return [self._checked(name, value) for value in values]

    def _checked(self, name: str, value: Any) -> tuple[float, str | None]:
        """One item of a batch: an Exception, a non-number or NaN is an error scored default."""
        if isinstance(value, Exception):
            return self.config.default_on_error, f"{type(value).__name__}: {value}"
        try:
            value = float(value)
        except (TypeError, ValueError):
            return self.config.default_on_error, f"reward function {name!r} returned {value!r}, not a number"
        if math.isnan(value):
            return self.config.default_on_error, f"reward function {name!r} returned NaN"
        return value, None

    def _column(self, name: str, trajs: list[Trajectory]) -> list[tuple[float, str | None]]:
        if isinstance(self.functions[name], BatchReward):
            return self._call_batch(name, trajs)
        return [self._call(name, traj) for traj in trajs]

    def score(self, trajectories: list[Trajectory]) -> RewardStats:
        sums = {name: 0.0 for name in self.functions}
        errors = {name: 0 for name in self.functions}
        first_tb = None
        for traj in trajectories:
            traj.rewards = {}
        for name in self.functions:
            for traj, (value, tb) in zip(trajectories, self._column(name, trajectories)):
                if tb is not None:
                    errors[name] += 1
                    first_tb = first_tb or f"reward function {name!r} failed:\n{tb}"
                traj.rewards[name] = value
                sums[name] += value
        for traj in trajectories:
            traj.reward = sum(self.config.weights[n] * v for n, v in traj.rewards.items())
        self.total_errors += sum(errors.values())
        for name, count in errors.items():
            self.errors_by_name[name] += count
        self.first_traceback = self.first_traceback or first_tb
        n = max(1, len(trajectories))
        total = sum(t.reward for t in trajectories) / n
        return RewardStats({k: v / n for k, v in sums.items()}, errors, first_tb, total)
