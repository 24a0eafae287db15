"""tamer's GRPO step with glibc's malloc kept (`tamer.memory.keep_freed_memory`, the default) and as
the system leaves it (TAMER_MALLOC=system): seconds and page faults per step, alternated.

    python benchmarks/page_faults.py --size 1m --pairs 6      # kept, system, system, kept, ...
    python benchmarks/page_faults.py --size 1m --path general  # the HF forward

Each run is vs_trl.py's tamer worker (the benchmark's GRPO step: 4 prompts x 8 samples, 32 tokens,
fp32, beta 0) in a fresh process; the two settings alternate so that the machine's drift hits
both. One JSON line per run, then a summary: per setting the median step seconds, process CPU
seconds (user + system, all threads: what page faults cost the kernel shows up here) and page
faults per step, and the per-pair ratios kept / system (median, min, max) of both.
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
from bench_stats import ratio_summary
from grpo_workers import SIZES, SPEED, build_model
from vs_trl import worker

SETTINGS = {"kept": None, "system": "system"}  # -> TAMER_MALLOC


def run(setting: str, spec: dict) -> dict:
    """One tamer worker run with TAMER_MALLOC set for `setting` (unset for `kept`)."""
    result = worker("tamer", spec, {"TAMER_MALLOC": SETTINGS[setting]})
    return {"setting": setting, "malloc": result["malloc"], "s_per_step": round(result["s_per_step"], 4),
            "cpu_s_per_step": round(result["cpu_s_per_step"], 4),
            "page_faults_per_step": result["page_faults_per_step"], "peak_rss_mb": round(result["peak_rss_mb"], 1),
            "profile_s": {k: round(v, 4) for k, v in result["profile_s"].items()}}


def summary(runs: list[dict]) -> dict:
    by = {s: [r for r in runs if r["setting"] == s] for s in SETTINGS}
    wall = ratio_summary([r["s_per_step"] for r in by["kept"]], [r["s_per_step"] for r in by["system"]], None)
    cpu = ratio_summary([r["cpu_s_per_step"] for r in by["kept"]], [r["cpu_s_per_step"] for r in by["system"]], None)
    return {"summary": True, "pairs": len(wall["ratios"]),
            **{f"{s}_s_per_step": statistics.median(r["s_per_step"] for r in rs) for s, rs in by.items()},
            **{f"{s}_cpu_s_per_step": statistics.median(r["cpu_s_per_step"] for r in rs) for s, rs in by.items()},
            **{f"{s}_page_faults_per_step": statistics.median(r["page_faults_per_step"] for r in rs)
               for s, rs in by.items()},
            **{f"{s}_peak_rss_mb": max(r["peak_rss_mb"] for r in rs) for s, rs in by.items()},
            **{k: wall[k] for k in ("ratio_median", "ratio_min", "ratio_max")},
            **{f"cpu_{k}": cpu[k] for k in ("ratio_median", "ratio_min", "ratio_max")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1m", choices=sorted(SIZES))
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--path", default="fast", choices=("fast", "general"),
                        help="tamer's lean forward, or the HF forward in engine and learner")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="page_faults_") as tmp:
        spec = dict(SPEED, model=str(build_model(args.size, Path(tmp))), beta=0.0, precision="fp32",
                    threads=args.threads, seed=0, warmup=args.warmup, total_steps=args.warmup + args.steps,
                    eval_every=0, run_dir=str(Path(tmp) / "run"), fast=args.path == "fast")
        for pair in range(args.pairs):
            for setting in (("kept", "system") if pair % 2 == 0 else ("system", "kept")):
                runs.append(run(setting, spec))
                print(json.dumps(runs[-1]), flush=True)
    print(json.dumps({**summary(runs), "size": args.size, "path": args.path}), flush=True)


if __name__ == "__main__":
    main()
