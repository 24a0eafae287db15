"""`VLLMEngine`: tamer's `GenerationEngine` on vLLM, colocated in-process or behind a server.

    engine = VLLMEngine(model, tokenizer, VLLMConfig())            # colocated: an in-process vllm.LLM
    engine = VLLMEngine(model, tokenizer, VLLMConfig(mode="server"))  # tamer starts a server on 127.0.0.1
    outputs = engine.generate(prompt_ids, SamplingParams(n=8, temperature=1.0, stop_token_ids=(eos,)))
    engine.sync_weights(model)     # after each learner update; a no-op when no weight changed
    engine.close()

Token ids in, token ids and the sampled tokens' logprobs out, exactly as `HFEngine`: the stop
token is included with finish_reason "stop", `n` samples per prompt, temperature/top-p/seed
mapped onto vLLM's sampling, logprobs after temperature and top-p (`processed_logprobs`, what
the learner recomputes). Multi-turn episodes reuse earlier turns' KV through vLLM's prefix
cache (`SamplingParams.reuse_prefix` needs nothing more).

Checks, so that nothing trains on stale weights silently:
* every output carries the engine's weight version (`GenerationOutput.weight_version`); the
  engine's own report of the version that sampled each token (in-process) or its /weight_info
  before and after a batch (server) must equal it;
* every output has one finite logprob per token and a finish reason of stop or length;
* after start-up and every sync, a probe's logprobs are compared with the learner's forward.
A failed or timed-out sync stops the engine: every later call raises.
"""

from __future__ import annotations

import copy
import math
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tamer.models import save_model
from tamer.models.logprobs import token_logprobs
from tamer.models.lora import is_lora, save_merged_model
from tamer.rollout.types import GenerationOutput, SamplingParams
from tamer.rollout.vllm.backends import ColocatedBackend, Sample, ServerBackend
from tamer.rollout.vllm.config import VLLMConfig
from tamer.rollout.vllm.errors import VLLMEngineError, WeightSyncError, one_line, require_vllm
from tamer.rollout.vllm.sync import SYNCS

PROBE_TEXT = "1+2=3 4+5=9"
PROBE_TEMPERATURE = 0.7  # not 1: raw logprobs (a server without processed_logprobs) fail the check


@torch.no_grad()
def fingerprint(model: PreTrainedModel) -> torch.Tensor:
    """Per parameter, its sum and sum of squares in float64: (P, 2). Any optimizer step changes them.

    Content, not torch's per-tensor write counters: fused optimizers (AdamW(fused=True), the
    default here) write parameters without bumping those counters.
    """
    return torch.stack([torch.stack([p.double().sum(), p.double().square().sum()]) for p in model.parameters()]).cpu()


class VLLMEngine:
    """Sampling on vLLM for the learner `model`; see the module docstring."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: VLLMConfig = VLLMConfig(),
                 *, work_dir: str | Path | None = None) -> None:
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.weight_version = 0
        self.stats: dict[str, float] = {"syncs": 0, "sync_s": 0.0, "sync_s_total": 0.0, "probe_gap": math.nan}
        self._broken: str | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="tamer-vllm-") if work_dir is None else None
        self.work_dir = Path(work_dir or self._tmp.name)
        learner_dtype = str(next(model.parameters()).dtype).replace("torch.", "")
        self.dtype = learner_dtype if config.dtype == "auto" else config.dtype
        self.max_model_len = config.max_model_len or int(getattr(model.config, "max_position_embeddings", 2048))
        self.tolerance = config.verify_tolerance or (1e-3 if self.dtype == "float32" else 0.1)
        self._probe_ids = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
        self.backend = self.sync = None
        try:
            self.backend = self._start_backend(model)
            self.max_model_len = getattr(self.backend, "max_model_len", 0) or self.max_model_len
            self.sync = SYNCS.get(config.sync_strategy)(self.backend, config)
            if config.url:  # a server started elsewhere holds some checkpoint: give it the learner's
                _with_timeout(lambda: self._push(model, 0), config.sync_timeout_s, "the first weight sync")
            else:
                self.backend.set_version("0")
            self._fingerprint = fingerprint(model)
            self._verify("at start-up")
        except BaseException as err:
            self.close()
            if isinstance(err, VLLMEngineError) or not isinstance(err, Exception):  # ours, or Ctrl-C
                raise
            raise VLLMEngineError(f"vLLM cannot run this model: {one_line(err)}") from err

    def _start_backend(self, model: PreTrainedModel):
        weight_transfer = self.config.sync_strategy if self.config.sync_strategy in ("nccl", "ipc") else None
        if self.config.mode == "server" and self.config.url:
            return ServerBackend(self.config, url=self.config.url)
        require_vllm()
        check_supported(model)
        if is_lora(model):  # vLLM loads full weights: the adapter merged (the same on every sync)
            model_dir = save_merged_model(model, self.tokenizer, self.work_dir / "model")
        else:
            model_dir = save_model(model, self.tokenizer, self.work_dir / "model")
        if self.config.mode == "server":
            return ServerBackend(self.config, model_dir=str(model_dir), dtype=self.dtype,
                                 max_model_len=self.max_model_len, weight_transfer=weight_transfer,
                                 log_path=self.work_dir / "vllm-server.log")
        return ColocatedBackend(str(model_dir), self.config, self.dtype, self.max_model_len)

    # ---------------------------------------------------------------- generation
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[GenerationOutput]]:
        """For each prompt, `params.n` continuations with their sampling logprobs (see `HFEngine`)."""
        self._check_alive()
        if not prompts:
            return []
        n = 1 if params.greedy else params.n  # vLLM samples greedy with n=1 only; copies are identical
        sampling = [self._sampling(params, i, len(prompt), n) for i, prompt in enumerate(prompts)]
        self._check_server_version("before generating")
        try:
            raw = self.backend.generate(prompts, sampling, self.config.request_timeout_s)
        except VLLMEngineError:
            raise
        except Exception as err:  # the in-process engine died (EngineDeadError, a kernel error, ...)
            self._broken = f"generation failed: {one_line(err)}"
            raise VLLMEngineError(f"vLLM {self._broken}") from err
        self._check_server_version("after generating")
        outputs = []
        for samples in raw:
            if len(samples) != n:
                raise VLLMEngineError(f"vLLM returned {len(samples)} samples for a prompt, expected {n}")
            group = [self._output(s, params) for s in samples]
            outputs.append(group if n == params.n else [copy.deepcopy(group[0]) for _ in range(params.n)])
        return outputs

    def _sampling(self, params: SamplingParams, index: int, prompt_len: int, n: int) -> dict[str, Any]:
        room = min(params.max_new_tokens, self.max_model_len - prompt_len)
        if room < 1:
            raise VLLMEngineError(f"a prompt of {prompt_len} tokens leaves no room to generate within the engine's "
                                  f"max_model_len {self.max_model_len} (vllm.max_model_len)")
        # One seed per prompt: identical prompts (two episodes at the same state) still differ.
        seed = (params.seed * 1_000_003 + index * 7919 + 1) % (2**62)
        return {"n": n, "temperature": params.temperature, "top_p": params.top_p, "max_tokens": room, "seed": seed,
                "stop_token_ids": list(params.stop_token_ids), "ignore_eos": True, "logprobs": 0}

    def _output(self, sample: Sample, params: SamplingParams) -> GenerationOutput:
        """The checked `GenerationOutput` of one vLLM sample."""
        if sample.finish_reason not in ("stop", "length"):
            raise VLLMEngineError(f"vLLM ended a request with finish_reason {sample.finish_reason!r}")
        if not sample.token_ids or len(sample.logprobs) != len(sample.token_ids) or \
                not all(math.isfinite(x) for x in sample.logprobs):
            raise VLLMEngineError(f"vLLM returned {len(sample.token_ids)} tokens with {len(sample.logprobs)} "
                                  "logprobs (expected one finite logprob per token)")
        if sample.finish_reason == "stop" and sample.token_ids[-1] not in params.stop_token_ids:
            raise VLLMEngineError(f"vLLM stopped on token {sample.token_ids[-1]}, not one of the stop tokens")
        expected = str(self.weight_version)
        if sample.versions and sample.versions != {expected}:
            self._broken = f"tokens sampled with weight version(s) {sorted(sample.versions)}, expected {expected}"
            raise WeightSyncError(f"stale weights: {self._broken}")
        return GenerationOutput(list(sample.token_ids), list(sample.logprobs), sample.finish_reason,
                                weight_version=self.weight_version)

    def _check_server_version(self, when: str) -> None:
        if self.backend.kind != "server":
            return
        version = self.backend.version()
        if version != str(self.weight_version):
            self._broken = f"the server's weight version is {version!r} {when}, expected {self.weight_version}"
            raise WeightSyncError(f"stale weights: {self._broken} (was it updated by someone else?)")

    # ---------------------------------------------------------------- weights
    def sync_weights(self, model: PreTrainedModel) -> None:
        """Give the engine `model`'s current weights (a new weight version); no-op if no weight changed."""
        self._check_alive()
        current = fingerprint(model)
        if model is self.model and torch.equal(current, self._fingerprint):
            return
        version = self.weight_version + 1
        start = time.perf_counter()
        try:
            _with_timeout(lambda: self._push(model, version), self.config.sync_timeout_s,
                          f"weight sync to version {version}")
        except BaseException as err:
            self._broken = f"weight sync to version {version} failed: {one_line(err)}"
            raise WeightSyncError(f"{self._broken}; the engine is stopped (the last checkpoint stays valid)") from err
        seconds = time.perf_counter() - start
        self.model, self.weight_version, self._fingerprint = model, version, current
        self.stats["syncs"] += 1
        self.stats["sync_s"] = seconds
        self.stats["sync_s_total"] += seconds
        if self.config.verify_sync:
            self._verify(f"after the sync to weight version {version}")

    def _push(self, model: PreTrainedModel, version: int) -> None:
        self.backend.pause()
        self.sync.push(model)
        self.backend.reset_prefix_cache()  # cached keys/values were computed with the old weights
        self.backend.set_version(str(version))
        reported = self.backend.version()
        if reported != str(version):
            raise WeightSyncError(f"the engine reports weight version {reported!r} after the update, "
                                  f"expected {version}")
        self.backend.resume()

    def _verify(self, when: str) -> None:
        """Sample a short probe and compare its logprobs with the learner's forward of the same tokens."""
        params = SamplingParams(n=1, temperature=PROBE_TEMPERATURE, max_new_tokens=8, seed=12345)
        out = self.generate([self._probe_ids], params)[0][0]
        learner = learner_logprobs(self.model, self._probe_ids, out.token_ids, PROBE_TEMPERATURE)
        gap = float((torch.tensor(out.logprobs) - learner).abs().max())
        self.stats["probe_gap"] = gap
        if not gap <= self.tolerance:
            self._broken = (f"{when}, the engine's logprobs differ from the learner's by {gap:.3g} > "
                            f"{self.tolerance:g} (vllm.verify_tolerance): its weights or sampling settings "
                            "are not the learner's")
            raise WeightSyncError(self._broken)

    # ---------------------------------------------------------------- lifecycle
    def metrics(self) -> dict[str, float]:
        """Scalars for the run log: weight version, last sync seconds, last probe gap."""
        return {"vllm/weight_version": float(self.weight_version), "vllm/sync_s": self.stats["sync_s"],
                "vllm/probe_logprob_gap": self.stats["probe_gap"]}

    def _check_alive(self) -> None:
        if self._broken is not None:
            raise VLLMEngineError(f"the vLLM engine stopped: {self._broken}")
        if self.backend is None:
            raise VLLMEngineError("the vLLM engine is closed")

    def close(self) -> None:
        """Stop the engine (and a server tamer started); safe to call twice."""
        if self.sync is not None:
            self.sync.close()
        if self.backend is not None:
            self.backend.close()
        self.sync = self.backend = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def learner_logprobs(model: PreTrainedModel, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """The learner's logprobs (len(tokens),) float32 of `tokens` after `prompt`, at `temperature`."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + tokens], device=device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        lp = token_logprobs(model, ids, torch.ones_like(ids), temperature=temperature)
    model.train(was_training)
    return lp[0, len(prompt):].float().cpu()


def check_supported(model: PreTrainedModel) -> None:
    """On vLLM's CPU backend, fail before start-up on a head size its attention kernels lack."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    cfg = model.config
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head not in sizes:
        raise VLLMEngineError(f"vLLM's CPU attention does not support head size {head} (hidden_size "
                              f"{cfg.hidden_size} / num_attention_heads {cfg.num_attention_heads}); "
                              f"supported: {', '.join(map(str, sizes))}")


def _with_timeout(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """`fn()` on a helper thread; raises WeightSyncError if it is still running after `timeout` s."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as err:
            result["error"] = err

    thread = threading.Thread(target=run, name="tamer-vllm-sync", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise WeightSyncError(f"{what} did not finish within {timeout:g} s (vllm.sync_timeout_s)")
    if "error" in result:
        raise result["error"]
    return result.get("value")
