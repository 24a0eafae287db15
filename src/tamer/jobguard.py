"""The guard every training job runs under: one run per output directory, clean stop on
SIGTERM/SIGINT, disk and permission errors as one line.

    @guarded_job
    def run_rl(config: RunConfig, ...) -> dict: ...

is, for the job's whole life,

    with output_dir_lock(config.output_dir), graceful_stop(), storage_errors(config.output_dir):
        ...

See tamer.runlock, tamer.stopping and tamer.storage. Jobs nest (the demo runs SFT and RL):
the lock and the signal handlers are re-entrant.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from tamer.runlock import output_dir_lock
from tamer.stopping import TrainingStopped, graceful_stop
from tamer.storage import storage_errors, write_json

F = TypeVar("F", bound=Callable[..., Any])


def guarded_job(job: F) -> F:
    """Decorate a job whose first argument is a RunConfig (see the module docstring)."""
    @functools.wraps(job)
    def guarded(config, *args, **kwargs):
        with output_dir_lock(config.output_dir), graceful_stop(), storage_errors(config.output_dir):
            return job(config, *args, **kwargs)

    return guarded  # type: ignore[return-value]


@contextmanager
def summary_on_stop(path: str | Path, so_far: Callable[[], dict[str, Any]]) -> Iterator[None]:
    """If training stops on a signal inside the block, write `path` (the stop, plus `so_far()`)."""
    try:
        yield
    except TrainingStopped as stop:
        stop.summary_path = write_json(path, {**stop.summary(), **so_far()})
        stop.args = (stop.message(),)
        raise
