"""Resuming a run: which checkpoint, what if there is none, what if the newest is damaged.

    if wants_resume(ckpt_dir, resume):              # resume: False | True | "if-exists"
        path, step = resume_latest(ckpt_dir, trainer.resume, report=tracker.print)

`resume=True` (`--resume`) with no checkpoint is an error naming the directory, never a
silent start from step 0; `"if-exists"` (`--resume-if-exists`) resumes when there is a
checkpoint and starts fresh otherwise.

The newest checkpoint is tried first. One whose files cannot be read (a truncated or
garbled `trainer_state.pt` or weights file) is reported, renamed to `step-NNNNNN.corrupt`
so it is never picked again, and the previous intact one is used. A checkpoint that reads
fine but does not fit the model (another model or config) is not corruption: that stops
the run with a one-line error and renames nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from tamer.checkpoint import (
    LATEST,
    STEP_DIR,
    TRAINER_STATE,
    CheckpointError,
    CorruptCheckpointError,
    _step_dirs,
    _step_of,
)
from tamer.errors import RunError

RESUME_MODES = (False, True, "if-exists")
CORRUPT_SUFFIX = ".corrupt"


class ResumeError(RunError):
    """Nothing to resume from, or no checkpoint that fits."""


def candidates(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints, the one `latest` names first, then by step, newest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    complete = sorted((p for p in _step_dirs(ckpt_dir) if (p / TRAINER_STATE).is_file()), key=_step_of, reverse=True)
    pointer = ckpt_dir / LATEST
    if pointer.is_file():
        named = ckpt_dir / pointer.read_text(encoding="utf-8").strip()
        if STEP_DIR.match(named.name) and named in complete:
            complete.remove(named)
            complete.insert(0, named)
    return complete


def wants_resume(ckpt_dir: str | os.PathLike, resume: bool | str) -> bool:
    """Whether to resume; ResumeError when `resume` is True and there is no checkpoint."""
    if resume not in RESUME_MODES:
        raise ValueError(f"resume: expected one of {RESUME_MODES}, got {resume!r}")
    if not resume:
        return False
    if candidates(ckpt_dir):
        return True
    if resume == "if-exists":
        return False
    raise ResumeError(f"{ckpt_dir}: no checkpoint to resume from; run without --resume to start fresh, "
                      "or use --resume-if-exists")


def resume_latest(ckpt_dir: str | os.PathLike, load: Callable[[Path], int],
                  report: Callable[[str], None] = print) -> tuple[Path, int]:
    """Load the newest readable checkpoint with `load(path) -> step`; returns (path, step)."""
    damaged: list[str] = []
    for path in candidates(ckpt_dir):
        try:
            return path, load(path)
        except CorruptCheckpointError as err:
            moved = quarantine(path)
            damaged.append(path.name)
            report(f"checkpoint {path} is damaged ({_first_line(err)}); moved to {moved.name}, "
                   "trying the previous one")
        except CheckpointError as err:
            raise ResumeError(f"{path}: cannot resume: {_first_line(err)}") from err
    raise ResumeError(f"{ckpt_dir}: no intact checkpoint to resume from"
                      + (f" (damaged: {', '.join(damaged)})" if damaged else ""))


def quarantine(path: Path) -> Path:
    """Rename a damaged checkpoint out of the `step-*` namespace (kept for inspection)."""
    target = path.with_name(path.name + CORRUPT_SUFFIX)
    n = 1
    while target.exists():
        target, n = path.with_name(f"{path.name}{CORRUPT_SUFFIX}{n}"), n + 1
    os.rename(path, target)
    return target


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


def resume_trainer(trainer, ckpt_dir: str | os.PathLike, tracker) -> int:
    """Resume `trainer` (anything with `.resume(path) -> step`) from the newest intact
    checkpoint; drop the metrics logged after it; returns the step."""
    path, step = resume_latest(ckpt_dir, trainer.resume, report=tracker.print)
    tracker.truncate_after(step)
    tracker.print(f"resumed from {path} at step {step}")
    return step


def finished_phase(phase_dir: str | os.PathLike, steps_key: str, steps: int, model) -> dict | None:
    """The summary of a phase that already ran to `steps` in `phase_dir` (its model loaded
    into `model`), or None if it did not finish: resuming a multi-phase job skips it."""
    import json

    from tamer.checkpoint import load_weights

    summary_path, model_dir = Path(phase_dir) / "summary.json", Path(phase_dir) / "model"
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    from tamer.models import is_lora_dir

    saved = (model_dir / "config.json").is_file() or is_lora_dir(model_dir)
    if summary.get("stopped") or summary.get(steps_key) != steps or not saved:
        return None
    load_weights(model_dir, model)
    return summary
