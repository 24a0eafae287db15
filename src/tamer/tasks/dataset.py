"""Tasks from the user's own local files: JSONL, JSON or Parquet, read with `datasets`.

Each row needs a prompt and a reference answer (column names configurable); an optional
completion column holds demonstrations for SFT. Malformed rows fail with the file and the
row number, before any training starts.

    {"prompt": "What is the capital of France?", "answer": "Paris"}
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tamer.config import PATH, FieldError
from tamer.tasks.base import TASK_SOURCES, Task, format_answer

SUFFIX_TO_BUILDER = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class DatasetError(ValueError):
    """A data file is missing or malformed; the message names the file and row."""


@dataclass(frozen=True)
class DatasetConfig:
    """A local dataset of prompt/answer rows."""

    path: str = field(default="", metadata=PATH)  # JSONL/JSON/Parquet file of rows (relative to the YAML file)
    heldout_path: str = field(default="", metadata=PATH)  # a separate held-out file; else `heldout_fraction` of `path`
    prompt_column: str = "prompt"  # column holding the user message
    answer_column: str = "answer"  # column holding the reference answer
    completion_column: str = "completion"  # demonstrations for SFT, used when present
    system_prompt: str = ""  # a system message before every prompt ("" for none)
    heldout_fraction: float = 0.1  # share of `path`'s rows held out when there is no `heldout_path`
    seed: int = 0  # which rows are held out

    def __post_init__(self) -> None:
        if not 0.0 < self.heldout_fraction < 1.0:
            raise FieldError("heldout_fraction", f"expected a fraction in (0, 1), got {self.heldout_fraction}")


def load_rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    builder = SUFFIX_TO_BUILDER.get(path.suffix.lower())
    if builder is None:
        raise DatasetError(f"{path}: unsupported file type; use one of {sorted(SUFFIX_TO_BUILDER)}")
    if builder == "json":
        _check_json_lines(path)
    import datasets  # imported lazily: it is slow to import and only this loader needs it

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as err:
        raise DatasetError(f"{path}: could not be read as {builder}: {err}") from None
    return ds.to_list()


def iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(row number, parsed value) for each non-blank line; a broken line names file and row."""
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{path}, row {number}: invalid JSON ({err.msg})") from None


def _check_json_lines(path: Path) -> None:
    """Pinpoint a broken JSONL line before `datasets` reports it without a row number."""
    if path.suffix.lower() != ".jsonl":
        return
    for number, row in iter_jsonl(path):
        if not isinstance(row, dict):
            raise DatasetError(f"{path}, row {number}: expected a JSON object, got {type(row).__name__}")


@TASK_SOURCES.register("dataset")
class DatasetTasks:
    """Prompt/answer rows from local files as tasks."""

    name = "dataset"

    def __init__(self, config: DatasetConfig) -> None:
        if not config.path:
            raise DatasetError("task.dataset.path: give the path of a JSONL or Parquet file")
        self.config = config

    def _tasks(self, path: Path) -> list[Task]:
        rows = load_rows(path)
        return [self._task(path, i, row) for i, row in enumerate(rows, start=1)]

    def _task(self, path: Path, number: int, row: dict) -> Task:
        cfg = self.config
        for column in (cfg.prompt_column, cfg.answer_column):
            value = row.get(column)
            if value is None or (isinstance(value, str) and not value.strip()):
                raise DatasetError(f"{path}, row {number}: missing or empty column {column!r}")
        prompt = row[cfg.prompt_column]
        if not isinstance(prompt, str):
            raise DatasetError(f"{path}, row {number}: column {cfg.prompt_column!r} must be text")
        messages = ({"role": "system", "content": cfg.system_prompt},) if cfg.system_prompt else ()
        messages += ({"role": "user", "content": prompt},)
        completion = row.get(cfg.completion_column)
        meta = {"row": number, "file": str(path)}
        if isinstance(completion, str) and completion.strip():
            meta["completion"] = completion
        return Task(id=f"{path.name}:{number}", messages=messages, answer=str(row[cfg.answer_column]), meta=meta)

    def split(self) -> tuple[list[Task], list[Task]]:
        tasks = self._tasks(Path(self.config.path))
        if self.config.heldout_path:
            return tasks, self._tasks(Path(self.config.heldout_path))
        order = list(range(len(tasks)))
        random.Random(self.config.seed).shuffle(order)
        n_held = max(1, round(len(tasks) * self.config.heldout_fraction))
        if n_held >= len(tasks):
            raise DatasetError(f"{self.config.path}: {len(tasks)} rows are too few to hold some out")
        return [tasks[i] for i in order[n_held:]], [tasks[i] for i in order[:n_held]]

    def demonstrate(self, task: Task, rng: random.Random) -> str:
        return task.meta.get("completion") or format_answer(task.answer)
