"""The parent side of one run: spawn, supervise (stdin/stdout/stderr, deadline, output cap),
kill everything the run left behind, and name the limit that was hit.

`execute(config, workdir, uid, stdin)` is the whole of it; `sweep_uid` is also used by the uid
lease (run.py) to clean up after a holder that died mid-run.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tamer.tools.sandbox.child import child_setup
from tamer.tools.sandbox.config import PARENT_SIDE, SandboxConfig, SandboxError, SandboxResult
from tamer.tools.sandbox.plan import make_plan

# -E -s is -I without -P: the script's directory (the fresh workdir, holding only what the caller
# passed in `files`) stays importable. -u so output printed before a kill is not lost in a buffer.
_PYTHON_FLAGS = ("-E", "-s", "-u")
_OUTPUT_KILL_FACTOR = 16  # keep max_output_bytes per stream; kill past 16x that in total
_STDERR_TAIL_BYTES = 4096  # read to name the limit that was hit, even when stderr was truncated
_POLL_S = 0.05
_STDERR_MARKERS = (  # last-resort naming of a limit from what Python printed before dying
    ("MemoryError", "memory"), ("Cannot allocate memory", "memory"),
    ("File too large", "file_size"), ("No space left on device", "disk_space"),
    ("Too many open files", "open_files"),
    ("Resource temporarily unavailable", "processes"), ("can't start new thread", "processes"),
)


def execute(config: SandboxConfig, workdir: str, uid: int | None, stdin: bytes) -> SandboxResult:
    token = os.urandom(8).hex()
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
           "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TAMER_SANDBOX": token}
    parent_side = ["new-session", "scrubbed-env", "tmp-workdir", "isolated-python",
                   "sweep-uid" if uid is not None else "sweep-marker"]
    missing = [name for name in config.require if name in PARENT_SIDE and name not in parent_side]
    if missing:
        raise SandboxError(f"required protections {missing} not available here (needs root)")
    report_r, report_w = os.pipe()  # the child says what it set up, or why it failed
    try:
        plan = make_plan(config, workdir, uid, report_w)
        start = time.monotonic()
        proc = subprocess.Popen(
            [config.python, *_PYTHON_FLAGS, "main.py"], cwd=workdir, env=env,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=lambda: child_setup(plan))
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
            # Whether it had exited is sampled before the select: sampled after, a program that
            # wrote its last output and exited while the select timed out would lose that output.
            exited = proc.poll() is not None
            events = sel.select(min(remaining, _POLL_S))
            for key, _ in events:
                _pump(sel, key)
            if out.total + err.total > hard_cap:
                reason = "output"
            elif not events and exited:
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
        sweep_uid(uid)
    else:
        _sweep_marked(token)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None and not stream.closed:
            stream.close()


def _killpg(proc: subprocess.Popen) -> None:
    # Only while the leader is unreaped is its pid, and so the group id, certainly still ours;
    # after that the sweep finds what is left.
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def sweep_uid(uid: int, wait_s: float = 2.0) -> None:
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
            if (name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid
                    and Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1][1:2] != b"Z"):
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
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
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
