"""A static-shape decode step, eager vs `torch.compile`: could a compiled decode beat the eager one?

    python benchmarks/compiled_decode.py --size 1m --rounds 12                     # inductor's C++ wrapper
    python benchmarks/compiled_decode.py --size 1m --rounds 12 --python-wrapper    # its Python wrapper

`FastDecoder.decode` attends over the keys filled so far, so its shapes grow by one every step
and a compiled version recompiles (docs/performance.md: the dynamic compile was no faster and
took minutes). `static_step` is the same float32 lean step (Qwen2/Llama without windows or
soft-capping; no replay record) with shapes that do not change within a `generate`: attention
over the whole KV capacity with an additive mask (the columns not yet written zeroed: a masked
NaN would still spread), the new key and value written at a tensor column (`index_copy_`). The
script builds the benchmark model, prefills the speed batch's prompts, checks the static step's
logits against `FastDecoder.decode` on the same cache, then times the static step eager
(`inference_mode`, as the engine runs) and compiled (`no_grad`: inference tensors cannot be
traced) in `--rounds` interleaved rounds of `--calls` calls. One JSON line: the compile's seconds
(wall and this process's CPU; inductor compiles in worker processes too, and caches on disk, so a
second run compiles faster), microseconds per step, the per-round ratio compiled / eager (median,
min, max) and the largest logit difference. A dev measurement: nothing here is used by the
trainer.
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


def static_step(fast, tokens, cs, keys, values, bias, col):
    """Logits (B, V) of one decode step of `fast` (a refreshed `FastDecoder`) with static shapes.

    tokens (B,), cs (B, 2, D) RoPE cos/signed sin at the tokens' positions (`_rope_tables`), keys /
    values per layer (B, H_kv, capacity, D) written in place at column `col` (a (1,) long tensor),
    bias (B·H_kv, group, capacity): 0 where a key may be attended (the new column included), -inf
    elsewhere. `FastDecoder.decode`'s fused float32 operations in its order, every matmul as `F.linear` / `addmm`
    on row-major activations (decode runs the MLP on h.T at 1m and packed weights at 20m): equal up to rounding.
    """
    import torch
    import torch.nn.functional as F
    batch = tokens.shape[0]
    heads, kv, d = fast.num_heads, fast.num_kv, fast.head_dim
    group, capacity = heads // kv, keys[0].shape[2]
    weight, eps = fast.norm
    x = F.embedding(tokens, fast.embed)
    cos, sin = cs.unsqueeze(-3).unbind(-2)
    for i, layer in enumerate(fast.layers):
        h = F.rms_norm(x, (x.shape[-1],), layer.ln1[0], layer.ln1[1])
        qkv = F.linear(h, layer.qkv_w, layer.qkv_b).view(batch, heads + 2 * kv, d)
        qk = qkv[:, :heads + kv]
        qk = qk * cos + torch.roll(qk, d // 2, dims=-1) * sin
        keys[i].index_copy_(2, col, qk[:, heads:].unsqueeze(2))
        values[i].index_copy_(2, col, qkv[:, heads + kv:].unsqueeze(2))
        q = qk[:, :heads].reshape(batch * kv, group, d)
        scores = torch.baddbmm(bias, q, keys[i].reshape(batch * kv, capacity, d).transpose(1, 2), alpha=fast.scaling)
        attn = torch.bmm(scores.softmax(-1), values[i].reshape(batch * kv, capacity, d)).reshape(batch, heads * d)
        x = torch.addmm(x, attn, layer.o_w.t())
        h = F.rms_norm(x, (x.shape[-1],), layer.ln2[0], layer.ln2[1])
        gate, up = F.linear(h, layer.gu_w).chunk(2, dim=-1)
        x = torch.addmm(x, F.silu(gate) * up, layer.down_w.t())
    return F.linear(F.rms_norm(x, (x.shape[-1],), weight, eps), fast.head)


def static_inputs(fast, kv, key_mask, positions):
    """`static_step`'s cs, keys, values (copies of the `KVBuffer`, the columns not yet written zeroed), bias and
    col for the next decode step."""
    import torch

    from tamer.models.fast_forward import grouped_bias
    col = kv.length
    allowed = key_mask.clone()
    allowed[:, col] = True
    allowed[:, col + 1:] = False
    bias = grouped_bias(allowed, fast.num_kv, fast.num_heads // fast.num_kv, torch.float32)
    cs = fast._rope_tables(positions, positions.device, size=0)
    keys, values = [k.clone() for k in kv.k], [v.clone() for v in kv.v]
    for buffer in keys + values:  # columns not yet written hold whatever memory held: masked scores of a
        buffer[:, :, col:].zero_()  # NaN key would still be NaN, and 0 x a NaN value too, so make them 0
    return cs, keys, values, bias, torch.tensor([col])


def prefilled(size: str, out: Path, threads: int):
    """The benchmark model's `FastDecoder` with the speed batch's prompts prefilled (n samples each) and room for
    the new tokens: (fast, KVBuffer, key_mask, last logits, last positions)."""
    import torch

    from tamer.models.fast_forward import FastDecoder
    from tamer.models.loading import encode_chat
    from tamer.rollout.engine import _left_pad
    spec = dict(SPEED, model=str(build_model(size, out)), threads=threads, seed=0, total_steps=1)
    model, tokenizer = load(spec)
    prompts, _ = tasks_for(spec)
    fast = FastDecoder.for_model(model)
    if fast is None:
        raise SystemExit(f"{size}: the lean forward does not support this model")
    fast.refresh()
    ids, mask = _left_pad([encode_chat(tokenizer, p.messages) for p in prompts[:spec["prompts_per_step"]]],
                          tokenizer.pad_token_id)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    n = spec["group_size"]
    with torch.inference_mode():
        logits, kv = fast.prefill(ids, mask, positions, repeat=n, extra=spec["max_new_tokens"])
    key_mask = torch.ones(logits.shape[0], mask.shape[1] + spec["max_new_tokens"], dtype=torch.bool)
    key_mask[:, :mask.shape[1]] = mask.repeat_interleave(n, dim=0).bool()
    return fast, kv, key_mask, logits, positions[:, -1].repeat_interleave(n)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1m", help=f"of {', '.join(SIZES)}")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--calls", type=int, default=100, help="decode steps per round and side")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--python-wrapper", action="store_true", help="inductor's Python wrapper instead of C++")
    args = parser.parse_args(argv)
    import torch
    import torch._inductor.config as inductor_config

    fast, kv, key_mask, logits, last = prefilled(args.size, Path(tempfile.mkdtemp()), args.threads)
    tokens, positions = logits.argmax(-1), last + 1
    with torch.inference_mode():
        inputs = static_inputs(fast, kv, key_mask, positions)
        expected = fast.decode(tokens, positions, kv, key_mask)
        eager_logits = static_step(fast, tokens, *inputs)
    inductor_config.cpp_wrapper = not args.python_wrapper
    compiled = torch.compile(static_step, dynamic=False, fullgraph=True)
    cs, keys, values, bias, col = inputs
    keys, values = [k.clone() for k in keys], [v.clone() for v in values]  # normal tensors: traceable
    cs, bias = cs.clone(), bias.clone()
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        compiled_logits = compiled(fast, tokens, cs, keys, values, bias, col)
    compile_s, compile_cpu_s = time.perf_counter() - start, time.process_time() - cpu

    def block(run, grad_mode) -> float:
        with grad_mode():
            start = time.perf_counter()
            for _ in range(args.calls):
                run()
            return (time.perf_counter() - start) / args.calls * 1e6
    eager_run = lambda: static_step(fast, tokens, *inputs)  # noqa: E731
    compiled_run = lambda: compiled(fast, tokens, cs, keys, values, bias, col)  # noqa: E731
    block(eager_run, torch.inference_mode)
    block(compiled_run, torch.no_grad)
    times = {"compiled": [], "eager": []}
    for r in range(args.rounds):
        for side in (("compiled", "eager") if r % 2 == 0 else ("eager", "compiled")):
            times[side].append(block(compiled_run, torch.no_grad) if side == "compiled"
                               else block(eager_run, torch.inference_mode))
    print(json.dumps({
        "size": args.size, "rounds": args.rounds, "calls": args.calls, "threads": torch.get_num_threads(),
        "wrapper": "python" if args.python_wrapper else "cpp", "rows": int(tokens.shape[0]),
        "capacity": int(key_mask.shape[1]), "compile_s": round(compile_s, 2), "compile_cpu_s": round(compile_cpu_s, 2),
        "eager_us": round(statistics.median(times["eager"]), 1),
        "compiled_us": round(statistics.median(times["compiled"]), 1),
        "ratio": ratio_summary(times["compiled"], times["eager"], None),
        "max_abs_diff_vs_decode": float((eager_logits - expected).abs().max()),
        "max_abs_diff_compiled": float((compiled_logits - eager_logits).abs().max()),
        "environment": environment()}))


if __name__ == "__main__":
    main()
