"""The run's own PID namespace, and the reaper at its PID 1: cleanup that does not depend on
the supervisor living.

The supervisor's own cleanup (kill the process group, sweep the uid, remove the workdir) runs
only while the supervisor runs. If it is killed (SIGKILL, OOM killer, a scheduler), the
program dies too (`pdeathsig`), but a daemon that double-forked out of the session would
live on, and the workdir would stay. So, in the forked child before exec (`start_reaper`):

  1. `unshare(CLONE_NEWPID)`: every process the program starts lives in a new PID namespace;
  2. the child forks the reaper, which becomes that namespace's PID 1, and keeps a pidfd of
     the child (the program-to-be; exec keeps the pid, so the pidfd follows it);
  3. the child execs the program as usual (it keeps its pid in the host's namespace, so
     exit codes, signals and limits behave exactly as before).

The reaper waits for the program to exit, whatever ended it, reaping orphans meanwhile. Then it
kills everything left in the namespace (`kill(-1)` from a namespace's PID 1 reaches all of it and
nothing else), waits for it, removes the workdir and exits. If the reaper itself is killed, the
kernel kills every process of the namespace (a namespace dies with its PID 1); the workdir is then
left to the supervisor, or to the sweep of stale workdirs at the next start (run.py).

Costs: one extra fork per run (the reaper is a copy of the child, no exec). Inside the program,
`os.getpid()` is still the host pid, and its children see `os.getppid() == 0` (their parent is
outside their namespace).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import shutil
import signal

from tamer.tools.sandbox import linux
from tamer.tools.sandbox.linux import CLONE_NEWPID

_REAP_EVERY_MS = 100  # orphans that exit are reaped within this (zombies count against RLIMIT_NPROC)


def start_reaper(workdir: str, applied: list[str], warnings: list[str]) -> None:
    """In the forked child: new PID namespace for what the program starts, and its reaper."""
    try:
        me = os.pidfd_open(os.getpid())
    except (AttributeError, OSError) as exc:  # Linux < 5.3, or Python without pidfd_open
        warnings.append(f"no PID namespace (pidfd_open: {exc}): if the supervisor is killed, "
                        "processes that left the session survive until the next run of this uid")
        return
    if not linux.unshare(CLONE_NEWPID):
        os.close(me)
        warnings.append(f"no PID namespace ({os.strerror(ctypes.get_errno())}): if the supervisor is killed, "
                        "processes that left the session survive until the next run of this uid")
        return
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_r)
            _reaper(me, workdir, ready_w)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(me)
    ok = os.read(ready_r, 1) == b"1"
    os.close(ready_r)
    if not ok:  # the namespace has no PID 1: forks would fail
        raise OSError("the sandbox reaper did not start")
    applied.append("pidns")


def _reaper(program: int, workdir: str, ready: int) -> None:
    """PID 1 of the run's namespace: reap until the program exits, then kill all and clean up."""
    os.closerange(0, min(program, ready))  # pipes to the supervisor, the lock files it holds, ...
    os.closerange(max(program, ready) + 1, os.sysconf("SC_OPEN_MAX"))
    os.closerange(min(program, ready) + 1, max(program, ready))
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)  # the supervisor's handlers are not ours
    os.write(ready, b"1")
    os.close(ready)
    poller = select.poll()
    poller.register(program, select.POLLIN)
    while not poller.poll(_REAP_EVERY_MS):
        _reap(block=False)
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)  # from a namespace's PID 1: everything in it, nothing else
    _reap(block=True)
    shutil.rmtree(workdir, ignore_errors=True)


def _reap(block: bool) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
