"""The RL trainer: GRPO and its variants, and PPO with a critic, in one loop.

Each step follows the algorithm box of GRPO (Shao et al., 2024):

    1. sample prompts from the task pool
    2. roll out a group of G attempts per prompt with the current policy (π_old)
    3. score every attempt with the reward functions
    4. compute advantages: within each group, or with PPO's critic (one `Advantage` interface)
    5. μ inner updates of the clipped surrogate, new logprobs recomputed with gradients
    6. evaluate on held-out tasks, checkpoint, log

Simplifications, stated as nanochat does: the sampler and the learner share one module in
one process (`HFEngine.sync_weights` is where a separate engine would receive weights).
Old logprobs: with one pass and one mini-batch (μ = 1, the default) the update is on-policy,
π_old = π_θ, and the loss uses a detached copy of the learner's own logprobs (ρ = 1 exactly,
docs/algorithms.md#on-policy); the sampler's logprobs then only feed
`train/sampler_logprob_gap`, which measures sampler/learner disagreement (bf16 rounding, a
separate engine). With μ > 1 old logprobs are the sampler's, or a learner forward when
`recompute_old_logprobs` is set.

Past one process (docs/scaling.md): the rollout may be a `tamer.scale.RayRollout` (same
interface), the update runs through a `tamer.scale.learner.Learner` (DDP/FSDP2 ranks: row shards,
all-reduced denominators), and with `max_staleness` k > 0 a producer thread samples up to k steps
ahead (`tamer.trainers.producer`; docs/algorithms.md#off-policy-by-k). The defaults are this loop.

Speed (docs/performance.md): the learner forwards each group's shared prompt once
(`share_prompt_prefix`), the reference forward runs only when β > 0, and `precision: bf16`
runs sampler and learner under bf16 autocast with fp32 master weights.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tamer.algorithms import (
    ADVANTAGES,
    AGGREGATIONS,
    BEHAVIOUR_WEIGHTS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    aggregate,
    behaviour_weights,
    bind,
    get_policy_loss_fn,
    kl_penalty,
    masked_mean,
    zero_spread_groups,
)
from tamer.algorithms.mismatch import truncated_importance_weights
from tamer.checkpoint import load_checkpoint, save_checkpoint
from tamer.config import FieldError, check_name
from tamer.evaluate import EvalConfig, evaluate
from tamer.memory import keep_freed_memory
from tamer.models import (
    PRECISIONS,
    AdapterFreeView,
    autocast,
    is_lora,
    shared_prefix_logprobs,
    stop_token_ids,
    token_logprobs,
)
from tamer.rewards import RewardComposer
from tamer.rollout.agent import AgentConfig
from tamer.rollout.engine import GenerationEngine, HFEngine
from tamer.rollout.runner import Rollout
from tamer.rollout.types import SamplingParams, Trajectory
from tamer.rollout_log import RolloutLogConfig, RolloutRecorder
from tamer.scale.learner import CallModule, Learner
from tamer.stopping import TrainingStopped
from tamer.tasks.base import Task, TaskPool
from tamer.trainers.advantage import Advantage, GroupAdvantage
from tamer.trainers.batch import Batch, collate, micro_batches
from tamer.trainers.common import OptimConfig, clip_and_step, make_optimizer, make_scheduler
from tamer.trainers.critic import Critic, CriticConfig

DYNAMIC_SAMPLING = ("off", "drop", "refill")
SAMPLING_SEEDS = ("batch", "trajectory")
CRITIC_ADVANTAGES = ("gae",)  # estimators that need PPO's value model


@dataclass(frozen=True)
class AlgorithmConfig:
    """Which estimator, loss and aggregation; names come from the algorithm registries."""

    advantage: str = "grpo"  # grpo | dr_grpo | rloo | reinforce_pp | turn_grpo (per turn) | gae (PPO: needs the critic)
    policy_loss: str = "ppo"  # ppo (clipped surrogate; GRPO, DAPO) | gspo
    aggregation: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm
    aggregation_constant: float = 0.0  # C for seq-mean-token-sum-norm; 0: max_new_tokens
    clip_eps_low: float = 0.2  # ε_low of the clipped ratio: clip(ρ, 1 − ε_low, 1 + ε_high)
    clip_eps_high: float = 0.2  # ε_high; 0.28 is DAPO's clip-higher
    dual_clip_c: float | None = None  # e.g. 3.0 bounds the loss for negative advantages (> 1; null: off)
    gspo_eps_low: float = 3e-4  # GSPO's ε_low for its sequence ratio
    gspo_eps_high: float = 4e-4  # GSPO's ε_high
    kl_coef: float = 0.0  # β; 0 means no reference model is loaded or run
    kl_estimator: str = "k3"  # k1 | k2 | k3
    dynamic_sampling: str = "off"  # off | drop (zero-spread groups) | refill (DAPO)
    max_refill_rounds: int = 4  # refill: extra rollout rounds per step at most
    behaviour_weight: str = "truncate"  # rl.max_staleness > 0: π_prox/π_behav per token, truncate (TIS) | mask | off
    behaviour_weight_cap: float = 2.0  # C of the behaviour weight: min(ρ, C), or 0 past C for mask

    def __post_init__(self) -> None:
        check_name("advantage", self.advantage, ADVANTAGES.names() + list(CRITIC_ADVANTAGES), "advantage estimator")
        check_name("policy_loss", self.policy_loss, POLICY_LOSSES.names(), "policy loss")
        check_name("aggregation", self.aggregation, AGGREGATIONS, "aggregation")
        check_name("kl_estimator", self.kl_estimator, KL_ESTIMATORS, "KL estimator")
        check_name("dynamic_sampling", self.dynamic_sampling, DYNAMIC_SAMPLING, "dynamic sampling mode")
        check_name("behaviour_weight", self.behaviour_weight, BEHAVIOUR_WEIGHTS, "behaviour weight")
        if self.behaviour_weight_cap <= 0:
            raise FieldError("behaviour_weight_cap", f"expected > 0, got {self.behaviour_weight_cap}")
        if self.kl_coef < 0:
            raise FieldError("kl_coef", f"expected >= 0, got {self.kl_coef}")
        if not 0 <= self.clip_eps_low < 1:
            raise FieldError("clip_eps_low", f"expected a value in [0, 1), got {self.clip_eps_low}")
        for name in ("clip_eps_high", "gspo_eps_low", "gspo_eps_high", "aggregation_constant"):
            if getattr(self, name) < 0:
                raise FieldError(name, f"expected >= 0, got {getattr(self, name)}")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            raise FieldError("dual_clip_c", f"expected > 1 (or null for off), got {self.dual_clip_c}")
        if self.max_refill_rounds < 0:
            raise FieldError("max_refill_rounds", f"expected >= 0, got {self.max_refill_rounds}")


@dataclass(frozen=True)
class RLConfig:
    """The RL loop: sampling, update schedule, evaluation and checkpoints."""

    steps: int = 100  # RL steps (one rollout batch and its updates each)
    prompts_per_step: int = 16  # tasks per step
    group_size: int = 8  # G attempts per prompt
    temperature: float = 1.0  # sampling temperature (the learner divides its logits by it too)
    top_p: float = 1.0  # nucleus sampling mass
    max_new_tokens: int = 32  # tokens per reply (per turn for agent tasks)
    ppo_epochs: int = 1  # μ: passes over each batch of rollouts
    mini_batches: int = 1  # optimizer steps per pass
    micro_batch_tokens: int = 8192  # padded tokens per forward/backward (gradient accumulation)
    recompute_old_logprobs: bool = False  # μ > 1: old logprobs from a learner forward, not the sampler
    precision: str = "fp32"  # fp32 | bf16 (autocast for sampler and learner; fp32 weights and optimizer)
    share_prompt_prefix: bool = True  # learner: forward each group's shared prompt once, not G times
    rollout_threads: int = 0  # intra-op threads while generating; 0 = the process's setting
    generation_batch: int = 256  # sequences generated at once (rollouts and evaluation); lower caps memory
    fast_forward: bool = True  # the lean forward in engine and learner where supported; False: HF forward
    reuse_sampler_activations: bool = True  # learner reuses the sampler's projection outputs where valid (on-policy)
    skip_zero_advantage: bool = True  # learner leaves out rows whose gradient is exactly 0 (A = 0, no KL term)
    engine: str = "hf"  # hf (tamer's decode loop) | vllm (VLLMEngine, settings in the run's `vllm:` section)
    tis_cap: float = 0.0  # truncated importance sampling cap C (>= 1) on π_learner/π_sampler; 0: off
    tis_level: str = "token"  # token | sequence (one weight per row)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-5))  # the policy's optimizer
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)  # estimator, loss, aggregation, KL
    critic: CriticConfig = field(default_factory=CriticConfig)  # used when algorithm.advantage = gae
    eval_every: int = 10  # steps between held-out evaluations; 0: only at the end
    checkpoint_every: int = 0  # steps between checkpoints; 0: no periodic checkpoints
    keep_checkpoints: int = 2  # newest checkpoints kept on disk
    seed: int = 0  # task order and sampling
    sampling_seed: str = field(  # batch: one stream per generate call |
        default="batch")  # trajectory: one per trajectory (Ray workers' mode)
    max_staleness: int = 0  # k: a producer samples up to k steps ahead of the learner (decoupled PPO); 0: synchronous

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "group_size", "max_new_tokens", "ppo_epochs", "mini_batches",
                     "micro_batch_tokens", "keep_checkpoints", "generation_batch"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"expected >= 1, got {getattr(self, name)}")
        if self.temperature <= 0:
            raise FieldError("temperature", f"expected > 0 (RL samples), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise FieldError("top_p", f"expected a value in (0, 1], got {self.top_p}")
        uses_critic = self.algorithm.advantage in CRITIC_ADVANTAGES
        if self.group_size < 2 and not uses_critic:
            raise FieldError("group_size", "group-relative advantages need at least 2 attempts per prompt")
        if self.tis_cap and not self.on_policy and not self.recompute_old_logprobs:
            raise FieldError("tis_cap", "with several updates per batch (ppo_epochs or mini_batches > 1) TIS needs "
                                        "rl.recompute_old_logprobs: true (π_old from the learner, π_sampler from "
                                        "the engine)")
        if self.critic.kl_in_reward > 0 and not uses_critic:
            raise FieldError("critic.kl_in_reward", "only PPO's critic (algorithm.advantage: gae) puts the KL in "
                                                    "the reward; for GRPO-style runs use algorithm.kl_coef")
        if self.mini_batches > self.prompts_per_step * self.group_size:
            raise FieldError("mini_batches", "more mini-batches than trajectories per step")
        for name in ("rollout_threads", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise FieldError(name, f"expected >= 0, got {getattr(self, name)}")
        check_name("precision", self.precision, PRECISIONS, "precision")
        check_name("engine", self.engine, ("hf", "vllm"), "engine")
        if self.tis_cap and self.max_staleness > 0:
            raise FieldError("tis_cap", "with max_staleness > 0 the behaviour weights already correct for the sampler "
                                        "(π_behav is the sampler's); set tis_cap=0")
        if self.tis_cap and self.tis_cap < 1:
            raise FieldError("tis_cap", f"expected 0 (off) or >= 1, got {self.tis_cap}")
        check_name("tis_level", self.tis_level, ("token", "sequence"), "TIS level")
        check_name("sampling_seed", self.sampling_seed, SAMPLING_SEEDS, "sampling seed mode")
        if self.max_staleness < 0:
            raise FieldError("max_staleness", f"expected >= 0 (0: synchronous), got {self.max_staleness}")

    @property
    def on_policy(self) -> bool:
        """One pass, one mini-batch: every update is taken at the weights that sampled."""
        return self.ppo_epochs == 1 and self.mini_batches == 1 and not self.recompute_old_logprobs

    @property
    def total_updates(self) -> int:
        """Optimizer steps over the whole run (for the LR schedule)."""
        return self.steps * self.ppo_epochs * self.mini_batches


# Policy losses that are 0, with a 0 gradient, wherever the advantage is 0 (a row with A = 0 can be left out).
ZERO_AT_ZERO_ADVANTAGE = ("ppo", "gspo")
LOSS_METRICS = ("train/policy_loss", "train/loss", "train/kl")  # averaged over all rows, left-out ones included


def zero_advantage_rows(batch: Batch) -> torch.Tensor:
    """(B,) bool: rows whose advantage is exactly 0 at every learned token (sequence or per-token advantages)."""
    adv = batch.advantages
    if adv.dim() == 1:
        return adv == 0
    return ~((adv != 0) & batch.loss_mask.bool()).any(-1)


def _unique_prompt_tokens(batch: Batch) -> float:
    """Prompt tokens of `batch` with each distinct prompt (`prefix_index`) counted once."""
    _, first = torch.unique(batch.prefix_index, return_inverse=True)
    return float(torch.zeros(int(first.max()) + 1, dtype=torch.long).scatter_(0, first, batch.prompt_lengths).sum())


def make_advantage(config: RLConfig, policy: PreTrainedModel, learner: Learner | None = None) -> Advantage:
    """The advantage step `config` names: PPO's critic, or a group-relative estimator."""
    if config.algorithm.advantage in CRITIC_ADVANTAGES:
        return Critic(policy, config.critic, config.total_updates, config.micro_batch_tokens, learner=learner)
    return GroupAdvantage(config.algorithm.advantage, config.algorithm)


def _step_seed(seed: int, step: int, round_: int = 0) -> int:
    # Sampling randomness is a function of (seed, step): a resumed run samples the same.
    return (seed * 1_000_003 + step * 997 + round_) % (2**63)


class RLTrainer:
    """Runs the loop above on one model; `train()` returns the final eval metrics."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        train_tasks: list[Task],
        heldout_tasks: list[Task],
        rewards: RewardComposer,
        config: RLConfig,
        eval_config: EvalConfig = EvalConfig(),
        *,
        run_dir: str | Path = "runs/rl",
        tracker=None,
        engine: GenerationEngine | None = None,
        agent: AgentConfig = AgentConfig(),
        rollout_log: RolloutLogConfig | None = None,
        rollout: Rollout | None = None,
        learner: Learner | None = None,
    ) -> None:
        keep_freed_memory()  # freed tensors' memory reused, not faulted in again each step (tamer.memory)
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.heldout, self.rewards, self.eval_config = heldout_tasks, rewards, eval_config
        self.run_dir, self.tracker = Path(run_dir), tracker
        self.pool = TaskPool(train_tasks, seed=config.seed)
        self.engine = engine or HFEngine(model, tokenizer.pad_token_id, max_batch=config.generation_batch,
                                        precision=config.precision, threads=config.rollout_threads,
                                        fast=config.fast_forward)
        # In-process generation, or another runner with Rollout's interface (tamer.scale.RayRollout).
        self.local_rollout = Rollout(self.engine, tokenizer, agent, seeding=config.sampling_seed)
        self.rollout = rollout or self.local_rollout
        self.stop_ids = stop_token_ids(tokenizer)
        # The strategy (tamer.scale.learner): one process, DDP or FSDP2 ranks; the loss runs through
        # `policy.forward`, the optimizer steps `policy.module` (the model itself in one process).
        self.learner = learner or Learner()
        self.policy = self.learner.wrap(model, lambda m: CallModule(m, self._logprobs))
        self.optimizer = make_optimizer(self.policy.module, config.optim)
        self.scheduler = make_scheduler(self.optimizer, config.optim, config.total_updates)
        self.advantage = make_advantage(config, model, self.learner)
        needs_ref = config.algorithm.kl_coef > 0 or self.advantage.needs_reference
        self.ref_model = self._frozen_copy(model) if needs_ref else None
        self.policy_loss = bind(get_policy_loss_fn(config.algorithm.policy_loss), config.algorithm)
        self.behaviour_weights = bind(behaviour_weights, config.algorithm)
        self.step = 0
        self.timings: dict[str, float] = {}  # seconds per phase of the current step (time/* metrics)
        self.last_eval: dict[str, float] = {}
        self._reported_reward_error = False
        self.recorder = RolloutRecorder(rollout_log, tokenizer, rewards, tracker) \
            if rollout_log and self.learner.is_main else None
        self.producer = None  # rl.max_staleness > 0: the thread that samples ahead (tamer.trainers.producer)

    @staticmethod
    def _frozen_copy(model: PreTrainedModel) -> PreTrainedModel:
        """π_ref: a frozen copy of the start model; for a LoRA model the same modules with the
        adapters off (its frozen base is the start model), which costs no memory."""
        if is_lora(model):
            return AdapterFreeView(model).eval()
        ref = copy.deepcopy(model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def held_models(self) -> list[torch.nn.Module]:
        """The models this trainer keeps in memory: policy, critic (unless shared), reference."""
        copies = ([self.ref_model] if self.ref_model is not None and not isinstance(self.ref_model, AdapterFreeView)
                  else [])
        return [self.model, *self.advantage.modules(), *copies]

    def trainable_parameters(self) -> int:
        """Parameters that receive updates (policy and critic), each counted once."""
        params = [*self.model.parameters(), *self.advantage.trainable_parameters()]
        return sum(p.numel() for p in {id(p): p for p in params if p.requires_grad}.values())

    # ---------------------------------------------------------------- the loop
    def train(self, initial_eval: dict[str, float] | None = None) -> dict[str, float]:
        """Run to `config.steps`; `initial_eval` (the start model's eval, if already known) saves one eval."""
        cfg = self.config
        if self.step == 0 and cfg.eval_every:  # the starting point of the accuracy curve
            self._log(initial_eval or self.evaluate(), 0)
        while self.step < cfg.steps:
            metrics = self.train_step()
            step = self.step
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
                metrics.update(self.evaluate())  # 6: held-out evaluation
            self._log(metrics, step)
            stop = self.learner.should_stop() and step < cfg.steps  # SIGTERM/SIGINT: checkpoint, then stop
            if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or stop:
                saved = self.save_checkpoint()
            if stop:
                raise TrainingStopped("rl", step, saved, total_steps=cfg.steps)
        return self.last_eval

    def train_step(self) -> dict[str, float]:
        """One step of the algorithm box (1-5), without evaluation or checkpoints; returns its metrics.

        `time/*` metrics split the step: generate, score, logprobs (reference and old-logprob
        forwards), forward_backward, optimizer; rollout_s and update_s are its two halves.
        """
        step, self.timings = self.step + 1, {}
        with self._timed("rollout"):  # 1-3: sample, roll out, score (rank 0; the other ranks receive them)
            trajectories, metrics = self.learner.broadcast(self._next_rollouts(step) if self.learner.is_main else None)
        with self._timed("update"):
            if trajectories:
                batch = self.make_batch(trajectories)  # 4: advantages (+ reference logprobs)
                if self.recorder is not None:  # a sample of the groups to rollouts.jsonl, at the sampling weights
                    with self._timed("rollout_log"):
                        self.recorder.on_batch(step, trajectories, batch,
                                               lambda b: self._no_grad_logprobs(self.model, b))
                metrics |= self.update(batch, step) | self._token_counts(batch)  # 5: μ inner updates
                batch.replay = None  # the sampler's activations belong to the weights before this update
                for traj in trajectories:
                    traj.activations = None
        self.step = step
        if self.producer is not None:  # the new weights, for batches sampled from now on
            self.producer.publish(step, self.model)
        return metrics | self._step_metrics(skipped=not trajectories)

    def _next_rollouts(self, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        """This step's scored trajectories: collected now, or taken from the producer (rl.max_staleness > 0)."""
        if self.config.max_staleness == 0:
            return self.collect(step)
        if self.producer is None:
            from tamer.trainers.producer import Producer

            self.producer = Producer(self, start_step=step)
        return self.producer.take(step)

    def _step_metrics(self, skipped: bool) -> dict[str, float]:
        out = {f"time/{name}_s": seconds for name, seconds in self.timings.items()}
        out["train/lr"] = self.scheduler.get_last_lr()[0]
        if skipped:
            out["train/skipped_updates"] = 1.0
        return out

    def _token_counts(self, batch: Batch) -> dict[str, float]:
        """Tokens the step pushed through the model (for FLOP counts): sampled, prefilled, learned on (rows left
        out as zero-advantage not counted). The learner does not forward a micro-batch's last column (its
        logits predict past the end; logprobs.py): counted over the micro-batches as one mini-batch splits them."""
        live = self._rows_with_gradient(batch)
        out = {"tokens/generated": float(batch.loss_mask.sum()), "tokens/prefill": _unique_prompt_tokens(batch),
               "tokens/learner_rows_skipped": float(len(batch) - (0 if live is None else len(live)))}
        if live is None:
            return out | {"tokens/learner": 0.0, "tokens/replayed": 0.0}
        replayed = batch.replay is not None and any(record.used for record in batch.replay.records)
        completions = 0.0
        for micro in micro_batches(live, self.config.micro_batch_tokens):
            comp = micro.attention_mask.sum(-1) - micro.prompt_lengths
            completions += float(comp.clamp(max=int(comp.max()) - 1).sum())
        shared = self.config.share_prompt_prefix
        prompts = _unique_prompt_tokens(live) if shared else float(live.prompt_lengths.sum())
        return out | {"tokens/learner": completions + prompts,
                      "tokens/replayed": completions if replayed else 0.0}  # the learner's forward projections skipped

    @contextlib.contextmanager
    def _timed(self, name: str, timings: dict[str, float] | None = None):
        timings = self.timings if timings is None else timings
        start = time.perf_counter()
        try:
            yield
        finally:
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - start

    # ---------------------------------------------------------------- phases
    def sampling_params(self, step: int, round_: int = 0) -> SamplingParams:
        cfg = self.config
        return SamplingParams(n=cfg.group_size, temperature=cfg.temperature, top_p=cfg.top_p,
                              max_new_tokens=cfg.max_new_tokens, stop_token_ids=self.stop_ids,
                              seed=_step_seed(cfg.seed, step, round_))

    def collect(self, step: int, rollout: Rollout | None = None, version: int | None = None,
                timings: dict[str, float] | None = None) -> tuple[list[Trajectory], dict[str, float]]:
        """Roll out and score groups; with dynamic sampling keep only groups with spread.

        By default on this trainer's rollout at the current weights; the producer of an
        off-policy run passes its own `rollout`, already at weights `version`, and `timings`."""
        cfg, mode = self.config, self.config.algorithm.dynamic_sampling
        if rollout is None:
            rollout, version = self.rollout, self.step
            rollout.sync_weights(self.model, version)
        kept: list[Trajectory] = []
        seen: list[Trajectory] = []
        for round_ in range(1 + (cfg.algorithm.max_refill_rounds if mode == "refill" else 0)):
            missing = cfg.prompts_per_step - len(kept) // cfg.group_size
            tasks = self.pool.next_batch(missing)
            params = self.sampling_params(step, round_)
            if self._reuses_activations(rollout):
                params = dataclasses.replace(params, keep_activations=True)
            with self._timed("generate", timings):
                trajs = rollout.run(tasks, params, group_offset=len(seen) // cfg.group_size)
            with self._timed("score", timings):
                self._score(trajs)
            for t in trajs:
                t.policy_version = version  # the weights that sampled it: after `version` updates
            seen += trajs
            kept += trajs if mode == "off" else self._with_spread(trajs)
            if mode != "refill" or len(kept) // cfg.group_size >= cfg.prompts_per_step:
                break
        return kept, self._rollout_metrics(seen, kept) | rollout.metrics()

    def _reuses_activations(self, rollout) -> bool:
        """Whether the learner can take the sampler's projection outputs (tamer.models.replay): the update is
        the one optimizer step right after sampling (on-policy, synchronous) and the sampler is this
        process's lean engine on the learner's own module, in fp32 (the engine checks the rest); one
        learner process (ranks receive rank 0's trajectories pickled: records stay in their process)."""
        cfg = self.config
        return (cfg.reuse_sampler_activations and cfg.on_policy and cfg.max_staleness == 0 and cfg.fast_forward
                and self.learner.world == 1
                and cfg.share_prompt_prefix and cfg.precision == "fp32" and rollout is self.local_rollout
                and isinstance(self.engine, HFEngine) and self.engine.model is self.model
                and not any(getattr(m, "gradient_checkpointing", False) is True for m in self.model.modules()))

    def _score(self, trajs: list[Trajectory]) -> None:
        stats = self.rewards.score(trajs)
        if stats.first_traceback and not self._reported_reward_error and self.tracker is not None:
            self._reported_reward_error = True  # the first traceback once; the count is in every log line
            self.tracker.print(f"[reward error, counted and scored as default]\n{stats.first_traceback}")

    @staticmethod
    def _with_spread(trajs: list[Trajectory]) -> list[Trajectory]:
        rewards = torch.tensor([t.reward for t in trajs])
        zero = zero_spread_groups(rewards, torch.tensor([t.group_id for t in trajs]))
        return [t for t, z in zip(trajs, zero.tolist()) if not z]

    def _rollout_metrics(self, seen: list[Trajectory], kept: list[Trajectory]) -> dict[str, float]:
        n = len(seen)
        rewards = torch.tensor([t.reward for t in seen])
        zero = zero_spread_groups(rewards, torch.tensor([t.group_id for t in seen]))
        out = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if n > 1 else 0.0,
               "rollout/zero_spread_frac": float(zero.float().mean()),
               "rollout/mean_length": sum(t.num_generated for t in seen) / n,
               "rollout/truncated_frac": sum(t.truncated for t in seen) / n,
               "rollout/trajectories": float(n), "rollout/kept": float(len(kept)),
               "rollout/tool_calls": sum(t.num_tool_calls for t in seen) / n,
               "rollout/errors": sum(t.num_errors for t in seen) / n,
               "reward/errors_total": float(self.rewards.total_errors)}
        out.update({f"reward/errors/{k}": float(v) for k, v in self.rewards.errors_by_name.items()})
        for name in seen[0].rewards:
            out[f"reward/{name}"] = sum(t.rewards[name] for t in seen) / n
        return out

    def make_batch(self, trajectories: list[Trajectory]) -> Batch:
        """Collate, reference (and recomputed old) logprobs when needed, then advantages."""
        batch = collate(trajectories, torch.zeros(len(trajectories)), self.tokenizer.pad_token_id,
                        process_weight=self.rewards.config.weights.get("process", 0.0),
                        turns=self.advantage.per_turn)
        with self._timed("logprobs"):
            if self.ref_model is not None:
                batch.ref_logprobs = self._no_grad_logprobs(self.ref_model, batch)
            batch.sampler_logprobs = batch.old_logprobs  # what the engine reported; old_logprobs may be recomputed
            if self.config.max_staleness > 0:  # the sampler's logprobs are π_behav; π_prox is the learner's
                batch.behaviour_logprobs = batch.old_logprobs.clone()
            if self.config.recompute_old_logprobs or (self.config.max_staleness > 0 and not self.config.on_policy):
                batch.old_logprobs = self._no_grad_logprobs(self.model, batch)
            self.advantage.compute(batch)
        return batch

    def _logprobs(self, model: PreTrainedModel, batch: Batch) -> torch.Tensor:
        """Learner logprobs (B, T) float32 of `batch` under `model`, in the configured precision."""
        cfg = self.config
        with autocast(cfg.precision, batch.input_ids.device):
            # every micro-batch the same way, whatever its row count: under FSDP2 the ranks' forwards (two
            # here: prompts, then completions) must issue the same collectives
            if cfg.share_prompt_prefix and batch.prefix_index is not None:
                replay = batch.replay if model is self.model else None  # recorded from this model's weights
                return shared_prefix_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_lengths,
                                              batch.prefix_index, cfg.temperature, fast=cfg.fast_forward,
                                              replay=replay)
            return token_logprobs(model, batch.input_ids, batch.attention_mask, cfg.temperature, fast=cfg.fast_forward)

    @torch.no_grad()
    def _no_grad_logprobs(self, model: PreTrainedModel, batch: Batch) -> torch.Tensor:
        out = torch.zeros_like(batch.old_logprobs)
        lengths = batch.attention_mask.sum(-1)
        for micro, rows in micro_batches(batch, self.config.micro_batch_tokens, with_rows=True):
            lp = self._logprobs(model, micro)
            out[rows, :lp.shape[1]] = lp * (torch.arange(lp.shape[1])[None, :] < lengths[rows, None])
        return out

    def update(self, batch: Batch, step: int) -> dict[str, float]:
        """μ passes over the batch, each split into mini-batches; one optimizer step per mini-batch."""
        cfg = self.config
        self.policy.forward.train()
        generator = torch.Generator().manual_seed(_step_seed(cfg.seed, step, 10_000))
        sums: dict[str, float] = {}
        updates = 0
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(len(batch), generator=generator)
            for rows in order.chunk(cfg.mini_batches):
                for key, value in self._mini_batch_step(batch.select(rows)).items():
                    sums[key] = sums.get(key, 0.0) + value
                updates += 1
        self.policy.forward.eval()
        self.learner.publish(self.policy, self.model)  # FSDP2: the full weights back into the sampler's model
        return {key: value / updates for key, value in sums.items()}

    def _mini_batch_step(self, mini: Batch) -> dict[str, float]:
        """Gradients of the loss over the mini-batch's micro-batches, the advantage's own update, one step.

        With N learner ranks each takes a row shard (`learner.local`); the denominator is the
        global count (all-reduced) and every rank runs as many micro-batches as the busiest one,
        so the summed gradient is the one-rank gradient (docs/scaling.md#distributed-learner).
        """
        seq_mode = self.config.algorithm.aggregation != "token-mean"
        count = (lambda b: float((b.loss_mask.sum(-1) > 0).sum())) if seq_mode else (lambda b: float(b.loss_mask.sum()))
        mini = self.learner.local(mini)
        total = max(self.learner.all_reduce_sum(count(mini)), 1.0)
        sums: dict[str, float] = {}
        live = self._rows_with_gradient(mini)  # the denominator above still counts the rows left out
        micros = [m for m in micro_batches(live, self.config.micro_batch_tokens) if count(m) > 0] if live else []
        # the losses are means over every row (a left-out row's loss is 0); other metrics over the rows run
        run = (max(self.learner.all_reduce_sum(sum(count(m) for m in micros)), 1.0) if self.skips_zero_advantage
               else total)
        micros = self.learner.pad_micro_batches(micros, mini)
        for i, micro in enumerate(micros):
            share = count(micro)  # the micro-batch's part of the mini-batch's denominator: share / total
            with self._timed("forward_backward"), self.learner.accumulate(self.policy, last=i == len(micros) - 1):
                loss, metrics = self.loss(micro)
                (loss * share / total * self.learner.grad_scale).backward()
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value * share / (total if key in LOSS_METRICS else run)
        if not micros:  # every row left out (on every rank): the loss is 0, and the optimizer still steps
            sums.update({"train/policy_loss": 0.0, "train/loss": 0.0})  # (momentum, decay) on zero gradients
            for p in self.policy.module.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        sums = self.learner.all_reduce_metrics(sums)
        sums.update(self.advantage.update(mini))  # the critic; before the step: a shared trunk's grads join it
        with self._timed("optimizer"):
            sums["train/grad_norm"] = clip_and_step(self.policy.module, self.optimizer, self.scheduler,
                                                    self.config.optim.max_grad_norm)
        return sums

    @property
    def skips_zero_advantage(self) -> bool:
        """Whether a row with A = 0 at every learned token adds exactly 0 to the gradient, and is left out:
        the clipped surrogate (ppo, gspo) is -A·ρ-shaped, so 0 with a 0 gradient at A = 0, and no KL term
        adds its own gradient (β = 0). docs/algorithms.md#zero-advantage-rows"""
        alg = self.config.algorithm
        return self.config.skip_zero_advantage and alg.kl_coef == 0 and alg.policy_loss in ZERO_AT_ZERO_ADVANTAGE

    def _rows_with_gradient(self, batch: Batch) -> Batch | None:
        """The rows of `batch` the learner runs: `batch` itself, or without its zero-advantage rows when
        `skips_zero_advantage`; None if no row is left."""
        keep = ~zero_advantage_rows(batch) if self.skips_zero_advantage else None
        if keep is None or bool(keep.all()):
            return batch
        return batch.select(keep.nonzero().flatten()) if bool(keep.any()) else None

    def loss(self, micro: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro-batch's loss (policy surrogate, aggregated, + β·KL) and its metrics."""
        alg = self.config.algorithm
        constant = alg.aggregation_constant or float(self.config.max_new_tokens)
        logprobs = self.policy.forward(micro)
        old_logprobs = micro.old_logprobs
        metrics = {}
        if self.config.on_policy:  # π_old = π_θ: ρ = 1 in value, ∇ρ = ∇ log π_θ
            old_logprobs = logprobs.detach()
            gap = (logprobs.detach() - micro.old_logprobs).abs()
            metrics["train/sampler_logprob_gap"] = float(masked_mean(gap, micro.loss_mask))
        loss_matrix, parts = self.policy_loss(logprobs, old_logprobs, micro.advantages, micro.loss_mask)
        if micro.behaviour_logprobs is not None:  # off-policy by k: decoupled PPO's behaviour weight
            weights, stats = self.behaviour_weights(old_logprobs, micro.behaviour_logprobs, micro.loss_mask)
            loss_matrix = loss_matrix * weights
            metrics.update({f"offpolicy/{k}": float(v) for k, v in stats.items()})
        elif self.config.tis_cap:  # the engine sampled from π_sampler ≠ π_old: reweight (docs/algorithms.md#tis)
            weights, tis = truncated_importance_weights(old_logprobs, micro.sampler_logprobs, micro.loss_mask,
                                                        cap=self.config.tis_cap, level=self.config.tis_level)
            loss_matrix = loss_matrix * weights
            metrics.update({f"mismatch/{k}": float(v) for k, v in tis.items()})
        loss = aggregate(loss_matrix, micro.loss_mask, alg.aggregation, constant=constant)
        metrics["train/policy_loss"] = loss.item()
        metrics.update({f"train/{k}": float(v) for k, v in parts.items()})
        if micro.ref_logprobs is not None and alg.kl_coef > 0:
            kl = aggregate(kl_penalty(logprobs, micro.ref_logprobs, alg.kl_estimator), micro.loss_mask,
                           alg.aggregation, constant=constant)
            loss = loss + alg.kl_coef * kl
            metrics["train/kl"] = kl.item()
        metrics["train/loss"] = loss.item()
        return loss, metrics

    def close(self) -> None:
        """Stop the producer thread and the rollout workers, if any (idempotent)."""
        if self.producer is not None:
            self.producer.close()
        close = getattr(self.rollout, "close", None)
        if close is not None:
            close()

    # ---------------------------------------------------------------- evaluation, checkpoints, logs
    def evaluate(self) -> dict[str, float]:
        if not self.learner.is_main:  # rank 0 evaluates and logs
            return {}
        # With a producer sampling ahead, evaluation runs here, on the learner's current weights.
        rollout = self.rollout if self.config.max_staleness == 0 else self.local_rollout
        rollout.sync_weights(self.model, self.step)
        report = evaluate(rollout, self.heldout, self.eval_config, self.stop_ids)
        self.last_eval = report.metrics()
        if self.recorder is not None:
            self.recorder.on_eval(self.step, report.trajectories)
        return self.last_eval

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.tracker is not None:
            self.tracker.log(metrics, step)

    def save_checkpoint(self) -> Path:
        """Rank 0 writes the full model and optimizer state (gathered from every rank under FSDP2)."""
        optimizer = self.learner.checkpoint_optimizer(self.policy, self.optimizer)
        pool = self.producer.pool_state() if self.producer is not None else self.pool.state_dict()
        state = {"pool": pool, "reward_errors": self.rewards.total_errors,
                 "last_eval": self.last_eval, "advantage": self.advantage.state_dict()}
        if not self.learner.is_main:
            return self.run_dir / "checkpoints"
        return save_checkpoint(self.run_dir / "checkpoints", self.step, model=self.model, optimizer=optimizer,
                               scheduler=self.scheduler, state=state, keep_last=self.config.keep_checkpoints,
                               tokenizer=self.tokenizer)

    def resume(self, path: str | Path) -> int:
        """Continue from a checkpoint directory; returns the step it resumes after."""
        optimizer = self.learner.checkpoint_optimizer(self.policy, self.optimizer, gather=False)
        state = load_checkpoint(path, model=self.model, optimizer=optimizer, scheduler=self.scheduler)
        if self.policy.module is not self.model:  # FSDP2: shard the loaded weights into the learner's copy
            self.learner.load_module_state(self.policy, self.model.state_dict())
        self.pool.load_state_dict(state["pool"])
        self.rewards.total_errors = state.get("reward_errors", 0)
        self.last_eval = state.get("last_eval", {})
        self.advantage.load_state_dict(state.get("advantage", {}))
        # The reference model stays the policy this trainer was built from (the run's start).
        self.step = state["step"]
        return self.step
