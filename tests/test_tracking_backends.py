"""W&B (offline) and MLflow (local file store) sinks: config, scalars, rollout tables, summary; extras checked first."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tamer.cli import app
from tamer.config import ConfigError, load_config
from tamer.pipeline import RunConfig, run_rl
from tamer.tracking_backends import mlflow_key

TINY_RL = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
           "rl.steps=2", "rl.prompts_per_step=2", "rl.group_size=4", "rl.max_new_tokens=8", "rl.eval_every=1",
           "eval.size=4", "eval.max_new_tokens=8", "tracking.console=false",
           "reward.weights={correctness: 1.0, length: 1.0}", "reward.params={length: {max_tokens: 8}}"]


def _missing(module: str, monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))


@pytest.mark.parametrize("backend", ["wandb", "mlflow"])
def test_a_missing_extra_fails_before_any_work_with_the_pip_command(backend, monkeypatch, tmp_path):
    _missing(backend, monkeypatch)
    with pytest.raises(ConfigError,
                       match=rf'tracking.backends: {backend} is not installed; pip install "tamer\[{backend}\]"'):
        load_config(RunConfig, overrides=[f"tracking.backends=[tensorboard, {backend}]"])
    result = CliRunner().invoke(app, ["train", "--set", f"tracking.backends=[{backend}]", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and f'pip install "tamer[{backend}]"' in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_unknown_backend_and_default():
    with pytest.raises(ConfigError,
                       match="tracking.backends: unknown backend 'neptune'; valid: tensorboard, wandb, mlflow"):
        load_config(RunConfig, overrides=["tracking.backends=[neptune]"])
    assert load_config(RunConfig).tracking.backends == ("tensorboard",)


def test_mlflow_key_keeps_what_mlflow_accepts():
    assert mlflow_key("eval/pass@4") == "eval/pass_4" and mlflow_key("reward/mean") == "reward/mean"


def _tiny_run(tmp_path: Path, backend: str) -> tuple[Path, dict]:
    out = tmp_path / "run"
    config = load_config(RunConfig, overrides=[*TINY_RL, f"output_dir={out}",
                                               f"tracking.backends=[tensorboard, {backend}]"])
    result = run_rl(config)
    return out, result


def test_mlflow_file_store_gets_config_scalars_rollouts_and_summary(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason='the mlflow extra is missing: pip install -e ".[mlflow]"')
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out, result = _tiny_run(tmp_path, "mlflow")
    client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("tamer")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run-rl" and run.data.tags["phase"] == "rl" and run.info.status == "FINISHED"
    assert run.data.params["rl.steps"] == "2" and run.data.params["rl.optim.lr"] == "0.0001"
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    local = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [(m.step, m.value) for m in history] == [(r["step"], r["reward/mean"]) for r in local if "reward/mean" in r]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy")] == [0, 1, 2]
    assert (run.data.metrics["summary/rl_steps"] == 2
            and run.data.metrics["summary/eval/accuracy"] == result["rl_accuracy"])
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
    assert json.loads((artifacts / "summary.json").read_text())["rl_steps"] == 2
    assert json.loads((artifacts / "config.json").read_text())["rl"]["steps"] == 2
    table = json.loads((artifacts / "rollouts" / "train-step000001.json").read_text())
    assert "completion" in table["columns"] and len(table["data"]) == 2 * 4  # 2 groups x 4 attempts
    assert (artifacts / "rollouts" / "eval-step000002.json").is_file()


def _wandb_records(run_file: Path) -> list:
    """Records of an offline run's .wandb file (a LevelDB-style log of protobuf Records, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, out, pending = 7, [], b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a record header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a FULL record, or the LAST piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


@pytest.mark.slow  # wandb runs its own service process
def test_wandb_offline_gets_config_scalars_rollout_tables_and_summary(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason='the wandb extra is missing: pip install -e ".[wandb]"')
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out, result = _tiny_run(tmp_path, "wandb")
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    records = _wandb_records(run_file)
    kinds = [r.WhichOneof("record_type") for r in records]
    run = records[kinds.index("run")].run
    assert run.display_name == "run-rl" and run.run_group == "run" and run.job_type == "rl"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["rl"]["steps"] == 2 and config["tracking"]["backends"] == ["tensorboard", "wandb"]
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            history.setdefault(r.history.step.num, {}).update(items)
    local = {json.loads(line)["step"]: json.loads(line)
             for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()}
    assert sorted(history) == [0, 1, 2]
    assert history[1]["reward/mean"] == pytest.approx(local[1]["reward/mean"])
    assert history[2]["eval/accuracy"] == local[2]["eval/accuracy"]
    # a table is a nested value: its fields arrive as nested keys
    assert history[1]["rollouts/train/_type"] == "table-file" and history[2]["rollouts/eval/_type"] == "table-file"
    assert history[1]["rollouts/train/nrows"] == 2 * 4
    tables = run_file.parent / "files" / "media" / "table" / "rollouts"
    table = json.loads(next(tables.glob("train_1_*.table.json")).read_text())
    assert "completion" in table["columns"] and len(table["data"]) == 2 * 4
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.summary.update})
    assert summary["rl_steps"] == 2 and summary["eval/accuracy"] == result["rl_accuracy"]
