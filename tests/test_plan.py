"""The memory plan: parameter counts, the estimate's arithmetic by hand, the activation formula
against autograd's own count, what fits, the CLI; and (slow) the 1M case against measured RSS."""

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from tamer.cli import app
from tamer.config import load_config
from tamer.models import (
    LoraConfig,
    TinyModelConfig,
    apply_lora,
    build_char_tokenizer,
    build_tiny_model,
    count_parameters,
    save_model,
    token_logprobs,
)
from tamer.pipeline import RunConfig
from tamer.plan import (
    MB,
    Setup,
    Shape,
    estimate,
    learner_activations_mb,
    plan_run,
    shape_from_hf,
    shape_of,
    what_fits,
)

SMALL = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


@pytest.mark.parametrize("arch, tied", [("qwen2", True), ("llama", False)])
def test_parameter_counts_match_the_built_model(arch, tied):
    config = load_config(RunConfig, [], [f"model.tiny.{k}={v}" for k, v in SMALL.items()]
                         + [f"model.tiny.arch={arch}", f"model.tiny.tie_word_embeddings={tied}"])
    model = build_tiny_model(build_char_tokenizer(), config.model.tiny)
    shape = shape_of(config)
    assert shape.parameters() == count_parameters(model)
    lora = apply_lora(model, LoraConfig(r=4))
    assert shape.lora_parameters(4, LoraConfig().target_modules) == count_parameters(lora, trainable_only=True)


@pytest.mark.parametrize("overrides, kept", [([], True), (["rl.ppo_epochs=2", "rl.recompute_old_logprobs=true"], False),
                                             (["rl.precision=bf16"], False),
                                             (["rl.reuse_sampler_activations=false"], False),
                                             (["task.name=trip_planner"], False)])
def test_the_plan_counts_the_sampler_record_when_the_learner_reuses_it(overrides, kept):
    """On-policy fp32 single-turn runs keep the sampler's outputs for the learner; μ > 1, bf16, the switch off
    and agent tasks (multi-turn episodes) do not."""
    config = load_config(RunConfig, [], [f"model.tiny.{k}={v}" for k, v in SMALL.items()] + overrides)
    _, setup, plan = plan_run(config)
    assert setup.replay is kept and ("sampler_activations" in plan.components) is kept


def test_qwen2_5_0_5b_shape_has_its_published_parameter_count():
    config = load_config(RunConfig, ["src/tamer/configs/qwen2.5-0.5b-shape.yaml"], [])
    shape = shape_of(config)
    assert shape.parameters() == 494_032_768  # Qwen2.5-0.5B: 0.49B, tied embeddings
    assert shape.lora_parameters(16, LoraConfig().target_modules) == 8_798_208


def test_estimate_by_hand():
    shape = Shape(vocab=100, hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16)
    # per layer: q 64, k 32, v 32, o 64, gate 128, up 128, down 128 = 576, norms 16 -> 592; embed 800, final norm 8
    assert shape.parameters() == 800 + 2 * 592 + 8
    setup = Setup(prompts=2, group_size=2, prompt_tokens=3, completion_tokens=5, micro_batch_tokens=16,
                  generation_batch=4, reference=True, runtime_mb=100.0)
    plan = estimate(shape, setup)
    p = 1992
    fused = 2 * (64 + 32 + 32 + 128 + 128)  # the sampler's QKV and gate/up copies, 2 layers
    assert plan.components == {"runtime": 100.0, "weights": p * 4 / MB, "reference": p * 4 / MB,
                               "sampler_weights": fused * 4 / MB, "gradients": p * 4 / MB,
                               "optimizer": 2 * p * 4 / MB, "retained_gradients": p * 4 / MB}
    gpu = estimate(shape, Setup(**{**setup.__dict__, "cpu_allocator": False}))
    assert "retained_gradients" not in gpu.components
    # learner: 16 // 8 = 2 rows of one group: 1 prompt (3 tokens) + 2 completions (5) = 13 tokens;
    # per layer 6h + 3kv + 4i = 48 + 12 + 64 = 124 floats (the lean forward's norms keep x̂ only); prompt KV
    # copies 2 layers * 2 rows * 3 * 2 * 4; logits 10 tokens * (V + 2h) saved, and 3 * 10 * V in the backward
    # of logsumexp, all float32
    saved = (13 * 2 * 124 + 2 * 2 * 3 * 2 * 4) * 4 + 10 * (100 + 16) * 4
    assert math.isclose(plan.learner_mb, (saved + 3 * 10 * 100 * 4) / MB)
    # sampler: 4 rows, 8 tokens, keys and values of width 4 in 2 layers, float32; logits 3 * 4 * V
    assert math.isclose(plan.sampler_mb, (2 * 4 * 8 * 2 * 4 * 4 + 3 * 4 * 100 * 4) / MB)
    assert plan.peak_mb == plan.resident_mb + plan.learner_mb and plan.phase == "learner"
    # the sampler's projection outputs kept for the learner: 4 rows x 5 tokens x (2 layers x (q/k/v 8 + 4 + 4,
    # o 8, gate/up 32, down 8) + V 100) float32
    replay = estimate(shape, Setup(**{**setup.__dict__, "replay": True}))
    assert replay.components["sampler_activations"] == 4 * 5 * (2 * (16 + 8 + 32 + 8) + 100) * 4 / MB
    lora = estimate(shape, Setup(**{**setup.__dict__, "lora_r": 2}))
    adapter = 2 * 2 * (16 + 12 + 12 + 16 + 24 + 24 + 24)  # r * (in + out) per projection, 2 layers
    assert lora.components["reference"] == 0 and "sampler_weights" not in lora.components
    assert lora.trainable == adapter
    assert lora.components["gradients"] == adapter * 4 / MB and lora.components["weights"] == (p + adapter) * 4 / MB


def _saved_bytes(model, ids):
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(model, ids, torch.ones_like(ids))
    return sum(storages.values())


def test_sampler_snapshot_by_hand():
    """fp32: fused QKV and gate/up copies; bf16 autocast on fp32 weights: bf16 copies of every projection
    and of the head; bf16 weights: the fused copies in bf16."""
    shape = Shape(vocab=1000, hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=1024)
    setup = Setup(prompts=1, group_size=2, prompt_tokens=3, completion_tokens=5, generation_batch=2, runtime_mb=0.0)
    fused = 256 * 512 + 256 * 2048  # QKV (q 256 + k 128 + v 128 wide), gate/up
    assert math.isclose(estimate(shape, setup).components["sampler_weights"], 2 * fused * 4 / MB)
    bf16 = estimate(shape, Setup(**{**setup.__dict__, "autocast_bf16": True}))
    per_layer = 65536 + 2 * 32768 + 65536 + 3 * 262144  # q, k, v, o, gate, up, down
    assert math.isclose(bf16.components["sampler_weights"], (2 * per_layer + 256000) * 2 / MB)
    half = estimate(shape, Setup(**{**setup.__dict__, "weight_bytes": 2, "autocast_bf16": True}))
    assert math.isclose(half.components["sampler_weights"], 2 * fused * 2 / MB)


@pytest.mark.parametrize("lora", [0, 8])
@pytest.mark.parametrize("size", [dict(hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=2,
                                       intermediate_size=512),
                                  dict(hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2,
                                       intermediate_size=768, vocab_size=2000)])
def test_activation_formula_matches_what_autograd_saves(size, lora):
    tokenizer = build_char_tokenizer()
    config = TinyModelConfig(**size)
    model = build_tiny_model(tokenizer, config).train()
    if lora:
        model = apply_lora(model, LoraConfig(r=lora)).train()
    rows, tokens = 4, 48
    ids = torch.randint(0, len(tokenizer), (rows, tokens), generator=torch.Generator().manual_seed(0))
    shape = Shape(vocab=config.vocab_size or len(tokenizer), hidden=config.hidden_size, layers=config.num_layers,
                  heads=config.num_heads, kv_heads=config.num_kv_heads, head_dim=config.hidden_size // config.num_heads,
                  intermediate=config.intermediate_size)
    setup = Setup(prompts=1, group_size=rows, prompt_tokens=0, completion_tokens=tokens,
                  micro_batch_tokens=rows * tokens, share_prompt_prefix=False, lora_r=lora)
    backward = 3 * rows * tokens * shape.vocab * 4  # the estimate's logsumexp backward (not saved tensors)
    formula = learner_activations_mb(shape, setup) * MB - backward
    assert abs(formula - _saved_bytes(model, ids)) / _saved_bytes(model, ids) < 0.1


def test_what_fits_suggests_changes_that_fit():
    shape = Shape(vocab=151936, hidden=896, layers=24, heads=14, kv_heads=2, head_dim=64, intermediate=4864)
    setup = Setup(prompts=4, group_size=4, prompt_tokens=64, completion_tokens=128, micro_batch_tokens=1024,
                  reference=True)
    options = {o["option"].split(" (")[0]: o for o in what_fits(shape, setup, memory_gb=8)}
    assert not options["as configured"]["fits"]  # 0.5B full fine-tuning with a reference copy: > 8 GB
    assert options["LoRA r=16"]["fits"] and options["LoRA r=16"]["overrides"] == {"model.lora.r": 16}
    assert options["LoRA r=16"]["peak_mb"] < options["as configured"]["peak_mb"] - 6000


def test_shape_from_a_model_directory_and_its_lora_directory(tmp_path):
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, TinyModelConfig(**SMALL))
    save_model(model, tokenizer, tmp_path / "base")
    shape = shape_from_hf(tmp_path / "base")
    assert shape.parameters() == count_parameters(model) and shape.qkv_bias
    lora = apply_lora(model, LoraConfig(r=2), base_source=tmp_path / "base")
    save_model(lora, tokenizer, tmp_path / "lora")
    config = load_config(RunConfig, [], [f"model.path={tmp_path / 'lora'}"])
    assert shape_of(config) == shape


def test_cli_plan_json_and_table():
    result = CliRunner().invoke(app, ["plan", "--memory-gb", "0.5", "--prompt-tokens", "30", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["estimate"]["peak_mb"] > 480 and data["memory_gb"] == 0.5
    assert data["options"][0]["option"] == "as configured"
    result = CliRunner().invoke(app, ["plan", "-c", "qwen2.5-0.5b-shape", "--memory-gb", "16"])
    assert result.exit_code == 0, result.output
    assert "494,032,768" in result.output and "fits" in result.output


@pytest.mark.slow
def test_the_1m_estimate_is_within_20_percent_of_measured_peak_rss(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    from memory_plan import measure

    # One run's peak RSS moves by up to ~20% around the estimate (703-887 MB for the same code,
    # docs/memory_plan.md: standalone runs 703-793, inside the slow suite in CI 811-887; cause not found).
    results = sorted((measure("1m", steps=2, threads=1, output_dir=str(tmp_path / str(i))) for i in range(3)),
                     key=lambda r: r["measured_peak_rss_mb"])
    median = results[1]
    assert abs(median["error_pct"]) < 20, [(r["measured_peak_rss_mb"], r["rss_parts_at_end_mb"]) for r in results]
