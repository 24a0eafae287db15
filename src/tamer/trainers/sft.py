"""Supervised fine-tuning on demonstrations: loss on completion tokens only.

    data = demonstrations(source, train_tasks, tokenizer, seed=0)
    SFTTrainer(model, tokenizer, data, SFTConfig(steps=800)).train(tracker)

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

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tamer.models import encode_chat
from tamer.rollout.agent import AgentConfig, AgentRollout
from tamer.rollout.fast_forward import FastDecoder
from tamer.tasks.base import Task, TaskSource
from tamer.trainers.common import OptimConfig, clip_and_step, make_optimizer, make_scheduler, right_pad
from tamer.trainers.packed import pack, packed_loss


@dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning schedule."""

    steps: int = 1000
    batch_size: int = 64
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, warmup_steps=50, schedule="cosine"))
    log_every: int = 25
    seed: int = 0
    padding_free: bool = True  # packed batches on the lean forward where supported; False: padded HF forward

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"sft.steps: expected >= 1, got {self.steps}")
        if self.batch_size < 1:
            raise ValueError(f"sft.batch_size: expected >= 1, got {self.batch_size}")


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
                 data: list[Example], config: SFTConfig) -> None:
        if not data:
            raise ValueError("SFT needs at least one demonstration")
        self.model, self.tokenizer, self.data, self.config = model, tokenizer, data, config
        self.fast = FastDecoder.for_model(model) if config.padding_free else None  # None: padded HF forward
        self.optimizer = make_optimizer(model, config.optim)
        self.scheduler = make_scheduler(self.optimizer, config.optim, config.steps)

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
            return packed_loss(self.model, pack(examples), self.fast)
        return sft_loss(self.model, collate(examples, self.tokenizer.pad_token_id))

    def train(self, tracker=None) -> float:
        """Run `config.steps` updates; return the last logged loss."""
        self.model.train()
        running, count = 0.0, 0
        loss_value = float("nan")
        for step, examples in zip(range(1, self.config.steps + 1), self.example_batches()):
            loss = self.loss(examples)
            loss.backward()
            grad_norm = clip_and_step(self.model, self.optimizer, self.scheduler, self.config.optim.max_grad_norm)
            running, count = running + loss.item(), count + 1
            if step % self.config.log_every == 0 or step == self.config.steps:
                loss_value = running / count
                if tracker is not None:
                    tracker.log({"sft/loss": loss_value, "sft/grad_norm": grad_norm,
                                 "sft/lr": self.scheduler.get_last_lr()[0]}, step)
                running, count = 0.0, 0
        self.model.eval()
        return loss_value
