"""Engine tier: sampling, logprobs, shared-prefix generation and the learner's token masks."""

import pytest
import torch

from tamer.models import encode_chat, stop_token_ids, token_logprobs
from tamer.rollout.engine import HFEngine, _left_pad
from tamer.rollout.runner import Rollout
from tamer.rollout.types import SamplingParams
from tamer.tasks import ArithmeticTasks
from tamer.trainers.batch import collate, micro_batches


def _prompts(tokenizer, n=4):
    return [encode_chat(tokenizer, [{"role": "user", "content": f"{10 + 7 * i}+{31 + i}"}]) for i in range(n)]


def test_greedy_matches_hf_generate(tokenizer, tiny_model):
    prompts = _prompts(tokenizer)
    out = HFEngine(tiny_model, tokenizer.pad_token_id).generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=8))
    ids, mask = _left_pad(prompts, tokenizer.pad_token_id)
    ref = tiny_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                              eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    assert [o[0].token_ids for o in out] == ref[:, ids.shape[1]:].tolist()


def test_sampling_logprobs_equal_learner_logprobs(tokenizer, tiny_model):
    """π_old from the sampler == log-softmax(logits / τ) recomputed by the learner, token by token."""
    params = SamplingParams(n=3, temperature=0.7, max_new_tokens=10, stop_token_ids=stop_token_ids(tokenizer), seed=5)
    rollout = Rollout(HFEngine(tiny_model, tokenizer.pad_token_id), tokenizer)
    tasks = ArithmeticTasks().split()[1][:4]
    trajs = rollout.run(tasks, params)
    batch = collate(trajs, torch.zeros(len(trajs)), tokenizer.pad_token_id)
    with torch.no_grad():
        learner = token_logprobs(tiny_model, batch.input_ids, batch.attention_mask, temperature=0.7)
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(learner[mask], batch.old_logprobs[mask], atol=1e-4, rtol=1e-4)


def test_shared_prefix_equals_repeated_prompts(tokenizer, tiny_model):
    """Prefill once + cache copy for n samples gives the same tokens as n separate prompt copies."""
    engine = HFEngine(tiny_model, tokenizer.pad_token_id)
    prompts = _prompts(tokenizer, 2)
    shared = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=11))
    repeated = engine.generate([p for p in prompts for _ in range(4)],
                               SamplingParams(n=1, temperature=1.0, max_new_tokens=12, seed=11))
    flat_shared = [o for group in shared for o in group]
    flat_repeated = [group[0] for group in repeated]
    assert [o.token_ids for o in flat_shared] == [o.token_ids for o in flat_repeated]
    for a, b in zip(flat_shared, flat_repeated):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5)


def test_stop_tokens_end_each_sequence(tokenizer, tiny_model):
    # Make the model always emit EOS by biasing its output layer, then check stopping.
    with torch.no_grad():
        tiny_model.lm_head.weight.zero_()
        tiny_model.lm_head.weight[tokenizer.eos_token_id] = 1.0
        tiny_model.model.norm.weight.fill_(10.0)
    out = HFEngine(tiny_model, tokenizer.pad_token_id).generate(
        _prompts(tokenizer, 2), SamplingParams(n=2, temperature=0.0, max_new_tokens=9,
                                               stop_token_ids=(tokenizer.eos_token_id,)))
    for group in out:
        for o in group:
            assert o.token_ids == [tokenizer.eos_token_id] and o.finish_reason == "stop"


def test_length_finish_reason(tokenizer, tiny_model):
    out = HFEngine(tiny_model, tokenizer.pad_token_id).generate(
        _prompts(tokenizer, 1), SamplingParams(temperature=0.0, max_new_tokens=5))
    assert len(out[0][0].token_ids) == 5 and out[0][0].finish_reason == "length"


def test_collate_masks_prompt_and_padding(tokenizer, tiny_model):
    rollout = Rollout(HFEngine(tiny_model, tokenizer.pad_token_id), tokenizer)
    tasks = ArithmeticTasks().split()[1][:3]
    trajs = rollout.run(tasks, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=1))
    batch = collate(trajs, torch.arange(len(trajs), dtype=torch.float32), tokenizer.pad_token_id)
    for row, t in enumerate(trajs):
        p, c = len(t.prompt_ids), len(t.completion_ids)
        assert batch.loss_mask[row, :p].sum() == 0  # prompt
        assert batch.loss_mask[row, p:p + c].tolist() == [1.0] * c  # generated
        assert batch.loss_mask[row, p + c:].sum() == 0  # padding
        assert batch.input_ids[row, p:p + c].tolist() == t.completion_ids  # trained tokens == sampled tokens
        assert batch.attention_mask[row].sum() == p + c


def test_micro_batches_respect_token_budget_and_keep_rows(tokenizer, tiny_model):
    rollout = Rollout(HFEngine(tiny_model, tokenizer.pad_token_id), tokenizer)
    trajs = rollout.run(ArithmeticTasks().split()[1][:6],
                        SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=2))
    batch = collate(trajs, torch.zeros(len(trajs)), tokenizer.pad_token_id)
    micro = micro_batches(batch, max_tokens=100)
    assert sum(len(m) for m in micro) == len(batch)
    assert sum(m.num_tokens for m in micro) == batch.num_tokens
    assert all(m.input_ids.numel() <= 100 or len(m) == 1 for m in micro)


def test_inverse_cdf_sampler_matches_the_distribution():
    """The sampler's one-uniform-per-row draw: right frequencies, never a zero-probability token."""
    from tamer.rollout.engine import _inverse_cdf_sample
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(1, 40, generator=generator) * 2, -1)
    probs[0, ::3] = 0.0
    tokens = _inverse_cdf_sample(probs.repeat(200_000, 1), generator)
    freq = torch.bincount(tokens, minlength=40).float() / len(tokens)
    assert freq[::3].sum() == 0
    torch.testing.assert_close(freq, probs[0] / probs[0].sum(), atol=3e-3, rtol=0)


def test_decode_threads_change_nothing_but_speed(tokenizer, tiny_model):
    """A one-thread decode samples the same tokens, and the process's thread count comes back."""
    before = torch.get_num_threads()
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=7)
    plain = HFEngine(tiny_model, tokenizer.pad_token_id).generate(_prompts(tokenizer, 2), params)
    seen = []
    engine = HFEngine(tiny_model, tokenizer.pad_token_id, threads=1)
    original = engine._decode

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return original(*args, **kwargs)
    engine._decode = spy
    single = engine.generate(_prompts(tokenizer, 2), params)
    assert seen == [1] and torch.get_num_threads() == before
    for a, b in zip([o for g in plain for o in g], [o for g in single for o in g]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5)


def test_negative_decode_threads_are_refused(tokenizer, tiny_model):
    with pytest.raises(ValueError, match="threads"):
        HFEngine(tiny_model, tokenizer.pad_token_id, threads=-1)
