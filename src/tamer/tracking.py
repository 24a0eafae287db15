"""The one sink for metrics: console, JSONL and TensorBoard behind a single `log` call.

Trainers, evaluators and the CLI report numbers here and nowhere else; algorithm code
never logs. A run directory ends up holding:

    run_dir/metrics.jsonl   one JSON object per `log` call: {"step", "time", **metrics};
                            strict JSON: a NaN or infinite metric is written as null
    run_dir/tb/             TensorBoard event files (`tensorboard --logdir run_dir/tb`)

    with Tracker("runs/gsm8k", total_steps=200) as tracker:
        for step in range(1, 201):
            ...
            tracker.log({"reward/mean": 0.42, "loss": 0.13}, step=step)
        tracker.table("eval", ["task", "accuracy"], [["gsm8k", 0.61]])
    plot_metrics("runs/gsm8k/metrics.jsonl", "runs/gsm8k/curves.png")

Resuming: open with `append=True`, then `truncate_after(resume_step)` so records the
crashed run wrote after its last checkpoint are dropped instead of duplicated.

On a terminal the console shows a Rich progress bar whose description carries the
latest reward and accuracy; when stdout is not a terminal (CI, `nohup`, a pipe) a bar
would print a line per refresh, so it falls back to one short line every
`console_every` steps.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import IO, Any, Iterable, Mapping, Sequence

from rich.console import Console
from rich.progress import (
    BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
)
from rich.table import Table

from tamer.storage import storage_errors, strict_dumps

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
# Keys shown in the progress description and the non-TTY summary line, with short labels.
HEADLINE_KEYS: dict[str, str] = {"reward/mean": "reward", "eval/accuracy": "acc"}
RESERVED_KEYS = ("step", "time")


# ---------------------------------------------------------------------------- values


def _to_number(key: str, value: Any) -> float | int:
    """Turn a metric value (python number, numpy scalar, 0-d/1-element tensor) into a JSON number."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    # Tensors and numpy scalars both expose .item(); checking the attribute avoids
    # importing numpy or torch just to log a float.
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return _to_number(key, item())
        except (ValueError, RuntimeError) as err:  # a multi-element tensor or array
            raise TypeError(f"metric {key!r} must be a scalar, got shape {getattr(value, 'shape', '?')}") from err
    raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}")


def _format(value: float | int) -> str:
    return str(value) if isinstance(value, int) else f"{value:.4g}"


def _headline(latest: Mapping[str, float | int]) -> str:
    return "  ".join(f"{label} {_format(latest[k])}" for k, label in HEADLINE_KEYS.items() if k in latest)


# ---------------------------------------------------------------------------- console


class _ConsoleView:
    """A progress bar on a terminal; elsewhere one summary line every `every` steps."""

    def __init__(self, console: Console, total_steps: int | None, every: int, description: str) -> None:
        self.console = console
        self.total_steps = total_steps
        self.every = every
        self.description = description
        self.latest: dict[str, float | int] = {}  # eval keys arrive rarely; keep the last seen
        self.last_printed: int | None = None
        self.last_step: int | None = None
        self.progress: Progress | None = None
        if console.is_terminal and total_steps is not None:
            self.progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TimeRemainingColumn(), console=console,
            )
            self.task = self.progress.add_task(description, total=total_steps)
            self.progress.start()

    def update(self, metrics: Mapping[str, float | int], step: int) -> None:
        self.latest.update({k: metrics[k] for k in HEADLINE_KEYS if k in metrics})
        self.last_step = step
        if self.progress is not None:
            desc = " ".join(filter(None, [self.description, _headline(self.latest)]))
            self.progress.update(self.task, completed=step, description=desc)
        elif self.last_printed is None or step - self.last_printed >= self.every:
            self._print_line(step)

    def _print_line(self, step: int) -> None:
        total = f"/{self.total_steps}" if self.total_steps is not None else ""
        parts = [f"{self.description} step {step}{total}", _headline(self.latest)]
        # markup/highlight off: a metric name like "[x]" must print as written.
        self.console.print("  ".join(filter(None, parts)), markup=False, highlight=False)
        self.last_printed = step

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        elif self.last_step is not None and self.last_step != self.last_printed:
            self._print_line(self.last_step)  # the final state is always worth one line


# ---------------------------------------------------------------------------- tracker


class Tracker:
    """Fan one `log(metrics, step)` call out to the console, metrics.jsonl and TensorBoard.

    Holds open file handles, so it is not picklable by design; every process that logs
    (normally rank 0 only) makes its own. There is no module-level state.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        console: bool = True,
        jsonl: bool = True,
        tensorboard: bool = True,
        total_steps: int | None = None,
        description: str = "train",
        append: bool = False,
        console_every: int = 10,
        stream: IO[str] | None = None,
    ) -> None:
        """`append` keeps an existing metrics.jsonl (resume); otherwise old logs are replaced.
        `console_every` is the non-terminal throttle in steps; `stream` redirects console
        output (default stdout), mostly for tests."""
        if console_every < 1:
            raise ValueError(f"console_every must be >= 1, got {console_every}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.append = append
        self._start = time.monotonic()
        self._closed = False
        self.console: Console | None = Console(file=stream) if console else None
        self._view = _ConsoleView(self.console, total_steps, console_every, description) if self.console else None
        self._jsonl: IO[str] | None = None
        if jsonl:
            if append:
                _drop_torn_tail(self.metrics_path)
            self._jsonl = self.metrics_path.open("a" if append else "w", encoding="utf-8")
        self._tb: Any = None
        if tensorboard:
            if not append:
                # A fresh run replaces metrics.jsonl, so stale event files must go too,
                # or TensorBoard would overlay two runs under one name.
                shutil.rmtree(self.run_dir / TB_DIR, ignore_errors=True)
            self._tb = self._open_tensorboard(purge_step=None)

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / METRICS_FILE

    def _open_tensorboard(self, purge_step: int | None) -> Any:
        # Imported lazily: tensorboard costs ~1 s to import and is optional at runtime.
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=str(self.run_dir / TB_DIR), purge_step=purge_step)

    # -- logging -------------------------------------------------------------

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record `metrics` at `step` (completed optimizer steps) in every enabled sink."""
        if self._closed:
            raise RuntimeError("Tracker.log called after close()")
        clash = [k for k in RESERVED_KEYS if k in metrics]
        if clash:
            raise ValueError(f"metric names {clash} are reserved by the tracker")
        values = {k: _to_number(k, v) for k, v in metrics.items()}
        record = {"step": int(step), "time": round(time.monotonic() - self._start, 3), **values}
        if self._jsonl is not None:
            with storage_errors(self.metrics_path, "metrics"):  # a full disk: one line naming the file
                self._jsonl.write(strict_dumps(record) + "\n")  # NaN/inf -> null: strict JSON
                self._jsonl.flush()  # a crash must not lose the steps before it
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, global_step=int(step))
        if self._view is not None:
            self._view.update(values, int(step))

    def print(self, msg: Any) -> None:
        """Print through the tracker's console (keeps the progress bar intact)."""
        if self.console is not None:
            self.console.print(msg)

    def table(self, title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
        """Print a Rich table; floats are shown with 4 significant digits."""
        if self.console is None:
            return
        table = Table(title=title)
        for column in columns:
            table.add_column(str(column))
        for row in rows:
            table.add_row(*(f"{c:.4g}" if isinstance(c, float) else str(c) for c in row))
        self.console.print(table)

    # -- resume --------------------------------------------------------------

    def truncate_after(self, step: int) -> int:
        """Drop records with step > `step` from metrics.jsonl and hide them in TensorBoard.

        Call after resuming from the checkpoint at `step`. Returns how many records were
        dropped. The file is rewritten atomically, so a crash here leaves the old one.
        """
        dropped = 0
        if self.metrics_path.exists():
            records = read_metrics(self.metrics_path)
            kept = [r for r in records if r["step"] <= step]
            dropped = len(records) - len(kept)
            if self._jsonl is not None:
                self._jsonl.close()
            tmp = self.metrics_path.with_suffix(".jsonl.tmp")
            with tmp.open("w", encoding="utf-8") as f:
                f.writelines(strict_dumps(r) + "\n" for r in kept)
            os.replace(tmp, self.metrics_path)
            if self._jsonl is not None:
                self._jsonl = self.metrics_path.open("a", encoding="utf-8")
        if self._tb is not None:
            # purge_step makes TensorBoard discard events at or after it on reload.
            self._tb.close()
            self._tb = self._open_tensorboard(purge_step=step + 1)
        return dropped

    # -- lifetime ------------------------------------------------------------

    def close(self) -> None:
        """Flush and close every sink; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._view is not None:
            self._view.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------- reading and plotting


def read_metrics(path: str | Path) -> list[dict]:
    """Load metrics.jsonl (or the one inside a run directory) as a list of dicts.

    A torn last line (the process died mid-write) is skipped; a bad line elsewhere is an error.
    """
    path = _metrics_file(path)
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not valid JSON: {err}") from err
    return records


def _metrics_file(path: str | Path) -> Path:
    path = Path(path)
    return path / METRICS_FILE if path.is_dir() else path


def _drop_torn_tail(path: Path) -> None:
    """Cut a partial last line (the writer died mid-line) so appended records start clean."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        with path.open("r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def plot_metrics(
    metrics_path: str | Path,
    out_png: str | Path,
    keys: Sequence[str] = ("reward/mean", "eval/accuracy"),
    title: str | None = None,
) -> Path:
    """Plot `keys` against step, one subplot per key present; returns the PNG path.

    Keys absent from the log are skipped; if none is present the figure says so. Eval
    keys (logged every few steps) are drawn with markers so sparse points stay visible.
    """
    # Figure + Agg canvas directly rather than pyplot: no global backend switch, no display.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_metrics(metrics_path)
    series = {k: _series(records, k) for k in keys}
    present = [k for k in keys if series[k][0]]
    fig = Figure(figsize=(6.4, 2.6 * max(1, len(present))), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(max(1, len(present)), 1, sharex=True, squeeze=False)[:, 0]
    for ax, key in zip(axes, present):
        steps, values = series[key]
        marker = "o" if key.startswith("eval/") else None
        ax.plot(steps, values, marker=marker, markersize=4, linewidth=1.5)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    if not present:
        axes[0].text(0.5, 0.5, f"no data for {', '.join(keys)}", ha="center", va="center")
    axes[-1].set_xlabel("step")
    fig.suptitle(title if title is not None else _metrics_file(metrics_path).resolve().parent.name)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return out_png


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key`, skipping records without it and non-finite values."""
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [s for s, _ in pairs], [v for _, v in pairs]
