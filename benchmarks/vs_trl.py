"""tamer vs Hugging Face TRL's GRPOTrainer: seconds per step, memory, utilization, learning.

    pip install -e ".[bench]"                       # trl + accelerate (not core dependencies)
    python benchmarks/vs_trl.py --precisions fp32   # speed: 1m, 20m, 1m-llama3 x beta 0/0.04 x fast/general path
    python benchmarks/vs_trl.py --sizes 1m --betas 0 --paths fast --pairs 3 --steps 3 --warmup 1   # a smoke run
    python benchmarks/vs_trl.py --precisions fp32 --interleave-steps 1   # each pair's two runs alive at once,
                                                                        # their timed steps alternated
    python benchmarks/vs_trl.py --learning --out runs/learning.jsonl   # 24 fixed seeds, accuracy vs steps and seconds
    python benchmarks/vs_trl.py --summarize runs/learning.jsonl        # the learning statistics of a finished file

Both trainers start from the same saved weights (a tiny Qwen2, or Llama with Llama 3's RoPE,
with tamer's char tokenizer), see the same prompts in the same order (arithmetic train tasks),
score with the same reward (speed: digit characters per completion, `grpo_workers.digit_score`, since a
random-init model scores 0 on every arithmetic task and its updates would be zero; learning: tamer's
`correctness`, wrapped for TRL), and run group size 8, 4
prompts per step, 32 completion tokens, temperature 1, the same lr, beta, mu = 1, token-mean
loss (TRL `dapo`), clip eps 0.2, grad-norm clip 1, constant lr, no activation checkpointing,
in fp32 or bf16 autocast with fp32 weights. Every run is its own subprocess (peak RSS is per
run). Each setting runs `--pairs` interleaved pairs (tamer, TRL, TRL, tamer, ...) so that
machine noise hits both; one JSON object per setting on stdout with the median ratio and its
range. docs/performance.md explains every field.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_stats import learning_summary, ratio_summary
from bench_workers import block_pair, run_worker, serve
from grpo_workers import LEARNING, SIZES, SPEED, build_model, environment


def worker(kind: str, spec: dict, env_changes: dict[str, str | None] | None = None) -> dict:
    """Run one GRPO trainer in a fresh subprocess of this script (`bench_workers.run_worker`); `env_changes`:
    variables set for the subprocess only (None: removed from its environment)."""
    return run_worker(__file__, kind, spec, env_changes)


def interleaved(spec: dict, pairs: int) -> dict[str, list[dict]]:
    """`pairs` runs of each trainer in the order tamer, TRL, TRL, tamer, tamer, TRL, ... With
    `spec["interleave_steps"]` K, each pair is one tamer and one TRL process alive at once whose timed
    steps alternate in blocks of K (the first side flipped every pair): a slow spell of the machine then
    falls on both sides' steps alike, where one process after the other puts it on one side's run."""
    runs: dict[str, list[dict]] = {"tamer": [], "trl": []}
    for pair in range(pairs):
        first, second = ("tamer", "trl") if pair % 2 == 0 else ("trl", "tamer")
        if spec.get("interleave_steps"):
            results = block_pair(__file__, {first: spec, second: spec}, first)
        else:
            results = {kind: worker(kind, spec) for kind in (first, second)}
        for kind in runs:
            runs[kind].append(results[kind])
    return runs


def target_for(path: str, beta: float) -> float:
    """The issue's targets for tamer / TRL: general (HF forward) path 0.8; lean path 0.5 at beta 0, else 0.6."""
    return 0.8 if path == "general" else (0.5 if beta == 0 else 0.6)


UTILIZATION_TARGET = {"20m": 0.7}  # of the same-run fp32 matmul rate (1024^3, best layout)


def speed(args, tmp: Path) -> None:
    for size in args.sizes:
        model = build_model(size, tmp)
        for precision in args.precisions:
            for beta in args.betas:
                for path in args.paths:
                    spec = dict(SPEED, model=str(model), beta=beta, precision=precision, threads=args.threads,
                                seed=args.seed, warmup=args.warmup, total_steps=args.warmup + args.steps, eval_every=0,
                                run_dir=str(tmp / "run"), fast=path == "fast", interleave_steps=args.interleave_steps)
                    runs = interleaved(spec, args.pairs)
                    print(json.dumps(speed_row(size, path, spec, runs["tamer"], runs["trl"])), flush=True)


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _profile(runs: list[dict]) -> dict:
    keys = sorted({k for r in runs for k in r["profile_s"]})
    return {k: round(statistics.median(r["profile_s"].get(k, 0.0) for r in runs), 4) for k in keys}


def _update_summary(side: str, runs: list[dict]) -> dict:
    norms = [g for r in runs for g in r.get("grad_norms_timed", [])]
    spread = [z for r in runs for z in r.get("zero_spread_timed", [])]
    return {f"{side}_grad_norm_median": round(statistics.median(norms), 4) if norms else None,
            f"{side}_zero_spread_frac": round(statistics.fmean(spread), 4) if spread else None}


def speed_row(size: str, path: str, spec: dict, tamer: list[dict], trl: list[dict]) -> dict:
    """One setting: medians over the runs of each trainer, the per-pair ratios and the targets."""
    t_steps, r_steps = [r["s_per_step"] for r in tamer], [r["s_per_step"] for r in trl]
    achieved = _median(tamer, "achieved_gflops")
    rate_1024, rate_model = _median(tamer, "matmul_gflops_1024"), _median(tamer, "matmul_gflops_model_shape")
    row = {
        "model": size, "model_params": tamer[0]["model_params"], "path": path, "beta": spec["beta"],
        "precision": spec["precision"], "cpu_bf16_units": tamer[0]["cpu_bf16_units"],
        "pairs": len(tamer), "steps_timed": spec["total_steps"] - spec["warmup"],
        "interleave_steps": spec.get("interleave_steps", 0),  # 0: each run its own process, one after the other
        "tamer_threads": tamer[0]["threads"], "trl_threads": trl[0]["threads"],
        "tamer_s_per_step": round(statistics.median(t_steps), 4),
        "trl_s_per_step": round(statistics.median(r_steps), 4),
        "tamer_s_per_step_runs": [round(s, 4) for s in t_steps], "trl_s_per_step_runs": [round(s, 4) for s in r_steps],
        **ratio_summary(t_steps, r_steps, target_for(path, spec["beta"])),
        # process CPU seconds per step: less sensitive to other load than wall-clock (at one thread: the work)
        "tamer_cpu_s_per_step": round(_median(tamer, "cpu_s_per_step"), 4),
        "trl_cpu_s_per_step": round(_median(trl, "cpu_s_per_step"), 4),
        "cpu_ratio_median": round(statistics.median(a["cpu_s_per_step"] / b["cpu_s_per_step"]
                                                    for a, b in zip(tamer, trl)), 3),
        # the timed steps' updates: gradient norm before clipping (median) and the fraction of groups whose
        # rewards were all equal (mean), over every run of the side; a zero-gradient step would be no update
        "reward": spec["reward"], **_update_summary("tamer", tamer), **_update_summary("trl", trl),
        "trl_gradient_checkpointing": any(r["gradient_checkpointing"] for r in trl),
        "trl_use_bias_correction_kl": trl[0]["use_bias_correction_kl"],
        "tamer_fast_forward": tamer[0]["fast_forward"],
        "tamer_malloc": tamer[0].get("malloc"), "trl_malloc": trl[0].get("malloc"),
        "tamer_page_faults_per_step": _median(tamer, "page_faults_per_step"),
        "trl_page_faults_per_step": _median(trl, "page_faults_per_step"),
        "tamer_gen_tokens_per_s": round(_median(tamer, "gen_tokens_per_s"), 1),
        "trl_gen_tokens_per_s": round(_median(trl, "gen_tokens_per_s"), 1),
        "tamer_generated_tokens_per_step": _median(tamer, "generated_tokens_per_step"),
        "trl_generated_tokens_per_step": _median(trl, "generated_tokens_per_step"),
        "tamer_peak_rss_mb": round(max(r["peak_rss_mb"] for r in tamer), 1),
        "trl_peak_rss_mb": round(max(r["peak_rss_mb"] for r in trl), 1),
        "tamer_achieved_gflops": round(achieved, 2), "matmul_gflops_1024": round(rate_1024, 2),
        "matmul_gflops_model_shape": round(rate_model, 2), "model_matmul_shape": tamer[0]["model_matmul_shape"],
        "matmul_gflops_by_layout": tamer[0]["matmul_layouts"],
        "tamer_utilization_vs_1024": round(achieved / rate_1024, 3),
        "tamer_utilization_vs_model_shape": round(achieved / rate_model, 3),
        "tamer_profile_s": _profile(tamer), "trl_profile_s": _profile(trl),
        "tamer_step_seconds": [r["step_seconds"] for r in tamer], "trl_step_seconds": [r["step_seconds"] for r in trl],
        "trl_version": trl[0]["trl_version"], "environment": environment(spec["model"]),
    }
    if size in UTILIZATION_TARGET and spec["precision"] == "fp32":
        row["utilization_target"] = UTILIZATION_TARGET[size]
        row["utilization_met"] = row["tamer_utilization_vs_1024"] >= UTILIZATION_TARGET[size]
    return row


# ---------------------------------------------------------------------------- learning
def learning(args, tmp: Path) -> None:
    """Every seed of `--seeds` (fixed before the run), appended to `--out`; then the summary."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {r["seed"] for r in _read_rows(out)} if out.exists() else set()
    model = args.sft_model or sft_checkpoint(tmp, 0)
    for seed in args.seeds:
        if seed in done:
            continue
        spec = dict(LEARNING, model=str(model), beta=args.betas[0], precision=args.precisions[0], threads=args.threads,
                    seed=seed, warmup=0, total_steps=args.learning_steps, eval_every=args.eval_every,
                    eval_size=args.eval_size, run_dir=str(tmp / "run"), fast=args.paths[0] == "fast")
        order = ("trl", "tamer") if seed % 2 == 0 else ("tamer", "trl")
        results = {kind: worker(kind, spec) for kind in order}
        with out.open("a") as f:
            f.write(json.dumps(learning_row(spec, results)) + "\n")
    summarize(args)


def learning_row(spec: dict, results: dict) -> dict:
    return {
        "mode": "learning", "seed": spec["seed"], "model": spec["model"], "steps": spec["total_steps"],
        "eval_every": spec["eval_every"], "heldout_size": spec["eval_size"], "beta": spec["beta"],
        "precision": spec["precision"], "prompts_per_step": spec["prompts_per_step"], "group_size": spec["group_size"],
        "lr": spec["lr"], "tamer_s_per_step": round(results["tamer"]["s_per_step"], 4),
        "trl_s_per_step": round(results["trl"]["s_per_step"], 4),
        "tamer_curve": results["tamer"]["curve"], "trl_curve": results["trl"]["curve"],  # [step, train s, accuracy]
        # per step: [mean reward of the step's samples, gradient norm before clipping]
        "tamer_trace": [[round(r, 4), round(g, 4)] for r, g in results["tamer"]["trace"]],
        "trl_trace": [[round(r, 4), round(g, 4)] for r, g in results["trl"]["trace"]],
        "environment": environment(spec["model"]),
    }


def _read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(args) -> None:
    rows = _read_rows(Path(args.out))
    summary = learning_summary(rows, seeds=args.seeds, target=args.target, margin=args.margin, flips=args.flips)
    print(json.dumps({"mode": "learning_summary", "file": str(args.out), **summary}), flush=True)


def sft_checkpoint(tmp: Path, seed: int) -> Path:
    """The arithmetic demo's SFT model (tamer's run_sft with the demo's defaults)."""
    from tamer.config import load_config
    from tamer.pipeline import RunConfig, run_sft, seed_overrides
    config = load_config(RunConfig, overrides=[f"output_dir={tmp / 'sft-run'}", "tracking.console=false",
                                               "tracking.tensorboard=false", *seed_overrides(seed)])
    return Path(run_sft(config)["model_path"])


def _seeds(text: str) -> list[int]:
    """'0-23' or '0,1,5' -> a list of seeds."""
    if "-" in text:
        lo, hi = (int(x) for x in text.split("-"))
        return list(range(lo, hi + 1))
    return [int(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1m,20m,1m-llama3", type=lambda s: s.split(","),
                        help=f"of {', '.join(SIZES)}")
    parser.add_argument("--betas", default="0,0.04", type=lambda s: [float(b) for b in s.split(",")])
    parser.add_argument("--precisions", default="fp32,bf16", type=lambda s: s.split(","))
    parser.add_argument("--paths", default="fast,general", type=lambda s: s.split(","),
                        help="fast: tamer's lean forward where supported; general: the HF forward in engine and "
                             "learner")
    parser.add_argument("--pairs", type=int, default=3, help="interleaved tamer/TRL pairs per setting")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per run (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--interleave-steps", type=int, default=0, metavar="K",
                        help="each pair: both trainers alive at once, their timed steps alternated in blocks of K "
                             "(0: one run after the other)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--learning", action="store_true", help="accuracy vs steps and seconds from an SFT checkpoint")
    parser.add_argument("--summarize", metavar="FILE", help="learning statistics of FILE (rows of --learning)")
    parser.add_argument("--same-batch", action="store_true",
                        help="one rollout batch through both losses: logprob and gradient differences")
    parser.add_argument("--seeds", default="0-23", type=_seeds, help="learning: the seeds, fixed before running")
    parser.add_argument("--out", default="runs/vs_trl_learning.jsonl", help="learning: one row per seed (resumable)")
    parser.add_argument("--target", type=float, default=0.95, help="learning: accuracy for steps/seconds-to-target")
    parser.add_argument("--margin", type=float, default=0.01, help="learning: equivalence margin (TOST)")
    parser.add_argument("--flips", type=int, default=20000, help="learning: sign flips of the whole-curve test")
    parser.add_argument("--sft-model", default="", help="learning: SFT model dir (default: run tamer's SFT, seed 0)")
    parser.add_argument("--learning-steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-size", type=int, default=400)
    parser.add_argument("--worker", choices=("tamer", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.interleave_steps and args.steps % args.interleave_steps:
        parser.error("--interleave-steps: --steps must be a multiple of it")
    if args.worker:
        from grpo_workers import run_tamer, run_trl
        serve(run_tamer, run_trl, args.worker, args.spec)  # both sides: tamer's allocator settings
        return
    if args.summarize:
        args.out = args.summarize
        summarize(args)
        return
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmp:
        if args.same_batch:
            from same_batch import same_batch
            same_batch(args, Path(tmp), sft_checkpoint)
        else:
            (learning if args.learning else speed)(args, Path(tmp))


if __name__ == "__main__":
    main()
