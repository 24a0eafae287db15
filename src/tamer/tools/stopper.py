"""Stop a tool's thread after its timeout, instead of leaving it running.

Python cannot kill a thread, but it can raise an exception in one: `PyThreadState_SetAsyncExc`
makes the thread raise `ToolStopped` at its next bytecode. A tool stuck in a Python loop (the
common case: a bad `while`, a huge `range`) stops within milliseconds, so a timed-out call no
longer keeps a core busy and the trainer's own Python code no longer fights it for the GIL.

    stop_thread(thread, done)       # after join(timeout) left it alive

The exception is raised again every `RETRY_S` by one background thread (a tool may catch it
with a bare `except`), for up to `GIVE_UP_S`; a thread still alive then is counted as
unstoppable in `stats()`. What this cannot stop: code blocked inside one C call (a long
`time.sleep`, a socket read, a huge regex or big-integer operation) until that call returns,
and a loop that catches BaseException around all of its work. For such tools run episodes
with `agent.tool_isolation=process` (tamer.rollout.isolation): a worker process that is
killed and replaced.
"""

from __future__ import annotations

import ctypes
import threading
import time

RETRY_S = 0.02  # how often the exception is raised again in a thread that survived it
GIVE_UP_S = 30.0  # after this, a still-running thread is counted as unstoppable and left alone
FIRST_WAIT_S = 0.05  # the caller waits this long for a Python loop to stop before moving on

_pending: dict[threading.Thread, tuple[threading.Event, float]] = {}
_lock = threading.Lock()
_stats = {"stopped": 0, "unstoppable": 0}
_worker: threading.Thread | None = None


class ToolStopped(BaseException):
    """Raised inside a timed-out tool's thread; BaseException so `except Exception` cannot swallow it."""


def _raise_in(thread: threading.Thread) -> None:
    # Only ever into a live thread of ours: an ident can be reused only after its thread ended.
    if thread.ident is not None and thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(ToolStopped))


def stop_thread(thread: threading.Thread, done: threading.Event) -> bool:
    """Stop `thread` (a tool call past its timeout; `done` is set when its function has returned).

    Returns True if it stopped within FIRST_WAIT_S; otherwise it is retried in the background."""
    if not done.is_set():
        _raise_in(thread)
    thread.join(FIRST_WAIT_S)
    if not thread.is_alive():
        with _lock:
            _stats["stopped"] += 1
        return True
    with _lock:
        _pending[thread] = (done, time.monotonic() + GIVE_UP_S)
        _ensure_worker()
    return False


def _ensure_worker() -> None:
    global _worker
    if _worker is None or not _worker.is_alive():
        _worker = threading.Thread(target=_retry_loop, name="tamer-tool-stopper", daemon=True)
        _worker.start()


def _retry_loop() -> None:
    while True:
        time.sleep(RETRY_S)
        with _lock:
            for thread, (done, give_up) in list(_pending.items()):
                if not thread.is_alive():
                    del _pending[thread]
                    _stats["stopped"] += 1
                elif time.monotonic() > give_up:
                    del _pending[thread]
                    _stats["unstoppable"] += 1
                elif not done.is_set():
                    _raise_in(thread)
            if not _pending:
                return


def still_running() -> int:
    """Timed-out tool threads still being stopped."""
    with _lock:
        return sum(t.is_alive() for t in _pending)


def stats() -> dict[str, int]:
    """Counts so far: threads stopped after a timeout, and threads given up on."""
    with _lock:
        return dict(_stats)
