"""tamer vs Hugging Face TRL's GRPOTrainer: seconds per step, memory, utilization, learning.

    pip install -e ".[bench]"                       # trl + accelerate (not core dependencies)
    python benchmarks/vs_trl.py                     # speed: 2 sizes x 2 betas x 2 precisions
    python benchmarks/vs_trl.py --sizes 1m --betas 0 --precisions fp32 --steps 3 --warmup 1   # a smoke run
    python benchmarks/vs_trl.py --learning          # accuracy vs wall-clock from one SFT checkpoint

Both trainers start from the same saved weights (a tiny Qwen2 with tamer's char tokenizer),
see the same prompts in the same order (arithmetic train tasks), score with the same reward
(tamer's `correctness`, wrapped for TRL), and run group size 8, 4 prompts per step, 32
completion tokens, temperature 1, the same lr, β, μ = 1, token-mean loss (TRL `dapo`),
clip ε 0.2, grad-norm clip 1, constant lr, in fp32 or bf16 autocast with fp32 weights.
Every run is its own subprocess (peak RSS is per run); per setting the order alternates
(TRL first, then tamer first) so that machine noise hits both. One JSON object per setting
on stdout; docs/performance.md explains every field.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {  # name -> TinyModelConfig fields (char vocabulary: 269 tokens)
    "1m": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512),
    "20m": dict(hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4, intermediate_size=1664),
}
SPEED = dict(prompts_per_step=4, group_size=8, max_new_tokens=32, lr=1e-5)
LEARNING = dict(prompts_per_step=16, group_size=8, max_new_tokens=32, lr=1e-4)  # the arithmetic demo's RL


# ---------------------------------------------------------------------------- shared by both workers
def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def matmul_gflops(dtype_name: str, shapes: list[tuple[int, int, int]], seconds: float = 0.5) -> list[dict]:
    """GFLOP/s of a plain torch.matmul (m,k)@(k,n) in `dtype_name`, in this process and thread setting.

    Each operand is tried stored row-major and stored transposed (`x @ W.t()` is how a linear
    calls it); the reference is the best of the four layouts. On CPUs without bf16 units the
    bf16 rate depends on the layout by 10x or more (exactly one transposed operand is fast),
    so a single layout would be a straw man. Returns {"gflops": best, "all": {layout: rate}} per shape.
    """
    import torch
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    out = []
    for m, k, n in shapes:
        rates = {}
        for a_t in (False, True):
            for b_t in (False, True):
                a = torch.randn(k, m, dtype=dtype).t() if a_t else torch.randn(m, k, dtype=dtype)
                b = torch.randn(n, k, dtype=dtype).t() if b_t else torch.randn(k, n, dtype=dtype)
                a @ b
                count, start = 0, time.perf_counter()
                while time.perf_counter() - start < seconds:
                    a @ b
                    count += 1
                name = ("A.t()" if a_t else "A") + " @ " + ("B.t()" if b_t else "B")
                rates[name] = round(2 * m * k * n * count / (time.perf_counter() - start) / 1e9, 2)
        out.append({"gflops": max(rates.values()), "all": rates})
    return out


def load(spec: dict):
    import torch
    from tamer.models import load_model
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    return load_model(spec["model"])


def tasks_for(spec: dict):
    """The train prompts in the order both trainers see them, and the held-out tasks."""
    import random
    from tamer.tasks import ArithmeticTasks
    train, heldout = ArithmeticTasks().split()
    order = random.Random(spec["seed"]).sample(train, len(train))
    need = spec["prompts_per_step"] * spec["total_steps"]
    return (order * (need // len(order) + 1))[:need], heldout[: spec.get("eval_size", 0) or len(heldout)]


def tamer_correctness(task, text: str) -> float:
    """tamer's `correctness` reward on a completion text (TRL hands rewards text, not trajectories)."""
    from tamer.rewards import REWARDS
    from tamer.rollout.types import Trajectory
    traj = Trajectory(task=task, group_id=0, prompt_ids=[], completion_ids=[], loss_mask=[], logprobs=[], text=text)
    return REWARDS.get("correctness")(traj)


def evaluator(spec: dict, tokenizer, heldout):
    """Held-out greedy accuracy with tamer's evaluator (fp32, same tasks) for either trainer's model."""
    from tamer.evaluate import EvalConfig, evaluate
    from tamer.models import stop_token_ids
    from tamer.rollout.engine import HFEngine
    from tamer.rollout.runner import Rollout
    config = EvalConfig(size=len(heldout), max_new_tokens=spec["max_new_tokens"])

    def run(model) -> float:
        was_training = model.training
        rollout = Rollout(HFEngine(model, tokenizer.pad_token_id), tokenizer)
        accuracy = evaluate(rollout, heldout, config, stop_token_ids(tokenizer)).accuracy
        model.train(was_training)
        return accuracy
    return run


def summarize(spec: dict, step_seconds: list[float], generated: list[int], phases: list[dict], **extra) -> dict:
    timed = step_seconds[spec["warmup"]:]
    gen_tokens = sum(generated[spec["warmup"]:])
    phase_median = {k: statistics.median(p.get(k, 0.0) for p in phases[spec["warmup"]:]) for k in phases[-1]} if phases else {}
    return {"s_per_step": statistics.median(timed), "step_seconds": [round(s, 4) for s in step_seconds],
            "gen_tokens_per_s": gen_tokens / sum(timed), "generated_tokens_per_step": gen_tokens / len(timed),
            "peak_rss_mb": peak_rss_mb(), "profile_s": phase_median, **extra}


# ---------------------------------------------------------------------------- tamer worker
def tamer_trainer(spec: dict, model, tokenizer, prompts, heldout):
    """tamer's RLTrainer for `spec` (the tamer column of the table in docs/performance.md), fed `prompts` in order."""
    from tamer.rewards import RewardComposer, RewardConfig
    from tamer.trainers.common import OptimConfig
    from tamer.trainers.rl import AlgorithmConfig, RLConfig, RLTrainer
    config = RLConfig(
        steps=spec["total_steps"], prompts_per_step=spec["prompts_per_step"], group_size=spec["group_size"],
        max_new_tokens=spec["max_new_tokens"], temperature=1.0, precision=spec["precision"], eval_every=0,
        rollout_threads=spec.get("rollout_threads", 0),
        seed=spec["seed"], optim=OptimConfig(lr=spec["lr"], max_grad_norm=1.0),
        algorithm=AlgorithmConfig(kl_coef=spec["beta"], kl_estimator="k3", aggregation="token-mean"))
    trainer = RLTrainer(model, tokenizer, prompts, heldout, RewardComposer(RewardConfig(weights={"correctness": 1.0})),
                        config, run_dir=spec["run_dir"])
    trainer.pool = _InOrder(prompts)
    return trainer


def run_tamer(spec: dict) -> dict:
    import torch
    from tamer.models import count_parameters
    model, tokenizer = load(spec)
    prompts, heldout = tasks_for(spec)
    trainer = tamer_trainer(spec, model, tokenizer, prompts, heldout)
    evaluate = evaluator(spec, tokenizer, heldout) if spec["eval_every"] else None
    seconds, generated, phases, curve, learner_tokens, clock, trace = [], [], [], [], [], 0.0, []
    if evaluate:
        curve.append((0, 0.0, evaluate(model)))
    for step in range(1, spec["total_steps"] + 1):
        start = time.perf_counter()
        metrics = trainer.train_step()
        seconds.append(time.perf_counter() - start)
        clock += seconds[-1]
        generated.append(int(metrics["tokens/generated"]))
        learner_tokens.append((metrics["tokens/learner"], metrics["tokens/prefill"]))
        phases.append({k[5:-2]: v for k, v in metrics.items() if k.startswith("time/") and k not in
                       ("time/rollout_s", "time/update_s")})
        trace.append((metrics["reward/mean"], metrics["train/grad_norm"]))
        if evaluate and step % spec["eval_every"] == 0:
            curve.append((step, clock, evaluate(model)))
    params = count_parameters(model)
    w = spec["warmup"]
    flops = [2 * params * (gen + prefill) + (6 + 2 * (spec["beta"] > 0)) * params * learn
             for gen, (learn, prefill) in zip(generated, learner_tokens)]
    achieved = sum(flops[w:]) / sum(seconds[w:]) / 1e9
    cfg = model.config
    shapes = [(1024, 1024, 1024), (spec["prompts_per_step"] * spec["group_size"] * 48, cfg.hidden_size, cfg.intermediate_size)]
    rates = matmul_gflops(spec["precision"], shapes) if not spec["eval_every"] else [{"gflops": float("nan")}] * 2
    return summarize(spec, seconds, generated, phases, model_params=params, curve=curve, trace=trace,
                     achieved_gflops=achieved, matmul_gflops_1024=rates[0]["gflops"],
                     matmul_gflops_model_shape=rates[1]["gflops"], matmul_layouts=[r.get("all") for r in rates],
                     model_matmul_shape=list(shapes[1]), threads=torch.get_num_threads(),
                     fast_forward=getattr(trainer.engine, "fast", None) is not None)


class _InOrder:
    """A task pool that hands out a fixed list in order (so TRL and tamer see the same prompts)."""

    def __init__(self, tasks):
        self.tasks, self.position = tasks, 0

    def next_batch(self, n: int):
        out = self.tasks[self.position:self.position + n]
        self.position += n
        return out


def trl_config(spec: dict):
    """TRL's GRPOConfig for `spec`: every setting of the table in docs/performance.md, stated explicitly
    (GRPOConfig's own defaults differ: e.g. bf16=True, which on CPU runs the forward under autocast)."""
    from trl import GRPOConfig
    rows = spec["prompts_per_step"] * spec["group_size"]
    return GRPOConfig(
        output_dir=spec["run_dir"], per_device_train_batch_size=rows, gradient_accumulation_steps=1,
        num_generations=spec["group_size"], max_completion_length=spec["max_new_tokens"], temperature=1.0,
        top_p=1.0, top_k=0, learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        beta=spec["beta"], num_iterations=1, loss_type="dapo", epsilon=0.2, max_grad_norm=1.0,
        scale_rewards="group", bf16=spec["precision"] == "bf16", use_cpu=True, max_steps=spec["total_steps"],
        logging_steps=1, save_strategy="no", report_to=[], shuffle_dataset=False, seed=spec["seed"],
        dataloader_num_workers=0, disable_tqdm=True, log_completions=False)


# ---------------------------------------------------------------------------- TRL worker
def run_trl(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer
    model, tokenizer = load(spec)
    prompts, heldout = tasks_for(spec)
    by_id = {t.id: t for t in prompts}
    data = Dataset.from_list([{"prompt": list(t.messages), "task_id": t.id} for t in prompts])
    timer: dict[str, float] = {}
    generated: list[int] = []

    def correctness(prompts, completions, task_id, completion_ids, **_) -> list[float]:
        start = time.perf_counter()
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        generated.append(sum(len(ids) for ids in completion_ids))
        scores = [tamer_correctness(by_id[i], text) for i, text in zip(task_id, texts)]
        timer["score"] = timer.get("score", 0.0) + time.perf_counter() - start
        return scores

    args = trl_config(spec)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=correctness, args=args,
                          train_dataset=data)
    _time_trl_phases(trainer, timer)
    evaluate = evaluator(spec, tokenizer, heldout) if spec["eval_every"] else None
    state = {"last": None, "clock": 0.0}
    seconds, phases, curve = [], [], []

    class Clock(TrainerCallback):  # step time = between consecutive step ends, evaluation excluded
        def on_train_begin(self, *a, **k):
            if evaluate:
                curve.append((0, 0.0, evaluate(trainer.model)))
            state["last"] = time.perf_counter()

        def on_step_end(self, _args, train_state, *a, **k):
            now = time.perf_counter()
            seconds.append(now - state["last"])
            state["clock"] += seconds[-1]
            phases.append(dict(timer))
            timer.clear()
            if evaluate and train_state.global_step % spec["eval_every"] == 0:
                curve.append((train_state.global_step, state["clock"], evaluate(trainer.model)))
            state["last"] = time.perf_counter()

    trainer.add_callback(Clock())
    trainer.train()
    from tamer.models import count_parameters
    trace = [(log["reward"], log["grad_norm"]) for log in trainer.state.log_history if "grad_norm" in log and "reward" in log]
    return summarize(spec, seconds, generated, phases, model_params=count_parameters(model), curve=curve, trace=trace,
                     threads=torch.get_num_threads(), trl_version=__import__("trl").__version__)


def _time_trl_phases(trainer, timer: dict[str, float]) -> None:
    """Wrap TRL's phases with timers: generate, logprobs (no-grad ref/old forwards), forward, backward, optimizer."""
    import torch

    def wrap(obj, name, key, only_no_grad=False):
        inner = getattr(obj, name)

        def timed(*a, **k):
            if only_no_grad and torch.is_grad_enabled():
                key_now = "forward_backward"
            else:
                key_now = key
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                timer[key_now] = timer.get(key_now, 0.0) + time.perf_counter() - start
        setattr(obj, name, timed)

    wrap(trainer, "_generate_single_turn", "generate")
    wrap(trainer, "_get_per_token_logps_and_entropies", "logprobs", only_no_grad=True)
    wrap(trainer.accelerator, "backward", "forward_backward")
    from transformers import TrainerCallback

    class Optim(TrainerCallback):
        def on_pre_optimizer_step(self, *a, **k):
            timer["_optim_start"] = time.perf_counter()

        def on_optimizer_step(self, *a, **k):
            timer["optimizer"] = time.perf_counter() - timer.pop("_optim_start", time.perf_counter())
    trainer.add_callback(Optim())


# ---------------------------------------------------------------------------- the parent: settings, alternation
def worker(kind: str, spec: dict) -> dict:
    """Run one trainer in a fresh subprocess; its last stdout line is the JSON result."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("OMP_NUM_THREADS", str(spec["threads"]))
    proc = subprocess.run([sys.executable, __file__, "--worker", kind, "--spec", json.dumps(spec)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def build_model(size: str, out: Path) -> Path:
    from tamer.models import TinyModelConfig, build_char_tokenizer, build_tiny_model, save_model
    tokenizer = build_char_tokenizer()
    save_model(build_tiny_model(tokenizer, TinyModelConfig(**SIZES[size])), tokenizer, out / size)
    return out / size


def speed(args, tmp: Path) -> None:
    order = 0
    for size in args.sizes:
        model = build_model(size, tmp)
        for precision in args.precisions:
            for beta in args.betas:
                spec = dict(SPEED, model=str(model), beta=beta, precision=precision, threads=args.threads,
                            seed=args.seed, warmup=args.warmup, total_steps=args.warmup + args.steps, eval_every=0,
                            run_dir=str(tmp / "run"))
                kinds = ("trl", "tamer") if order % 2 == 0 else ("tamer", "trl")
                order += 1
                results = {kind: worker(kind, spec) for kind in kinds}
                print(json.dumps(speed_row(size, spec, results["tamer"], results["trl"])), flush=True)


def speed_row(size: str, spec: dict, tamer: dict, trl: dict) -> dict:
    return {
        "model": size, "model_params": tamer["model_params"], "beta": spec["beta"], "precision": spec["precision"],
        "steps_timed": spec["total_steps"] - spec["warmup"], "threads": tamer["threads"],
        "tamer_s_per_step": round(tamer["s_per_step"], 4), "trl_s_per_step": round(trl["s_per_step"], 4),
        "ratio": round(tamer["s_per_step"] / trl["s_per_step"], 3),
        "tamer_fast_forward": tamer.get("fast_forward"),
        "tamer_gen_tokens_per_s": round(tamer["gen_tokens_per_s"], 1), "trl_gen_tokens_per_s": round(trl["gen_tokens_per_s"], 1),
        "tamer_generated_tokens_per_step": tamer["generated_tokens_per_step"],
        "trl_generated_tokens_per_step": trl["generated_tokens_per_step"],
        "tamer_peak_rss_mb": round(tamer["peak_rss_mb"], 1), "trl_peak_rss_mb": round(trl["peak_rss_mb"], 1),
        "tamer_achieved_gflops": round(tamer["achieved_gflops"], 2),
        "matmul_gflops_1024": round(tamer["matmul_gflops_1024"], 2),
        "matmul_gflops_model_shape": round(tamer["matmul_gflops_model_shape"], 2),
        "model_matmul_shape": tamer["model_matmul_shape"],
        "matmul_gflops_by_layout": tamer.get("matmul_layouts"),
        "tamer_utilization_vs_1024": round(tamer["achieved_gflops"] / tamer["matmul_gflops_1024"], 3),
        "tamer_utilization_vs_model_shape": round(tamer["achieved_gflops"] / tamer["matmul_gflops_model_shape"], 3),
        "tamer_profile_s": {k: round(v, 4) for k, v in tamer["profile_s"].items()},
        "trl_profile_s": {k: round(v, 4) for k, v in trl["profile_s"].items()},
        "tamer_step_seconds": tamer["step_seconds"], "trl_step_seconds": trl["step_seconds"],
        "trl_version": trl["trl_version"],
    }


def learning(args, tmp: Path) -> None:
    model = args.sft_model or sft_checkpoint(tmp, args.seed)
    spec = dict(LEARNING, model=str(model), beta=args.betas[0], precision=args.precisions[0], threads=args.threads,
                seed=args.seed, warmup=0, total_steps=args.learning_steps, eval_every=args.eval_every,
                eval_size=args.eval_size, run_dir=str(tmp / "run"))
    results = {kind: worker(kind, spec) for kind in ("trl", "tamer")}
    curves = {kind: r["curve"] for kind, r in results.items()}
    target = args.target if args.target is not None else min(max(a for _, _, a in c) for c in curves.values())
    reach = {kind: next((round(s, 2) for _, s, a in c if a >= target), None) for kind, c in curves.items()}
    final = {kind: c[-1][2] for kind, c in curves.items()}
    print(json.dumps({
        "mode": "learning", "model": str(model), "steps": spec["total_steps"], "eval_every": spec["eval_every"],
        "heldout_size": spec["eval_size"], "beta": spec["beta"], "precision": spec["precision"],
        "prompts_per_step": spec["prompts_per_step"], "group_size": spec["group_size"], "lr": spec["lr"],
        "target_accuracy": target, "tamer_seconds_to_target": reach["tamer"], "trl_seconds_to_target": reach["trl"],
        "tamer_final_accuracy": final["tamer"], "trl_final_accuracy": final["trl"],
        "tamer_s_per_step": round(results["tamer"]["s_per_step"], 4), "trl_s_per_step": round(results["trl"]["s_per_step"], 4),
        "tamer_curve": curves["tamer"], "trl_curve": curves["trl"],  # [step, train seconds (eval excluded), accuracy]
        # per step: [mean reward of the step's samples, gradient norm before clipping]
        "tamer_trace": [[round(r, 4), round(g, 4)] for r, g in results["tamer"]["trace"]],
        "trl_trace": [[round(r, 4), round(g, 4)] for r, g in results["trl"]["trace"]],
    }), flush=True)


def same_batch(args, tmp: Path) -> None:
    """One batch, both losses: tamer's rollout of one step fed to tamer's loss and to TRL's `_compute_loss`.

    Prints the largest per-token logprob difference, both losses, and the relative difference of
    the two gradients, with TRL's own advantages (its std eps is 1e-4) and with tamer's.
    """
    import torch
    from trl import GRPOTrainer
    from tamer.algorithms import ADVANTAGES
    from tamer.rollout.engine import _left_pad
    from tamer.trainers.common import right_pad
    model_dir = args.sft_model or sft_checkpoint(tmp, args.seed)
    spec = dict(LEARNING, model=str(model_dir), beta=0.0, precision=args.precisions[0], threads=args.threads,
                seed=args.seed, total_steps=1, eval_size=16, run_dir=str(tmp / "run"))
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
    trl = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                      args=trl_config(spec), train_dataset=__import__("datasets").Dataset.from_list(
                          [{"prompt": list(t.messages)} for t in prompts]))
    trl.current_gradient_accumulation_steps = 1  # set by Trainer.train(); _compute_loss reads it
    prompt_ids, prompt_mask = _left_pad([t.prompt_ids for t in trajs], tokenizer.pad_token_id)
    completion_ids = right_pad([t.completion_ids for t in trajs], tokenizer.pad_token_id, torch.long)
    completion_mask = right_pad([[1] * len(t.completion_ids) for t in trajs], 0, torch.long)
    # TRL's advantages: the same unbiased group std, with TRL's eps (1e-4; tamer's default is 1e-6)
    trl_adv = ADVANTAGES.get("grpo")(batch.rewards, batch.group_ids, eps=1e-4)
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                  completion_mask=completion_mask, num_items_in_batch=completion_mask.sum().float(), old_per_token_logps=None)
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
        "grad_rel_diff_same_advantages": rel(tamer_grad, trl_grad_same_adv), "trl_version": __import__("trl").__version__,
    }), flush=True)


def sft_checkpoint(tmp: Path, seed: int) -> Path:
    """The arithmetic demo's SFT model (tamer's run_sft with the demo's defaults)."""
    from tamer.config import load_config
    from tamer.pipeline import RunConfig, run_sft, seed_overrides
    config = load_config(RunConfig, overrides=[f"output_dir={tmp / 'sft-run'}", "tracking.console=false",
                                               "tracking.tensorboard=false", *seed_overrides(seed)])
    return Path(run_sft(config)["model_path"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1m,20m", type=lambda s: s.split(","))
    parser.add_argument("--betas", default="0,0.04", type=lambda s: [float(b) for b in s.split(",")])
    parser.add_argument("--precisions", default="fp32,bf16", type=lambda s: s.split(","))
    parser.add_argument("--steps", type=int, default=12, help="timed steps per run (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--learning", action="store_true", help="accuracy vs wall-clock from an SFT checkpoint")
    parser.add_argument("--same-batch", action="store_true",
                        help="one rollout batch through both losses: logprob and gradient differences")
    parser.add_argument("--sft-model", default="", help="learning: SFT model dir (default: run tamer's SFT)")
    parser.add_argument("--learning-steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-size", type=int, default=400)
    parser.add_argument("--target", type=float, default=None, help="learning: accuracy to reach (default: the lower best)")
    parser.add_argument("--worker", choices=("tamer", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = (run_tamer if args.worker == "tamer" else run_trl)(json.loads(args.spec))
        print(json.dumps(result), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmp:
        (same_batch if args.same_batch else learning if args.learning else speed)(args, Path(tmp))


if __name__ == "__main__":
    main()
