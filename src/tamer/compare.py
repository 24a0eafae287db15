"""`tamer compare`: SFT once, then GRPO and PPO from that checkpoint with the same budget.

    config = load_config(RunConfig, ["configs/compare.yaml"], ["rl.steps=20"])
    summary = run_compare(config)                     # OUTPUT_DIR/summary.json + compare.png

Both RL methods start from the model `run_sft` saved, run the same number of steps with
the same prompts per step and group size, and are evaluated on the same held-out tasks.
What differs is what each must hold: GRPO one policy (plus a frozen reference if
`rl.algorithm.kl_coef` > 0); PPO the policy and a critic as large as it (by default).

Memory is measured, not computed: every phase (SFT, GRPO, PPO) runs in its own Python
process (`tamer.phases.run_in_child`), so one method's allocations never count against
another. The preset `configs/compare.yaml` uses a 35.6M-parameter model, big enough that
weights, gradients and Adam state outweigh the ~335 MB Python + torch + transformers take
before any model exists (docs/compare_and_advise.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from tamer.config import to_dict
from tamer.phases import run_in_child
from tamer.pipeline import RunConfig, write_json
from tamer.tracking import read_metrics

METHODS = {"grpo": "grpo", "ppo": "gae"}  # method -> rl.algorithm.advantage
LABELS = {"sft": "SFT", "grpo": "GRPO", "ppo": "PPO"}


def method_config(config: RunConfig, method: str, sft_model: str) -> RunConfig:
    """`config` for one RL method: from the SFT model, into OUTPUT_DIR/METHOD."""
    algorithm = dataclasses.replace(config.rl.algorithm, advantage=METHODS[method])
    return dataclasses.replace(config, output_dir=str(Path(config.output_dir) / method),
                               model=dataclasses.replace(config.model, path=sft_model),
                               rl=dataclasses.replace(config.rl, algorithm=algorithm))


def _curve(metrics_path: str, key: str) -> list[list[float]]:
    return [[r["step"], r[key]] for r in read_metrics(metrics_path)
            if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]  # null: a NaN that was logged


def _row(method: str, result: dict[str, Any], accuracy: float | None) -> dict[str, Any]:
    row = {"method": LABELS[method], "heldout_accuracy": accuracy, "seconds": result["seconds"],
           "peak_rss_mb": result["peak_rss_mb"], "baseline_rss_mb": result["baseline_rss_mb"],
           "rss_after_load_mb": result["rss_after_load_mb"], "models_held": result["models_held"],
           "trainable_parameters": result["trainable_parameters"]}
    if method in METHODS:
        row.update(model_path=result["model_path"], parameters_held=result["parameters_held"],
                   reward_errors=result["reward_errors"],
                   reward_curve=_curve(result["metrics"], "reward/mean"),
                   accuracy_curve=_curve(result["metrics"], "eval/accuracy"))
    return row


def run_compare(config: RunConfig, *, sft_model: str | None = None, quiet: bool = False) -> dict[str, Any]:
    """SFT, then GRPO and PPO from the SFT model; writes summary.json and compare.png.

    With `sft_model` (a saved SFT model directory) SFT is skipped and the SFT row is that
    model's held-out evaluation (its seconds and memory are the evaluation's).
    """
    out = Path(config.output_dir)
    start = time.perf_counter()
    if sft_model:
        given = dataclasses.replace(config, model=dataclasses.replace(config.model, path=sft_model))
        sft = run_in_child("eval", given, quiet=quiet)
    else:
        sft = run_in_child("sft", config, quiet=quiet)
    rows = {"sft": _row("sft", sft, sft["sft_accuracy"])}
    if sft_model:
        rows["sft"]["method"] = "SFT (given; eval only)"
    for method in METHODS:
        result = run_in_child("rl", method_config(config, method, sft["model_path"]), quiet=quiet)
        rows[method] = _row(method, result, result["final"].get("eval/accuracy"))
    rl = config.rl
    summary = {
        "task": config.task.name, "sft_model": sft["model_path"], "sft_ran": not sft_model, "rows": rows,
        "budget": {"rl_steps": rl.steps, "prompts_per_step": rl.prompts_per_step, "group_size": rl.group_size,
                   "samples": rl.steps * rl.prompts_per_step * rl.group_size, "max_new_tokens": rl.max_new_tokens,
                   "eval_tasks": config.eval.size, "critic_shared": rl.critic.shared, "kl_coef": rl.algorithm.kl_coef},
        "grpo_over_ppo_peak_rss": rows["grpo"]["peak_rss_mb"] / rows["ppo"]["peak_rss_mb"],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "dtype": config.model.dtype},
        "seconds": time.perf_counter() - start, "config": to_dict(config),
    }
    summary["plot"] = str(plot_compare(rows, out / "compare.png", title=f"GRPO vs PPO on {config.task.name}"))
    write_json(out / "summary.json", summary)
    return summary


def plot_compare(rows: dict[str, dict], out_png: Path, title: str) -> Path:
    """Write `compare_figure` as a PNG; returns its path."""
    fig = compare_figure(rows, title)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return out_png


def compare_figure(rows: dict[str, dict], title: str):
    """One figure: every method's reward and held-out accuracy curves, peak memory and seconds.

    Accuracy shows SFT's level (where both RL methods start) dashed; the memory panel marks
    the interpreter + torch baseline every process pays, so the difference above it shows.
    """
    fig = Figure(figsize=(11, 7.2), layout="constrained")
    FigureCanvasAgg(fig)
    (reward_ax, acc_ax), (mem_ax, sec_ax) = fig.subplots(2, 2)
    colors = {"sft": "tab:gray", "grpo": "tab:blue", "ppo": "tab:red"}
    for method in METHODS:
        for ax, key, marker in ((reward_ax, "reward_curve", None), (acc_ax, "accuracy_curve", "o")):
            points = rows[method][key]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker, markersize=4,
                    color=colors[method], label=LABELS[method])
    if rows["sft"]["heldout_accuracy"] is not None:
        acc_ax.axhline(rows["sft"]["heldout_accuracy"], color=colors["sft"], linestyle="--",
                       label=f"SFT {rows['sft']['heldout_accuracy']:.3f}")
    reward_ax.set(ylabel="reward/mean", xlabel="RL step", title="reward per step")
    acc_ax.set(ylabel="held-out accuracy", xlabel="RL step", title="held-out accuracy")
    names = list(rows)
    labels = [LABELS.get(m, m) for m in names]
    bars = mem_ax.bar(labels, [rows[m]["peak_rss_mb"] for m in names],
                      color=[colors.get(m, "tab:green") for m in names])
    mem_ax.bar_label(bars, fmt="%.0f")
    mem_ax.axhline(rows["sft"]["baseline_rss_mb"], color="black", linestyle=":", label="Python + torch baseline")
    mem_ax.set(ylabel="peak RSS (MB, measured)", title="peak memory, each method in its own process")
    bars = sec_ax.bar(labels, [rows[m]["seconds"] for m in names], color=[colors.get(m, "tab:green") for m in names])
    sec_ax.bar_label(bars, fmt="%.0f")
    sec_ax.set(ylabel="seconds", title="wall-clock time")
    for ax in (reward_ax, acc_ax, mem_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    sec_ax.grid(alpha=0.3)
    fig.suptitle(title)
    return fig
