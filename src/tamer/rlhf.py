"""`tamer rm`: train a Bradley–Terry reward model on preference pairs, then train against it.

    tamer rm -c run.yaml --data prefs.jsonl --model runs/x/sft/model    # -> OUTPUT_DIR/rm/model
    tamer train -c run.yaml --set 'reward.weights={reward_model: 1.0}' \\
        --set 'reward.params={reward_model: {path: OUTPUT_DIR/rm/model}}'

The `rm` section of a run config (`RewardModelConfig`) holds the data (`rm.data.*`: a local
JSONL/Parquet file or a Hugging Face dataset, the prompt/chosen/rejected/margin columns),
the model to start from (`rm.base_model`; default the run's policy) and the schedule. The
job reports held-out pairwise accuracy and calibration (accuracy per bin of predicted
confidence, and the expected calibration error) and writes OUTPUT_DIR/rm/summary.json.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from tamer.algorithms.preference import CalibrationReport
from tamer.models import count_parameters, save_model
from tamer.tasks.preferences import PreferencePair, load_preference_pairs
from tamer.trainers.common import seed_everything
from tamer.trainers.reward_model import RewardModelTrainer, load_reward_base, reward_model_from


Pairs = tuple[list[PreferencePair], list[PreferencePair]]  # (train, held-out)


def run_rm(config, model=None, tokenizer=None, pairs: Pairs | None = None) -> dict[str, Any]:
    """Train a reward model per `config.rm`; saves OUTPUT_DIR/rm/model and OUTPUT_DIR/rm/summary.json.

    `model`/`tokenizer` (a causal LM in memory) and `pairs` (train, held-out) override
    `rm.base_model` and `rm.data`.
    """
    from tamer.pipeline import build_policy, tracker_for, write_json

    cfg = config.rm
    train, heldout = pairs if pairs is not None else load_preference_pairs(cfg.data)
    seed_everything(cfg.seed)
    if model is not None:
        rm, rm_tokenizer = reward_model_from(model, tokenizer)
    elif cfg.base_model:
        rm, rm_tokenizer = load_reward_base(cfg.base_model)
    else:
        rm, rm_tokenizer = reward_model_from(*build_policy(config.model, config.task))
    start = time.perf_counter()
    with tracker_for(config, "rm", cfg.steps, "rm") as tracker:
        trainer = RewardModelTrainer(rm, rm_tokenizer, train, heldout, cfg)
        report = trainer.train(tracker)
    out = Path(config.output_dir) / "rm"
    save_model(rm, rm_tokenizer, out / "model")
    result = {"rm_accuracy": report.accuracy, "rm_ece": report.ece, "rm_mean_confidence": report.mean_confidence,
              "train_pairs": len(train), "heldout_pairs": len(heldout), "truncated_texts":
              trainer.train_data.truncated + trainer.heldout_data.truncated, "rm_seconds": time.perf_counter() - start,
              "parameters": count_parameters(rm), "model_path": str(out / "model"),
              "calibration": [vars(b) for b in report.bins]}
    write_json(out / "summary.json", result)
    return result


def calibration_table(report: CalibrationReport, title: str) -> Table:
    """Per-bin confidence vs accuracy, as a Rich table."""
    table = Table(title=title)
    for column in ("confidence bin", "pairs", "mean confidence", "accuracy"):
        table.add_column(column, justify="right")
    for b in report.bins:
        if b.count:
            table.add_row(f"[{b.low:.2f}, {b.high:.2f})", str(b.count), f"{b.confidence:.3f}", f"{b.accuracy:.3f}")
    return table


def rm_command(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML file with RunConfig sections; the rm section holds data and schedule."),
    set_: Optional[list[str]] = typer.Option(None, "--set", "-s", help="Override one field, e.g. --set rm.steps=500 (repeatable)."),
    data: Optional[str] = typer.Option(None, "--data", "-d", help="Preference file, .jsonl/.json/.parquet (sets rm.data.path)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Local HF model to start from, usually the SFT model (sets rm.base_model)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for init and data order (sets rm.seed)."),
    output_dir: Optional[str] = typer.Option(None, "--output-dir", "-o", help="Where the reward model, metrics and summary.json go."),
) -> None:
    """Train a Bradley–Terry reward model on preference pairs (prompt, chosen, rejected[, margin]).

    Saves OUTPUT_DIR/rm/model (a Hugging Face sequence-classification model with its tokenizer) and
    prints held-out pairwise accuracy and calibration. Use it as a reward with
    reward.weights={reward_model: 1.0} and reward.params={reward_model: {path: OUTPUT_DIR/rm/model}}.
    """
    from tamer.algorithms.preference import CalibrationBin
    from tamer.cli import _config, _guard, console

    extra = [f"rm.data.path={data}"] * bool(data) + [f"rm.base_model={model}"] * bool(model)
    extra += [f"rm.seed={seed}"] * (seed is not None)
    cfg = _guard(lambda: _config(config, set_, None, output_dir, extra))
    result = _guard(lambda: run_rm(cfg))
    report = CalibrationReport(result["rm_accuracy"], result["rm_ece"], result["rm_mean_confidence"],
                               [CalibrationBin(**b) for b in result["calibration"]])
    console.print(calibration_table(report, f"reward model: {result['heldout_pairs']} held-out pairs"))
    console.print(f"held-out pairwise accuracy {result['rm_accuracy']:.3f}, ECE {result['rm_ece']:.3f}; "
                  f"{result['rm_seconds']:.0f} s; model saved to {result['model_path']}")
