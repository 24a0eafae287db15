"""Training-health checks on each step's metrics: say it when a run stops learning.

    monitor = HealthMonitor(HealthConfig())
    flags, warnings = monitor.update(metrics, step)   # flags: {"health/zero_spread": 1.0, ...}

The tracker feeds every logged record through a monitor: the flags go into the same record
(metrics.jsonl, TensorBoard, trackers; 1.0 while a condition holds, 0.0 otherwise, only for
checks the record's metrics allow), and each warning is printed once when its condition
starts. The checks, in the metrics' own names:

    success_collapse   held-out success (eval/success_rate, else eval/accuracy) fell below
                       `collapse_fraction` of its first value
    correctness_collapse  the same for the training correctness (reward/correctness): the mean
                       of the last `patience` steps against the mean of the first `patience`
    zero_spread        rollout/zero_spread_frac >= `zero_spread_frac` for `patience` steps in a
                       row: every attempt at a task scored the same, advantages are zero
    reward_failing     a reward function raised on every call of a step (from the cumulative
                       reward/errors/<name> against rollout/trajectories)
    tool_errors        rollout/errors per tool call >= `tool_error_frac` for `patience` steps
    tools_abandoned    tool calls per episode fell to zero from >= 0.5 over the first steps
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from tamer.config import FieldError

CHECKS = ("success_collapse", "correctness_collapse", "zero_spread", "reward_failing", "tool_errors", "tools_abandoned")


@dataclass(frozen=True)
class HealthConfig:
    """Thresholds of the training-health warnings (`tracking.health.*`)."""

    enabled: bool = True  # print and log training-health warnings
    collapse_fraction: float = 0.5  # success below this fraction of its start is a collapse
    collapse_min_start: float = 0.1  # ... when it started at least this high
    zero_spread_frac: float = 0.9  # share of zero-spread groups that counts as "no signal"
    tool_error_frac: float = 0.5  # tool errors per tool call
    patience: int = 3  # steps in a row a condition must hold (and the window of smoothed figures)

    def __post_init__(self) -> None:
        for name in ("collapse_fraction", "zero_spread_frac", "tool_error_frac"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise FieldError(name, f"expected a fraction in (0, 1], got {getattr(self, name)}")
        if self.patience < 1:
            raise FieldError("patience", f"expected >= 1, got {self.patience}")


class HealthMonitor:
    """Keeps the little history the checks need; `update` once per logged record, in step order."""

    def __init__(self, config: HealthConfig = HealthConfig()) -> None:
        self.config = config
        self.start: dict[str, float] = {}  # first value of each eval success key
        self.first: dict[str, list[float]] = {}  # first `patience` values of smoothed keys
        self.recent: dict[str, deque] = {}  # last `patience` values
        self.streak: dict[str, int] = {}  # consecutive records a streak condition held
        self.errors_seen: dict[str, float] = {}  # cumulative reward errors at the previous record
        self.active: set[str] = set()

    def _push(self, key: str, value: float) -> None:
        first = self.first.setdefault(key, [])
        if len(first) < self.config.patience:
            first.append(value)
        self.recent.setdefault(key, deque(maxlen=self.config.patience)).append(value)

    def _mean(self, values) -> float:
        return sum(values) / len(values)

    def _held(self, name: str, condition: bool) -> bool:
        self.streak[name] = self.streak.get(name, 0) + 1 if condition else 0
        return self.streak[name] >= self.config.patience

    def update(self, metrics: Mapping[str, float], step: int) -> tuple[dict[str, float], list[str]]:
        """Flags for this record and the warnings that start at it."""
        if not self.config.enabled:
            return {}, []
        found: dict[str, tuple[bool, str]] = {}
        for check in (self._collapse, self._zero_spread, self._reward_failing, self._tool_errors):
            found.update(check(metrics, step))
        flags = {f"health/{name}": float(on) for name, (on, _) in found.items()}
        started = [message for name, (on, message) in found.items() if on and name not in self.active]
        self.active = {name for name, (on, _) in found.items() if on} | {n for n in self.active if n not in found}
        return flags, started

    # -- checks: each returns {name: (holds, message)} for the checks this record allows -------
    def _collapse(self, m: Mapping[str, float], step: int) -> dict[str, tuple[bool, str]]:
        cfg = self.config
        key = next((k for k in ("eval/success_rate", "eval/accuracy") if k in m), None)
        out = {}
        if key is not None:
            start = self.start.setdefault(key, m[key])
            on = start >= cfg.collapse_min_start and m[key] < cfg.collapse_fraction * start
            out["success_collapse"] = (on, f"held-out success collapsed: {key} {m[key]:.3f} at step {step}, "
                                           f"{start:.3f} at the start (below {cfg.collapse_fraction:.0%} of it)")
        if "reward/correctness" in m:
            self._push("reward/correctness", m["reward/correctness"])
            start, now = self._mean(self.first["reward/correctness"]), self._mean(self.recent["reward/correctness"])
            on = (len(self.recent["reward/correctness"]) >= cfg.patience and start >= cfg.collapse_min_start
                  and now < cfg.collapse_fraction * start)
            out["correctness_collapse"] = (on, f"training success collapsed: reward/correctness {now:.3f} over "
                                               f"the last {cfg.patience} steps, {start:.3f} over the first "
                                               f"(step {step})")
        return out

    def _zero_spread(self, m: Mapping[str, float], step: int) -> dict[str, tuple[bool, str]]:
        if "rollout/zero_spread_frac" not in m:
            return {}
        frac = m["rollout/zero_spread_frac"]
        on = self._held("zero_spread", frac >= self.config.zero_spread_frac)
        return {"zero_spread": (on, f"no learning signal: {frac:.0%} of groups had zero reward spread "
                                    f"({self.config.patience} steps in a row, step {step}); every attempt "
                                    "at a task scores the same, so advantages are zero: try a larger "
                                    "rl.group_size, a reward with partial credit, or tasks nearer the model's level")}

    def _reward_failing(self, m: Mapping[str, float], step: int) -> dict[str, tuple[bool, str]]:
        calls = m.get("rollout/trajectories")
        out = {}
        failing = []
        for key in (k for k in m if k.startswith("reward/errors/")):
            name = key[len("reward/errors/"):]
            before = self.errors_seen.get(name, 0.0)
            new = m[key] - before if m[key] >= before else m[key]  # a resumed run restarts the count
            self.errors_seen[name] = m[key]
            if calls:
                failing += [f"{name!r} ({new:.0f}/{calls:.0f})"] if new >= calls else []
        if calls and self.errors_seen:
            out["reward_failing"] = (bool(failing), f"reward function {', '.join(failing)} failed on every call "
                                                    f"at step {step}; its score is reward.default_on_error")
        return out

    def _tool_errors(self, m: Mapping[str, float], step: int) -> dict[str, tuple[bool, str]]:
        if "rollout/tool_calls" not in m or "rollout/errors" not in m:
            return {}
        calls, errors = m["rollout/tool_calls"], m["rollout/errors"]
        out = {}
        if calls > 0 or self.streak.get("tool_errors"):
            ratio = errors / calls if calls > 0 else 0.0
            on = self._held("tool_errors", ratio >= self.config.tool_error_frac)
            out["tool_errors"] = (on, f"tool errors dominate: {ratio:.2f} errors per tool call "
                                      f"({self.config.patience} steps in a row, step {step})")
        self._push("rollout/tool_calls", calls)
        start, now = self._mean(self.first["rollout/tool_calls"]), self._mean(self.recent["rollout/tool_calls"])
        if start >= 0.5:
            on = len(self.recent["rollout/tool_calls"]) >= self.config.patience and now == 0.0
            out["tools_abandoned"] = (on, f"the agent stopped calling tools: {start:.2f} calls per episode over "
                                          f"the first {self.config.patience} steps, 0 over the last (step {step})")
        return out
