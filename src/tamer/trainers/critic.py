"""PPO's critic: a value model, the advantages it gives (GAE) and its clipped value-loss update.

By default the critic is a separate model as large as the policy (a copy of its architecture
and weights with a scalar value head) — the memory GRPO saves by dropping it. `shared=True`
puts the value head on the policy's own trunk instead (one model, two heads): the value
loss's gradient on the trunk is then stepped by the policy's optimizer, in the same step as
the policy loss's (one combined loss, as shared actor-critic implementations do), so the
critic must update before the policy's optimizer steps. With a LoRA policy, `adapter=True` gives
the critic its own LoRA adapter on the policy's frozen base (one copy of the base weights, the
critic's adapter active only while values are computed); a separate critic copies the base and
trains its own copy of the adapter.

The critic implements the trainer's advantage interface (`tamer.trainers.advantage`):

    critic = Critic(policy, CriticConfig(), total_updates=100, micro_batch_tokens=8192)
    critic.compute(batch)                     # batch.old_values, batch.advantages, batch.returns
    metrics = critic.update(mini)             # one optimizer step of the value loss

With learner ranks (`tamer.scale.learner`) the separate critic is wrapped like the policy (DDP
or FSDP2), each rank updates on its row shard and the value loss's denominator is all-reduced;
a shared trunk needs one process.

Formulas: docs/algorithms.md#ppo-with-a-critic.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from tamer.algorithms import critic_advantages, kl_penalty, value_loss
from tamer.config import ConfigError, FieldError
from tamer.models.lora import active_adapter, add_adapter, is_lora
from tamer.scale.learner import Learner
from tamer.trainers.batch import Batch, micro_batches
from tamer.trainers.common import OptimConfig, clip_and_step, make_optimizer, make_scheduler


@dataclass(frozen=True)
class CriticConfig:
    """The value model of PPO and its optimisation."""

    shared: bool = False  # True: value head on the policy trunk; False: a separate model of the same size
    adapter: bool = False  # LoRA policies: the critic's own adapter on the policy's frozen base (no second copy)
    gamma: float = 1.0  # GAE discount per generated token
    lam: float = 0.95  # GAE λ: 0 one-step TD, 1 Monte-Carlo returns
    value_clip_eps: float = 0.2  # clip V around V_old by this much in the value loss; 0 disables
    kl_in_reward: float = 0.0  # β of classic RLHF-PPO: per-token −β·k1 added to the rewards
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))  # the critic's own optimizer

    def __post_init__(self) -> None:
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise FieldError(name, f"expected a value in [0, 1], got {getattr(self, name)}")
        if self.value_clip_eps < 0:
            raise FieldError("value_clip_eps", f"expected >= 0 (0 disables clipping), got {self.value_clip_eps}")
        if self.kl_in_reward < 0:
            raise FieldError("kl_in_reward", f"expected >= 0, got {self.kl_in_reward}")
        if self.adapter and self.shared:
            raise FieldError("adapter", "the critic has its own adapter or shares the policy's trunk, not both")


CRITIC_ADAPTER = "critic"


class ValueModel(torch.nn.Module):
    """A causal-LM trunk with a scalar head: V(s_t) for every position t.

    s_t is the state before token t is generated (tokens < t), so V(s_t) comes from the hidden
    state at position t − 1, as in GAE's δ_t = r_t + γ V(s_{t+1}) − V(s_t): a value that had
    read token t would be a baseline that depends on the action it scores. Position 0 gets 0
    (it is never a generated token).
    """

    def __init__(self, trunk: torch.nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.trunk = trunk
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=positions).last_hidden_state
        after = self.head(hidden.float()).squeeze(-1)  # (B, T): value after reading token t
        return torch.cat([torch.zeros_like(after[:, :1]), after[:, :-1]], dim=1)  # (B, T): V(s_t)


class Critic:
    """PPO's advantage: values for GAE and a value-loss update, on a separate or a shared trunk."""

    def __init__(self, policy: PreTrainedModel, config: CriticConfig, total_updates: int, micro_batch_tokens: int,
                 learner: Learner | None = None) -> None:
        self.config = config
        self.needs_reference = config.kl_in_reward > 0  # the KL penalty in the reward needs π_ref
        self.per_turn = False  # GAE reads per-token rewards, not turns
        self.policy = policy
        self.learner = learner or Learner()
        if (config.shared or config.adapter) and self.learner.world > 1:
            raise ValueError("critic.shared / critic.adapter: a value head on the policy's trunk needs one learner "
                             "process (scale.learner_ranks = 1); use a separate critic with learner ranks")
        if config.adapter and not is_lora(policy):
            raise ConfigError("rl.critic.adapter: needs a LoRA policy (model.lora.r > 0)")
        adapter = add_adapter(policy, CRITIC_ADAPTER) if config.adapter else []
        trunk = policy.get_decoder() if config.shared or config.adapter else copy.deepcopy(policy.get_decoder())
        self.wrapped = self.learner.wrap(ValueModel(trunk, policy.config.hidden_size), lambda m: m)
        self.model = self.wrapped.module  # the value model (under fsdp2: sharded); forwards go through `wrapped`
        params = list(self.model.head.parameters()) + adapter if config.shared or config.adapter \
            else list(self.model.parameters())
        # A shared trunk is stepped by the policy's optimizer too; the critic's owns the head only.
        self.optimizer = make_optimizer(_Params(params), config.optim)
        self.scheduler = make_scheduler(self.optimizer, config.optim, total_updates)
        self.micro_batch_tokens = micro_batch_tokens

    def modules(self) -> list[torch.nn.Module]:
        """The models this advantage holds beyond the policy (none when the trunk is shared)."""
        return [] if self.config.shared or self.config.adapter else [self.model]

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """Every parameter the value loss trains (a shared trunk's are the policy's too)."""
        return list(self.model.parameters())

    def state_dict(self) -> dict:
        """Full (unsharded) state; collective under FSDP2 (every rank calls it)."""
        if self.config.adapter:  # the head and the critic's adapter; the base is the policy's own
            model = {"head": self.model.head.state_dict(),
                     "adapter": {k: v for k, v in self.model.state_dict().items() if f".{CRITIC_ADAPTER}." in k}}
            return {"model": model, "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        return {"model": self.learner.module_state(self.wrapped),
                "optimizer": self.learner.checkpoint_optimizer(self.wrapped, self.optimizer).state_dict(),
                "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.config.adapter:
            self.model.head.load_state_dict(state["model"]["head"])
            self.model.load_state_dict(state["model"]["adapter"], strict=False)
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            self.learner.load_module_state(self.wrapped, state["model"])
            self.learner.checkpoint_optimizer(self.wrapped, self.optimizer,
                                              gather=False).load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def compute(self, batch: Batch) -> None:
        """V_old, then GAE advantages (whitened) and returns for `batch` (set on it, (B, T) each)."""
        batch.old_values = self.values(batch)
        kl = kl_penalty(batch.old_logprobs, batch.ref_logprobs, "k1") if self.needs_reference else None
        batch.advantages, batch.returns = critic_advantages(
            batch.rewards, batch.old_values, batch.loss_mask, gamma=self.config.gamma, lam=self.config.lam,
            kl=kl, kl_coef=self.config.kl_in_reward)

    def _active(self):
        """The critic's adapter active on the shared base while it runs (a no-op without one)."""
        return active_adapter(self.policy, CRITIC_ADAPTER) if self.config.adapter else contextlib.nullcontext()

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        with self._active():
            return self._values(batch)

    def _values(self, batch: Batch) -> torch.Tensor:
        out = torch.zeros_like(batch.old_logprobs)
        rows = max(1, self.micro_batch_tokens // max(1, batch.input_ids.shape[1]))
        for start in range(0, len(batch), rows):
            sl = slice(start, start + rows)
            out[sl] = self.wrapped.forward(batch.input_ids[sl], batch.attention_mask[sl]) * batch.loss_mask[sl]
        return out

    def update(self, mini: Batch) -> dict[str, float]:
        """One optimizer step of the clipped value loss on a mini-batch."""
        with self._active():
            return self._update(mini)

    def _update(self, mini: Batch) -> dict[str, float]:
        clip = self.config.value_clip_eps or None
        total = max(1.0, self.learner.all_reduce_sum(float(mini.loss_mask.sum())))  # global: every rank's tokens
        sums = {"critic/value_loss": 0.0, "critic/value_clip_frac": 0.0}
        micros = [m for m in micro_batches(mini, self.micro_batch_tokens) if float(m.loss_mask.sum()) > 0]
        micros = self.learner.pad_micro_batches(micros, mini)
        for i, micro in enumerate(micros):
            share = float(micro.loss_mask.sum()) / total
            with self.learner.accumulate(self.wrapped, last=i == len(micros) - 1):
                values = self.wrapped.forward(micro.input_ids, micro.attention_mask)
                loss, metrics = value_loss(values, micro.old_values, micro.returns, micro.loss_mask, clip_eps=clip)
                (loss * share * self.learner.grad_scale).backward()
            sums["critic/value_loss"] += loss.item() * share
            sums["critic/value_clip_frac"] += float(metrics["value_clip_frac"]) * share
        sums = self.learner.all_reduce_metrics(sums)
        sums["critic/grad_norm"] = clip_and_step(_Params(self.optimizer.param_groups[0]["params"]), self.optimizer,
                                                 self.scheduler, self.config.optim.max_grad_norm)
        return sums


class _Params(torch.nn.Module):
    """Adapter: a plain parameter list seen as a module (for the optimizer helpers)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self._plist = list(params)

    def parameters(self, recurse: bool = True):
        return iter(self._plist)
