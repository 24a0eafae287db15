"""The speed paths give the same numbers as the plain ones: in-place KV decode, shared-prompt
learner forward, on-policy old logprobs, bf16 autocast; and vs_trl.py's tamer side runs."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tamer.models import autocast, encode_chat, shared_prefix_logprobs, stop_token_ids, token_logprobs
from tamer.rewards import REWARDS, RewardComposer, RewardConfig
from tamer.rollout.engine import HFEngine, _left_pad, sample_tokens
from tamer.rollout.runner import Rollout
from tamer.rollout.types import SamplingParams
from tamer.tasks import ArithmeticTasks
from tamer.trainers.batch import collate, micro_batches
from tamer.trainers.common import OptimConfig
from tamer.trainers.rl import RLConfig, RLTrainer

ROOT = Path(__file__).resolve().parents[1]


def _prompts(tokenizer, n):
    return [encode_chat(tokenizer, [{"role": "user", "content": f"{10 + 7 * i}+{31 + 3 * i}"}]) for i in range(n)]


@torch.no_grad()
def _plain_sampling(model, prompt, params, generator):
    """The slowest correct sampler: full forward of the whole sequence for every token, no cache."""
    ids, lps = list(prompt), []
    for _ in range(params.max_new_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[:, -1]
        token, lp = sample_tokens(logits, params, generator)
        ids.append(int(token))
        lps.append(float(lp))
    return ids[len(prompt):], lps


def test_in_place_cache_decode_samples_like_plain_loop(tokenizer, tiny_model):
    """Same seed, same tokens: the engine's prefill-once, in-place-cache decode vs recompute-everything."""
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=16, seed=7)
    prompts = _prompts(tokenizer, 3)
    engine_out = HFEngine(tiny_model, tokenizer.pad_token_id).generate(prompts, params)
    generator = torch.Generator().manual_seed(params.seed)
    # The engine draws one token per row per step for the whole batch; replay that order.
    ids, mask = _left_pad(prompts, tokenizer.pad_token_id)
    with torch.no_grad():
        seqs, lps = ids.clone(), []
        for _ in range(params.max_new_tokens):
            am = torch.cat([mask, torch.ones(len(prompts), seqs.shape[1] - ids.shape[1], dtype=torch.long)], 1)
            logits = tiny_model(input_ids=seqs, attention_mask=am,
                                position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits[:, -1]
            token, lp = sample_tokens(logits, params, generator)
            seqs = torch.cat([seqs, token[:, None]], 1)
            lps.append(lp)
    plain_tokens = seqs[:, ids.shape[1]:].tolist()
    assert [g[0].token_ids for g in engine_out] == plain_tokens
    torch.testing.assert_close(torch.tensor([g[0].logprobs for g in engine_out]), torch.stack(lps, 1),
                               atol=1e-5, rtol=1e-5)


def test_single_prompt_matches_unbatched_plain_sampler(tokenizer, tiny_model):
    params = SamplingParams(n=1, temperature=0.8, max_new_tokens=12, seed=3)
    prompt = _prompts(tokenizer, 1)[0]
    out = HFEngine(tiny_model, tokenizer.pad_token_id).generate([prompt], params)[0][0]
    tokens, lps = _plain_sampling(tiny_model, prompt, params, torch.Generator().manual_seed(params.seed))
    assert out.token_ids == tokens
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(lps), atol=1e-5, rtol=1e-5)


def _batch(tokenizer, model, n=4, tasks=3):
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=10, stop_token_ids=stop_token_ids(tokenizer), seed=2)
    trajs = Rollout(HFEngine(model, tokenizer.pad_token_id), tokenizer).run(
        ArithmeticTasks().split()[1][:tasks], params)
    trajs[0].prompt_ids = trajs[0].prompt_ids[3:]  # a prompt of another length, alone in its prefix group
    return collate(trajs, torch.zeros(len(trajs)), tokenizer.pad_token_id)


def test_shared_prefix_logprobs_and_gradients_equal_plain(tokenizer, tiny_model):
    batch = _batch(tokenizer, tiny_model)
    assert len(set(batch.prefix_index.tolist())) == 4  # 3 groups, one row split off
    plain = token_logprobs(tiny_model, batch.input_ids, batch.attention_mask, 0.7)
    shared = shared_prefix_logprobs(tiny_model, batch.input_ids, batch.attention_mask, batch.prompt_lengths,
                                    batch.prefix_index, 0.7)
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(shared[mask], plain[mask], atol=1e-5, rtol=1e-5)
    assert (shared[~mask] == 0).all()
    params = list(tiny_model.parameters())
    g_plain = torch.autograd.grad((plain * batch.loss_mask).sum(), params)
    g_shared = torch.autograd.grad((shared * batch.loss_mask).sum(), params)
    for a, b in zip(g_plain, g_shared):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fast", [True, False])
def test_the_last_column_is_not_forwarded(tokenizer, tiny_model, monkeypatch, fast):
    """Its logits would predict past the end and no earlier position reads its keys: both learner
    forwards run one column less, equal the full forward's logprobs, and one-token rows still work."""
    from tamer.models.fast_forward import FastDecoder
    seen = []
    if fast:
        original = FastDecoder.forward
        monkeypatch.setattr(FastDecoder, "forward", lambda self, ids, *a, **kw: seen.append(ids.shape[1])
                            or original(self, ids, *a, **kw))
    else:
        original = type(tiny_model).forward
        monkeypatch.setattr(type(tiny_model), "forward", lambda self, input_ids=None, **kw: seen.append(
            input_ids.shape[1]) or original(self, input_ids=input_ids, **kw))
    batch = _batch(tokenizer, tiny_model)
    seen.clear()
    ids, mask = batch.input_ids, batch.attention_mask
    plain = token_logprobs(tiny_model, ids, mask, fast=fast)
    assert seen == [ids.shape[1] - 1]
    with torch.no_grad():
        logits = tiny_model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    full = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    valid = mask.bool()[:, 1:]
    torch.testing.assert_close(plain[:, 1:][valid], full[valid], atol=1e-5, rtol=1e-5)
    seen.clear()
    shared_prefix_logprobs(tiny_model, ids, mask, batch.prompt_lengths, batch.prefix_index, fast=fast)
    completion = int((mask.sum(-1) - batch.prompt_lengths).max())
    assert seen == [int(batch.prompt_lengths.max()), completion - 1]  # prompts, then completions but the last
    # every completion one token: only the prompts' forward runs, its last logits score the token
    width = int(batch.prompt_lengths.max())
    short = torch.where(torch.arange(ids.shape[1])[None, :] <= batch.prompt_lengths[:, None], mask, 0)
    seen.clear()
    one = shared_prefix_logprobs(tiny_model, ids, short, batch.prompt_lengths, batch.prefix_index, fast=fast)
    assert seen == [width]
    rows = torch.arange(len(ids))
    expected = token_logprobs(tiny_model, ids, short, fast=fast)[rows, batch.prompt_lengths]
    torch.testing.assert_close(one[rows, batch.prompt_lengths], expected, atol=1e-5, rtol=1e-5)
    assert token_logprobs(tiny_model, ids[:, :1], mask[:, :1], fast=fast).abs().sum() == 0


def test_token_counts_leave_out_each_micro_batchs_last_column(tokenizer, tiny_model):
    from types import SimpleNamespace
    batch = _batch(tokenizer, tiny_model)
    comp = batch.attention_mask.sum(-1) - batch.prompt_lengths
    for budget, groups in ((10**6, [list(range(len(batch)))]), (1, [[row] for row in range(len(batch))])):
        trainer = SimpleNamespace(config=SimpleNamespace(micro_batch_tokens=budget, share_prompt_prefix=True),
                                  _rows_with_gradient=lambda batch: batch)  # every row run
        counts = RLTrainer._token_counts(trainer, batch)
        # one micro-batch: every row's completion up to the longest one's last column; one row each: its last token
        expected = sum(min(int(comp[r]), int(comp[g].max()) - 1) for g in groups for r in g)
        assert counts["tokens/learner"] - counts["tokens/prefill"] == expected
        assert counts["tokens/replayed"] == 0.0 and counts["tokens/generated"] == float(batch.loss_mask.sum())


def test_micro_batches_with_rows_cover_every_row(tokenizer, tiny_model):
    batch = _batch(tokenizer, tiny_model)
    pairs = micro_batches(batch, max_tokens=64, with_rows=True)
    rows = torch.cat([r for _, r in pairs])
    assert sorted(rows.tolist()) == list(range(len(batch)))
    for micro, r in pairs:
        assert torch.equal(micro.prefix_index, batch.prefix_index[r])


if "parity" not in REWARDS:  # a reward that splits every group (an untrained model's completions all run to max length)
    REWARDS.register("parity")(lambda traj: float(sum(traj.completion_ids) % 2))


def _trainer(model, tokenizer, tmp_path, **overrides):
    cfg = RLConfig(**{"steps": 2, "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8,
                      "optim": OptimConfig(lr=1e-3), "eval_every": 0, **overrides})
    train, held = ArithmeticTasks().split()
    rewards = RewardComposer(RewardConfig(weights={"correctness": 1.0, "parity": 1.0}))
    return RLTrainer(model, tokenizer, train, held, rewards, cfg, run_dir=tmp_path)


def test_shared_prefix_step_equals_plain_step(tokenizer, tmp_path):
    """One RL step with and without the shared-prompt forward moves the weights the same way."""
    from tamer.models import build_tiny_model
    from tests.conftest import TINY
    moved = []
    for share in (True, False):
        model = build_tiny_model(tokenizer, TINY)
        metrics = _trainer(model, tokenizer, tmp_path, share_prompt_prefix=share).train_step()
        moved.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        assert not torch.equal(moved[-1],
                               torch.cat([p.flatten() for p in build_tiny_model(tokenizer, TINY).parameters()]))
        assert metrics["train/sampler_logprob_gap"] < 1e-4  # fp32: sampler and learner agree
    # Adam divides by sqrt(v): a 1e-7 gradient difference on a near-zero gradient moves ~1% of lr.
    torch.testing.assert_close(moved[0], moved[1], atol=1e-5, rtol=1e-4)


def test_bf16_step_runs_with_fp32_weights(tiny_model, tokenizer, tmp_path):
    before = [p.detach().clone() for p in tiny_model.parameters()]
    trainer = _trainer(tiny_model, tokenizer, tmp_path, precision="bf16")
    metrics = trainer.train_step()
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    assert all(p.dtype == torch.float32 for p in tiny_model.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, tiny_model.parameters()))
    assert metrics["time/generate_s"] > 0 and metrics["time/forward_backward_s"] > 0
    assert metrics["tokens/learner"] < metrics["tokens/generated"] + 8 * metrics["tokens/prefill"]


def test_bf16_autocast_logprobs_are_float32_and_close(tokenizer, tiny_model):
    batch = _batch(tokenizer, tiny_model)
    with torch.no_grad():
        fp32 = token_logprobs(tiny_model, batch.input_ids, batch.attention_mask)
        with autocast("bf16"):
            bf16 = token_logprobs(tiny_model, batch.input_ids, batch.attention_mask)
    assert bf16.dtype == torch.float32
    mask = batch.loss_mask.bool()
    assert (bf16[mask] - fp32[mask]).abs().max() < 0.1


def test_precision_is_validated():
    with pytest.raises(ValueError, match="^precision: unknown precision 'fp16'"):
        RLConfig(precision="fp16")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl not installed (pip install -e '.[bench]')")
def test_vs_trl_smoke(tmp_path):
    """Both sides of benchmarks/vs_trl.py run and print the documented keys."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vs_trl.py"), "--sizes", "1m", "--betas", "0.04",
                          "--precisions", "fp32", "--paths", "fast", "--pairs", "2", "--steps", "1", "--warmup", "1",
                          "--threads", "1"], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("model_params", "beta", "precision", "tamer_s_per_step", "trl_s_per_step", "ratio_median",
                "ratio_min", "ratio_max", "target_met", "tamer_threads", "trl_threads", "tamer_gen_tokens_per_s",
                "trl_gen_tokens_per_s", "tamer_peak_rss_mb", "trl_peak_rss_mb", "tamer_utilization_vs_1024",
                "tamer_profile_s", "trl_profile_s", "cpu_bf16_units"):
        assert key in row
    assert row["beta"] == 0.04 and row["tamer_s_per_step"] > 0 and row["pairs"] == 2
    assert row["trl_gradient_checkpointing"] is False and row["trl_use_bias_correction_kl"] is False
    assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"]
    assert row["target_met"] == (row["ratio_max"] <= row["target"])
    # The reference rate is each run's best of the four operand layouts, then the median over runs;
    # the row keeps the first run's four layouts.
    layouts = row["matmul_gflops_by_layout"][0]
    assert len(layouts) == 4 and row["matmul_gflops_1024"] > 0 and max(layouts.values()) > 0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl not installed (pip install -e '.[bench]')")
def test_vs_trl_interleaved_steps(tmp_path):
    """--interleave-steps 1: both trainers alive, their timed steps alternated; every step timed on each side."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vs_trl.py"), "--sizes", "1m", "--betas", "0",
                          "--precisions", "fp32", "--paths", "fast", "--pairs", "1", "--steps", "2", "--warmup", "1",
                          "--threads", "1", "--interleave-steps", "1"], capture_output=True, text=True, timeout=900,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["interleave_steps"] == 1 and row["pairs"] == 1 and row["steps_timed"] == 2
    assert len(row["tamer_step_seconds"][0]) == len(row["trl_step_seconds"][0]) == 3
    assert row["trl_gradient_checkpointing"] is False and row["tamer_s_per_step"] > 0 and row["trl_s_per_step"] > 0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl not installed (pip install -e '.[bench]')")
def test_vs_trl_same_batch_gives_trls_gradient(tmp_path):
    """On one rollout batch, tamer's GRPO loss has TRL's logprobs and TRL's gradient (same advantages), tamer
    reusing its sampler's projection outputs where TRL recomputes its forward."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vs_trl.py"), "--same-batch", "--threads", "2"],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert 0.0 < row["mean_reward"] < 1.0 and row["tamer_grad_norm"] > 0
    assert row["logprob_max_abs_diff"] < 1e-4
    assert row["grad_rel_diff_same_advantages"] < 1e-4
    assert row["grad_rel_diff"] < 1e-2  # only TRL's std eps (1e-4 vs 1e-6) differs
    assert row["tamer_replayed_sampler_outputs"] is True


def test_fast_forward_off_runs_the_hf_forward_everywhere(tokenizer, tiny_model, tmp_path, monkeypatch):
    """rl.fast_forward=false: the engine and the learner take the HF forward (the general path
    vs_trl --paths general measures)."""
    from tamer.models.fast_forward import FastDecoder

    def refuse(*a, **k):
        raise AssertionError("the lean forward ran with fast_forward=False")
    monkeypatch.setattr(FastDecoder, "forward", refuse)
    monkeypatch.setattr(FastDecoder, "decode", refuse)
    trainer = _trainer(tiny_model, tokenizer, tmp_path, fast_forward=False)
    assert trainer.engine.fast is None
    metrics = trainer.train_step()
    assert metrics["train/sampler_logprob_gap"] < 1e-4 and metrics["tokens/learner"] > 0
