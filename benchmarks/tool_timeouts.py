"""Does a pathological tool slow the trainer down? RL step time before and after 20 timed-out,
CPU-bound tool calls, printed as one JSON object.

    python benchmarks/tool_timeouts.py [--repeats 3] [--steps 6] [--calls 20]

For each mode, in a fresh process (a thread left spinning would distort every later figure):
  1. times `--steps` RL steps of a tiny model on `arithmetic` (RLTrainer.train_step),
  2. makes `--calls` tool calls to a tool stuck in a pure-Python loop (timeout 0.1 s each),
  3. times `--steps` more steps, and reports the median step time before and after.

Modes:
  unstopped  the executor before tool calls could be stopped: the timed-out threads keep running
             (reproduced here by disabling the stop);
  thread     the default: the timed-out call's thread is stopped (tamer.tools.stopper);
  process    `agent.tool_isolation=process`: the environment runs in a worker process.
Modes are interleaved over `--repeats` rounds; each figure is the median over rounds, with the
range (min, max) beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

MODES = ("unstopped", "thread", "process")


def spin(n: int) -> int:
    """Loop forever in Python.

    Args:
        n: ignored
    """
    x = 0
    while True:
        x += n


def _trainer():
    import torch

    from tamer.evaluate import EvalConfig
    from tamer.models import TinyModelConfig, build_char_tokenizer, build_tiny_model
    from tamer.rewards import RewardComposer, RewardConfig
    from tamer.tasks import ArithmeticTasks
    from tamer.trainers.common import OptimConfig
    from tamer.trainers.rl import RLConfig, RLTrainer

    torch.set_num_threads(1)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128))
    train, held = ArithmeticTasks().split()
    config = RLConfig(steps=1000, prompts_per_step=4, group_size=4, max_new_tokens=16, optim=OptimConfig(lr=1e-4),
                      eval_every=0)
    return RLTrainer(model, tokenizer, train, held, RewardComposer(RewardConfig()), config, EvalConfig(size=4),
                     run_dir="/tmp/tamer-bench-tool-timeouts")


def _step_times(trainer, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - start)
    return times


def _timed_out_calls(mode: str, calls: int) -> float:
    """Make `calls` calls to `spin` through a tool environment; returns the seconds they took."""
    import tamer.tools.executor as executor
    from tamer.rollout.isolation import IsolatedEnvironment
    from tamer.tasks.base import Task
    from tamer.tasks.tool_env import ToolEnvConfig, ToolEnvironment
    from tamer.tools.schema import ToolSet

    class Spinning(ToolEnvironment):
        def build_tools(self):
            return ToolSet([spin])

    if mode == "unstopped":
        executor.stop_thread = lambda thread, done: False  # the old behaviour: leave it running
    env = Spinning(ToolEnvConfig(tool_timeout_s=0.1, max_tool_calls_per_turn=1))
    env = IsolatedEnvironment(env) if mode == "process" else env
    env.reset(Task(id="t", messages=({"role": "user", "content": "x"},), answer="1"))
    start = time.perf_counter()
    for _ in range(calls):
        result = env.step('<tool_call>{"name": "spin", "arguments": {"n": 1}}</tool_call>')
        assert result.info["turn_calls"][0]["error_kind"] == "timeout", result
    if mode == "process":
        env.close()
    return time.perf_counter() - start


def child(mode: str, steps: int, calls: int) -> None:
    trainer = _trainer()
    _step_times(trainer, 2)  # warm-up
    before = _step_times(trainer, steps)
    calls_s = _timed_out_calls(mode, calls)
    after = _step_times(trainer, steps)
    print(json.dumps({"before_s": statistics.median(before), "after_s": statistics.median(after),
                      "calls_s": calls_s}), flush=True)
    os._exit(0)  # in "unstopped" mode the spinning threads would outlive us otherwise anyway


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--child", choices=MODES)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.calls)
        return
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--steps", str(args.steps),
                                  "--calls", str(args.calls)], capture_output=True, text=True, check=True)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    result = {"calls": args.calls, "tool_timeout_s": 0.1, "steps_timed": args.steps, "repeats": args.repeats,
              "cpus": os.cpu_count(), "python": platform.python_version(), "modes": {}}
    for mode, records in runs.items():
        before = [r["before_s"] for r in records]
        after = [r["after_s"] for r in records]
        result["modes"][mode] = {"step_s_before": _summary(before), "step_s_after": _summary(after),
                                 "slowdown": _summary([a / b for a, b in zip(after, before)]),
                                 "calls_s": _summary([r["calls_s"] for r in records])}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
