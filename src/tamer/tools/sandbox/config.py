"""The sandbox's public data: what a run may do (`SandboxConfig`) and what happened (`SandboxResult`).

`KNOWN_PROTECTIONS` names every layer a run can report in `SandboxResult.protections`;
`PARENT_SIDE` are the ones the parent process sets up itself (the rest happen in the child).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

NETWORK_MODES = ("isolate", "allow")
KNOWN_PROTECTIONS = (
    "new-session", "scrubbed-env", "tmp-workdir", "isolated-python", "sweep-uid", "sweep-marker",
    "userns", "netns", "seccomp-net", "mountns", "private-tmp", "tmpfs-workdir", "hidden-dirs",
    "ro-root",
    "rlimit_as", "rlimit_cpu", "rlimit_nproc", "rlimit_fsize", "rlimit_nofile", "rlimit_core",
    "uid-drop", "no-new-privs", "pdeathsig", "pidns",
)
PARENT_SIDE = ("new-session", "scrubbed-env", "tmp-workdir", "isolated-python", "sweep-uid", "sweep-marker")


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
    pid_namespace: bool = True  # own PID namespace + reaper: nothing outlives the run, even a killed supervisor
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
