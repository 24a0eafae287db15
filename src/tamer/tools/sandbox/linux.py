"""Linux primitives through ctypes (no dependencies): unshare, setns, mount, prctl, seccomp.

The child-setup code calls these as `linux.unshare(...)` (module attribute, not an imported name),
so a test can patch one here to simulate a kernel that refuses it; the forked child sees the patch.
"""

from __future__ import annotations

import ctypes
import os

_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded before any fork: dlopen in a child can deadlock
_LIBC.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_LIBC.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID = 0x00020000, 0x10000000, 0x40000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 22, 38


def unshare(flags: int) -> bool:
    return _LIBC.unshare(flags) == 0


def enter_netns(fd: int | None) -> bool:
    """Join the uid's reserved empty network namespace, or else create a fresh one."""
    if fd is not None and _LIBC.setns(fd, CLONE_NEWNET) == 0:
        return True
    return unshare(CLONE_NEWNET)


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    if _LIBC.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def prctl(option: int, arg: int) -> None:
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


def install_seccomp_no_inet() -> bool:
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
