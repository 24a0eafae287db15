"""Training-health warnings on constructed metric sequences, and their path through the tracker."""

from __future__ import annotations

import io
import json

import pytest

from tamer.health import HealthConfig, HealthMonitor
from tamer.tracking import Tracker


def feed(records: list[tuple[int, dict]], config: HealthConfig = HealthConfig()):
    monitor = HealthMonitor(config)
    flags, warnings = {}, []
    for step, metrics in records:
        f, w = monitor.update(metrics, step)
        flags[step] = f
        warnings += [(step, m) for m in w]
    return flags, warnings


def step_metrics(zero=0.2, correctness=0.7, calls=2.0, errors=0.0, n=64.0, reward_errors=None) -> dict:
    out = {"reward/mean": correctness, "reward/correctness": correctness, "rollout/zero_spread_frac": zero,
           "rollout/tool_calls": calls, "rollout/errors": errors, "rollout/trajectories": n}
    out.update({f"reward/errors/{k}": v for k, v in (reward_errors or {"correctness": 0.0}).items()})
    return out


def test_healthy_run_raises_nothing():
    records = [(0, {"eval/success_rate": 0.7})] + [(s, step_metrics()) for s in range(1, 11)]
    records[5] = (5, {**records[5][1], "eval/success_rate": 0.72})
    flags, warnings = feed(records)
    assert warnings == []
    assert all(v == 0.0 for f in flags.values() for v in f.values())
    assert set(flags[3]) == {"health/correctness_collapse", "health/zero_spread", "health/tool_errors",
                             "health/tools_abandoned", "health/reward_failing"}


def test_the_silent_collapse_is_named():
    # The case that went unnoticed: held-out success 0.705 -> 0.000, every group with zero
    # spread, tool calls falling to zero; the only console sign was "acc 0".
    records = [(0, {"eval/success_rate": 0.705})]
    for step in range(1, 11):
        fade = max(0.0, 1 - step / 4)
        records.append((step, step_metrics(zero=0.5 if step < 3 else 1.0, correctness=0.7 * fade, calls=2.0 * fade)))
    records[-1] = (10, {**records[-1][1], "eval/success_rate": 0.0})
    flags, warnings = feed(records)
    started = {m.split(":")[0]: s for s, m in warnings}
    # zero spread from step 3 on: three steps in a row at step 5
    assert started["no learning signal"] == 5
    assert started["training success collapsed"] == 5  # mean of steps 3-5 vs mean of steps 1-3
    assert started["the agent stopped calling tools"] == 6  # steps 4-6 average zero calls
    assert started["held-out success collapsed"] == 10
    assert "0.000 at step 10, 0.705 at the start" in dict((s, m) for s, m in warnings)[10]
    assert flags[10]["health/success_collapse"] == 1.0 and flags[10]["health/zero_spread"] == 1.0
    assert len(warnings) == 4  # each once, not once per step


def test_zero_spread_needs_patience_steps_in_a_row_and_rearms():
    seq = [0.95, 0.95, 0.5, 0.95, 0.95, 0.95, 0.95, 0.1, 0.92, 0.93, 0.99]
    flags, warnings = feed([(s, {"rollout/zero_spread_frac": z}) for s, z in enumerate(seq, start=1)])
    assert [s for s, _ in warnings] == [6, 11]  # steps 4-6, then again after it cleared at step 8
    assert [flags[s]["health/zero_spread"] for s in range(1, 12)] == [0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 1]


def test_reward_function_failing_on_every_call():
    cumulative = {"ok": 0.0, "broken": 0.0}
    records = []
    for step in range(1, 5):
        cumulative["broken"] += 64 if step >= 3 else 5  # partial failures first, then every call
        records.append((step, step_metrics(reward_errors=dict(cumulative))))
    flags, warnings = feed(records)
    assert [s for s, _ in warnings] == [3]
    assert "'broken' (64/64)" in warnings[0][1] and "'ok'" not in warnings[0][1]
    assert [flags[s]["health/reward_failing"] for s in range(1, 5)] == [0, 0, 1, 1]


def test_tool_errors_dominate():
    ratios = [(2.0, 0.2), (2.0, 1.5), (2.0, 1.2), (1.0, 0.9), (2.0, 0.1)]
    records = [(s, step_metrics(calls=c, errors=e)) for s, (c, e) in enumerate(ratios, start=1)]
    flags, warnings = feed(records)
    assert [s for s, _ in warnings] == [4] and "0.90 errors per tool call" in warnings[0][1]
    assert flags[5]["health/tool_errors"] == 0.0


def test_disabled_monitor_and_bad_thresholds():
    assert feed([(1, step_metrics(zero=1.0))] * 5, HealthConfig(enabled=False)) == ({1: {}}, [])
    with pytest.raises(ValueError, match="^zero_spread_frac: "):
        HealthConfig(zero_spread_frac=1.5)
    with pytest.raises(ValueError, match="^patience: "):
        HealthConfig(patience=0)


def test_tracker_prints_each_warning_once_and_records_the_flags(tmp_path):
    stream = io.StringIO()
    with Tracker(tmp_path, tensorboard=False, stream=stream, total_steps=6) as tracker:
        for step in range(1, 7):
            tracker.log({"rollout/zero_spread_frac": 1.0, "reward/mean": 0.0}, step)
    out = stream.getvalue()
    assert out.count("warning: no learning signal") == 1
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["health/zero_spread"] for r in records] == [0, 0, 1, 1, 1, 1]
    assert tracker.warnings[0][0] == 3
