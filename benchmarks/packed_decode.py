"""tamer's GRPO step (the `vs_trl.py` speed spec) with one setting on and off, alternated in one process.

    python benchmarks/packed_decode.py --size 20m --pairs 12                          # MKL-packed weights
    python benchmarks/packed_decode.py --size 20m --pairs 12 --switch onednn          # oneDNN-packed weights
    python benchmarks/packed_decode.py --size 20m --pairs 12 --switch onednn --path general  # the HF forward's
    python benchmarks/packed_decode.py --size 20m --pairs 12 --switch mlp_transposed  # MLP on h.T
    python benchmarks/packed_decode.py --size 20m --pairs 12 --switch replay          # sampler outputs reused

The settings are `FastDecoder`'s float32 decode switches in `models/fast_forward.py` and one of the
trainer's:

* `packed` (`MKL_PACKED`, on by default on Intel CPUs): decode matmuls on weights packed once per
  `generate` (`torch.ops.mkl._mkl_linear`) when the model's weights are large enough;
* `onednn` (`ONEDNN_PACKED`, on by default on AMD CPUs): the same with oneDNN's packed layout
  (`torch.ops.mkldnn._linear_pointwise`); MKL's packing is off in both runs;
* `mlp_transposed` (`MLP_TRANSPOSED`, on by default): the MLP as W_gu @ h.T with the activation
  on (I, B), the weights as the left operand of the few-row matmuls;
* `replay` (`rl.reuse_sampler_activations`, on by default): the learner takes the decode steps'
  projection outputs instead of recomputing them (`models/replay.py`).

This script builds the benchmark model, warms an `RLTrainer` up, then runs `--pairs` pairs of
`train_step()` with the setting on and off (on any CPU), the order reversed every other pair, all
in one process: a slow spell of the machine falls on both alike. One JSON line: per setting the
median step, generation and learner (forward + backward) seconds and their range, and the per-pair
ratio on / off (median,
min, max). Peak memory needs one process per setting (`memory_plan.py` measures the whole step's).
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
from grpo_workers import SIZES, SPEED, build_model, environment, load, tamer_trainer, tasks_for

SWITCHES = {"packed": "MKL_PACKED", "onednn": "ONEDNN_PACKED", "mlp_transposed": "MLP_TRANSPOSED",  # fast_forward.py
            "replay": "reuse_sampler_activations"}  # the trainer's RLConfig


def _set(trainer, name: str, on: bool) -> None:
    import tamer.models.fast_forward as ff

    if hasattr(ff, name):
        setattr(ff, name, on)
    else:  # a field of the trainer's (frozen) RLConfig
        object.__setattr__(trainer.config, name, on)


def _get(trainer, name: str) -> bool:
    import tamer.models.fast_forward as ff

    return getattr(ff, name) if hasattr(ff, name) else getattr(trainer.config, name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="20m", help=f"of {', '.join(SIZES)}")
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--switch", default="packed", choices=sorted(SWITCHES))
    parser.add_argument("--path", default="fast", choices=("fast", "general"),
                        help="general: the HF forward in engine and learner (packing: models/decode_linear.py)")
    args = parser.parse_args(argv)
    import tamer.models.fast_forward as ff
    from tamer.models.decode_linear import packable_linear

    tmp = Path(tempfile.mkdtemp())
    model_dir = build_model(args.size, tmp)
    spec = dict(SPEED, model=str(model_dir), threads=args.threads, seed=0, beta=0.0, precision="fp32", warmup=0,
                total_steps=args.warmup + 2 * args.pairs, eval_every=0, run_dir=str(tmp / "run"),
                fast=args.path == "fast")
    model, tokenizer = load(spec)
    prompts, heldout = tasks_for(spec)
    trainer = tamer_trainer(spec, model, tokenizer, prompts, heldout)
    for _ in range(args.warmup):
        trainer.train_step()
    name = SWITCHES[args.switch]
    default = _get(trainer, name)
    available = {"packed": ff.MKL_PACKED_AVAILABLE, "onednn": ff.ONEDNN_PACKED_AVAILABLE}.get(args.switch, True)
    mkl_default = ff.MKL_PACKED  # without the kernels both runs are F.linear
    if args.switch == "onednn":
        ff.MKL_PACKED = False
    steps, generate, learn = ({True: [], False: []} for _ in range(3))
    for pair in range(args.pairs):
        for on in ((True, False) if pair % 2 == 0 else (False, True)):
            _set(trainer, name, available and on)
            start = time.perf_counter()
            metrics = trainer.train_step()
            steps[on].append(time.perf_counter() - start)
            generate[on].append(metrics["time/generate_s"])
            learn[on].append(metrics.get("time/forward_backward_s", 0.0))
    extra = {}
    if args.switch in ("packed", "onednn"):
        setattr(ff, name, available)
        fast = trainer.engine.fast
        extra = {f"{'mkl' if args.switch == 'packed' else 'onednn'}_available": available,
                 "packs_apply": fast._packable_mb() > 0 if fast is not None
                 else any(packable_linear(m) for m in trainer.model.modules())}
    ff.MKL_PACKED = mkl_default
    _set(trainer, name, default)
    ratios = ratio_summary(steps[True], steps[False], None)

    def summary(xs: list[float]) -> dict:
        return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)}
    print(json.dumps({
        "size": args.size, "path": args.path, "switch": args.switch, "pairs": args.pairs, "threads": args.threads,
        **extra,
        "on_by_default": default, "on_step_s": summary(steps[True]), "off_step_s": summary(steps[False]),
        "on_generate_s": summary(generate[True]), "off_generate_s": summary(generate[False]),
        "on_learn_s": summary(learn[True]), "off_learn_s": summary(learn[False]),
        "ratio": {k: ratios[f"ratio_{k}"] for k in ("median", "min", "max")},
        "environment": environment(model_dir)}), flush=True)


if __name__ == "__main__":
    main()
