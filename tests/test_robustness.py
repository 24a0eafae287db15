"""Nothing lost, nothing left behind (fast tier): output-dir lock, strict JSON, resume edge
cases, disk and permission errors, atomic saves, unloadable model directories, stop between
steps (the stop flag set directly; real signals are in test_robustness_slow.py)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import signal

import pytest
import torch
from typer.testing import CliRunner

from tamer.cli import app
from tamer.config import load_config
from tamer.models import build_tiny_model, save_model
from tamer.pipeline import RunConfig, run_rl, run_sft
from tamer.tracking import Tracker, plot_metrics, read_metrics
from tests.conftest import TINY

runner = CliRunner()
LOCK_NAME = ".tamer-lock"
TINY_SETS = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
             "sft.steps=6", "sft.batch_size=4", "sft.log_every=1", "rl.steps=4", "rl.prompts_per_step=2",
             "rl.group_size=2", "rl.max_new_tokens=6", "eval.size=4", "eval.max_new_tokens=6", "rl.eval_every=0",
             "tracking.tensorboard=false", "tracking.console=false", "model.threads=1",
             "task.arithmetic.train_size=64", "task.arithmetic.heldout_size=16"]


def _config(out, *extra: str) -> RunConfig:
    return load_config(RunConfig, None, [*TINY_SETS, f"output_dir={out}", *extra])


def _cli_sets(*extra: str) -> list[str]:
    return [arg for item in (*TINY_SETS, *extra) for arg in ("--set", item)]


def _foreign_holder(directory, pid: int):
    """Hold `directory`'s lock through a separate open file description, as another process would."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps({"pid": pid, "host": os.uname().nodename, "command": "tamer train -c other.yaml",
                             "since": "2025-01-01T00:00:00"}).encode())
    return fd


@pytest.fixture(autouse=True)
def _no_stop_left():
    yield
    import sys

    if "tamer.stopping" in sys.modules:
        sys.modules["tamer.stopping"].reset()


# ---------------------------------------------------------------------------- 1. lock
def test_second_run_in_a_held_output_dir_fails_at_once_naming_dir_and_holder(tmp_path):
    out = tmp_path / "run"
    fd = _foreign_holder(out, pid=424242)
    try:
        result = runner.invoke(app, ["train", "-o", str(out), *_cli_sets()])
    finally:
        os.close(fd)
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert "error:" in line and str(out) in line and "in use by another run" in line and "pid 424242" in line
    assert "other.yaml" in line and len(result.output.strip().splitlines()) <= 3  # one line, soft-wrapped at most
    assert not (out / "rl").exists()  # nothing of the run was started


def test_lock_is_reentrant_released_and_stale_holder_is_ignored(tmp_path):
    from tamer.runlock import output_dir_lock

    out = tmp_path / "run"
    out.mkdir()
    # A lock file naming a dead process, but not flock'ed by anyone: stale, taken over.
    (out / LOCK_NAME).write_text(json.dumps({"pid": 999999, "host": os.uname().nodename}))
    with output_dir_lock(out):
        with output_dir_lock(out):  # the demo: SFT and RL inside one job
            assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
        fd = os.open(out / LOCK_NAME, os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # still held after the inner exit
        os.close(fd)
    fd = os.open(out / LOCK_NAME, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released
    os.close(fd)
    assert (out / LOCK_NAME).read_text() == ""  # names no holder once released


def test_lock_without_flock_falls_back_to_pid_and_takes_over_dead_holders(tmp_path, monkeypatch):
    from tamer.runlock import LockError, output_dir_lock

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    out = tmp_path / "nfs"
    out.mkdir()
    host = os.uname().nodename
    (out / LOCK_NAME).write_text(json.dumps({"pid": os.getppid(), "host": host, "command": "x"}))
    with pytest.raises(LockError, match=f"pid {os.getppid()}"), output_dir_lock(out):
        pass
    (out / LOCK_NAME).write_text(json.dumps({"pid": 999999, "host": host, "command": "x"}))  # dead: stale
    with output_dir_lock(out):
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert not (out / LOCK_NAME).exists()


# ---------------------------------------------------------------------------- 5. strict JSON
def test_nan_and_inf_metrics_are_written_as_null_strict_json(tmp_path):
    from tamer.pipeline import write_json

    with Tracker(tmp_path, tensorboard=False, console=False) as tracker:
        tracker.log({"eval/accuracy": float("nan"), "loss": torch.tensor(float("inf")), "ok": 1.0}, step=1)
        tracker.log({"eval/accuracy": 0.5}, step=2)

    def reject(name):
        raise ValueError(f"non-strict JSON constant {name}")

    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=reject)
    assert read_metrics(tmp_path)[0]["eval/accuracy"] is None and read_metrics(tmp_path)[0]["loss"] is None
    plot_metrics(tmp_path, tmp_path / "p.png", keys=("eval/accuracy",))  # nulls are skipped, not a crash
    write_json(tmp_path / "summary.json", {"sft_loss": float("nan"), "nested": [float("-inf"), 1.0]})
    assert (json.loads((tmp_path / "summary.json").read_text(), parse_constant=reject)
            == {"sft_loss": None, "nested": [None, 1.0]})


# ---------------------------------------------------------------------------- 5. resume edge cases
def test_resume_without_a_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", "--resume", "-o", str(out), *_cli_sets()])
    assert result.exit_code == 2, result.output
    assert "no checkpoint to resume from" in " ".join(result.output.split())
    assert not (out / "rl" / "metrics.jsonl").exists()


def test_resume_if_exists_starts_fresh_without_a_checkpoint(tmp_path):
    result = run_rl(_config(tmp_path / "run", "rl.steps=1"), resume="if-exists")
    assert result["rl_steps"] == 1


def test_damaged_latest_checkpoint_is_reported_and_the_previous_one_used(tmp_path, capsys):
    out = tmp_path / "run"
    run_rl(_config(out, "rl.checkpoint_every=2", "rl.keep_checkpoints=3"))
    ckpts = out / "rl" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-000004"
    (ckpts / "step-000004" / "trainer_state.pt").write_bytes(b"\x80garbage")  # torn / garbled
    result = run_rl(_config(out, "rl.checkpoint_every=2", "rl.keep_checkpoints=3", "tracking.console=true",
                            "rl.steps=6"), resume=True)
    printed = " ".join(capsys.readouterr().out.split())
    assert "step-000004" in printed and "damaged" in printed and "resumed from" in printed
    assert "step-000002 at step 2" in printed
    assert result["rl_steps"] == 6
    assert (ckpts / "step-000004.corrupt").is_dir()  # kept for inspection, never picked again
    steps = [r["step"] for r in read_metrics(out / "rl")]
    assert steps == sorted(steps) and steps[-1] == 6 and steps.count(3) == 1


# ---------------------------------------------------------------------------- 4. disk and permissions
def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_failed_final_save_leaves_no_half_model(tmp_path, monkeypatch, tokenizer):
    model = build_tiny_model(tokenizer, TINY)
    target = tmp_path / "model"
    save_model(model, tokenizer, target)  # a previous, complete save
    before = sorted(p.name for p in target.iterdir())
    monkeypatch.setattr(type(tokenizer), "save_pretrained", _enospc)  # weights written, then the disk fills
    with pytest.raises(Exception, match="no space left on device") as info:
        save_model(model, tokenizer, target)
    assert type(info.value).__name__ == "StorageError"
    assert str(target) in str(info.value) and "\n" not in str(info.value)
    assert sorted(p.name for p in target.iterdir()) == before  # the earlier model, untouched
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temp directory left behind
    fresh = tmp_path / "fresh"
    with pytest.raises(Exception, match="no space left"):
        save_model(model, tokenizer, fresh)
    assert not fresh.exists()  # never a config without weights


def test_disk_full_during_checkpoint_is_one_line_naming_the_path(tmp_path, monkeypatch):
    def torch_save_fails(*args, **kwargs):  # what torch raises when the disk fills mid-write
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1234 vs 1180")

    monkeypatch.setattr(torch, "save", torch_save_fails)
    result = runner.invoke(app, ["train", "-o", str(tmp_path / "run"),
                                 *_cli_sets("rl.steps=2", "rl.checkpoint_every=1")])
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert "checkpoints/step-000001" in line and "cannot write a checkpoint" in line and "disk full" in line
    assert not [p for p in (tmp_path / "run" / "rl" / "checkpoints").iterdir() if p.name.startswith(".tmp")]


def test_too_little_free_space_fails_before_training(tmp_path, monkeypatch):
    import tamer.storage

    monkeypatch.setattr(tamer.storage.shutil, "disk_usage",
                        lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 50_000, 50_000))
    result = runner.invoke(app, ["sft", "-o", str(tmp_path / "run"), *_cli_sets()])
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert "not enough free space" in line and "MB free" in line and str(tmp_path / "run" / "sft") in line
    assert not (tmp_path / "run" / "sft" / "metrics.jsonl").exists()


def test_unwritable_output_dir_is_one_line_before_any_work(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir(mode=0o555)
    os.chmod(tmp_path, 0o755)
    out = parent / "run"
    with _AsNobody():
        result = runner.invoke(app, ["train", "-o", str(out), *_cli_sets()])
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert str(out) in line and "permission denied" in line.lower()
    assert len(result.output.strip().splitlines()) <= 2


class _AsNobody:
    def __enter__(self):
        self.root = os.geteuid() == 0
        if self.root:
            os.seteuid(65534)

    def __exit__(self, *exc):
        if self.root:
            os.seteuid(0)


# ---------------------------------------------------------------------------- 6. model directories
@pytest.mark.parametrize("case, expected", [
    ("no_weights", "no model weights"),
    ("junk_config", "config.json: not valid JSON"),
    ("not_a_model_config", "no \"model_type\""),
    ("missing_shard", "weight shard model-00002-of-00002.safetensors is missing"),
])
def test_unloadable_model_dir_is_one_line_naming_what_is_missing(tmp_path, tokenizer, case, expected):
    d = tmp_path / "m"
    save_model(build_tiny_model(tokenizer, TINY), tokenizer, d)
    if case == "no_weights":
        (d / "model.safetensors").unlink()
    elif case == "junk_config":
        (d / "config.json").write_text("{this is not json")
    elif case == "not_a_model_config":
        (d / "config.json").write_text('{"hello": 1}')
    else:
        (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    result = runner.invoke(app, ["eval", "--model", str(d), "--set", "eval.size=2"])
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split()) and str(d) in " ".join(result.output.split())
    assert len(result.output.strip().splitlines()) <= 2


# ---------------------------------------------------------------------------- 2. stop between steps
def _stop_after(step: int, signum=signal.SIGTERM):
    """A Tracker.log wrapper that raises the stop flag once `step` is logged, as the handler would."""
    from tamer import stopping

    original = Tracker.log

    def log(self, metrics, at):
        original(self, metrics, at)
        if at == step:
            stopping._state["signal"] = signum

    return log


def _weights(path):
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def _records(run_dir):
    return [{k: v for k, v in r.items() if not k.startswith("time")} for r in read_metrics(run_dir)]


@pytest.mark.parametrize("phase", ["sft", "rl"])
def test_stop_checkpoints_writes_summary_and_resume_is_exact(tmp_path, monkeypatch, phase):
    from tamer import stopping

    job = run_sft if phase == "sft" else run_rl
    full = tmp_path / "full"
    job(_config(full))
    part = tmp_path / "part"
    with monkeypatch.context() as patch, stopping.graceful_stop():
        patch.setattr(Tracker, "log", _stop_after(3))
        with pytest.raises(stopping.TrainingStopped) as info:
            job(_config(part))
    stop = info.value
    assert stop.step == 3 and stop.exit_code == 143 and stop.checkpoint.name == "step-000003"
    summary = json.loads((part / phase / "summary.json").read_text())
    assert summary["stopped"] is True and summary["signal"] == "SIGTERM" and summary["step"] == 3
    assert not (part / phase / "model").exists()
    stopping.reset()
    job(_config(part), resume=True)
    assert _records(part / phase) == _records(full / phase)  # every metric, bit for bit
    for name, tensor in _weights(full / phase / "model").items():
        assert torch.equal(tensor, _weights(part / phase / "model")[name]), name


def test_sft_checkpoint_every_and_resume_continue_the_same_data_order(tmp_path, tokenizer):
    from tamer.tasks import ArithmeticTasks
    from tamer.trainers.sft import SFTConfig, SFTTrainer, demonstrations

    source = ArithmeticTasks()
    data = demonstrations(source, source.split()[0][:40], tokenizer)
    cfg = SFTConfig(steps=5, batch_size=4, log_every=2, checkpoint_every=2)
    torch.manual_seed(0)
    whole = build_tiny_model(tokenizer, TINY)
    SFTTrainer(whole, tokenizer, data, cfg, run_dir=tmp_path / "a").train()
    first = build_tiny_model(tokenizer, TINY)
    with pytest.raises(StopIteration):  # "crash" in step 5, after step 4's checkpoint
        SFTTrainer(first, tokenizer, data, cfg, run_dir=tmp_path / "b").train(_RaiseAt(5))
    resumed = build_tiny_model(tokenizer, TINY)
    trainer = SFTTrainer(resumed, tokenizer, data, cfg, run_dir=tmp_path / "b")
    assert trainer.resume(tmp_path / "b" / "checkpoints" / "step-000004") == 4
    trainer.train()
    for a, b in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


class _RaiseAt:
    def __init__(self, step):
        self.step = step

    def log(self, metrics, step):
        if step == self.step:
            raise StopIteration


def test_stopped_demo_resumes_reusing_finished_phases(tmp_path, monkeypatch):
    from tamer import stopping
    from tamer.pipeline import run_demo

    full_dir, part = tmp_path / "full", tmp_path / "part"
    full = run_demo(_config(full_dir))
    with monkeypatch.context() as patch, stopping.graceful_stop():
        patch.setattr(Tracker, "log", _stop_after_phase("rl", 2))
        with pytest.raises(stopping.TrainingStopped) as info:
            run_demo(_config(part))
    assert info.value.phase == "rl" and info.value.step == 2
    assert json.loads((part / "sft" / "summary.json").read_text())["sft_steps"] == 6  # SFT finished
    stopping.reset()
    resumed = run_demo(_config(part), resume=True)
    for key in ("demonstrator_accuracy", "sft_accuracy", "rl_accuracy", "rl_steps"):
        assert resumed[key] == full[key], key
    assert _records(part / "rl") == _records(full_dir / "rl") and _records(part / "sft") == _records(full_dir / "sft")


def _stop_after_phase(phase: str, step: int):
    from tamer import stopping

    original = Tracker.log

    def log(self, metrics, at):
        original(self, metrics, at)
        if at == step and self.run_dir.name == phase:
            stopping._state["signal"] = signal.SIGINT

    return log
