"""The memory LoRA saves in an RL run with a KL reference, each setting in its own process.

    .venv/bin/python benchmarks/lora_memory.py [--case 35m] [--modes full,lora-copy,lora-view] [--steps 2] [--prompts 2]

Modes, all GRPO with kl_coef 0.04 on the same model, prompts and lengths:
  full       every weight trained; the reference is a frozen deep copy (what a full run holds)
  lora-copy  LoRA r=16; the reference is still a frozen deep copy of the base (the old way)
  lora-view  LoRA r=16; the reference is the same model with its adapter disabled (tamer's way)

full -> lora-copy is what LoRA saves in gradients and AdamW moments; lora-copy -> lora-view is the
second copy of the weights that the adapter-free reference avoids. Prints one JSON object per
mode: peak RSS (VmHWM of the mode's own process), RSS before any model, the reference's own
parameters, and seconds per step (noisy on a shared machine). `--case 0.5b` runs the
qwen2.5-0.5b-shape preset (full is left out there by default: about 10 GB).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

MODES = ("full", "lora-copy", "lora-view")


def child(case: str, mode: str, steps: int, threads: int, prompts: int) -> dict:
    import dataclasses

    from memory_plan import case_config
    from tamer.memory import current_rss_mb, peak_rss_mb
    from tamer.models import LoraConfig, apply_lora, count_parameters
    from tamer.pipeline import build_policy, make_trainer
    from tamer.trainers.rl import RLTrainer

    baseline = current_rss_mb()
    config = case_config(case, threads, f"runs/lora_memory/{case}-{mode}")
    config = dataclasses.replace(config, rl=dataclasses.replace(
        config.rl, prompts_per_step=prompts, algorithm=dataclasses.replace(config.rl.algorithm, kl_coef=0.04)))
    lora = config.model.lora if config.model.lora.r else LoraConfig(r=16, alpha=32.0)
    base_config = dataclasses.replace(config.model, lora=LoraConfig())
    model, tokenizer = build_policy(base_config, config.task)
    copy = RLTrainer._frozen_copy(model) if mode == "lora-copy" else None
    if mode != "full":
        model = apply_lora(model, lora)
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, lora=lora))
    trainer = make_trainer(config, model, tokenizer)
    if copy is not None:
        trainer.ref_model = copy  # the reference as a second, frozen copy of the base
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step()
        seconds.append(round(time.perf_counter() - start, 2))
    ref = trainer.ref_model
    return {"case": case, "mode": mode, "peak_rss_mb": round(peak_rss_mb(), 1), "baseline_rss_mb": round(baseline, 1),
            "parameters": count_parameters(model), "trainable": trainer.trainable_parameters(),
            "reference_parameters": count_parameters(ref) if ref is not None else 0, "step_seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="35m", choices=("1m", "35m", "0.5b"))
    parser.add_argument("--modes", default="")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step (x the case's group size)")
    parser.add_argument("--child", default="")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.case, args.child, args.steps, args.threads, args.prompts)))
        return
    modes = args.modes.split(",") if args.modes else [m for m in MODES if args.case != "0.5b" or m != "full"]
    results = {}
    for mode in modes:  # one process each: a peak RSS is a process's own
        command = [sys.executable, __file__, "--case", args.case, "--child", mode, "--steps", str(args.steps),
                   "--threads", str(args.threads), "--prompts", str(args.prompts)]
        out = subprocess.run(command, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"{mode} failed:\n{out.stderr[-2000:]}")
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps(results[mode]), flush=True)
    if "lora-copy" in results and "lora-view" in results:
        saved = results["lora-copy"]["peak_rss_mb"] - results["lora-view"]["peak_rss_mb"]
        summary = {"case": args.case, "reference_view_saves_mb": round(saved, 1)}
        if "full" in results:
            summary["lora_view_vs_full_saves_mb"] = round(results["full"]["peak_rss_mb"]
                                                          - results["lora-view"]["peak_rss_mb"], 1)
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
