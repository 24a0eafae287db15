"""Preference pairs for reward models: local JSONL/JSON/Parquet files or a Hugging Face dataset.

Each row holds a prompt and two replies to it, the one a labeller preferred and the one
they rejected, and optionally a margin (how strongly the first was preferred):

    {"prompt": "7 kg + 5 kg", "chosen": "<answer>12 kg</answer>", "rejected": "<answer>12</answer>", "margin": 1.0}

The prompt may also be a list of chat messages, and a reply a list of messages ending
with the assistant's (the conversational layout TRL and many hub datasets use). Malformed
rows fail before training with the file and row, as task datasets do:

    DatasetError: prefs.jsonl, row 17: missing or empty column 'rejected'

    train, heldout = load_preference_pairs(PreferenceDataConfig(path="prefs.jsonl"))
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tamer.config import PATH, FieldError
from tamer.tasks.dataset import DatasetError, load_rows


@dataclass(frozen=True)
class PreferenceDataConfig:
    """Where preference pairs come from, and which columns hold what."""

    path: str = field(default="", metadata=PATH)  # local .jsonl/.json/.parquet file (relative to the YAML file)
    heldout_path: str = field(default="",  # a separate held-out file;
                              metadata=PATH)  # else `heldout_fraction` of the training rows
    hf_dataset: str = ""  # instead of `path`: a Hugging Face dataset name or local dataset directory
    hf_config: str = ""  # the dataset's configuration (subset), if it has several
    hf_split: str = "train"  # the dataset split to train on
    hf_heldout_split: str = ""  # e.g. "test"; else `heldout_fraction` of `hf_split`
    prompt_column: str = "prompt"  # column holding the prompt (text or chat messages)
    chosen_column: str = "chosen"  # column holding the preferred reply
    rejected_column: str = "rejected"  # column holding the other reply
    margin_column: str = ""  # optional column of margins (numbers >= 0); "" = no margin
    system_prompt: str = ""  # prepended as a system message to text prompts
    heldout_fraction: float = 0.1  # share of the rows held out when there is no held-out file or split
    max_rows: int = 0  # 0: every row
    seed: int = 0  # which rows are held out

    def __post_init__(self) -> None:
        if not 0.0 < self.heldout_fraction < 1.0:
            raise FieldError("heldout_fraction", "expected a fraction in (0, 1)")
        if self.path and self.hf_dataset:
            raise FieldError("path", "give either path or hf_dataset, not both")
        if self.max_rows < 0:
            raise FieldError("max_rows", "expected >= 0")


@dataclass(frozen=True)
class PreferencePair:
    """One labelled comparison: `chosen` was preferred to `rejected` as a reply to `messages`."""

    messages: tuple[dict[str, str], ...]  # the prompt as chat messages
    chosen: str
    rejected: str
    margin: float = 0.0
    source: str = ""  # "file, row N": where the pair came from, for messages


def load_preference_pairs(config: PreferenceDataConfig) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, held-out) pairs, checked row by row; deterministic for a given config."""
    if config.hf_dataset:
        pairs = _pairs(config, config.hf_dataset, _hf_rows(config, config.hf_split))
        held = _pairs(config, config.hf_dataset, _hf_rows(config, config.hf_heldout_split)) \
            if config.hf_heldout_split else None
    elif config.path:
        pairs = _pairs(config, config.path, load_rows(Path(config.path)))
        held = _pairs(config, config.heldout_path, load_rows(Path(config.heldout_path))) \
            if config.heldout_path else None
    else:
        raise DatasetError("rm.data: give the path of a preference file (rm.data.path) or rm.data.hf_dataset")
    if held is not None:
        return pairs, held
    order = list(range(len(pairs)))
    random.Random(config.seed).shuffle(order)
    n_held = max(1, round(len(pairs) * config.heldout_fraction))
    if n_held >= len(pairs):
        raise DatasetError(f"{config.path or config.hf_dataset}: {len(pairs)} pairs are too few to hold some out")
    return [pairs[i] for i in order[n_held:]], [pairs[i] for i in order[:n_held]]


def _hf_rows(config: PreferenceDataConfig, split: str) -> list[dict]:
    import datasets  # slow to import; only this loader needs it

    datasets.disable_progress_bars()
    saved = Path(config.hf_dataset)
    try:
        if (saved / "state.json").is_file() or (saved / "dataset_dict.json").is_file():  # save_to_disk output
            ds = datasets.load_from_disk(str(saved))
            ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        else:  # a hub name, or a local directory of data files
            ds = datasets.load_dataset(config.hf_dataset, config.hf_config or None, split=split)
    except Exception as err:
        raise DatasetError(f"{config.hf_dataset} (split {split!r}): could not be loaded: {err}") from None
    return ds.to_list()


def _pairs(config: PreferenceDataConfig, where: str, rows: list[dict]) -> list[PreferencePair]:
    if config.max_rows:
        rows = rows[: config.max_rows]
    if not rows:
        raise DatasetError(f"{where}: no rows")
    return [pair_from_row(config, row, f"{where}, row {number}") for number, row in enumerate(rows, start=1)]


def pair_from_row(config: PreferenceDataConfig, row: Any, source: str) -> PreferencePair:
    """One row as a `PreferencePair`; `source` ("file, row N") starts every error message."""
    if not isinstance(row, dict):
        raise DatasetError(f"{source}: expected an object with columns, got {type(row).__name__}")
    messages = _prompt(config, row.get(config.prompt_column), source)
    chosen = _reply(row.get(config.chosen_column), config.chosen_column, source)
    rejected = _reply(row.get(config.rejected_column), config.rejected_column, source)
    if chosen == rejected:
        raise DatasetError(f"{source}: chosen and rejected replies are identical (a pair teaches nothing)")
    margin = 0.0
    if config.margin_column:
        value = row.get(config.margin_column)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
            raise DatasetError(f"{source}: column {config.margin_column!r} must be a number >= 0, got {value!r}")
        margin = float(value)
    return PreferencePair(messages, chosen, rejected, margin, source)


def _prompt(config: PreferenceDataConfig, value: Any, source: str) -> tuple[dict[str, str], ...]:
    column = config.prompt_column
    if isinstance(value, str) and value.strip():
        system = ({"role": "system", "content": config.system_prompt},) if config.system_prompt else ()
        return system + ({"role": "user", "content": value},)
    if isinstance(value, list) and value:
        return tuple(_message(m, column, i, source) for i, m in enumerate(value))
    raise DatasetError(f"{source}: missing or empty column {column!r} (text or a list of chat messages)")


def _reply(value: Any, column: str, source: str) -> str:
    """A reply as text: a string, or the content of the last (assistant) message of a list."""
    if isinstance(value, list) and value:
        last = _message(value[-1], column, len(value) - 1, source)
        if last["role"] != "assistant":
            raise DatasetError(f"{source}: column {column!r}: the last message must be the assistant's, "
                               f"got role {last['role']!r}")
        value = last["content"]
    if not isinstance(value, str) or not value.strip():
        raise DatasetError(f"{source}: missing or empty column {column!r} (text or a list of chat messages)")
    return value


def _message(message: Any, column: str, index: int, source: str) -> dict[str, str]:
    if (not isinstance(message, dict) or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)):
        raise DatasetError(f"{source}: column {column!r}, message {index}: expected {{'role': ..., 'content': ...}}")
    return {"role": message["role"], "content": message["content"]}
