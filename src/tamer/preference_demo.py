"""`tamer demo --env preference`: the RLHF stage, and how optimising a learned reward goes wrong.

    SFT on a demonstrator that rarely states the unit        (7 kg + 5 kg -> <answer>12</answer>)
    preferences from a labeller with a hidden rule           (chosen: <answer>12 kg</answer>)
    a Bradley–Terry reward model on those pairs, from the SFT model
    RL against the reward model from the SFT model: GRPO, GRPO with a KL penalty, RLHF-PPO

On held-out prompts, every `rl.eval_every` steps, each run records the hidden rule's
satisfaction rate (the quality the labeller meant), the reward model's score (what RL
optimises), the number's accuracy, how often any unit is stated, and KL(π || π_SFT) per
reply (sampled, k1). The summary table and curves show where the reward keeps rising while
the rule stops improving or falls: reward hacking, and what a KL penalty does to it.

Settings: configs/demo-preference.yaml (a run config; the demo's own settings are its
`preference` section, `tamer.preference_config`); a user's `--config` and `--set` are laid
over it. Outputs under OUTPUT_DIR: sft/, rm/, preferences*.jsonl, one directory per RL
variant, summary.json and rlhf.png.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from tamer.config import ConfigError
from tamer.evaluate import evaluate
from tamer.learned_rewards import RewardModelScorer, preference_text
from tamer.models import load_model, save_model, token_logprobs
from tamer.pipeline import RunConfig, build_policy, run_sft, tracker_for, write_json
from tamer.preference_config import PreferenceDemoConfig
from tamer.rewards import RewardComposer, RewardConfig
from tamer.rlhf import run_rm
from tamer.rollout.types import SamplingParams, Trajectory
from tamer.tasks import get_task_source
from tamer.tasks.units import follows_rule, states_a_unit
from tamer.tracking import read_metrics
from tamer.trainers.batch import collate
from tamer.trainers.common import seed_everything
from tamer.trainers.rl import RLTrainer

EXAMPLES = 6  # held-out replies kept from the last evaluation
CURVE_KEYS = ("eval/rm_score", "eval/rule_rate", "eval/accuracy", "eval/unit_rate", "eval/kl_to_sft")


# ---------------------------------------------------------------------------- evaluation
class RLHFTrainer(RLTrainer):
    """The RL trainer, with held-out metrics of the hidden rule, the RM score and KL to the SFT model."""

    def __init__(self, *args, scorer, sft_model, kl_samples: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scorer, self.sft_model, self.kl_samples = scorer, sft_model, kl_samples

    def evaluate(self) -> dict[str, float]:
        self.engine.sync_weights(self.model)
        report = evaluate(self.rollout, self.heldout, self.eval_config, self.stop_ids)
        self.last_eval = {**report.metrics(), **quality(report.trajectories, self.scorer),
                          "eval/kl_to_sft": self.kl_to_sft()}
        self.examples = {t.task.messages[-1]["content"]: t.text for t in report.trajectories[:EXAMPLES]}
        return self.last_eval

    @torch.no_grad()
    def kl_to_sft(self) -> float:
        """Mean over sampled replies of Σ_t log π(y_t) − log π_SFT(y_t): an unbiased KL(π || π_SFT) per reply."""
        tasks = self.heldout[: self.kl_samples]
        params = SamplingParams(n=1, temperature=self.config.temperature, max_new_tokens=self.config.max_new_tokens,
                                stop_token_ids=self.stop_ids, seed=self.config.seed + 7919 * self.step)
        trajs = self.rollout.run(tasks, params)
        batch = collate(trajs, torch.zeros(len(trajs)), self.tokenizer.pad_token_id)
        ref = token_logprobs(self.sft_model, batch.input_ids, batch.attention_mask, self.config.temperature)
        return float(((batch.old_logprobs - ref) * batch.loss_mask).sum() / len(trajs))


def quality(trajs: list[Trajectory], scorer) -> dict[str, float]:
    """The hidden rule's rate, any-unit rate and mean reward-model score of held-out replies."""
    n = len(trajs)
    # Laid out as the `reward_model` reward lays out a rollout: the completion exactly as sampled.
    scores = scorer.score_texts([preference_text(scorer.tokenizer, t.task.messages, t.text, add_eos=False)
                                 for t in trajs])
    return {"eval/rule_rate": sum(follows_rule(t.text, t.task) for t in trajs) / n,
            "eval/unit_rate": sum(states_a_unit(t.text) for t in trajs) / n,
            "eval/rm_score": sum(scores) / n}


# ---------------------------------------------------------------------------- the demo
def variant_config(config: RunConfig, demo: PreferenceDemoConfig, name: str, rm_path: str):
    """The run config of one RL variant: the reward model as the only reward, and the variant's KL."""
    rl = config.rl
    if name == "grpo":
        rl = dataclasses.replace(rl, algorithm=dataclasses.replace(rl.algorithm, kl_coef=0.0))
    elif name == "grpo_kl":
        rl = dataclasses.replace(rl, algorithm=dataclasses.replace(rl.algorithm, kl_coef=demo.kl_coef))
    else:
        rl = dataclasses.replace(rl, algorithm=dataclasses.replace(rl.algorithm, advantage="gae", kl_coef=0.0),
                                 critic=dataclasses.replace(rl.critic, kl_in_reward=demo.ppo_kl_in_reward))
    # GRPO's group normalisation makes any affine rescaling of the reward irrelevant, so its runs log
    # raw reward-model scores; PPO's value targets and its KL-in-reward β need a fixed scale.
    normalize = "batch" if name == "ppo" else "none"
    reward = RewardConfig(weights={"reward_model": 1.0},
                          params={"reward_model": {"path": rm_path, "normalize": normalize}},
                          default_on_error=config.reward.default_on_error)
    return dataclasses.replace(config, rl=rl, reward=reward, output_dir=str(Path(config.output_dir) / name))


def run_variant(config: RunConfig, sft_path: str, kl_samples: int) -> dict[str, Any]:
    """RL from the saved SFT model against the reward model; returns the eval curve and final metrics."""
    model, tokenizer = load_model(sft_path)
    sft_model, _ = load_model(sft_path)
    train, heldout = get_task_source(config.task).split()
    seed_everything(config.rl.seed)
    rewards = RewardComposer(config.reward)
    start = time.perf_counter()
    with tracker_for(config, "rl", config.rl.steps, Path(config.output_dir).name) as tracker:
        trainer = RLHFTrainer(model, tokenizer, train, heldout, rewards, config.rl, config.eval,
                              run_dir=Path(config.output_dir) / "rl", tracker=tracker, agent=config.agent,
                              scorer=rewards.functions["reward_model"].scorer, sft_model=sft_model.eval(),
                              kl_samples=kl_samples)
        trainer.train()
    save_model(model, tokenizer, Path(config.output_dir) / "rl" / "model")
    curve = [{"step": r["step"], **{k.split("/")[1]: r[k] for k in CURVE_KEYS if k in r}}
             for r in read_metrics(Path(config.output_dir) / "rl" / "metrics.jsonl") if "eval/rule_rate" in r]
    result = {"curve": curve, "final": curve[-1], "examples": trainer.examples, "seconds": time.perf_counter() - start,
              "reward_errors": rewards.total_errors, "model_path": str(Path(config.output_dir) / "rl" / "model")}
    write_json(Path(config.output_dir) / "summary.json", result)
    return result


def write_pairs(path: Path, pairs) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for p in pairs:
            fh.write(json.dumps({"prompt": p.messages[-1]["content"], "chosen": p.chosen,
                                 "rejected": p.rejected}) + "\n")
    return path


def rm_probe(scorer, task, units: tuple[str, ...]) -> dict[str, float]:
    """What the reward model learned, on one held-out prompt: its score of replies that vary the number and unit."""
    n, unit = int(task.answer), task.meta["unit"]
    other = next(u for u in units + ("kg", "m") if u != unit)
    replies = [f"{n} {unit}", f"{n + 1} {unit}", f"{n - 1} {unit}", f"{n + 5} {unit}", f"{n} {other}", f"{n}", unit]
    scores = scorer.score_pairs([task.messages] * len(replies), [f"<answer>{r}</answer>" for r in replies])
    return {"prompt": task.messages[-1]["content"], **{r: round(x, 3) for r, x in zip(replies, scores)}}


def run_preference_demo(config: RunConfig) -> dict[str, Any]:
    """SFT -> preferences -> reward model -> each RL variant; summary.json, rlhf.png."""
    demo = config.preference
    if config.task.name != "units":
        raise ConfigError(f"task.name: the preference demo runs on the units task, got {config.task.name!r}")
    start, out = time.perf_counter(), Path(config.output_dir)
    model, tokenizer = build_policy(config.model, config.task)
    source = get_task_source(config.task)
    train, heldout = source.split()
    sft = run_sft(config, model, tokenizer, source)
    # The labeller's pairs go through the same files and loader a user's would.
    data = dataclasses.replace(config.rm.data, path=str(write_pairs(out / "preferences.jsonl", source.preference_pairs(
        train, demo.train_pairs, seed=config.rm.seed))), heldout_path=str(write_pairs(
        out / "preferences-heldout.jsonl",
        source.preference_pairs(heldout, demo.heldout_pairs, seed=config.rm.seed + 1))))
    rm = run_rm(dataclasses.replace(config, rm=dataclasses.replace(config.rm, data=data)), model, tokenizer)
    probe = rm_probe(RewardModelScorer.load(rm["model_path"]), heldout[0], config.task.units.units)
    runs = {name: run_variant(variant_config(config, demo, name, rm["model_path"]), sft["model_path"], demo.kl_samples)
            for name in demo.variants}
    summary = {"task": "units", "heldout_size": min(config.eval.size or len(heldout), len(heldout)),
               "rm": {**{k: rm[k] for k in ("rm_accuracy", "rm_ece", "train_pairs", "heldout_pairs", "calibration")},
                      "probe": probe},
               "sft": runs[demo.variants[0]]["curve"][0], "runs": runs, "seconds": time.perf_counter() - start,
               "sft_seconds": sft["sft_seconds"], "rm_seconds": rm["rm_seconds"],
               "demo": dataclasses.asdict(demo)}
    summary["plot"] = str(plot_rlhf(runs, out / "rlhf.png"))
    write_json(out / "summary.json", summary)
    return summary


def plot_rlhf(runs: dict[str, dict], out_png: Path) -> Path:
    """RM score, hidden-rule rate and KL against step per variant, and rule rate against KL."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2).flatten()
    panels = (("rm_score", "reward-model score"), ("rule_rate", "hidden rule satisfied"), ("kl_to_sft", "KL to SFT"))
    for ax, (key, label) in zip(axes, panels):
        for name, run in runs.items():
            ax.plot([p["step"] for p in run["curve"]], [p[key] for p in run["curve"]], marker="o", markersize=3,
                    label=name)
        ax.set_xlabel("RL step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    for name, run in runs.items():
        axes[3].plot([p["kl_to_sft"] for p in run["curve"]], [p["rule_rate"] for p in run["curve"]], marker="o",
                     markersize=4, linestyle="none", label=name)  # KL is not monotone in steps: points, no lines
    axes[3].set_xlabel("KL(policy || SFT) per reply")
    axes[3].set_ylabel("hidden rule satisfied")
    axes[3].grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("RLHF on the units task: held-out prompts, greedy replies")
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return out_png


# ---------------------------------------------------------------------------- command
def print_summary(summary: dict[str, Any], console) -> None:
    """The end-of-run table (SFT, each variant's last and best-rule points), what the RM learned, the curves."""
    from rich.table import Table

    rm = summary["rm"]
    keys = ("rule_rate", "rm_score", "accuracy", "unit_rate", "kl_to_sft")
    table = Table(title=f"units: {summary['heldout_size']} held-out prompts, greedy replies "
                        "(rule: number and unit right; number: number right; unit: any unit stated)")
    for column in ("model", "step", "rule", "RM score", "number", "unit", "KL"):
        table.add_column(column, justify="left" if column == "model" else "right")
    rows = [("SFT", summary["sft"])]
    for name, run in summary["runs"].items():
        best = max(run["curve"], key=lambda p: (p["rule_rate"], -p["step"]))
        rows += [(name, run["final"])] + ([(f"{name} best", best)] if best is not run["final"] else [])
    for name, point in rows:
        table.add_row(name, str(point["step"]), *(f"{point[k]:.3f}" for k in keys))
    console.print(table)
    console.print(f"reward model: held-out pair accuracy {rm['rm_accuracy']:.3f}, ECE {rm['rm_ece']:.3f}; its scores "
                  f"for {rm['probe']['prompt']!r}: " + ", ".join(f"{k} {v:+.2f}" for k, v in rm["probe"].items()
                                                                  if k != "prompt"), soft_wrap=True)
    for name, run in summary["runs"].items():
        curve = ", ".join(f"{p['step']}: {p['rm_score']:+.2f}/{p['rule_rate']:.2f}/{p['kl_to_sft']:.1f}"
                          for p in run["curve"])
        console.print(f"{name} curve (step: RM score/rule rate/KL): {curve}", soft_wrap=True)
        examples = "; ".join(f"{k} -> {v.replace('<|im_end|>', '')}" for k, v in list(run["examples"].items())[:4])
        console.print(f"{name} replies at step {run['final']['step']}: {examples}", soft_wrap=True)
    console.print(f"total {summary['seconds']:.0f} s (SFT {summary['sft_seconds']:.0f} s, reward model "
                  f"{summary['rm_seconds']:.0f} s); plot: {summary['plot']}")
