"""vLLM tier: `VLLMEngine` on this CPU against HFEngine and the learner (run in .venv-vllm: `make test-vllm`).

Skipped where vLLM is not importable (tamer's default environment), unless TAMER_REQUIRE_VLLM=1
(set by `make test-vllm`), where a missing vLLM is an error. The model is a tiny Qwen2 with
head_dim 32: vLLM's CPU attention supports head sizes 32, 64, 80, ... only.
"""

from __future__ import annotations

import copy
import os
import random
import time

import pytest
import torch

from tamer.models import TinyModelConfig, build_char_tokenizer, build_tiny_model, encode_chat, stop_token_ids
from tamer.models.logprobs import token_logprobs
from tamer.rollout.agent import AgentConfig, AgentRollout
from tamer.rollout.engine import HFEngine, _top_p_filter
from tamer.rollout.runner import Rollout
from tamer.rollout.types import SamplingParams
from tamer.rollout.vllm import VLLMConfig, VLLMEngineError, WeightSyncError
from tamer.tasks import ArithmeticTasks, CalculatorTasks
from tamer.trainers.batch import collate

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except ImportError:
    if os.environ.get("TAMER_REQUIRE_VLLM") == "1":
        raise
    HAVE_VLLM = False

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not HAVE_VLLM, reason="vLLM not installed (make test-vllm)")]

SMALL = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)  # head_dim 32
PARITY = 1e-5  # max |logprob gap| in float32


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def policy(tok):
    return build_tiny_model(tok, SMALL)


@pytest.fixture(scope="module")
def engine(policy, tok, tmp_path_factory):
    from tamer.rollout.vllm import VLLMEngine

    eng = VLLMEngine(policy, tok, VLLMConfig(), work_dir=tmp_path_factory.mktemp("colocated"))
    yield eng
    eng.close()


def _prompts(tok, n=6):
    return [encode_chat(tok, [{"role": "user", "content": f"{10 + 7 * i}+{31 + i}"}]) for i in range(n)]


def _gap(model, trajectories, pad_id, temperature) -> float:
    """Max |sampler - learner| logprob over the trained tokens of `trajectories` (the learner's own path)."""
    batch = collate(trajectories, torch.zeros(len(trajectories)), pad_id)
    with torch.no_grad():
        learner = token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=temperature)
    mask = batch.loss_mask.bool()
    return float((learner[mask] - batch.old_logprobs[mask]).abs().max())


def _perturb(model, scale=0.05, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)


# ------------------------------------------------------------------------------------- parity
def test_greedy_tokens_and_logprobs_equal_hf_engine(engine, policy, tok):
    engine.sync_weights(policy)
    prompts = _prompts(tok)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=16, stop_token_ids=stop_token_ids(tok))
    ours = engine.generate(prompts, params)
    ref = HFEngine(policy, tok.pad_token_id).generate(prompts, params)
    for group, ref_group in zip(ours, ref):
        assert len(group) == 2 and group[0].token_ids == group[1].token_ids  # greedy copies
        assert group[0].token_ids == ref_group[0].token_ids
        assert group[0].finish_reason == ref_group[0].finish_reason
        gap = (torch.tensor(group[0].logprobs) - torch.tensor(ref_group[0].logprobs)).abs().max()
        assert gap < PARITY


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_the_learners(engine, policy, tok, temperature):
    engine.sync_weights(policy)
    tasks = ArithmeticTasks().split()[1][:6]
    params = SamplingParams(n=4, temperature=temperature, max_new_tokens=16, stop_token_ids=stop_token_ids(tok), seed=3)
    trajectories = Rollout(engine, tok).run(tasks, params)
    assert len(trajectories) == 24 and [t.group_id for t in trajectories] == [j for j in range(6) for _ in range(4)]
    assert len({tuple(t.completion_ids) for t in trajectories}) > 12  # n samples, not n copies
    assert all(t.weight_version == engine.weight_version for t in trajectories)
    gap = _gap(policy, trajectories, tok.pad_token_id, temperature)
    print(f"sampled-token logprob gap vs learner at T={temperature}: {gap:.2e}")
    assert gap < PARITY
    again = Rollout(engine, tok).run(tasks, params)  # same seed, same samples
    assert [t.completion_ids for t in again] == [t.completion_ids for t in trajectories]


def test_top_p_logprobs_are_the_filtered_distribution(engine, policy, tok):
    """Under top-p, the sampler's logprob is log p renormalised over the nucleus (as HFEngine samples)."""
    engine.sync_weights(policy)
    prompt = _prompts(tok, 1)[0]
    out = engine.generate([prompt], SamplingParams(n=4, temperature=0.8, top_p=0.5, max_new_tokens=12, seed=1))[0]
    for o in out:
        ids = torch.tensor([prompt + o.token_ids])
        with torch.no_grad():
            logits = policy(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        filtered = _top_p_filter(torch.log_softmax(logits / 0.8, -1), 0.5)
        expected = filtered.gather(-1, torch.tensor(o.token_ids)[:, None]).squeeze(-1)
        assert torch.isfinite(expected).all()  # every sampled token lies inside the nucleus
        assert (torch.tensor(o.logprobs) - expected).abs().max() < 1e-4


def test_stop_token_included_and_ends_the_sequence(engine, policy, tok):
    engine.sync_weights(policy)
    stops = tuple(range(5, 140))  # half the vocabulary: most samples stop within a few tokens
    out = engine.generate(_prompts(tok, 4), SamplingParams(n=4, temperature=1.0, max_new_tokens=10,
                                                           stop_token_ids=stops, seed=2))
    reasons = set()
    for o in (o for group in out for o in group):
        reasons.add(o.finish_reason)
        assert not any(t in stops for t in o.token_ids[:-1])
        if o.finish_reason == "stop":
            assert o.token_ids[-1] in stops
        else:
            assert len(o.token_ids) == 10 and o.token_ids[-1] not in stops
    assert "stop" in reasons


def test_seeded_batch_larger_than_one_prefill_step(engine, policy, tok):
    """12 prompts of 400 tokens (more than vLLM's default 2048-token step): seeded sampling still works."""
    engine.sync_weights(policy)
    prompts = [[5 + (i * 7 + j) % 200 for j in range(400)] for i in range(12)]
    out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=9))
    assert [len(group) for group in out] == [2] * 12


# ------------------------------------------------------------------------------------- weight sync
def test_inprocess_sync_follows_perturbed_weights_with_tied_embeddings(engine, policy, tok):
    assert policy.config.tie_word_embeddings and policy.lm_head.weight is policy.model.embed_tokens.weight
    engine.sync_weights(policy)
    version = engine.weight_version
    tasks = ArithmeticTasks().split()[1][:4]
    params = SamplingParams(n=2, temperature=0.7, max_new_tokens=12, stop_token_ids=stop_token_ids(tok), seed=4)
    _perturb(policy)
    stale = Rollout(engine, tok).run(tasks, params)  # sampled before the sync: old weights
    assert _gap(policy, stale, tok.pad_token_id, 0.7) > 1e-2  # the perturbation is visible
    start = time.perf_counter()
    engine.sync_weights(policy)
    print(f"in-process sync: {time.perf_counter() - start:.3f} s (probe gap {engine.stats['probe_gap']:.1e})")
    assert engine.weight_version == version + 1
    fresh = Rollout(engine, tok).run(tasks, params)
    assert all(t.weight_version == version + 1 for t in fresh)
    assert _gap(policy, fresh, tok.pad_token_id, 0.7) < PARITY
    engine.sync_weights(policy)  # nothing written since: no new version
    assert engine.weight_version == version + 1


def test_engine_reports_the_version_that_sampled(engine, policy, tok):
    """vLLM's own record of the weights behind each token equals tamer's version."""
    engine.sync_weights(policy)
    sampling = [engine._sampling(SamplingParams(max_new_tokens=4), i, 20, 1) for i in range(2)]
    samples = engine.backend.generate(_prompts(tok, 2), sampling, 60.0)
    assert all(s.versions == {str(engine.weight_version)} for group in samples for s in group)


def _memorize(model, tok, trajectory, steps=150):
    """Fit `model` to one episode's policy tokens (a few seconds): it then plays that episode itself."""
    ids = torch.tensor([trajectory.prompt_ids + trajectory.completion_ids])
    mask = torch.tensor([[0] * len(trajectory.prompt_ids) + trajectory.loss_mask], dtype=torch.bool)[:, 1:]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[mask], ids[:, 1:][mask])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return float(loss)


def test_calculator_episode_trains_on_exactly_the_sampled_tokens(engine, policy, tok):
    """Multi-turn through vLLM (prefix cache on): tool outputs masked, generated spans = vLLM's samples."""
    source = CalculatorTasks()
    task = source.split()[1][0]
    config = AgentConfig(max_turns=6, max_total_tokens=700, show_tools=False)
    demo = AgentRollout(None, tok, config).replay(task, source.demonstrate_turns(task, random.Random(0)))
    agent_model = copy.deepcopy(policy)
    assert _memorize(agent_model, tok, demo) < 0.05
    engine.sync_weights(agent_model)
    captured = []
    original = engine.generate

    def spy(prompts, params):
        outputs = original(prompts, params)
        captured.extend(o.token_ids for group in outputs for o in group)
        return outputs

    engine.generate = spy
    try:
        trajectories = AgentRollout(engine, tok, config).run([task], SamplingParams(
            n=4, temperature=0.7, max_new_tokens=120, stop_token_ids=stop_token_ids(tok), seed=0))
    finally:
        del engine.generate
    multi = [t for t in trajectories if sum(bool(turn.tool_results) for turn in t.turns) >= 1 and len(t.turns) >= 2]
    assert multi, "no episode called the calculator"
    for t in trajectories:
        spans, current = [], []
        for token, m in zip(t.completion_ids + [None], t.loss_mask + [0]):
            if m:
                current.append(token)
            elif current:
                spans.append(current)
                current = []
        assert all(span in captured for span in spans) and len(spans) == len(t.turns)
        masked = tok.decode([x for x, m in zip(t.completion_ids, t.loss_mask) if not m])
        assert masked.count("<|im_start|>tool") == sum(bool(turn.tool_results) for turn in t.turns)
        assert "<tool_response>" in masked or len(t.turns) == 1
    assert _gap(agent_model, trajectories, tok.pad_token_id, 0.7) < PARITY  # later turns came from the prefix cache


def test_disk_sync_untied_then_a_failed_sync_stops_the_engine(tok, tmp_path):
    from tamer.rollout.vllm import VLLMEngine

    model = build_tiny_model(tok, TinyModelConfig(**{**SMALL.__dict__, "tie_word_embeddings": False, "seed": 1}))
    with VLLMEngine(model, tok, VLLMConfig(sync="disk", sync_dir=str(tmp_path)), work_dir=tmp_path / "w") as eng:
        _perturb(model, seed=1)
        start = time.perf_counter()
        eng.sync_weights(model)
        print(f"disk sync: {time.perf_counter() - start:.3f} s")
        tasks = ArithmeticTasks().split()[1][:4]
        params = SamplingParams(n=2, temperature=0.7, max_new_tokens=12, stop_token_ids=stop_token_ids(tok), seed=4)
        assert _gap(model, Rollout(eng, tok).run(tasks, params), tok.pad_token_id, 0.7) < PARITY
        wrong = build_tiny_model(tok, TinyModelConfig(**{**SMALL.__dict__, "intermediate_size": 96}))
        with pytest.raises(WeightSyncError, match="weight sync to version 2 failed") as err:
            eng.sync_weights(wrong)
        assert "\n" not in str(err.value)
        with pytest.raises(VLLMEngineError, match="engine stopped"):
            eng.generate(_prompts(tok, 1), params)


def test_lora_policy_samples_from_the_merged_weights(tok, tmp_path):
    """A LoRA policy on vLLM: started from and synced with the adapter merged; sampled logprobs
    equal the learner's (peft forward) before and after an adapter update. (Its own engine: after
    the shared `engine` fixture's tests, since closing an in-process engine resets vLLM's globals.)"""
    from tamer.models.lora import LoraConfig, adapter_parameters, apply_lora
    from tamer.rollout.vllm import VLLMEngine

    model = apply_lora(build_tiny_model(tok, SMALL), LoraConfig(r=4, alpha=8.0))
    with torch.no_grad():
        for p in adapter_parameters(model):
            p.normal_(0, 0.05)
    tasks = ArithmeticTasks().split()[1][:4]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, stop_token_ids=stop_token_ids(tok), seed=5)
    with VLLMEngine(model, tok, VLLMConfig(), work_dir=tmp_path) as engine:
        assert _gap(model, Rollout(engine, tok).run(tasks, params), tok.pad_token_id, 1.0) < PARITY
        with torch.no_grad():
            for p in adapter_parameters(model):
                p.add_(torch.randn_like(p) * 0.05)
        engine.sync_weights(model)
        assert _gap(model, Rollout(engine, tok).run(tasks, params), tok.pad_token_id, 1.0) < PARITY


def test_unsupported_head_size_fails_before_start_in_one_line(tok):
    from tamer.rollout.vllm import VLLMEngine

    model = build_tiny_model(tok, TinyModelConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                                  intermediate_size=64))  # head_dim 8
    start = time.perf_counter()
    with pytest.raises(VLLMEngineError, match="head size 8") as err:
        VLLMEngine(model, tok, VLLMConfig())
    assert "\n" not in str(err.value) and time.perf_counter() - start < 30


# ------------------------------------------------------------------------------------- server mode
def test_real_server_parity_sync_and_a_second_client(tok, tmp_path):
    """tamer starts `vllm.entrypoints.openai.api_server` on 127.0.0.1; a second engine then addresses it by URL."""
    from tamer.rollout.vllm import VLLMEngine

    model = build_tiny_model(tok, TinyModelConfig(**{**SMALL.__dict__, "seed": 2}))
    config = VLLMConfig(mode="server", sync_dir=str(tmp_path / "sync"), startup_timeout_s=900, request_timeout_s=300)
    with VLLMEngine(model, tok, config, work_dir=tmp_path / "w") as eng:
        proc = eng.backend.proc
        assert proc.poll() is None and eng.backend.url.startswith("http://127.0.0.1:")
        prompts = _prompts(tok, 4)
        greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=12, stop_token_ids=stop_token_ids(tok))
        ref = HFEngine(model, tok.pad_token_id).generate(prompts, greedy)
        assert [g[0].token_ids for g in eng.generate(prompts, greedy)] == [g[0].token_ids for g in ref]
        tasks = ArithmeticTasks().split()[1][:4]
        params = SamplingParams(n=3, temperature=0.7, max_new_tokens=12, stop_token_ids=stop_token_ids(tok), seed=4)
        gap = _gap(model, Rollout(eng, tok).run(tasks, params), tok.pad_token_id, 0.7)
        print(f"server: sampled-token logprob gap {gap:.2e}")
        assert gap < PARITY
        _perturb(model, seed=2)
        start = time.perf_counter()
        eng.sync_weights(model)  # disk: safetensors to a directory, /collective_rpc reload_weights
        print(f"server disk sync: {time.perf_counter() - start:.3f} s")
        assert eng.weight_version == 1 and eng.backend.version() == "1"
        assert _gap(model, Rollout(eng, tok).run(tasks, params), tok.pad_token_id, 0.7) < PARITY
        other = build_tiny_model(tok, TinyModelConfig(**{**SMALL.__dict__, "seed": 3}))
        user = VLLMConfig(mode="server", url=eng.backend.url, sync_dir=str(tmp_path / "sync2"), request_timeout_s=300)
        with VLLMEngine(other, tok, user) as second:  # pushes its own weights first
            assert second.backend.proc is None and second.stats["probe_gap"] < PARITY
            assert _gap(other, Rollout(second, tok).run(tasks, params), tok.pad_token_id, 0.7) < PARITY
        with pytest.raises(WeightSyncError, match="stale weights"):  # the first engine notices
            eng.generate(prompts, params)
    assert proc.poll() is not None  # closing the engine stopped the server it started


# ------------------------------------------------------------------------------------- GRPO through vLLM
class _Log:
    def __init__(self):
        self.records = {}

    def log(self, metrics, step):
        self.records.setdefault(step, {}).update(metrics)

    def print(self, message):
        pass


def test_grpo_on_arithmetic_through_vllm_raises_heldout_accuracy(tmp_path):
    """The arithmetic demo's SFT, then GRPO with every rollout and evaluation sampled by vLLM."""
    from tamer.evaluate import EvalConfig
    from tamer.rewards import RewardComposer, RewardConfig
    from tamer.rollout.vllm import VLLMEngine
    from tamer.trainers.common import OptimConfig, seed_everything
    from tamer.trainers.rl import RLConfig, RLTrainer
    from tamer.trainers.sft import SFTConfig, SFTTrainer, demonstrations

    seed_everything(0)  # one torch thread (conftest): two spin against each other on a shared machine
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, TinyModelConfig())  # the demo's 1M model, head_dim 32
    source = ArithmeticTasks()
    train, heldout = source.split()
    sft = SFTConfig(steps=500, batch_size=32, optim=OptimConfig(lr=1e-3, warmup_steps=50, schedule="cosine"))
    SFTTrainer(model, tok, demonstrations(source, train, tok), sft).train()
    config = RLConfig(steps=20, prompts_per_step=16, group_size=8, max_new_tokens=32, optim=OptimConfig(lr=1e-4),
                      eval_every=10)
    log = _Log()
    with VLLMEngine(model, tok, VLLMConfig(), work_dir=tmp_path / "vllm") as engine:
        trainer = RLTrainer(model, tok, train, heldout, RewardComposer(RewardConfig()), config,
                            EvalConfig(size=200, max_new_tokens=32), run_dir=tmp_path / "rl", tracker=log,
                            engine=engine)
        collect = trainer.collect

        def checked_collect(step):  # every trajectory was sampled by the weights of this step
            trajectories, metrics = collect(step)
            assert {t.weight_version for t in trajectories} == {engine.weight_version}
            return trajectories, metrics

        trainer.collect = checked_collect
        final = trainer.train()
        syncs = engine.stats["syncs"]
    before, after = log.records[0]["eval/accuracy"], final["eval/accuracy"]
    print(f"GRPO through vLLM: held-out accuracy {before:.3f} -> {after:.3f}, {syncs} syncs")
    assert after >= before + 0.1
    assert syncs >= config.steps  # one per update (+ none skipped wrongly)
    gaps = [log.records[s]["train/sampler_logprob_gap"] for s in range(1, config.steps + 1)]
    assert max(gaps) < 1e-4  # vLLM sampled exactly the learner's distribution at every step
