"""The learner's view of a rollout: padded tensors built from trajectories.

Token positions follow the model's input: position t of `loss_mask`, `old_logprobs` and
`ref_logprobs` describes token t of `input_ids` (predicted from tokens < t). Prompt,
environment and padding positions have `loss_mask = 0` and never enter a loss.
`turn_ids` numbers the assistant turn each policy token belongs to (0, 1, ...; -1 on every
other position), for per-turn advantages (`turn_grpo`); `turn_rewards` is (B, K), per turn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tamer.models.replay import Replay
from tamer.rollout.types import Trajectory
from tamer.trainers.common import right_pad


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) long, right-padded
    attention_mask: torch.Tensor  # (B, T) long
    loss_mask: torch.Tensor  # (B, T) float32, 1 on policy-generated tokens
    old_logprobs: torch.Tensor  # (B, T) float32, log π_old at sampling time
    advantages: torch.Tensor  # (B,) or (B, T) float32
    group_ids: torch.Tensor  # (B,) long
    rewards: torch.Tensor  # (B,) float32
    prompt_lengths: torch.Tensor | None = None  # (B,) long, tokens before the first completion token
    prefix_index: torch.Tensor | None = None  # (B,) long, equal for rows with identical prompts
    ref_logprobs: torch.Tensor | None = None  # (B, T) float32, when KL is on
    sampler_logprobs: torch.Tensor | None = None  # (B, T) float32, the engine's, when old ones are recomputed
    old_values: torch.Tensor | None = None  # (B, T) float32, PPO's critic at rollout time
    returns: torch.Tensor | None = None  # (B, T) float32, PPO's value targets
    behaviour_logprobs: torch.Tensor | None = None  # (B, T) float32, the sampler's logprobs when off-policy by k
    turn_ids: torch.Tensor | None = None  # (B, T) long, the assistant turn of each policy token; -1 elsewhere
    turn_rewards: torch.Tensor | None = None  # (B, K) float32, each turn's weighted process reward (turn_grpo)
    replay: Replay | None = None  # the sampler's projection outputs per row (tamer.models.replay), when reusable

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def select(self, index: torch.Tensor | list[int]) -> Batch:
        """Rows `index` of every tensor, trimmed to the longest selected row."""
        index = torch.as_tensor(index, dtype=torch.long)
        width = int(self.attention_mask[index].sum(-1).max())
        fields = {}
        for name, value in self.__dict__.items():
            if value is None:
                fields[name] = None
                continue
            value = value[index]
            fields[name] = (value[:, :width] if isinstance(value, torch.Tensor) and value.dim() == 2
                            and name != "turn_rewards" else value)  # turn_rewards (B, K): per turn
        return Batch(**fields)


def collate(trajectories: list[Trajectory], advantages: torch.Tensor, pad_id: int,
            process_weight: float = 0.0, turns: bool = True) -> Batch:
    """Stack trajectories (prompt + completion) into one right-padded `Batch`.

    `turns` adds `turn_ids` and `turn_rewards` (per-turn estimators; the trainer asks only when
    its estimator reads them). `process_weight` is the weight of the `process` reward: each
    turn's environment reward times it goes into `turn_rewards`, the share of R_i earned at that
    turn (see `turn_rewards`)."""
    ids = [t.prompt_ids + t.completion_ids for t in trajectories]
    masks = [[0] * len(t.prompt_ids) + list(t.loss_mask) for t in trajectories]
    logprobs = [[0.0] * len(t.prompt_ids) + list(t.logprobs) for t in trajectories]
    prefixes: dict[tuple[int, ...], int] = {}
    prefix_index = [prefixes.setdefault(tuple(t.prompt_ids), len(prefixes)) for t in trajectories]
    return Batch(
        input_ids=right_pad(ids, pad_id, torch.long),
        attention_mask=right_pad([[1] * len(r) for r in ids], 0, torch.long),
        loss_mask=right_pad(masks, 0, torch.float32),
        old_logprobs=right_pad(logprobs, 0.0, torch.float32),
        advantages=advantages.float(),
        group_ids=torch.tensor([t.group_id for t in trajectories], dtype=torch.long),
        rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        prompt_lengths=torch.tensor([len(t.prompt_ids) for t in trajectories], dtype=torch.long),
        prefix_index=torch.tensor(prefix_index, dtype=torch.long),
        turn_ids=right_pad([[-1] * len(t.prompt_ids) + token_turns(t) for t in trajectories], -1, torch.long)
        if turns else None,
        turn_rewards=turn_rewards(trajectories, process_weight) if turns else None,
        replay=Replay.of([t.activations for t in trajectories]),
    )


def token_turns(traj: Trajectory) -> list[int]:
    """Per completion token: the index of the assistant turn that generated it, -1 for
    environment tokens. A turn's tokens are the next `Turn.generated` policy tokens."""
    sizes = [turn.generated for turn in traj.turns] or [len(traj.completion_ids)]
    out, turn, left = [], 0, sizes[0]
    for mask in traj.loss_mask:
        if not mask:
            out.append(-1)
            continue
        while left == 0 and turn + 1 < len(sizes):  # turns are consumed in order; skip empty ones
            turn, left = turn + 1, sizes[turn + 1]
        out.append(turn)
        left -= 1
    return out


def turn_rewards(trajectories: list[Trajectory], weight: float) -> torch.Tensor:
    """(B, K) float32: weight x each turn's environment (process) reward, 0 past a row's turns.

    `weight` is the `process` reward's weight, so row i sums to that reward's share of R_i.
    """
    rows = [[weight * turn.env_reward for turn in t.turns] or [0.0] for t in trajectories]
    return right_pad(rows, 0.0, torch.float32)


def micro_batches(batch: Batch, max_tokens: int, with_rows: bool = False) -> list:
    """Split into micro-batches of at most `max_tokens` padded tokens each.

    Rows are sorted by length first so that rows of similar length share a micro-batch:
    padding waste stays small without packing. `with_rows` also returns each micro-batch's
    row indices in `batch`, as `(micro, rows)` pairs.
    """
    lengths = batch.attention_mask.sum(-1)
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    chunks, current, width = [], [], 0
    for row in order:
        new_width = max(width, int(lengths[row]))
        if current and new_width * (len(current) + 1) > max_tokens:
            chunks.append(current)
            current, new_width = [], int(lengths[row])
        current.append(row)
        width = new_width
    if current:
        chunks.append(current)
    if with_rows:
        return [(batch.select(c), torch.tensor(c)) for c in chunks]
    return [batch.select(c) for c in chunks]
