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
from typing import Any

from rich.table import Table

from tamer.algorithms.preference import CalibrationReport
from tamer.models import count_parameters, save_model
from tamer.pipeline import RunConfig, build_policy, tracker_for, write_json
from tamer.tasks.preferences import PreferencePair, load_preference_pairs
from tamer.trainers.common import seed_everything
from tamer.trainers.reward_model import RewardModelTrainer, load_reward_base, reward_model_from

Pairs = tuple[list[PreferencePair], list[PreferencePair]]  # (train, held-out)


def run_rm(config: RunConfig, model=None, tokenizer=None, pairs: Pairs | None = None) -> dict[str, Any]:
    """Train a reward model per `config.rm`; saves OUTPUT_DIR/rm/model and OUTPUT_DIR/rm/summary.json.

    `model`/`tokenizer` (a causal LM in memory) and `pairs` (train, held-out) override
    `rm.base_model` and `rm.data`.
    """
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
    return {**result, "calibration_report": report}


def calibration_table(report: CalibrationReport, title: str) -> Table:
    """Per-bin confidence vs accuracy, as a Rich table."""
    table = Table(title=title)
    for column in ("confidence bin", "pairs", "mean confidence", "accuracy"):
        table.add_column(column, justify="right")
    for b in report.bins:
        if b.count:
            table.add_row(f"[{b.low:.2f}, {b.high:.2f})", str(b.count), f"{b.confidence:.3f}", f"{b.accuracy:.3f}")
    return table
