"""The `vllm:` section of a run config: where the engine runs and how it receives weights.

Importable without vLLM installed (configs are checked before any engine starts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tamer.config import FieldError, check_name

MODES = ("colocated", "server")
SYNC_STRATEGIES = ("auto", "inprocess", "disk", "nccl", "ipc")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class VLLMConfig:
    """How `VLLMEngine` runs vLLM (used when `rl.engine` is `vllm`)."""

    # colocated: an in-process `vllm.LLM` beside the learner. server: an OpenAI-compatible vLLM
    # server, the one at `url` or, when `url` is empty, one tamer starts on 127.0.0.1.
    mode: str = "colocated"  # colocated | server
    url: str = ""  # server mode: base URL of a running vLLM server (started with VLLM_SERVER_DEV_MODE=1)
    port: int = 0  # server mode, tamer-started server: the port; 0 picks a free one
    # auto: the learner's dtype. The logprob parity figures hold for float32 on both sides.
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    kv_cache_gib: int = 1  # CPU: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE)
    gpu_memory_utilization: float = 0.3  # GPU: share of device memory vLLM may take (colocated: leave room)
    enforce_eager: bool = True  # False: CUDA graphs / torch.compile (faster decode, much slower start)
    prefix_caching: bool = True  # multi-turn episodes reuse the KV of earlier turns
    # How weights reach the engine after each learner update. auto: inprocess (colocated) or
    # disk (server). nccl and ipc use vLLM's GPU weight-transfer engines.
    sync: str = "auto"  # auto | inprocess | disk | nccl | ipc
    sync_dir: str = ""  # disk sync: where weights are written; empty: /dev/shm when present, else a temp dir
    sync_timeout_s: float = 300.0  # one weight sync, end to end; past it the run stops
    request_timeout_s: float = 600.0  # one generate call (all its requests)
    startup_timeout_s: float = 900.0  # engine or server start
    # After every sync, sample a short probe and compare its logprobs with the learner's
    # forward: stale or corrupt weights stop the run instead of training on them.
    verify_sync: bool = True  # probe vLLM's logprobs against the learner after every sync
    verify_tolerance: float = 0.0  # max |logprob gap| on the probe; 0: 1e-3 in float32, 0.1 otherwise
    max_concurrent_requests: int = 64  # server mode: requests in flight at once
    seed: int = 0  # vLLM's own seed
    extra_args: dict[str, Any] = field(default_factory=dict)  # more `vllm.LLM` kwargs / server flags

    def __post_init__(self) -> None:
        check_name("mode", self.mode, MODES, "mode")
        check_name("sync", self.sync, SYNC_STRATEGIES, "sync strategy")
        check_name("dtype", self.dtype, DTYPES, "dtype")
        if self.mode == "colocated" and self.url:
            raise FieldError("url", "only used with vllm.mode=server")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise FieldError("url", f"expected http://host:port, got {self.url!r}")
        if self.sync == "inprocess" and self.mode != "colocated":
            raise FieldError("sync", "inprocess needs vllm.mode=colocated (a server is another process)")
        if self.sync in ("nccl", "ipc") and self.mode != "server":
            raise FieldError("sync", f"{self.sync} needs vllm.mode=server (a colocated engine takes inprocess)")
        for name in ("sync_timeout_s", "request_timeout_s", "startup_timeout_s"):
            if getattr(self, name) <= 0:
                raise FieldError(name, f"expected > 0, got {getattr(self, name)}")
        for name, low in (("kv_cache_gib", 1), ("max_concurrent_requests", 1), ("max_model_len", 0)):
            if getattr(self, name) < low:
                raise FieldError(name, f"expected >= {low}, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise FieldError("gpu_memory_utilization", f"expected in (0, 1], got {self.gpu_memory_utilization}")
        if self.verify_tolerance < 0:
            raise FieldError("verify_tolerance", f"expected >= 0, got {self.verify_tolerance}")
        if not 0 <= self.port < 65536:
            raise FieldError("port", f"expected 0..65535, got {self.port}")

    @property
    def sync_strategy(self) -> str:
        """The strategy `auto` resolves to."""
        if self.sync != "auto":
            return self.sync
        return "inprocess" if self.mode == "colocated" else "disk"
