"""Writing a run's files safely: checks before training, one-line disk errors, atomic
directories, strict JSON.

    preflight("runs/pens", model)              # StorageError now, not 14 s into training
    with atomic_directory("runs/pens/rl/model") as tmp:
        model.save_pretrained(tmp)             # `model/` appears complete, or not at all
    with storage_errors("runs/pens/rl"):       # OSError(ENOSPC) -> StorageError, one line
        ...
    strict_dumps({"loss": float("nan")})       # '{"loss": null}'

Disk and permission failures become `StorageError` naming the path and the cause:

    error: runs/pens/rl/model: cannot write the model: no space left on device (12.0 MB free)

`preflight` checks, before any work, that the output directory can be created and written
and that its filesystem has room for one checkpoint (weights plus two AdamW moments,
estimated from the model's parameters). A save that fails midway leaves no partial
directory: `atomic_directory` builds the content in a hidden sibling and renames it into
place only once everything is written and flushed.

JSON written by tamer (metrics.jsonl, summary.json) is strict: NaN and ±inf, which JSON
has no literal for, are written as `null`.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tamer.errors import RunError

# errno values that mean "the disk or the permissions", not a bug.
STORAGE_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                  errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
                  errno.EROFS: "read-only file system"}
# How torch and safetensors report a failed write, without an errno.
_WRITE_FAILURE_MARKERS = ("PytorchStreamWriter", "inline_container", "unexpected pos", "file write failed",
                          "StorageFull", "No space left")
_MB = 1024 * 1024


class StorageError(RunError):
    """A file or directory cannot be written: permission, read-only, no space."""


# ---------------------------------------------------------------------------- checks before work
def checkpoint_bytes(model: Any, optimizer_moments: int = 2) -> int:
    """Bytes one checkpoint of `model` takes: weights, plus `optimizer_moments` copies (AdamW), plus 1 MiB."""
    params = {id(p): p for p in model.parameters()}.values()
    weights = sum(p.numel() * p.element_size() for p in params)
    return weights * (1 + optimizer_moments) + _MB


def _existing_ancestor(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | os.PathLike) -> int:
    return shutil.disk_usage(_existing_ancestor(Path(path))).free


def check_writable(directory: str | os.PathLike) -> Path:
    """Create `directory` if needed and write (then remove) a probe file in it."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".tamer-write-test-{uuid.uuid4().hex[:8]}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, b"x")
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as err:
        where = Path(err.filename) if err.filename else directory
        raise StorageError(f"{where}: the output directory is not writable ({_cause(err, where)})") from None
    return directory


def check_free_space(directory: str | os.PathLike, need: int, what: str = "one checkpoint") -> None:
    free = free_bytes(directory)
    if free < need:
        raise StorageError(f"{directory}: not enough free space: {free / _MB:.1f} MB free, "
                           f"{what} needs about {need / _MB:.1f} MB")


def preflight(directory: str | os.PathLike, model: Any = None) -> None:
    """Before training: `directory` writable, and room for one checkpoint of `model`."""
    check_writable(directory)
    if model is not None:
        check_free_space(directory, checkpoint_bytes(model))


# ---------------------------------------------------------------------------- errors while writing
def _cause(err: BaseException, path: Path) -> str:
    number = getattr(err, "errno", None)
    text = str(err)
    if number == errno.ENOSPC or any(m in text for m in ("StorageFull", "No space left")):
        return f"no space left on device ({free_bytes(path) / _MB:.1f} MB free)"
    if number in STORAGE_ERRNOS:
        return STORAGE_ERRNOS[number]
    if isinstance(err, OSError) and err.strerror:
        return err.strerror.lower()
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    # torch reports a full disk as a bare position mismatch; say what it most likely is.
    return f"write failed ({first[:120]}); is the disk full? {free_bytes(path) / _MB:.1f} MB free"


def is_storage_failure(err: BaseException) -> bool:
    if isinstance(err, OSError) and err.errno in STORAGE_ERRNOS:
        return True
    return isinstance(err, (OSError, RuntimeError)) and any(m in str(err) for m in _WRITE_FAILURE_MARKERS)


def as_storage_error(err: BaseException, path: str | os.PathLike, what: str) -> BaseException:
    """`err` as a one-line StorageError about writing `what` at `path`; other errors unchanged."""
    if isinstance(err, StorageError) or not is_storage_failure(err):
        return err
    where = Path(err.filename) if isinstance(err, OSError) and err.filename else Path(path)
    new = StorageError(f"{where}: cannot write {what}: {_cause(err, where)}")
    new.__cause__ = err
    return new


@contextmanager
def storage_errors(path: str | os.PathLike, what: str = "the run's files") -> Iterator[None]:
    """Turn disk and permission failures inside the block into StorageError."""
    try:
        yield
    except Exception as err:
        translated = as_storage_error(err, path, what)
        if translated is err:
            raise
        raise translated from err


@contextmanager
def atomic_directory(final: str | os.PathLike, what: str = "the model") -> Iterator[Path]:
    """Yield a fresh hidden sibling of `final`; on success it replaces `final` in one rename.

    On failure the sibling is removed and `final` (an older save, or nothing) is untouched.
    """
    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        yield tmp
        fsync_tree(tmp)
        old = None
        if final.exists():  # rename() cannot replace a non-empty directory: move the old one aside
            old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        translated = as_storage_error(err, final, what)
        if translated is err:
            raise
        raise translated from err


def fsync_tree(root: Path) -> None:
    """Flush every file and directory under `root` to disk before it becomes visible."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    """Make renames inside `path` durable (POSIX; Windows cannot open directories)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file written line by line: a torn last line (the writer died
    mid-line) is skipped; a bad line elsewhere is an error naming the file and line."""
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not valid JSON: {err}") from err
    return records


# ---------------------------------------------------------------------------- strict JSON
def finite_or_null(value: Any) -> Any:
    """`value` with every NaN/±inf float (at any depth) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def strict_dumps(value: Any, **kwargs: Any) -> str:
    """json.dumps that never writes NaN/Infinity (they become null)."""
    return json.dumps(finite_or_null(value), allow_nan=False, **kwargs)


def write_json(path: str | os.PathLike, data: dict[str, Any]) -> Path:
    """Write `data` as strict, indented JSON, atomically (temp file + rename)."""
    path = Path(path)
    with storage_errors(path, "a JSON file"):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            tmp.write_text(strict_dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
    return path
