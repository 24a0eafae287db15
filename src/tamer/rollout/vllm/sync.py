"""Weight sync strategies: how the learner's current weights reach the vLLM engine.

    sync = SYNCS.get("inprocess")(backend, config)
    sync.push(model)        # the engine now holds `model`'s weights; raises on any failure

`VLLMEngine.sync_weights` wraps every push in the same sequence: pause the engine, push,
reset the prefix cache (its keys and values belong to the old weights), stamp the new weight
version, resume, and (`vllm.verify_sync`) check a probe's logprobs against the learner. The
whole sequence runs under `vllm.sync_timeout_s`.

| strategy  | engine              | how                                                          | tested here |
|-----------|---------------------|--------------------------------------------------------------|-------------|
| inprocess | colocated           | `reload_weights(weights_iterator=...)` over the live tensors | yes (CPU)   |
| disk      | colocated or server | safetensors into a directory, `reload_weights(weights_path)` | yes (CPU)   |
| nccl      | server (other GPUs) | vLLM's NCCL weight-transfer engine, broadcast from rank 0    | no: GPU only|
| ipc       | server (same GPU)   | vLLM's CUDA-IPC weight-transfer engine, handles over HTTP    | no: GPU only|

Tied embeddings: every strategy sends `lm_head.weight` explicitly. vLLM's loader does not
re-tie on reload; without it the head silently keeps the old weights (a logprob gap of ~1.2
was measured on a tiny model, and only a log line says so).

nccl and ipc are written against vLLM 0.32's trainer-side API (`WeightTransferTrainerFactory`,
`HTTPVLLMWeightSyncClient`) and need a server started with `--weight-transfer-config`
(tamer adds it when it starts the server). They have not been run: no GPU was available.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import torch
from transformers import PreTrainedModel

from tamer.models.lora import is_lora, merged_state_dict
from tamer.registry import Registry
from tamer.rollout.vllm.config import VLLMConfig
from tamer.rollout.vllm.errors import WeightSyncError

SYNCS: Registry[type[WeightSync]] = Registry("weight sync strategy")


def named_weights(model: PreTrainedModel) -> list[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor of `model` by its checkpoint name, `lm_head.weight` included when tied.

    A LoRA policy (peft) gives its weights with the adapter merged, under the plain model's names:
    the sampler holds the full model that is being trained."""
    state = merged_state_dict(model) if is_lora(model) else model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" not in state:
        state["lm_head.weight"] = model.get_input_embeddings().weight
    return [(name, tensor.detach()) for name, tensor in state.items()]


class WeightSync:
    """One way of moving weights; subclasses implement `push`."""

    name = ""
    backends: tuple[str, ...] = ("colocated", "server")

    def __init__(self, backend, config: VLLMConfig) -> None:
        if backend.kind not in self.backends:
            raise WeightSyncError(f"vllm.sync={self.name} does not work with a {backend.kind} engine "
                                  f"(it needs: {', '.join(self.backends)})")
        self.backend, self.config = backend, config

    def push(self, model: PreTrainedModel) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


@SYNCS.register("inprocess")
class InProcessSync(WeightSync):
    """The learner's tensors handed to the in-process engine's loader (no copy through disk)."""

    name, backends = "inprocess", ("colocated",)

    def push(self, model: PreTrainedModel) -> None:
        self.backend.reload(weights=iter(named_weights(model)))


@SYNCS.register("disk")
class DiskSync(WeightSync):
    """safetensors in a directory the engine can read (tmpfs when there is one), then a reload from it."""

    name = "disk"

    def __init__(self, backend, config: VLLMConfig) -> None:
        super().__init__(backend, config)
        self._owned = not config.sync_dir
        root = config.sync_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        self.dir = Path(root) / f"tamer-vllm-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def push(self, model: PreTrainedModel) -> None:
        from safetensors.torch import save_file

        self.dir.mkdir(parents=True, exist_ok=True)
        # Copies, not views: safetensors refuses shared storage (tied weights) and non-contiguous tensors.
        tensors = {name: t.to("cpu", copy=True).contiguous() for name, t in named_weights(model)}
        tmp = self.dir / "model.safetensors.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.replace(self.dir / "model.safetensors")  # never a half-written file under the loaded name
        model.config.to_json_file(str(self.dir / "config.json"))
        self.backend.reload(path=str(self.dir))

    def close(self) -> None:
        if self._owned:
            shutil.rmtree(self.dir, ignore_errors=True)


def _weight_source(model: PreTrainedModel):
    """vLLM's `WeightSource` over `named_weights(model)` (its own `ModuleSource` skips a tied `lm_head`)."""
    from vllm.distributed.weight_transfer import ParamMeta, WeightSource

    class NamedWeights(WeightSource):
        def __init__(self, model: PreTrainedModel) -> None:
            self.model = model

        def metadata(self):
            return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in named_weights(self.model)]

        def __iter__(self):
            return iter(named_weights(self.model))

    return NamedWeights(model)


class _TransferSync(WeightSync):
    """Shared by nccl and ipc: vLLM's trainer-side transfer engine over the server's HTTP routes."""

    backends = ("server",)

    def __init__(self, backend, config: VLLMConfig) -> None:
        super().__init__(backend, config)
        if not torch.cuda.is_available():
            raise WeightSyncError(f"vllm.sync={self.name} needs a CUDA GPU; on CPU use vllm.sync=disk")
        self.transfer = None

    def _start(self, model: PreTrainedModel):
        raise NotImplementedError

    def push(self, model: PreTrainedModel) -> None:
        if self.transfer is None:
            self.source = _weight_source(model)
            self.transfer = self._start(model)
        self.source.model = model
        self.transfer.send_weights()

    def _client(self):
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

        return HTTPVLLMWeightSyncClient(self.backend.url, timeout=self.config.sync_timeout_s)

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.shutdown()
            self.transfer = None


@SYNCS.register("nccl")
class NCCLSync(_TransferSync):
    """NCCL broadcast from the learner (rank 0) to the server's workers. GPU only; untested here."""

    name = "nccl"

    def _start(self, model: PreTrainedModel):
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
        from vllm.utils.network_utils import get_open_port

        info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=get_open_port(),
                                   world_size=1 + self.backend.world_size(), rank=0)
        return WeightTransferTrainerFactory.trainer_init(info, client=self._client(), source=self.source)


@SYNCS.register("ipc")
class IPCSync(_TransferSync):
    """CUDA IPC handles of the learner's tensors, opened by a server on the same GPU. Untested here."""

    name = "ipc"

    def _start(self, model: PreTrainedModel):
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo(rank=0), client=self._client(),
                                                         source=self.source)
