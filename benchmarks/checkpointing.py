"""Activation memory of the learner's forward with and without `model.gradient_checkpointing`.

    .venv/bin/python benchmarks/checkpointing.py [--size 20m] [--rows 16] [--tokens 256]

Counts the bytes autograd keeps for backward during one `token_logprobs` forward (the distinct
storages a `saved_tensors_hooks` tally sees, parameters included: exact and machine-independent,
unlike RSS), and the wall time of
forward + backward, for a tiny-model shape from benchmarks/vs_trl.py. Prints one JSON object
per setting; seconds are a median of `--repeats` interleaved runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tamer.models import TinyModelConfig, build_char_tokenizer, build_tiny_model, token_logprobs

SIZES = {
    "1m": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512),
    "20m": dict(hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4, intermediate_size=1664),
}


def step(model, ids, mask) -> tuple[int, float]:
    """(bytes saved for backward, seconds) of one forward + backward."""
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t
    model.zero_grad()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs = token_logprobs(model, ids, mask)
    (logprobs * mask).sum().backward()
    return sum(storages.values()), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="20m", choices=sorted(SIZES))
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokenizer = build_char_tokenizer()
    models = {}
    for checkpointing in (False, True):
        model = build_tiny_model(tokenizer, TinyModelConfig(**SIZES[args.size])).train()
        if checkpointing:
            model.activation_checkpointing_enable()
        models[checkpointing] = model
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(tokenizer), (args.rows, args.tokens), generator=generator)
    mask = torch.ones_like(ids)
    results = {False: [], True: []}
    for _ in range(args.repeats):  # interleaved, so both settings see the same machine load
        for checkpointing, model in models.items():
            results[checkpointing].append(step(model, ids, mask))
    for checkpointing, runs in results.items():
        seconds = [s for _, s in runs]
        print(json.dumps({"size": args.size, "rows": args.rows, "tokens": args.tokens,
                          "gradient_checkpointing": checkpointing, "saved_mb": round(runs[0][0] / 2**20, 1),
                          "seconds_median": round(statistics.median(seconds), 3),
                          "seconds_range": [round(min(seconds), 3), round(max(seconds), 3)]}))


if __name__ == "__main__":
    main()
