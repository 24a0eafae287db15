"""Models: load any local Hugging Face causal LM or build a tiny one, and run its forward.

    model, tokenizer = load_model("path/to/local/hf-model")      # any local HF directory
    tokenizer = build_char_tokenizer()                            # no hub needed
    model = build_tiny_model(tokenizer, TinyModelConfig())       # Qwen2/Llama-style, few layers
    logprobs = token_logprobs(model, input_ids, attention_mask)  # the learner's forward

Modules: `loading` (tokenizers, tiny models, load/save), `fast_forward` (the lean Llama/Qwen2
forward the sampler and the learner share), `logprobs` (the learner's per-token logprobs),
`precision` (fp32/bf16 autocast, thread counts, the KV-cache keyword), `lora` (peft adapters,
the adapter-free reference, LoRA model directories).
"""

from tamer.models.loading import (
    BOS,
    CHATML_TEMPLATE,
    DTYPES,
    EOS,
    IM_START,
    MARKUP_TOKENS,
    PAD,
    SPECIAL_TOKENS,
    UNK,
    ModelConfig,
    TinyModelConfig,
    build_bpe_tokenizer,
    build_char_tokenizer,
    build_tiny_model,
    count_parameters,
    encode_chat,
    load_causal_lm,
    load_model,
    load_tokenizer,
    quiet_progress,
    save_model,
    stop_token_ids,
)
from tamer.models.logprobs import shared_prefix_logprobs, token_logprobs
from tamer.models.lora import (
    AdapterFreeView,
    LoraConfig,
    LoraError,
    adapter_parameters,
    apply_lora,
    fold_adapter,
    is_lora,
    is_lora_dir,
)
from tamer.models.precision import PRECISIONS, autocast, cache_keyword, intra_op_threads

__all__ = [
    "AdapterFreeView", "LoraConfig", "LoraError", "adapter_parameters", "apply_lora", "fold_adapter", "is_lora",
    "is_lora_dir", "load_causal_lm",
    "BOS", "CHATML_TEMPLATE", "DTYPES", "EOS", "ModelConfig", "IM_START", "MARKUP_TOKENS", "PAD", "PRECISIONS",
    "SPECIAL_TOKENS", "UNK",
    "TinyModelConfig", "autocast", "build_bpe_tokenizer", "build_char_tokenizer", "build_tiny_model",
    "cache_keyword", "count_parameters", "encode_chat", "intra_op_threads", "load_model", "load_tokenizer",
    "quiet_progress", "save_model", "shared_prefix_logprobs", "stop_token_ids", "token_logprobs",
]
