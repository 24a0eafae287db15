"""Config tier: one load path for YAML + overrides; every bad value names its full field path.

Covers: nested paths in every section, every registry-backed name, override semantics
(sections merge, a mapping given whole replaces, a dotted key sets one entry), dataset paths
relative to the YAML file, plugins, presets, and `config show` (help per field, loads back).
"""

import dataclasses
import textwrap

import pytest
import yaml
from typer.testing import CliRunner

from tamer.cli import app
from tamer.config import ConfigError, apply_override, describe, field_help, load_config, parse_override
from tamer.pipeline import RunConfig
from tamer.presets import preset_names, preset_path

runner = CliRunner()


def test_defaults_file_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rl:\n  steps: 7\n  algorithm:\n    advantage: rloo\ntask:\n  arithmetic:\n    operations: '+-'\n")
    cfg = load_config(RunConfig, path, ["rl.optim.lr=3e-5", "rl.algorithm.dual_clip_c=3", "eval.size=10"])
    assert cfg.rl.steps == 7 and cfg.rl.algorithm.advantage == "rloo" and cfg.rl.optim.lr == 3e-5
    assert cfg.rl.algorithm.dual_clip_c == 3.0 and cfg.eval.size == 10 and cfg.task.arithmetic.operations == "+-"


# One bad value per section, nested as deep as the sections go: the message names the full path.
@pytest.mark.parametrize("override, message", [
    ("output_dir=[1, 2]", "output_dir: expected a string"),
    ("model.dtype=float8", "model.dtype: unknown dtype 'float8'"),
    ("model.threads=-1", "model.threads: expected >= 0"),
    ("model.tiny.num_heads=3", "model.tiny.hidden_size: 128 is not divisible by num_heads"),
    ("model.tiny.arch=gpt2", "model.tiny.arch: unknown architecture 'gpt2'"),
    ("task.name=nope", "task.name: unknown task 'nope'"),
    ("task.arithmetic.digits=9", "task.arithmetic.digits: expected 1..3"),
    ("task.calculator.train_size=0", "task.calculator.train_size: expected at least 1"),
    ("task.code.timeout_s=0", "task.code.timeout_s: expected a positive number"),
    ("task.trip_planner.demo_waste_rate=2", "task.trip_planner.demo_waste_rate: expected a probability"),
    ("task.trip_planner.world.window=1", "task.trip_planner.world.window: expected at least 2"),
    ("task.dataset.heldout_fraction=1.5", "task.dataset.heldout_fraction: expected a fraction"),
    ("reward.default_on_error=x", "reward.default_on_error: expected a number"),
    ("sft.batch_size=0", "sft.batch_size: expected >= 1"),
    ("sft.optim.schedule=step", "sft.optim.schedule: unknown schedule 'step'"),
    ("rl.optim.lr=fast", "rl.optim.lr: expected a number"),
    ("rl.optim.lr=-1", "rl.optim.lr: expected > 0"),
    ("rl.steps=1.5", "rl.steps: expected an integer"),
    ("rl.stepz=3", "rl.stepz: unknown field"),
    ("rl.temperature=0", "rl.temperature: expected > 0"),
    ("rl.algorithm.dual_clip_c=0.5", "rl.algorithm.dual_clip_c: expected > 1"),
    ("rl.critic.lam=2", "rl.critic.lam: expected a value in [0, 1]"),
    ("rl.critic.optim.lr=0", "rl.critic.optim.lr: expected > 0"),
    ("rl.critic.kl_in_reward=0.1", "rl.critic.kl_in_reward: only PPO's critic"),
    ("eval.pass_n=2", None),  # fine alone: pass_k is 0
    ("eval.temperature=0", "eval.temperature: expected > 0"),
    ("agent.max_turns=0", "agent.max_turns: expected >= 1"),
    ("tracking.console=maybe", "tracking.console: expected true or false"),
    ("tracking.console_every=0", "tracking.console_every: expected >= 1"),
])
def test_bad_values_name_the_full_path(override, message):
    if message is None:
        load_config(RunConfig, None, [override])
        return
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, [override])
    assert str(err.value).startswith(message), str(err.value)


# Every name that refers to a registry is checked at load, with the valid names listed.
@pytest.mark.parametrize("override, message, valid", [
    ("task.name=arithmetc", "task.name: unknown task 'arithmetc'", "arithmetic"),
    ("reward.weights.corectness=1", "reward.weights: unknown reward 'corectness'", "correctness"),
    ("reward.weights={nope: 1.0}", "reward.weights: unknown reward 'nope'", "format"),
    ("reward.params.nope={x: 1}", "reward.params.nope: no such function in reward.weights", None),
    ("rl.algorithm.advantage=ppo2", "rl.algorithm.advantage: unknown advantage estimator 'ppo2'", "gae"),
    ("rl.algorithm.policy_loss=trpo", "rl.algorithm.policy_loss: unknown policy loss 'trpo'", "gspo"),
    ("rl.algorithm.aggregation=mean", "rl.algorithm.aggregation: unknown aggregation 'mean'", "token-mean"),
    ("rl.algorithm.kl_estimator=k4", "rl.algorithm.kl_estimator: unknown KL estimator 'k4'", "k3"),
    ("rl.algorithm.dynamic_sampling=on", "rl.algorithm.dynamic_sampling: unknown dynamic sampling mode 'on'", "refill"),
])
def test_registry_names_are_checked_at_load(override, message, valid):
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, [override])
    assert str(err.value).startswith(message), str(err.value)
    if valid:
        assert valid in str(err.value).split("valid:")[1]


def test_tool_parser_and_environment_registries_are_checked():
    from tamer.config import from_dict
    from tamer.tasks.env import ENVIRONMENTS
    from tamer.tasks.tool_env import ToolEnvConfig

    with pytest.raises(ConfigError, match="env.parser: unknown tool-call format .xml.; valid: hermes"):
        from_dict(ToolEnvConfig, {"parser": "xml"}, "env")
    assert {"calculator", "trip_planner", "python"} <= set(ENVIRONMENTS.names())


def test_cli_misspelled_reward_fails_before_any_work(tmp_path):
    result = runner.invoke(app, ["demo", "--set", "reward.weights.corectness=1", "-o", str(tmp_path)])
    assert result.exit_code == 2
    assert "error: reward.weights: unknown reward 'corectness'; valid: " in result.output
    assert {"correctness", "format", "cost"} <= set(result.output.split("valid: ")[1].strip().split(", "))
    assert "Traceback" not in result.output and not (tmp_path / "sft").exists()


def test_setting_one_field_keeps_the_root_defaults_of_its_section():
    """`rl.steps=5` must not reset rl.optim.lr to RLConfig's class default."""
    base = RunConfig()
    cfg = load_config(RunConfig, overrides=["rl.steps=5", "sft.batch_size=4"])
    assert cfg.rl.steps == 5 and cfg.rl.optim == base.rl.optim and cfg.rl.eval_every == base.rl.eval_every
    assert cfg.sft.batch_size == 4 and cfg.sft.optim == base.sft.optim and cfg.sft.steps == base.sft.steps


def test_a_mapping_given_whole_replaces_a_dotted_key_sets_one_entry(tmp_path):
    assert load_config(RunConfig, overrides=["reward.weights={format: 1.0}"]).reward.weights == {"format": 1.0}
    merged = load_config(RunConfig, overrides=["reward.weights.length=0.5"]).reward.weights
    assert merged == {"correctness": 1.0, "format": 0.1, "length": 0.5}
    # The same in files: a preset's mapping is replaced whole by a later file's.
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("reward: {weights: {correctness: 1.0, steps: 1.0}, params: {steps: {per_call: 0.1}}}\n")
    second.write_text("reward: {weights: {steps: 2.0}}\n")
    cfg = load_config(RunConfig, [first, second])
    assert cfg.reward.weights == {"steps": 2.0} and cfg.reward.params == {"steps": {"per_call": 0.1}}
    cfg = load_config(RunConfig, [first], ["reward.params.steps.free_calls=4"])
    assert cfg.reward.params == {"steps": {"per_call": 0.1, "free_calls": 4}}


def test_override_parsing_and_errors():
    assert parse_override("a.b.c=1") == (["a", "b", "c"], 1)
    assert parse_override("a={x: 1}") == (["a"], {"x": 1})
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("novalue")
    with pytest.raises(ConfigError, match="rl.steps: not a section or a mapping"):
        apply_override(RunConfig, dataclasses.asdict(RunConfig()), ["rl", "steps", "x"], 1)


def test_dataset_paths_resolve_against_the_yaml_file(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "rows.jsonl").write_text('{"prompt": "p", "answer": "a"}\n')
    config = tmp_path / "data" / "run.yaml"
    config.write_text("task: {name: dataset, dataset: {path: rows.jsonl}}\n")
    monkeypatch.chdir(tmp_path)  # not the YAML's folder
    cfg = load_config(RunConfig, [config])
    assert cfg.task.dataset.path == str(tmp_path / "data" / "rows.jsonl")
    # On the command line a path stays as typed (relative to where the command runs).
    assert load_config(RunConfig, [config], ["task.dataset.path=x.jsonl"]).task.dataset.path == "x.jsonl"
    code = tmp_path / "code.yaml"
    code.write_text("task: {code: {source: builtin}}\n")
    assert load_config(RunConfig, [code]).task.code.source == "builtin"  # a keyword, not a path


def test_dataset_task_without_a_path_fails_at_load():
    with pytest.raises(ConfigError, match="task.dataset.path: give the path"):
        load_config(RunConfig, overrides=["task.name=dataset"])


def test_bad_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rl: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(RunConfig, path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(RunConfig, tmp_path / "missing.yaml")
    path.write_text("rl:\n  optim: {lr: fast}\n")
    with pytest.raises(ConfigError, match="rl.optim.lr: expected a number"):
        load_config(RunConfig, path)


def test_plugins_register_names_before_the_check(tmp_path, monkeypatch):
    plugin = tmp_path / "my_rewards.py"
    plugin.write_text(textwrap.dedent('''
        from tamer.rewards import REWARDS

        @REWARDS.register("plugin_reward")
        def plugin_reward(traj):
            return 1.0
    '''))
    with pytest.raises(ConfigError, match="unknown reward 'plugin_reward'"):
        load_config(RunConfig, overrides=["reward.weights={plugin_reward: 1.0}"])
    cfg = load_config(RunConfig, overrides=["reward.weights={plugin_reward: 1.0}"], plugins=[str(plugin)])
    assert cfg.plugins == (str(plugin),)
    (tmp_path / "more_rewards.py").write_text(plugin.read_text().replace("plugin_reward", "module_reward"))
    monkeypatch.chdir(tmp_path)  # a module name is imported from the current directory, as python -m does
    cfg = load_config(RunConfig, overrides=["plugins=[more_rewards]", "reward.weights={module_reward: 1.0}"])
    assert cfg.reward.weights == {"module_reward": 1.0}
    with pytest.raises(ConfigError, match="plugins: cannot import 'no_such_module'"):
        load_config(RunConfig, plugins=["no_such_module"])


def test_every_field_has_help_and_config_show_loads_back(tmp_path):
    def check(cls, path):
        helps = field_help(cls)
        for f in dataclasses.fields(cls):
            assert f.name in helps, f"{path}{f.name} has no help comment"
            if dataclasses.is_dataclass(f.type) or (isinstance(f.type, str) and f.type.endswith("Config")):
                check(type(getattr(cls(), f.name)), f"{path}{f.name}.")
    check(RunConfig, "")
    shown = "\n".join(describe(load_config(RunConfig, overrides=["rl.steps=3", "reward.weights.length=0.5"])))
    assert "  lr: 0.0001  # peak learning rate (after warmup)" in shown
    (tmp_path / "shown.yaml").write_text(shown)
    assert load_config(RunConfig, [tmp_path / "shown.yaml"]) == load_config(
        RunConfig, overrides=["rl.steps=3", "reward.weights.length=0.5"])


def test_presets_load_and_are_listed():
    assert {"demo-arithmetic", "demo-calculator", "demo-trip_planner", "compare"} <= set(preset_names())
    for name in preset_names():
        load_config(RunConfig, [preset_path(name)])  # every preset is a valid config
        assert preset_path(name).read_text().startswith("# ")  # and says what it is for
    result = runner.invoke(app, ["config", "list"])
    assert result.exit_code == 0 and "demo-calculator" in result.output
    shown = runner.invoke(app, ["config", "show", "-c", "demo-calculator", "--set", "rl.steps=3"])
    assert shown.exit_code == 0, shown.output
    data = yaml.safe_load(shown.output)
    assert data["task"]["name"] == "calculator" and data["rl"]["steps"] == 3


def test_cli_warnings_for_untrained_start_and_default_task(tmp_path):
    result = runner.invoke(app, ["train", "--set", "rl.steps=zero", "-o", str(tmp_path)])
    assert result.exit_code == 2 and "rl.steps: expected an integer" in result.output
    result = runner.invoke(app, ["eval", "--model", str(tmp_path / "none")])
    assert "warning: no --config: evaluating on the default task 'arithmetic'" in result.output
    assert result.exit_code == 2 and "no such model directory" in result.output
