"""The one sink for metrics: console, JSONL and TensorBoard behind a single `log` call.

Trainers, evaluators and the CLI report numbers here and nowhere else; algorithm code
never logs. A run directory ends up holding:

    run_dir/metrics.jsonl   one JSON object per `log` call: {"step", "time", **metrics};
                            strict JSON: a NaN or infinite metric is written as null
    run_dir/rollouts.jsonl  saved rollouts (`log_rollouts`; see tamer.rollout_log)
    run_dir/tb/             TensorBoard event files (`tensorboard --logdir run_dir/tb`)

Experiment trackers (W&B, MLflow: tamer.tracking_backends) are further sinks passed in as
`sinks`; they receive the same scalars, the rollouts as tables and the final summary. A
`HealthMonitor` (tamer.health) reads every record and adds its `health/*` flags to it.

    with Tracker("runs/gsm8k", total_steps=200) as tracker:
        for step in range(1, 201):
            ...
            tracker.log({"reward/mean": 0.42, "loss": 0.13}, step=step)
        tracker.table("eval", ["task", "accuracy"], [["gsm8k", 0.61]])
    plot_metrics("runs/gsm8k/metrics.jsonl", "runs/gsm8k/curves.png")

Resuming: open with `append=True`, then `truncate_after(resume_step)` so records the
crashed run wrote after its last checkpoint are dropped instead of duplicated.

On a terminal the console shows a Rich progress bar (tamer.progress) with the latest loss,
reward and accuracy, seconds per step and the ETA; when stdout is not a terminal (CI,
`nohup`, a pipe) it falls back to one short line every `console_every` steps.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.table import Table

from tamer.config import FieldError
from tamer.health import HealthConfig, HealthMonitor
from tamer.progress import ProgressView
from tamer.rollout_log import RolloutFile, RolloutLogConfig, rollouts_markdown
from tamer.storage import read_jsonl, storage_errors, strict_dumps
from tamer.tracking_backends import MlflowConfig, WandbConfig, check_backends


@dataclass(frozen=True)
class TrackingConfig:
    """Where metrics, rollouts and warnings go besides metrics.jsonl."""

    console: bool = True  # progress bar on a terminal, periodic lines elsewhere
    tensorboard: bool = True  # false drops TensorBoard even when `backends` lists it
    console_every: int = 10  # steps between console lines when stdout is not a terminal
    backends: tuple[str, ...] = ("tensorboard",)  # tensorboard | wandb | mlflow (tamer.tracking_backends)
    wandb: WandbConfig = field(default_factory=WandbConfig)  # used when backends lists wandb
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)  # used when backends lists mlflow
    rollouts: RolloutLogConfig = field(default_factory=RolloutLogConfig)  # RL rollouts saved to rollouts.jsonl
    health: HealthConfig = field(default_factory=HealthConfig)  # training-health warnings

    def __post_init__(self) -> None:
        if self.console_every < 1:
            raise FieldError("console_every", f"expected >= 1, got {self.console_every}")
        check_backends(self.backends)


METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
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


# ---------------------------------------------------------------------------- tracker


class Tracker:
    """Fan one `log(metrics, step)` call out to the console, metrics.jsonl, TensorBoard and trackers.

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
        sinks: Sequence[Any] = (),
        health: HealthConfig | None = HealthConfig(),
    ) -> None:
        """`append` keeps an existing metrics.jsonl (resume); otherwise old logs are replaced.
        `console_every` is the non-terminal throttle in steps; `stream` redirects console
        output (default stdout), mostly for tests. `sinks`: opened experiment trackers
        (tamer.tracking_backends); `health`: the warnings' thresholds, None for none."""
        if console_every < 1:
            raise ValueError(f"console_every must be >= 1, got {console_every}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.append = append
        self._start = time.monotonic()
        self._closed = False
        self.console: Console | None = Console(file=stream) if console else None
        self._view = ProgressView(self.console, description, total_steps, console_every) if self.console else None
        self._sinks = list(sinks)
        self.health = HealthMonitor(health) if health is not None else None
        self.warnings: list[tuple[int, str]] = []  # (step, message) of every health warning raised
        self._rollouts = RolloutFile(self.run_dir, append=append)
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
        if self.health is not None:
            flags, started = self.health.update(values, int(step))
            values.update(flags)
            for message in started:
                self.warnings.append((int(step), message))
                if self.console is not None:
                    self.console.print(f"[bold yellow]warning:[/] {message}", soft_wrap=True, highlight=False)
        record = {"step": int(step), "time": round(time.monotonic() - self._start, 3), **values}
        if self._jsonl is not None:
            with storage_errors(self.metrics_path, "metrics"):  # a full disk: one line naming the file
                self._jsonl.write(strict_dumps(record) + "\n")  # NaN/inf -> null: strict JSON
                self._jsonl.flush()  # a crash must not lose the steps before it
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, global_step=int(step))
        for sink in self._sinks:
            sink.log(values, int(step))
        if self._view is not None:
            self._view.update(int(step), values)

    def log_rollouts(self, records: list[dict[str, Any]], step: int) -> None:
        """Append rollout records (tamer.rollout_log) to rollouts.jsonl and send them to the trackers."""
        if self._closed:
            raise RuntimeError("Tracker.log_rollouts called after close()")
        self._rollouts.write(records)
        if self._tb is not None and records:
            self._tb.add_text(f"rollouts/{records[0]['kind']}", rollouts_markdown(records), global_step=int(step))
        for sink in self._sinks:
            sink.log_rollouts(records, int(step))

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """The run's final figures, for the experiment trackers (summary.json is the job's to write)."""
        for sink in self._sinks:
            sink.log_summary(dict(summary))

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
            if self.health is not None:  # the checks' history as the interrupted run had it at `step`
                for record in kept:
                    self.health.update({k: v for k, v in record.items() if not k.startswith("health/")}, record["step"])
        self._rollouts.truncate_after(step)
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
        self._rollouts.close()
        for sink in self._sinks:
            sink.close()
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
    return read_jsonl(path)


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


def summary_baselines(summary: Mapping[str, Any], sft_summary: Mapping[str, Any] | None = None) -> dict:
    """{eval key: {"demonstrator": level, "SFT": level}} from a demo's summary and an SFT summary.

    Reads `demonstrator_accuracy`/`sft_accuracy` (single-turn demo), the `demonstrator`/`sft`
    sections (agent demo), and `demonstrator_accuracy`, `sft_eval/*` of sft/summary.json;
    the first value found for a level wins; non-numbers are skipped.
    """
    out: dict[str, dict[str, float]] = {}

    def put(key: str, label: str, value: Any) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out.setdefault(key, {}).setdefault(label, float(value))

    put("eval/accuracy", "demonstrator", summary.get("demonstrator_accuracy"))
    put("eval/accuracy", "SFT", summary.get("sft_accuracy"))
    for label, section in (("demonstrator", "demonstrator"), ("SFT", "sft")):
        if isinstance(summary.get(section), Mapping):
            for key, value in summary[section].items():
                put(f"eval/{key}", label, value)
    put("eval/accuracy", "demonstrator", (sft_summary or {}).get("demonstrator_accuracy"))
    for key, value in (sft_summary or {}).items():
        if key.startswith("sft_eval/"):
            put("eval/" + key[len("sft_eval/"):], "SFT", value)
    return out


def read_baselines(output_dir: str | Path, demo: bool = True) -> dict:
    """`summary_baselines` of OUTPUT_DIR/summary.json (with `demo`) and OUTPUT_DIR/sft/summary.json.

    An RL phase still running reads only the SFT summary: the demo's may be an earlier run's.
    """
    def load(path: Path) -> dict:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}

    output_dir = Path(output_dir)
    top = load(output_dir / "summary.json") if demo else {}
    return summary_baselines(top, load(output_dir / "sft" / "summary.json"))


BASELINE_STYLES = {"demonstrator": ("tab:gray", ":"), "SFT": ("tab:orange", "--")}


def plot_metrics(
    metrics_path: str | Path,
    out_png: str | Path,
    keys: Sequence[str] = ("reward/mean", "eval/accuracy"),
    title: str | None = None,
    baselines: Mapping[str, Mapping[str, float]] | None = None,
) -> Path:
    """Plot `keys` against step, one subplot per key present; returns the PNG path.

    Keys absent from the log are skipped; if none is present the figure says so. Eval
    keys (logged every few steps) are drawn with markers so sparse points stay visible.
    `baselines` ({key: {label: level}}, e.g. from `summary_baselines`) adds dashed levels.
    """
    fig = metrics_figure(metrics_path, keys, title, baselines)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return out_png


def metrics_figure(metrics_path: str | Path, keys: Sequence[str], title: str | None = None,
                   baselines: Mapping[str, Mapping[str, float]] | None = None):
    """The matplotlib Figure `plot_metrics` saves."""
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
        ax.plot(steps, values, marker=marker, markersize=4, linewidth=1.5, label="this run")
        for label, level in (baselines or {}).get(key, {}).items():
            color, style = BASELINE_STYLES.get(label, ("tab:green", "-."))
            ax.axhline(level, color=color, linestyle=style, linewidth=1.2, label=f"{label} {level:.3g}")
        if (baselines or {}).get(key):
            ax.legend(fontsize=8, loc="best")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    if not present:
        axes[0].text(0.5, 0.5, f"no data for {', '.join(keys)}", ha="center", va="center")
    axes[-1].set_xlabel("step")
    fig.suptitle(title if title is not None else _metrics_file(metrics_path).resolve().parent.name)
    return fig


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key`, skipping records without it and non-finite values."""
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [s for s, _ in pairs], [v for _, v in pairs]
