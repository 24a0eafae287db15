"""Shared fixtures: a tiny model and tokenizer built locally (no hub), fast on CPU."""

from __future__ import annotations

import pytest
import torch

from tamer.models import TinyModelConfig, build_char_tokenizer, build_tiny_model

TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


@pytest.fixture(autouse=True)
def _few_threads():
    torch.set_num_threads(1)  # tests run many tiny ops: threading only adds overhead


@pytest.fixture
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def tiny_model(tokenizer):
    return build_tiny_model(tokenizer, TINY)
