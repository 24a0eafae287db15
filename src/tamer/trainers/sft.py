"""Supervised fine-tuning on demonstrations: loss on completion tokens only.

    data = demonstrations(source, train_tasks, tokenizer, seed=0)
    SFTTrainer(model, tokenizer, data, SFTConfig(steps=800)).train(tracker)

With `run_dir`, `save_checkpoint()` writes `run_dir/checkpoints/step-N` (weights, optimizer,
schedule, RNG, the running loss) and `resume(path)` continues from one exactly: the data
order is a function of the seed and the step. A stop signal (tamer.stopping) ends `train`
after the current step with a checkpoint and `TrainingStopped`.

Each example is a chat prompt and the assistant's reply; the reply ends with the turn's
stop token so that the model learns when to stop. Prompt and padding tokens are masked
out of the loss.

Llama/Qwen2-family models train on padding-free batches (`sft.padding_free`, default on:
`trainers/packed.py`, the same loss without padded tokens, and logits only where a token is
learned); other models, or `padding_free: false`, on right-padded batches through the HF forward.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tamer.checkpoint import load_checkpoint, save_checkpoint
from tamer.config import FieldError
from tamer.memory import keep_freed_memory
from tamer.models import encode_chat
from tamer.models.fast_forward import FastDecoder
from tamer.progress import report_progress
from tamer.rollout.agent import AgentConfig, AgentRollout
from tamer.stopping import TrainingStopped, stop_requested
from tamer.tasks.base import Task, TaskSource
from tamer.trainers.common import OptimConfig, clip_and_step, make_optimizer, make_scheduler, right_pad
from tamer.trainers.packed import pack, packable, packed_loss


@dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning schedule."""

    steps: int = 1000  # optimizer steps
    batch_size: int = 64  # demonstrations per step
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(
        lr=1e-3, warmup_steps=50, schedule="cosine"))  # AdamW and its schedule
    log_every: int = 25  # steps between logged (averaged) losses
    seed: int = 0  # order of the demonstrations
    padding_free: bool = True  # packed batches on the lean forward where supported; False: padded HF forward
    share_prefix: bool = True  # packed batches: the tokens every sequence starts with (system prompt) packed once
    checkpoint_every: int = 0  # steps between checkpoints in OUTPUT_DIR/sft/checkpoints; 0: none
    keep_checkpoints: int = 2  # newest checkpoints kept on disk

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "log_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"expected >= 1, got {getattr(self, name)}")
        if self.checkpoint_every < 0:
            raise FieldError("checkpoint_every", f"expected >= 0 (0: none), got {self.checkpoint_every}")


@dataclass
class Example:
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_mask: list[int] | None = None  # None: learn every completion token


def demonstrations(
    source: TaskSource, tasks: list[Task], tokenizer: PreTrainedTokenizerBase, seed: int = 0,
    agent: AgentConfig = AgentConfig(),
) -> list[Example]:
    """One demonstration per task from the task's demonstrator, tokenized for SFT.

    Environment tasks are replayed turn by turn through their environment, so the example
    holds the real tool outputs (masked out of the loss) between the demonstrator's turns.
    """
    rng = random.Random(seed)
    replayer = AgentRollout(None, tokenizer, agent)
    examples = []
    for task in tasks:
        if task.env is not None:
            traj = replayer.replay(task, source.demonstrate_turns(task, rng))
            examples.append(Example(traj.prompt_ids, traj.completion_ids, traj.loss_mask))
            continue
        reply = source.demonstrate(task, rng)
        completion = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        examples.append(Example(encode_chat(tokenizer, task.messages), completion))
    return examples


def demonstration_texts(source: TaskSource, tasks: list[Task], tokenizer: PreTrainedTokenizerBase,
                        limit: int = 2000, seed: int = 0) -> list[str]:
    """Full demonstration conversations as text (a corpus to train a tokenizer on)."""
    return [tokenizer.decode(e.prompt_ids + e.completion_ids)
            for e in demonstrations(source, tasks[:limit], tokenizer, seed=seed, agent=AgentConfig(show_tools=False))]


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask and loss_mask (1 on learned completion tokens)."""
    ids = [e.prompt_ids + e.completion_ids for e in examples]
    masks = [[0] * len(e.prompt_ids) + (e.completion_mask or [1] * len(e.completion_ids)) for e in examples]
    return {
        "input_ids": right_pad(ids, pad_id, torch.long),  # (B, T)
        "attention_mask": right_pad([[1] * len(r) for r in ids], 0, torch.long),  # (B, T)
        "loss_mask": right_pad(masks, 0, torch.float32),  # (B, T)
    }


def sft_loss(model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy over completion tokens."""
    positions = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=positions).logits[:, :-1].float()
    targets = batch["input_ids"][:, 1:]
    mask = batch["loss_mask"][:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return (nll * mask).sum() / mask.sum().clamp(min=1)


def batch_order(size: int, batch_size: int, seed: int):
    """Endless lists of `batch_size` indices into `size` examples: shuffled epochs, continued across epoch ends."""
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        if len(order) < batch_size:
            fresh = list(range(size))
            rng.shuffle(fresh)
            order += fresh
        chosen, order = order[:batch_size], order[batch_size:]
        yield chosen


class SFTTrainer:
    """Mini-batch SFT with AdamW and a warmup/decay schedule."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 data: list[Example], config: SFTConfig, run_dir: str | Path | None = None) -> None:
        if not data:
            raise ValueError("SFT needs at least one demonstration")
        keep_freed_memory()  # freed tensors' memory reused, not faulted in again each step (tamer.memory)
        self.model, self.tokenizer, self.data, self.config = model, tokenizer, data, config
        self.run_dir = Path(run_dir) if run_dir is not None else None
        fast = FastDecoder.for_model(model) if config.padding_free else None
        self.fast = fast if packable(fast) else None  # None: padded HF forward
        self.optimizer = make_optimizer(model, config.optim)
        self.scheduler = make_scheduler(self.optimizer, config.optim, config.steps)
        self.step = 0
        # Loss summed since the last log line, and the last logged mean: part of a checkpoint,
        # so that a resumed run logs exactly what an uninterrupted one would.
        self.running, self.count, self.last_loss = 0.0, 0, float("nan")

    def example_batches(self):
        """Endless mini-batches of examples (`batch_order`)."""
        for chosen in batch_order(len(self.data), self.config.batch_size, self.config.seed):
            yield [self.data[i] for i in chosen]

    def batches(self):
        """Padded batches (`collate`) in the order of `example_batches`."""
        for examples in self.example_batches():
            yield collate(examples, self.tokenizer.pad_token_id)

    def loss(self, examples: list[Example]) -> torch.Tensor:
        """Mean cross-entropy over the learned tokens of `examples` (packed or padded, the same value)."""
        if self.fast is not None:
            return packed_loss(self.model, pack(examples, share_prefix=self.config.share_prefix), self.fast)
        return sft_loss(self.model, collate(examples, self.tokenizer.pad_token_id))

    def train(self, tracker=None) -> float:
        """Run to `config.steps` updates (from `self.step` when resumed); return the last logged loss."""
        cfg = self.config
        self.model.train()
        batches = self.example_batches()
        for _ in range(self.step):  # resumed: skip the batches already trained on
            next(batches)
        while self.step < cfg.steps:
            loss = self.loss(next(batches))
            loss.backward()
            grad_norm = clip_and_step(self.model, self.optimizer, self.scheduler, cfg.optim.max_grad_norm)
            self.step += 1
            self.running, self.count = self.running + loss.item(), self.count + 1
            report_progress(self.step, {"sft/loss": self.running / self.count})  # the console's bar, every step
            if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                self.last_loss = self.running / self.count
                if tracker is not None:
                    tracker.log({"sft/loss": self.last_loss, "sft/grad_norm": grad_norm,
                                 "sft/lr": self.scheduler.get_last_lr()[0]}, self.step)
                self.running, self.count = 0.0, 0
            self._checkpoint_or_stop()
        self.model.eval()
        return self.last_loss

    def _checkpoint_or_stop(self) -> None:
        cfg = self.config
        stop = stop_requested() and self.step < cfg.steps and self.run_dir is not None
        if (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and self.run_dir is not None) or stop:
            saved = self.save_checkpoint()
        if stop:
            self.model.eval()
            raise TrainingStopped("sft", self.step, saved, total_steps=cfg.steps)

    def save_checkpoint(self) -> Path:
        if self.run_dir is None:
            raise ValueError("SFTTrainer.save_checkpoint needs run_dir")
        state = {"running": self.running, "count": self.count, "last_loss": self.last_loss}
        return save_checkpoint(self.run_dir / "checkpoints", self.step, model=self.model, optimizer=self.optimizer,
                               scheduler=self.scheduler, state=state, keep_last=self.config.keep_checkpoints,
                               tokenizer=self.tokenizer)

    def resume(self, path: str | Path) -> int:
        """Continue from a checkpoint directory; returns the step it resumes after."""
        state = load_checkpoint(path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler)
        self.running, self.count, self.last_loss = state["running"], state["count"], state["last_loss"]
        self.step = state["step"]
        return self.step
