"""The learner reusing the sampler's projection outputs (models/replay.py): same logprobs and gradients
as recomputing them, used only where valid."""

import copy

import pytest
import torch

from tamer.models import TinyModelConfig, build_tiny_model, fast_forward
from tamer.models.fast_forward import FastDecoder
from tamer.models.logprobs import shared_prefix_logprobs
from tamer.models.replay import DecodeRecord, Replay, replayed
from tamer.rollout.engine import HFEngine
from tamer.rollout.types import SamplingParams
from tamer.trainers.batch import collate
from tests.test_fast_arch import build

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]


def test_replayed_linear_by_hand():
    """Forward returns the known value as given (here deliberately not x Wᵀ + b); backward is the linear
    layer's: dx = g W, dW = gᵀ x, db = Σ g (rows summed), nothing for the known value."""
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0]], requires_grad=True)
    w = torch.tensor([[1.0, 0.0], [2.0, 1.0], [0.0, -1.0]], requires_grad=True)
    b = torch.tensor([0.5, 0.0, 1.0], requires_grad=True)
    known = torch.full((2, 3), 7.0)
    y = replayed.apply(x, w, b, known)
    assert torch.equal(y, known)
    g = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, -1.0]])
    y.backward(g)
    # dx row 0 = 1*[1,0] + 0*[2,1] + 2*[0,-1] = [1,-2]; row 1 = [2,1] - [0,-1] = [2,2]
    assert x.grad.tolist() == [[1.0, -2.0], [2.0, 2.0]]
    # dW[j] = sum_r g[r, j] x[r]: j=0: [1,2]; j=1: [3,-1]; j=2: 2*[1,2] - [3,-1] = [-1,5]
    assert w.grad.tolist() == [[1.0, 2.0], [3.0, -1.0], [-1.0, 5.0]]
    assert b.grad.tolist() == [1.0, 1.0, 1.0]
    assert known.grad is None


def _tiny(tokenizer, arch):
    return build_tiny_model(tokenizer, TinyModelConfig(arch=arch, hidden_size=64, num_layers=2, num_heads=4,
                                                       num_kv_heads=2, intermediate_size=128,
                                                       tie_word_embeddings=arch == "qwen2"))


def _sampled_batch(model, pad_id, n=3, max_new=6):
    """Sample with the activations kept; rows = prompt + completion, the second row cut short (its later
    recorded columns must not matter)."""
    engine = HFEngine(model, pad_id)
    outs = [o for group in engine.generate(PROMPTS, SamplingParams(n=n, max_new_tokens=max_new, seed=3,
                                                                   keep_activations=True)) for o in group]
    assert all(o.activations is not None for o in outs)
    completions = [o.token_ids for o in outs]
    completions[1] = completions[1][:2]
    rows = [PROMPTS[i // n] + c for i, c in enumerate(completions)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    plen = torch.tensor([len(PROMPTS[i // n]) for i in range(len(rows))])
    return ids, mask, plen, torch.arange(len(rows)) // n, Replay.of([o.activations for o in outs])


def _logprobs_and_grads(model, ids, mask, plen, index, replay):
    model.zero_grad(set_to_none=True)
    lp = shared_prefix_logprobs(model, ids, mask, plen, index, 1.0, replay=replay)
    weights = torch.linspace(-1.0, 1.0, lp.numel()).view(lp.shape)
    (lp * weights).sum().backward()
    return lp.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch,shuffled,pack", [("qwen2", False, None), ("qwen2", True, None), ("llama", True, None),
                                                ("qwen3", False, None), ("gemma2", True, None),
                                                ("qwen2", False, "onednn"), ("llama", True, "mkl")])
def test_replayed_forward_equals_the_recomputed_one(tokenizer, arch, shuffled, pack, monkeypatch):
    """Logprobs and every parameter's gradient with the sampler's projection outputs equal those of the
    learner's own forward (float rounding): qwen2 with biases and a tied head, llama, Qwen3's q/k
    norms, Gemma2's sandwich norms, soft-capping and sliding window; rows in the record's order (read
    in place) or shuffled (run in the record's order, returned in the caller's); decode on weights
    packed for oneDNN or MKL (`pack`: every weight; the record is then written row-major)."""
    if pack:
        if not getattr(fast_forward, f"{pack.upper()}_PACKED_AVAILABLE"):
            pytest.skip(f"torch built without {pack}")
        monkeypatch.setattr(fast_forward, "MKL_PACKED", pack == "mkl")
        monkeypatch.setattr(fast_forward, "ONEDNN_PACKED", pack == "onednn")
        monkeypatch.setattr(fast_forward, "PACK_MIN_WEIGHTS", 0)
    model = _tiny(tokenizer, arch) if arch in ("qwen2", "llama") else build(arch)
    pad = tokenizer.pad_token_id if arch in ("qwen2", "llama") else 0
    ids, mask, plen, index, replay = _sampled_batch(model, pad)
    if pack:
        assert all(not record.gu_transposed for record in replay.records)  # the packed path ran
    if shuffled:
        perm = torch.tensor([4, 1, 5, 0, 3, 2])
        ids, mask, plen, index, replay = ids[perm], mask[perm], plen[perm], index[perm], replay[perm]
    gathered = []
    original = Replay.gather
    monkeypatch.setattr(Replay, "gather", lambda self, width: gathered.append(width) or original(self, width))
    model.train()
    lp_replay, grads_replay = _logprobs_and_grads(model, ids, mask, plen, index, replay)
    # the replay was used, for the completion columns forwarded: all but the last (its logits predict past the end)
    assert gathered == [int((mask.sum(-1) - plen).max()) - 1]
    lp, grads = _logprobs_and_grads(model, ids, mask, plen, index, None)
    assert len(gathered) == 1
    torch.testing.assert_close(lp_replay, lp, atol=2e-5, rtol=1e-5)
    assert grads_replay.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_replay[name], grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_replay_is_ignored_where_it_does_not_apply(tokenizer):
    """Another model (even with equal weights), bf16 autocast, the wrong row count, last-only logits:
    the projections are computed."""
    model = _tiny(tokenizer, "qwen2")
    ids, mask, plen, index, replay = _sampled_batch(model, tokenizer.pad_token_id)
    completion = ids[:, :4]
    fast = FastDecoder.for_model(model)
    assert fast.replay_applies(replay, completion)
    assert not FastDecoder.for_model(copy.deepcopy(model)).replay_applies(replay, completion)
    assert not fast.replay_applies(replay[[0, 1]], completion)
    assert not fast.replay_applies(replay, ids[:, :7])  # more columns than the record has
    assert not fast.replay_applies(replay, completion, last_only=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fast.replay_applies(replay, completion)


def test_no_record_where_it_cannot_be_reused(tokenizer):
    """Only when asked, and only the lean float32 decode keeps activations."""
    model = _tiny(tokenizer, "qwen2")
    params = SamplingParams(n=2, max_new_tokens=4, keep_activations=True)
    for engine in (HFEngine(model, tokenizer.pad_token_id, fast=False),
                   HFEngine(model, tokenizer.pad_token_id, precision="bf16")):
        assert all(o.activations is None for group in engine.generate(PROMPTS, params) for o in group)
    asked = HFEngine(model, tokenizer.pad_token_id).generate(PROMPTS, SamplingParams(n=2, max_new_tokens=4))
    assert all(o.activations is None for group in asked for o in group)


def test_record_layout_and_row_selection(tokenizer):
    """Column k holds the k-th fed token's outputs (k < decode steps), later columns zero; rows from two
    records select and gather in batch order, as `Batch.select` composes them."""
    model = _tiny(tokenizer, "llama")
    engine = HFEngine(model, tokenizer.pad_token_id)
    params = SamplingParams(n=2, max_new_tokens=5, seed=1, keep_activations=True)
    first = [o for g in engine.generate(PROMPTS, params) for o in g]
    second = [o for g in engine.generate(PROMPTS[:1], params) for o in g]
    record = first[0].activations[0]
    assert record.step == 4 and record.logits.shape[:2] == (5, 4)  # 5 tokens sampled, 4 fed back; 4 rows
    assert record.logits[4].abs().sum() == 0 and record.logits[:4].abs().min() > 0
    # the head's logits of the fed token k are the sampling distribution of token k + 1
    lp = torch.log_softmax(record.logits[0, 0], -1)[first[0].token_ids[1]]
    assert abs(float(lp) - first[0].logprobs[1]) < 1e-5

    class Traj:  # what collate reads
        def __init__(self, out, prompt):
            self.prompt_ids, self.completion_ids, self.activations = prompt, out.token_ids, out.activations
            self.loss_mask, self.logprobs = [1] * len(out.token_ids), out.logprobs
            self.group_id, self.reward, self.turns = 0, 0.0, []

    trajs = [Traj(o, PROMPTS[0]) for o in second] + [Traj(o, PROMPTS[i // 2]) for i, o in enumerate(first)]
    batch = collate(trajs, torch.zeros(len(trajs)), tokenizer.pad_token_id, turns=False)
    assert len(batch.replay.records) == 2
    picked = batch.select([3, 0, 5]).replay  # first's row 1, second's row 0, first's row 3
    layers, logits = picked.gather(3)
    want = [(record, 1), (second[0].activations[0], 0), (record, 3)]
    for row, (rec, r) in enumerate(want):
        assert torch.equal(logits[row], rec.logits[:3, r])
        assert torch.equal(layers[1]["gu"][row], rec.rows(1, "gu", 3, None)[r])
    assert record.gu_transposed == ({0, 1} if fast_forward.MLP_TRANSPOSED else set())  # W_gu @ h.T, in its slot
    assert DecodeRecord.nbytes(FastDecoder.for_model(model), 4, 5) == record.logits.numel() * 4 + sum(
        b.numel() * 4 for layer in record.layers for b in layer.values())


def test_trainer_reuses_activations_on_policy_only(tokenizer, tmp_path, monkeypatch):
    """An on-policy GRPO step takes the sampler's outputs and ends at the weights of the same step with
    the reuse off; with two passes over the batch (μ = 2) nothing is kept, the second pass's weights
    having changed."""
    from tests.test_rl import _trainer
    gathered = []
    original = Replay.gather
    monkeypatch.setattr(Replay, "gather", lambda self, width: gathered.append(width) or original(self, width))
    start = _tiny(tokenizer, "qwen2")
    weights = {}
    for reuse in (True, False):
        model = copy.deepcopy(start)
        trainer = _trainer(model, tokenizer, tmp_path / str(reuse), steps=1, reuse_sampler_activations=reuse)
        metrics = trainer.train_step()
        assert metrics["train/sampler_logprob_gap"] < 1e-5
        weights[reuse] = {name: p.detach().clone() for name, p in model.named_parameters()}
        assert len(gathered) == (1 if reuse else 0) + (0 if reuse else 1)  # one micro-batch, reuse on only
    for name, value in weights[True].items():  # Adam's first step is ~lr·sign(g): 1% of lr for gradients near eps
        torch.testing.assert_close(value, weights[False][name], atol=1e-5, rtol=0, msg=name)
        assert not torch.equal(value, start.state_dict()[name]) or "norm" in name
    gathered.clear()
    trainer = _trainer(copy.deepcopy(start), tokenizer, tmp_path / "mu2", steps=1, ppo_epochs=2,
                       recompute_old_logprobs=True)
    assert not trainer._reuses_activations(trainer.rollout)
    trainer.train_step()
    assert gathered == []


def test_memory_plan_counts_the_record(tokenizer):
    """`tamer plan`'s sampler_activations part is the record the engine allocates for a step's rows, and is
    there only when the reuse applies."""
    from tamer.plan import MB, Setup, Shape, estimate
    model = _tiny(tokenizer, "qwen2")
    shape = Shape(vocab=len(tokenizer), hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                  tied=True, qkv_bias=True)
    setup = Setup(prompts=2, group_size=3, prompt_tokens=7, completion_tokens=6, replay=True)
    engine = HFEngine(model, tokenizer.pad_token_id)
    outs = engine.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=6, keep_activations=True))
    record = outs[0][0].activations[0]
    allocated = sum(b.numel() * 4 for layer in record.layers for b in layer.values()) + record.logits.numel() * 4
    assert estimate(shape, setup).components["sampler_activations"] * MB == allocated
    assert "sampler_activations" not in estimate(shape, Setup(prompts=2, group_size=3, prompt_tokens=7,
                                                             completion_tokens=6)).components
