"""Helpers shared by several test files: a scripted engine and the lean-forward-vs-HF learner check."""

from __future__ import annotations

import torch

from tamer.models import shared_prefix_logprobs, token_logprobs
from tamer.models.fast_forward import FastDecoder
from tamer.rollout.types import GenerationOutput


class ScriptedEngine:
    """A stand-in engine that 'samples' given assistant texts, one per turn, for every prompt."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.calls = tokenizer, list(turns), 0

    def sync_weights(self, model):
        pass

    def generate(self, prompts, params):
        text = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return [[GenerationOutput(ids, [-0.5] * len(ids), "stop") for _ in range(params.n)] for _ in prompts]


def hf_only(monkeypatch):
    """Send every model through the HF forward from here on (the lean forward declines all)."""
    monkeypatch.setattr(FastDecoder, "for_model", classmethod(lambda cls, model: None))


def assert_learner_matches_hf(model, ids, mask, plen, index, monkeypatch, valid):
    """token_logprobs and shared_prefix_logprobs give HF's logprobs (at `valid`) and gradients."""

    def run():
        out = []
        for fn in (lambda: token_logprobs(model, ids, mask, 0.7),
                   lambda: shared_prefix_logprobs(model, ids, mask, plen, index, 0.7)):
            model.zero_grad()
            lp = fn()
            (lp * mask).sum().backward()
            out.append((lp.detach(), [p.grad.clone() for p in model.parameters()]))
        return out

    fast = run()
    hf_only(monkeypatch)
    hf = run()
    for (lp_a, grads_a), (lp_b, grads_b) in zip(fast, hf):
        torch.testing.assert_close(lp_a[valid], lp_b[valid], atol=1e-5, rtol=1e-5)
        for ga, gb in zip(grads_a, grads_b):
            torch.testing.assert_close(ga, gb, atol=1e-5, rtol=1e-4)
