"""Environments in a worker process that can be killed: `agent.tool_isolation=process`.

In the default `thread` isolation a tool runs in a thread of the trainer, and a call past its
timeout is stopped by raising an exception in that thread (tamer.tools.stopper). That cannot
stop code blocked inside one C call, which may also hold the GIL and so freeze the trainer.
With `agent.tool_isolation=process` each episode's environment runs in its own worker process:

    env = IsolatedEnvironment(CalculatorEnv())   # what the rollout does with tool_isolation=process
    env.reset(task)        # forks the worker (a copy of the untouched environment), resets it there
    env.step(text)         # runs the turn's tool calls in the worker; the result comes back pickled

A turn that overruns its deadline (`tool_timeout_s` per call it makes, plus a margin), or that
leaves a timed-out tool thread the worker could not stop, gets its worker killed (SIGKILL) and
replaced: a fresh fork of the untouched environment replays the
episode so far (`reset`, then every earlier turn), so the episode goes on where it was, and the
turn is answered with a timeout error for each of its calls. A worker that dies on its own
(a crashing extension) is replaced the same way. The worker ends with its episode, and dies
with the trainer (parent-death signal); it ignores SIGINT/SIGTERM, which the trainer handles.

Costs: a fork per episode (copy-on-write; a few ms for a small trainer, more for a large one)
and a pickle round trip per turn. Environments must be deterministic for the replay to rebuild
the same state, and `reset`/`step` results must be picklable.
"""

from __future__ import annotations

import os
import pickle
import signal
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, Pipe
from typing import Any

from tamer.tasks.env import BaseEnvironment, StepResult
from tamer.tools import stopper

REPLY_MARGIN_S = 2.0  # fork, pickling and scheduling on a busy machine, on top of the tools' own time
DEFAULT_STEP_TIMEOUT_S = 60.0  # reset, and steps of environments that do not say (`step_deadline`)
_PDEATHSIG = 1  # prctl(PR_SET_PDEATHSIG)


class WorkerLost(Exception):
    """The worker missed its deadline (`timed_out`) or died."""

    def __init__(self, message: str, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class EnvWorker:
    """A forked copy of `env` serving reset, step and killed-turn calls over a pipe."""

    def __init__(self, env: Any) -> None:
        parent_end, child_end = Pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the worker
            try:
                parent_end.close()
                _become_worker(parent)
                _serve(env, child_end)
            finally:
                os._exit(0)
        child_end.close()
        self.pid, self.conn = pid, parent_end
        self._finalizer = weakref.finalize(self, _kill, pid, parent_end)

    def call(self, method: str, *args: Any, timeout: float) -> Any:
        try:
            self.conn.send((method, args))
            ready = self.conn.poll(timeout)
            if ready:
                status, value = self.conn.recv()
        except (EOFError, OSError) as err:
            raise WorkerLost(f"the tool process died ({self._exit_status()})", timed_out=False) from err
        if not ready:
            raise WorkerLost(f"the turn's tools ran past {timeout:g} s", timed_out=True)
        if status == "error":
            raise value
        return value

    def _exit_status(self) -> str:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return "already reaped"
        if pid == 0:
            return "still running"
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        return f"killed by signal {sig}" if sig else f"exit status {os.WEXITSTATUS(status)}"

    def close(self) -> None:
        self._finalizer()


def _kill(pid: int, conn: Connection) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    conn.close()


def _become_worker(parent: int) -> None:
    # Ctrl-C and a scheduler's SIGTERM reach the whole process group; the trainer handles them
    # (tamer.stopping) and needs its workers until it has finished the step.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    try:
        from tamer.tools.sandbox import linux

        linux.prctl(_PDEATHSIG, signal.SIGKILL)  # die with the trainer, even if it is SIGKILLed
    except (ImportError, OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(0)  # the trainer died before the parent-death signal was armed


def _serve(env: Any, conn: Connection) -> None:
    methods = _worker_methods(env)
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            return  # the trainer closed its end: done
        try:
            reply = ("ok", methods[method](*args))
        except Exception as err:
            reply = ("error", err)
        try:
            conn.send(reply)
        except (pickle.PicklingError, TypeError, AttributeError):
            conn.send(("error", RuntimeError(f"{method}: result cannot be sent back ({reply[1]!r:.200})")))


class IsolatedEnvironment(BaseEnvironment):
    """Runs `env`'s episodes in worker processes; see the module docstring."""

    def __init__(self, env: Any, step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S) -> None:
        self.env = env  # never reset or stepped in this process: each worker forks from it untouched
        self.step_timeout_s = step_timeout_s
        self.worker: EnvWorker | None = None
        self.task: Any = None
        self.turns: list[tuple[str, str, str | None]] = []  # (kind, action, message), to replay
        self.tools: list[dict] = getattr(env, "tools", None) or []

    def _deadline(self, action: str | None = None) -> float:
        own = getattr(self.env, "step_deadline", None)
        return (own(action) if own is not None and action is not None else self.step_timeout_s) + REPLY_MARGIN_S

    def reset(self, task: Any) -> str:
        self.close()
        self.task, self.turns = task, []
        self.worker = EnvWorker(self.env)
        first, tools = self.worker.call("_reset_with_tools", task, timeout=self._deadline())
        self.tools = tools or []
        return first

    def step(self, action: str) -> StepResult:
        try:
            result, leftover = self.worker.call("_step", action, timeout=self._deadline(action))
        except WorkerLost as lost:
            return self._replace_and_fail(action, lost)
        if leftover:  # a timed-out tool thread that would not stop keeps burning the worker's CPU
            return self._replace_and_fail(action, WorkerLost(f"{leftover} timed-out tool call(s) would not stop",
                                                             timed_out=True))
        self.turns.append(("step", action, None))
        if result.done:
            self.close()
        return result

    def _replace_and_fail(self, action: str, lost: WorkerLost) -> StepResult:
        """Kill the worker, rebuild the episode in a new one, answer the turn with errors."""
        kind = "timeout" if lost.timed_out else "tool_raised"
        message = f"{lost}; the tool process was stopped and restarted"
        self.worker.close()
        self.worker = EnvWorker(self.env)
        self.worker.call("_reset_with_tools", self.task, timeout=self._deadline())
        for turn_kind, earlier, earlier_message in self.turns:
            if turn_kind == "step":
                self.worker.call("step", earlier, timeout=self._deadline(earlier))
            else:
                self.worker.call("_killed", earlier, earlier_message, turn_kind, timeout=self._deadline())
        self.turns.append((kind, action, message))
        return self.worker.call("_killed", action, message, kind, timeout=self._deadline())

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None


def _worker_methods(env: Any) -> dict[str, Callable[..., Any]]:
    def reset_with_tools(task: Any) -> tuple[str, Any]:
        first = env.reset(task)
        return first, getattr(env, "tools", None)

    def step(action: str) -> tuple[StepResult, int]:
        result = env.step(action)
        return result, stopper.still_running()

    def killed(action: str, message: str, kind: str) -> StepResult:
        record = getattr(env, "record_killed_turn", None)
        if record is not None:
            return record(action, message, kind)
        return StepResult(f"error: {message}", done=False, info={})

    return {"_reset_with_tools": reset_with_tools, "_killed": killed, "_step": step, "step": env.step}
