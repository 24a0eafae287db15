"""One sandboxed run: lease a uid (as root), make a fresh workdir, write the files, execute.

`run_python` and `run_file` are the public entry points; the package re-exports them.
"""

from __future__ import annotations

import fcntl
import grp
import os
import pwd
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache, lru_cache
from pathlib import Path

from tamer.tools.sandbox.config import SandboxConfig, SandboxError, SandboxResult
from tamer.tools.sandbox.supervise import execute, sweep_uid

# Between systemd's container range (60001-60513) and its DynamicUser range (61184-65519), and
# below 65536 so it also works inside user-namespaced containers that map only 16-bit ids.
_UID_RANGE = range(60514, 61184)
# Each host process scans the range from its own random start: its own runs reuse the same few
# uids (and their network namespaces), while concurrent host processes rarely contend.
_UID_START = int.from_bytes(os.urandom(2), "little") % len(_UID_RANGE)


def run_python(
    code: str,
    config: SandboxConfig = SandboxConfig(),
    *,
    stdin: str = "",
    files: dict[str, str] | None = None,
) -> SandboxResult:
    """Run `code` as main.py in a fresh sandbox; `files` (relative path -> text) are written beside it."""
    if files and "main.py" in files:
        raise ValueError("files must not contain 'main.py'; pass the program as code")
    with _lease_uid(config) as uid, _workdir(uid) as workdir:
        _write_files(workdir, {**(files or {}), "main.py": code}, uid)
        return execute(config, workdir, uid, stdin.encode())


def run_file(
    path: str | os.PathLike,
    config: SandboxConfig = SandboxConfig(),
    *,
    stdin: str = "",
    files: dict[str, str] | None = None,
) -> SandboxResult:
    """Run the Python file at `path` (copied into the sandbox as main.py)."""
    return run_python(Path(path).read_text(encoding="utf-8"), config, stdin=stdin, files=files)


@contextmanager
def _lease_uid(config: SandboxConfig) -> Iterator[int | None]:
    """Hold an exclusive, per-run uid (as root), so limits, permissions and the final sweep apply
    to this run alone. A lock file per uid makes leases exclusive across threads and processes;
    its content marks a lease whose holder died before sweeping, so the next holder sweeps first."""
    if not (config.drop_privileges and os.geteuid() == 0):
        yield None
        return
    lock_dir = _lock_dir()
    for i in range(len(_UID_RANGE)):
        uid = _UID_RANGE[(_UID_START + i) % len(_UID_RANGE)]
        if _id_taken(uid):
            continue
        fd = os.open(os.path.join(lock_dir, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            if os.pread(fd, 1, 0) == b"1":
                sweep_uid(uid)
            os.pwrite(fd, b"1", 0)
            try:
                yield uid  # execute sweeps the uid before the workdir is removed
            except BaseException:
                sweep_uid(uid)
                os.pwrite(fd, b"0", 0)
                raise
            os.pwrite(fd, b"0", 0)
        finally:
            os.close(fd)  # releases the lock
        return
    raise SandboxError(f"all {len(_UID_RANGE)} sandbox uids are in use")


def _lock_dir() -> str:
    path = "/run/tamer-sandbox" if os.access("/run", os.W_OK) else os.path.join(
        tempfile.gettempdir(), f"tamer-sandbox-locks-{os.geteuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise SandboxError(f"refusing lock directory {path}: not a private directory of ours")
    return path


@cache
def _id_taken(uid: int) -> bool:
    """A uid or gid the system already assigns must never be borrowed."""
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return True
        except KeyError:
            pass
    return False


_WORKDIR_PREFIX = "tamer-sbx-"


@lru_cache(maxsize=1)
def sweep_stale_workdirs() -> list[str]:
    """Remove workdirs left by supervisors that died (once per process, at its first run).

    A workdir is named `tamer-sbx-<supervisor pid>-<random>`; one whose supervisor is no longer
    running is stale. Normally the run's reaper removes it even then (reaper.py); this catches
    what it could not (no PID namespace here, or the reaper was killed too)."""
    removed = []
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        if not name.startswith(_WORKDIR_PREFIX):
            continue
        pid = name[len(_WORKDIR_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        try:
            info = os.lstat(os.path.join(root, name))
        except OSError:
            continue
        # Only real directories made by a sandbox of ours: owned by us, or by a sandbox uid.
        if stat.S_ISDIR(info.st_mode) and (info.st_uid == os.geteuid() or info.st_uid in _UID_RANGE):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


@contextmanager
def _workdir(uid: int | None) -> Iterator[str]:
    sweep_stale_workdirs()
    path = tempfile.mkdtemp(prefix=f"{_WORKDIR_PREFIX}{os.getpid()}-")
    try:
        if uid is not None:
            os.chown(path, uid, uid)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)  # fd-based: safe against planted symlinks


def _write_files(workdir: str, files: dict[str, str], uid: int | None) -> None:
    for rel, text in files.items():
        parts = Path(rel).parts
        if Path(rel).is_absolute() or ".." in parts or not parts:
            raise ValueError(f"files key {rel!r} must be a relative path inside the workdir")
        target = Path(workdir, rel)
        for parent in reversed(target.relative_to(workdir).parents[:-1]):
            (Path(workdir) / parent).mkdir(exist_ok=True)
            if uid is not None:
                os.chown(Path(workdir) / parent, uid, uid)
        target.write_text(text, encoding="utf-8")
        if uid is not None:
            os.chown(target, uid, uid)
