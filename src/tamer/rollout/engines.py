"""Pick the generation engine by name: `hf` (tamer's own decode loop) or `vllm`.

    engine = make_engine(config.rl.engine, model, tokenizer, vllm=config.vllm,
                         precision=config.rl.precision, threads=config.rl.rollout_threads)

The caller owns the engine: `close()` a vLLM engine when the run ends (HFEngine has nothing to close).
"""

from __future__ import annotations

import contextlib

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tamer.rollout.engine import GenerationEngine, HFEngine
from tamer.rollout.vllm.config import VLLMConfig

ENGINES = ("hf", "vllm")


def make_engine(name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *,
                vllm: VLLMConfig | None = None, precision: str = "fp32", threads: int = 0,
                work_dir: str | None = None) -> GenerationEngine:
    """The engine `name` sampling from `model` (`vllm` starts vLLM now and checks the model)."""
    if name == "hf":
        return HFEngine(model, tokenizer.pad_token_id, precision=precision, threads=threads)
    if name == "vllm":
        from tamer.rollout.vllm.engine import VLLMEngine

        return VLLMEngine(model, tokenizer, vllm or VLLMConfig(), work_dir=work_dir)
    raise ValueError(f"rl.engine: expected one of {', '.join(ENGINES)}, got {name!r}")


def close_engine(engine: GenerationEngine) -> None:
    """Release what an engine holds (a vLLM engine, a server tamer started); no-op for HFEngine."""
    close = getattr(engine, "close", None)
    if callable(close):
        close()


@contextlib.contextmanager
def rl_engine(name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, vllm: VLLMConfig | None = None):
    """For RLTrainer's `engine=`: None for `hf` (the trainer builds its own), else a started engine, closed on exit."""
    if name == "hf":
        yield None
        return
    engine = make_engine(name, model, tokenizer, vllm=vllm)
    try:
        yield engine
    finally:
        close_engine(engine)
