"""`tamer plan`'s estimate against the measured peak RSS of the same RL steps on CPU.

    .venv/bin/python benchmarks/memory_plan.py [--cases 1m,35m,0.5b] [--steps 2] [--threads 2]

Each case runs `--steps` RL steps (rollout, reference and learner forwards, update; no
evaluation) in its own fresh process (`tamer.phases.run_in_child`), whose peak resident set
(VmHWM) is the measured figure. Prints one JSON object per case: the estimate and its parts,
the measured peak and the process's RSS before any model (`baseline_rss_mb`), the error, and the
seconds per step (noisy on a shared machine; the memory figures are not).

Cases: `1m` the demo's 1M-parameter model, full fine-tuning with a KL reference copy; `35m` the
`compare` preset's 35.6M model, full fine-tuning with a reference copy; `0.5b` the
`qwen2.5-0.5b-shape` preset (Qwen2.5-0.5B's shape at random init, LoRA r=16, the reference the
same model with its adapter off).
"""

from __future__ import annotations

import argparse
import json

from tamer.config import load_config
from tamer.phases import run_in_child
from tamer.pipeline import RunConfig
from tamer.plan import plan_run
from tamer.presets import preset_path

COMMON = ["rl.eval_every=0", "tracking.tensorboard=false", "tracking.console=false", "tracking.rollouts.enabled=false"]
CASES = {
    "1m": ([], ["rl.algorithm.kl_coef=0.04", "rl.prompts_per_step=16", "rl.group_size=8", "rl.max_new_tokens=32"]),
    "35m": (["compare"], ["rl.algorithm.kl_coef=0.04"]),
    "0.5b": (["qwen2.5-0.5b-shape"], []),
}


def case_config(name: str, threads: int, output_dir: str) -> RunConfig:
    presets, overrides = CASES[name]
    return load_config(RunConfig, [preset_path(p) for p in presets],
                       [*overrides, *COMMON, f"model.threads={threads}", f"output_dir={output_dir}"])


def measure(name: str, steps: int, threads: int, output_dir: str) -> dict:
    config = case_config(name, threads, f"{output_dir}/{name}")
    shape, setup, plan = plan_run(config)
    result = run_in_child("rl", config, measure_steps=steps, quiet=True)
    measured = result["peak_rss_mb"]
    return {"case": name, "parameters": plan.parameters, "trainable": plan.trainable, "lora_r": setup.lora_r,
            "reference": setup.reference, "prompt_tokens": setup.prompt_tokens,
            "completion_tokens": setup.completion_tokens, "estimate_mb": round(plan.peak_mb, 1),
            "measured_peak_rss_mb": round(measured, 1), "baseline_rss_mb": round(result["baseline_rss_mb"], 1),
            "rss_parts_at_end_mb": result.get("rss_parts_mb"),
            "error_pct": round(100 * (plan.peak_mb - measured) / measured, 1), "estimate": plan.to_dict(),
            "step_seconds": [round(s, 2) for s in result["step_seconds"]], "models_held": result["models_held"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="1m,35m,0.5b")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-dir", default="runs/memory_plan")
    args = parser.parse_args()
    for name in args.cases.split(","):
        print(json.dumps(measure(name, args.steps, args.threads, args.output_dir)), flush=True)


if __name__ == "__main__":
    main()
