"""The jobs the CLI runs, as plain functions: SFT, RL, evaluation and the full demo.

    config = load_config(RunConfig, ["my.yaml"], ["rl.steps=50"])
    summary = run_demo(config)      # tiny model -> SFT -> GRPO -> held-out table

Every job writes under `config.output_dir`: metrics (JSONL + TensorBoard), models saved
with `save_pretrained`, and a `summary.json` of the measured figures. The pieces the jobs
share (`build_policy`, `evaluate_model`, `make_trainer`) are what `tamer compare` and
`tamer advise` call too, so every command runs a config the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tamer.config import FieldError, to_dict
from tamer.evaluate import EvalConfig, EvalReport, agent_metrics, demonstrator_accuracy, evaluate
from tamer.jobguard import guarded_job, summary_on_stop
from tamer.models import (
    DTYPES,
    ModelConfig,
    apply_lora,
    build_bpe_tokenizer,
    build_char_tokenizer,
    build_tiny_model,
    count_parameters,
    fold_adapter,
    load_model,
    save_model,
    stop_token_ids,
)
from tamer.preference_config import PreferenceDemoConfig
from tamer.resume import finished_phase, resume_trainer, wants_resume
from tamer.rewards import RewardComposer, RewardConfig
from tamer.rollout.agent import AgentConfig, AgentRollout
from tamer.rollout.engine import GenerationEngine, HFEngine
from tamer.rollout.engines import rl_engine
from tamer.rollout.runner import Rollout
from tamer.rollout.vllm.config import VLLMConfig
from tamer.rollout_log import RolloutRecorder
from tamer.scale import ScaleConfig
from tamer.scale.learner import Learner
from tamer.storage import preflight, write_json
from tamer.tasks import TaskConfig, get_task_source
from tamer.tasks.base import Task, TaskSource
from tamer.tracking import Tracker, TrackingConfig, plot_metrics, read_baselines, summary_baselines
from tamer.tracking_backends import open_sinks
from tamer.trainers.common import OptimConfig, seed_everything
from tamer.trainers.reward_model import RewardModelConfig
from tamer.trainers.rl import RLConfig, RLTrainer
from tamer.trainers.sft import SFTConfig, SFTTrainer, demonstration_texts, demonstrations
from tamer.transcripts import episode_records


@dataclass(frozen=True)
class RunConfig:
    """One run: model, task, rewards, the SFT and RL phases, and evaluation."""

    output_dir: str = "runs/demo"  # where metrics, checkpoints, models and summary.json go
    plugins: tuple[str, ...] = ()  # modules or .py files imported first: your tasks, environments, rewards
    model: ModelConfig = field(default_factory=ModelConfig)  # the policy
    task: TaskConfig = field(default_factory=TaskConfig)  # what to train and evaluate on
    reward: RewardConfig = field(default_factory=RewardConfig)  # reward functions and weights
    sft: SFTConfig = field(default_factory=lambda: SFTConfig(
        steps=500, batch_size=32, optim=OptimConfig(lr=1e-3, warmup_steps=50, schedule="cosine")))  # fine-tuning
    rl: RLConfig = field(default_factory=lambda: RLConfig(
        steps=40, prompts_per_step=16, group_size=8, max_new_tokens=32, optim=OptimConfig(lr=1e-4),
        eval_every=10))  # the RL loop
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out evaluation
    agent: AgentConfig = field(default_factory=AgentConfig)  # multi-turn budgets for environment tasks
    rm: RewardModelConfig = field(default_factory=RewardModelConfig)  # `tamer rm`: reward model from preferences
    preference: PreferenceDemoConfig = field(default_factory=PreferenceDemoConfig)  # `tamer demo --env preference`
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # the vLLM engine, when rl.engine = vllm
    tracking: TrackingConfig = field(default_factory=TrackingConfig)  # console and TensorBoard
    scale: ScaleConfig = field(default_factory=ScaleConfig)  # Ray rollout workers and learner ranks (docs/scaling.md)

    def __post_init__(self) -> None:
        critic = self.rl.critic
        if self.scale.distributed and (critic.shared or critic.adapter) and self.rl.algorithm.advantage == "gae":
            raise FieldError("scale.learner_ranks", "a critic on the policy's trunk (rl.critic.shared or "
                                                    "rl.critic.adapter) needs one learner process; set both to false")


def seed_overrides(seed: int) -> list[str]:
    """`--seed S`: every random choice (init, data order, sampling) drawn from S."""
    return [f"model.tiny.seed={seed}", f"sft.seed={seed}", f"rl.seed={seed}"]


# ---------------------------------------------------------------------------- pieces
def build_policy(config: ModelConfig,
                 task: TaskConfig | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The local model at `config.path`, or a tiny one (its BPE tokenizer trained on `task`'s text)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    if config.path:
        model, tokenizer = load_model(config.path, dtype=DTYPES[config.dtype])
    else:
        tokenizer = build_char_tokenizer()
        if config.tokenizer == "bpe":
            if task is None:
                raise ValueError("model.tokenizer=bpe needs the task whose text it is trained on")
            source = get_task_source(task)
            tokenizer = build_bpe_tokenizer(demonstration_texts(source, source.split()[0], tokenizer),
                                            config.bpe_vocab_size, config.bpe_split)
        model = build_tiny_model(tokenizer, config.tiny).to(DTYPES[config.dtype])
    if config.lora.enabled:  # adapters on the frozen base; the reference is the base (tamer.models.lora)
        model = apply_lora(model, config.lora, base_source=config.path or None)
    return with_checkpointing((model, tokenizer), config)


def with_checkpointing(policy: tuple[PreTrainedModel, PreTrainedTokenizerBase], config: ModelConfig) -> tuple:
    """`policy` with HF's gradient checkpointing on when `model.gradient_checkpointing` (the lean
    learner forward follows HF's per-layer flags)."""
    if config.gradient_checkpointing:
        enable = getattr(policy[0], "activation_checkpointing_enable", None)  # transformers >= 5
        enable() if enable else policy[0].gradient_checkpointing_enable({"use_reentrant": False})
    return policy


def tracker_for(config: RunConfig, sub: str, total_steps: int, description: str, append: bool = False) -> Tracker:
    tracking = config.tracking
    return Tracker(Path(config.output_dir) / sub, console=tracking.console,
                   tensorboard=tracking.tensorboard and "tensorboard" in tracking.backends, total_steps=total_steps,
                   description=description, append=append, console_every=tracking.console_every,
                   sinks=open_sinks(tracking, config.output_dir, sub, to_dict(config)), health=tracking.health)


def evaluate_model(model, tokenizer, tasks: list[Task], config: RunConfig,
                   engine: GenerationEngine | None = None) -> EvalReport:
    """Held-out evaluation of `model` on `tasks` with the run's eval and agent settings."""
    engine = engine or HFEngine(model, tokenizer.pad_token_id, max_batch=config.rl.generation_batch)
    rollout = Rollout(engine, tokenizer, config.agent)
    return evaluate(rollout, tasks, config.eval, stop_token_ids(tokenizer))


def make_trainer(config: RunConfig, model, tokenizer, *, tracker: Tracker | None = None,
                 engine: GenerationEngine | None = None, learner: Learner | None = None) -> RLTrainer:
    """The RL trainer a run's config describes, on its task's train and held-out splits.

    With `scale.rollout_workers` > 0 (on rank 0) it rolls out on Ray actors, which always seed
    per trajectory (`rl.sampling_seed: trajectory`) so that the split over actors changes nothing."""
    train, heldout = get_task_source(config.task).split()
    learner = learner or Learner()
    rl, rollout = config.rl, None
    if config.scale.rollout_workers and learner.is_main:
        from tamer.scale.ray_rollout import RayRollout

        rl = dataclasses.replace(rl, sampling_seed="trajectory")
        rollout = RayRollout.from_run(config, model, tokenizer)
    return RLTrainer(model, tokenizer, train, heldout, RewardComposer(config.reward), rl, config.eval,
                     run_dir=Path(config.output_dir) / "rl", tracker=tracker, agent=config.agent, engine=engine,
                     rollout_log=config.tracking.rollouts, rollout=rollout, learner=learner)


# ---------------------------------------------------------------------------- jobs
@guarded_job
def run_sft(config: RunConfig, model=None, tokenizer=None, source: TaskSource | None = None, *,
            resume: bool | str = False) -> dict[str, Any]:
    """SFT on the task's demonstrations; saves `output_dir/sft/model`.

    `resume`: True continues from the newest checkpoint in `output_dir/sft/checkpoints` (error
    if none), "if-exists" only when there is one; a finished SFT of the same length is reused."""
    if model is None:
        model, tokenizer = build_policy(config.model, config.task)
    out = Path(config.output_dir) / "sft"
    if resume and (done := finished_phase(out, "sft_steps", config.sft.steps, model)) is not None:
        return done
    preflight(out, model)
    resuming = wants_resume(out / "checkpoints", resume)
    source = source or get_task_source(config.task)
    train, heldout = source.split()
    seed_everything(config.sft.seed)
    start = time.perf_counter()
    with tracker_for(config, "sft", config.sft.steps, "sft", append=resuming) as tracker:
        data = demonstrations(source, train, tokenizer, seed=config.sft.seed, agent=config.agent)
        trainer = SFTTrainer(model, tokenizer, data, config.sft, run_dir=out)
        if resuming:
            resume_trainer(trainer, out / "checkpoints", tracker)
        with summary_on_stop(out / "summary.json", lambda: {"sft_loss": trainer.last_loss}):
            loss = trainer.train(tracker)
        report = evaluate_model(model, tokenizer, heldout, config)
        tracker.log(report.metrics(), config.sft.steps)
        RolloutRecorder(config.tracking.rollouts, tokenizer, RewardComposer(config.reward), tracker, "sft").on_eval(
            config.sft.steps, report.trajectories)  # the SFT model's held-out episodes, for `tamer view`
        tracker.log_summary({"sft_loss": loss, "sft_seconds": time.perf_counter() - start,
                             **report.metrics("sft_eval")})
    save_model(model, tokenizer, out / "model")
    result = {"sft_loss": loss, "sft_accuracy": report.accuracy, "sft_seconds": time.perf_counter() - start,
              "sft_steps": trainer.step, "model_path": str(out / "model"), **report.metrics("sft_eval")}
    if heldout[0].env is None:  # what the demonstrations score on the same held-out tasks (plots' baseline)
        result["demonstrator_accuracy"] = demonstrator_accuracy(source, heldout[: config.eval.size or None],
                                                                config.sft.seed)
    write_json(out / "summary.json", result)
    return result


@guarded_job
def run_rl(config: RunConfig, model=None, tokenizer=None, *, resume: bool | str = False,
           initial_eval: dict[str, float] | None = None) -> dict[str, Any]:
    """RL (GRPO family or PPO) from `model` or `config.model`; saves `output_dir/rl/model`.

    `resume`: True continues from the newest checkpoint in `output_dir/rl/checkpoints` (error
    if none), "if-exists" only when there is one and then also reuses a finished RL phase.
    With learner ranks (`scale.learner_ranks` > 1) the ranks run under torchrun (tamer.scale.launch)."""
    if config.scale.distributed:
        from tamer.scale.launch import launch_ranks

        return launch_ranks(config, model, tokenizer, resume=resume, initial_eval=initial_eval)
    return rl_job(config, model, tokenizer, resume=resume, initial_eval=initial_eval)


def rl_job(config: RunConfig, model=None, tokenizer=None, *, resume: bool | str = False,
           initial_eval: dict[str, float] | None = None, learner: Learner | None = None) -> dict[str, Any]:
    """`run_rl`'s work in this process (one learner rank of `learner`; rank 0 logs and saves)."""
    learner = learner or Learner()
    if model is None:
        model, tokenizer = build_policy(config.model, config.task)
    elif config.model.lora.enabled:  # an adapter trained before (SFT) joins the base: RL's reference is the start
        model = fold_adapter(model, config.model.lora)
    run_dir = Path(config.output_dir) / "rl"
    if resume == "if-exists" and (done := finished_phase(run_dir, "rl_steps", config.rl.steps, model)) is not None:
        return done
    if learner.is_main:
        preflight(run_dir, model)
    resuming = wants_resume(run_dir / "checkpoints", resume)
    seed_everything(config.rl.seed)
    start = time.perf_counter()
    with (tracker_for(config, "rl", config.rl.steps, "rl", append=resuming) if learner.is_main
          else _quiet_tracker()) as tracker, rl_engine(config.rl.engine, model, tokenizer, config.vllm) as engine:
        trainer = make_trainer(config, model, tokenizer, tracker=tracker if learner.is_main else None,
                               engine=engine, learner=learner)
        try:
            if resuming:
                resume_trainer(trainer, run_dir / "checkpoints", tracker)
            with (summary_on_stop(run_dir / "summary.json", lambda: {"rl_steps": trainer.step, **trainer.last_eval})
                  if learner.is_main else contextlib.nullcontext()):
                final = trainer.train(initial_eval)
        finally:
            trainer.close()
        tracker.log_summary({"rl_steps": trainer.step, "rl_seconds": time.perf_counter() - start,
                             "reward_errors": trainer.rewards.total_errors, **final})
    if not learner.is_main:
        return {}
    plot = plot_metrics(run_dir / "metrics.jsonl", run_dir / "reward_accuracy.png",
                        title=f"{config.rl.algorithm.advantage} on {config.task.name}",
                        baselines=read_baselines(config.output_dir, demo=False))
    save_model(model, tokenizer, run_dir / "model")
    result = {"rl_accuracy": final.get("eval/accuracy"), "rl_steps": trainer.step,
              "rl_seconds": time.perf_counter() - start, "model_path": str(run_dir / "model"),
              "plot": str(plot), "reward_errors": trainer.rewards.total_errors, **final}
    write_json(run_dir / "summary.json", result)
    return result


def _quiet_tracker():
    from tamer.scale.launch import QuietTracker

    return QuietTracker()


def run_eval(config: RunConfig, show: int = 0) -> dict[str, Any]:
    """Held-out evaluation of `config.model` on `config.task`; `show` > 0 adds that many "episodes"."""
    model, tokenizer = build_policy(config.model, config.task)
    _, heldout = get_task_source(config.task).split()
    report = evaluate_model(model, tokenizer, heldout, config)
    result = {"accuracy": report.accuracy, "num_tasks": report.num_tasks, **report.metrics()}
    if show:  # transcripts (tamer.transcripts): turns, tool calls and results, reward breakdown
        result["episodes"] = episode_records(report.trajectories[:show], tokenizer, RewardComposer(config.reward))
    return result


def _as_eval(sft_result: dict[str, Any]) -> dict[str, float]:
    """The SFT model's held-out metrics under the RL trainer's names (its step-0 point)."""
    return {k.replace("sft_eval/", "eval/"): v for k, v in sft_result.items() if k.startswith("sft_eval/")}


AGENT_KEYS = ("success_rate", "mean_tool_calls", "mean_cost_ratio", "error_rate")


def demonstrator_agent_metrics(source: TaskSource, tasks: list[Task], tokenizer, agent: AgentConfig, seed: int) -> dict:
    """The scripted demonstrator's episodes on `tasks`, replayed through their environments."""
    rng = random.Random(seed)
    replayer = AgentRollout(None, tokenizer, agent)
    return agent_metrics([replayer.replay(t, source.demonstrate_turns(t, rng)) for t in tasks])


@guarded_job
def run_demo(config: RunConfig, resume: bool = False) -> dict[str, Any]:
    """Tiny model -> SFT on the demonstrator -> GRPO; held-out table and summary.json.

    `resume`: continue a stopped demo (a finished phase is reused, a stopped one resumed)."""
    start = time.perf_counter()
    out = Path(config.output_dir)
    model, tokenizer = build_policy(config.model, config.task)
    source = get_task_source(config.task)
    _, heldout = source.split()
    eval_tasks = heldout[: config.eval.size] if config.eval.size else heldout
    if eval_tasks[0].env is not None:
        return _agent_demo(config, model, tokenizer, source, eval_tasks, start, resume)
    demo_acc = demonstrator_accuracy(source, eval_tasks, seed=config.sft.seed)
    sft = run_sft(config, model, tokenizer, source, resume="if-exists" if resume else False)
    rl = run_rl(config, model, tokenizer, initial_eval=_as_eval(sft), resume="if-exists" if resume else False)
    summary = {
        "task": config.task.name, "heldout_size": len(eval_tasks),
        "demonstrator_accuracy": demo_acc, "sft_accuracy": sft["sft_accuracy"], "rl_accuracy": rl["rl_accuracy"],
        "rl_steps": rl["rl_steps"], "seconds": time.perf_counter() - start,
        "sft_seconds": sft["sft_seconds"], "rl_seconds": rl["rl_seconds"],
        "model_parameters": count_parameters(model), "plot": rl["plot"],
        "sft_model": sft["model_path"], "rl_model": rl["model_path"], "config": to_dict(config),
    }
    plot_metrics(out / "rl" / "metrics.jsonl", out / "reward_accuracy.png", title="GRPO after SFT",
                 baselines=summary_baselines(summary))
    summary["plot"] = str(out / "reward_accuracy.png")
    write_json(out / "summary.json", summary)
    return summary


def _agent_demo(config: RunConfig, model, tokenizer, source: TaskSource, eval_tasks: list[Task], start: float,
                resume: bool = False) -> dict:
    """The demo for tool-using tasks: success, tool calls, cost over the optimum, errors."""
    out = Path(config.output_dir)
    demo = demonstrator_agent_metrics(source, eval_tasks, tokenizer, config.agent, config.sft.seed)
    sft = run_sft(config, model, tokenizer, source, resume="if-exists" if resume else False)
    rl = run_rl(config, model, tokenizer, initial_eval=_as_eval(sft), resume="if-exists" if resume else False)

    def pick(metrics: dict, prefix: str) -> dict:
        return {k: metrics.get(f"{prefix}/{k}") for k in AGENT_KEYS}

    summary = {
        "task": config.task.name, "heldout_size": len(eval_tasks),
        "demonstrator": {k: demo[k] for k in AGENT_KEYS}, "sft": pick(sft, "sft_eval"), "rl": pick(rl, "eval"),
        "rl_steps": rl["rl_steps"], "seconds": time.perf_counter() - start,
        "sft_seconds": sft["sft_seconds"], "rl_seconds": rl["rl_seconds"],
        "model_parameters": count_parameters(model), "config": to_dict(config),
    }
    plot_metrics(out / "rl" / "metrics.jsonl", out / "reward_accuracy.png",
                 keys=("reward/mean", "eval/success_rate", "eval/mean_tool_calls", "eval/mean_cost_ratio"),
                 title=f"GRPO on {config.task.name}", baselines=summary_baselines(summary))
    summary["plot"] = str(out / "reward_accuracy.png")
    write_json(out / "summary.json", summary)
    return summary
