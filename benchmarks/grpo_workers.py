"""The two sides of `benchmarks/vs_trl.py`: one GRPO run of tamer or of TRL, in this process.

`vs_trl.py` starts each run as `vs_trl.py --worker tamer|trl --spec JSON` in a fresh subprocess
and reads the JSON result from its last stdout line. `spec` holds the setting: model directory,
sizes of a step (prompts, group, tokens), lr, beta, precision, threads, seed, steps, warm-up,
evaluation cadence, `fast` (tamer's lean forward or the HF forward everywhere), and
`interleave_steps` (K > 0: both workers alive at once, timed steps alternated in blocks of K with
the other trainer's, `bench_workers.block_pair`).

`trl_settings(spec)` is every `GRPOConfig` field the benchmark sets; docs/performance.md lists
the ones whose TRL default differs from what tamer does (tests/test_bench.py checks both
agree).
"""

from __future__ import annotations

import functools
import resource
import statistics
import time
from pathlib import Path

from bench_workers import pause

SIZES = {  # name -> model shape (char vocabulary: 269 tokens)
    "1m": dict(arch="qwen2", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512),
    "20m": dict(arch="qwen2", hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4, intermediate_size=1664),
    # Llama 3.2's RoPE (llama3 frequency scaling: factor 32, theta 5e5; its original context scaled down to 1024,
    # so that most of the 16 frequencies of a 32-wide head are rescaled), untied head; the 1m shape otherwise
    "1m-llama3": dict(arch="llama", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512,
                      rope={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 1024, "rope_theta": 500000.0}),
}
# `reward`: what both sides score a completion with (`score`). Speed runs start from a random-init model, which
# never answers an arithmetic task: under `correctness` every reward, advantage and gradient is 0 and the timed
# steps' updates are zero. `digits` differs between a group's samples, so every step's update is a real one.
SPEED = dict(prompts_per_step=4, group_size=8, max_new_tokens=32, lr=1e-5, reward="digits")
LEARNING = dict(prompts_per_step=16, group_size=8, max_new_tokens=32, lr=1e-4, reward="correctness")  # the demo's RL


def build_model(size: str, out: Path) -> Path:
    """Save the `size` model (random init, seed 0) with tamer's char tokenizer under out/size."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tamer.models import TinyModelConfig, build_char_tokenizer, build_tiny_model, save_model
    tokenizer = build_char_tokenizer()
    shape = dict(SIZES[size])
    rope = shape.pop("rope", None)
    if rope is None:
        model = build_tiny_model(tokenizer, TinyModelConfig(**shape))
    else:
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=shape["hidden_size"],
                             intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_layers"],
                             num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
                             max_position_embeddings=8192, rope_parameters=rope, tie_word_embeddings=False,
                             pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    return save_model(model, tokenizer, out / size)


# ---------------------------------------------------------------------------- shared by both sides
ENV_PACKAGES = ("torch", "transformers", "trl", "accelerate", "tokenizers", "numpy")
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def environment(model_dir: str | Path | None = None, packages: tuple[str, ...] = ENV_PACKAGES) -> dict:
    """What a run's numbers may depend on beyond the code: `packages`' versions, the CPU and its vector
    units, and (with `model_dir`) a digest of the model's weight files (so two machines' runs can be told
    apart)."""
    import platform
    from importlib import metadata
    versions = {}
    for name in packages:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    from tamer.memory import cpu_info
    fields = cpu_info()
    cpu = fields.get("model name") or platform.processor() or platform.machine()
    flags = set(fields.get("flags", "").split())
    out = {"packages": versions, "cpu": cpu, "cpu_flags": [f for f in CPU_FLAGS if f in flags],
           "python": platform.python_version()}
    if model_dir is not None:
        files = sorted(Path(model_dir).glob("*.safetensors"))
        out["model_sha256"] = _weights_digest(tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in files))
    return out


@functools.lru_cache(maxsize=8)
def _weights_digest(files: tuple[tuple[str, int, int], ...]) -> str:
    """sha256[:16] of the files' bytes; cached per (path, mtime, size), so a learning run hashes its model once."""
    import hashlib
    digest = hashlib.sha256()
    for path, _, _ in files:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


def minor_faults() -> int:
    """Page faults this process has taken so far that needed no disk read (fresh or reclaimed pages)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_has_bf16_units() -> bool:
    """Whether this CPU has bf16 matmul instructions (AVX512-BF16 / AMX), as oneDNN reports it."""
    import torch
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


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


DIGITS = frozenset("0123456789")


def digit_score(text: str, max_new_tokens: int) -> float:
    """The speed runs' reward: digit characters in the completion text / `max_new_tokens` (special tokens have
    none, so tamer's trajectory text and TRL's decoded completion score alike)."""
    return sum(c in DIGITS for c in text) / max_new_tokens


def score(spec: dict, task, text: str) -> float:
    """The reward of one completion text under `spec["reward"]` (the same function on both sides)."""
    if spec.get("reward", "correctness") == "digits":
        return digit_score(text, spec["max_new_tokens"])
    return tamer_correctness(task, text)


def _bench_digits(traj, *, max_new_tokens: int = 32) -> float:
    """`digit_score` as a tamer reward function (registered as "bench_digits" by `tamer_trainer`)."""
    return digit_score(traj.text, max_new_tokens)


def tamer_reward(spec: dict):
    """tamer's RewardComposer for `spec["reward"]`."""
    from tamer.rewards import REWARDS, RewardComposer, RewardConfig
    if spec.get("reward", "correctness") == "digits":
        if "bench_digits" not in REWARDS:
            REWARDS.register("bench_digits")(_bench_digits)
        return RewardComposer(RewardConfig(weights={"bench_digits": 1.0},
                                           params={"bench_digits": {"max_new_tokens": spec["max_new_tokens"]}}))
    return RewardComposer(RewardConfig(weights={"correctness": 1.0}))


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


def summarize(spec: dict, step_seconds: list[float], cpu_seconds: list[float], generated: list[int], phases: list[dict],
              faults: list[int], **extra) -> dict:
    """The run's figures; `cpu_seconds` is process CPU time per step (all threads), which load from
    other processes inflates far less than wall-clock time (at one thread: the work done)."""
    import torch
    timed = step_seconds[spec["warmup"]:]
    updates = {f"{k}_timed": [round(v, 4) for v in extra.pop(k)[spec["warmup"]:]]
               for k in ("grad_norms", "zero_spread") if k in extra}
    gen_tokens = sum(generated[spec["warmup"]:])
    phase_median = ({k: statistics.median(p.get(k, 0.0) for p in phases[spec["warmup"]:]) for k in phases[-1]}
                    if phases else {})
    return {"s_per_step": statistics.median(timed), "step_seconds": [round(s, 4) for s in step_seconds],
            "cpu_s_per_step": statistics.median(cpu_seconds[spec["warmup"]:]),
            "page_faults_per_step": statistics.median(faults[spec["warmup"]:]),
            "gen_tokens_per_s": gen_tokens / sum(timed), "generated_tokens_per_step": gen_tokens / len(timed),
            "peak_rss_mb": peak_rss_mb(), "profile_s": phase_median, "threads": torch.get_num_threads(), **updates,
            **extra}


# ---------------------------------------------------------------------------- tamer
class _InOrder:
    """A task pool that hands out a fixed list in order (so TRL and tamer see the same prompts)."""

    def __init__(self, tasks):
        self.tasks, self.position = tasks, 0

    def next_batch(self, n: int):
        out = self.tasks[self.position:self.position + n]
        self.position += n
        return out


def tamer_trainer(spec: dict, model, tokenizer, prompts, heldout):
    """tamer's RLTrainer for `spec` (the tamer column of the table in docs/performance.md), fed `prompts` in order."""
    from tamer.trainers.common import OptimConfig
    from tamer.trainers.rl import AlgorithmConfig, RLConfig, RLTrainer
    config = RLConfig(
        steps=spec["total_steps"], prompts_per_step=spec["prompts_per_step"], group_size=spec["group_size"],
        max_new_tokens=spec["max_new_tokens"], temperature=1.0, precision=spec["precision"], eval_every=0,
        rollout_threads=spec.get("rollout_threads", 0), fast_forward=spec.get("fast", True),
        seed=spec["seed"], optim=OptimConfig(lr=spec["lr"], max_grad_norm=1.0),
        algorithm=AlgorithmConfig(kl_coef=spec["beta"], kl_estimator="k3", aggregation="token-mean"))
    trainer = RLTrainer(model, tokenizer, prompts, heldout, tamer_reward(spec), config, run_dir=spec["run_dir"])
    trainer.pool = _InOrder(prompts)
    return trainer


def run_tamer(spec: dict) -> dict:
    from tamer.models import count_parameters
    model, tokenizer = load(spec)
    prompts, heldout = tasks_for(spec)
    trainer = tamer_trainer(spec, model, tokenizer, prompts, heldout)
    evaluate = evaluator(spec, tokenizer, heldout) if spec["eval_every"] else None
    seconds, generated, phases, curve, learner_tokens, clock, trace = [], [], [], [], [], 0.0, []
    if evaluate:
        curve.append((0, 0.0, evaluate(model)))
    cpu, faults, zero_spread = [], [], []
    for step in range(1, spec["total_steps"] + 1):
        pause(spec.get("interleave_steps"), spec["warmup"], spec["total_steps"], step - 1)
        start, cpu_start, faults_start = time.perf_counter(), time.process_time(), minor_faults()
        metrics = trainer.train_step()
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
        faults.append(minor_faults() - faults_start)
        clock += seconds[-1]
        generated.append(int(metrics["tokens/generated"]))
        learner_tokens.append((metrics["tokens/learner"], metrics["tokens/prefill"], metrics["tokens/replayed"]))
        phases.append({k[5:-2]: v for k, v in metrics.items() if k.startswith("time/") and k not in
                       ("time/rollout_s", "time/update_s")})
        trace.append((metrics["reward/mean"], metrics["train/grad_norm"]))
        zero_spread.append(metrics["rollout/zero_spread_frac"])
        if evaluate and step % spec["eval_every"] == 0:
            curve.append((step, clock, evaluate(model)))
    params = count_parameters(model)
    w = spec["warmup"]
    # FLOPs done: a replayed token's learner forward projections are not (models/replay.py), 2P less
    flops = [2 * params * (gen + prefill) + (6 + 2 * (spec["beta"] > 0)) * params * learn - 2 * params * replayed
             for gen, (learn, prefill, replayed) in zip(generated, learner_tokens)]
    achieved = sum(flops[w:]) / sum(seconds[w:]) / 1e9
    cfg = model.config
    shapes = [(1024, 1024, 1024),
              (spec["prompts_per_step"] * spec["group_size"] * 48, cfg.hidden_size, cfg.intermediate_size)]
    rates = matmul_gflops(spec["precision"], shapes) if not spec["eval_every"] else [{"gflops": float("nan")}] * 2
    return summarize(spec, seconds, cpu, generated, phases, faults, model_params=params, curve=curve, trace=trace,
                     grad_norms=[g for _, g in trace], zero_spread=zero_spread, achieved_gflops=achieved,
                     matmul_gflops_1024=rates[0]["gflops"],
                     matmul_gflops_model_shape=rates[1]["gflops"], matmul_layouts=[r.get("all") for r in rates],
                     model_matmul_shape=list(shapes[1]), fast_forward=getattr(trainer.engine, "fast", None) is not None,
                     replayed_tokens_per_step=statistics.median(r for _, _, r in learner_tokens[w:] or learner_tokens),
                     cpu_bf16_units=cpu_has_bf16_units())


# ---------------------------------------------------------------------------- TRL
def trl_settings(spec: dict) -> dict:
    """Every `GRPOConfig` field the benchmark sets for `spec` (docs/performance.md: why each).

    Speed runs (`eval_every` 0) log after `max_steps` only, so no step pays for TRL's metric
    gathering; learning runs log every step (their per-step reward and gradient-norm trace).
    """
    rows = spec["prompts_per_step"] * spec["group_size"]
    return dict(
        output_dir=spec["run_dir"], per_device_train_batch_size=rows, gradient_accumulation_steps=1,
        num_generations=spec["group_size"], max_completion_length=spec["max_new_tokens"], temperature=1.0,
        top_p=1.0, top_k=0, learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        beta=spec["beta"], use_bias_correction_kl=False, num_iterations=1, loss_type="dapo", epsilon=0.2,
        max_grad_norm=1.0, scale_rewards="group", bf16=spec["precision"] == "bf16", gradient_checkpointing=False,
        use_cpu=True, max_steps=spec["total_steps"],
        logging_steps=1 if spec["eval_every"] else spec["total_steps"] + 1,
        save_strategy="no", report_to="none", shuffle_dataset=False, seed=spec["seed"],
        dataloader_num_workers=0, disable_tqdm=True, log_completions=False)


def trl_config(spec: dict):
    """TRL's GRPOConfig for `spec`: `trl_settings(spec)`, every one stated explicitly."""
    from trl import GRPOConfig
    return GRPOConfig(**trl_settings(spec))


def checkpointing_layers(model) -> int:
    """How many modules of `model` run activation (gradient) checkpointing."""
    return sum(bool(getattr(m, "gradient_checkpointing", False)) for m in model.modules())


def run_trl(spec: dict) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from tamer.models import count_parameters
    model, tokenizer = load(spec)
    prompts, heldout = tasks_for(spec)
    by_id = {t.id: t for t in prompts}
    data = Dataset.from_list([{"prompt": list(t.messages), "task_id": t.id} for t in prompts])
    timer: dict[str, float] = {}
    generated: list[int] = []

    def reward(prompts, completions, task_id, completion_ids, **_) -> list[float]:
        start = time.perf_counter()
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        generated.append(sum(len(ids) for ids in completion_ids))
        scores = [score(spec, by_id[i], text) for i, text in zip(task_id, texts)]
        timer["score"] = timer.get("score", 0.0) + time.perf_counter() - start
        return scores

    args = trl_config(spec)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=reward, args=args,
                          train_dataset=data)
    _time_trl_phases(trainer, timer)
    grad_norms = _record_grad_norms(trainer)
    evaluate = evaluator(spec, tokenizer, heldout) if spec["eval_every"] else None
    state = {"last": None, "clock": 0.0, "checkpointing": None}
    seconds, cpu, phases, curve, faults, zero_spread = [], [], [], [], [], []

    class Clock(TrainerCallback):  # step time = between consecutive step ends, evaluation excluded
        def on_train_begin(self, *a, **k):
            # Trainer.train switches checkpointing on before this callback: it must be off here.
            state["checkpointing"] = checkpointing_layers(trainer.model)
            if state["checkpointing"]:
                raise RuntimeError(f"TRL's model runs activation checkpointing in {state['checkpointing']} modules")
            if evaluate:
                curve.append((0, 0.0, evaluate(trainer.model)))
            state["last"], state["cpu"], state["faults"] = time.perf_counter(), time.process_time(), minor_faults()

        def on_step_end(self, _args, train_state, *a, **k):
            now = time.perf_counter()
            seconds.append(now - state["last"])
            cpu.append(time.process_time() - state["cpu"])
            faults.append(minor_faults() - state["faults"])
            state["clock"] += seconds[-1]
            phases.append(dict(timer))
            timer.clear()
            # the fraction of this step's groups whose rewards are all equal (zero advantages), as TRL logs it
            zero_spread.append((trainer._metrics["train"].get("frac_reward_zero_std") or [float("nan")])[-1])
            if evaluate and train_state.global_step % spec["eval_every"] == 0:
                curve.append((train_state.global_step, state["clock"], evaluate(trainer.model)))
            pause(spec.get("interleave_steps"), spec["warmup"], spec["total_steps"], train_state.global_step)
            state["last"], state["cpu"], state["faults"] = time.perf_counter(), time.process_time(), minor_faults()

    trainer.add_callback(Clock())
    trainer.train()
    trace = [(log["reward"], log["grad_norm"]) for log in trainer.state.log_history
             if "grad_norm" in log and "reward" in log]
    return summarize(spec, seconds, cpu, generated, phases, faults, model_params=count_parameters(model), curve=curve,
                     trace=trace, grad_norms=grad_norms, zero_spread=zero_spread,
                     trl_version=__import__("trl").__version__,
                     gradient_checkpointing=bool(state["checkpointing"]),
                     use_bias_correction_kl=args.use_bias_correction_kl)


def _record_grad_norms(trainer) -> list[float]:
    """Each step's gradient norm before clipping, as `Trainer` hands it to its logging hook after the step
    (speed runs log no step, so the log history has none)."""
    norms: list[float] = []
    log_save_evaluate = trainer._maybe_log_save_evaluate

    def hook(tr_loss, grad_norm, *args, **kwargs):
        norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
        return log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)
    trainer._maybe_log_save_evaluate = hook
    return norms


def _time_trl_phases(trainer, timer: dict[str, float]) -> None:
    """Wrap TRL's phases with timers: generate, logprobs (no-grad ref/old forwards), forward, backward, optimizer."""
    import torch
    from transformers import TrainerCallback

    def wrap(obj, name, key, only_no_grad=False):
        inner = getattr(obj, name)

        def timed(*a, **k):
            key_now = "forward_backward" if only_no_grad and torch.is_grad_enabled() else key
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                timer[key_now] = timer.get(key_now, 0.0) + time.perf_counter() - start
        setattr(obj, name, timed)

    wrap(trainer, "_generate_single_turn", "generate")
    wrap(trainer, "_get_per_token_logps_and_entropies", "logprobs", only_no_grad=True)
    wrap(trainer.accelerator, "backward", "forward_backward")

    class Optim(TrainerCallback):
        def on_pre_optimizer_step(self, *a, **k):
            timer["_optim_start"] = time.perf_counter()

        def on_optimizer_step(self, *a, **k):
            timer["optimizer"] = time.perf_counter() - timer.pop("_optim_start", time.perf_counter())
    trainer.add_callback(Optim())
