"""PPO's critic: a value model, its per-token values and its clipped value-loss update.

By default the critic is a separate model as large as the policy (a copy of its
architecture and weights with a scalar value head) — the memory GRPO saves by dropping
it. `shared=True` puts the value head on the policy's own trunk instead (one model, two
heads; the value loss then also trains the trunk).

    critic = Critic(policy, CriticConfig())
    values = critic.values(batch)             # (B, T), no grad: V_old at rollout time
    metrics = critic.update(batch)            # value_loss on batch.returns / batch.old_values
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from tamer.algorithms import value_loss
from tamer.trainers.batch import Batch, micro_batches
from tamer.trainers.common import OptimConfig, clip_and_step, make_optimizer, make_scheduler


@dataclass(frozen=True)
class CriticConfig:
    """The value model of PPO and its optimisation."""

    shared: bool = False  # True: value head on the policy trunk; False: a separate model of the same size
    gamma: float = 1.0
    lam: float = 0.95
    value_clip_eps: float = 0.2  # 0 disables value clipping
    kl_in_reward: float = 0.0  # β of classic RLHF-PPO: per-token −β·k1 added to the rewards
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))

    def __post_init__(self) -> None:
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ValueError("rl.critic.gamma and rl.critic.lam must be in [0, 1]")
        if self.value_clip_eps < 0:
            raise ValueError("rl.critic.value_clip_eps: expected >= 0")


class ValueModel(torch.nn.Module):
    """A causal-LM trunk with a scalar head: V(token_t) for every position."""

    def __init__(self, trunk: torch.nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.trunk = trunk
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).last_hidden_state
        return self.head(hidden.float()).squeeze(-1)  # (B, T)


class Critic:
    """Values for GAE and a value-loss update, on a separate or a shared trunk."""

    def __init__(self, policy: PreTrainedModel, config: CriticConfig, total_updates: int, micro_batch_tokens: int) -> None:
        self.config = config
        trunk = policy.get_decoder() if config.shared else copy.deepcopy(policy.get_decoder())
        self.model = ValueModel(trunk, policy.config.hidden_size)
        params = list(self.model.head.parameters()) if config.shared else list(self.model.parameters())
        # A shared trunk is stepped by the policy's optimizer too; the critic's owns the head only.
        self.optimizer = make_optimizer(_Params(params), config.optim)
        self.scheduler = make_scheduler(self.optimizer, config.optim, total_updates)
        self.micro_batch_tokens = micro_batch_tokens

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        out = torch.zeros_like(batch.old_logprobs)
        rows = max(1, self.micro_batch_tokens // max(1, batch.input_ids.shape[1]))
        for start in range(0, len(batch), rows):
            sl = slice(start, start + rows)
            out[sl] = self.model(batch.input_ids[sl], batch.attention_mask[sl]) * batch.loss_mask[sl]
        return out

    def update(self, mini: Batch) -> dict[str, float]:
        """One optimizer step of the clipped value loss on a mini-batch."""
        clip = self.config.value_clip_eps or None
        total = max(1.0, float(mini.loss_mask.sum()))
        sums = {"critic/value_loss": 0.0, "critic/value_clip_frac": 0.0}
        for micro in micro_batches(mini, self.micro_batch_tokens):
            share = float(micro.loss_mask.sum()) / total
            if share == 0:
                continue
            values = self.model(micro.input_ids, micro.attention_mask)
            loss, metrics = value_loss(values, micro.old_values, micro.returns, micro.loss_mask, clip_eps=clip)
            (loss * share).backward()
            sums["critic/value_loss"] += loss.item() * share
            sums["critic/value_clip_frac"] += float(metrics["value_clip_frac"]) * share
        sums["critic/grad_norm"] = clip_and_step(_Params(self.optimizer.param_groups[0]["params"]), self.optimizer,
                                                 self.scheduler, self.config.optim.max_grad_norm)
        return sums


class _Params(torch.nn.Module):
    """Adapter: a plain parameter list seen as a module (for the optimizer helpers)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self._plist = list(params)

    def parameters(self, recurse: bool = True):  # noqa: D401 - nn.Module API
        return iter(self._plist)
