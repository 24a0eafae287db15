"""Decode-sized float32 matmuls (few rows, a model's weight shapes) in each operand layout, weights hot and cold.

    python benchmarks/decode_matmul.py                    # the 20m benchmark model's shapes, 32 rows
    python benchmarks/decode_matmul.py --rows 32 --threads 2 --cold-mb 160

A decode step multiplies a few rows (one token per sequence) by every weight of the model once.
Which kernel is fastest there depends on the CPU: MKL's packed GEMM (`fast_forward.MKL_PACKED`)
won on an Intel Xeon and did not on an AMD EPYC. Per shape (in -> out) this times, best of 5
rounds:

* `linear`: `F.linear(x, W)` (the engine's unpacked path), `packed`: `torch.ops.mkl._mkl_linear`
  on a packed W (the engine's packed path on Intel CPUs), `left`: `W @ x.T` (the weight as the left
  operand, output transposed), `left_back`: the same with the output made row-major again,
  `onednn`: `torch.ops.mkldnn._linear_pointwise` on W as it is, `onednn_packed`: the same on W
  packed for the row count (`_reorder_linear_weight`; the engine's packed path on AMD CPUs);
* `hot`: one weight again and again (in cache); `cold`: `--cold-mb` of distinct weights of that
  shape in turn, as a decode step reads a model larger than the L3 cache.

Also a plain `sum` over `--cold-mb` of float32 (what the memory system streams). One JSON line:
microseconds per call and GB/s of weights read, per shape, layout and temperature.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_workers import SIZES, environment


def model_shapes(size: str) -> list[tuple[int, int]]:
    """(in, out) of the engine's fused decode matmuls for a `SIZES` model: qkv, o, gate/up, down, head."""
    from tamer.models import build_char_tokenizer
    s, vocab = SIZES[size], len(build_char_tokenizer())
    hidden, head_dim = s["hidden_size"], s["hidden_size"] // s["num_heads"]
    qkv = (s["num_heads"] + 2 * s["num_kv_heads"]) * head_dim
    return [(hidden, qkv), (hidden, hidden), (hidden, 2 * s["intermediate_size"]), (s["intermediate_size"], hidden),
            (hidden, vocab)]


def best_seconds(fn, reps: int, rounds: int = 5) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - start) / reps)
    return min(times)


def time_shape(k: int, n: int, rows: int, cold_mb: float, packed_available: bool, onednn_available: bool) -> dict:
    """Microseconds per call of each layout for a (rows, k) x (k -> n) matmul, hot and cold."""
    import torch
    import torch.nn.functional as F
    count = max(1, int(cold_mb * 2**20 // (n * k * 4)))
    weights = [torch.randn(n, k) for _ in range(count)]
    x = torch.randn(rows, k)
    layouts = {"linear": lambda w, i: F.linear(x, w), "left": lambda w, i: w @ x.t(),
               "left_back": lambda w, i: (w @ x.t()).t().contiguous()}
    if packed_available:
        packs = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
        layouts["packed"] = lambda w, i: torch.ops.mkl._mkl_linear(x, packs[i], w, None, rows)
    if onednn_available:
        dnn = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
        layouts["onednn"] = lambda w, i: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        layouts["onednn_packed"] = lambda w, i: torch.ops.mkldnn._linear_pointwise(x, dnn[i], None, "none", [], "")
    row = {"in": k, "out": n, "cold_weights": count}
    for name, call in layouts.items():
        hot = best_seconds(lambda call=call: call(weights[0], 0), reps=50)
        cold = best_seconds(lambda call=call: [call(w, i) for i, w in enumerate(weights)], reps=2) / count
        row[name] = {"hot_us": round(hot * 1e6, 1), "cold_us": round(cold * 1e6, 1),
                     "cold_gb_per_s": round(n * k * 4 / cold / 1e9, 2)}
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="20m", help=f"shapes of: {', '.join(SIZES)}")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cold-mb", type=float, default=160.0, help="distinct weights per cold round, in MB")
    args = parser.parse_args(argv)
    import torch

    from tamer.models.fast_forward import MKL_PACKED, MKL_PACKED_AVAILABLE, ONEDNN_PACKED, ONEDNN_PACKED_AVAILABLE
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    out = {"size": args.size, "rows": args.rows, "threads": torch.get_num_threads(), "cold_mb": args.cold_mb,
           "packed_by_default": MKL_PACKED, "onednn_packed_by_default": ONEDNN_PACKED, "shapes": []}
    with torch.inference_mode():
        for k, n in model_shapes(args.size):
            out["shapes"].append(time_shape(k, n, args.rows, args.cold_mb, MKL_PACKED_AVAILABLE,
                                            ONEDNN_PACKED_AVAILABLE))
        stream = torch.randn(int(args.cold_mb * 2**20 // 4))
        seconds = best_seconds(stream.sum, reps=3)
        out["sum_gb_per_s"] = round(stream.numel() * 4 / seconds / 1e9, 1)
    out["environment"] = environment()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
