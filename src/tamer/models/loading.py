"""Models and tokenizers: load any local Hugging Face causal LM, or build a tiny one.

Two ways in, one object out (a `transformers` causal LM plus its tokenizer):

    model, tokenizer = load_model("path/to/local/hf-model")      # any local HF directory
    tokenizer = build_char_tokenizer()                            # no hub needed
    model = build_tiny_model(tokenizer, TinyModelConfig())       # Qwen2/Llama-style, few layers

Trained models are saved with `save_model` (plain `save_pretrained`) and load back in
`transformers` with `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`.
Nothing here touches the network: loading passes `local_files_only=True`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
)
from transformers.utils import logging as hf_logging

from tamer.config import ConfigError, FieldError, check_name
from tamer.modeldir import check_model_dir, model_dir_errors
from tamer.models.lora import LoraConfig, base_dir_of, is_lora, is_lora_dir, merge_adapter_dir, save_lora_model
from tamer.storage import atomic_directory

# Special tokens of the built-in tokenizer; the chat markers follow the ChatML convention
# that Qwen models use, so prompts look the same on a tiny model and on a real one.
PAD, BOS, EOS, UNK = "<|pad|>", "<|bos|>", "<|im_end|>", "<|unk|>"
IM_START = "<|im_start|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, IM_START)
# Markup that agents emit; one token each keeps tiny models' sequences short.
MARKUP_TOKENS = (
    "<answer>", "</answer>", "<think>", "</think>",
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
)

CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n' }}{%- endif %}"
    "{{- 'Tools:' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of a tiny model built from a config (no weights downloaded)."""

    arch: str = "qwen2"  # "qwen2" or "llama"
    hidden_size: int = 128  # width of the residual stream
    num_layers: int = 4  # decoder layers
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention when < num_heads)
    intermediate_size: int = 512  # width of the gated MLP
    max_position_embeddings: int = 1024  # longest sequence (prompt + completion)
    tie_word_embeddings: bool = True  # the output head shares the embedding matrix
    vocab_size: int = 0  # rows of the embedding; 0: the tokenizer's size (more: a real model's shape, rows unused)
    rope_theta: float = 10000.0  # RoPE base frequency
    rms_norm_eps: float = 1e-6  # epsilon of the RMSNorms
    seed: int = 0  # random initialisation

    def __post_init__(self) -> None:
        check_name("arch", self.arch, ("qwen2", "llama"), "architecture")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"expected >= 1, got {getattr(self, name)}")
        if self.vocab_size < 0:
            raise FieldError("vocab_size", f"expected >= 0 (0: the tokenizer's size), got {self.vocab_size}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise FieldError("rope_theta" if self.rope_theta <= 0 else "rms_norm_eps", "expected > 0")
        if self.hidden_size % self.num_heads:
            raise FieldError("hidden_size", f"{self.hidden_size} is not divisible by num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise FieldError("num_heads", f"{self.num_heads} is not divisible by num_kv_heads ({self.num_kv_heads})")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZERS = ("char", "bpe")


@dataclass(frozen=True)
class ModelConfig:
    """The policy: a local Hugging Face model directory, or a tiny model built from a config."""

    path: str = ""  # local HF model directory; empty builds `tiny` (random init)
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)  # the tiny model's shape
    dtype: str = field(  # float32 | bfloat16 | float16: the weights' dtype
        default="float32")  # (docs/models.md: bf16 weights vs rl.precision)
    gradient_checkpointing: bool = False  # recompute each layer's activations in backward: less memory, same gradients
    threads: int = 0  # torch CPU threads; 0 keeps torch's default
    tokenizer: str = "char"  # tiny models: "char" (one token per byte) or "bpe" (trained on the task's text)
    bpe_vocab_size: int = 1024  # vocabulary of the "bpe" tokenizer
    bpe_split: str = "qwen2"  # its pre-tokenizer: "qwen2" (words, punctuation) or "digits" (only digits split off)
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters (r > 0) instead of full fine-tuning

    def __post_init__(self) -> None:
        check_name("dtype", self.dtype, DTYPES, "dtype")
        check_name("tokenizer", self.tokenizer, TOKENIZERS, "tokenizer")
        check_name("bpe_split", self.bpe_split, BPE_SPLITS, "BPE split")
        if self.threads < 0:
            raise FieldError("threads", f"expected >= 0 (0: torch's default), got {self.threads}")
        if self.bpe_vocab_size < 300:
            raise FieldError("bpe_vocab_size",
                             f"expected >= 300 (the byte alphabet and specials), got {self.bpe_vocab_size}")


def build_char_tokenizer(extra_tokens: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """A character-level tokenizer built locally with `tokenizers`, with a ChatML template.

    It is a byte-level BPE with no merges: every byte is one token, as in GPT-2/Qwen
    tokenizers before merges, so any text encodes and `AutoTokenizer` loads it back as
    the same tokenizer. Chat markers and agent markup (`<answer>`, `<tool_call>`, ...)
    are single tokens.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START]})
    tokenizer.add_tokens(list(MARKUP_TOKENS) + list(extra_tokens))
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


# The pre-tokenizer of Qwen2-family tokenizers: a BPE trained behind it reloads through
# `AutoTokenizer` (as Qwen2Tokenizer) into exactly the same tokenizer.
# Qwen2's pre-tokenizer split. (A variant in which words never take the character before them,
# so that "Trip PRG>ATH" and a tool call's "PRG" tokenize alike, measured worse: the 1M trip
# model trained with it never learned to copy the city names at all.)
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# "digits": only digits are split off (one token each); merges may cross words, punctuation and
# spaces, so a templated tool call's fixed text (`","arguments":{"`) can become one token.
BPE_SPLITS = {"qwen2": QWEN2_PRETOKENIZE_REGEX, "digits": r"\p{N}|[^\p{N}]+"}


def build_bpe_tokenizer(corpus: Iterable[str], vocab_size: int = 1024, split: str = "qwen2") -> PreTrainedTokenizerFast:
    """A byte-level BPE trained locally on `corpus`, with the same specials and template as
    `build_char_tokenizer`.

    For tasks whose text is long and regular (tool calls, JSON tool results) it shortens
    sequences several times over the character tokenizer. Digits stay one token each.
    `split` is the pre-tokenizer (`BPE_SPLITS`): "qwen2" (Qwen2's word/punctuation split) or
    "digits" (only digits split off: shorter sequences for templated text).
    """
    check_name("split", split, BPE_SPLITS, "BPE split")
    backend = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(BPE_SPLITS[split]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    specials = list(SPECIAL_TOKENS) + list(MARKUP_TOKENS)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(_without(corpus, specials), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START]})
    tokenizer.add_tokens(list(MARKUP_TOKENS))
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def _without(corpus: Iterable[str], tokens: list[str]) -> Iterator[str]:
    """Corpus texts with the single-token markers removed (they never take part in merges)."""
    for text in corpus:
        for token in tokens:
            text = text.replace(token, " ")
        yield text


def build_tiny_model(tokenizer: PreTrainedTokenizerBase, config: TinyModelConfig) -> PreTrainedModel:
    """A randomly initialised Qwen2- or Llama-style causal LM sized for CPU experiments."""
    if 0 < config.vocab_size < len(tokenizer):
        raise ConfigError(f"model.tiny.vocab_size: {config.vocab_size} is smaller than the tokenizer's "
                          f"{len(tokenizer)} tokens")
    common = dict(
        vocab_size=config.vocab_size or len(tokenizer),
        rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    hf_config = Qwen2Config(**common) if config.arch == "qwen2" else LlamaConfig(**common)
    with torch.random.fork_rng():
        torch.manual_seed(config.seed)
        model = AutoModelForCausalLM.from_config(hf_config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """Silence transformers' own progress bars: all console output goes through the Tracker."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a local model directory, as saved.

    transformers 5 maps some model types (qwen2 among them) to their family's tokenizer class
    whatever tokenizer_config.json declares, and that class rebuilds the family's pre-tokenizer. A
    directory that declares the generic class (what `save_model` writes for the tokenizers tamer
    builds, e.g. a BPE with `split="digits"`) loads as exactly its tokenizer.json instead."""
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    config_file = Path(path) / "tokenizer_config.json"
    if type(tokenizer) is not PreTrainedTokenizerFast and config_file.is_file() \
            and json.loads(config_file.read_text()).get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return tokenizer


def load_model(
    path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a local Hugging Face model directory.

    A LoRA directory (`tamer.models.lora`: adapter + tokenizer, base beside it or named) loads
    as its base with the adapter merged: a plain model equal to the one that was trained."""
    if not is_lora_dir(path):
        path = check_model_dir(path)  # ModelDirError naming what is missing, before transformers tries
    with model_dir_errors(path), quiet_progress():
        tokenizer = load_tokenizer(path)
        model = load_causal_lm(path, dtype)
    if tokenizer.pad_token_id is None:  # many base models ship without one
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model.to(device), tokenizer


def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The weights of a model directory, a LoRA one merged into its base (followed recursively)."""
    if is_lora_dir(path):
        return merge_adapter_dir(load_causal_lm(base_dir_of(path), dtype), path)
    with model_dir_errors(path), quiet_progress():
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path) -> Path:
    """Save model and tokenizer so that plain `transformers` can load them back.

    Atomic: written into a hidden sibling and renamed into place, so `path` is never a half
    model (a full disk raises StorageError and leaves any earlier save untouched)."""
    path = Path(path)
    with atomic_directory(path, "the model") as tmp, quiet_progress():
        if is_lora(model):  # the adapter (tamer.models.lora); its base beside it or named
            save_lora_model(model, tokenizer, Path(tmp))
        else:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    return path


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """Number of (unique) parameters; tied embeddings count once."""
    params = {id(p): p for p in model.parameters() if p.requires_grad or not trainable_only}
    return sum(p.numel() for p in params.values())


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """Token ids that end an assistant turn: EOS and, when present, ChatML's <|im_end|>."""
    ids = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids(EOS)
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return tuple(sorted(i for i in ids if i is not None))


def encode_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, str]] | tuple[dict[str, str], ...],
    *,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of a chat prompt through the tokenizer's chat template."""
    text = tokenizer.apply_chat_template(
        list(messages), tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]
