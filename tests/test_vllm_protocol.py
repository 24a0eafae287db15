"""vLLM engine without vLLM: config checks, one-line errors, and the server protocol against a fake server.

The fake speaks the routes of vLLM's OpenAI-compatible server that `VLLMEngine` uses
(/v1/completions with token ids and logprobs, /collective_rpc reload_weights, /pause, /resume,
/reset_prefix_cache, /update_weight_version, /weight_info), answering with an HFEngine on its own
copy of the model. The real server is exercised in tests/test_vllm.py (vLLM tier).
"""

from __future__ import annotations

import copy
import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import pytest
import torch

from tamer.config import ConfigError, from_dict
from tamer.models import encode_chat, stop_token_ids, token_logprobs
from tamer.rollout.engine import HFEngine
from tamer.rollout.engines import make_engine
from tamer.rollout.runner import Rollout
from tamer.rollout.types import SamplingParams
from tamer.rollout.vllm import INSTALL_HINT, VLLMConfig, VLLMEngineError, WeightSyncError, named_weights
from tamer.rollout.vllm.engine import VLLMEngine, _with_timeout
from tamer.tasks import ArithmeticTasks
from tamer.trainers.batch import collate
from tamer.trainers.common import OptimConfig, make_optimizer


class FakeVLLM(ThreadingHTTPServer):
    """An HTTP server on 127.0.0.1 that answers like vLLM's, generating with an HFEngine."""

    daemon_threads = True

    def __init__(self, model, pad_id, delay: float = 0.0):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.model, self.engine = model, HFEngine(model, pad_id)
        self.version, self.delay, self.calls = "default", delay, []
        self.lock = threading.Lock()  # HFEngine is not thread-safe; requests arrive concurrently
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"

    def answer(self, method: str, path: str, body: dict):
        self.calls.append(path)
        if path == "/health":
            return {}
        if path == "/v1/models":
            return {"data": [{"id": "fake", "max_model_len": 1024}]}
        if path == "/weight_info":
            return {"weight_version": self.version}
        if path == "/update_weight_version":
            self.version = body["new_version"]
            return {"success": True}
        if path == "/collective_rpc":
            from safetensors.torch import load_file

            state = load_file(f"{body['kwargs']['weights_path']}/model.safetensors")
            with torch.no_grad():
                for name, tensor in named_weights(self.model):
                    tensor.copy_(state[name])
            return {"results": [None]}
        if path == "/v1/completions":
            return self._complete(body)
        return {"status": "ok"}  # /pause, /resume, /reset_prefix_cache

    def _complete(self, body: dict) -> dict:
        params = SamplingParams(n=body["n"], temperature=body["temperature"], top_p=body["top_p"],
                                max_new_tokens=body["max_tokens"], stop_token_ids=tuple(body["stop_token_ids"]),
                                seed=body["seed"])
        with self.lock:
            outs = self.engine.generate([body["prompt"]], params)[0]
        return {"choices": [{"index": i, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
                             "logprobs": {"tokens": [f"token_id:{t}" for t in o.token_ids],
                                          "token_logprobs": o.logprobs}} for i, o in enumerate(outs)]}


class _Handler(BaseHTTPRequestHandler):
    def _reply(self, method):
        server: FakeVLLM = self.server
        time.sleep(server.delay)
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        data = json.dumps(server.answer(method, urlparse(self.path).path, body)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._reply("GET")

    def do_POST(self):
        self._reply("POST")

    def log_message(self, *args):
        pass


@pytest.fixture
def fake(tiny_model, tokenizer):
    server = FakeVLLM(copy.deepcopy(tiny_model), tokenizer.pad_token_id)
    yield server
    server.shutdown()
    server.server_close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------------------------- config and errors
@pytest.mark.parametrize("data, needle", [
    ({"mode": "gpu"}, "vllm.mode: unknown mode 'gpu'; valid: colocated, server"),
    ({"sync": "rsync"}, "vllm.sync: unknown sync strategy"),
    ({"mode": "server", "sync": "inprocess"}, "vllm.sync: inprocess needs vllm.mode=colocated"),
    ({"sync": "nccl"}, "vllm.sync: nccl needs vllm.mode=server"),
    ({"url": "http://x:1"}, "vllm.url: only used with vllm.mode=server"),
    ({"mode": "server", "url": "localhost:8000"}, "vllm.url: expected http://host:port"),
    ({"sync_timeout_s": 0}, "vllm.sync_timeout_s: expected > 0"),
])
def test_config_errors_name_the_field(data, needle):
    with pytest.raises(ConfigError, match=needle):
        from_dict(VLLMConfig, data, "vllm")


def test_sync_auto_resolves_by_mode():
    assert VLLMConfig().sync_strategy == "inprocess" and VLLMConfig(mode="server").sync_strategy == "disk"


def test_missing_vllm_names_the_install_command(tiny_model, tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError, installed or not
    with pytest.raises(VLLMEngineError) as err:
        make_engine("vllm", tiny_model, tokenizer)
    assert INSTALL_HINT in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="rl.engine: expected one of hf, vllm"):
        make_engine("tgi", tiny_model, tokenizer)


def test_unreachable_server_fails_fast_in_one_line(tiny_model, tokenizer):
    url = f"http://127.0.0.1:{_free_port()}"
    start = time.perf_counter()
    with pytest.raises(VLLMEngineError, match="unreachable") as err:
        VLLMEngine(tiny_model, tokenizer, VLLMConfig(mode="server", url=url, request_timeout_s=5))
    assert time.perf_counter() - start < 5 and "\n" not in str(err.value) and url in str(err.value)


def test_slow_server_fails_within_the_timeout(tiny_model, tokenizer):
    server = FakeVLLM(copy.deepcopy(tiny_model), tokenizer.pad_token_id, delay=30.0)
    try:
        start = time.perf_counter()
        with pytest.raises(VLLMEngineError, match="no answer within 1 s"):
            VLLMEngine(tiny_model, tokenizer, VLLMConfig(mode="server", url=server.url, request_timeout_s=1))
        assert time.perf_counter() - start < 5
    finally:
        server.delay = 0.0
        server.shutdown()
        server.server_close()


def test_timeout_helper():
    assert _with_timeout(lambda: 7, 1.0, "x") == 7
    with pytest.raises(WeightSyncError, match="did not finish within 0.2 s"):
        _with_timeout(lambda: time.sleep(2), 0.2, "a sync")
    with pytest.raises(KeyError):
        _with_timeout(lambda: {}["missing"], 1.0, "x")


def test_named_weights_send_the_tied_head(tiny_model):
    names = [name for name, _ in named_weights(tiny_model)]
    assert tiny_model.config.tie_word_embeddings and "lm_head.weight" in names and "model.embed_tokens.weight" in names


# ------------------------------------------------------------------------------------- the server protocol
def test_server_protocol_sync_versions_and_parity(fake, tiny_model, tokenizer, tmp_path):
    """First sync pushes the learner's weights, samples match the learner, a new version follows an update."""
    with torch.no_grad():  # the server starts from other weights than the learner's
        for p in fake.model.parameters():
            p.mul_(0.5)
    config = VLLMConfig(mode="server", url=fake.url, sync_dir=str(tmp_path), request_timeout_s=30)
    with VLLMEngine(tiny_model, tokenizer, config) as engine:
        assert fake.version == "0" and engine.weight_version == 0 and engine.stats["probe_gap"] < 1e-5
        tasks = ArithmeticTasks().split()[1][:3]
        stops = stop_token_ids(tokenizer)
        params = SamplingParams(n=3, temperature=0.7, max_new_tokens=8, stop_token_ids=stops, seed=1)
        trajs = Rollout(engine, tokenizer).run(tasks, params)
        assert len(trajs) == 9 and all(t.weight_version == 0 for t in trajs)
        batch = collate(trajs, torch.zeros(9), tokenizer.pad_token_id)
        with torch.no_grad():
            learner = token_logprobs(tiny_model, batch.input_ids, batch.attention_mask, temperature=0.7)
        mask = batch.loss_mask.bool()
        assert (learner[mask] - batch.old_logprobs[mask]).abs().max() < 1e-5
        optimizer = make_optimizer(tiny_model, OptimConfig(lr=1e-3))  # fused AdamW: no write counters bumped
        token_logprobs(tiny_model, batch.input_ids, batch.attention_mask).sum().backward()
        optimizer.step()
        engine.sync_weights(tiny_model)
        assert engine.weight_version == 1 and fake.version == "1"
        assert fake.calls.count("/pause") == 2 and fake.calls.count("/resume") == 2
        engine.sync_weights(tiny_model)  # nothing written since: no request at all
        assert fake.calls.count("/collective_rpc") == 2
        fake.version = "someone-else"  # another client updated the server's weights
        with pytest.raises(WeightSyncError, match="stale weights"):
            engine.generate([encode_chat(tokenizer, [{"role": "user", "content": "1+1"}])], params)
        with pytest.raises(VLLMEngineError, match="engine stopped"):
            engine.generate([[1, 2, 3]], params)


def test_server_answer_that_does_not_match_is_refused(fake, tiny_model, tokenizer, tmp_path, monkeypatch):
    config = VLLMConfig(mode="server", url=fake.url, sync_dir=str(tmp_path), request_timeout_s=30)
    with VLLMEngine(tiny_model, tokenizer, config) as engine:
        original = fake._complete

        def one_logprob_short(body):
            answer = original(body)
            answer["choices"][0]["logprobs"]["tokens"] = answer["choices"][0]["logprobs"]["tokens"][:-1]
            return answer

        monkeypatch.setattr(fake, "_complete", one_logprob_short)
        with pytest.raises(VLLMEngineError, match="logprobs do not match the returned token ids"):
            engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4))
