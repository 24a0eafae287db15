"""The trainer's advantage step, one interface for both kinds of baseline.

Built once from the config (`tamer.trainers.rl.make_advantage`), then used the same way by
every algorithm:

    advantage.compute(batch)          # sets batch.advantages ((B,) or (B, T)), for the critic also
                                      # batch.old_values and batch.returns
    metrics = advantage.update(mini)  # per mini-batch, before the policy's optimizer step
                                      # (the critic's value-loss step; {} for group estimators)

`GroupAdvantage` wraps a group-relative estimator of `tamer.algorithms.ADVANTAGES` (GRPO,
Dr. GRPO, RLOO, REINFORCE++, and per-turn GRPO); `tamer.trainers.critic.Critic` is PPO's (GAE with a value model).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from tamer.algorithms import PER_TURN, bind, get_advantage_fn
from tamer.trainers.batch import Batch


class Advantage(Protocol):
    needs_reference: bool  # compute() reads batch.ref_logprobs (a KL penalty in the reward)
    per_turn: bool  # compute() reads batch.turn_ids and batch.turn_rewards (collate builds them only then)

    def compute(self, batch: Batch) -> None: ...

    def update(self, mini: Batch) -> dict[str, float]: ...

    def modules(self) -> list[torch.nn.Module]: ...

    def trainable_parameters(self) -> list[torch.nn.Parameter]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class GroupAdvantage:
    """Advantages relative to each group's other samples; nothing to train, nothing to hold."""

    needs_reference = False

    def __init__(self, name: str, hparams: Any) -> None:
        self.name = name
        self.fn = bind(get_advantage_fn(name), hparams)  # hyperparameters from same-named config fields
        self.per_turn = name in PER_TURN  # also reads each token's turn and each turn's process reward

    def compute(self, batch: Batch) -> None:
        if self.per_turn:
            batch.advantages = self.fn(batch.rewards, batch.group_ids, batch.loss_mask, batch.turn_ids,
                                       batch.turn_rewards).float()
        else:
            batch.advantages = self.fn(batch.rewards, batch.group_ids, batch.loss_mask).float()

    def update(self, mini: Batch) -> dict[str, float]:
        return {}

    def modules(self) -> list[torch.nn.Module]:
        return []

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return []

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
