"""Plots: demonstrator and SFT levels on the accuracy plot; compare's one figure with curves and memory."""

from __future__ import annotations

import json

from tamer.compare import compare_figure, plot_compare
from tamer.tracking import metrics_figure, plot_metrics, read_baselines, summary_baselines


def test_baselines_from_demo_and_sft_summaries(tmp_path):
    (tmp_path / "sft").mkdir()
    (tmp_path / "summary.json").write_text(json.dumps({"demonstrator_accuracy": 0.772, "sft_accuracy": 0.595,
                                                       "plot": "x.png", "config": {"a": 1}}))
    (tmp_path / "sft" / "summary.json").write_text(json.dumps({"sft_eval/accuracy": 0.5, "sft_eval/mean_length": 20.0,
                                                               "demonstrator_accuracy": 0.7}))
    assert read_baselines(tmp_path) == {"eval/accuracy": {"demonstrator": 0.772, "SFT": 0.595},
                                        "eval/mean_length": {"SFT": 20.0}}  # the demo's own SFT figure wins
    assert read_baselines(tmp_path, demo=False) == {"eval/accuracy": {"demonstrator": 0.7, "SFT": 0.5},
                                                    "eval/mean_length": {"SFT": 20.0}}
    agent = {"demonstrator": {"success_rate": 1.0, "mean_cost_ratio": None}, "sft": {"success_rate": 0.8}}
    assert summary_baselines(agent) == {"eval/success_rate": {"demonstrator": 1.0, "SFT": 0.8}}


def test_accuracy_plot_draws_the_levels(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 0, "time": 0, "eval/accuracy": 0.6}, {"step": 1, "time": 1, "reward/mean": 0.5},
        {"step": 2, "time": 2, "reward/mean": 0.7, "eval/accuracy": 0.9}]))
    baselines = {"eval/accuracy": {"demonstrator": 0.77, "SFT": 0.6}}
    fig = metrics_figure(metrics, ("reward/mean", "eval/accuracy"), baselines=baselines)
    reward_ax, acc_ax = fig.axes
    assert [line.get_label() for line in acc_ax.get_lines()] == ["this run", "demonstrator 0.77", "SFT 0.6"]
    assert list(acc_ax.get_lines()[1].get_ydata()) == [0.77, 0.77]
    assert len(reward_ax.get_lines()) == 1  # no levels where none are given
    assert plot_metrics(metrics, tmp_path / "p.png", baselines=baselines).stat().st_size > 0


def _rows():
    def rl(offset):
        return {"reward_curve": [[1, 0.5 + offset], [2, 0.6 + offset]], "accuracy_curve": [[0, 0.6], [2, 0.7 + offset]]}

    common = {"baseline_rss_mb": 335.0, "heldout_accuracy": 0.6}
    return {"sft": {**common, "peak_rss_mb": 1641.0, "seconds": 699.0},
            "grpo": {**common, "peak_rss_mb": 1102.0, "seconds": 104.0, **rl(0.1)},
            "ppo": {**common, "peak_rss_mb": 1527.0, "seconds": 222.0, **rl(0.0)}}


def test_compare_figure_has_every_methods_curves_and_memory(tmp_path):
    fig = compare_figure(_rows(), "GRPO vs PPO")
    reward_ax, acc_ax, mem_ax, sec_ax = fig.axes
    assert [line.get_label() for line in reward_ax.get_lines()] == ["GRPO", "PPO"]
    assert [line.get_label() for line in acc_ax.get_lines()] == ["GRPO", "PPO", "SFT 0.600"]
    assert [p.get_height() for p in mem_ax.patches] == [1641.0, 1102.0, 1527.0]
    assert [t.get_text() for t in mem_ax.get_xticklabels()] == ["SFT", "GRPO", "PPO"]
    assert mem_ax.get_lines()[0].get_ydata()[0] == 335.0  # the interpreter + torch baseline
    assert [p.get_height() for p in sec_ax.patches] == [699.0, 104.0, 222.0]
    assert plot_compare(_rows(), tmp_path / "c.png", "t").stat().st_size > 0
