"""Config tier: YAML + overrides onto the dataclasses; bad values name their field."""

import pytest

from tamer.config import ConfigError, load_config, parse_overrides
from tamer.pipeline import RunConfig


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rl:\n  steps: 7\n  algorithm:\n    advantage: rloo\ntask:\n  arithmetic:\n    operations: '+-'\n")
    cfg = load_config(RunConfig, path, ["rl.optim.lr=3e-5", "rl.algorithm.dual_clip_c=3", "eval.size=10"])
    assert cfg.rl.steps == 7 and cfg.rl.algorithm.advantage == "rloo" and cfg.rl.optim.lr == 3e-5
    assert cfg.rl.algorithm.dual_clip_c == 3.0 and cfg.eval.size == 10 and cfg.task.arithmetic.operations == "+-"


@pytest.mark.parametrize("override, message", [
    ("rl.optim.lr=fast", "rl.optim.lr: expected a number"),
    ("rl.steps=1.5", "rl.steps: expected an integer"),
    ("rl.stepz=3", "rl.stepz: unknown field"),
    ("rl.algorithm.advantage=ppo2", "rl.algorithm.advantage: unknown 'ppo2'"),
    ("rl.temperature=0", "rl.temperature: expected > 0"),
    ("task.name=nope", "task.name: unknown task 'nope'"),
    ("model.dtype=float8", "model.dtype: expected one of"),
    ("sft.batch_size=0", "sft.batch_size: expected >= 1"),
    ("tracking.console=maybe", "tracking.console: expected true or false"),
])
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(RunConfig, None, [override])


def test_bad_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rl: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(RunConfig, path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(RunConfig, tmp_path / "missing.yaml")


def test_parse_overrides_nests():
    assert parse_overrides(["a.b.c=1", "a.d=x"]) == {"a": {"b": {"c": 1}, "d": "x"}}
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["novalue"])


def test_setting_one_field_keeps_the_root_defaults_of_its_section():
    """`rl.steps=5` must not reset rl.optim.lr to RLConfig's class default."""
    from tamer.pipeline import RunConfig

    base = RunConfig()
    cfg = load_config(RunConfig, overrides=["rl.steps=5", "sft.batch_size=4"])
    assert cfg.rl.steps == 5 and cfg.rl.optim == base.rl.optim and cfg.rl.eval_every == base.rl.eval_every
    assert cfg.sft.batch_size == 4 and cfg.sft.optim == base.sft.optim and cfg.sft.steps == base.sft.steps


def test_mapping_fields_are_replaced_not_merged_with_defaults():
    cfg = load_config(RunConfig, overrides=["reward.weights={mine: 1.0}"])
    assert cfg.reward.weights == {"mine": 1.0}
