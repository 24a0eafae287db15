"""Run untrusted Python (model-written code, reward checks) in a separate, locked-down process.

    from tamer.tools.sandbox import SandboxConfig, SandboxPool, run_python

    result = run_python("print(sum(range(10)))", SandboxConfig(timeout_s=5))
    result.ok, result.stdout            # True, "45\\n"
    result.limit_hit                    # None | "timeout" | "cpu_time" | "memory" | ...
    result.protections                  # what was actually in force for this run

    with SandboxPool(max_workers=4) as pool:     # many runs at once, for rollouts and rewards
        results = pool.map(["print(1)", "while True: pass"])

Each run gets a fresh working directory (removed afterwards), a scrubbed environment, its own
process group and a wall-clock deadline. Inside the forked child, before exec, `_child_setup` adds
what the kernel and our privileges allow:
  * no network: an empty network namespace (one per concurrent uid, reused); if namespaces are
    refused, a seccomp filter that lets socket() make only AF_UNIX sockets;
  * a private mount namespace: size-capped tmpfs on /tmp (holding a copy of the workdir), /var/tmp
    and /dev/shm; the invoking user's home and /run covered by empty tmpfs (the interpreter is
    bound back read-only if it lives there); the root filesystem read-only;
  * resource limits: address space, CPU time, processes, file size, open files, no core dumps;
  * as root: a per-run unprivileged uid/gid without groups, so RLIMIT_NPROC binds, file
    permissions apply and signals to host processes are refused; no-new-privs; parent-death signal.
After the run every process of that uid is killed (`kill(-1)` from a helper running as the uid),
which also catches daemons that left the process group. What could not be set up is listed in
`SandboxResult.warnings`; `SandboxConfig.require` turns a missing layer into a `SandboxError`.
docs/sandbox.md says in plain words what this protects against and what it does not.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import grp
import json
import os
import pwd
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Iterator, Sequence

NETWORK_MODES = ("isolate", "allow")
KNOWN_PROTECTIONS = (
    "new-session", "scrubbed-env", "tmp-workdir", "isolated-python", "sweep-uid", "sweep-marker",
    "userns", "netns", "seccomp-net", "mountns", "private-tmp", "tmpfs-workdir", "hidden-dirs",
    "ro-root",
    "rlimit_as", "rlimit_cpu", "rlimit_nproc", "rlimit_fsize", "rlimit_nofile", "rlimit_core",
    "uid-drop", "no-new-privs", "pdeathsig",
)
_PARENT_SIDE = ("new-session", "scrubbed-env", "tmp-workdir", "isolated-python", "sweep-uid", "sweep-marker")
# -E -s is -I without -P: the script's directory (the fresh workdir, holding only what the caller
# passed in `files`) stays importable. -u so output printed before a kill is not lost in a buffer.
_PYTHON_FLAGS = ("-E", "-s", "-u")
# Between systemd's container range (60001-60513) and its DynamicUser range (61184-65519), and
# below 65536 so it also works inside user-namespaced containers that map only 16-bit ids.
_UID_RANGE = range(60514, 61184)
# Each host process scans the range from its own random start: its own runs reuse the same few
# uids (and their network namespaces), while concurrent host processes rarely contend.
_UID_START = int.from_bytes(os.urandom(2), "little") % len(_UID_RANGE)
_OUTPUT_KILL_FACTOR = 16  # keep max_output_bytes per stream; kill past 16x that in total
_STDERR_TAIL_BYTES = 4096  # read to name the limit that was hit, even when stderr was truncated
_POLL_S = 0.05
_PRIVATE_TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
_HIDDEN_DIRS = ("/run",)  # host sockets (D-Bus, container runtimes) live here; IP isolation misses them
_NEVER_HIDE = {"/", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/proc", "/sys", "/dev"}
_STDERR_MARKERS = (  # last-resort naming of a limit from what Python printed before dying
    ("MemoryError", "memory"), ("Cannot allocate memory", "memory"),
    ("File too large", "file_size"), ("No space left on device", "disk_space"),
    ("Too many open files", "open_files"),
    ("Resource temporarily unavailable", "processes"), ("can't start new thread", "processes"),
)


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the code inside it), or a required protection is missing."""


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and isolation for one sandboxed run. Picklable; shared by a whole pool."""

    timeout_s: float = 10.0  # wall clock, from spawn; then the whole process tree is killed
    cpu_time_s: float | None = None  # RLIMIT_CPU (SIGXCPU); None: the same as timeout_s
    memory_mb: int = 512  # RLIMIT_AS, per process (virtual address space, not RSS)
    max_processes: int = 32  # RLIMIT_NPROC for the run's uid; threads count too
    max_file_size_mb: int = 16  # RLIMIT_FSIZE
    tmpfs_mb: int = 64  # size of each private tmpfs: /tmp (holding the workdir), /var/tmp, /dev/shm
    max_open_files: int = 256  # RLIMIT_NOFILE
    max_output_bytes: int = 64 * 1024  # kept per stream; more is dropped, 16x more kills
    network: str = "isolate"  # "isolate": no network at all; "allow": the host's network
    python: str = sys.executable  # interpreter to run the code with
    drop_privileges: bool = True  # when run as root: switch to a per-run unprivileged uid
    isolate_filesystem: bool = True  # private /tmp, hidden home, read-only root (mount ns)
    require: tuple[str, ...] = ()  # protections that must be in force, else SandboxError

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if self.cpu_time_s is not None and not self.cpu_time_s > 0:
            raise ValueError(f"cpu_time_s must be > 0 or None, got {self.cpu_time_s!r}")
        for name in ("memory_mb", "max_processes", "max_file_size_mb", "tmpfs_mb", "max_open_files"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.max_output_bytes, int) or self.max_output_bytes < 0:
            raise ValueError(f"max_output_bytes must be an int >= 0, got {self.max_output_bytes!r}")
        if self.network not in NETWORK_MODES:
            raise ValueError(f"network must be one of {NETWORK_MODES}, got {self.network!r}")
        if not self.python:
            raise ValueError("python must name an interpreter, got an empty string")
        unknown = [name for name in self.require if name not in KNOWN_PROTECTIONS]
        if unknown:
            raise ValueError(f"require has unknown protections {unknown}; valid: {KNOWN_PROTECTIONS}")
        object.__setattr__(self, "require", tuple(self.require))


@dataclass(frozen=True)
class SandboxResult:
    """What happened to one run. `ok` means exit status 0 and no limit hit."""

    ok: bool
    exit_code: int | None  # None when killed by a signal
    signal: int | None  # the signal that ended the main process, if any
    timed_out: bool
    limit_hit: str | None  # None|timeout|output|cpu_time|memory|file_size|disk_space|processes|open_files
    stdout: str  # first max_output_bytes bytes, decoded as UTF-8 (errors replaced)
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    duration_s: float  # spawn to exit (or to the kill)
    protections: tuple[str, ...] = ()  # layers actually in force for this run
    warnings: tuple[str, ...] = ()  # layers asked for but not available, and why
    uid: int | None = None  # the run's unprivileged uid, when privileges were dropped

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["protections"], out["warnings"] = list(self.protections), list(self.warnings)
        return out


# ---------------------------------------------------------------------------- public entry points


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
        return _execute(config, workdir, uid, stdin.encode())


def run_file(
    path: str | os.PathLike,
    config: SandboxConfig = SandboxConfig(),
    *,
    stdin: str = "",
    files: dict[str, str] | None = None,
) -> SandboxResult:
    """Run the Python file at `path` (copied into the sandbox as main.py)."""
    return run_python(Path(path).read_text(encoding="utf-8"), config, stdin=stdin, files=files)


class SandboxPool:
    """Runs up to `max_workers` sandboxes at once. Threads suffice: the work is in child processes,
    and each run leases its own uid, so concurrent runs cannot see or signal each other."""

    def __init__(self, max_workers: int | None = None, config: SandboxConfig = SandboxConfig()):
        max_workers = max_workers or os.cpu_count() or 1
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.config = config
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="tamer-sandbox")

    def submit(self, code: str, *, stdin: str = "", files: dict[str, str] | None = None,
               config: SandboxConfig | None = None) -> Future[SandboxResult]:
        return self._executor.submit(run_python, code, config or self.config, stdin=stdin, files=files)

    def map(self, codes: Iterable[str], *, stdins: Sequence[str] | None = None) -> list[SandboxResult]:
        """Run every code; results in input order."""
        codes = list(codes)
        stdins = list(stdins) if stdins is not None else [""] * len(codes)
        if len(stdins) != len(codes):
            raise ValueError(f"stdins has {len(stdins)} entries for {len(codes)} codes")
        futures = [self.submit(code, stdin=text) for code, text in zip(codes, stdins)]
        return [future.result() for future in futures]

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# -------------------------------------------------------------------- workspace: uid and workdir


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
                _sweep_uid(uid)
            os.pwrite(fd, b"1", 0)
            try:
                yield uid  # _execute sweeps the uid before the workdir is removed
            except BaseException:
                _sweep_uid(uid)
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


@lru_cache(maxsize=None)
def _id_taken(uid: int) -> bool:
    """A uid or gid the system already assigns must never be borrowed."""
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return True
        except KeyError:
            pass
    return False


@contextmanager
def _workdir(uid: int | None) -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="tamer-sbx-")
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


# ----------------------------------------------------------------- the plan handed to the child


@dataclass(frozen=True)
class _MountPlan:
    hide: tuple[str, ...]  # directories covered by an empty tmpfs
    private_tmp: tuple[str, ...]  # directories replaced by a fresh, size-capped tmpfs
    expose_ro: tuple[str, ...]  # interpreter trees bound back (read-only) where covered
    workdir: str
    owner: int | None  # the run's uid, to own the workdir's copy
    tmpfs_mb: int


@dataclass(frozen=True)
class _ChildPlan:
    workdir: str
    uid: int | None
    isolate_net: bool
    netns_fd: int | None  # an empty network namespace reserved for this uid, to join
    mounts: _MountPlan | None
    interpreter_visible: bool  # can an unprivileged uid reach the interpreter without mounts?
    rlimits: tuple[tuple[str, int, int], ...]  # (name, resource, value); RLIMIT_AS comes last
    require: tuple[str, ...]
    report_fd: int
    parent_pid: int = field(default_factory=os.getpid)


def _plan(config: SandboxConfig, workdir: str, uid: int | None, report_fd: int) -> _ChildPlan:
    exposed, blocked = _interpreter_view(config.python)
    mounts = None
    if config.isolate_filesystem:
        hide = {*blocked, *filter(None, [_blocking_ancestor(workdir)]), *_home_to_hide(),
                *(p for p in _HIDDEN_DIRS if _real_dir(p))}
        tmp = tuple(p for p in _PRIVATE_TMP_DIRS if _real_dir(p))
        mounts = _MountPlan(tuple(sorted(hide)), tmp, exposed, workdir, uid, config.tmpfs_mb)
    isolate_net = config.network == "isolate"
    netns_fd = _netns_for(uid) if isolate_net and uid is not None else None
    return _ChildPlan(
        workdir, uid, isolate_net, netns_fd, mounts, not blocked,
        _rlimits(config, uid), tuple(r for r in config.require if r not in _PARENT_SIDE), report_fd)


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
        if not _unshare(CLONE_NEWNET):
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")

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


# ------------------------------------------------------- Linux primitives (ctypes, no dependencies)

_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded before any fork: dlopen in a child can deadlock
_LIBC.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_LIBC.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 22, 38


def _unshare(flags: int) -> bool:
    return _LIBC.unshare(flags) == 0


def _enter_netns(fd: int | None) -> bool:
    """Join the uid's reserved empty network namespace, or else create a fresh one."""
    if fd is not None and _LIBC.setns(fd, CLONE_NEWNET) == 0:
        return True
    return _unshare(CLONE_NEWNET)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    if _LIBC.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _prctl(option: int, arg: int) -> None:
    if _LIBC.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


# audit arch, socket(2), io_uring_setup(2) (io_uring can open sockets without calling socket(2))
_SECCOMP_ARCH = {"x86_64": (0xC000003E, 41, 425), "aarch64": (0xC00000B7, 198, 425)}


def _install_seccomp_no_inet() -> bool:
    """Fallback when no network namespace is allowed: socket() only for AF_UNIX; io_uring denied;
    foreign syscall ABIs (i386, x32) kill the process. Needs no-new-privs set first."""
    arch = _SECCOMP_ARCH.get(os.uname().machine)
    if arch is None:
        return False
    audit_arch, nr_socket, nr_io_uring = arch
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, deny, kill = 0x7FFF0000, 0x00050000 | 1, 0x80000000  # deny = ERRNO(EPERM)
    program = [
        (ld, 0, 0, 4), (jeq, 0, 8, audit_arch),  # arch mismatch -> kill
        (ld, 0, 0, 0), (jge, 6, 0, 0x40000000),  # x32 ABI -> kill
        (jeq, 4, 0, nr_io_uring), (jeq, 0, 2, nr_socket),
        (ld, 0, 0, 16), (jeq, 0, 1, 1),  # args[0] (low word) == AF_UNIX -> allow
        (ret, 0, 0, allow), (ret, 0, 0, deny), (ret, 0, 0, kill),
    ]
    filters = (_SockFilter * len(program))(*(_SockFilter(*ins) for ins in program))
    fprog = _SockFprog(len(program), filters)
    return _LIBC.prctl(PR_SET_SECCOMP, 2, ctypes.addressof(fprog), 0, 0) == 0


# ------------------------------------------------ child setup (forked child, before exec, as root)


def _child_setup(plan: _ChildPlan) -> None:
    """preexec_fn. Order matters: namespaces and mounts need our privileges, so they come before the
    uid drop; pdeathsig is reset by a uid change, so it comes after; RLIMIT_AS comes last because
    this forked copy of the parent may already be larger than the limit."""
    applied: list[str] = []
    warnings: list[str] = []
    try:
        _enter_namespaces(plan, applied, warnings)
        for name, which, value in plan.rlimits[:-1]:
            resource.setrlimit(which, (value, value + 1 if which == resource.RLIMIT_CPU else value))
            applied.append(name)
        _drop_privileges(plan, applied, warnings)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        applied.append("no-new-privs")
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != plan.parent_pid:
            os._exit(137)  # the parent died before pdeathsig was armed
        applied.append("pdeathsig")
        if plan.isolate_net and "netns" not in applied:
            if _install_seccomp_no_inet():
                applied.append("seccomp-net")
            else:
                warnings.append("network NOT isolated: neither a network namespace nor seccomp available")
        os.chdir(plan.workdir)  # again: the cwd set by Popen may be the copy now under a tmpfs
        missing = [name for name in plan.require if name not in applied]
        if missing:
            raise SandboxError(f"required protections {missing} not available here; in force: {applied}")
        applied.append(plan.rlimits[-1][0])
        _report(plan.report_fd, {"protections": applied, "warnings": warnings})
    except BaseException as exc:
        _report(plan.report_fd, {"error": f"{type(exc).__name__}: {exc}"})
        raise
    _name, which, value = plan.rlimits[-1]
    resource.setrlimit(which, (value, value))


def _enter_namespaces(plan: _ChildPlan, applied: list[str], warnings: list[str]) -> None:
    if os.geteuid() != 0 and (plan.isolate_net or plan.mounts) and _unshare(CLONE_NEWUSER):
        # Unprivileged: a user namespace grants the rights for the rest. Map our ids onto
        # themselves (not onto 0), so that the program loses those rights again at exec.
        uid, gid = os.geteuid(), os.getegid()
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        applied.append("userns")
    if plan.isolate_net and _enter_netns(plan.netns_fd):
        applied.append("netns")
    if plan.mounts is None:
        return
    if not _unshare(CLONE_NEWNS):
        warnings.append(f"no mount namespace ({os.strerror(ctypes.get_errno())}): host /tmp is "
                        "shared and the home directory is not hidden")
        return
    applied.append("mountns")
    _build_mounts(plan.mounts, applied, warnings)


def _build_mounts(plan: _MountPlan, applied: list[str], warnings: list[str]) -> None:
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount may propagate to the host
    # Hold what we bring back before covering it; /proc/self/fd/N still reaches it afterwards.
    held = {p: os.open(p, os.O_PATH | os.O_CLOEXEC) for p in (*plan.expose_ro, plan.workdir)}
    covered = _cover(plan.hide, "mode=755,size=1m")
    applied += ["hidden-dirs"] if covered else []
    private = _cover(plan.private_tmp, f"mode=1777,size={plan.tmpfs_mb}m")
    applied += ["private-tmp"] if private else []
    for path in plan.expose_ro:
        if any(_is_under(path, c) for c in covered):
            os.makedirs(path, exist_ok=True)
            _mount(f"/proc/self/fd/{held[path]}", path, None, MS_BIND | MS_REC)
            _remount_ro(path, warnings)
    _place_workdir(plan, f"/proc/self/fd/{held[plan.workdir]}", private, applied)
    for fd in held.values():
        os.close(fd)
    if _remount_ro("/", warnings):
        applied.append("ro-root")


def _cover(paths: Sequence[str], options: str) -> list[str]:
    covered: list[str] = []
    for path in paths:
        if not any(_is_under(path, c) for c in covered):
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, options)
            covered.append(path)
    return covered


def _place_workdir(plan: _MountPlan, source: str, private: list[str], applied: list[str]) -> None:
    """Inside a private tmpfs the workdir becomes a copy there, so what the program writes is capped
    by that tmpfs and never reaches the host's disk. Elsewhere the real one is bound onto itself, so
    it stays writable once / is read-only."""
    if not any(_is_under(plan.workdir, p) for p in private):
        os.makedirs(plan.workdir, exist_ok=True)  # in case a hidden directory now covers it
        _mount(source, plan.workdir, None, MS_BIND)
        return
    shutil.copytree(source, plan.workdir, symlinks=True, dirs_exist_ok=True)
    os.chmod(plan.workdir, 0o700)
    for root, dirs, files in os.walk(plan.workdir) if plan.owner is not None else ():
        for name in (root, *(os.path.join(root, n) for n in dirs + files)):
            os.lchown(name, plan.owner, plan.owner)
    applied.append("tmpfs-workdir")


def _remount_ro(path: str, warnings: list[str]) -> bool:
    # A remount must restate the locked flags it keeps (nosuid, nodev, noexec, atime) or fail.
    kept = os.statvfs(path).f_flag & (MS_NOSUID | MS_NODEV | 8 | 1024 | 2048)
    kept |= (1 << 21) if os.statvfs(path).f_flag & 4096 else 0  # ST_RELATIME -> MS_RELATIME
    try:
        _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)
        return True
    except OSError as exc:
        warnings.append(f"could not make {path} read-only: {exc}")
        return False


def _drop_privileges(plan: _ChildPlan, applied: list[str], warnings: list[str]) -> None:
    if plan.uid is None:
        return
    if not plan.interpreter_visible and "mountns" not in applied:
        warnings.append(f"still uid {os.getuid()}: the interpreter is not readable by other users "
                        "and no mount namespace could expose it")
        return
    os.setgroups([])
    os.setresgid(plan.uid, plan.uid, plan.uid)
    os.setresuid(plan.uid, plan.uid, plan.uid)
    applied.append("uid-drop")


def _is_under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _report(fd: int, payload: dict) -> None:
    os.write(fd, json.dumps(payload).encode())


# ------------------------------------------------------------ parent: spawn, supervise, clean up


def _execute(config: SandboxConfig, workdir: str, uid: int | None, stdin: bytes) -> SandboxResult:
    token = os.urandom(8).hex()
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
           "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TAMER_SANDBOX": token}
    parent_side = ["new-session", "scrubbed-env", "tmp-workdir", "isolated-python",
                   "sweep-uid" if uid is not None else "sweep-marker"]
    missing = [name for name in config.require if name in _PARENT_SIDE and name not in parent_side]
    if missing:
        raise SandboxError(f"required protections {missing} not available here (needs root)")
    report_r, report_w = os.pipe()  # the child says what it set up, or why it failed
    try:
        plan = _plan(config, workdir, uid, report_w)
        start = time.monotonic()
        proc = subprocess.Popen(
            [config.python, *_PYTHON_FLAGS, "main.py"], cwd=workdir, env=env,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=lambda: _child_setup(plan))
    except (OSError, subprocess.SubprocessError) as exc:
        os.close(report_w)
        detail = _read_report(report_r).get("error") or f"{type(exc).__name__}: {exc}"
        raise SandboxError(f"could not start the sandbox: {detail}") from exc
    except BaseException:
        os.close(report_w)
        os.close(report_r)
        raise
    os.close(report_w)
    report = _read_report(report_r)  # written before exec; EOF once every copy of report_w is closed
    try:
        outcome = _supervise(proc, stdin, config, start)
    finally:
        _kill_everything(proc, uid, token)
    return _result(proc.wait(), outcome, parent_side + report.get("protections", []),
                   report.get("warnings", []), uid if "uid-drop" in report.get("protections", []) else None)


def _read_report(fd: int) -> dict:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    return json.loads(b"".join(chunks) or b"{}")


class _Capture:
    """Keeps the head of a stream up to a limit, and a short tail for naming limits."""

    def __init__(self, limit: int) -> None:
        self.limit, self.total = limit, 0
        self.head, self.tail = bytearray(), bytearray()

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if len(self.head) < self.limit:
            self.head += chunk[: self.limit - len(self.head)]
        self.tail = (self.tail + chunk)[-_STDERR_TAIL_BYTES:]

    def text(self) -> str:
        return self.head.decode("utf-8", errors="replace")


@dataclass
class _Outcome:
    stdout: _Capture
    stderr: _Capture
    reason: str | None  # "timeout" | "output" when we killed the run, else None
    duration_s: float


def _supervise(proc: subprocess.Popen, stdin: bytes, config: SandboxConfig, start: float) -> _Outcome:
    """Pump stdin/stdout/stderr without blocking on any of them until the program exits, the
    deadline passes or the output passes the hard cap."""
    out, err = _Capture(config.max_output_bytes), _Capture(config.max_output_bytes)
    hard_cap = _OUTPUT_KILL_FACTOR * max(config.max_output_bytes, 4096)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    if proc.stdin is not None:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE, memoryview(stdin))
    deadline, reason = start + config.timeout_s, None
    while reason is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            reason = "timeout"
        elif not any(key.events & selectors.EVENT_READ for key in sel.get_map().values()):
            try:  # both pipes closed: only the exit is left to wait for
                proc.wait(remaining)
            except subprocess.TimeoutExpired:
                reason = "timeout"
            break
        else:
            events = sel.select(min(remaining, _POLL_S))
            for key, _ in events:
                _pump(sel, key)
            if out.total + err.total > hard_cap:
                reason = "output"
            elif not events and proc.poll() is not None:
                break  # exited, but something it left behind still holds the pipes
    duration = time.monotonic() - start
    if reason is not None:
        _killpg(proc)
    sel.close()
    return _Outcome(out, err, reason, duration)


def _pump(sel: selectors.BaseSelector, key: selectors.SelectorKey) -> None:
    if isinstance(key.data, _Capture):
        chunk = os.read(key.fd, 65536)
        if chunk:
            key.data.add(chunk)
            return
    else:
        pending: memoryview = key.data
        try:
            written = os.write(key.fd, pending[:65536])
            if written < len(pending):
                sel.modify(key.fileobj, selectors.EVENT_WRITE, pending[written:])
                return
        except (BrokenPipeError, BlockingIOError):
            pass  # the program stopped reading; that is its business
    sel.unregister(key.fileobj)
    key.fileobj.close()


def _kill_everything(proc: subprocess.Popen, uid: int | None, token: str) -> None:
    """Kill the process group, then whatever left it (double-forked daemons); close our pipe ends."""
    _killpg(proc)
    if uid is not None:
        _sweep_uid(uid)
    else:
        _sweep_marked(token)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None and not stream.closed:
            stream.close()


def _killpg(proc: subprocess.Popen) -> None:
    # Only while the leader is unreaped is its pid, and so the group id, certainly still ours;
    # after that the sweep finds what is left.
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _sweep_uid(uid: int, wait_s: float = 2.0) -> None:
    """Kill every process of `uid`, then wait until they are gone, so that nothing of the run keeps
    running and the next lease of the uid starts from zero processes (RLIMIT_NPROC)."""
    _kill_all_as(uid)
    deadline = time.monotonic() + wait_s
    while _live_tasks(uid) and time.monotonic() < deadline:
        time.sleep(0.005)  # SIGKILL is pending on each of them; dying takes a moment


def _kill_all_as(uid: int) -> None:
    """kill(-1) from a helper running as `uid` reaches every process of that uid and nothing else
    (so a recycled pid can never hit a bystander); the kernel walks the task list under a lock that
    fork also takes, so a fork bomb cannot outrun it. (A /proc scan could: it is not atomic.)"""
    def kill_all_as_uid() -> None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        os.kill(-1, signal.SIGKILL)

    subprocess.run([shutil.which("true") or "/bin/true"], preexec_fn=kill_all_as_uid, env={},
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _live_tasks(uid: int) -> list[int]:
    """Processes of `uid` not yet dead. Only used to wait for the ones kill(-1) already hit, so the
    cheap owner check suffices (it misses non-dumpable ones, which die just the same)."""
    live = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid:
                if Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1][1:2] != b"Z":
                    live.append(int(name))
        except OSError:
            continue
    return live


def _sweep_marked(token: str, wait_s: float = 2.0) -> None:
    """Without a uid of its own a run is found by the marker in its environment: best effort, since
    a process can overwrite its environment block. Repeats until none is left alive (a process that
    is exiting has no environment any more), so a fork that raced the first round is caught too."""
    marker, deadline = f"TAMER_SANDBOX={token}".encode(), time.monotonic() + wait_s
    while time.monotonic() < deadline:
        pids = []
        for pid in (p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
            try:
                if marker in Path("/proc", pid, "environ").read_bytes().split(b"\0"):
                    pids.append(int(pid))
            except OSError:
                continue
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.005)


def _result(returncode: int, outcome: _Outcome, protections: list[str], warnings: list[str],
            uid: int | None) -> SandboxResult:
    limit = _name_limit(returncode, outcome)
    return SandboxResult(
        ok=returncode == 0 and limit is None,
        exit_code=returncode if returncode >= 0 else None,
        signal=-returncode if returncode < 0 else None,
        timed_out=outcome.reason == "timeout",
        limit_hit=limit,
        stdout=outcome.stdout.text(),
        stderr=outcome.stderr.text(),
        stdout_truncated=outcome.stdout.total > outcome.stdout.limit,
        stderr_truncated=outcome.stderr.total > outcome.stderr.limit,
        duration_s=round(outcome.duration_s, 4),
        protections=tuple(protections),
        warnings=tuple(warnings),
        uid=uid,
    )


def _name_limit(returncode: int, outcome: _Outcome) -> str | None:
    """Best effort: from our own kill, the fatal signal, or Python's last words on stderr."""
    if outcome.reason is not None:
        return outcome.reason
    if returncode == 0:
        return None
    if returncode == -signal.SIGXCPU:
        return "cpu_time"
    if returncode == -signal.SIGXFSZ:
        return "file_size"
    tail = outcome.stderr.tail.decode("utf-8", errors="replace")
    return next((limit for marker, limit in _STDERR_MARKERS if marker in tail), None)
