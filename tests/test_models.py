"""Models tier: the local tokenizer, the tiny-model factory, save/load through plain transformers."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tamer.models import (
    TinyModelConfig,
    build_char_tokenizer,
    build_tiny_model,
    count_parameters,
    encode_chat,
    load_model,
    save_model,
    stop_token_ids,
)


def test_tokenizer_roundtrip_and_single_token_markup(tokenizer):
    text = "<think>7+8=15 4+3+1=8</think><answer>85</answer> héllo\n\tend"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_ids_to_tokens(tokenizer("<answer>", add_special_tokens=False)["input_ids"]) == ["<answer>"]


def test_chat_template_renders_chatml(tokenizer):
    ids = encode_chat(tokenizer, [{"role": "user", "content": "12+34"}])
    assert tokenizer.decode(ids) == "<|im_start|>user\n12+34<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token_id in stop_token_ids(tokenizer)


def test_chat_template_lists_tools_in_system_turn(tokenizer):
    tools = [{"type": "function", "function": {"name": "calc", "description": "d", "parameters": {}}}]
    text = tokenizer.decode(encode_chat(tokenizer, [{"role": "user", "content": "hi"}], tools=tools))
    assert text.startswith("<|im_start|>system\nTools:\n") and '"name": "calc"' in text


def test_tiny_model_is_deterministic_per_seed(tokenizer):
    a = build_tiny_model(tokenizer, TinyModelConfig(hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64,
                                                    seed=3))
    b = build_tiny_model(tokenizer, TinyModelConfig(hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64,
                                                    seed=3))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert count_parameters(a) > 0


def test_llama_arch_builds(tokenizer):
    model = build_tiny_model(tokenizer, TinyModelConfig(arch="llama", hidden_size=32, num_layers=1, num_heads=4,
                                                        intermediate_size=64))
    assert model.config.model_type == "llama"


def test_save_then_load_in_plain_transformers(tmp_path, tokenizer, tiny_model):
    save_model(tiny_model, tokenizer, tmp_path / "m")
    plain_tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    plain_model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    text = "<|im_start|>user\n12+34<|im_end|>\n<answer>46</answer>"
    assert (plain_tok(text, add_special_tokens=False)["input_ids"]
            == tokenizer(text, add_special_tokens=False)["input_ids"])
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    torch.testing.assert_close(plain_model(ids).logits, tiny_model(ids).logits)
    model, tok = load_model(tmp_path / "m")
    assert tok.chat_template == tokenizer.chat_template and tok.padding_side == "left"


def test_load_model_rejects_non_model_dir(tmp_path):
    import pytest

    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)


def test_bpe_tokenizer_shortens_and_reloads_identically(tmp_path):
    from tamer.models import build_bpe_tokenizer

    corpus = [f'<tool_call>{{"name":"search_flights","arguments":{{"origin":"LON","dest":"ROM{i}"}}}}</tool_call>'
              for i in range(200)]
    bpe = build_bpe_tokenizer(corpus, vocab_size=400)
    char = build_char_tokenizer()
    text = corpus[7] + "<|im_end|>"
    ids = bpe(text, add_special_tokens=False)["input_ids"]
    assert bpe.decode(ids) == text
    assert len(ids) * 3 < len(char(text, add_special_tokens=False)["input_ids"])
    model = build_tiny_model(bpe, TinyModelConfig(hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64))
    save_model(model, bpe, tmp_path / "m")
    assert AutoTokenizer.from_pretrained(tmp_path / "m")(text, add_special_tokens=False)["input_ids"] == ids


def test_bpe_digits_split_merges_template_text_keeps_digits_and_reloads(tmp_path):
    """`split="digits"`: the fixed text of a tool call merges across words and punctuation, digits
    stay one token each, decoding is exact, and the saved tokenizer reloads the same."""
    import pytest

    from tamer.config import FieldError
    from tamer.models import ModelConfig, build_bpe_tokenizer

    corpus = [f'<tool_call>{{"name":"book","arguments":{{"flight":"F{i % 7}","hotel":"H{i % 5}"}}}}</tool_call>'
              f'<tool_response>{{"price":{100 + 13 * i}}}</tool_response>' for i in range(300)]
    words = build_bpe_tokenizer(corpus, vocab_size=400)
    digits = build_bpe_tokenizer(corpus, vocab_size=400, split="digits")
    text = corpus[7]
    ids = digits(text, add_special_tokens=False)["input_ids"]
    assert digits.decode(ids) == text
    assert len(ids) < len(words(text, add_special_tokens=False)["input_ids"])
    pieces = [digits.decode([i]) for i in ids]
    assert '","hotel":"H' in pieces  # one token spans punctuation, a word and punctuation
    assert not any('","' in p and any(c.isalpha() for c in p) for p in
                   (words.decode([i]) for i in words(text, add_special_tokens=False)["input_ids"]))
    assert [p for p in pieces if any(c.isdigit() for c in p)] == ["0", "2", "1", "9", "1"]  # F0, H2, price 191
    save_model(build_tiny_model(digits, TinyModelConfig(hidden_size=32, num_layers=1, num_heads=4,
                                                        intermediate_size=64)), digits, tmp_path / "m")
    _, loaded = load_model(tmp_path / "m")  # transformers alone maps a qwen2 dir to Qwen2's own split
    assert loaded(text, add_special_tokens=False)["input_ids"] == ids
    assert loaded.decode(ids) == text and loaded.chat_template == digits.chat_template
    with pytest.raises(FieldError, match="bpe_split"):
        ModelConfig(tokenizer="bpe", bpe_split="words")
