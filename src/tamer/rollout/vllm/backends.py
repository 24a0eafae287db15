"""Where vLLM runs: an in-process `vllm.LLM` (colocated) or an OpenAI-compatible server.

Both backends take token-id prompts and vLLM sampling settings and give back, per prompt, the
sampled token ids, their logprobs and finish reasons, plus the weight version the engine
reports. `VLLMEngine` (engine.py) does the mapping from tamer's `SamplingParams` and the checks.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import subprocess
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tamer.rollout.vllm.config import VLLMConfig
from tamer.rollout.vllm.errors import VLLMEngineError, one_line, require_vllm
from tamer.rollout.vllm.server import SERVED_MODEL_NAME, ServerClient, launch_server, stop_server


@dataclass
class Sample:
    """One continuation as the engine returned it."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # vLLM's: "stop", "length" or "abort"
    versions: set[str] = field(default_factory=set)  # weight versions that sampled these tokens, when reported


def whole_prompt_scheduling(max_model_len: int) -> dict[str, Any]:
    """On vLLM's CPU backend: schedule each prompt's prefill in one step (no chunked prefill).

    vLLM 0.32 rewinds a seeded request's random generator when its prefill is split over steps,
    and CPU generators cannot rewind (`RuntimeError: CPU Generator does not use offset`, which
    kills the engine). tamer seeds every request, so on CPU prompts are never split.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 8192)}


class ColocatedBackend:
    """A `vllm.LLM` in this process (in-process engine core, so weights pass as tensors)."""

    kind = "colocated"

    def __init__(self, model_dir: str, config: VLLMConfig, dtype: str, max_model_len: int) -> None:
        # In-process engine: collective_rpc can take a Python iterator of tensors, and start-up is
        # seconds, not a minute (measured 6 s vs 45-70 s on a 2-core CPU).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_gib)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the learner shares these cores
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the trainer's (and JSON's)
        vllm = require_vllm()
        # Token ids in and out: no tokenizer in the engine, so vLLM's chat-template warm-up fails
        # harmlessly, with a traceback at WARNING level on every start.
        logging.getLogger("vllm.renderers.base").setLevel(logging.ERROR)
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process
        # (it expects to own pinned threads); unpinned, the trainer keeps control of its threads.
        set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
        kwargs = {**whole_prompt_scheduling(max_model_len), **config.extra_args}
        rng_states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
        try:
            self.llm = vllm.LLM(
                model=model_dir, dtype=dtype, seed=config.seed, max_model_len=max_model_len,
                enforce_eager=config.enforce_eager, enable_prefix_caching=config.prefix_caching,
                gpu_memory_utilization=config.gpu_memory_utilization, skip_tokenizer_init=True,
                logprobs_mode="processed_logprobs", **kwargs)
        finally:
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
            # In-process, vLLM seeds the process's global RNGs (random, numpy, torch) with its own
            # seed: the trainer's random streams continue as if no engine had started.
            random.setstate(rng_states[0])
            np.random.set_state(rng_states[1])
            torch.random.set_rng_state(rng_states[2])
        self._params_cls = vllm.SamplingParams

    def generate(self, prompts: list[list[int]], sampling: list[dict[str, Any]], timeout: float) -> list[list[Sample]]:
        params = [self._params_cls(**s, detokenize=False, skip_special_tokens=False) for s in sampling]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        result = []
        for out in outputs:
            samples = []
            for o in sorted(out.outputs, key=lambda o: o.index):
                picked = [] if o.logprobs is None else [step[t].logprob for step, t in zip(o.logprobs, o.token_ids)]
                samples.append(Sample(list(o.token_ids), picked, o.finish_reason or "abort",
                                      {span.version for span in (o.weight_versions or [])}))
            result.append(samples)
        return result

    def reload(self, *, weights: Iterable[tuple[str, torch.Tensor]] | None = None, path: str | None = None) -> None:
        kwargs = {"weights_iterator": weights} if weights is not None else {"weights_path": path}
        self.llm.collective_rpc("reload_weights", kwargs=kwargs)

    def reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise VLLMEngineError("vLLM refused to reset its prefix cache (requests still running?)")

    def set_version(self, version: str) -> None:
        self.llm.llm_engine.set_weight_version(version)

    def version(self) -> str:
        return str(self.llm.llm_engine.get_weight_version())

    def pause(self) -> None:  # generation is synchronous in this process: nothing runs during a sync
        pass

    def resume(self) -> None:
        pass

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        try:  # the in-process worker set up torch.distributed; a later engine sets it up again
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel
            destroy_model_parallel()
            destroy_distributed_environment()
        except Exception:
            pass


class ServerBackend:
    """An OpenAI-compatible vLLM server at `url`, or one started here on 127.0.0.1."""

    kind = "server"

    def __init__(self, config: VLLMConfig, *, url: str = "", model_dir: str = "", dtype: str = "auto",
                 max_model_len: int = 0, weight_transfer: str | None = None, log_path: Path | None = None) -> None:
        self.config = config
        self.proc: subprocess.Popen | None = None
        if not url:
            require_vllm()
            log_path = log_path or Path(model_dir).parent / "vllm-server.log"
            self.proc, url = launch_server(model_dir, config, log_path, dtype, max_model_len, weight_transfer,
                                           whole_prompt_scheduling(max_model_len))
            self._stop = weakref.finalize(self, stop_server, self.proc)  # also at interpreter exit, if never closed
        self.url, self.log_path = url.rstrip("/"), log_path
        self.client = ServerClient(self.url, timeout=config.request_timeout_s)
        self.pool = ThreadPoolExecutor(max_workers=config.max_concurrent_requests, thread_name_prefix="vllm-http")
        try:
            self.client.get("/health")  # unreachable: one line now, before anything else
            models = self.client.get("/v1/models").get("data") or []
            if not models:
                raise VLLMEngineError(f"vLLM server {self.url} serves no model")
        except BaseException:
            self.close()
            raise
        self.model_name = models[0]["id"] if self.proc is None else SERVED_MODEL_NAME
        self.max_model_len = int(models[0].get("max_model_len") or max_model_len or 0)

    def generate(self, prompts: list[list[int]], sampling: list[dict[str, Any]], timeout: float) -> list[list[Sample]]:
        """One /v1/completions request per prompt, up to `max_concurrent_requests` in flight."""
        deadline = time.monotonic() + timeout
        futures = [self.pool.submit(self._complete, p, s, deadline) for p, s in zip(prompts, sampling)]
        done, pending = wait(futures, timeout=max(0.0, deadline - time.monotonic()) + 1.0)
        if pending:
            for future in pending:
                future.cancel()
            raise VLLMEngineError(f"vLLM server {self.url}: {len(pending)} of {len(futures)} requests unanswered "
                                  f"within {timeout:g} s (vllm.request_timeout_s)")
        return [future.result() for future in futures]

    def _complete(self, prompt: list[int], sampling: dict[str, Any], deadline: float) -> list[Sample]:
        body = {"model": self.model_name, "prompt": prompt, **sampling, "return_token_ids": True,
                "return_tokens_as_token_ids": True, "add_special_tokens": False, "skip_special_tokens": False}
        answer = self.client.post("/v1/completions", body, timeout=max(0.0, deadline - time.monotonic()))
        samples = []
        for choice in sorted(answer.get("choices", []), key=lambda c: c["index"]):
            token_ids = list(choice.get("token_ids") or [])
            logprobs = choice.get("logprobs") or {}
            tokens = logprobs.get("tokens") or []
            if tokens != [f"token_id:{t}" for t in token_ids]:  # the logprobs must describe these very tokens
                raise VLLMEngineError(f"vLLM server {self.url}: logprobs do not match the returned token ids")
            samples.append(Sample(token_ids, [float(x) for x in logprobs.get("token_logprobs") or []],
                                  choice.get("finish_reason") or "abort"))
        return samples

    def reload(self, *, weights=None, path: str | None = None) -> None:
        if weights is not None:
            raise VLLMEngineError("a vLLM server cannot take weights as in-process tensors: use vllm.sync=disk")
        answer = self.client.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}},
                                  timeout=self.config.sync_timeout_s)
        results = answer.get("results", [None]) if isinstance(answer, dict) else answer
        errors = [r for r in results if r is not None]
        if errors:  # reload_weights returns None on every worker; anything else is a failure report
            raise VLLMEngineError(f"vLLM server {self.url}: reload_weights answered {one_line(str(errors[0]))}")

    def reset_prefix_cache(self) -> None:
        self.client.post("/reset_prefix_cache")

    def set_version(self, version: str) -> None:
        self.client.post("/update_weight_version", {"new_version": version})

    def version(self) -> str:
        return str(self.client.get("/weight_info").get("weight_version"))

    def pause(self) -> None:
        self.client.post("/pause", query={"mode": "wait"}, timeout=self.config.sync_timeout_s)

    def resume(self) -> None:
        self.client.post("/resume")

    def world_size(self) -> int:
        return int(self.client.get("/get_world_size?include_dp=false").get("world_size", 1))

    def close(self) -> None:
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if self.proc is not None:
            self._stop()
            self.proc = None
