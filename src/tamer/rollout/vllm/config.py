"""The `vllm:` section of a run config: where the engine runs and how it receives weights.

Importable without vLLM installed (configs are checked before any engine starts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MODES = ("colocated", "server")
SYNC_STRATEGIES = ("auto", "inprocess", "disk", "nccl", "ipc")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class VLLMConfig:
    """How `VLLMEngine` runs vLLM (used when `rl.engine` is `vllm`)."""

    # colocated: an in-process `vllm.LLM` beside the learner. server: an OpenAI-compatible vLLM
    # server, the one at `url` or, when `url` is empty, one tamer starts on 127.0.0.1.
    mode: str = "colocated"
    url: str = ""  # server mode: base URL of a running vLLM server (started with VLLM_SERVER_DEV_MODE=1)
    port: int = 0  # server mode, tamer-started server: the port; 0 picks a free one
    # auto: the learner's dtype. The logprob parity figures hold for float32 on both sides.
    dtype: str = "auto"
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    kv_cache_gib: int = 1  # CPU: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE)
    gpu_memory_utilization: float = 0.3  # GPU: share of device memory vLLM may take (colocated: leave room)
    enforce_eager: bool = True  # False: CUDA graphs / torch.compile (faster decode, much slower start)
    prefix_caching: bool = True  # multi-turn episodes reuse the KV of earlier turns
    # How weights reach the engine after each learner update. auto: inprocess (colocated) or
    # disk (server). nccl and ipc use vLLM's GPU weight-transfer engines.
    sync: str = "auto"
    sync_dir: str = ""  # disk sync: where weights are written; empty: /dev/shm when present, else a temp dir
    sync_timeout_s: float = 300.0  # one weight sync, end to end; past it the run stops
    request_timeout_s: float = 600.0  # one generate call (all its requests)
    startup_timeout_s: float = 900.0  # engine or server start
    # After every sync, sample a short probe and compare its logprobs with the learner's
    # forward: stale or corrupt weights stop the run instead of training on them.
    verify_sync: bool = True
    verify_tolerance: float = 0.0  # max |logprob gap| on the probe; 0: 1e-3 in float32, 0.1 otherwise
    max_concurrent_requests: int = 64  # server mode: requests in flight at once
    seed: int = 0
    extra_args: dict[str, Any] = field(default_factory=dict)  # more `vllm.LLM` kwargs / server flags

    def __post_init__(self) -> None:
        checks = (("mode", self.mode, MODES), ("sync", self.sync, SYNC_STRATEGIES), ("dtype", self.dtype, DTYPES))
        for name, value, valid in checks:
            if value not in valid:
                raise ValueError(f"vllm.{name}: expected one of {', '.join(valid)}, got {value!r}")
        if self.mode == "colocated" and self.url:
            raise ValueError("vllm.url: only used with vllm.mode=server")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"vllm.url: expected http://host:port, got {self.url!r}")
        if self.sync == "inprocess" and self.mode != "colocated":
            raise ValueError("vllm.sync: inprocess needs vllm.mode=colocated (a server is another process)")
        if self.sync in ("nccl", "ipc") and self.mode != "server":
            raise ValueError(f"vllm.sync: {self.sync} needs vllm.mode=server (a colocated engine takes inprocess)")
        for name in ("sync_timeout_s", "request_timeout_s", "startup_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"vllm.{name}: expected > 0, got {getattr(self, name)}")
        if self.kv_cache_gib < 1:
            raise ValueError(f"vllm.kv_cache_gib: expected >= 1, got {self.kv_cache_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"vllm.gpu_memory_utilization: expected in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_concurrent_requests < 1:
            raise ValueError(f"vllm.max_concurrent_requests: expected >= 1, got {self.max_concurrent_requests}")
        if self.verify_tolerance < 0 or self.max_model_len < 0 or not 0 <= self.port < 65536:
            raise ValueError("vllm.verify_tolerance and vllm.max_model_len must be >= 0, vllm.port in [0, 65535]")

    @property
    def sync_strategy(self) -> str:
        """The strategy `auto` resolves to."""
        if self.sync != "auto":
            return self.sync
        return "inprocess" if self.mode == "colocated" else "disk"
