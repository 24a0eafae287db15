"""Rollout workers and off-policy training on an environment-bound task, printed as one JSON object.

    python benchmarks/scale_bench.py [--tool-ms 50] [--repeats 3] [--steps 4]

The task is `echo_turns` (tests/scale_envs.py): 3-turn episodes whose tool sleeps `--tool-ms`
per call, so a step's time is mostly waiting on the environment, as with real tools, sandboxes
and APIs. A small tiny model (hidden 64, 2 layers) keeps generation cheap. Measured:

* rollout only: episodes/s of one batch (prompts x group) in process (environment steps one
  after another, and with `agent.env_threads`) and on 1 and 2 Ray rollout actors;
* training: steps/s and episodes/s of whole RL steps, synchronous (`rl.max_staleness=0`) and
  one step off-policy (`rl.max_staleness=1`), in process and on 2 Ray actors; the off-policy
  runs also report how the learner's time splits into waiting and learning.

Configurations are interleaved within each repeat; medians and ranges over repeats are reported.
Ray actors start once per worker count and are reused (their start-up, ~10-30 s, is excluded).
"""

from __future__ import annotations

# ruff: noqa: E402 - the repository root goes on sys.path before tests.scale_envs is imported
import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch
from tests.scale_envs import echo_tasks

from tamer.config import load_config
from tamer.models import build_char_tokenizer, build_tiny_model, stop_token_ids
from tamer.pipeline import RunConfig
from tamer.rewards import RewardComposer
from tamer.rollout.agent import AgentConfig
from tamer.rollout.engine import HFEngine
from tamer.rollout.runner import Rollout
from tamer.rollout.types import SamplingParams
from tamer.scale.ray_rollout import RayRollout, WorkerSpec, start_ray
from tamer.trainers.rl import RLTrainer

TINY = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.num_heads=4", "model.tiny.num_kv_heads=2",
        "model.tiny.intermediate_size=128"]


def run_config(args, max_staleness: int):
    return load_config(RunConfig, [], TINY + [
        "task.name=echo_turns", f"rl.prompts_per_step={args.prompts}", f"rl.group_size={args.group}",
        "rl.max_new_tokens=12", "rl.eval_every=0", f"rl.steps={args.steps + 1}", f"rl.max_staleness={max_staleness}",
        "rl.sampling_seed=trajectory", "agent.max_turns=3", f"agent.env_threads={args.env_threads}",
        "reward.weights={length: 1.0}", "reward.params={length: {max_tokens: 12}}"], plugins=("tests.scale_envs",))


def rollout_rate(rollout, model, tokenizer, tasks, params) -> float:
    """Episodes per second of one batch (weights already pushed)."""
    rollout.sync_weights(model, 0)
    start = time.perf_counter()
    trajs = rollout.run(tasks, params)
    return len(trajs) / (time.perf_counter() - start)


def train_rate(config, tokenizer, rollout, steps: int) -> dict[str, float]:
    """Steps/s and episodes/s over `steps` RL steps after one warm-up step."""
    from tamer.tasks import get_task_source

    model = build_tiny_model(tokenizer, config.model.tiny)
    train, held = get_task_source(config.task).split()
    if rollout is not None:
        rollout.version = -1  # a fresh model: push its weights
    trainer = RLTrainer(model, tokenizer, train, held, RewardComposer(config.reward), config.rl, config.eval,
                        run_dir="/tmp/tamer-scale-bench", agent=config.agent, rollout=rollout)
    try:
        trainer.train_step()  # warm-up (and the producer's first batch)
        start, idle, episodes = time.perf_counter(), 0.0, 0
        for _ in range(steps):
            metrics = trainer.train_step()
            idle += metrics.get("async/learner_idle_s", 0.0)
            episodes += int(metrics["rollout/trajectories"])
        seconds = time.perf_counter() - start
    finally:
        if trainer.producer is not None:
            trainer.producer.close()
    return {"steps_per_s": steps / seconds, "episodes_per_s": episodes / seconds, "learner_idle_frac": idle / seconds}


def summary(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tool-ms", type=float, default=50.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--env-threads", type=int, default=8)
    args = parser.parse_args()
    os.environ["TAMER_TEST_TOOL_S"] = str(args.tool_ms / 1000)  # before Ray starts: its workers inherit it
    torch.set_num_threads(1)
    tokenizer = build_char_tokenizer()
    base = run_config(args, 0)
    model = build_tiny_model(tokenizer, base.model.tiny)
    tasks = echo_tasks(args.prompts, answer=str(args.tool_ms / 1000))
    params = SamplingParams(n=args.group, temperature=1.0, max_new_tokens=12, stop_token_ids=stop_token_ids(tokenizer))
    start_ray(num_cpus=4, object_store_mb=200)
    spec = WorkerSpec(model.config, tokenizer, agent=base.agent, plugins=("tests.scale_envs",),
                      sys_path=tuple(p for p in sys.path if p))
    actors = {n: RayRollout(spec, workers=n) for n in (1, 2)}
    for pool in actors.values():
        pool.sync_weights(model, 0)  # waits for the actors to start
    local = {t: Rollout(HFEngine(model, tokenizer.pad_token_id), tokenizer,
                        AgentConfig(max_turns=3, env_threads=t), seeding="trajectory") for t in (1, args.env_threads)}
    rollout_cfgs = {"in_process_sequential_env": local[1], f"in_process_env_threads_{args.env_threads}":
                    local[args.env_threads], "ray_1_worker": actors[1], "ray_2_workers": actors[2]}
    train_cfgs = {"sync_in_process": (0, None), "k1_in_process": (1, None), "sync_ray_2_workers": (0, actors[2]),
                  "k1_ray_2_workers": (1, actors[2]), "sync_ray_1_worker": (0, actors[1])}
    rollout_runs = {name: [] for name in rollout_cfgs}
    train_runs = {name: [] for name in train_cfgs}
    for _ in range(args.repeats):  # interleaved: each repeat measures every configuration once
        for name, rollout in rollout_cfgs.items():
            rollout_runs[name].append(rollout_rate(rollout, model, tokenizer, tasks, params))
        for name, (k, rollout) in train_cfgs.items():
            train_runs[name].append(train_rate(run_config(args, k), tokenizer, rollout, args.steps))
    for pool in actors.values():
        pool.close()
    print(json.dumps({
        "conditions": {"tool_ms_per_call": args.tool_ms, "turns_per_episode": 3, "episodes_per_batch":
                       args.prompts * args.group, "env_threads": args.env_threads, "steps_timed": args.steps,
                       "repeats": args.repeats, "cpus": os.cpu_count(),
                       "machine": platform.processor() or platform.machine(),
                       "torch": torch.__version__},
        "rollout_episodes_per_s": {name: summary(v) for name, v in rollout_runs.items()},
        "training": {name: {key: summary([r[key] for r in runs]) for key in runs[0]}
                     for name, runs in train_runs.items()},
    }, indent=1))


if __name__ == "__main__":
    main()
