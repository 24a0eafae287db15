"""A trained reward model as a reward function: scores each rollout's text, a batch at a time.

A reward model is a standard Hugging Face sequence-classification model with one label
(`AutoModelForSequenceClassification`: a causal-LM trunk whose last non-pad token feeds a
scalar head), saved with its tokenizer; `tamer rm` trains one. Text is laid out the same way
for training and for scoring (`preference_text`): the prompt through the reward model's chat
template, then the reply exactly as written (a rollout's completion keeps the stop token it
sampled; a preference pair's reply gets the EOS token appended, which a finished rollout
also ends with).

In a run config:

    reward:
      weights: {reward_model: 1.0}
      params: {reward_model: {path: runs/rm/rm/model, normalize: batch, device: cpu, dtype: float32}}

From Python: `RewardModelScorer(path).score_texts([...])` or, on a model in memory,
`RewardModelScorer.from_model(model, tokenizer)`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Generic, TypeVar

import torch
from transformers import AutoModelForSequenceClassification, PreTrainedModel, PreTrainedTokenizerBase

from tamer.models import load_tokenizer, quiet_progress
from tamer.rollout.types import Trajectory

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NORMALIZATIONS = ("none", "batch")
V = TypeVar("V")


class LRUCache(Generic[V]):
    """Text -> value, at most `size` entries (the least recently stored go first); size 0 keeps nothing."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"cache_size: expected >= 0, got {size}")
        self.size = size
        self._data: OrderedDict[str, V] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: str) -> V:
        return self._data[key]

    def update(self, items: dict[str, V]) -> None:
        if not self.size:
            return
        for key, value in items.items():
            self._data[key] = value
            self._data.move_to_end(key)
        while len(self._data) > self.size:
            self._data.popitem(last=False)


def preference_text(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], reply: str,
                    *, add_eos: bool = True) -> str:
    """The text a reward model reads: the prompt through the chat template, then `reply`.

    `add_eos` appends the EOS token unless the reply already ends with it (a pair's replies
    are bare text; a finished rollout's completion already ends with its stop token).
    Tokenizers without a chat template get the messages' contents joined by blank lines.
    """
    if getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    else:
        prompt = "".join(m["content"] + "\n\n" for m in messages)
    eos = tokenizer.eos_token or ""
    return prompt + reply + (eos if add_eos and eos and not reply.endswith(eos) else "")


def encode_texts(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str],
                 max_length: int) -> tuple[list[list[int]], int]:
    """Token ids per text, cut to their last `max_length` tokens (the reply is at the end); and how many were cut."""
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    cut = sum(len(row) > max_length for row in ids)
    return [row[-max_length:] for row in ids], cut


def pad_right(rows: list[list[int]], pad_id: int,
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, T) long, right-padded."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row)] = 1
    return ids.to(device), mask.to(device)


def reward_forward(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Scalar rewards (B,) float32 for right-padded rows; the HF head pools the last non-pad token.

    Positions are passed explicitly so that a row's reward does not depend on the batch's padding.
    """
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits  # (B, 1)
    return logits[:, 0].float()


class RewardModelScorer:
    """Batched, gradient-free scoring of texts with a reward model, on its own device and dtype."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, batch_size: int = 32,
                 max_length: int = 1024) -> None:
        if batch_size < 1 or max_length < 1:
            raise ValueError("batch_size and max_length must be >= 1")
        if model.config.num_labels != 1:
            raise ValueError(f"a reward model has one output (num_labels=1), this one has {model.config.num_labels}")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.batch_size, self.max_length = batch_size, max_length
        self.truncated = 0  # texts cut to max_length so far

    @classmethod
    def load(cls, path: str | Path, *, device: str = "cpu", dtype: str = "float32", **kwargs) -> RewardModelScorer:
        """The reward model saved at `path` (a local directory), loaded with plain transformers."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: not a Hugging Face model directory (no config.json)")
        if dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
        tokenizer = load_tokenizer(path)
        with quiet_progress():
            model = AutoModelForSequenceClassification.from_pretrained(path, dtype=DTYPES[dtype], local_files_only=True)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
            model.config.pad_token_id = tokenizer.pad_token_id
        for p in model.parameters():
            p.requires_grad_(False)
        return cls(model.to(device), tokenizer, **kwargs)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def score_texts(self, texts: Sequence[str]) -> list[float]:
        """One reward per text, `batch_size` texts per forward."""
        rows, cut = encode_texts(self.tokenizer, texts, self.max_length)
        self.truncated += cut
        out: list[float] = []
        for start in range(0, len(rows), self.batch_size):
            ids, mask = pad_right(rows[start:start + self.batch_size], self.tokenizer.pad_token_id, self.device)
            out += reward_forward(self.model, ids, mask).tolist()
        return out

    def score_pairs(self, messages: Sequence[Sequence[dict[str, str]]], replies: Sequence[str]) -> list[float]:
        return self.score_texts([preference_text(self.tokenizer, m, r) for m, r in zip(messages, replies)])


class RewardModelReward:
    """The `reward_model` reward function: a reward model's score of each rollout's prompt + completion.

    normalize="batch" z-scores the scores over each scoring pass (one RL step's rollouts), which
    puts a reward model's arbitrary scale on the same footing as other rewards in the weighted sum
    (GRPO's group normalisation makes it redundant for GRPO alone; PPO's value targets need it).
    Scores are cached per text (`cache_size` entries, 0 disables): a text's score never changes.
    """

    def __init__(self, path: str = "", *, device: str = "cpu", dtype: str = "float32", batch_size: int = 32,
                 max_length: int = 1024, normalize: str = "none", cache_size: int = 100_000,
                 scorer: RewardModelScorer | None = None) -> None:
        if normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize: expected one of {', '.join(NORMALIZATIONS)}, got {normalize!r}")
        if scorer is None and not path:
            raise ValueError("path: give the directory of a reward model (tamer rm saves OUTPUT_DIR/rm/model)")
        self.scorer = scorer or RewardModelScorer.load(path, device=device, dtype=dtype, batch_size=batch_size,
                                                       max_length=max_length)
        self.normalize = normalize
        self._cache: LRUCache[float] = LRUCache(cache_size)

    def text(self, traj: Trajectory) -> str:
        return preference_text(self.scorer.tokenizer, traj.task.messages, traj.text, add_eos=False)

    def score_batch(self, trajectories: list[Trajectory]) -> list[float]:
        texts = [self.text(t) for t in trajectories]
        missing = list(dict.fromkeys(t for t in texts if t not in self._cache))
        fresh = dict(zip(missing, self.scorer.score_texts(missing))) if missing else {}
        scores = [fresh[t] if t in fresh else self._cache.get(t) for t in texts]
        self._cache.update(fresh)
        if self.normalize == "batch" and len(scores) > 1:
            values = torch.tensor(scores, dtype=torch.float64)
            scores = ((values - values.mean()) / (values.std() + 1e-6)).tolist()
        return scores
