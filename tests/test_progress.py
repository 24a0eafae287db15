"""Progress: plain lines with s/step and ETA off a terminal, Rich bar fields on one, SFT and eval reporting."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from tamer import progress
from tamer.evaluate import EvalConfig, evaluate
from tamer.models import stop_token_ids
from tamer.progress import ProgressView, format_seconds, progress_task, report_progress
from tamer.rollout.engine import HFEngine
from tamer.rollout.runner import Rollout
from tamer.tasks import ArithmeticTasks
from tamer.tracking import Tracker
from tamer.trainers.sft import SFTConfig, SFTTrainer, demonstrations


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(progress.time, "perf_counter", c)
    return c


def test_plain_lines_carry_loss_rate_and_eta(clock):
    out = io.StringIO()
    with ProgressView(Console(file=out), "sft", total=100, every=10) as view:
        for step in range(1, 22):
            clock.now += 2.0  # 2 s per step
            view.update(step, {"sft/loss": 1.0 / step})
    lines = out.getvalue().splitlines()
    assert [ln.split()[2] for ln in lines] == ["1/100", "11/100", "21/100"]
    assert lines[0] == "sft step 1/100  loss 1"  # no rate yet: measured from the first report
    assert lines[1] == "sft step 11/100  loss 0.09091  2.00 s/step  ETA 2m58s"
    assert "\x1b[" not in out.getvalue()


def test_a_slow_run_still_prints_a_line_a_minute(clock):
    out = io.StringIO()
    with ProgressView(Console(file=out), "rl", total=10, every=10) as view:
        for step in range(0, 4):
            clock.now += 45.0
            view.update(step, {"reward/mean": 0.5})
    steps = [ln.split()[2] for ln in out.getvalue().splitlines()]
    assert steps == ["0/10", "2/10", "3/10"]  # 90 s after step 0; the final state on close


def test_terminal_bar_fields(clock):
    console = Console(file=io.StringIO(), force_terminal=True, width=200)
    view = ProgressView(console, "rl", total=40)
    try:
        view.update(0, {"eval/accuracy": 0.6})
        clock.now += 3.0
        view.update(1, {"train/loss": 0.25, "reward/mean": 0.5})
        task = view.progress.tasks[0]
        assert task.completed == 1 and task.fields["rate"] == "3.00 s/step" and task.fields["eta"] == "ETA 1m57s"
        assert task.fields["headline"] == "loss 0.25  reward 0.5  acc 0.6"
        with progress_task("eval", 8) as advance:
            advance(8)
            assert view.progress.tasks[-1].completed == 8 and len(view.progress.tasks) == 2
        assert len(view.progress.tasks) == 1  # the eval bar is transient
    finally:
        view.close()


def test_reporting_without_a_view_does_nothing():
    assert progress.active_view() is None
    report_progress(3, {"sft/loss": 1.0})
    with progress_task("eval", 4) as advance:
        advance(4)
    assert format_seconds(59) == "59s" and format_seconds(3725) == "1h02m"


def test_sft_reports_every_step_and_evaluation_its_progress(tiny_model, tokenizer, tmp_path):
    out = io.StringIO()
    train, held = ArithmeticTasks().split()
    data = demonstrations(ArithmeticTasks(), train[:32], tokenizer)
    with Tracker(tmp_path, tensorboard=False, stream=out, total_steps=12, console_every=5,
                 description="sft") as tracker:
        SFTTrainer(tiny_model, tokenizer, data, SFTConfig(steps=12, batch_size=4, log_every=25)).train(tracker)
        rollout = Rollout(HFEngine(tiny_model, tokenizer.pad_token_id, max_batch=4), tokenizer)
        evaluate(rollout, held[:10], EvalConfig(size=10, max_new_tokens=4), stop_token_ids(tokenizer))
    lines = out.getvalue().splitlines()
    # SFT logs metrics only at step 12 (log_every 25), yet the console shows steps 1, 6 and 11
    assert [ln.split()[2] for ln in lines if ln.startswith("sft step")] == ["1/12", "6/12", "11/12", "12/12"]
    assert "sft eval: 10/10 in" in out.getvalue()
