"""tamer's packed SFT step at several attention-group budgets, alternated in one process.

    python benchmarks/sft_attention_groups.py --task arithmetic --budgets 180,1024,4096
    python benchmarks/sft_attention_groups.py --task trip_planner --budgets 1024,2048,4096 --reps 8
    python benchmarks/sft_attention_groups.py --task trip_planner --budgets 1024,4096,8192 --reps 6 --steps 2 \
        --set agent.show_tools=true --set model.tiny.max_position_embeddings=4096

`trainers/packed.py` sends attention to the kernel in groups of length-sorted sequences of at most
`ATTENTION_TOKENS` padded tokens each. This script builds a demo preset's model and
demonstrations (as `sft_vs_trl.py` does), then times tamer's SFT step (loss, backward, clip,
AdamW) on the same `--steps` batches under each budget in turn, `--reps` rounds, the order
reversed every other round, all in one process: a slow spell of the machine then falls on every
budget alike, which separate processes (`sft_vs_trl.py`'s pairs) do not ensure. One JSON line:
per budget the median seconds per step, its range, and the per-round ratio to the first budget
(median, min, max).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sft_vs_trl import prepare, tamer_trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="arithmetic", help="a demo preset: arithmetic, calculator, trip_planner")
    parser.add_argument("--budgets", default="180,1024,4096", type=lambda s: [int(v) for v in s.split(",")],
                        help="ATTENTION_TOKENS values; the first is the reference")
    parser.add_argument("--steps", type=int, default=4, help="batches timed per budget and round")
    parser.add_argument("--reps", type=int, default=10, help="rounds (each budget once per round)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a preset field, as in sft_vs_trl.py (repeatable)")
    args = parser.parse_args()

    import torch

    from tamer.trainers import packed
    from tamer.trainers.common import clip_and_step
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        spec = prepare(args.task, Path(tmp), args.seed, args.set)
        model, trainer = tamer_trainer(spec)
    optim = trainer.config.optim
    batches = [b for _, b in zip(range(args.steps), trainer.example_batches())]

    def run(budget: int, timed: list | None) -> None:
        packed.ATTENTION_TOKENS = budget
        for batch in batches:
            start = time.perf_counter()
            trainer.loss(batch).backward()
            clip_and_step(model, trainer.optimizer, trainer.scheduler, optim.max_grad_norm)
            if timed is not None:
                timed.append(time.perf_counter() - start)

    for budget in args.budgets:  # warm-up: every layout once
        run(budget, None)
    seconds = {b: [] for b in args.budgets}  # per round: mean seconds per step
    for rep in range(args.reps):
        for budget in (args.budgets if rep % 2 == 0 else args.budgets[::-1]):
            timed = []
            run(budget, timed)
            seconds[budget].append(statistics.mean(timed))
    first = seconds[args.budgets[0]]
    rows = {}
    for budget, s in seconds.items():
        ratios = [a / b for a, b in zip(s, first)]
        groups = [len(packed.attention_groups(sorted(len(e.prompt_ids) + len(e.completion_ids) for e in batch), budget))
                  for batch in batches]
        rows[str(budget)] = {"s_per_step": round(statistics.median(s), 4), "s_per_step_min": round(min(s), 4),
                             "s_per_step_max": round(max(s), 4), "groups_per_layer": statistics.median(groups),
                             "ratio_to_first_median": round(statistics.median(ratios), 3),
                             "ratio_to_first_min": round(min(ratios), 3), "ratio_to_first_max": round(max(ratios), 3)}
    print(json.dumps({"task": args.task, "batch_size": spec["batch_size"], "steps_per_round": args.steps,
                      "rounds": args.reps, "threads": torch.get_num_threads(), "budgets": rows}), flush=True)


if __name__ == "__main__":
    main()
