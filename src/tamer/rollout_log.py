"""Rollouts saved for reading: a sample of each RL step's groups, every held-out episode at eval.

    recorder = RolloutRecorder(RolloutLogConfig(groups_per_step=4), tokenizer, rewards, sink=tracker)
    recorder.on_batch(step, trajectories, batch, learner_logprobs)   # after advantages, before the update
    recorder.on_eval(step, report.trajectories)                      # after each held-out evaluation
    records = read_rollouts("runs/demo/rl")                          # what `tamer view` reads

The sink (the run's `Tracker`) appends the records to `run_dir/rollouts.jsonl`, one strict JSON
object per line (NaN and infinities become null), and forwards them to the experiment trackers.
A record describes one trajectory:

    kind            "train" (a sampled group member) or "eval" (a greedy held-out episode)
    phase           "rl", or "sft" for the SFT model's held-out episodes (step = SFT steps)
    step            optimizer steps done when it was sampled (eval at step 0: the start model)
    group, sample   group id within the step, and the attempt's index within its group
    task            {"id", "messages", "answer"}
    turns           per assistant turn: {"text", "tool_calls", "tool_results", "errors",
                    "env_reward", "env_text", "span"}: env_text is the environment's tokens that
                    followed; span [start, end, env_end] indexes `tokens` (generated: start..end)
    completion      the decoded completion (what reward functions read)
    tokens          the completion's token texts; loss_mask: 1 on the tokens the policy
                    generated (trained), 0 on the tokens the environment inserted (masked)
    reward, rewards the weighted total and each reward function's unweighted score; weights: theirs
    advantage       the trajectory's advantage (mean over its generated tokens for PPO); null at eval
    logprob_gap     mean |learner - sampler| logprob over its generated tokens at the sampling
                    weights (logprob_gap_max: the largest); null when not measured
    weight_version  the policy version an engine stamped on the trajectory (info["weight_version"]);
                    null while the sampler is the learner's own module
    finish_reason, truncated, num_generated, num_tool_calls, num_errors, info (environment facts)

Recording never touches the trainer's random state (groups are drawn from their own seeded
stream), so a run with and without it trains identically.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tamer.config import FieldError
from tamer.rollout.types import Trajectory
from tamer.storage import read_jsonl

ROLLOUTS_FILE = "rollouts.jsonl"


@dataclass(frozen=True)
class RolloutLogConfig:
    """Which rollouts an RL run saves to run_dir/rollouts.jsonl (`tracking.rollouts.*`)."""

    enabled: bool = True  # write rollouts.jsonl
    groups_per_step: int = 2  # groups sampled (seeded) from each logged training step; 0: none
    every: int = 1  # log the training groups of every N-th step
    eval_episodes: int = 0  # held-out episodes saved at each evaluation; 0: all of them
    logprob_gap: bool = True  # one no-grad learner forward on the saved rows to measure the gap
    seed: int = 0  # which groups are sampled (its own stream: training randomness untouched)

    def __post_init__(self) -> None:
        for name in ("groups_per_step", "eval_episodes"):
            if getattr(self, name) < 0:
                raise FieldError(name, f"expected >= 0, got {getattr(self, name)}")
        if self.every < 1:
            raise FieldError("every", f"expected >= 1, got {self.every}")


# ---------------------------------------------------------------------------- JSON
def strict_json(value: Any) -> Any:
    """`value` as plain JSON data: non-finite floats become None, unknown objects their str()."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, dict):
        return {str(k): strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    item = getattr(value, "item", None)  # numpy and torch scalars
    if callable(item):
        try:
            return strict_json(item())
        except (ValueError, RuntimeError):
            pass
    return str(value)


def dumps(record: dict[str, Any]) -> str:
    """One strict JSON line (no NaN, no Infinity: every JSON parser, browsers included, reads it)."""
    return json.dumps(strict_json(record), ensure_ascii=False, allow_nan=False)


def read_rollouts(path: str | Path) -> list[dict[str, Any]]:
    """The records of rollouts.jsonl (or of the one in a run directory); a torn last line is skipped."""
    path = Path(path)
    path = path / ROLLOUTS_FILE if path.is_dir() else path
    return read_jsonl(path)


# ---------------------------------------------------------------------------- records
class TokenTexts:
    """Token ids -> one text per token whose concatenation is the decoded sequence.

    Decoded incrementally over a short window, as streaming detokenizers do: a token that
    ends inside a multi-byte character gets "" and the character goes to the token that
    completes it; SentencePiece's leading spaces survive because each token is decoded
    after its predecessor.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if ids else ""

    def __call__(self, ids: Iterable[int]) -> list[str]:
        ids = list(ids)
        out: list[str] = []
        prefix = read = 0  # ids[prefix:read] is decoded context already emitted
        for i in range(len(ids)):
            before, after = self._decode(ids[prefix:read]), self._decode(ids[prefix:i + 1])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                out.append(after[len(before):])
                prefix, read = read, i + 1
            else:
                out.append("")
        if read < len(ids) and out:  # bytes that never completed a character: flush them as decoded
            out[-1] += self._decode(ids[prefix:])[len(self._decode(ids[prefix:read])):]
        return out


def split_turns(traj: Trajectory, texts: list[str]) -> list[dict[str, Any]]:
    """Each assistant turn's text with its tool calls and results, from the token layout.

    A turn's generated tokens (`Turn.generated` of them, loss_mask 1) are followed by the
    tokens the environment inserted (loss_mask 0) up to the next turn.
    """
    turns, pos, n = [], 0, len(traj.completion_ids)
    for turn in traj.turns or []:
        end = min(n, pos + turn.generated)
        env_end = end
        while env_end < n and traj.loss_mask[env_end] == 0:
            env_end += 1
        turns.append({"text": "".join(texts[pos:end]), "tool_calls": turn.tool_calls,
                      "tool_results": turn.tool_results, "errors": turn.errors,
                      "env_reward": turn.env_reward, "env_text": "".join(texts[end:env_end]),
                      "span": [pos, end, env_end]})
        pos = env_end
    if not turns:
        turns.append({"text": "".join(texts), "tool_calls": [], "tool_results": [], "errors": [],
                      "env_reward": 0.0, "env_text": "", "span": [0, n, n]})
    return turns


def trajectory_record(traj: Trajectory, token_texts: TokenTexts, *, kind: str, step: int, sample: int = 0,
                      phase: str = "rl", advantage: float | None = None, gap: tuple[float, float] | None = None,
                      rewards: dict[str, float] | None = None, reward: float | None = None,
                      weights: dict[str, float] | None = None) -> dict[str, Any]:
    """One trajectory as a record (the fields in the module docstring); JSON-ready after `strict_json`."""
    texts = token_texts(traj.completion_ids)
    task = traj.task
    return {
        "kind": kind, "phase": phase, "step": step, "group": traj.group_id, "sample": sample,
        "task": {"id": task.id, "messages": [dict(m) for m in task.messages], "answer": task.answer},
        "turns": split_turns(traj, texts), "completion": traj.text,
        "tokens": texts, "loss_mask": [int(m) for m in traj.loss_mask],
        "reward": traj.reward if reward is None else reward,
        "rewards": dict(traj.rewards if rewards is None else rewards), "weights": dict(weights or {}),
        "advantage": advantage,
        "logprob_gap": gap[0] if gap else None, "logprob_gap_max": gap[1] if gap else None,
        "weight_version": traj.info.get("weight_version"),
        "finish_reason": traj.finish_reason, "truncated": traj.truncated,
        "num_generated": traj.num_generated, "num_tool_calls": traj.num_tool_calls, "num_errors": traj.num_errors,
        "info": {k: v for k, v in traj.info.items() if k != "weight_version"},
    }


def select_groups(group_ids: list[int], k: int, seed: int, step: int) -> set[int]:
    """`k` distinct group ids drawn from a stream of their own (the trainer's RNG is untouched)."""
    distinct = sorted(set(group_ids))
    if k >= len(distinct):
        return set(distinct)
    return set(random.Random(seed * 1_000_003 + step).sample(distinct, k))


def per_row_advantage(advantages: torch.Tensor, loss_mask: torch.Tensor) -> list[float]:
    """(B,) advantages as they are; (B, T) token advantages as their mean over generated tokens."""
    if advantages.dim() == 1:
        return advantages.tolist()
    counts = loss_mask.sum(-1).clamp(min=1)
    return ((advantages * loss_mask).sum(-1) / counts).tolist()


def logprob_gaps(learner: torch.Tensor, trajs: list[Trajectory]) -> list[tuple[float, float]]:
    """(mean, max) |learner - sampler| per trajectory over its generated tokens.

    `learner` (b, T) float32 follows the batch layout: position P + j holds completion token
    j's logprob, P the prompt length. Sampler logprobs come from the trajectory itself (the
    batch's old logprobs may have been recomputed by the learner).
    """
    out = []
    for row, traj in enumerate(trajs):
        start = len(traj.prompt_ids)
        gaps = [abs(float(learner[row, start + j]) - lp)
                for j, (m, lp) in enumerate(zip(traj.loss_mask, traj.logprobs)) if m]
        out.append((sum(gaps) / len(gaps), max(gaps)) if gaps else (float("nan"), float("nan")))
    return out


class RolloutRecorder:
    """Turns a step's trajectories into records and hands them to `sink.log_rollouts(records, step)`."""

    def __init__(self, config: RolloutLogConfig, tokenizer, rewards=None, sink=None, phase: str = "rl") -> None:
        self.config, self.rewards, self.sink, self.phase = config, rewards, sink, phase
        self.token_texts = TokenTexts(tokenizer)
        self.weights = dict(rewards.config.weights) if rewards is not None else {}

    @property
    def active(self) -> bool:
        return self.config.enabled and callable(getattr(self.sink, "log_rollouts", None))

    def on_batch(self, step: int, trajectories: list[Trajectory], batch,
                 learner_logprobs: Callable[[Any], torch.Tensor] | None = None) -> None:
        """Save the sampled groups of a training step; `batch` rows follow `trajectories`."""
        cfg = self.config
        if not self.active or not cfg.groups_per_step or step % cfg.every:
            return
        chosen = select_groups([t.group_id for t in trajectories], cfg.groups_per_step, cfg.seed, step)
        rows = [i for i, t in enumerate(trajectories) if t.group_id in chosen]
        advantages = per_row_advantage(batch.advantages[rows], batch.loss_mask[rows])
        gaps: list = [None] * len(rows)
        if cfg.logprob_gap and learner_logprobs is not None:
            gaps = logprob_gaps(learner_logprobs(batch.select(rows)), [trajectories[i] for i in rows])
        seen: dict[int, int] = {}
        records = []
        for row, advantage, gap in zip(rows, advantages, gaps):
            traj = trajectories[row]
            sample = seen[traj.group_id] = seen.get(traj.group_id, -1) + 1
            records.append(trajectory_record(traj, self.token_texts, kind="train", step=step, sample=sample,
                                             phase=self.phase, advantage=advantage, gap=gap, weights=self.weights))
        self.sink.log_rollouts(records, step)

    def on_eval(self, step: int, trajectories: list[Trajectory]) -> None:
        """Save held-out episodes (all, or the first `eval_episodes`), scored by every reward function."""
        if not self.active:
            return
        keep = trajectories[: self.config.eval_episodes] if self.config.eval_episodes else trajectories
        records = []
        for traj in keep:
            total, scores = self.rewards.breakdown(traj) if self.rewards is not None else (traj.reward, traj.rewards)
            records.append(trajectory_record(traj, self.token_texts, kind="eval", step=step, phase=self.phase,
                                             rewards=scores, reward=total, weights=self.weights))
        self.sink.log_rollouts(records, step)


def rollout_rows(records: list[dict[str, Any]], max_chars: int = 2000) -> tuple[list[str], list[list[Any]]]:
    """(columns, rows): the records as a flat table for experiment trackers (long texts cut)."""
    columns = ["step", "kind", "group", "sample", "task", "answer", "reward", "rewards", "advantage",
               "logprob_gap", "truncated", "tool_calls", "errors", "completion"]
    rows = [[r["step"], r["kind"], r["group"], r["sample"], r["task"]["messages"][-1]["content"][:max_chars],
             r["task"]["answer"], r["reward"], json.dumps(strict_json(r["rewards"])), r["advantage"],
             r["logprob_gap"], r["truncated"], r["num_tool_calls"], r["num_errors"], r["completion"][:max_chars]]
            for r in records]
    return columns, strict_json(rows)


def rollouts_markdown(records: list[dict[str, Any]], max_rows: int = 16) -> str:
    """A Markdown table of the first `max_rows` records (TensorBoard's text tab renders it)."""
    columns, rows = rollout_rows(records[:max_rows], max_chars=300)
    keep = ("group", "sample", "task", "reward", "advantage", "truncated", "completion")
    index = [columns.index(c) for c in keep]

    def cell(value: Any) -> str:
        text = f"{value:.3f}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(keep) + " |", "|" + "---|" * len(keep)]
    lines += ["| " + " | ".join(cell(row[i]) for i in index) + " |" for row in rows]
    return "\n".join(lines)


class RolloutFile:
    """rollouts.jsonl of one run directory: replaced by a fresh run, appended to on resume."""

    def __init__(self, run_dir: str | Path, append: bool = False) -> None:
        self.path = Path(run_dir) / ROLLOUTS_FILE
        if not append:
            self.path.unlink(missing_ok=True)
        self._fh = None

    def write(self, records: list[dict[str, Any]]) -> None:
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("a", encoding="utf-8")
        self._fh.writelines(dumps(r) + "\n" for r in records)
        self._fh.flush()

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after `step` (a resumed run writes them again); atomic rewrite."""
        if not self.path.exists():
            return
        self.close()
        kept = [r for r in read_rollouts(self.path) if r.get("step", 0) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(dumps(r) + "\n" for r in kept), encoding="utf-8")
        tmp.replace(self.path)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
