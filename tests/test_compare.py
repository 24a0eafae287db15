"""`tamer compare`: config layering, memory readings, the RL phase, and one tiny end-to-end run.

The end-to-end run checks structure only (keys, files, finite numbers); the memory claim
(GRPO's peak <= 0.75 x PPO's) needs compare's default 35.6M-parameter model and is
measured in docs/compare_and_advise.md.
"""

import json
import math

import pytest
import torch
import yaml
from typer.testing import CliRunner

from tamer.cli import app, load_run_config
from tamer.compare import METHODS, method_config
from tamer.config import read_yaml
from tamer.memory import current_rss_mb, peak_rss_mb
from tamer.phases import _phase_rl
from tamer.pipeline import build_policy
from tamer.presets import preset_path

TINY = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.num_heads=4", "model.tiny.num_kv_heads=2",
        "model.tiny.intermediate_size=64", "model.threads=1", "task.arithmetic.heldout_size=8", "eval.size=8",
        "eval.max_new_tokens=8", "sft.steps=4", "sft.batch_size=4", "rl.steps=2", "rl.prompts_per_step=2",
        "rl.group_size=4", "rl.max_new_tokens=8", "rl.eval_every=1"]


def test_config_layers_preset_then_file_then_set(tmp_path):
    preset = read_yaml(preset_path("compare"))
    hidden = preset["model"]["tiny"]["hidden_size"]
    cfg = load_run_config(preset="compare")
    assert cfg.output_dir == "runs/compare" and cfg.model.tiny.hidden_size == hidden and not cfg.tracking.tensorboard
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"rl": {"steps": 7, "group_size": 4}, "model": {"tiny": {"num_layers": 1}}}))
    cfg = load_run_config([str(path)], ["rl.steps=9"], seed=3, output_dir=str(tmp_path / "out"), preset="compare")
    assert (cfg.rl.steps, cfg.rl.group_size, cfg.model.tiny.num_layers) == (9, 4, 1)  # --set > file > preset
    assert cfg.model.tiny.hidden_size == hidden and cfg.rl.seed == 3 and cfg.output_dir == str(tmp_path / "out")
    assert cfg.rl.optim.lr == preset["rl"]["optim"]["lr"] and cfg.rl.generation_batch == 64


def test_method_config_starts_from_the_sft_model():
    cfg = load_run_config(["compare"], ["rl.algorithm.kl_coef=0.1"])
    for method, advantage in METHODS.items():
        m = method_config(cfg, method, "runs/x/sft/model")
        assert m.model.path == "runs/x/sft/model" and m.rl.algorithm.advantage == advantage
        assert m.output_dir.endswith(method) and m.rl.algorithm.kl_coef == 0.1 and m.rl.steps == cfg.rl.steps


def test_memory_is_read_from_the_process():
    before = current_rss_mb()
    block = torch.ones(64 * 1024 * 1024 // 4)  # 64 MB, written, so resident
    after = current_rss_mb()
    assert after - before > 48 and peak_rss_mb() >= after
    del block


@pytest.mark.parametrize("method, models, copies", [("grpo", 1, 1), ("ppo", 2, 2)])
def test_rl_phase_counts_models_and_trainable_parameters(tmp_path, method, models, copies):
    cfg = load_run_config(["compare"], TINY, output_dir=str(tmp_path))
    cfg = method_config(cfg, method, "")  # "" builds model.tiny: no SFT needed for the counts
    result = _phase_rl(cfg, measure_steps=1)
    policy = sum(p.numel() for p in build_policy(cfg.model, cfg.task)[0].parameters())
    assert result["models_held"] == models and len(result["step_seconds"]) == 1
    value_head = cfg.model.tiny.hidden_size + 1 if method == "ppo" else 0
    assert result["trainable_parameters"] == copies * policy + value_head  # PPO: a critic as large as the policy


@pytest.mark.slow  # three child Python processes (SFT, GRPO, PPO)
def test_compare_end_to_end_writes_summary_and_plot(tmp_path):
    out = tmp_path / "cmp"
    args = [arg for item in TINY for arg in ("--set", item)]
    result = CliRunner().invoke(app, ["compare", *args, "-o", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "GRPO peak RSS / PPO peak RSS" in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert (out / "compare.png").stat().st_size > 0 and summary["plot"] == str(out / "compare.png")
    assert set(summary["rows"]) == {"sft", "grpo", "ppo"}
    assert summary["budget"]["samples"] == 2 * 2 * 4
    for key, row in summary["rows"].items():
        for field in ("heldout_accuracy", "seconds", "peak_rss_mb", "baseline_rss_mb", "trainable_parameters"):
            assert math.isfinite(row[field]) and row[field] >= 0, (key, field)
        assert row["peak_rss_mb"] >= row["baseline_rss_mb"] > 0
    assert summary["rows"]["grpo"]["models_held"] == 1 and summary["rows"]["ppo"]["models_held"] == 2
    for method in METHODS:
        assert [s for s, _ in summary["rows"][method]["reward_curve"]] == [1, 2]
        assert [s for s, _ in summary["rows"][method]["accuracy_curve"]] == [0, 1, 2]
    assert (out / "sft" / "model" / "config.json").is_file()  # both RL runs started from it
    assert summary["config"]["rl"]["steps"] == 2 and math.isfinite(summary["grpo_over_ppo_peak_rss"])


def test_bad_override_is_one_clear_error(tmp_path):
    result = CliRunner().invoke(app, ["compare", "--set", "rl.steps=zero", "-o", str(tmp_path)])
    assert result.exit_code == 2 and "rl.steps" in result.output
