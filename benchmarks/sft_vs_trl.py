"""tamer's SFT vs Hugging Face TRL's SFTTrainer: tokens per second and the loss curve, same data.

    pip install -e ".[bench]"
    python benchmarks/sft_vs_trl.py                                   # trip planner demo data, 3 pairs
    python benchmarks/sft_vs_trl.py --task arithmetic --steps 10 --pairs 1   # a smoke run
    python benchmarks/sft_vs_trl.py --steps 300 --pairs 1             # the loss curves over 300 steps
    python benchmarks/sft_vs_trl.py --steps 33 --warmup 3 --interleave-steps 5 --pairs 2 \
        --trl-layouts padded --tamer-layouts packed                   # both alive, alternating 5-step blocks

Both trainers start from the same saved model (the demo's tiny Qwen2 and its BPE tokenizer,
built once), train on the same tokenized demonstrations (tamer's `demonstrations()` for the
task: prompt, reply, tool outputs masked out of the loss) in the same order (tamer's shuffled
epochs; TRL reads them with `train_sampling_strategy="sequential"`), batch size, AdamW, lr,
warm-up + cosine schedule (tamer's lr multiplier on TRL's optimizer), gradient clip, fp32, no activation checkpointing.
TRL runs in each of its batch layouts: `padded`, `padding_free` (one flattened row with
position ids) and `packing` (best-fit-decreasing rows of `--batch-size` x mean-length tokens,
so ~the same tokens per step; its batches then hold other sequences than tamer's); its best
layout is the reference. tamer runs its default (`packed`: padding-free batches on the lean
forward, a prefix all sequences of a batch share packed once) and, for reference, `padded`
(`sft.padding_free: false`) and, on request, `packed_unshared` (`sft.share_prefix: false`).

Each (tamer, TRL layout) set runs `--pairs` times, interleaved, each run in its own subprocess;
one JSON object per layout and a summary line with the median tokens/s ratio tamer / best TRL
and its range. Loss curves: per-step losses of every run, and the largest and mean absolute
difference between tamer's and TRL's per-step losses where both see the same batches.
With `--interleave-steps K` (old name `--block-steps`) each pair is one tamer and one TRL process
alive at once, running their timed steps in alternating blocks of K (the idle one waits on
stdin); the summary adds a ratio per block (the same batches on both sides).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_workers import block_pair, pause, run_worker, serve

TRL_LAYOUTS = ("padded", "padding_free", "packing")
TAMER_LAYOUTS = ("packed", "padded")  # and packed_unshared: packed, sft.share_prefix false


# ---------------------------------------------------------------------------- data and model (parent)
def prepare(task: str, out: Path, seed: int, overrides: list[str] = ()) -> dict:
    """Build the demo's model + tokenizer and its demonstrations once; return the spec's data part."""
    from tamer.config import load_config
    from tamer.models import save_model
    from tamer.pipeline import RunConfig, build_policy, seed_overrides
    from tamer.presets import preset_path
    from tamer.tasks import get_task_source
    from tamer.trainers.sft import demonstrations
    config = load_config(RunConfig, [preset_path(f"demo-{task}")], [*seed_overrides(seed), *overrides])
    model, tokenizer = build_policy(config.model, config.task)
    source = get_task_source(config.task)
    examples = demonstrations(source, source.split()[0], tokenizer, seed=config.sft.seed, agent=config.agent)
    save_model(model, tokenizer, out / "model")
    with (out / "examples.pkl").open("wb") as f:
        pickle.dump([(e.prompt_ids, e.completion_ids, e.completion_mask) for e in examples], f)
    optim = config.sft.optim
    return {"model": str(out / "model"), "examples": str(out / "examples.pkl"), "batch_size": config.sft.batch_size,
            "lr": optim.lr, "warmup": optim.warmup_steps, "schedule": optim.schedule,
            "min_lr_ratio": optim.min_lr_ratio, "max_grad_norm": optim.max_grad_norm,
            "weight_decay": optim.weight_decay, "schedule_steps": config.sft.steps,
            "task": task, "data_seed": config.sft.seed}


def _examples(spec: dict):
    from tamer.trainers.sft import Example
    with open(spec["examples"], "rb") as f:
        return [Example(p, c, m) for p, c, m in pickle.load(f)]


def _order(spec: dict, examples) -> list[list[int]]:
    """The example indices of each step, as tamer's SFTTrainer draws them (shuffled epochs, its seed)."""
    from tamer.trainers.sft import batch_order
    batches = batch_order(len(examples), spec["batch_size"], spec["data_seed"])
    return [next(batches) for _ in range(spec["steps"])]


def _result(spec: dict, seconds: list[float], cpu: list[float], tokens: list[int], losses: list[float],
            **extra) -> dict:
    w = spec["warmup_steps"]
    return {"s_per_step": statistics.median(seconds[w:]), "cpu_s_per_step": statistics.median(cpu[w:]),
            "tokens_per_s": sum(tokens[w:]) / sum(seconds[w:]), "tokens_per_cpu_s": sum(tokens[w:]) / sum(cpu[w:]),
            "tokens_per_step": statistics.fmean(tokens), "losses": [round(x, 5) for x in losses],
            "step_seconds": [round(s, 6) for s in seconds], "step_tokens": tokens, **extra}


# ---------------------------------------------------------------------------- tamer worker
def tamer_trainer(spec: dict):
    """(model in train mode, tamer's SFTTrainer) for `spec`; `spec["layout"]` (default packed) picks the path."""
    from tamer.models import load_model
    from tamer.trainers.common import OptimConfig
    from tamer.trainers.sft import SFTConfig, SFTTrainer
    model, tokenizer = load_model(spec["model"])
    optim = OptimConfig(lr=spec["lr"], warmup_steps=spec["warmup"], schedule=spec["schedule"],
                        min_lr_ratio=spec["min_lr_ratio"], max_grad_norm=spec["max_grad_norm"],
                        weight_decay=spec["weight_decay"])
    layout = spec.get("layout", "packed")
    config = SFTConfig(steps=spec["schedule_steps"], batch_size=spec["batch_size"], optim=optim, seed=spec["data_seed"],
                       padding_free=layout != "padded", share_prefix=layout == "packed")
    trainer = SFTTrainer(model, tokenizer, _examples(spec), config)
    return model.train(), trainer


def run_tamer(spec: dict) -> dict:
    import torch

    from tamer.trainers.common import clip_and_step
    torch.set_num_threads(spec["threads"])
    model, trainer = tamer_trainer(spec)
    optim = trainer.config.optim
    seconds, cpu, tokens, losses = [], [], [], []
    for _, batch in zip(range(spec["steps"]), trainer.example_batches()):
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = trainer.loss(batch)
        loss.backward()
        clip_and_step(model, trainer.optimizer, trainer.scheduler, optim.max_grad_norm)
        losses.append(loss.item())
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
        tokens.append(sum(len(e.prompt_ids) + len(e.completion_ids) for e in batch))
        pause(spec.get("block_steps"), spec["warmup_steps"], spec["steps"], len(seconds))
    return _result(spec, seconds, cpu, tokens, losses, threads=torch.get_num_threads(),
                   lean_forward=trainer.fast is not None)


# ---------------------------------------------------------------------------- TRL worker
def trl_sft_settings(spec: dict, mean_length: float) -> dict:
    """Every `SFTConfig` field set for TRL (its defaults: gradient_checkpointing=True, bf16 where supported,
    lr 2e-5, logging every 10 steps). The lr schedule is tamer's (`_tamer_schedule`)."""
    layout = spec["layout"]
    packing = layout == "packing"
    return dict(
        output_dir=spec["run_dir"], per_device_train_batch_size=1 if packing else spec["batch_size"],
        gradient_accumulation_steps=1, max_steps=spec["steps"], learning_rate=spec["lr"],
        weight_decay=spec["weight_decay"], max_grad_norm=spec["max_grad_norm"],
        gradient_checkpointing=False, bf16=False, use_cpu=True, seed=spec["data_seed"],
        train_sampling_strategy="sequential", completion_only_loss=True,
        padding_free=layout == "padding_free", packing=packing, packing_strategy="bfd",
        max_length=round(spec["batch_size"] * mean_length) if packing else None,  # no sequence is truncated
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0)


def _tamer_schedule(trainer, spec: dict) -> None:
    """TRL's own optimizer with tamer's lr multiplier: HF's warm-up starts at 0 (step / warmup), tamer's at
    1 / warmup ((step + 1) / warmup), so with HF's `cosine_with_min_lr` every warm-up step's lr would differ."""
    from tamer.trainers.common import OptimConfig, make_scheduler
    optim = OptimConfig(lr=spec["lr"], warmup_steps=spec["warmup"], schedule=spec["schedule"],
                        min_lr_ratio=spec["min_lr_ratio"])

    def create_scheduler(num_training_steps, optimizer=None):
        trainer.lr_scheduler = make_scheduler(optimizer or trainer.optimizer, optim, spec["schedule_steps"])
        return trainer.lr_scheduler
    trainer.create_scheduler = create_scheduler


def run_trl(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from tamer.models import load_model
    torch.set_num_threads(spec["threads"])
    model, tokenizer = load_model(spec["model"])
    examples = _examples(spec)
    order = [i for step in _order(spec, examples) for i in step]
    rows = [{"input_ids": examples[i].prompt_ids + examples[i].completion_ids,
             "completion_mask": [0] * len(examples[i].prompt_ids)
             + list(examples[i].completion_mask or [1] * len(examples[i].completion_ids))} for i in order]
    mean_length = statistics.fmean(len(r["input_ids"]) for r in rows)
    args = SFTConfig(**trl_sft_settings(spec, mean_length))
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    _tamer_schedule(trainer, spec)
    state = {}
    seconds, cpu, tokens = [], [], []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            state["checkpointing"] = sum(bool(getattr(m, "gradient_checkpointing", False))
                                         for m in trainer.model.modules())
            if state["checkpointing"]:
                raise RuntimeError("TRL's model runs activation checkpointing")
            state["last"], state["cpu"] = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            seconds.append(time.perf_counter() - state["last"])
            cpu.append(time.process_time() - state["cpu"])
            pause(spec.get("block_steps"), spec["warmup_steps"], spec["steps"], len(seconds))
            state["last"], state["cpu"] = time.perf_counter(), time.process_time()

    inner = trainer.compute_loss

    def counted(model, inputs, *a, **k):  # real (non-padding) tokens of the step
        mask = inputs.get("attention_mask")
        tokens.append(int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel()))
        return inner(model, inputs, *a, **k)
    trainer.compute_loss = counted
    trainer.add_callback(Clock())
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return _result(spec, seconds, cpu, tokens, losses, threads=torch.get_num_threads(),
                   gradient_checkpointing=bool(state["checkpointing"]), trl_version=__import__("trl").__version__)


# ---------------------------------------------------------------------------- arithmetic per step
def model_shape(model_dir: str) -> dict:
    """The decoder's sizes from its config.json."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    heads = c["num_attention_heads"]
    return {"hidden": c["hidden_size"], "layers": c["num_hidden_layers"], "mlp": c["intermediate_size"],
            "heads": heads, "kv_heads": c.get("num_key_value_heads") or heads,
            "head_dim": c.get("head_dim") or c["hidden_size"] // heads, "vocab": c["vocab_size"]}


def step_flops(lengths: list[int], learned: int, shape: dict, layout: str, budget: int | None = None,
               shared: int = 0) -> dict:
    """Model FLOPs of one SFT step (forward + backward) over sequences of `lengths` with `learned` learned tokens.

    Matmuls: 6 FLOPs per weight per token (forward 2, input and weight gradients 4). Attention:
    7·W²·D per head for a row of width W (forward QKᵀ and PV over the causal lower triangle 2·W²·D,
    the flash backward 5·W²·D), counted with the upper triangle skipped for both layouts (TRL's
    masked kernel may do more). `packed` (tamer): every layer's q/k/v on the N packed tokens (a
    prefix of `shared` tokens all sequences start with counted once), the rest of the last layer
    and the head on the learned positions only, attention in groups of length-sorted sequences of
    at most `budget` padded tokens each (`attention_groups`; None: `ATTENTION_TOKENS`), every row
    whole (`trainers/packed.py`). `padded` (TRL, tamer's HF path): every token-wise op and the head
    on B x T_max positions, one row per sequence. Norms, RoPE, activations and the loss are left out (no matmul).
    """
    h, layers, d, heads = shape["hidden"], shape["layers"], shape["head_dim"], shape["heads"]
    qkv, o, mlp = h * (heads + 2 * shape["kv_heads"]) * d, heads * d * h, 3 * h * shape["mlp"]
    row_attention = lambda width: 7 * width * width * d * heads  # noqa: E731
    if layout == "packed":
        from tamer.trainers.packed import attention_groups
        n, ordered = sum(lengths) - shared * (len(lengths) - 1), sorted(lengths)
        groups = attention_groups(ordered, budget)
        widths, rows = [ordered[g[-1]] for g in groups], [len(g) for g in groups]
        linear = 6 * (layers * n * qkv + (layers - 1) * n * (o + mlp) + learned * (o + mlp))
        attention = layers * sum(r * row_attention(w) for r, w in zip(rows, widths))
        head = 6 * learned * h * shape["vocab"]
    elif layout == "padded":
        positions = len(lengths) * max(lengths)
        linear = 6 * layers * positions * (qkv + o + mlp)
        attention = layers * len(lengths) * row_attention(max(lengths))
        head = 6 * positions * h * shape["vocab"]
    else:
        raise ValueError(f"step_flops: layout {layout!r} is not one of packed, padded")
    return {"linear": linear, "attention": attention, "head": head, "total": linear + attention + head}


def work_ratio(spec: dict, steps: range) -> dict:
    """TRL padded's model FLOPs / tamer packed's over the batches of `steps` (the same batches both see)."""
    from tamer.trainers.packed import prefix_to_share
    examples, shape = _examples(spec), model_shape(spec["model"])
    totals = {"packed": {}, "padded": {}}
    for batch in _order(dict(spec, steps=steps.stop), examples)[steps.start:]:
        sequences = [examples[i].prompt_ids + examples[i].completion_ids for i in batch]
        lengths = [len(s) for s in sequences]
        learned = sum(sum(examples[i].completion_mask or [1] * len(examples[i].completion_ids)) for i in batch)
        shared = prefix_to_share(sequences)
        for layout, total in totals.items():
            for part, flops in step_flops(lengths, learned, shape, layout, shared=shared).items():
                total[part] = total.get(part, 0) + flops
    tamer, trl = totals["packed"], totals["padded"]
    return {"work_ratio": round(trl["total"] / tamer["total"], 3),
            "work_parts_trl_over_tamer": {k: round(trl[k] / tamer[k], 3) for k in ("linear", "attention", "head")},
            "tamer_gflop_per_step": round(tamer["total"] / len(steps) / 1e9, 3),
            "trl_gflop_per_step": round(trl["total"] / len(steps) / 1e9, 3)}


# ---------------------------------------------------------------------------- parent
def worker(kind: str, spec: dict) -> dict:
    """Run one SFT trainer in a fresh subprocess of this script (`bench_workers.run_worker`)."""
    return run_worker(__file__, kind, spec)


def block_speedups(tamer: dict, trl: dict, spec: dict) -> list[float]:
    """tokens/s tamer / TRL per block of the timed steps (the same batches on both sides)."""
    def rate(result: dict, part: slice) -> float:
        return sum(result["step_tokens"][part]) / sum(result["step_seconds"][part])
    parts = [slice(start, start + spec["block_steps"])
             for start in range(spec["warmup_steps"], spec["steps"], spec["block_steps"])]
    return [rate(tamer, part) / rate(trl, part) for part in parts]


def curve_gap(a: list[float], b: list[float]) -> dict:
    diffs = [abs(x - y) for x, y in zip(a, b)]
    return {"max_abs_loss_diff": round(max(diffs), 5), "mean_abs_loss_diff": round(statistics.fmean(diffs), 5),
            "final_loss": [a[-1], b[-1]]}


def compare(args, data: dict, tmp: Path) -> None:
    base = dict(data, threads=args.threads, steps=args.steps, warmup_steps=args.warmup, run_dir=str(tmp / "run"))
    runs: dict[str, list[dict]] = {}
    sides = [("tamer", layout) for layout in args.tamer_layouts] + [("trl", layout) for layout in args.trl_layouts]
    blocks = []
    for pair in range(args.pairs):
        if args.block_steps:  # one tamer and one TRL layout, alternating in blocks within each pair
            specs = {kind: dict(base, layout=layout, block_steps=args.block_steps) for kind, layout in sides}
            results = block_pair(__file__, specs, "tamer" if pair % 2 == 0 else "trl")
            for kind, layout in sides:
                runs.setdefault(f"{kind}:{layout}", []).append(results[kind])
            blocks += block_speedups(results["tamer"], results["trl"], specs["tamer"])
            continue
        for kind, layout in (sides if pair % 2 == 0 else sides[::-1]):
            runs.setdefault(f"{kind}:{layout}", []).append(worker(kind, dict(base, layout=layout)))
    for name, results in runs.items():
        kind, layout = name.split(":")
        row = {"side": kind, "layout": layout, "runs": len(results), "threads": results[0]["threads"],
               "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in results), 1),
               "tokens_per_s_runs": [round(r["tokens_per_s"], 1) for r in results],
               "tokens_per_cpu_s": round(statistics.median(r["tokens_per_cpu_s"] for r in results), 1),
               "s_per_step": round(statistics.median(r["s_per_step"] for r in results), 4),
               "tokens_per_step": round(results[0]["tokens_per_step"], 1), "losses": results[0]["losses"]}
        row.update({k: results[0][k] for k in ("gradient_checkpointing", "trl_version", "lean_forward", "malloc")
                    if k in results[0]})
        print(json.dumps(row), flush=True)
    tamer = runs[f"tamer:{args.tamer_layouts[0]}"]
    best = max(args.trl_layouts, key=lambda lay: statistics.median(r["tokens_per_s"] for r in runs[f"trl:{lay}"]))
    trl = runs[f"trl:{best}"]
    speedups = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(tamer, trl)]
    cpu_speedups = [a["tokens_per_cpu_s"] / b["tokens_per_cpu_s"] for a, b in zip(tamer, trl)]
    same_batches = [lay for lay in args.trl_layouts if lay != "packing"]
    work = {}
    if args.tamer_layouts[0] == "packed" and best == "padded":  # arithmetic of the timed steps' batches
        work = work_ratio(base, range(args.warmup, args.steps))
        work["speedup_per_work"] = round(statistics.median(speedups) / work["work_ratio"], 3)
    print(json.dumps({
        "mode": "sft_summary", "task": data["task"], "steps": args.steps, "warmup_steps": args.warmup,
        "batch_size": data["batch_size"], "tamer_layout": args.tamer_layouts[0], "trl_best_layout": best,
        "speedup_median": round(statistics.median(speedups), 3), "speedup_min": round(min(speedups), 3),
        "speedup_max": round(max(speedups), 3), "speedups": [round(s, 3) for s in speedups],
        "cpu_speedup_median": round(statistics.median(cpu_speedups), 3), "target": 1.5,
        "target_met": min(speedups) >= 1.5, **work, **_blocks_summary(args, blocks),
        "loss_curve_vs_trl": {lay: curve_gap(tamer[0]["losses"], runs[f"trl:{lay}"][0]["losses"])
                              for lay in same_batches},
    }), flush=True)


def _blocks_summary(args, blocks: list[float]) -> dict:
    if not blocks:
        return {}
    return {"block_steps": args.block_steps, "blocks": len(blocks),
            "block_speedup_median": round(statistics.median(blocks), 3), "block_speedup_min": round(min(blocks), 3),
            "block_speedup_max": round(max(blocks), 3), "block_speedups": [round(b, 3) for b in blocks],
            "block_target_met": min(blocks) >= 1.5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="trip_planner", help="a demo preset: arithmetic, calculator, trip_planner")
    parser.add_argument("--steps", type=int, default=30, help="steps per run (the loss curve is over these)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trl-layouts", default=",".join(TRL_LAYOUTS), type=lambda s: s.split(","))
    parser.add_argument("--tamer-layouts", default=",".join(TAMER_LAYOUTS), type=lambda s: s.split(","))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override the demo preset (repeatable), e.g. agent.show_tools=true")
    parser.add_argument("--interleave-steps", "--block-steps", dest="block_steps", type=int, default=0, metavar="K",
                        help="both trainers alive at once, their timed steps alternated in blocks of K steps (one "
                             "tamer and one TRL layout); each block pair is a ratio (as vs_trl.py's "
                             "--interleave-steps; --block-steps is the old name)")
    parser.add_argument("--worker", choices=("tamer", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.block_steps and (len(args.tamer_layouts) != 1 or len(args.trl_layouts) != 1
                             or (args.steps - args.warmup) % args.block_steps):
        parser.error("--interleave-steps: one --tamer-layouts and one --trl-layouts, and the timed steps "
                     "(--steps minus --warmup) a multiple of it")
    if args.worker:
        serve(run_tamer, run_trl, args.worker, args.spec)  # both sides: tamer's allocator settings
        return
    with tempfile.TemporaryDirectory(prefix="sft_vs_trl_") as tmp:
        compare(args, prepare(args.task, Path(tmp), args.seed, args.set), Path(tmp))


if __name__ == "__main__":
    main()
