"""Experiment trackers users already read: Weights & Biases and MLflow, as optional sinks.

    tracking:
      backends: [tensorboard, wandb, mlflow]      # tensorboard alone is the default
      wandb: {project: my-agent}                  # WANDB_MODE=offline works without an account
      mlflow: {tracking_uri: ""}                  # "": a local file store in OUTPUT_DIR/mlruns

Each phase of a run (sft, rl) becomes one tracker run named OUTPUT_DIR's name plus the phase,
grouped by OUTPUT_DIR's name. A run receives:

    config    the whole resolved RunConfig (W&B: run config; MLflow: flattened params + config.json)
    scalars   every record the Tracker logs, at its step (MLflow: names with characters it
              refuses, such as '@', get '_'; non-finite values are skipped)
    rollouts  the saved rollouts (tamer.rollout_log) as tables: W&B `rollouts/train|eval`
              tables, MLflow `rollouts/<kind>-stepNNNNNN.json` table artifacts
    summary   the phase's final figures (W&B run summary; MLflow summary.json + `summary/*` metrics)

Each backend is an extra (`pip install "tamer[wandb]"`, `"tamer[mlflow]"`); naming one that is
not installed fails while the config is checked, before any work, with the pip command.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tamer.config import FieldError
from tamer.rollout_log import rollout_rows, strict_json

BACKENDS = ("tensorboard", "wandb", "mlflow")
EXTRA_MODULES = {"wandb": "wandb", "mlflow": "mlflow"}  # backend -> module its extra installs


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases settings (`tracking.wandb.*`); WANDB_* environment variables also apply."""

    project: str = "tamer"  # W&B project name
    entity: str = ""  # "": your default entity
    mode: str = ""  # online | offline | disabled; "": WANDB_MODE, else wandb's default
    table_rows: int = 64  # rollouts per logged table (the first ones of each call)

    def __post_init__(self) -> None:
        if self.mode not in ("", "online", "offline", "disabled"):
            raise FieldError("mode", f"expected online, offline or disabled, got {self.mode!r}")


@dataclass(frozen=True)
class MlflowConfig:
    """MLflow settings (`tracking.mlflow.*`)."""

    tracking_uri: str = ""  # "": MLFLOW_TRACKING_URI, else a local file store in OUTPUT_DIR/mlruns
    experiment: str = "tamer"  # MLflow experiment name
    table_rows: int = 64  # rollouts per logged table artifact


def check_backends(names: tuple[str, ...]) -> None:
    """Unknown names and missing extras as one-line errors naming the field and the pip command."""
    for name in names:
        if name not in BACKENDS:
            raise FieldError("backends", f"unknown backend {name!r}; valid: {', '.join(BACKENDS)}")
        module = EXTRA_MODULES.get(name)
        if module and importlib.util.find_spec(module) is None:
            raise FieldError("backends", f"{name} is not installed; pip install \"tamer[{name}]\" "
                             f"(from a checkout: pip install -e \".[{name}]\")")


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"rl": {"optim": {"lr": 1e-4}}} -> {"rl.optim.lr": 1e-4}."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def run_names(output_dir: str, phase: str) -> tuple[str, str]:
    group = Path(output_dir).resolve().name
    return f"{group}-{phase}", group


# ---------------------------------------------------------------------------- W&B
class WandbSink:
    """One W&B run per phase."""

    def __init__(self, settings: WandbConfig, output_dir: str, phase: str, config: dict[str, Any]) -> None:
        import wandb

        self.wandb, self.settings = wandb, settings
        name, group = run_names(output_dir, phase)
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=settings.project, entity=settings.entity or None, name=name, group=group,
                              job_type=phase, dir=str(output_dir), config=strict_json(config),
                              mode=settings.mode or None, reinit="finish_previous",
                              settings=wandb.Settings(silent=True, console="off"))

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def log_rollouts(self, records: list[dict[str, Any]], step: int) -> None:
        if not records:
            return
        columns, rows = rollout_rows(records[: self.settings.table_rows])
        self.run.log({f"rollouts/{records[0]['kind']}": self.wandb.Table(columns=columns, data=rows)}, step=step)

    def log_summary(self, summary: dict[str, Any]) -> None:
        self.run.summary.update(strict_json(summary))

    def close(self) -> None:
        self.run.finish()


# ---------------------------------------------------------------------------- MLflow
_MLFLOW_BAD = re.compile(r"[^0-9A-Za-z_\-. /]")


def mlflow_key(name: str) -> str:
    """A metric name MLflow accepts (letters, digits, _ - . space /): `eval/pass@4` -> `eval/pass_4`."""
    return _MLFLOW_BAD.sub("_", name)


class MlflowSink:
    """One MLflow run per phase, through `MlflowClient` (no global active run)."""

    def __init__(self, settings: MlflowConfig, output_dir: str, phase: str, config: dict[str, Any]) -> None:
        uri = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or \
            (Path(output_dir).resolve() / "mlruns").as_uri()
        if uri.startswith("file:"):
            # MLflow 3 keeps the file store in maintenance mode and refuses it unless opted in;
            # a local run directory is exactly what it is for here.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.Metric, self.settings = Metric, settings
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(settings.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(settings.experiment)
        name, group = run_names(output_dir, phase)
        self.run_id = self.client.create_run(experiment_id, run_name=name,
                                             tags={"phase": phase, "group": group}).info.run_id
        params = [Param(k, json.dumps(v) if isinstance(v, (dict, list)) else str(v))
                  for k, v in flatten(strict_json(config)).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_dict(self.run_id, strict_json(config), "config.json")

    def log(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        metrics = [self.Metric(mlflow_key(k), float(v), now, step) for k, v in values.items() if math.isfinite(v)]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def log_rollouts(self, records: list[dict[str, Any]], step: int) -> None:
        if not records:
            return
        columns, rows = rollout_rows(records[: self.settings.table_rows])
        table = {c: [row[i] for row in rows] for i, c in enumerate(columns)}
        self.client.log_table(self.run_id, data=table,
                              artifact_file=f"rollouts/{records[0]['kind']}-step{step:06d}.json")

    def log_summary(self, summary: dict[str, Any]) -> None:
        clean = strict_json(summary)
        self.client.log_dict(self.run_id, clean, "summary.json")
        now = int(time.time() * 1000)
        numbers = [self.Metric(mlflow_key(f"summary/{k}"), float(v), now, 0) for k, v in clean.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if numbers:
            self.client.log_batch(self.run_id, metrics=numbers)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def open_sinks(tracking, output_dir: str, phase: str, config: dict[str, Any]) -> list:
    """The experiment-tracker sinks `tracking.backends` names (TensorBoard is the Tracker's own)."""
    sinks: list = []
    if "wandb" in tracking.backends:
        sinks.append(WandbSink(tracking.wandb, output_dir, phase, config))
    if "mlflow" in tracking.backends:
        sinks.append(MlflowSink(tracking.mlflow, output_dir, phase, config))
    return sinks
