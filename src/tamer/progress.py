"""Progress on the console: a Rich bar on a terminal, a plain line now and then elsewhere.

    with ProgressView(console, "sft", total=500) as view:      # a Tracker opens one for its phase
        for step in range(1, 501):
            ...
            report_progress(step, {"sft/loss": loss})          # from anywhere inside the block
    with progress_task("eval", total=400) as advance:           # a sub-task under the open view
        for chunk in chunks:
            ...
            advance(len(chunk))

On a terminal the bar shows steps done, seconds per step, elapsed time, the ETA and the
latest loss, reward and accuracy. When stdout is not a terminal (CI, `nohup`, a pipe) a bar
would print a line per refresh, so the view prints one plain line every `every` steps (or
after a minute without one), with the same figures and no escape codes.

The open view is kept in a context variable, so code deep in a call (evaluation, an SFT
loop) reports progress without a tracker being passed down; with no view open, reporting
does nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

# Metrics shown in the bar and the plain lines, with short labels; the first present key wins a label.
HEADLINE_KEYS: dict[str, str] = {
    "sft/loss": "loss", "train/loss": "loss", "reward/mean": "reward",
    "eval/accuracy": "acc", "eval/success_rate": "success",
}
QUIET_MAX_SECONDS = 60.0  # a plain line at least this often while steps advance

_ACTIVE: ContextVar[ProgressView | None] = ContextVar("tamer_progress_view", default=None)


def _format(value: float | int) -> str:
    return str(value) if isinstance(value, int) else f"{value:.4g}"


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m{seconds:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


class ProgressView:
    """The console view of one phase (SFT, RL, evaluation) with `total` steps (None: unknown)."""

    def __init__(self, console: Console, description: str, total: int | None, every: int = 10) -> None:
        if every < 1:
            raise ValueError(f"console_every must be >= 1, got {every}")
        self.console, self.description, self.total, self.every = console, description, total, every
        self.latest: dict[str, float | int] = {}  # eval keys arrive rarely; keep the last seen
        self.base: tuple[float, int] | None = None  # (time, step) that s/step is measured from
        self.last_step: int | None = None
        self.last_printed: tuple[float, int] | None = None
        self.progress: Progress | None = None
        self.task = None  # the bar of the phase's steps (a terminal and a known total)
        if console.is_terminal:
            self.progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("{task.fields[eta]}"),
                TextColumn("{task.fields[headline]}"), console=console,
            )
            if total is not None:
                self.task = self.progress.add_task(description, total=total, rate="", eta="", headline="")
            self.progress.start()
        self._previous = _ACTIVE.get()
        _ACTIVE.set(self)

    # -- figures -------------------------------------------------------------
    def seconds_per_step(self) -> float | None:
        if self.base is None or self.last_step is None or self.last_step <= self.base[1]:
            return None
        return (time.perf_counter() - self.base[0]) / (self.last_step - self.base[1])

    def eta(self) -> float | None:
        rate = self.seconds_per_step()
        if rate is None or self.total is None or self.last_step is None:
            return None
        return rate * max(0, self.total - self.last_step)

    def headline(self) -> str:
        shown: dict[str, str] = {}
        for key, label in HEADLINE_KEYS.items():
            if key in self.latest and label not in shown:
                shown[label] = f"{label} {_format(self.latest[key])}"
        return "  ".join(shown.values())

    # -- updates -------------------------------------------------------------
    def update(self, step: int, metrics: Mapping[str, float | int] = {}) -> None:
        """`step` steps are done; `metrics` may carry headline figures."""
        self.latest.update({k: metrics[k] for k in HEADLINE_KEYS if k in metrics})
        if self.base is None:  # measured from the first report: start-up work (data, model) is not a step
            self.base = (time.perf_counter(), step)
        self.last_step = step
        if self.task is not None:
            rate, eta = self.seconds_per_step(), self.eta()
            self.progress.update(self.task, completed=step, headline=self.headline(),
                                 rate=f"{rate:.2f} s/step" if rate is not None else "",
                                 eta=f"ETA {format_seconds(eta)}" if eta is not None else "")
        elif self._due(step):
            self._print_line(step)

    def _due(self, step: int) -> bool:
        if self.last_printed is None:
            return True
        seconds, printed = self.last_printed
        return step - printed >= self.every or (step > printed and time.perf_counter() - seconds >= QUIET_MAX_SECONDS)

    def _print_line(self, step: int) -> None:
        total = f"/{self.total}" if self.total is not None else ""
        rate, eta = self.seconds_per_step(), self.eta()
        parts = [f"{self.description} step {step}{total}", self.headline(),
                 f"{rate:.2f} s/step" if rate is not None else "",
                 f"ETA {format_seconds(eta)}" if eta is not None else ""]
        # markup/highlight off: a metric name like "[x]" must print as written.
        self.console.print("  ".join(filter(None, parts)), markup=False, highlight=False)
        self.last_printed = (time.perf_counter(), step)

    @contextlib.contextmanager
    def subtask(self, description: str, total: int) -> Iterator[Callable[[int], None]]:
        """A sub-task (an evaluation): a transient bar on a terminal, one closing line elsewhere."""
        start = time.perf_counter()
        done = 0
        task_id = self.progress.add_task(f"  {description}", total=total, rate="", eta="", headline="") \
            if self.progress is not None else None

        def advance(n: int) -> None:
            nonlocal done
            done += n
            if task_id is not None:
                self.progress.update(task_id, completed=done)

        try:
            yield advance
        finally:
            if task_id is not None:
                self.progress.remove_task(task_id)
            else:
                self.console.print(f"{self.description} {description}: {done}/{total} in "
                                   f"{time.perf_counter() - start:.1f} s", markup=False, highlight=False)

    def close(self) -> None:
        if _ACTIVE.get() is self:
            _ACTIVE.set(self._previous)
        if self.progress is not None:
            self.progress.stop()
        unprinted = self.last_step is not None and (self.last_printed is None or self.last_printed[1] != self.last_step)
        if self.task is None and unprinted:
            self._print_line(self.last_step)  # the final state is always worth one line

    def __enter__(self) -> ProgressView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def active_view() -> ProgressView | None:
    return _ACTIVE.get()


def report_progress(step: int, metrics: Mapping[str, float | int] = {}) -> None:
    """Tell the open view that `step` steps are done (nothing happens without one)."""
    view = _ACTIVE.get()
    if view is not None:
        view.update(step, metrics)


@contextlib.contextmanager
def progress_task(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A sub-task under the open view; without one, `advance` does nothing."""
    view = _ACTIVE.get()
    if view is None:
        yield lambda n: None
        return
    with view.subtask(description, total) as advance:
        yield advance
