"""A vLLM OpenAI-compatible server: a small JSON client with timeouts, and a launcher.

    proc, url = launch_server(model_dir, config, log_path)    # python -m vllm.entrypoints.openai.api_server
    client = ServerClient(url, timeout=30.0)
    client.post("/v1/completions", {...})                      # dict, or VLLMEngineError in one line

The client uses only the standard library, so tamer can address a server in another
environment (or on another machine) without vLLM installed locally. Every failure is one line
naming the URL and the route: unreachable, no answer within the timeout, or an HTTP error with
the server's own message.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from tamer.rollout.vllm.config import VLLMConfig
from tamer.rollout.vllm.errors import VLLMEngineError, one_line

SERVED_MODEL_NAME = "tamer-policy"


class ServerClient:
    """JSON over HTTP to one vLLM server; `timeout` bounds each request in seconds."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def get(self, path: str, *, timeout: float | None = None) -> Any:
        return self._request("GET", path, None, timeout)

    def post(self, path: str, body: dict[str, Any] | None = None, *, query: dict[str, Any] | None = None,
             timeout: float | None = None) -> Any:
        if query:
            path = f"{path}?{urllib.parse.urlencode(query)}"
        return self._request("POST", path, body, timeout)

    def _request(self, method: str, path: str, body: dict[str, Any] | None, timeout: float | None) -> Any:
        timeout = self.timeout if timeout is None else timeout
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=max(timeout, 1e-3)) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            raise VLLMEngineError(f"vLLM server {self.url}{path} answered {err.code}: {_error_message(err)}") from None
        except TimeoutError:
            raise VLLMEngineError(f"vLLM server {self.url}{path}: no answer within {timeout:g} s") from None
        except urllib.error.URLError as err:
            if isinstance(err.reason, (TimeoutError, socket.timeout)):
                raise VLLMEngineError(f"vLLM server {self.url}{path}: no answer within {timeout:g} s") from None
            raise VLLMEngineError(f"vLLM server {self.url} unreachable ({err.reason})") from None
        except (ConnectionError, OSError) as err:
            raise VLLMEngineError(f"vLLM server {self.url} unreachable ({one_line(err)})") from None
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise VLLMEngineError(f"vLLM server {self.url}{path}: answer is not JSON: {raw[:200]!r}") from None

    def wait_healthy(self, deadline: float, proc: subprocess.Popen | None = None, log_path: Path | None = None) -> None:
        """Poll /health until it answers 200, the deadline passes, or `proc` exits."""
        while True:
            if proc is not None and proc.poll() is not None:
                raise VLLMEngineError(f"vLLM server exited with code {proc.returncode} while starting: "
                                      f"{_log_error(log_path)}")
            try:
                self.get("/health", timeout=min(5.0, self.timeout))
                return
            except VLLMEngineError:
                if time.monotonic() > deadline:
                    raise VLLMEngineError(f"vLLM server {self.url} not healthy within the startup timeout "
                                          f"(vllm.startup_timeout_s); log: {log_path}") from None
                time.sleep(1.0)


def _error_message(err: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(err.read() or b"{}")
    except (json.JSONDecodeError, OSError):
        return err.reason or "error"
    error = body.get("error", body.get("detail", body)) if isinstance(body, dict) else body
    if isinstance(error, dict):
        error = error.get("message", error)
    return one_line(str(error))


def _log_error(log_path: Path | None) -> str:
    """The last line of the server log that reads like an error (the reason it stopped)."""
    if log_path is None or not log_path.is_file():
        return "no log"
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "error:" in line:
            return line[-400:]
    return lines[-1][-400:] if lines else "empty log"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(model_dir: str | Path, config: VLLMConfig, dtype: str, port: int, max_model_len: int,
                   weight_transfer: str | None = None, engine_args: dict[str, Any] | None = None) -> list[str]:
    """The command line of a server for `model_dir` with tamer's settings (see `launch_server`)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
           "--served-model-name", SERVED_MODEL_NAME, "--seed", str(config.seed),
           # Logprobs after temperature/top-p: what the learner recomputes (raw ones differ by ~0.2 at T=0.7).
           "--logprobs-mode", "processed_logprobs",
           # Sampling defaults from the request only, never from the model's generation_config.json.
           "--generation-config", "vllm", "--max-model-len", str(max_model_len),
           "--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    cmd += ["--enforce-eager"] if config.enforce_eager else []
    cmd += ["--enable-prefix-caching"] if config.prefix_caching else ["--no-enable-prefix-caching"]
    if weight_transfer:
        cmd += ["--weight-transfer-config", json.dumps({"backend": weight_transfer})]
    for key, value in {**(engine_args or {}), **config.extra_args}.items():
        flag = "--" + key.replace("_", "-")
        cmd += [flag] if value is True else [flag, str(value)] if value is not False else [f"--no-{flag[2:]}"]
    return cmd


def server_env(config: VLLMConfig) -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc, /reset_prefix_cache, /pause: what weight sync needs
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.kv_cache_gib))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # share the CPU with the learner, unpinned
    env.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # CUDA IPC handles travel pickled (ipc sync)
    return env


def launch_server(model_dir: str | Path, config: VLLMConfig, log_path: Path, dtype: str, max_model_len: int,
                  weight_transfer: str | None = None, engine_args: dict[str, Any] | None = None,
                  ) -> tuple[subprocess.Popen, str]:
    """Start a server on 127.0.0.1 and wait until it is healthy; returns (process, base URL).

    Its output goes to `log_path`. A server that exits or stays unhealthy past
    `config.startup_timeout_s` is stopped and raises with the log's last error line.
    """
    port = config.port or free_port()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = server_command(model_dir, config, dtype, port, max_model_len, weight_transfer, engine_args)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env(config),
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        ServerClient(url, timeout=10.0).wait_healthy(time.monotonic() + config.startup_timeout_s, proc, log_path)
    except BaseException:
        stop_server(proc)
        raise
    return proc, url


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Terminate the server (SIGTERM, then SIGKILL after `timeout` s)."""
    if proc.poll() is not None:
        return
    _signal_group(proc, signal.SIGTERM)  # the server and the engine processes it spawned
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        proc.wait(timeout)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)  # started with start_new_session: its own process group
