"""Child setup: runs in the forked child, before exec (as `preexec_fn`), usually as root.

`child_setup(plan)` enters the namespaces, builds the mounts, sets the rlimits, drops to the
run's uid and arms no-new-privs and the parent-death signal; it reports what it set up (or why
it failed) as JSON on `plan.report_fd`. Only async-signal-tolerant work belongs here: the plan
was computed in the parent (see plan.py).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import signal
from collections.abc import Sequence

from tamer.tools.sandbox import linux
from tamer.tools.sandbox.config import SandboxError
from tamer.tools.sandbox.linux import (
    CLONE_NEWNS,
    CLONE_NEWUSER,
    MS_BIND,
    MS_NODEV,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    MS_REMOUNT,
    PR_SET_NO_NEW_PRIVS,
    PR_SET_PDEATHSIG,
)
from tamer.tools.sandbox.plan import ChildPlan, MountPlan
from tamer.tools.sandbox.reaper import start_reaper


def child_setup(plan: ChildPlan) -> None:
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
        linux.prctl(PR_SET_NO_NEW_PRIVS, 1)
        applied.append("no-new-privs")
        linux.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != plan.parent_pid:
            os._exit(137)  # the parent died before pdeathsig was armed
        applied.append("pdeathsig")
        if plan.isolate_net and "netns" not in applied:
            if linux.install_seccomp_no_inet():
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


def _enter_namespaces(plan: ChildPlan, applied: list[str], warnings: list[str]) -> None:
    if os.geteuid() != 0 and (plan.isolate_net or plan.mounts) and linux.unshare(CLONE_NEWUSER):
        # Unprivileged: a user namespace grants the rights for the rest. Map our ids onto
        # themselves (not onto 0), so that the program loses those rights again at exec.
        uid, gid = os.geteuid(), os.getegid()
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        applied.append("userns")
    if plan.pid_namespace:  # before the mount namespace: the reaper removes the host's workdir
        start_reaper(plan.workdir, applied, warnings)
    if plan.isolate_net and linux.enter_netns(plan.netns_fd):
        applied.append("netns")
    if plan.mounts is None:
        return
    if not linux.unshare(CLONE_NEWNS):
        warnings.append(f"no mount namespace ({os.strerror(ctypes.get_errno())}): host /tmp is "
                        "shared and the home directory is not hidden")
        return
    applied.append("mountns")
    _build_mounts(plan.mounts, applied, warnings)


def _build_mounts(plan: MountPlan, applied: list[str], warnings: list[str]) -> None:
    linux.mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount may propagate to the host
    # Hold what we bring back before covering it; /proc/self/fd/N still reaches it afterwards.
    held = {p: os.open(p, os.O_PATH | os.O_CLOEXEC) for p in (*plan.expose_ro, plan.workdir)}
    covered = _cover(plan.hide, "mode=755,size=1m")
    applied += ["hidden-dirs"] if covered else []
    private = _cover(plan.private_tmp, f"mode=1777,size={plan.tmpfs_mb}m")
    applied += ["private-tmp"] if private else []
    for path in plan.expose_ro:
        # An interpreter (or venv) under a hidden or private directory (a checkout in /tmp, say)
        # is bound back on top of the fresh tmpfs.
        if any(_is_under(path, c) for c in covered + private):
            os.makedirs(path, exist_ok=True)
            linux.mount(f"/proc/self/fd/{held[path]}", path, None, MS_BIND | MS_REC)
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
            linux.mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, options)
            covered.append(path)
    return covered


def _place_workdir(plan: MountPlan, source: str, private: list[str], applied: list[str]) -> None:
    """Inside a private tmpfs the workdir becomes a copy there, so what the program writes is capped
    by that tmpfs and never reaches the host's disk. Elsewhere the real one is bound onto itself, so
    it stays writable once / is read-only."""
    if not any(_is_under(plan.workdir, p) for p in private):
        os.makedirs(plan.workdir, exist_ok=True)  # in case a hidden directory now covers it
        linux.mount(source, plan.workdir, None, MS_BIND)
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
        linux.mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)
        return True
    except OSError as exc:
        warnings.append(f"could not make {path} read-only: {exc}")
        return False


def _drop_privileges(plan: ChildPlan, applied: list[str], warnings: list[str]) -> None:
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
