"""Reward-model training: a causal-LM trunk with a scalar head, fit to preference pairs (Bradley–Terry).

    rm, rm_tokenizer = reward_model_from(policy, tokenizer)          # or load_reward_base("path")
    trainer = RewardModelTrainer(rm, rm_tokenizer, train_pairs, heldout_pairs, RewardModelConfig(steps=300))
    report = trainer.train(tracker)     # held-out pairwise accuracy, ECE, per-bin calibration
    save_model(rm, rm_tokenizer, "runs/x/rm/model")   # loads back with AutoModelForSequenceClassification

The model is the architecture's own `...ForSequenceClassification` with one label, so a
saved reward model is a standard Hugging Face checkpoint: its trunk starts as a copy of the
given causal LM (usually the SFT model, as in Ouyang et al., 2022), its head at zero (every
pair starts at P = 0.5). Each step takes `batch_size` pairs, runs chosen and rejected texts
through the model in one forward, and minimises the Bradley–Terry loss
(`tamer.algorithms.preference`). Texts are laid out by `preference_text`, the same function
the `reward_model` reward uses on rollouts.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from tamer.algorithms.preference import CalibrationReport, bradley_terry_loss, calibration
from tamer.config import FieldError
from tamer.learned_rewards.reward_model import encode_texts, pad_right, preference_text, reward_forward
from tamer.memory import keep_freed_memory
from tamer.models import load_tokenizer, quiet_progress
from tamer.tasks.preferences import PreferenceDataConfig, PreferencePair
from tamer.trainers.common import OptimConfig, clip_and_step, make_optimizer, make_scheduler


@dataclass(frozen=True)
class RewardModelConfig:
    """`tamer rm`: the preference data, the model to start from, and the training schedule."""

    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)  # the preference pairs
    base_model: str = ""  # local HF model directory to start from; "": the run's policy (model.path or model.tiny)
    steps: int = 300  # optimizer steps
    batch_size: int = 16  # pairs per step (2x as many sequences per forward)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(
        lr=1e-4, warmup_steps=20, schedule="cosine"))  # AdamW + schedule
    max_length: int = 1024  # tokens per text; longer texts keep their end (the reply)
    center_coef: float = 0.0  # c of c * mean((r_c + r_r)^2): keeps rewards centred on 0
    eval_every: int = 50  # steps between held-out evaluations; 0: only at the end
    eval_batch_size: int = 64  # pairs per held-out forward
    calibration_bins: int = 10  # confidence bins of the calibration report
    log_every: int = 10  # steps between logged losses
    seed: int = 0  # init of the head and order of the pairs

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "max_length", "eval_batch_size", "calibration_bins", "log_every"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"expected >= 1, got {getattr(self, name)}")
        if self.center_coef < 0:
            raise FieldError("center_coef", f"expected >= 0, got {self.center_coef}")
        if self.eval_every < 0:
            raise FieldError("eval_every", f"expected >= 0, got {self.eval_every}")


# ---------------------------------------------------------------------------- the model
def reward_model_from(lm: PreTrainedModel,
                      tokenizer: PreTrainedTokenizerBase) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A sequence-classification reward model whose trunk is a copy of causal LM `lm`; head at zero.

    Returns it with its own copy of the tokenizer, padded on the right (the side HF pooling and
    absolute positions expect when the saved model is used with plain transformers).
    """
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.padding_side = "right"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = copy.deepcopy(lm.config)
    config.num_labels, config.pad_token_id = 1, tokenizer.pad_token_id
    config.id2label, config.label2id = {0: "reward"}, {"reward": 0}
    with torch.random.fork_rng():
        rm = AutoModelForSequenceClassification.from_config(config)
    rm.base_model.load_state_dict(lm.base_model.state_dict())
    torch.nn.init.zeros_(rm.score.weight)
    return rm.to(device=lm.device, dtype=next(lm.parameters()).dtype), tokenizer


def load_reward_base(path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Start from a local directory: a reward model (training continues) or a causal LM (trunk copied)."""
    from tamer.models import load_model

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a Hugging Face model directory (no config.json)")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if any(a.endswith("ForSequenceClassification") for a in config.architectures or []) and config.num_labels == 1:
        tokenizer = load_tokenizer(path)
        with quiet_progress():
            return AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True), tokenizer
    lm, tokenizer = load_model(path)
    return reward_model_from(lm, tokenizer)


# ---------------------------------------------------------------------------- data
@dataclass
class EncodedPairs:
    """Pairs tokenized once: token ids of each chosen and rejected text, and margins (N,)."""

    chosen: list[list[int]]
    rejected: list[list[int]]
    margins: torch.Tensor  # (N,) float32
    truncated: int  # texts cut to max_length

    def __len__(self) -> int:
        return len(self.chosen)


def encode_pairs(tokenizer: PreTrainedTokenizerBase, pairs: list[PreferencePair], max_length: int) -> EncodedPairs:
    chosen, cut_c = encode_texts(tokenizer, [preference_text(tokenizer, p.messages, p.chosen) for p in pairs],
                                 max_length)
    rejected, cut_r = encode_texts(tokenizer, [preference_text(tokenizer, p.messages, p.rejected) for p in pairs],
                                   max_length)
    return EncodedPairs(chosen, rejected, torch.tensor([p.margin for p in pairs], dtype=torch.float32), cut_c + cut_r)


def pair_rewards(model: PreTrainedModel, pad_id: int, data: EncodedPairs,
                 rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen rewards, rejected rewards), each (B,) float32, of pairs `rows` in one forward."""
    ids, mask = pad_right([data.chosen[i] for i in rows] + [data.rejected[i] for i in rows], pad_id,
                          next(model.parameters()).device)
    rewards = reward_forward(model, ids, mask)  # (2B,)
    return rewards[:len(rows)], rewards[len(rows):]


# ---------------------------------------------------------------------------- training
class RewardModelTrainer:
    """Mini-batch Bradley–Terry training with AdamW, held-out accuracy and calibration."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, train_pairs: list[PreferencePair],
                 heldout_pairs: list[PreferencePair], config: RewardModelConfig) -> None:
        if not train_pairs or not heldout_pairs:
            raise ValueError("reward-model training needs training and held-out pairs")
        keep_freed_memory()  # freed tensors' memory reused, not faulted in again each step (tamer.memory)
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.train_data = encode_pairs(tokenizer, train_pairs, config.max_length)
        self.heldout_data = encode_pairs(tokenizer, heldout_pairs, config.max_length)
        self.use_margins = bool(self.train_data.margins.any())
        self.optimizer = make_optimizer(model, config.optim)
        self.scheduler = make_scheduler(self.optimizer, config.optim, config.steps)
        self.last_report: CalibrationReport | None = None

    def batches(self):
        """Pair indices, `batch_size` at a time, reshuffled every epoch."""
        rng = random.Random(self.config.seed)
        order: list[int] = []
        while True:
            if len(order) < self.config.batch_size:
                fresh = list(range(len(self.train_data)))
                rng.shuffle(fresh)
                order += fresh
            yield order[: self.config.batch_size]
            order = order[self.config.batch_size:]

    def train(self, tracker=None) -> CalibrationReport:
        """Run `config.steps` updates; returns the final held-out calibration report."""
        cfg = self.config
        sums: dict[str, float] = {}
        for step, rows in zip(range(1, cfg.steps + 1), self.batches()):
            self.model.train()
            chosen, rejected = pair_rewards(self.model, self.tokenizer.pad_token_id, self.train_data, rows)
            margins = self.train_data.margins[rows].to(chosen.device) if self.use_margins else None
            loss, parts = bradley_terry_loss(chosen, rejected, margins, cfg.center_coef)
            loss.backward()
            grad_norm = clip_and_step(self.model, self.optimizer, self.scheduler, cfg.optim.max_grad_norm)
            for key, value in {"loss": loss.item(), "grad_norm": grad_norm,
                               **{k: float(v) for k, v in parts.items()}}.items():
                sums[key] = sums.get(key, 0.0) + value
            metrics: dict[str, float] = {}
            if step % cfg.log_every == 0 or step == cfg.steps:
                n = cfg.log_every if step % cfg.log_every == 0 else step % cfg.log_every
                metrics = {f"rm/{k}": v / n for k, v in sums.items()}
                metrics["rm/lr"] = self.scheduler.get_last_lr()[0]
                sums = {}
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
                metrics.update(self.evaluate())
            if metrics and tracker is not None:
                tracker.log(metrics, step)
        self.model.eval()
        return self.last_report

    @torch.no_grad()
    def heldout_gaps(self) -> torch.Tensor:
        """r_c − r_r (N,) float32 for every held-out pair."""
        self.model.eval()
        data, gaps = self.heldout_data, []
        for start in range(0, len(data), self.config.eval_batch_size):
            rows = list(range(start, min(start + self.config.eval_batch_size, len(data))))
            chosen, rejected = pair_rewards(self.model, self.tokenizer.pad_token_id, data, rows)
            gaps.append((chosen - rejected).cpu())
        return torch.cat(gaps)

    def evaluate(self) -> dict[str, float]:
        gaps = self.heldout_gaps()
        margins = self.heldout_data.margins if self.use_margins else None
        loss, _ = bradley_terry_loss(gaps, torch.zeros_like(gaps), margins)
        self.last_report = calibration(gaps, self.config.calibration_bins)
        return {**self.last_report.metrics("rm_eval"), "rm_eval/loss": loss.item(),
                "rm_eval/reward_gap": float(gaps.mean())}
