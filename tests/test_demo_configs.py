"""The agent demos' presets: the habits they rely on, and the scheduler's outcome-only twin."""

from __future__ import annotations

import dataclasses

from tamer.config import load_config
from tamer.pipeline import RunConfig
from tamer.presets import preset_path


def _preset(name: str) -> RunConfig:
    return load_config(RunConfig, [preset_path(name)])


def test_agent_demos_have_habitual_demonstrators():
    trip = _preset("demo-trip_planner").task.trip_planner
    assert trip.demo_check_all_rate > 0.5 and trip.demo_waste_rate == 0.0  # a habit SFT copies, not noise
    calc = _preset("demo-calculator").task.calculator
    assert calc.demo_double_check_rate > 0.5 and calc.demo_mental_rate > 0 and calc.demo_redundant_rate == 0.0


def test_scheduler_outcome_twin_only_changes_the_credit():
    base, outcome = _preset("demo-scheduler"), _preset("demo-scheduler-outcome")
    assert base.rl.algorithm.advantage == "turn_grpo" and base.reward.weights == {"correctness": 1.0, "process": 0.5}
    assert outcome.rl.algorithm.advantage == "grpo" and outcome.reward.weights == {"correctness": 1.0}
    assert base.sft == outcome.sft and base.task == outcome.task and base.eval == outcome.eval
    assert base.agent == outcome.agent and base.model == outcome.model
    assert base.rl.steps == outcome.rl.steps and base.rl.optim == outcome.rl.optim


def test_scheduler_preset_is_hard_for_outcome_only_credit():
    """The preset's demonstrator (what SFT copies, and about what its samples do) almost never gets a
    whole week right, while it books more than a fifth of the meetings right: an outcome-only learner sees
    nearly no success to learn from, per-turn process rewards see one per booking."""
    import random

    from tamer.tasks.scheduler import SchedulerTasks, Week, demonstrator_calls

    cfg = _preset("demo-scheduler").task.scheduler
    train, _ = SchedulerTasks(dataclasses.replace(cfg, train_size=1500, heldout_size=1)).split()
    rng, weeks, right, meetings = random.Random(0), 0, 0, 0
    for task in train:
        week = Week.from_dict(task.meta["week"])
        booked = [args["day"] for name, args in demonstrator_calls(week, rng, cfg.demo_hasty_rate) if name == "book"]
        hits = sum(b == a for b, a in zip(booked, week.answers))
        right, meetings, weeks = right + hits, meetings + len(week.answers), weeks + (hits == len(week.answers))
    assert weeks / len(train) < 0.01
    assert 0.2 < right / meetings < 0.5
