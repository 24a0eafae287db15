"""One run per output directory: an exclusive lock held for the run's whole life.

    with output_dir_lock("runs/pens"):          # LockError at once if another run holds it
        ...                                     # train, checkpoint, save

(The training jobs take it through `tamer.jobguard.guarded_job`.)

The lock is `OUTPUT_DIR/.tamer-lock`, locked with `flock`. The kernel drops an `flock` when
its holder exits in any way (SIGKILL included), so a lock never outlives its process and
there is nothing to clean up by hand. The file also names the holder (pid, host, command,
start time) so that a refused run can say who has the directory:

    error: runs/pens: in use by another run (pid 4242 on host gpu1: tamer train -c pens.yaml,
    since 2025-01-01T10:00:00); wait for it to end, stop it, or choose another --output-dir

On filesystems without `flock` (some network mounts) the lock falls back to creating the
file exclusively; a lock file left by a dead process is then recognised by its pid (same
host, process gone) and taken over. The lock is re-entrant within one process (the demo
runs SFT and RL in one directory), and the lock file is never inherited by a program the
run starts (close-on-exec).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tamer.errors import RunError

LOCK_NAME = ".tamer-lock"
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_HELD: dict[str, list[Any]] = {}  # real path -> [fd or None (fallback lock), depth]
_GUARD = threading.Lock()


class LockError(RunError):
    """Another live run holds the output directory."""


def holder_info() -> dict[str, Any]:
    """What the lock file says about its holder: this process."""
    command = " ".join([os.path.basename(sys.argv[0]) if sys.argv else "python", *sys.argv[1:]])
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "command": command[:100] + ("..." if len(command) > 100 else ""),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S")}


def describe_holder(info: dict[str, Any] | None) -> str:
    if not info:
        return "holder unknown"
    return f"pid {info.get('pid')} on host {info.get('host')}: {info.get('command') or '?'}, since {info.get('since')}"


def _read_info(path: Path) -> dict[str, Any] | None:
    try:
        text = path.read_text(encoding="utf-8").strip()
        return json.loads(text) if text else None
    except (OSError, ValueError):
        return None


def _write_info(fd: int) -> None:
    data = json.dumps(holder_info()).encode() + b"\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _busy(directory: Path, info: dict[str, Any] | None) -> LockError:
    return LockError(f"{directory}: in use by another run ({describe_holder(info)}); "
                     "wait for it to end, stop it, or choose another --output-dir")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _acquire(directory: Path) -> int | None:
    """Lock `directory`; the flock'ed fd, or None when the exclusive-create fallback was used."""
    path = directory / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise RunError(f"{directory}: cannot create the run lock file ({err.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise _busy(directory, _read_info(path)) from None
    except OSError as err:
        os.close(fd)
        if err.errno not in _NO_FLOCK:
            raise
        _acquire_by_pid(directory)
        return None
    _write_info(fd)
    return fd


def _acquire_by_pid(directory: Path) -> None:
    """Fallback: create the lock file exclusively; take over one whose holder died on this host."""
    path = directory / LOCK_NAME
    for _ in range(3):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            info = _read_info(path)
            stale = bool(info) and info.get("host") == socket.gethostname() and not _pid_alive(int(info["pid"]))
            if not stale:
                raise _busy(directory, info) from None
            path.unlink(missing_ok=True)  # its holder is gone: a stale lock
            continue
        _write_info(fd)
        os.close(fd)
        return
    raise _busy(directory, _read_info(path))


def _release(directory: Path, fd: int | None) -> None:
    path = directory / LOCK_NAME
    if fd is None:
        path.unlink(missing_ok=True)
        return
    # The file stays (unlinking a flock'ed file races with a run that has just opened it);
    # emptied, it names no holder.
    try:
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)


@contextmanager
def output_dir_lock(directory: str | os.PathLike) -> Iterator[Path]:
    """Hold the exclusive lock of `directory` (created if missing) for the `with` block."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunError(f"{directory}: cannot create the output directory ({err.strerror})") from None
    key = os.path.realpath(directory)
    with _GUARD:
        if key in _HELD:
            _HELD[key][1] += 1
        else:
            _HELD[key] = [_acquire(directory), 1]
    try:
        yield directory
    finally:
        with _GUARD:
            entry = _HELD[key]
            entry[1] -= 1
            if entry[1] == 0:
                del _HELD[key]
                _release(directory, entry[0])
