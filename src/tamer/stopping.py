"""Stop a training run cleanly on SIGTERM or SIGINT: finish the step, checkpoint, exit.

Schedulers (Slurm, Kubernetes, Ray) stop jobs with SIGTERM; people press Ctrl-C (SIGINT).
Inside `graceful_stop()` the first of either only sets a flag and prints one line; the
trainers check the flag between steps, write a checkpoint and raise `TrainingStopped`;
the job writes the summary so far and the CLI prints one line and exits with
`128 + signal number` (143 for SIGTERM, 130 for SIGINT), the shell's convention for a
process ended by that signal. `--resume` then continues exactly where the run stopped.
A second signal ends the process at once, by the signal itself.

    with graceful_stop():                       # a job (tamer.jobguard.guarded_job does this)
        run_training()

    # in a training loop, after a step is complete:
    if stop_requested():
        raise TrainingStopped("rl", step, trainer.save_checkpoint())

Outside `graceful_stop()` (library use, tests) nothing is installed and `stop_requested()`
is always False. Handlers can only be installed from the main thread; elsewhere the block
runs with the process's existing handlers.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_state: dict[str, Any] = {"signal": None, "depth": 0, "previous": {}}
_lock = threading.Lock()


def exit_code(signum: int) -> int:
    """The exit status of a run stopped by `signum`: 128 + signum (SIGTERM 143, SIGINT 130)."""
    return 128 + int(signum)


class TrainingStopped(Exception):
    """Training stopped between steps on a signal; a checkpoint of `step` is at `checkpoint`."""

    def __init__(self, phase: str, step: int, checkpoint: Path | None, signum: int | None = None,
                 total_steps: int | None = None) -> None:
        self.phase, self.step, self.checkpoint, self.total_steps = phase, step, checkpoint, total_steps
        self.signum = signum if signum is not None else (_state["signal"] or signal.SIGTERM)
        self.summary_path: Path | None = None
        super().__init__(self.message())

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)

    def message(self) -> str:
        total = f"/{self.total_steps}" if self.total_steps else ""
        where = f"; summary {self.summary_path}" if self.summary_path else ""
        return (f"stopped by {self.signal_name} after {self.phase} step {self.step}{total}: checkpoint "
                f"{self.checkpoint}{where}; run the same command with --resume to continue")

    def summary(self) -> dict[str, Any]:
        return {"stopped": True, "signal": self.signal_name, "phase": self.phase, "step": self.step,
                "total_steps": self.total_steps, "checkpoint": str(self.checkpoint) if self.checkpoint else None}


def stop_requested() -> bool:
    """True once a stop signal arrived inside `graceful_stop()`."""
    return _state["signal"] is not None


def _handler(signum: int, frame: Any) -> None:
    if _state["signal"] is not None:
        # The second signal: end now, by the signal itself (its default action).
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _state["signal"] = signum
    name = signal.Signals(signum).name
    try:
        sys.stderr.write(f"\n{name} received: stopping after the current step and saving a checkpoint "
                         f"(send it again to exit at once)\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed or a broken pipe: the stop goes on regardless
        pass


@contextmanager
def graceful_stop() -> Iterator[None]:
    """Within the block, SIGTERM/SIGINT request a stop instead of killing the process."""
    main = threading.current_thread() is threading.main_thread()
    with _lock:
        if main and _state["depth"] == 0:
            _state["signal"] = None
            _state["previous"] = {s: signal.signal(s, _handler) for s in STOP_SIGNALS}
        _state["depth"] += 1 if main else 0
    try:
        yield
    finally:
        with _lock:
            if main:
                _state["depth"] -= 1
                if _state["depth"] == 0:
                    for signum, previous in _state["previous"].items():
                        signal.signal(signum, previous)
                    _state["previous"] = {}


def reset() -> None:
    """Forget a received signal (tests; a new job in the same process)."""
    _state["signal"] = None
