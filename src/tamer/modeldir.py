"""Check a local Hugging Face model directory before loading it, and say in one line what
is missing.

    check_model_dir("path/to/model")    # ModelDirError naming the file, or nothing
    with model_dir_errors("path/to/model"):
        AutoModelForCausalLM.from_pretrained(...)   # a loader's failure -> one line

Without these, a directory with `config.json` but no weights, or a `config.json` that is
not a model config, fails deep inside `transformers` with a long traceback that can blame
something unrelated (a missing sentencepiece, say). Checked, in order: `config.json` is a
JSON object with a `model_type`; weights exist (safetensors or PyTorch, single or sharded,
every shard an index names present); a tokenizer exists.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tamer.errors import RunError

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ModelDirError(RunError):
    """A model directory cannot be loaded; the message names what is missing or broken."""


class ModelDirNotFound(ModelDirError, FileNotFoundError):
    """No directory, or no config.json in it (also a FileNotFoundError, as callers expect)."""


def check_model_dir(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise ModelDirNotFound(f"{path}: no such model directory")
    config = path / "config.json"
    if not config.is_file():
        raise ModelDirNotFound(f"{path}: not a Hugging Face model directory (no config.json)")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ModelDirError(f"{config}: not valid JSON ({_first_line(err)})") from None
    if not isinstance(data, dict) or not data.get("model_type"):
        raise ModelDirError(f"{config}: not a model config (no \"model_type\")")
    _check_weights(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelDirError(f"{path}: no tokenizer ({' or '.join(TOKENIZER_FILES[:2])})")
    return path


def _check_weights(path: Path) -> None:
    if any((path / name).is_file() for name in WEIGHT_FILES):
        return
    for index_name in WEIGHT_INDEXES:
        index = path / index_name
        if not index.is_file():
            continue
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ModelDirError(f"{index}: not a valid weight index ({_first_line(err)})") from None
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ModelDirError(f"{path}: weight shard {missing[0]} is missing"
                                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        return
    raise ModelDirError(f"{path}: no model weights ({', '.join(WEIGHT_FILES + WEIGHT_INDEXES[:1])})")


@contextmanager
def model_dir_errors(path: str | os.PathLike) -> Iterator[None]:
    """A loader's failure (truncated weights, an unknown architecture, ...) as one line about `path`."""
    try:
        yield
    except (OSError, ValueError, KeyError, ImportError, RuntimeError) as err:
        raise ModelDirError(f"{path}: cannot be loaded ({type(err).__name__}: {_first_line(err)})") from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__
