"""The HF-forward engine's decode attention on and off (`models/decode_attention.py`), alternated in one process.

    python benchmarks/hf_attention.py --size 1m-llama3 --pairs 30
    python benchmarks/hf_attention.py --size 20m --pairs 10

`HFEngine(fast=False)` (the general path: every model the lean forward does not cover, LoRA models)
samples the `vs_trl.py` speed batch (4 arithmetic prompts x 8 samples x 32 tokens, no stop token)
with `decode_attention.ENABLED` on and off, the order reversed every other pair. Two prompt sets:
`equal` (the benchmark's prompts, all 24 tokens: transformers passes no mask at decode, so SDPA
takes its maskless path) and `varied` (the same prompts cut to 24, 21, 18 and 15 tokens: left
padding, so every decode step carries a mask). One JSON line per prompt set: the median
`generate` seconds on and off, and the per-pair ratio on / off (median, min, max).

`--peer` asks the question for TRL's side instead: transformers' own `generate` (TRL's sampler)
and a forward + backward over the sampled rows (TRL's learner) with `attn_implementation` "sdpa"
(transformers' default, what `vs_trl.py` gives TRL) and "eager", alternated; one JSON line per
prompt set with both medians and the per-pair ratios eager / sdpa.
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
from bench_stats import ratio_summary
from grpo_workers import SIZES, SPEED, build_model, environment, load, tasks_for


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1m-llama3", help=f"of {', '.join(SIZES)}")
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", default="equal,varied", type=lambda s: s.split(","))
    parser.add_argument("--peer", action="store_true", help="transformers' generate and learner: sdpa vs eager")
    args = parser.parse_args(argv)
    import torch

    import tamer.models.decode_attention as da
    from tamer.models.loading import encode_chat
    from tamer.rollout.engine import HFEngine
    from tamer.rollout.types import SamplingParams

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp())
    model_dir = build_model(args.size, tmp)
    spec = dict(SPEED, model=str(model_dir), threads=args.threads, seed=0, precision="fp32")
    model, tokenizer = load(spec)
    prompts = [encode_chat(tokenizer, task.messages) for task in tasks_for(dict(spec, total_steps=1))[0]]
    sets = {"equal": prompts, "varied": [p[3 * i:] for i, p in enumerate(prompts)]}
    if args.peer:
        return peer(args, model_dir, sets)
    engine = HFEngine(model, tokenizer.pad_token_id, fast=False)
    params = SamplingParams(n=SPEED["group_size"], max_new_tokens=SPEED["max_new_tokens"], seed=0)
    default = da.ENABLED
    for name in args.prompts:
        batch = sets[name]
        for _ in range(args.warmup):
            engine.generate(batch, params)
        seconds = {True: [], False: []}
        for pair in range(args.pairs):
            for on in ((True, False) if pair % 2 == 0 else (False, True)):
                da.ENABLED = on
                start = time.perf_counter()
                engine.generate(batch, params)
                seconds[on].append(time.perf_counter() - start)
        da.ENABLED = default
        ratios = ratio_summary(seconds[True], seconds[False], None)
        print(json.dumps({
            "size": args.size, "prompts": name, "prompt_tokens": [len(p) for p in batch], "pairs": args.pairs,
            "threads": args.threads, "on_by_default": default,
            "on_generate_s": round(statistics.median(seconds[True]), 4),
            "off_generate_s": round(statistics.median(seconds[False]), 4),
            "ratio": {k: ratios[f"ratio_{k}"] for k in ("median", "min", "max")},
            "environment": environment(model_dir)}), flush=True)


def peer(args, model_dir: Path, sets: dict) -> None:
    """transformers' `generate` and a learner forward + backward with SDPA and with eager attention."""
    import torch
    from transformers import AutoModelForCausalLM

    from tamer.rollout.engine import _left_pad
    models = {impl: AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=impl)
              for impl in ("sdpa", "eager")}
    pad = models["sdpa"].generation_config.pad_token_id

    def step(model, ids, mask) -> tuple[float, float]:
        start = time.perf_counter()
        with torch.no_grad():  # as TRL's generation (inference tensors could not enter the backward below)
            rows = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0,
                                  max_new_tokens=SPEED["max_new_tokens"], min_new_tokens=SPEED["max_new_tokens"],
                                  pad_token_id=pad)
        generated = time.perf_counter() - start
        start = time.perf_counter()
        full = torch.cat([mask, torch.ones_like(rows[:, ids.shape[1]:])], dim=1)
        logits = model(input_ids=rows, attention_mask=full).logits
        logits.float().logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)
        return generated, time.perf_counter() - start
    for name in args.prompts:
        ids, mask = _left_pad(sets[name], pad)
        ids, mask = ids.repeat_interleave(SPEED["group_size"], 0), mask.repeat_interleave(SPEED["group_size"], 0)
        for impl in models:
            for _ in range(args.warmup):
                step(models[impl], ids, mask)
        times = {impl: ([], []) for impl in models}
        for pair in range(args.pairs):
            for impl in (("sdpa", "eager") if pair % 2 == 0 else ("eager", "sdpa")):
                torch.manual_seed(pair)
                for kept, value in zip(times[impl], step(models[impl], ids, mask)):
                    kept.append(value)
        row = {"size": args.size, "prompts": name, "peer": "transformers generate + forward/backward",
               "pairs": args.pairs, "threads": args.threads}
        for i, part in enumerate(("generate", "learner")):
            ratios = ratio_summary(times["eager"][i], times["sdpa"][i], None)
            row[f"sdpa_{part}_s"] = round(statistics.median(times["sdpa"][i]), 4)
            row[f"eager_{part}_s"] = round(statistics.median(times["eager"][i]), 4)
            row[f"{part}_ratio_eager_over_sdpa"] = {k: ratios[f"ratio_{k}"] for k in ("median", "min", "max")}
        print(json.dumps({**row, "environment": environment(model_dir)}), flush=True)


if __name__ == "__main__":
    main()
