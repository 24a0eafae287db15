"""`tamer compare`: SFT once, then GRPO and PPO from that checkpoint with the same budget.

    config = compare_config(None, ["rl.steps=20"])    # compare's defaults, then yours
    summary = run_compare(config)                     # OUTPUT_DIR/summary.json + compare.png

Both RL methods start from the model `run_sft` saved, run the same number of steps with
the same prompts per step and group size, and are evaluated on the same held-out tasks.
What differs is what each must hold: GRPO one policy (plus a frozen reference if
`rl.algorithm.kl_coef` > 0); PPO the policy and a critic as large as it (by default).

Memory is measured, not computed. Every phase (SFT, GRPO, PPO) runs in its own Python
process (`python -m tamer.compare SPEC.json`), so one method's allocations never count
against another; the figure is that process's peak resident set (VmHWM from
/proc/self/status, read when the phase ends). It includes the interpreter, torch and
transformers (`baseline_rss_mb`, measured after the imports) — a cost every method pays.
`getrusage(RUSAGE_CHILDREN)` is not used: on Linux a child's ru_maxrss starts from its
parent's RSS at fork, and it is a maximum over all children, not per child.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import typer

from tamer.config import ConfigError, from_dict, merge, parse_overrides, to_dict

# The options `tamer.cli` also uses. tamer.cli imports this module to register its command,
# so nothing from tamer.cli is imported here at module level (it would be circular).
ConfigOpt = typer.Option(None, "--config", "-c", help="YAML file with RunConfig sections (model, task, reward, sft, rl, eval, tracking).")
SetOpt = typer.Option(None, "--set", "-s", help="Override one field, e.g. --set rl.steps=50 --set rl.optim.lr=1e-5 (repeatable).")
SeedOpt = typer.Option(None, "--seed", help="Seed for model init, data order and sampling (sets model.tiny.seed, sft.seed, rl.seed).")
OutOpt = typer.Option(None, "--output-dir", "-o", help="Where metrics, models, summary.json and the plot go.")

# A model big enough that weights, gradients and Adam state (~23 bytes per parameter at
# GRPO's peak, measured) outweigh the ~335 MB that Python + torch + transformers take
# before any model exists: with the 1M-parameter demo model every method's memory is
# mostly that baseline. 768 x 4 layers is 35.6M parameters. A small micro-batch keeps
# activations (the same for both methods) from hiding the difference.
COMPARE_DEFAULTS = (
    "output_dir=runs/compare",
    "model.tiny.hidden_size=768", "model.tiny.num_layers=4", "model.tiny.num_heads=8",
    "model.tiny.num_kv_heads=4", "model.tiny.intermediate_size=3072",
    "task.arithmetic.heldout_size=200", "task.arithmetic.demo_slip_rate=0.5", "eval.size=200",
    "sft.steps=300", "sft.batch_size=32", "sft.optim.lr=5e-4", "sft.optim.warmup_steps=10",
    "sft.optim.schedule=cosine",
    "rl.steps=12", "rl.prompts_per_step=8", "rl.group_size=8", "rl.max_new_tokens=32",
    "rl.optim.lr=2e-5", "rl.optim.warmup_steps=2", "rl.micro_batch_tokens=256", "rl.eval_every=4",
    "tracking.tensorboard=false", "tracking.console_every=4",
)
METHODS = {"grpo": "grpo", "ppo": "gae"}  # method -> rl.algorithm.advantage
# Sequences generated at once (rollouts and held-out evaluation). The engine's default of
# 256 makes evaluating 200 held-out tasks a transient peak that both methods pay alike
# and that would hide the difference the comparison is about.
GENERATION_BATCH = 64
LABELS = {"sft": "SFT", "grpo": "GRPO", "ppo": "PPO"}


# ---------------------------------------------------------------------------- memory
def _proc_status_mb(key: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # kB -> MB
    except OSError:
        pass
    return None


def current_rss_mb() -> float:
    """Resident set size of this process now, in MB."""
    value = _proc_status_mb("VmRSS")
    return value if value is not None else peak_rss_mb()


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (VmHWM), in MB."""
    value = _proc_status_mb("VmHWM")
    if value is not None:
        return value
    import resource  # not Linux: ru_maxrss is kB on Linux/BSD, bytes on macOS

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


# ---------------------------------------------------------------------------- child processes
class PhaseError(RuntimeError):
    """A phase's child process failed; the message carries the tail of its stderr."""


def run_in_child(phase: str, config, *, reward_fns: dict[str, str] | None = None, measure_steps: int = 0,
                 quiet: bool = False, timeout: float | None = None) -> dict[str, Any]:
    """Run one phase (`sft`, `rl`) in a fresh Python process; returns its result dict.

    `reward_fns` maps reward names to "module:function" paths the child imports (your own
    reward functions). `measure_steps` > 0 runs that many RL steps only, without evaluation.
    """
    with tempfile.TemporaryDirectory(prefix="tamer-phase-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec = {"phase": phase, "config": to_dict(config), "reward_fns": reward_fns or {},
                "measure_steps": measure_steps, "result": str(result_path)}
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        # The child sees what this process sees (e.g. a test module holding a reward function).
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        out = subprocess.DEVNULL if quiet else None
        proc = subprocess.run([sys.executable, "-m", "tamer.compare", str(spec_path)], env=env, stdout=out,
                              stderr=subprocess.PIPE, text=True, timeout=timeout)
        if proc.returncode != 0 or not result_path.is_file():
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise PhaseError(f"phase {phase!r} failed (exit {proc.returncode}):\n{tail}")
        if proc.stderr and not quiet:
            sys.stderr.write(proc.stderr)
        return json.loads(result_path.read_text())


def import_function(path: str):
    """`package.module:function` -> the function."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ConfigError(f"reward function {path!r}: expected module:function")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"reward function {path!r}: {err}") from None


def held_models(trainer) -> list:
    """The modules an RL trainer keeps in memory: policy, critic (unless shared), reference."""
    models = [trainer.model]
    if trainer.critic is not None and not trainer.critic.config.shared:
        models.append(trainer.critic.model)
    if trainer.ref_model is not None:
        models.append(trainer.ref_model)
    return models


def trainable_parameters(trainer) -> int:
    """Parameters that receive updates, counted once each from the actual modules."""
    modules = [trainer.model] + ([trainer.critic.model] if trainer.critic is not None else [])
    params = {id(p): p for m in modules for p in m.parameters() if p.requires_grad}
    return sum(p.numel() for p in params.values())


def _phase_sft(config) -> dict[str, Any]:
    from tamer.pipeline import build_policy, run_sft

    model, tokenizer = build_policy(config.model, config.task)
    loaded = current_rss_mb()
    result = run_sft(config, model, tokenizer)
    return {**result, "rss_after_load_mb": loaded, "models_held": 1,
            "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def _phase_eval(config) -> dict[str, Any]:
    """Held-out evaluation of `config.model` (an SFT model given with --sft-model)."""
    from tamer.pipeline import build_policy, evaluate_model
    from tamer.tasks import get_task_source

    model, tokenizer = build_policy(config.model, config.task)
    loaded = current_rss_mb()
    report = evaluate_model(model, tokenizer, get_task_source(config.task).split()[1], config.eval)
    return {"sft_accuracy": report.accuracy, "model_path": config.model.path, "rss_after_load_mb": loaded,
            "models_held": 1, "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def _phase_rl(config, reward_extra: dict, measure_steps: int) -> dict[str, Any]:
    """Train (or, with `measure_steps`, only time) the RL method that `config` names."""
    from tamer.pipeline import build_policy, tracker_for
    from tamer.rewards import RewardComposer
    from tamer.rollout.engine import HFEngine
    from tamer.tasks import get_task_source
    from tamer.trainers.common import seed_everything
    from tamer.trainers.rl import RLTrainer

    model, tokenizer = build_policy(config.model, config.task)
    train, heldout = get_task_source(config.task).split()
    seed_everything(config.rl.seed)
    loaded = current_rss_mb()
    run_dir = Path(config.output_dir) / "rl"
    start = time.perf_counter()
    label = config.rl.algorithm.advantage
    with tracker_for(config, "rl", config.rl.steps, label) as tracker:
        trainer = RLTrainer(model, tokenizer, train, heldout, RewardComposer(config.reward, reward_extra),
                            config.rl, config.eval, run_dir=run_dir, tracker=tracker,
                            engine=HFEngine(model, tokenizer.pad_token_id, max_batch=GENERATION_BATCH))
        final = trainer.train() if not measure_steps else {}
        step_seconds = [_one_step(trainer, step) for step in range(1, measure_steps + 1)]
    if not measure_steps:
        from tamer.models import save_model

        save_model(model, tokenizer, run_dir / "model")
    return {"final": final, "model_path": str(run_dir / "model") if not measure_steps else None,
            "rl_seconds": time.perf_counter() - start, "rss_after_load_mb": loaded, "step_seconds": step_seconds, "models_held": len(held_models(trainer)),
            "parameters_held": sum(sum(p.numel() for p in {id(p): p for p in m.parameters()}.values())
                                   for m in held_models(trainer)),
            "trainable_parameters": trainable_parameters(trainer), "metrics": str(tracker.metrics_path),
            "reward_errors": trainer.rewards.total_errors}


def _one_step(trainer, step: int) -> float:
    """One RL step (collect, advantages, update) without evaluation; its wall-clock seconds."""
    start = time.perf_counter()
    trajectories, _ = trainer.collect(step)
    if trajectories:
        trainer.update(trainer.make_batch(trajectories), step)
    trainer.step = step
    return time.perf_counter() - start


def _child_main(spec_path: str) -> None:
    from tamer.pipeline import RunConfig

    baseline = current_rss_mb()  # interpreter + torch + transformers + tamer, before any model
    spec = json.loads(Path(spec_path).read_text())
    config = from_dict(RunConfig, spec["config"])
    start = time.perf_counter()
    if spec["phase"] == "sft":
        result = _phase_sft(config)
    elif spec["phase"] == "eval":
        result = _phase_eval(config)
    elif spec["phase"] == "rl":
        extra = {name: import_function(path) for name, path in spec["reward_fns"].items()}
        result = _phase_rl(config, extra, spec["measure_steps"])
    else:
        raise ValueError(f"unknown phase {spec['phase']!r}")
    result.update({"seconds": time.perf_counter() - start, "peak_rss_mb": peak_rss_mb(), "baseline_rss_mb": baseline})
    Path(spec["result"]).write_text(json.dumps(result, default=str))


# ---------------------------------------------------------------------------- the comparison
def compare_config(path: Optional[Path], overrides: Optional[list[str]], seed: Optional[int] = None,
                   output_dir: Optional[str] = None):
    """RunConfig from compare's defaults, then the YAML file, then `--set` overrides."""
    import yaml

    from tamer.pipeline import RunConfig, with_seed

    data = parse_overrides(list(COMPARE_DEFAULTS))
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        data = merge(data, loaded)
    items = list(overrides or []) + ([f"output_dir={output_dir}"] if output_dir else [])
    config = from_dict(RunConfig, merge(data, parse_overrides(items)))
    return with_seed(config, seed) if seed is not None else config


def method_config(config, method: str, sft_model: str):
    """`config` for one RL method: from the SFT model, into OUTPUT_DIR/METHOD."""
    algorithm = dataclasses.replace(config.rl.algorithm, advantage=METHODS[method])
    return dataclasses.replace(config, output_dir=str(Path(config.output_dir) / method),
                               model=dataclasses.replace(config.model, path=sft_model),
                               rl=dataclasses.replace(config.rl, algorithm=algorithm))


def _curve(metrics_path: str, key: str) -> list[list[float]]:
    from tamer.tracking import read_metrics

    return [[r["step"], r[key]] for r in read_metrics(metrics_path) if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


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


def run_compare(config, *, sft_model: str | None = None, quiet: bool = False) -> dict[str, Any]:
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
    from tamer.pipeline import write_json

    write_json(out / "summary.json", summary)
    return summary


def plot_compare(rows: dict[str, dict], out_png: Path, title: str) -> Path:
    """Reward (mean per step) and held-out accuracy against step, both methods on one figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 5.6), layout="constrained")
    FigureCanvasAgg(fig)
    reward_ax, acc_ax = fig.subplots(2, 1, sharex=True)
    for method in METHODS:
        for ax, key, marker in ((reward_ax, "reward_curve", None), (acc_ax, "accuracy_curve", "o")):
            points = rows[method][key]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker, markersize=4, label=LABELS[method])
    if rows["sft"]["heldout_accuracy"] is not None:
        acc_ax.axhline(rows["sft"]["heldout_accuracy"], color="gray", linestyle="--", label="SFT (start)")
    reward_ax.set_ylabel("reward/mean")
    acc_ax.set_ylabel("held-out accuracy")
    acc_ax.set_xlabel("RL step")
    for ax in (reward_ax, acc_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return out_png


def print_table(summary: dict[str, Any]) -> None:
    from rich.table import Table

    from tamer.cli import console

    budget = summary["budget"]
    table = Table(title=f"{summary['task']}: SFT, then {budget['rl_steps']} RL steps x {budget['prompts_per_step']} "
                        f"prompts x {budget['group_size']} samples each")
    for column in ("method", "held-out acc", "seconds", "peak RSS MB", "models held", "trainable params", "reward first -> last"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for key, row in summary["rows"].items():
        curve = row.get("reward_curve") or []
        rewards = f"{curve[0][1]:.3f} -> {curve[-1][1]:.3f}" if curve else "-"
        acc = row["heldout_accuracy"]
        table.add_row(row["method"], "-" if acc is None else f"{acc:.3f}", f"{row['seconds']:.0f}",
                      f"{row['peak_rss_mb']:.0f}", str(row["models_held"]), f"{row['trainable_parameters']:,}", rewards)
    console.print(table)
    console.print(f"GRPO peak RSS / PPO peak RSS = {summary['grpo_over_ppo_peak_rss']:.2f} "
                  f"(each in its own process; Python + torch alone: {summary['rows']['sft']['baseline_rss_mb']:.0f} MB)")


def _or_exit(job):
    """A failed phase (child process) as a red error line and exit status 1."""
    from tamer.cli import console

    try:
        return job()
    except PhaseError as err:
        console.print(f"[bold red]error:[/] {err}", soft_wrap=True)
        raise typer.Exit(1) from None


def compare_command(config: Optional[Path] = ConfigOpt, set_: Optional[list[str]] = SetOpt,
                    seed: Optional[int] = SeedOpt, output_dir: Optional[str] = OutOpt,
                    sft_model: Optional[str] = typer.Option(None, "--sft-model", help="Start both RL methods from this saved SFT model instead of running SFT (e.g. OUTPUT_DIR/sft/model of an earlier compare)."),
                    as_json: bool = typer.Option(False, "--json", help="Print summary.json instead of a table."),
                    quiet: bool = typer.Option(False, "--quiet", "-q", help="Hide the phases' own progress lines.")) -> None:
    """SFT, then PPO and GRPO from the same SFT model with the same budget; compare them.

    Reports per method held-out accuracy, wall-clock seconds, peak resident memory (measured,
    each phase in its own process), models held, trainable parameters and the reward curve.
    Writes OUTPUT_DIR/summary.json and OUTPUT_DIR/compare.png (default OUTPUT_DIR: runs/compare).
    Defaults differ from `tamer demo`: a 35.6M-parameter model, 300 SFT steps (see `tamer.compare.COMPARE_DEFAULTS`).
    """
    from tamer.cli import _guard, console

    cfg = _guard(lambda: compare_config(config, set_, seed, output_dir))
    if sft_model and not (Path(sft_model) / "config.json").is_file():
        console.print(f"[bold red]error:[/] --sft-model {sft_model}: not a saved model directory (no config.json)")
        raise typer.Exit(2)
    summary = _guard(lambda: _or_exit(lambda: run_compare(cfg, sft_model=sft_model, quiet=quiet or as_json)))
    if as_json:
        print(json.dumps(summary, default=str))
        return
    print_table(summary)
    console.print(f"summary: {Path(cfg.output_dir) / 'summary.json'}; plot: {summary['plot']}")


if __name__ == "__main__":
    _child_main(sys.argv[1])
