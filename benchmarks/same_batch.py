"""`vs_trl.py --same-batch`: one rollout batch through tamer's and TRL's GRPO losses.

Prints the largest per-token logprob difference, both losses, and the relative difference of
the two gradients, with TRL's own advantages (its std eps is 1e-4) and with tamer's. tamer's
side is its on-policy learner as it runs by default: reusing the sampler's projection outputs
(`tamer_replayed_sampler_outputs`), where TRL recomputes its forward.
"""

from __future__ import annotations

import json
from pathlib import Path

from grpo_workers import LEARNING, load, tamer_trainer, tasks_for, trl_config


def same_batch(args, tmp: Path, sft_checkpoint) -> None:
    """One batch, both losses: tamer's rollout of one step fed to tamer's loss and to TRL's `_compute_loss`."""
    import torch
    from trl import GRPOTrainer

    from tamer.algorithms import ADVANTAGES
    from tamer.rollout.engine import _left_pad
    from tamer.trainers.common import right_pad
    model_dir = args.sft_model or sft_checkpoint(tmp, args.seed)
    spec = dict(LEARNING, model=str(model_dir), beta=0.0, precision=args.precisions[0], threads=args.threads,
                seed=args.seed, total_steps=1, eval_size=16, eval_every=0, run_dir=str(tmp / "run"))
    model, tokenizer = load(spec)
    prompts, heldout = tasks_for(spec)
    tamer = tamer_trainer(spec, model, tokenizer, prompts, heldout)
    trajs, _ = tamer.collect(0)
    batch = tamer.make_batch(trajs)

    def grads(loss_fn) -> tuple[float, torch.Tensor]:
        model.train()
        model.zero_grad()
        loss = loss_fn()
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten().clone() for p in model.parameters()])

    tamer_loss, tamer_grad = grads(lambda: tamer.loss(batch)[0])
    trl = GRPOTrainer(model=model, processing_class=tokenizer,
                      reward_funcs=lambda completions, **_: [0.0] * len(completions),
                      args=trl_config(spec), train_dataset=__import__("datasets").Dataset.from_list(
                          [{"prompt": list(t.messages)} for t in prompts]))
    trl.current_gradient_accumulation_steps = 1  # set by Trainer.train(); _compute_loss reads it
    prompt_ids, prompt_mask = _left_pad([t.prompt_ids for t in trajs], tokenizer.pad_token_id)
    completion_ids = right_pad([t.completion_ids for t in trajs], tokenizer.pad_token_id, torch.long)
    completion_mask = right_pad([[1] * len(t.completion_ids) for t in trajs], 0, torch.long)
    # TRL's advantages: the same unbiased group std, with TRL's eps (1e-4; tamer's default is 1e-6)
    trl_adv = ADVANTAGES.get("grpo")(batch.rewards, batch.group_ids, eps=1e-4)
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                  completion_mask=completion_mask, num_items_in_batch=completion_mask.sum().float(),
                  old_per_token_logps=None)
    trl_loss, trl_grad = grads(lambda: trl._compute_loss(model, dict(inputs, advantages=trl_adv)))
    _, trl_grad_same_adv = grads(lambda: trl._compute_loss(model, dict(inputs, advantages=batch.advantages)))
    with torch.no_grad():
        ours = tamer._logprobs(model, batch)
        theirs = trl._get_per_token_logps_and_entropies(model, torch.cat([prompt_ids, completion_ids], 1),
                                                        torch.cat([prompt_mask, completion_mask], 1),
                                                        completion_ids.shape[1])[0]
    diff = max(float((ours[i, len(t.prompt_ids):len(t.prompt_ids) + len(t.completion_ids)]
                      - theirs[i, :len(t.completion_ids)]).abs().max()) for i, t in enumerate(trajs))
    rel = lambda a, b: float((a - b).norm() / b.norm().clamp(min=1e-12))  # noqa: E731
    print(json.dumps({
        "mode": "same_batch", "model": str(model_dir), "seed": args.seed, "precision": spec["precision"],
        "rows": len(trajs), "mean_reward": float(batch.rewards.mean()), "logprob_max_abs_diff": diff,
        "tamer_loss": tamer_loss, "trl_loss": trl_loss, "tamer_grad_norm": float(tamer_grad.norm()),
        "trl_grad_norm": float(trl_grad.norm()), "grad_rel_diff": rel(tamer_grad, trl_grad),
        "grad_rel_diff_same_advantages": rel(tamer_grad, trl_grad_same_adv),
        # tamer's loss took the sampler's projection outputs (models/replay.py) instead of recomputing them
        "tamer_replayed_sampler_outputs": batch.replay is not None and all(r.used for r in batch.replay.records),
        "trl_version": __import__("trl").__version__,
    }), flush=True)


