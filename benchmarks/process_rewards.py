"""Outcome-only GRPO against per-turn process rewards on a long-horizon task, as JSON and a plot.

    python benchmarks/process_rewards.py [-c configs/demo-scheduler.yaml] [--seed 0] [-o runs/process]
        [--variants outcome,turn] [--sft-model DIR] [--set key=value ...]

Runs SFT once (or starts from `--sft-model`), then, from that same model, one RL run per
variant with the same budget, sampling seed and held-out set:

  outcome       rl.algorithm.advantage=grpo,      reward {correctness: 1}
  process_sum   rl.algorithm.advantage=grpo,      reward {correctness: 1, process: w}  (the sum only)
  turn          rl.algorithm.advantage=turn_grpo, reward {correctness: 1, process: w}  (per-turn credit)

w is `--process-weight` (0.5). Prints one JSON object: per variant the held-out curve
(greedy success rate and tool calls at each evaluation), the training reward curve, the final
figures, the mean tool calls of successful held-out episodes, and seconds; writes
OUT/process_rewards.json and OUT/process_rewards.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from tamer.config import load_config
from tamer.models import load_model
from tamer.pipeline import RunConfig, evaluate_model, run_rl, run_sft, seed_overrides
from tamer.tasks import get_task_source
from tamer.tracking import read_metrics

VARIANTS = {
    "outcome": ("grpo", False),
    "process_sum": ("grpo", True),
    "turn": ("turn_grpo", True),
}


def variant_config(base: RunConfig, name: str, process_weight: float, out: Path) -> RunConfig:
    advantage, with_process = VARIANTS[name]
    weights = {"correctness": 1.0, **({"process": process_weight} if with_process else {})}
    reward = dataclasses.replace(base.reward, weights=weights, params={})
    rl = dataclasses.replace(base.rl, algorithm=dataclasses.replace(base.rl.algorithm, advantage=advantage))
    return dataclasses.replace(base, reward=reward, rl=rl, output_dir=str(out / name))


def successful_calls(config: RunConfig, model_dir: Path) -> float | None:
    """Mean tool calls of the successful greedy held-out episodes of a saved model."""
    model, tokenizer = load_model(model_dir)
    _, heldout = get_task_source(config.task).split()
    report = evaluate_model(model, tokenizer, heldout[: config.eval.size], config)
    calls = [t.num_tool_calls for t in report.trajectories if t.info.get("success")]
    return sum(calls) / len(calls) if calls else None


def curves(metrics_path: Path) -> dict[str, list]:
    records = read_metrics(metrics_path)
    pick = lambda key: [[r["step"], r[key]] for r in records if key in r]  # noqa: E731
    return {"eval_success_rate": pick("eval/success_rate"), "eval_tool_calls": pick("eval/mean_tool_calls"),
            "train_success": pick("reward/correctness"), "train_process": pick("reward/process")}


def plot(results: dict, out_png: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 5.2), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    for name, result in results.items():
        for ax, key in ((top, "eval_success_rate"), (bottom, "train_success")):
            points = result["curves"][key]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o" if key.startswith("eval") else None,
                    markersize=4, label=name)
    top.set_ylabel("held-out success (greedy)")
    bottom.set_ylabel("training success (sampled)")
    bottom.set_xlabel("RL step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(out_png, dpi=100)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", default="configs/demo-scheduler.yaml")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-o", "--output-dir", default="runs/process_rewards")
    parser.add_argument("--variants", default="outcome,turn")
    parser.add_argument("--process-weight", type=float, default=0.5)
    parser.add_argument("--sft-model", default="", help="start every variant from this saved SFT model")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown[0]!r}; valid: {', '.join(VARIANTS)}")
    out = Path(args.output_dir)
    base = load_config(RunConfig, [args.config], seed_overrides(args.seed) + args.overrides + [f"output_dir={out}"])
    start = time.perf_counter()
    sft_dir = Path(args.sft_model) if args.sft_model else None
    sft_figures = {}
    if sft_dir is None:
        sft = run_sft(base)
        sft_dir = Path(sft["model_path"])
        sft_figures = {"sft_seconds": sft["sft_seconds"], "sft_success_rate": sft.get("sft_eval/success_rate")}
    # The SFT model's held-out figures are step 0 of every curve (measured once).
    initial = {k.replace("sft_eval/", "eval/"): v for k, v in sft.items() if k.startswith("sft_eval/")} \
        if sft_figures else None
    results = {}
    for name in names:
        config = variant_config(base, name, args.process_weight, out)
        model, tokenizer = load_model(sft_dir)
        if initial is None:
            _, heldout = get_task_source(config.task).split()
            initial = evaluate_model(model, tokenizer, heldout[: config.eval.size], config).metrics()
        t0 = time.perf_counter()
        final = run_rl(config, model, tokenizer, initial_eval=initial)
        results[name] = {
            "advantage": config.rl.algorithm.advantage, "reward_weights": config.reward.weights,
            "final_success_rate": final.get("eval/success_rate"), "final_tool_calls": final.get("eval/mean_tool_calls"),
            "successful_episode_tool_calls": successful_calls(config, Path(final["model_path"])),
            "seconds": time.perf_counter() - t0, "curves": curves(Path(config.output_dir) / "rl" / "metrics.jsonl"),
        }
    summary = {"config": args.config, "seed": args.seed, "sft_model": str(sft_dir), **sft_figures,
               "sft_heldout_success_rate": initial.get("eval/success_rate") if initial else None,
               "rl_steps": base.rl.steps, "variants": results, "seconds": time.perf_counter() - start}
    out.mkdir(parents=True, exist_ok=True)
    (out / "process_rewards.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(results, out / "process_rewards.png")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    sys.exit(main() and 0)
