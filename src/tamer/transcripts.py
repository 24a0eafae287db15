"""Held-out episodes as text: what `tamer eval --show N` prints.

    records = episode_records(report.trajectories[:5], tokenizer, RewardComposer(config.reward))
    print_episodes(console, records)

Each episode shows the task, every assistant turn, its tool calls with their arguments, what
the tools returned (and errors), how the episode ended, and the reward breakdown: each reward
function's score times its weight. The records are those of `rollouts.jsonl`
(tamer.rollout_log), so the console and `tamer view` show the same thing.
"""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.text import Text

from tamer.rollout_log import TokenTexts, strict_json, trajectory_record


def episode_records(trajectories, tokenizer, rewards=None) -> list[dict[str, Any]]:
    """Records (the rollouts.jsonl fields) of held-out trajectories, scored by every reward function."""
    texts = TokenTexts(tokenizer)
    weights = dict(rewards.config.weights) if rewards is not None else {}
    out = []
    for traj in trajectories:
        total, scores = rewards.breakdown(traj) if rewards is not None else (traj.reward, traj.rewards)
        out.append(strict_json(trajectory_record(traj, texts, kind="eval", step=0, rewards=scores,
                                                 reward=total, weights=weights)))
    return out


def _breakdown(record: dict[str, Any]) -> str:
    parts = []
    for name, score in record["rewards"].items():
        weight = record.get("weights", {}).get(name)
        parts.append(f"{name} {score:.3g}" + (f" x {weight:g}" if weight is not None else ""))
    return ", ".join(parts)


def episode_panel(index: int, record: dict[str, Any]) -> Panel:
    """One episode as a Rich panel."""
    body: list[Any] = []
    for message in record["task"]["messages"]:
        body.append(Text.assemble((f"{message['role']}: ", "bold"), message["content"]))
    for i, turn in enumerate(record["turns"], start=1):
        body.append(Text.assemble((f"assistant (turn {i}): ", "bold cyan"), turn["text"]))
        for call in turn["tool_calls"]:
            body.append(Text(f"  -> {call.get('name')}({json.dumps(call.get('arguments'))})", style="blue"))
        for error in turn["errors"]:
            body.append(Text(f"  error: {error}", style="red"))
        for result in turn["tool_results"]:
            body.append(Text(f"  <- {result}", style="green"))
    end = f"finish: {record['finish_reason']}" + (" (truncated)" if record["truncated"] else "")
    facts = {k: v for k, v in record.get("info", {}).items() if k in ("success", "cost", "optimal_cost", "env_error")}
    if facts:
        end += "  " + "  ".join(f"{k}: {v}" for k, v in facts.items())
    body.append(Text(end, style="dim"))
    body.append(Text(f"reward {record['reward']:.3g} = {_breakdown(record)}; "
                     f"reference answer: {record['task']['answer']}", style="bold"))
    title = f"episode {index} · {escape(str(record['task']['id']))} · reward {record['reward']:.3g}"
    return Panel(Group(*body), title=title, title_align="left")


def print_episodes(console: Console, records: list[dict[str, Any]]) -> None:
    for i, record in enumerate(records, start=1):
        console.print(episode_panel(i, record))
