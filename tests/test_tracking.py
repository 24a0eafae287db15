"""Tracker: JSONL records, TensorBoard files, throttled non-TTY console, resume truncation, plots."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

from tamer.tracking import Tracker, plot_metrics, read_metrics


def _run(tmp_path, steps=range(1, 4), **kwargs):
    kwargs.setdefault("stream", io.StringIO())
    with Tracker(tmp_path, **kwargs) as tracker:
        for step in steps:
            tracker.log({"reward/mean": 0.1 * step, "loss": torch.tensor(1.0 / step)}, step=step)
    return tracker


def test_jsonl_records_have_step_time_and_python_numbers(tmp_path):
    with Tracker(tmp_path, tensorboard=False, stream=io.StringIO()) as tracker:
        tracker.log({"reward/mean": np.float32(0.5), "loss": torch.tensor(2.0), "n": 3, "ok": True}, step=7)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert set(record) == {"step", "time", "reward/mean", "loss", "n", "ok"}
    assert record["step"] == 7 and record["time"] >= 0
    assert record["reward/mean"] == 0.5 and record["loss"] == 2.0 and record["n"] == 3 and record["ok"] == 1
    assert read_metrics(tmp_path) == [record]


def test_rejects_non_scalars_and_reserved_keys(tmp_path):
    with Tracker(tmp_path, tensorboard=False, console=False) as tracker:
        with pytest.raises(TypeError, match="'x'"):
            tracker.log({"x": torch.ones(3)}, step=1)
        with pytest.raises(TypeError, match="'name'"):
            tracker.log({"name": "abc"}, step=1)
        with pytest.raises(ValueError, match="reserved"):
            tracker.log({"step": 1.0}, step=1)


def test_tensorboard_event_file_is_written(tmp_path):
    _run(tmp_path)
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_non_tty_console_is_throttled(tmp_path):
    stream = io.StringIO()
    _run(tmp_path, steps=range(1, 26), stream=stream, total_steps=25, tensorboard=False, console_every=10)
    lines = stream.getvalue().splitlines()
    # steps 1, 11, 21 by the throttle, then the final step once on close
    assert len(lines) == 4
    assert lines[0].startswith("train step 1/25") and "reward 0.1" in lines[0]
    assert lines[-1].startswith("train step 25/25")
    assert "\x1b[" not in stream.getvalue()  # no ANSI escapes in CI logs


def test_print_and_table_use_the_console(tmp_path):
    stream = io.StringIO()
    with Tracker(tmp_path, tensorboard=False, jsonl=False, stream=stream) as tracker:
        tracker.print("hello [1]")
        tracker.table("eval", ["task", "accuracy"], [["gsm8k", 0.61234]])
    out = stream.getvalue()
    assert "hello" in out and "gsm8k" in out and "0.6123" in out and "accuracy" in out


def test_console_off_prints_nothing(tmp_path, capsys):
    with Tracker(tmp_path, tensorboard=False, console=False) as tracker:
        tracker.log({"reward/mean": 1.0}, step=1)
        tracker.print("quiet")
        tracker.table("t", ["a"], [[1]])
    assert capsys.readouterr().out == ""


def test_append_and_truncate_after_resume(tmp_path):
    _run(tmp_path, steps=range(1, 6), tensorboard=False)
    # the crashed run died mid-line after step 5
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "ti')
    with Tracker(tmp_path, append=True, tensorboard=False, stream=io.StringIO()) as tracker:
        assert tracker.truncate_after(3) == 2
        tracker.log({"reward/mean": 9.0}, step=4)
    steps = [r["step"] for r in read_metrics(tmp_path)]
    assert steps == [1, 2, 3, 4]
    assert read_metrics(tmp_path)[-1]["reward/mean"] == 9.0


def test_truncate_after_hides_dropped_steps_in_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _run(tmp_path, steps=range(1, 5))
    with Tracker(tmp_path, append=True, stream=io.StringIO()) as tracker:
        tracker.truncate_after(2)
        tracker.log({"reward/mean": 5.0}, step=3)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = events.Scalars("reward/mean")
    assert [e.step for e in scalars] == [1, 2, 3]
    assert [e.value for e in scalars] == pytest.approx([0.1, 0.2, 5.0])


def test_fresh_run_replaces_old_logs(tmp_path):
    _run(tmp_path, steps=range(1, 6), tensorboard=False)
    _run(tmp_path, steps=[1], tensorboard=False)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]


def test_plot_metrics_writes_png_and_skips_missing_keys(tmp_path):
    with Tracker(tmp_path, tensorboard=False, console=False) as tracker:
        for step in range(1, 11):
            metrics = {"reward/mean": step / 10}
            if step % 5 == 0:
                metrics["eval/accuracy"] = step / 20
            tracker.log(metrics, step=step)
    out = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "plots" / "curves.png",
                       keys=("reward/mean", "eval/accuracy", "not/logged"), title="demo")
    assert out.exists() and out.stat().st_size > 1000
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = plot_metrics(tmp_path, tmp_path / "empty.png", keys=("absent",))
    assert empty.stat().st_size > 0


def test_no_global_state_between_trackers(tmp_path):
    a_out, b_out = io.StringIO(), io.StringIO()
    with Tracker(tmp_path / "a", tensorboard=False, stream=a_out) as a, \
            Tracker(tmp_path / "b", tensorboard=False, stream=b_out) as b:
        a.log({"reward/mean": 1.0}, step=1)
        b.log({"reward/mean": 2.0}, step=1)
    assert read_metrics(tmp_path / "a")[0]["reward/mean"] == 1.0
    assert read_metrics(tmp_path / "b")[0]["reward/mean"] == 2.0
    assert "reward 2" not in a_out.getvalue() and "reward 1" not in b_out.getvalue()
