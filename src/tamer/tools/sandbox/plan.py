"""The plan handed to the forked child: computed in the parent, before the fork.

Everything that needs lookups (the interpreter's directories, the home directory, a network
namespace to reuse, the user's task count) is done here, so that the child, which runs between
fork and exec, only acts on a frozen `ChildPlan`.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import resource
import shutil
import stat
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from tamer.tools.sandbox import linux
from tamer.tools.sandbox.config import PARENT_SIDE, SandboxConfig
from tamer.tools.sandbox.linux import CLONE_NEWNET

_PRIVATE_TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
_HIDDEN_DIRS = ("/run",)  # host sockets (D-Bus, container runtimes) live here; IP isolation misses them
_NEVER_HIDE = {"/", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/proc", "/sys", "/dev"}


@dataclass(frozen=True)
class MountPlan:
    hide: tuple[str, ...]  # directories covered by an empty tmpfs
    private_tmp: tuple[str, ...]  # directories replaced by a fresh, size-capped tmpfs
    expose_ro: tuple[str, ...]  # interpreter trees bound back (read-only) where covered
    workdir: str
    owner: int | None  # the run's uid, to own the workdir's copy
    tmpfs_mb: int


@dataclass(frozen=True)
class ChildPlan:
    workdir: str
    uid: int | None
    isolate_net: bool
    netns_fd: int | None  # an empty network namespace reserved for this uid, to join
    mounts: MountPlan | None
    interpreter_visible: bool  # can an unprivileged uid reach the interpreter without mounts?
    rlimits: tuple[tuple[str, int, int], ...]  # (name, resource, value); RLIMIT_AS comes last
    require: tuple[str, ...]
    report_fd: int
    pid_namespace: bool = True  # the run's processes in their own PID namespace, with a reaper (reaper.py)
    parent_pid: int = field(default_factory=os.getpid)


def make_plan(config: SandboxConfig, workdir: str, uid: int | None, report_fd: int) -> ChildPlan:
    exposed, blocked = _interpreter_view(config.python)
    mounts = None
    if config.isolate_filesystem:
        hide = {*blocked, *filter(None, [_blocking_ancestor(workdir)]), *_home_to_hide(),
                *(p for p in _HIDDEN_DIRS if _real_dir(p))}
        tmp = tuple(p for p in _PRIVATE_TMP_DIRS if _real_dir(p))
        mounts = MountPlan(tuple(sorted(hide)), tmp, exposed, workdir, uid, config.tmpfs_mb)
    isolate_net = config.network == "isolate"
    netns_fd = _netns_for(uid) if isolate_net and uid is not None else None
    return ChildPlan(
        workdir, uid, isolate_net, netns_fd, mounts, not blocked,
        _rlimits(config, uid), tuple(r for r in config.require if r not in PARENT_SIDE), report_fd,
        config.pid_namespace)


def _rlimits(config: SandboxConfig, uid: int | None) -> tuple[tuple[str, int, int], ...]:
    cpu = int(-(-(config.cpu_time_s or config.timeout_s) // 1))  # ceil: rlimits are whole seconds
    # RLIMIT_NPROC counts every task of the real uid. With a per-run uid that is exactly this run;
    # without one it is all of the user's tasks, so the budget goes on top of what already runs.
    nproc = config.max_processes + (0 if uid is not None else _count_tasks(os.getuid()))
    mib = 1024 * 1024
    return (
        ("rlimit_core", resource.RLIMIT_CORE, 0),
        ("rlimit_cpu", resource.RLIMIT_CPU, cpu),
        ("rlimit_nproc", resource.RLIMIT_NPROC, nproc),
        ("rlimit_fsize", resource.RLIMIT_FSIZE, config.max_file_size_mb * mib),
        ("rlimit_nofile", resource.RLIMIT_NOFILE, config.max_open_files),
        ("rlimit_as", resource.RLIMIT_AS, config.memory_mb * mib),
    )


def _real_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path)


@lru_cache(maxsize=16)
def _interpreter_view(python: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The interpreter's trees, and the directories that keep other users out of them."""
    exposed = _interpreter_paths(python)
    return exposed, tuple(sorted({p for p in map(_blocking_ancestor, exposed) if p}))


def _interpreter_paths(python: str) -> tuple[str, ...]:
    """Directory trees the interpreter reads at startup and import time (prefix, venv, base)."""
    exe = shutil.which(python) or python
    paths = {os.path.dirname(os.path.dirname(p)) for p in (os.path.abspath(exe), os.path.realpath(exe))}
    cfg = Path(os.path.dirname(os.path.dirname(os.path.abspath(exe))), "pyvenv.cfg")
    if cfg.is_file():
        for line in cfg.read_text(errors="replace").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home" and value.strip():
                home = value.strip()
                paths |= {os.path.dirname(home), os.path.dirname(os.path.realpath(home))}
    if os.path.realpath(exe) == os.path.realpath(sys.executable):
        paths |= {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    return tuple(sorted(p for p in paths if os.path.isdir(p) and p not in _NEVER_HIDE))


def _blocking_ancestor(path: str) -> str | None:
    """The topmost directory above `path` that other users cannot traverse, if any."""
    for parent in reversed(Path(path).parents):
        try:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return None if str(parent) in _NEVER_HIDE else str(parent)
        except OSError:
            return None
    return None


@lru_cache(maxsize=1)
def _home_to_hide() -> tuple[str, ...]:
    try:
        home = os.path.realpath(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:
        return ()
    return (home,) if os.path.isdir(home) and home not in _NEVER_HIDE else ()


_NETNS: dict[int, int | None] = {}  # uid -> fd of an empty network namespace kept for its runs
_NETNS_LOCK = threading.Lock()


def _netns_for(uid: int) -> int | None:
    """Creating a network namespace costs ~10 ms of kernel work per run; joining one is nearly
    free. Runs of one uid are sequential (the lease) and none of their processes outlives its run,
    so reusing the uid's namespace carries nothing between runs, and concurrent runs never share."""
    with _NETNS_LOCK:
        if uid not in _NETNS:
            _NETNS[uid] = _new_netns()
        return _NETNS[uid]


def _new_netns() -> int | None:
    def unshare_net() -> None:
        if not linux.unshare(CLONE_NEWNET):
            raise OSError(ctypes.get_errno(), "linux.unshare(CLONE_NEWNET)")

    try:  # `cat` waits on stdin, which keeps the holder alive until we have opened its namespace
        holder = subprocess.Popen([shutil.which("cat") or "/bin/cat"], stdin=subprocess.PIPE,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=unshare_net)
    except (OSError, subprocess.SubprocessError):
        return None
    try:
        return os.open(f"/proc/{holder.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    finally:
        holder.stdin.close()
        holder.wait()


def _count_tasks(uid: int) -> int:
    """Tasks (threads included, as RLIMIT_NPROC counts them) whose real uid is `uid`."""
    count = 0
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            text = Path(f"/proc/{name}/status").read_bytes()
            if int(text.split(b"\nUid:\t", 1)[1].split(b"\t", 1)[0]) == uid:
                count += int(text.split(b"\nThreads:\t", 1)[1].split(b"\n", 1)[0])
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
    return count
