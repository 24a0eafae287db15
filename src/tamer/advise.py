"""`tamer advise`: does my agent need RL, and which kind? Measured first, then advised.

    config = load_config(RunConfig, ["my.yaml"])
    advice = run_advise(config, AdviseConfig(k=8, memory_gb=16))
    print(advice.text())           # for people
    advice.to_dict()               # for scripts (`tamer advise --json`)

What it measures, without training the model:
- data: the number of training and held-out tasks;
- success: greedy accuracy, pass@1 and pass@k from n samples on held-out tasks (unbiased
  estimator, Chen et al., 2021);
- reward spread: one rollout round of G samples for M training prompts, scored by the
  configured reward functions; the fraction of groups whose rewards are all equal (they
  have zero advantage under GRPO and teach nothing);
- reward health, per function: errors, and whether it returned one value for every sample
  *and* for probe replies (the reference answer, a wrong answer, an empty reply) — a
  function that cannot tell those apart is constant; one that is constant only on the
  model's samples is a model that never succeeds, which the pass@k rule catches;
- learned rewards (a reward model, a judge): the fraction of held-out preference pairs
  (the run's `rm.data`) whose chosen reply they score above the rejected one;
- cost of one RL step for GRPO and PPO: `measure_steps` steps of each, each method in its
  own process (as `tamer compare` does): seconds per step and peak resident memory.

Every measurement runs the run's own config through the pieces `tamer train` and `tamer eval`
use (`evaluate_model`, `make_trainer`): the same agent settings, rewards and sampling.

The decision guide: rules in priority order; the first that fires is the verdict, and
every rule is reported with the numbers it was decided on.

1. fix the reward  a reward function raised, or is constant (see above), or a learned reward
                   agrees with fewer than AGREEMENT_MIN of held-out preferences
2. RL not needed   pass@1 (sampled, or greedy accuracy if higher) >= PASS1_ENOUGH: the
                   model already succeeds; prompting or few-shot examples may be all it needs
3. SFT first       pass@k < PASSK_MIN: k tries almost never succeed, so groups have no
                   reward spread for RL to learn from; imitate demonstrations first
4. fix the reward  zero-spread groups >= ZERO_SPREAD_MAX: RL would learn from almost no
                   samples; add a denser reward (partial credit, format) or raise G
5. get more data   (a note, not a verdict) fewer than MIN_TRAIN_TASKS training tasks
6. PPO or GRPO     PPO only when its measured peak fits `memory_gb` and at least
                   PPO_ZERO_SPREAD of groups have zero spread (a critic's baseline still
                   gives those samples a signal; GRPO's group mean does not); otherwise
                   GRPO, which holds one model instead of two. If even GRPO's measured peak
                   exceeds the budget the verdict is `over_budget`.
"""

from __future__ import annotations

import dataclasses
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tamer.algorithms import zero_spread_groups
from tamer.compare import METHODS
from tamer.config import FieldError
from tamer.learned_rewards.agreement import learned_reward_checks
from tamer.models import count_parameters
from tamer.phases import run_in_child
from tamer.pipeline import RunConfig, build_policy, evaluate_model, make_trainer
from tamer.rollout.types import Trajectory
from tamer.tasks import get_task_source
from tamer.tasks.base import format_answer
from tamer.trainers.common import seed_everything

PASS1_ENOUGH = 0.9  # pass@1 at or above: RL not needed
PASSK_MIN = 0.05  # pass@k below: SFT first
ZERO_SPREAD_MAX = 0.9  # fraction of zero-spread groups at or above: fix the reward
MIN_TRAIN_TASKS = 200  # fewer training tasks: get more data (a note)
PPO_ZERO_SPREAD = 0.5  # PPO only if at least this fraction of groups has zero spread (and it fits)

VERDICTS = ("fix_reward", "rl_not_needed", "sft_first", "ppo", "grpo", "over_budget")


@dataclass(frozen=True)
class AdviseConfig:
    """How much to measure; the run's own config supplies the model, task and rewards."""

    eval_tasks: int = 32  # held-out tasks for pass@k
    k: int = 8  # k of pass@k
    samples: int = 0  # n samples per task for pass@k; 0: max(eval.pass_n, k)
    spread_prompts: int = 16  # M training prompts for the reward-spread round
    group_size: int = 0  # G; 0: rl.group_size
    measure_steps: int = 2  # RL steps timed per method (0: skip); the first is a warm-up when > 1
    memory_gb: float | None = None  # memory budget for training

    def __post_init__(self) -> None:
        for name in ("eval_tasks", "k", "spread_prompts"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"expected >= 1, got {getattr(self, name)}")
        if self.samples and self.samples < self.k:
            raise FieldError("samples", f"must be >= k ({self.k}), got {self.samples}")
        if self.group_size == 1 or self.group_size < 0:
            raise FieldError("group_size", "a spread needs at least 2 samples per prompt")
        if self.measure_steps < 0:
            raise FieldError("measure_steps", f"expected >= 0, got {self.measure_steps}")
        if self.memory_gb is not None and self.memory_gb <= 0:
            raise FieldError("memory_gb", f"expected > 0, got {self.memory_gb}")


# ---------------------------------------------------------------------------- what is measured
@dataclass
class RewardHealth:
    """One reward function on the model's samples and on probe replies."""

    name: str
    weight: float
    calls: int  # model samples scored
    errors: int  # raised or NaN on model samples
    sample_values: list[float]  # distinct values on model samples (at most 5 listed)
    probe_values: list[float]  # distinct values on probe replies (at most 5 listed)
    constant: bool  # one value for every sample and every probe
    first_error: str | None = None


@dataclass
class StepCost:
    """One RL method's measured cost per step, in its own process."""

    method: str
    seconds_per_step: float
    peak_rss_mb: float
    baseline_rss_mb: float  # the same process after imports, before any model
    models_held: int
    trainable_parameters: int


@dataclass
class Measurements:
    task: str
    model: str
    parameters: int
    train_tasks: int
    heldout_tasks: int
    eval_tasks: int
    samples_per_task: int  # n
    k: int
    greedy_accuracy: float
    pass_at_1: float
    pass_at_k: float
    spread_prompts: int  # M
    group_size: int  # G
    zero_spread_fraction: float
    reward_mean: float
    rewards: list[RewardHealth]
    steps: dict[str, StepCost] = field(default_factory=dict)  # "grpo", "ppo"; empty if not measured
    learned_rewards: list = field(default_factory=list)  # PreferenceAgreement per learned reward (reward model, judge)
    steps_skipped: str = ""  # why steps were not measured
    seconds: float = 0.0


@dataclass
class Rule:
    """One line of the decision guide, decided on `detail`'s numbers."""

    name: str
    fired: bool
    action: str  # what to do (meaningful when fired)
    detail: str  # the measured numbers behind it
    status: str = ""  # verdict | fires | ok | later (the RL method, once the verdict is dealt with)


@dataclass
class Advice:
    verdict: str  # one of VERDICTS
    headline: str
    rules: list[Rule]
    measurements: Measurements
    memory_gb: float | None = None
    thresholds: dict[str, float] = field(default_factory=lambda: {
        "pass1_enough": PASS1_ENOUGH, "passk_min": PASSK_MIN, "zero_spread_max": ZERO_SPREAD_MAX,
        "min_train_tasks": MIN_TRAIN_TASKS, "ppo_zero_spread": PPO_ZERO_SPREAD})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def text(self) -> str:
        m = self.measurements
        lines = [f"tamer advise: task {m.task}, model {m.model} ({m.parameters:,} parameters)",
                 f"verdict: {self.verdict.upper().replace('_', ' ')} - {self.headline}", "",
                 f"measured ({m.seconds:.0f} s):", *_measurement_lines(m), "",
                 "decision guide (in priority order; the first rule that fires decides):"]
        for i, rule in enumerate(self.rules, start=1):
            lines.append(f"  {i}. {rule.name:<15} {rule.status.upper():<7}  {rule.detail}")
            if rule.status in ("verdict", "fires"):
                lines.append(f"     {'':<15} {'':<7}  -> {rule.action}")
            elif rule.status == "later":
                lines.append(f"     {'':<15} {'':<7}  -> after that: {rule.action}")
        return "\n".join(lines)


def _measurement_lines(m: Measurements) -> list[str]:
    lines = [f"  data            {m.train_tasks} train tasks, {m.heldout_tasks} held-out",
             f"  success         pass@1 {m.pass_at_1:.3f}, pass@{m.k} {m.pass_at_k:.3f}, "
             f"greedy {m.greedy_accuracy:.3f} "
             f"({m.eval_tasks} held-out tasks x {m.samples_per_task} samples)",
             f"  reward spread   {m.zero_spread_fraction:.0%} of {m.spread_prompts} groups of {m.group_size} have zero "
             f"spread; mean reward {m.reward_mean:.3f}"]
    for i, r in enumerate(m.rewards):
        label = "rewards" if i == 0 else ""
        lines.append(f"  {label:<16}{_health_line(r)}")
    for i, a in enumerate(m.learned_rewards):
        lines.append(f"  {'preferences' if i == 0 else '':<16}{a.line()}")
    if m.steps:
        for i, (method, s) in enumerate(m.steps.items()):
            label = "RL step" if i == 0 else ""
            lines.append(f"  {label:<16}{method.upper():<5} {s.seconds_per_step:.2f} s, peak {s.peak_rss_mb:.0f} MB "
                         f"(Python+torch {s.baseline_rss_mb:.0f} MB), {s.models_held} model(s), "
                         f"{s.trainable_parameters:,} trainable")
    else:
        lines.append(f"  RL step         not measured ({m.steps_skipped})")
    return lines


def _health_line(r: RewardHealth) -> str:
    def values(vs: list[float]) -> str:
        return "{" + ", ".join(f"{v:g}" for v in vs) + "}"

    state = "CONSTANT" if r.constant else "varies"
    return (f"{r.name} (weight {r.weight:g}): {r.errors} errors in {r.calls} calls, {state}; "
            f"samples {values(r.sample_values)}, probes {values(r.probe_values)}")


# ---------------------------------------------------------------------------- the decision guide
def decide(m: Measurements, memory_gb: float | None = None) -> Advice:
    """The decision guide above, applied to measurements (pure: no model, no I/O)."""
    rules = [_reward_rule(m), _pass1_rule(m), _passk_rule(m), _spread_rule(m), _data_rule(m)]
    method_rule, method = _method_rule(m, memory_gb)
    rules.append(method_rule)
    verdicts = {"fix the reward": "fix_reward", "RL not needed": "rl_not_needed", "SFT first": "sft_first",
                "reward spread": "fix_reward"}
    first = next((r for r in rules if r.fired and r.name in verdicts), None) or method_rule
    for rule in rules:
        rule.status = ("verdict" if rule is first else "later" if rule is method_rule
                       else "fires" if rule.fired else "ok")
    verdict = verdicts[first.name] if first is not method_rule else method
    return Advice(verdict, first.action, rules, m, memory_gb)


def _reward_rule(m: Measurements) -> Rule:
    broken = [r for r in m.rewards if r.errors]
    constant = [r for r in m.rewards if r.constant]
    parts = [f"{r.name} raised {r.errors} times in {r.calls} calls" for r in broken]
    parts += [f"{r.name} returned {r.sample_values[0]:g} for every sample and probe" for r in constant]
    parts += [a.problem() for a in m.learned_rewards if a.too_low]
    fired = bool(parts)
    detail = "; ".join(parts) if fired else (f"no errors in {m.rewards[0].calls if m.rewards else 0} calls per "
                                             "function; every function tells the probes apart")
    action = ("fix the reward: " + "; ".join(parts)
              + (f" (first error: {broken[0].first_error.strip().splitlines()[-1]})"
                 if broken and broken[0].first_error else "")
              + ". RL can only learn what the reward distinguishes.")
    return Rule("fix the reward", fired, action, detail)


def _pass1_rule(m: Measurements) -> Rule:
    best = max(m.pass_at_1, m.greedy_accuracy)  # a model that is right when decoded greedily is deployable as is
    fired = best >= PASS1_ENOUGH
    detail = (f"pass@1 {m.pass_at_1:.3f}, greedy {m.greedy_accuracy:.3f}: best {best:.3f} "
              f"{'>=' if fired else '<'} {PASS1_ENOUGH}")
    action = (f"RL not needed: the model already succeeds on {best:.0%} of single tries; "
              "prompting or a few-shot example may be all it needs")
    return Rule("RL not needed", fired, action, detail)


def _passk_rule(m: Measurements) -> Rule:
    fired = m.pass_at_k < PASSK_MIN
    detail = f"pass@{m.k} {m.pass_at_k:.3f} {'<' if fired else '>='} {PASSK_MIN}"
    action = (f"do SFT first: even {m.k} tries succeed on only {m.pass_at_k:.1%} of tasks, so RL groups would "
              "have no successes to learn from; fine-tune on demonstrations (`tamer sft`), then ask again")
    return Rule("SFT first", fired, action, detail)


def _spread_rule(m: Measurements) -> Rule:
    fired = m.zero_spread_fraction >= ZERO_SPREAD_MAX
    detail = (f"{m.zero_spread_fraction:.0%} of {m.spread_prompts} groups of {m.group_size} have zero spread "
              f"({'>=' if fired else '<'} {ZERO_SPREAD_MAX:.0%})")
    action = (f"fix the reward: {m.zero_spread_fraction:.0%} of groups score all samples alike, so GRPO learns "
              "from almost none; add partial credit or a format reward, or raise rl.group_size")
    return Rule("reward spread", fired, action, detail)


def _data_rule(m: Measurements) -> Rule:
    fired = m.train_tasks < MIN_TRAIN_TASKS
    detail = f"{m.train_tasks} train tasks {'<' if fired else '>='} {MIN_TRAIN_TASKS}"
    action = (f"get more data: {m.train_tasks} training tasks are few; RL will revisit them often and may "
              "overfit (a note, not a verdict: RL can still be tried)")
    return Rule("data size", fired, action, detail)


def _method_rule(m: Measurements, memory_gb: float | None) -> tuple[Rule, str]:
    budget_mb = memory_gb * 1024 if memory_gb else None
    grpo, ppo = m.steps.get("grpo"), m.steps.get("ppo")
    costs = ("; ".join(f"{s.method.upper()} {s.models_held} model(s), peak {s.peak_rss_mb:.0f} MB, "
                       f"{s.seconds_per_step:.2f} s/step" for s in m.steps.values())
             or f"step cost not measured ({m.steps_skipped})")
    budget = f"budget {memory_gb:g} GB" if memory_gb else "no --memory-gb given"
    detail = f"{costs}; {budget}; zero-spread {m.zero_spread_fraction:.0%}"
    if budget_mb and grpo and grpo.peak_rss_mb > budget_mb:
        action = (f"over budget: GRPO's measured peak {grpo.peak_rss_mb / 1024:.2f} GB exceeds {memory_gb:g} GB; "
                  "use a smaller model, bfloat16, or a smaller rl.micro_batch_tokens")
        return Rule("GRPO or PPO", True, action, detail), "over_budget"
    if budget_mb and ppo and ppo.peak_rss_mb <= budget_mb and m.zero_spread_fraction >= PPO_ZERO_SPREAD:
        action = (f"PPO: it fits ({ppo.peak_rss_mb / 1024:.2f} GB <= {memory_gb:g} GB) "
                  f"and {m.zero_spread_fraction:.0%} of groups have zero spread, where a critic's baseline still "
                  "gives a signal (`tamer train --set rl.algorithm.advantage=gae`)")
        return Rule("GRPO or PPO", True, action, detail), "ppo"
    why = ("it holds one model where PPO holds two" if not ppo else
           f"it holds {grpo.models_held if grpo else 1} model(s) where PPO holds {ppo.models_held}"
           + (f" and peaks at {grpo.peak_rss_mb:.0f} MB vs {ppo.peak_rss_mb:.0f} MB" if grpo else ""))
    action = f"GRPO: {why} (`tamer train`)"
    return Rule("GRPO or PPO", True, action, detail), "grpo"


# ---------------------------------------------------------------------------- measuring
def run_advise(config: RunConfig, advise: AdviseConfig = AdviseConfig()) -> Advice:
    """Measure `config`'s model on its task and rewards, then apply the decision guide."""
    return decide(measure(config, advise), advise.memory_gb)


def measure(config: RunConfig, advise: AdviseConfig) -> Measurements:
    start = time.perf_counter()
    source = get_task_source(config.task)
    train, heldout = source.split()
    model, tokenizer = build_policy(config.model, config.task)
    seed_everything(config.rl.seed)
    success = _success(model, tokenizer, heldout, config, advise)
    spread, mean_reward, health = _spread_and_health(model, tokenizer, source, config, advise)
    learned = learned_reward_checks(config, tokenizer.eos_token or "")  # agreement with held-out preferences
    del model  # the step measurements run in their own processes
    steps = measure_steps(config, advise.measure_steps) if advise.measure_steps else {}
    return Measurements(
        task=config.task.name, model=config.model.path or "model.tiny (random init)",
        parameters=success.pop("parameters"),
        train_tasks=len(train), heldout_tasks=len(heldout), **success, spread_prompts=advise.spread_prompts,
        group_size=advise.group_size or config.rl.group_size, zero_spread_fraction=spread, reward_mean=mean_reward,
        rewards=health, steps=steps, steps_skipped="" if advise.measure_steps else "--no-step-measure",
        seconds=time.perf_counter() - start, learned_rewards=learned)


def _success(model, tokenizer, heldout, config: RunConfig, advise: AdviseConfig) -> dict[str, Any]:
    """Greedy accuracy and pass@1/pass@k, through the run's own evaluator (agent settings included)."""
    n = advise.samples or max(config.eval.pass_n, advise.k)
    eval_config = dataclasses.replace(config.eval, size=advise.eval_tasks, pass_k=advise.k, pass_n=n)
    report = evaluate_model(model, tokenizer, heldout, dataclasses.replace(config, eval=eval_config))
    return {"eval_tasks": report.num_tasks, "samples_per_task": n, "k": advise.k, "greedy_accuracy": report.accuracy,
            "pass_at_1": report.pass_k[1], "pass_at_k": report.pass_k[advise.k], "parameters": count_parameters(model)}


def _spread_config(config: RunConfig, advise: AdviseConfig) -> RunConfig:
    """The run's config for one rollout round of G samples for M prompts (no reference, no critic)."""
    rl = config.rl
    algorithm = dataclasses.replace(rl.algorithm, advantage="grpo", kl_coef=0.0, dynamic_sampling="off")
    rl = dataclasses.replace(rl, prompts_per_step=advise.spread_prompts, group_size=advise.group_size or rl.group_size,
                             algorithm=algorithm, critic=dataclasses.replace(rl.critic, kl_in_reward=0.0))
    return dataclasses.replace(config, rl=rl)


def _spread_and_health(model, tokenizer, source, config: RunConfig, advise: AdviseConfig):
    """One rollout round through the run's own trainer; reward spread and per-function health."""
    trainer = make_trainer(_spread_config(config, advise), model, tokenizer)
    tasks = trainer.pool.next_batch(min(advise.spread_prompts, len(trainer.pool.tasks)))
    trajs = trainer.rollout.run(tasks, trainer.sampling_params(step=1))
    stats = trainer.rewards.score(trajs)
    zero = zero_spread_groups(torch.tensor([t.reward for t in trajs]), torch.tensor([t.group_id for t in trajs]))
    probes = _probes(tasks, source, tokenizer)
    trainer.rewards.score(probes)
    health = []
    for name, weight in config.reward.weights.items():
        on_samples = sorted({round(t.rewards[name], 9) for t in trajs})
        on_probes = sorted({round(t.rewards[name], 9) for t in probes})
        first = stats.first_traceback if stats.errors[name] and f"{name!r}" in (stats.first_traceback or "") else None
        health.append(RewardHealth(name, weight, len(trajs), stats.errors[name], on_samples[:5], on_probes[:5],
                                   len(set(on_samples) | set(on_probes)) == 1, first))
    return float(zero.float().mean()), stats.total_mean, health


def _probes(tasks, source, tokenizer) -> list[Trajectory]:
    """Replies a reward must tell apart: the reference answer, a demonstration, a wrong answer, nothing."""
    rng = random.Random(0)
    probes = []
    for i, task in enumerate(tasks):
        replies = [format_answer(task.answer), source.demonstrate(task, rng), format_answer(f"not {task.answer}"), ""]
        for reply in replies:
            text = reply + (tokenizer.eos_token or "")
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            probes.append(Trajectory(task=task, group_id=i, prompt_ids=[], completion_ids=ids, loss_mask=[1] * len(ids),
                                     logprobs=[0.0] * len(ids), text=text, finish_reason="stop"))
    return probes


def measure_steps(config: RunConfig, steps: int) -> dict[str, StepCost]:
    """`steps` RL steps of GRPO and of PPO, each in its own process: seconds/step, peak RSS."""
    costs = {}
    with tempfile.TemporaryDirectory(prefix="tamer-advise-") as tmp:
        for method, advantage in METHODS.items():
            rl = dataclasses.replace(config.rl, algorithm=dataclasses.replace(config.rl.algorithm, advantage=advantage),
                                     steps=max(steps, 1), eval_every=0, checkpoint_every=0)
            tracking = dataclasses.replace(config.tracking, console=False, tensorboard=False)
            cfg = dataclasses.replace(config, rl=rl, tracking=tracking, output_dir=str(Path(tmp) / method))
            result = run_in_child("rl", cfg, measure_steps=steps, quiet=True)
            times = result["step_seconds"]
            warm = times[1:] or times  # the first step pays one-off costs (allocations, caches)
            costs[method] = StepCost(method, sum(warm) / len(warm), result["peak_rss_mb"], result["baseline_rss_mb"],
                                     result["models_held"], result["trainable_parameters"])
    return costs
