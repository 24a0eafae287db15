"""One RL update of the tiny model on a fixed batch, on one process or on torchrun ranks.

    python tests/distributed_update.py --out one.pt                                      # one process
    torchrun --nproc-per-node 2 tests/distributed_update.py --strategy ddp --out two.pt  # 2 ranks

Rank 0 saves the updated parameters and the update's metrics to `--out`; tests/test_scale_learner.py
compares them. The batch has rows of very different lengths, so the ranks' token counts differ.
"""

from __future__ import annotations

import argparse
import random

import torch

from tamer.evaluate import EvalConfig
from tamer.models import TinyModelConfig, build_char_tokenizer, build_tiny_model
from tamer.rewards import RewardComposer, RewardConfig
from tamer.rollout.types import Trajectory
from tamer.scale.learner import init_distributed, make_learner
from tamer.tasks import ArithmeticTasks
from tamer.trainers.common import OptimConfig
from tamer.trainers.critic import CriticConfig
from tamer.trainers.rl import AlgorithmConfig, RLConfig, RLTrainer

TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


def fixed_trajectories(tasks, tokenizer, rows: int = 10, seed: int = 0, tied: int = 0) -> list[Trajectory]:
    """`rows` trajectories in groups of 2, with completions of 1 to 40 tokens and random rewards; the first
    `tied` groups' two rewards equal (zero advantages)."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    out = []
    for i in range(rows):
        task = tasks[i // 2]
        prompt = tokenizer(task.messages[-1]["content"], add_special_tokens=False)["input_ids"][:12] or [5]
        length = 1 + (i * 13) % 40
        completion = [rng.randrange(4, vocab) for _ in range(length)]
        mask = [1 if rng.random() < 0.8 else 0 for _ in range(length)]
        mask[0] = 1
        out.append(Trajectory(task=task, group_id=i // 2, prompt_ids=prompt, completion_ids=completion, loss_mask=mask,
                              logprobs=[-rng.random() * 3 if m else 0.0 for m in mask], text="",
                              reward=float(rng.random() < 0.5) + rng.random() * 0.1))
        if i % 2 == 1 and i // 2 < tied:
            out[-1].reward = out[-2].reward
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="single")
    parser.add_argument("--out", required=True)
    parser.add_argument("--advantage", default="grpo")
    parser.add_argument("--mini-batches", type=int, default=2)
    parser.add_argument("--micro-batch-tokens", type=int, default=120)
    parser.add_argument("--aggregation", default="token-mean")
    parser.add_argument("--kl-coef", type=float, default=0.05)
    parser.add_argument("--tied-groups", type=int, default=0, help="groups whose rewards tie (of 5)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.strategy != "single":
        init_distributed("gloo")
    learner = make_learner(args.strategy)
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model(tokenizer, TINY)
    train, held = ArithmeticTasks().split()
    algorithm = AlgorithmConfig(advantage=args.advantage, aggregation=args.aggregation, kl_coef=args.kl_coef)
    config = RLConfig(steps=1, prompts_per_step=5, group_size=2, max_new_tokens=40, ppo_epochs=2,
                      mini_batches=args.mini_batches, micro_batch_tokens=args.micro_batch_tokens,
                      optim=OptimConfig(lr=1e-3), algorithm=algorithm, eval_every=0,
                      critic=CriticConfig(optim=OptimConfig(lr=1e-3)))
    trainer = RLTrainer(model, tokenizer, train, held, RewardComposer(RewardConfig()), config, EvalConfig(size=4),
                        run_dir="/tmp/unused", learner=learner)
    batch = trainer.make_batch(fixed_trajectories(train, tokenizer, tied=args.tied_groups))
    metrics = trainer.update(batch, step=1) | trainer._token_counts(batch)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    critic = getattr(trainer.advantage, "model", None)
    critic_state = learner.module_state(trainer.advantage.wrapped) if critic is not None else {}
    if learner.is_main:
        torch.save({"params": state, "critic": critic_state, "metrics": metrics}, args.out)
    learner.barrier()
    if torch.distributed.is_initialized():
        # As scale/rank.py does: a rank that exits with the group alive can abort in gloo's
        # teardown ("terminate called without an active exception"), failing the run after its work.
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
